"""mutmut over the engine's modules, each against the tests that drive it.

``python -m tests.mutmut_engine`` copies the checkout into a work directory, gives the
copy a ``[tool.mutmut]`` section (the module to mutate, the tests that drive it) and
runs ``mutmut run`` there, one module after the other, then prints each module's
counts and every surviving mutant's diff, and at the end one line
``mutmut: killed=K of N (survived S, no tests T)``: a mutant that timed out counts
as killed (it hung the engine), one that no selected test reaches counts as not
killed. It exits 0 when it ran; the survivors are read, not asserted (docs/contributing/testing.md
says what each one is).

    python -m tests.mutmut_engine                     # settle.py, lease_keeper.py, runner.py
    python -m tests.mutmut_engine --module settle     # one module (repeat for more)
    python -m tests.mutmut_engine --workdir /tmp/mm   # keep the copy (mutmut show, browse)

The selections run under asyncio on Valkey alone (``-k "asyncio and valkey"``): the
engine's code is the same under both event loops and on both servers, and a survivor
reruns every selected test that reaches its function, so the quick matrix would make
a run four times as long. mutmut runs each test in the process it forks (``-n 0``):
a test that starts instances as subprocesses (test_takeover) runs the unmutated
engine there and is left out. The engine machine (``property_tests``) is left out too:
minutes per run; ``python -m tests.mutants --engine --machine`` runs it against the
hand-written engine mutants.

Needs ``pip install mutmut`` (3.x; not a dependency of the project or its tests).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Tests of the results the store records and of retries, on one event loop and
#: server these take about 16 s: they see what settle sends and what the runner
#: reports (the fields the claim-only strategies record, the error, the retry delay).
RESULTS = (
    "tests/test_strategies.py",
    "tests/test_lease_rules.py::test_a_handler_failing_twice_then_succeeding_runs_three_attempts_with_the_delays",
    "tests/test_lease_rules.py::test_with_max_attempts_two_a_failing_run_ends_failed",
    "tests/test_lease_rules.py::test_run_now_runs_here_as_a_manual_run_recorded_in_history",
    "tests/test_lease_rules.py::test_a_skipped_slot_is_recorded_in_history_once_with_its_reason_and_a_warning",
    "tests/test_lease_rules.py::test_fences_of_successive_wins_strictly_increase",
)  # fmt: skip
#: Each engine module and the tests that drive it.
SELECTIONS: dict[str, tuple[str, ...]] = {
    "settle": (
        "tests/test_dead_runs_settle.py",
        "tests/test_engine_faults.py",
        "tests/test_leases.py",
        *RESULTS,
    ),
    "lease_keeper": (
        "tests/test_lease_keeper.py",
        "tests/test_engine_faults.py",
        "tests/test_leases.py",
    ),
    "runner": (
        "tests/test_leases.py",
        "tests/test_engine_faults.py",
        *RESULTS,
    ),
    "claimer": (
        "tests/test_claimer.py",
        "tests/test_engine_faults.py",
        "tests/test_dead_runs_settle.py",
        "tests/test_batching.py",
        *RESULTS,
    ),
    "agenda": (
        "tests/test_agenda.py",
        "tests/test_engine_faults.py",
        *RESULTS,
    ),
    "hints": (
        "tests/test_timers.py::test_a_timer_set_by_another_process_sooner_than_the_next_poll_fires_through_a_hint",
        "tests/test_timer_faults.py::test_timer_hints_come_back_after_the_connection_is_cut",
        "tests/test_hints.py",
    ),
    "work": (
        "tests/test_engine_faults.py",
        "tests/test_leases.py",
        "tests/test_claimer.py",
        "tests/test_agenda.py",
        "tests/test_lease_keeper.py",
    ),
}  # fmt: skip
DEFAULT_MODULES = ("settle", "lease_keeper", "runner")
#: The statuses mutmut reports, and what each counts as here.
KILLED = ("killed", "timeout")


def copy_checkout(into: Path) -> None:
    """The files git tracks (a clean copy: no caches, no earlier mutmut output)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


#: Which of the selected tests run: one event loop and one server, as the module docstring
#: says; test_agenda.py's tests take no server (their ids hold no "valkey").
KEYWORDS = {
    "agenda": "(asyncio and valkey) or (test_agenda and not trio)",
    "work": "(asyncio and valkey) or (test_agenda and not trio)",
    "hints": "(asyncio and valkey) or (test_hints and not trio and not redis)",
}


def configure(work: Path, module: str) -> None:
    tests = ", ".join(f'"{t}"' for t in SELECTIONS[module])
    keyword = KEYWORDS.get(module, "asyncio and valkey")
    section = f"""

[tool.mutmut]
source_paths = ["src/anarchon/"]
only_mutate = ["src/anarchon/_engine/{module}.py"]
pytest_add_cli_args_test_selection = [{tests}]
pytest_add_cli_args = ["-n", "0", "-p", "no:randomly", "--timeout=120", "-k", "{keyword}"]
also_copy = ["property_tests/", "conftest.py"]
"""
    pyproject = work / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8").split("\n\n[tool.mutmut]")[0]
    pyproject.write_text(text + section, encoding="utf-8")
    shutil.rmtree(work / "mutants", ignore_errors=True)


def results(work: Path) -> dict[str, str]:
    """Each mutant's name and status, as ``mutmut results --all true`` prints them."""
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = {}
    for line in out.splitlines():
        match = re.match(r"\s*(\S+__mutmut_\d+): (.+)$", line)
        if match:
            found[match.group(1)] = match.group(2).strip()
    return found


def show(work: Path, name: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "mutmut", "show", name],
        cwd=work,
        capture_output=True,
        text=True,
    ).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutmut_engine", description=__doc__)
    parser.add_argument("--module", action="append", choices=sorted(SELECTIONS))
    parser.add_argument("--workdir", type=Path, help="where the copy goes (kept)")
    parser.add_argument("--children", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args(argv)
    if shutil.which("mutmut") is None:
        parser.error("mutmut is not installed: pip install mutmut")
    modules = args.module or list(DEFAULT_MODULES)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="anarchon-mutmut-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    copy_checkout(work)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "ANARCHON_FULL_MATRIX")}
    total: Counter[str] = Counter()
    for module in modules:
        configure(work, module)
        print(f"mutmut: {module}.py against {' '.join(SELECTIONS[module])}", flush=True)
        subprocess.run(
            ["nice", "mutmut", "run", "--max-children", str(args.children)],
            cwd=work,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        statuses = results(work)
        counts = Counter(statuses.values())
        total.update(counts)
        print(f"  {module}.py: {len(statuses)} mutants: " + ", ".join(
            f"{status} {n}" for status, n in counts.most_common()
        ), flush=True)  # fmt: skip
        for name, status in statuses.items():
            if status not in KILLED:
                print(f"{status}: {name}\n{show(work, name)}", end="\n\n", flush=True)
    killed = sum(total[s] for s in KILLED)
    print(
        f"mutmut: killed={killed} of {sum(total.values())} "
        f"(survived {total['survived']}, no tests {total['no tests']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
