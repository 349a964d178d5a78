"""``anarchon run MODULE:ATTRIBUTE`` as a user runs it (a subprocess, a real server):
graceful and immediate stops on signals, a server that is down at start, health probes,
one-line errors."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import pytest
import redis

from anarchon import ConnectionFailedError, RedisBackend, Scheduler, serve
from anarchon._ops.embedded import free_port
from anarchon._store.keys import RegistryKeys
from tests.faults import FaultProxy
from tests.helpers import hand_over_slot, wait_until
from tests.restartable_server import RestartableServer
from tests.servers import ServerSpec
from tests.test_takeover import wait_for

ROOT = Path(__file__).resolve().parents[1]
LEASE_MS = 30_000

pytestmark = [pytest.mark.slow, pytest.mark.engine_tier]


class RunCommand:
    """One ``anarchon run tests.run_app:make`` (or ``target``) process, its output in a
    file."""

    def __init__(
        self,
        tmp_path: Path,
        name: str,
        env: dict[str, str],
        *args: str,
        target: str = "tests.run_app:make",
    ) -> None:
        self.name = name
        self.health_file = tmp_path / f"{name}.health"
        self.output = tmp_path / f"{name}.log"
        full_env = command_env(env)
        command = [
            sys.executable, "-m", "anarchon", "run", target,
            "--instance-id", name, "--health-file", str(self.health_file), *args,
        ]  # fmt: skip
        with open(self.output, "w") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=full_env, stdin=subprocess.PIPE, stdout=out,
                stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip

    def health(self) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = json.loads(self.health_file.read_text())
        except (FileNotFoundError, ValueError):
            return None
        return found

    def wait_asked_for_slot(self, timeout_sec: float = 30) -> IO[str]:
        """Wait until the app (``APP_ONE_SLOT``) asks for its slot; its stdin."""
        wait_for(lambda: "slot?" in self.log(), timeout_sec, f"{self.name} to ask for its slot")
        assert self.process.stdin is not None
        return self.process.stdin

    def wait_live(self, timeout_sec: float = 30) -> None:
        wait_for(lambda: (self.health() or {}).get("live"), timeout_sec, f"{self.name} to run")

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout_sec: float) -> int:
        try:
            return self.process.wait(timeout_sec)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still runs after {timeout_sec} s:\n{self.log()}"
            ) from None

    def log(self) -> str:
        return self.output.read_text()

    def end(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def command_env(env: dict[str, str]) -> dict[str, str]:
    """This environment, with ``env``, for an ``anarchon`` subprocess that imports this
    checkout (and the tests' modules)."""
    full_env = dict(os.environ)
    paths = [full_env.get("PYTHONPATH", ""), str(ROOT / "src"), str(ROOT)]
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    full_env.update(env)
    return full_env


@pytest.fixture
def commands() -> Iterator[list[RunCommand]]:
    started: list[RunCommand] = []
    yield started
    for command in started:
        command.end()


def app_env(url: str, prefix: str, **settings: object) -> dict[str, str]:
    env = {"APP_URL": url, "APP_PREFIX": prefix, "APP_LEASE_MS": str(LEASE_MS)}
    env.update({f"APP_{name.upper()}": str(value) for name, value in settings.items()})
    return env


def entries(direct: redis.Redis, prefix: str) -> list[list[str]]:
    return [str(e).split("|") for e in direct.lrange(f"{prefix}log", 0, -1)]


def history(url: str, prefix: str) -> list[tuple[int, str, str]]:
    async def read() -> list[tuple[int, str, str]]:
        async with Scheduler(RedisBackend(redis=url, prefix=prefix)) as reader:
            return sorted((r.attempt, r.runner, r.status) for r in await reader.history("work"))

    return anyio.run(read)


@pytest.mark.parametrize("event_loop", ["asyncio", "trio"])
def test_sigterm_mid_run_gives_the_lease_back_and_a_backup_runs_attempt_2_at_once(
    server_url: str, prefix: str, direct: redis.Redis, tmp_path: Path, commands: list[RunCommand],
    event_loop: str,
) -> None:  # fmt: skip
    env = app_env(server_url, prefix, one_slot=1)
    for name in ("one", "two"):
        commands.append(RunCommand(tmp_path, name, env, "--event-loop", event_loop))
    hand_over_slot([command.wait_asked_for_slot() for command in commands])
    for command in commands:
        command.wait_live()
    first = wait_for(lambda: entries(direct, prefix), 20, "attempt 1 to start")[0]
    assert first[0] == "start" and first[2] == "1", first
    runner = next(c for c in commands if c.name == first[1])
    backup = next(c for c in commands if c is not runner)
    seconds, micros = direct.time()
    signalled_ms = seconds * 1000 + micros // 1000
    runner.signal(signal.SIGTERM)
    assert runner.wait(20) == 0, runner.log()

    second = wait_for(
        lambda: [e for e in entries(direct, prefix) if e[0] == "start" and e[2] == "2"],
        LEASE_MS / 1000,
        "attempt 2 to start",
    )[0]
    assert second[1] == backup.name
    assert int(second[3]) > int(first[3]), (first, second)  # a higher fence
    # Given back, not expired: the backup began long before the lease would have run out.
    assert int(second[4]) - signalled_ms < LEASE_MS / 2, (signalled_ms, second)
    assert "SIGTERM: stopping" in runner.log()
    assert "Traceback" not in runner.log()
    backup.signal(signal.SIGTERM)
    assert backup.wait(20) == 0, backup.log()
    assert history(server_url, prefix) == [
        (1, runner.name, "cancelled"),
        (2, backup.name, "cancelled"),
    ]


def test_a_second_sigterm_stops_at_once_without_waiting_out_the_grace_period(
    server_url: str, prefix: str, direct: redis.Redis, tmp_path: Path, commands: list[RunCommand]
) -> None:
    env = app_env(server_url, prefix, one_slot=1, stop_grace_ms=120_000)
    command = RunCommand(tmp_path, "one", env)
    commands.append(command)
    hand_over_slot([command.wait_asked_for_slot()])
    command.wait_live()
    wait_for(lambda: entries(direct, prefix), 20, "the run to start")
    command.signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM: stopping" in command.log(), 10, "the first SIGTERM to be heard")
    time.sleep(0.5)
    assert command.process.poll() is None, "it stopped before its grace period ended"
    command.signal(signal.SIGTERM)
    assert command.wait(20) == 0, command.log()
    assert "SIGTERM again: stopping at once" in command.log()
    assert history(server_url, prefix) == [(1, "one", "cancelled")]
    assert [e[0] for e in entries(direct, prefix)] == ["start"]


def test_a_server_down_at_start_is_waited_for_and_then_the_jobs_run(
    server: ServerSpec, prefix: str, tmp_path: Path, commands: list[RunCommand]
) -> None:
    late = RestartableServer(server.binary, tmp_path, appendonly=False)
    late.port = free_port()
    command = RunCommand(tmp_path, "one", app_env(late.url, prefix, work_sec=0))
    commands.append(command)
    try:
        wait_for(lambda: "waiting for the server" in command.log(), 20, "it to say it waits")
        assert command.process.poll() is None, command.log()
        late.start()
        command.wait_live()
        direct = redis.Redis.from_url(late.url, decode_responses=True, protocol=2)
        wait_for(lambda: len(entries(direct, prefix)) >= 2, 20, "the job to run")
        direct.close()
        command.signal(signal.SIGTERM)
        assert command.wait(20) == 0, command.log()
        log = command.log()
        assert log.count("waiting for the server") == 1, log
        assert "the server answers, after" in log
    finally:
        late.kill()


def test_a_server_that_never_answers_ends_it_with_one_line_and_exit_1(
    prefix: str, tmp_path: Path
) -> None:
    env = app_env(f"redis://127.0.0.1:{free_port()}", prefix)
    for wait, lines in (("0", 1), ("1.5", 2)):
        command = RunCommand(tmp_path, "one", env, "--wait-for-server", wait)
        assert command.wait(30) == 1, command.log()
        out = command.log().strip().splitlines()
        assert len(out) == lines, out  # with a wait: the WARNING that it waits, then the error
        assert (
            out[-1].startswith("anarchon: ANARCHON_CONNECTION: ") and "--wait-for-server" in out[-1]
        ), out
        assert ("waited" in out[-1]) == (wait != "0"), out


def test_a_signal_while_it_waits_for_the_server_ends_it_at_once(
    prefix: str, tmp_path: Path
) -> None:
    env = app_env(f"redis://127.0.0.1:{free_port()}", prefix)
    command = RunCommand(tmp_path, "one", env, "--wait-for-server", "600")
    wait_for(lambda: "waiting for the server" in command.log(), 20, "it to say it waits")
    command.signal(signal.SIGTERM)
    assert command.wait(10) == 0, command.log()


def http_get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_health_probes_say_live_and_ready_and_not_ready_while_the_server_is_down(
    server: ServerSpec, prefix: str, tmp_path: Path, commands: list[RunCommand]
) -> None:
    store = RestartableServer(server.binary, tmp_path, appendonly=False)
    store.start()
    port = free_port()
    env = app_env(store.url, prefix, work_sec=0, lease_ms=3000)
    command = RunCommand(tmp_path, "one", env, "--health-port", str(port))
    commands.append(command)
    try:
        command.wait_live()
        base = f"http://127.0.0.1:{port}"
        assert http_get(f"{base}/live")[0] == 200
        status, body = http_get(f"{base}/ready")
        # Whoever reaches the port learns the state, not what the fleet runs.
        assert status == 200 and body == {
            "live": True,
            "ready": True,
            "state": "running",
            "server": "answers",
        }, body
        # The health file (mode 0600) has the details, for anarchon health.
        assert command.health_file.stat().st_mode & 0o077 == 0
        details = json.loads(command.health_file.read_text())
        assert details["instance"] == "one" and details["jobs"] == ["work"], details
        assert http_get(f"{base}/other")[0] == 404
        checked = health_command(command.health_file)
        assert checked.returncode == 0 and checked.stdout.strip() == "ok", checked

        store.kill()
        wait_for(lambda: http_get(f"{base}/ready")[0] == 503, 30, "/ready to answer 503")
        assert http_get(f"{base}/live")[0] == 200  # the process itself is fine
        wait_for(
            lambda: health_command(command.health_file, "--ready").returncode == 1,
            30,
            "anarchon health --ready to fail",
        )
        assert health_command(command.health_file).returncode == 0
        store.start()
        wait_for(lambda: http_get(f"{base}/ready")[0] == 200, 30, "/ready to answer 200 again")

        command.signal(signal.SIGTERM)
        assert command.wait(20) == 0, command.log()
        gone = health_command(command.health_file)
        assert gone.returncode == 1 and "does not exist" in gone.stderr, gone
    finally:
        store.kill()


def test_while_it_waits_for_the_server_the_probes_answer_live_and_not_ready(
    prefix: str, tmp_path: Path, commands: list[RunCommand]
) -> None:
    """An orchestrator probes from the moment the port is bound: while the process waits
    for its server at start, each probe is answered at once (live: the process does
    what it should; not ready: it runs nothing yet), not left to time out."""
    env = app_env(f"redis://127.0.0.1:{free_port()}", prefix)
    port = free_port()
    command = RunCommand(
        tmp_path, "one", env, "--health-port", str(port), "--wait-for-server", "600"
    )
    commands.append(command)
    wait_for(lambda: "waiting for the server" in command.log(), 20, "it to say it waits")
    base = f"http://127.0.0.1:{port}"
    waiting = {"live": True, "ready": False, "state": "waiting for the server"}
    status, body = http_get(f"{base}/live")
    assert (status, body) == (200, {**waiting, "server": "does not answer"}), body
    status, body = http_get(f"{base}/ready")
    assert (status, body) == (503, {**waiting, "server": "does not answer"}), body
    command.signal(signal.SIGTERM)
    assert command.wait(10) == 0, command.log()


def health_command(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "anarchon", "health", str(path), *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_stale_health_file_fails_the_check(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    written = time.time() * 1000 - 120_000
    path.write_text(json.dumps({"live": True, "ready": True, "at_ms": written}))
    stale = health_command(path)
    assert stale.returncode == 1, stale
    # 120 s, or more by the time a loaded machine has started the check.
    (age,) = re.findall(r"last written (\d+) s ago \(more than 30 s\)", stale.stderr)
    assert 120 <= int(age) < 180, stale.stderr
    assert health_command(path, "--max-age", "600").returncode == 0
    path.write_text("not json")
    assert health_command(path).returncode == 1


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("tests.run_app", "is not MODULE:ATTRIBUTE"),
        ("tests.no_such_module:make", "no module named 'tests.no_such_module'"),
        ("tests.run_app:nothing", "has no attribute 'nothing'"),
        ("tests.run_app:not_a_scheduler", "is an object of type int, not a Scheduler"),
    ],
)
def test_a_bad_target_is_one_line_and_exit_2(target: str, says: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    done = subprocess.run(
        [sys.executable, "-m", "anarchon", "run", target],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("anarchon run: ") and says in lines[0], lines


@pytest.mark.anyio
async def test_a_server_frozen_at_start_is_a_connection_failure_within_the_start_deadline(
    server_url: str, prefix: str
) -> None:
    """The server accepts the connection and never answers: the start's checks have a
    deadline (10 s; the client's own timeout may come first), so ``serve`` fails (with no
    wait) instead of hanging, with the error itself (not inside an exception group)."""
    with FaultProxy(server_url) as proxy:
        proxy.pause()
        scheduler = Scheduler(RedisBackend(redis=proxy.url, prefix=prefix))
        with anyio.fail_after(30), pytest.raises(ConnectionFailedError):
            await serve(scheduler, wait_for_server_sec=0, stop_signals=())
        proxy.resume()


@pytest.mark.parametrize("served", ["health", "metrics"])
def test_a_health_or_metrics_port_that_is_taken_fails_before_the_start_in_one_line(
    server_url: str, prefix: str, tmp_path: Path, served: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = RunCommand(
            tmp_path, "one", app_env(server_url, prefix), f"--{served}-port", str(port),
            f"--{served}-host", "127.0.0.1",
        )  # fmt: skip
        assert command.wait(30) == 1, command.log()
    lines = command.log().strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], lines
    assert lines[0].startswith("anarchon: ") and "choose a free port" in lines[0]
    registered = RegistryKeys.for_prefix(prefix).instances
    direct = redis.Redis.from_url(server_url, decode_responses=True, protocol=2)
    assert direct.zcard(registered) == 0  # it never started
    direct.close()


# ------------------------------------------------------------------ the health file


async def serve_until_the_health_file_is_written(
    server_url: str, prefix: str, health: Path, written: Any
) -> None:
    """``serve`` with a health file at ``health``, until ``written()`` holds; then a stop."""
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    scheduler.add_job(lambda: None, "0 0 1 1 *", name="rare")
    async with anyio.create_task_group() as group:

        async def run() -> None:
            await serve(scheduler, health_file=health, stop_signals=())

        group.start_soon(run)
        await wait_until(written, 20, "the health file to be written")
        await scheduler.stop()


@pytest.mark.anyio
async def test_the_health_file_is_never_written_through_a_planted_symbolic_link(
    server_url: str, prefix: str, tmp_path: Path
) -> None:
    """Symbolic links planted where the health file goes and where its temporary file
    went (its old predictable name, ``.<name>.<pid>``): the files they point to are left
    as they were, and the health file is a file of its own, the running user's alone."""
    health = tmp_path / "app.health"
    victims = [tmp_path / "victim-of-temp", tmp_path / "victim-of-target"]
    for victim in victims:
        victim.write_text("precious\n")
    (tmp_path / f".{health.name}.{os.getpid()}").symlink_to(victims[0])
    health.symlink_to(victims[1])
    seen: list[dict[str, Any]] = []

    def written() -> bool:
        if any(victim.read_text() != "precious\n" for victim in victims):
            return True
        if health.is_symlink() or not health.exists():
            return False
        seen.append(json.loads(health.read_text()))
        assert health.stat().st_mode & 0o777 == 0o600
        return True

    await serve_until_the_health_file_is_written(server_url, prefix, health, written)
    assert [victim.read_text() for victim in victims] == ["precious\n", "precious\n"]
    assert seen and seen[0]["live"] is True


@pytest.mark.anyio
async def test_a_temporary_file_left_with_another_mode_does_not_lend_it_to_the_health_file(
    server_url: str, prefix: str, tmp_path: Path
) -> None:
    """A file already at the temporary file's old name, mode 0666, is not reused: the
    health file is created anew, mode 0600."""
    health = tmp_path / "app.health"
    planted = tmp_path / f".{health.name}.{os.getpid()}"
    planted.write_text("planted\n")
    planted.chmod(0o666)
    modes: list[int] = []

    def written() -> bool:
        if health.exists():
            modes.append(health.stat().st_mode & 0o777)
            return True
        return False

    await serve_until_the_health_file_is_written(server_url, prefix, health, written)
    assert modes == [0o600]
    assert planted.read_text() == "planted\n"
    assert not health.exists()  # removed at the stop
