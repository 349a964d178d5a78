"""The documentation says only what is true of the package: every Python block of the
README and the site either runs against a real server or says why it is a fragment;
every ``anarchon`` name it mentions exists; the README reads the same on a package
index page as in the repository (no relative links)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")],
    key=lambda path: str(path),
)
PAGES = [page for page in PAGES if page.exists()]

#: The line before a block that is not run, with the reason why.
_FRAGMENT = re.compile(r"<!-- fragment: (.+?) -->")
#: The line before a block that is a file of ``examples/`` written out (where snippets
#: cannot be included: the README); the file's own test runs it.
_SAME_AS = re.compile(r"<!-- same as: (\S+) -->")
_FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)
#: Where the docs' examples expect a server; the test gives them its own.
_LOCAL = "redis://localhost:6379"
#: The database the runnable blocks use (flushed before each): the other tests use 0.
_DOCS_DB = 7


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    code: str
    fragment: str | None
    same_as: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def included(self) -> bool:
        return self.code.lstrip().startswith("--8<--") or self.same_as is not None


def _blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in _FENCE.finditer(text):
            if match["lang"] not in ("python", "py"):
                continue
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
            fragment = _FRAGMENT.fullmatch(before.strip())
            same_as = _SAME_AS.fullmatch(before.strip())
            rows = match["body"].splitlines(keepends=True)
            body = "".join(row[len(match["indent"]) :] for row in rows)
            found.append(
                Block(
                    page,
                    line,
                    body,
                    fragment[1] if fragment else None,
                    same_as[1] if same_as else None,
                )
            )
    return found


BLOCKS = _blocks()
RUNNABLE = [block for block in BLOCKS if block.fragment is None and not block.included]


def test_the_pages_hold_python_blocks_to_check() -> None:
    assert len(BLOCKS) > 20
    assert RUNNABLE, "no block runs: the test below would check nothing"


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_every_block_compiles_and_every_fragment_says_why(block: Block) -> None:
    if block.same_as is not None:
        written = (ROOT / block.same_as).read_text()
        assert block.code == written, f"{block.id} differs from {block.same_as}"
        return
    if block.included:
        target = block.code.strip().split('"')[1]
        assert (ROOT / target).is_file(), f"{block.id} includes {target}, which is missing"
        return
    if block.fragment is not None:
        assert len(block.fragment.split()) >= 2, f"{block.id}: say why it is a fragment"
    compile(block.code, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.engine_tier
@pytest.mark.slow("every runnable block of the docs, one after another, each a process")
def test_every_block_that_is_not_a_fragment_runs(server_url: str, tmp_path: Path) -> None:
    """Each runs as a script, as a reader would paste it, with the docs' local server
    replaced by the test's; it must end by itself, with exit 0."""
    url = server_url.rstrip("/") + f"/{_DOCS_DB}"
    direct = redis.Redis.from_url(url)
    env = dict(os.environ, REDIS_URL=url, PYTHONPATH=str(ROOT))
    env.pop("ANARCHON_PREFIX", None)
    failures = []
    try:
        for index, block in enumerate(RUNNABLE):
            direct.flushdb()
            script = tmp_path / f"block_{index}.py"
            script.write_text(block.code.replace(_LOCAL, url))
            try:
                done = subprocess.run(
                    [sys.executable, str(script)],
                    env=env,
                    cwd=tmp_path,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
            except subprocess.TimeoutExpired:
                failures.append(f"{block.id}: still running after 60 s")
                continue
            if done.returncode != 0:
                failures.append(f"{block.id}: exit {done.returncode}\n{done.stderr[-2000:]}")
    finally:
        direct.flushdb()
        direct.close()
    assert not failures, "\n\n".join(failures)


#: ``anarchon.name`` or ``anarchon.module.name`` in prose or code (not a file name).
_DOTTED = re.compile(r"(?<![\w./-])anarchon(?:\.[A-Za-z_]\w*)+(?![\w-]*\.(?:service|py|md))")
_FILE_ENDINGS = (".service", ".env", ".py", ".md", ".yaml", ".yml", ".json", ".toml", ".log")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(value, name):
                return False
            value = getattr(value, name)
        return True
    return False


def _mentioned_names() -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in _DOTTED.finditer(line):
                name = match.group(0)
                if not name.endswith(_FILE_ENDINGS):
                    names.setdefault(name, []).append(f"{page.relative_to(ROOT)}:{number}")
    for block in BLOCKS:
        if block.included:
            continue
        tree = ast.parse(block.code)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("anarchon"):
                for alias in node.names:
                    names.setdefault(f"{node.module}.{alias.name}", []).append(block.id)
    return names


def _span_attributes() -> set[str]:
    """The spans' attribute names (``anarchon.job``, ...): names of the traces, not of the
    package, read from the code that sets them."""
    source = (ROOT / "src" / "anarchon" / "otel.py").read_text()
    return set(re.findall(r'"(anarchon\.[a-z_]+)"', source))


def test_every_anarchon_name_the_docs_mention_exists() -> None:
    names = _mentioned_names()
    assert "anarchon.Scheduler" in names  # the scan finds names at all
    attributes = _span_attributes()
    assert "anarchon.fence" in attributes
    missing = {
        name: where
        for name, where in names.items()
        if name not in attributes and not _resolves(name)
    }
    assert not missing, missing


def test_the_scan_of_names_would_catch_one_that_does_not_exist() -> None:
    assert _resolves("anarchon.prometheus.instrument")
    assert not _resolves("anarchon.Scheduler.start")
    assert not _resolves("anarchon.NoSuchThing")


def test_the_readme_has_no_relative_link_or_image() -> None:
    """On a package index page the README stands alone: a link to ``docs/x.md`` or an
    image at ``docs/img/`` would lead nowhere there."""
    text = (ROOT / "README.md").read_text()
    relative = re.findall(r"\]\((?!https?://|#)([^)]+)\)", text)
    relative += re.findall(r"<img[^>]+src=\"(?!https?://)([^\"]+)\"", text)
    assert not relative, relative


@contextmanager
def _started(
    command: list[str], url: str, out: Path, cwd: Path, seen: str
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` started as a reader starts it, with ``REDIS_URL`` (an empty database
    of its own, emptied again after), until its output shows ``seen``; killed at the end
    if it still runs."""
    direct = redis.Redis.from_url(url)
    direct.flushdb()
    env = dict(os.environ, REDIS_URL=url, PYTHONUNBUFFERED="1")
    with open(out, "w") as sink:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while seen not in out.read_text():
            assert process.poll() is None, out.read_text()
            assert time.monotonic() < deadline, f"no {seen!r} within 30 s: " + out.read_text()
            time.sleep(0.05)
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        direct.flushdb()
        direct.close()


@pytest.mark.engine_tier
def test_the_readmes_example_runs_a_slot_within_seconds_and_stops_cleanly_on_ctrl_c(
    server_url: str, tmp_path: Path
) -> None:
    """The first thing a reader runs: a job every five seconds prints its run, and
    Ctrl-C (SIGINT) stops it with exit 0 and no traceback."""
    out = tmp_path / "out.txt"
    command = [sys.executable, str(ROOT / "examples" / "quickstart.py")]
    with _started(command, server_url.rstrip("/") + "/8", out, tmp_path, "hello from") as process:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, out.read_text()
    shown = out.read_text()
    assert "Traceback" not in shown, shown
    assert re.search(r"hello from \S+: slot \d\d:\d\d:\d\d, attempt 1", shown), shown
    assert "SIGINT: stopping" in shown and "stopped" in shown, shown


@pytest.mark.engine_tier
def test_the_getting_started_app_runs_its_jobs_under_anarchon_run_and_stops_on_sigterm(
    server_url: str, tmp_path: Path
) -> None:
    """The guide's app, started as the guide starts it (``anarchon run app:scheduler``,
    from its folder): its every-five-seconds job runs, and SIGTERM stops it with exit 0.
    Its takeover is the suite's own business (tests/test_takeover.py)."""
    out = tmp_path / "out.txt"
    command = [sys.executable, "-m", "anarchon", "run", "getting_started:scheduler"]
    command += ["--instance-id", "a"]
    url = server_url.rstrip("/") + "/9"
    with _started(command, url, out, ROOT / "examples", "tick   slot") as process:
        process.send_signal(signal.SIGTERM)
        # A report may be running (20 s): the second signal stops at once.
        try:
            code = process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=30)
        assert code == 0, out.read_text()
    shown = out.read_text()
    assert "Traceback" not in shown, shown
    assert "instance a stopped" in shown, shown


#: The delivery promise, worded once: the pages, the README, the package's description
#: and the ``Scheduler`` docstring each carry it as it stands here.
PROMISE = (
    "Each attempt of a slot is started by exactly one instance, each slot that starts runs "
    "at least once (a new attempt follows a failure, a stop or a lost lease, while attempts "
    "are left), and a slot that does not start (skipped by the overlap policy, a pause or "
    "lateness) is recorded or logged, never silently lost."
)


def _words(text: str) -> str:
    """Text with its line breaks, Markdown quote marks and emphasis folded away."""
    text = re.sub(r"^\s*>\s?", "", text, flags=re.M)
    return " ".join(text.replace("**", "").split())


def test_the_promise_is_worded_the_same_everywhere_it_is_made() -> None:
    import tomllib

    from anarchon import Scheduler

    places = {
        name: (ROOT / name).read_text()
        for name in (
            "README.md",
            "docs/index.md",
            "docs/getting-started.md",
            "docs/concepts/index.md",
            "docs/concepts/leases.md",
        )
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    places["pyproject.toml description"] = project["description"]
    places["the Scheduler docstring"] = Scheduler.__doc__ or ""
    unworded = [name for name, text in places.items() if PROMISE not in _words(text)]
    assert not unworded, f"the promise is not worded as in tests/test_docs.py in {unworded}"
    assert "each slot runs at least once" not in " ".join(map(_words, places.values())).lower()
