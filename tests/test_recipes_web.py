"""The web-framework recipes of ``examples/`` (docs/how-to), started as their pages tell
a user to start them: FastAPI under ``uvicorn --workers 2`` and under gunicorn with two
uvicorn workers, Django's ``manage.py runscheduler`` twice, a Flask app under gunicorn
and a FastAPI endpoint that set timers which ``anarchon run`` fires. Each runs against
the test's server under a prefix of its own (``ANARCHON_PREFIX``, which the examples
read), and is stopped by a signal, as a terminal or an orchestrator stops it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from anarchon import Inspector, InstanceInfo, RedisBackend, RunResult, TimerInfo, Timers
from anarchon._ops.embedded import free_port
from tests.helpers import wait_for

# The recipes run under asyncio (uvicorn, gunicorn's uvicorn worker, anyio.run's
# default): of the engine tier's servers, the ones paired with asyncio.
pytestmark = [
    pytest.mark.engine_tier,
    pytest.mark.parametrize("anyio_backend", ["asyncio"]),
    pytest.mark.slow("real web servers, their workers and schedulers, each a process to start"),
]

ROOT = Path(__file__).resolve().parents[1]
DJANGO_PROJECT = ROOT / "examples" / "django_project"
#: How long a process may take to start, or to stop, on a busy machine.
START_SEC = 45.0
STOP_SEC = 30.0
#: Slots of the every-second jobs to see run before a check.
SLOTS = 4


class Process:
    """A command started as a user starts it, in a session of its own, its output in a
    file."""

    def __init__(
        self, tmp_path: Path, name: str, command: list[str], env: dict[str, str], cwd: Path = ROOT
    ) -> None:
        self.name = name
        self.output = tmp_path / f"{name}.log"
        full_env = dict(os.environ)
        paths = [str(ROOT / "src"), full_env.get("PYTHONPATH", "")]
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        full_env.update(env)
        with open(self.output, "w") as out:
            self.process = subprocess.Popen(
                command, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def log(self) -> str:
        return self.output.read_text()

    def check_running(self) -> None:
        assert self.process.poll() is None, f"{self.name} ended:\n{self.log()}"

    def stop(self, signum: signal.Signals, *, whole_group: bool = False) -> int:
        """Send ``signum`` (to the process, or to its whole group as a terminal's Ctrl-C
        does) and wait for the exit code."""
        if whole_group:
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)
        try:
            return self.process.wait(STOP_SEC)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still runs {STOP_SEC} s after {signum.name}:\n"
                                 f"{self.log()}") from None  # fmt: skip

    def end(self) -> None:
        """Kill what is left of it: the process and its workers (its session's group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    try:
        yield started
    finally:
        for process in started:
            process.end()


def recipe_env(server_url: str, prefix: str, **more: str) -> dict[str, str]:
    return {"REDIS_URL": server_url, "ANARCHON_PREFIX": prefix, **more}


def read_store(
    server_url: str, prefix: str, job: str
) -> tuple[list[InstanceInfo], list[RunResult]]:
    """The instances alive and the job's recorded attempts (oldest first)."""

    async def read() -> tuple[list[InstanceInfo], list[RunResult]]:
        async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as store:
            instances = await store.instances()
            known = job in await store.job_names()
            history = await store.history(job, limit=100) if known else []
            return instances, history[::-1]

    return anyio.run(read)


def read_timers(server_url: str, prefix: str, *keys: str) -> list[TimerInfo | None]:
    async def read() -> list[TimerInfo | None]:
        async with Timers(RedisBackend(redis=server_url, prefix=prefix)) as timers:
            return [await timers.get("remind", key) for key in keys]

    return anyio.run(read)


def each_slot_ran_once(
    server_url: str, prefix: str, job: str, runners: list[Process], log_line: str
) -> list[str]:
    """Two instances of the recipe run the every-second ``job``: wait until both are
    alive and SLOTS slots have run after that, then check that each slot ran once (in
    the store and in the handlers' own log lines, ``log_line`` with the slot in its one
    group), one after the other with none missed. The instances' ids."""

    def both_alive() -> list[InstanceInfo]:
        for process in runners:
            process.check_running()
        instances, _ = read_store(server_url, prefix, job)
        return instances if len(instances) == 2 else []

    instances = wait_for(both_alive, START_SEC, "two instances to run the job")
    ids = sorted(instance.id for instance in instances)
    assert len({instance.pid for instance in instances}) == 2, instances
    seen = len(read_store(server_url, prefix, job)[1])

    def ran() -> list[RunResult]:
        _, history = read_store(server_url, prefix, job)
        return history if len(history) >= seen + SLOTS else []

    last_ms = wait_for(ran, START_SEC, f"{SLOTS} more slots to run")[-1].slot_ms

    def recorded_up_to_last() -> list[RunResult]:
        # A slot is recorded when its run has ended: on a loaded machine an older run's
        # finish can come after newer ones'. A slot never recorded was missed.
        _, history = read_store(server_url, prefix, job)
        settled = [result for result in history if result.slot_ms <= last_ms]
        got = {result.slot_ms for result in settled}
        return settled if got >= set(range(settled[0].slot_ms, last_ms + 1, 1000)) else []

    history = wait_for(recorded_up_to_last, STOP_SEC, "every slot up to the last seen")
    slots = [result.slot_ms for result in history]
    assert len(set(slots)) == len(slots), history  # no slot twice in the store
    assert slots == list(range(slots[0], slots[-1] + 1, 1000)), history  # none missed
    # On a loaded machine a slot may be skipped by overlap protection: recorded skipped
    # while an older slot's run had not yet ended. Every other slot ran, once, ok.
    ran = [
        r
        for r in history
        if not (
            r.status == "skipped"
            and any(o.slot_ms < r.slot_ms and o.status != "skipped"
                    and o.finished_at >= r.finished_at for o in history)
        )
    ]  # fmt: skip
    assert {(r.attempt, r.status, r.trigger) for r in ran} == {(1, "ok", "schedule")}, history
    assert {result.runner for result in ran} <= set(ids), (history, ids)
    logged = Counter(match for process in runners for match in re.findall(log_line, process.log()))
    assert all(count == 1 for count in logged.values()), logged  # no slot twice in the logs
    for result in ran:
        assert logged[f"{result.slot:%H:%M:%S}"] == 1, (result, logged)
    return ids


def http(method: str, url: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(request, timeout=STOP_SEC) as reply:
        body: dict[str, Any] = json.loads(reply.read())
        return reply.status, body


def wait_serving(process: Process, url: str) -> None:
    def serving() -> bool:
        process.check_running()
        try:
            urllib.request.urlopen(url, timeout=5).close()
        except urllib.error.HTTPError:
            return True  # it answers
        except OSError:
            return False
        return True

    wait_for(serving, START_SEC, f"{process.name} to answer at {url}")


def check_clean(process: Process) -> None:
    log = process.log()
    assert "Traceback" not in log and "ERROR" not in log, log


TICK = r"\] app: tick (\d\d:\d\d:\d\d) attempt"


@pytest.mark.parametrize("server_kind", ["uvicorn", "gunicorn"])
def test_the_fastapi_app_under_two_workers_runs_each_slot_once_and_stops_on_a_signal(
    server_url: str, prefix: str, tmp_path: Path, processes: list[Process], anyio_backend: str,
    server_kind: str,
) -> None:  # fmt: skip
    """examples/fastapi_app.py (docs/how-to/fastapi.md, workers.md): each of the two
    worker processes runs a scheduler in the app's lifespan; each slot of the
    every-second job runs once across them, the app answers meanwhile, and a signal
    stops the workers, their schedulers and the server cleanly."""
    port = free_port()
    if server_kind == "uvicorn":
        command = [
            sys.executable, "-m", "uvicorn", "examples.fastapi_app:app",
            "--workers", "2", "--port", str(port),
        ]  # fmt: skip
    else:
        command = [
            sys.executable, "-m", "gunicorn", "examples.fastapi_app:app",
            "-k", "uvicorn_worker.UvicornWorker", "-w", "2", "-b", f"127.0.0.1:{port}",
            "--no-control-socket",
        ]  # fmt: skip
    web = Process(tmp_path, server_kind, command, recipe_env(server_url, prefix))
    processes.append(web)
    ids = each_slot_ran_once(server_url, prefix, "tick", [web], TICK)
    status, body = http("GET", f"http://127.0.0.1:{port}/")
    assert status == 200 and body["instance"] in ids, body
    assert body["last_runs"] and body["last_runs"][0]["status"] == "ok", body
    if server_kind == "uvicorn":
        # Ctrl-C in its terminal: SIGINT to the server and its workers.
        assert web.stop(signal.SIGINT, whole_group=True) == 0, web.log()
    else:
        assert web.stop(signal.SIGTERM) == 0, web.log()  # as an orchestrator stops it
    log = web.log()
    assert all(f"instance {instance} stopped" in log for instance in ids), log
    check_clean(web)
    assert read_store(server_url, prefix, "tick")[0] == []  # both withdrew


def test_the_django_command_runs_each_slot_once_across_two_processes(
    server_url: str, prefix: str, tmp_path: Path, processes: list[Process], anyio_backend: str
) -> None:
    """examples/django_project (docs/how-to/django.md): ``manage.py migrate``, then two
    ``manage.py runscheduler``: the job, which uses Django's ORM, runs each slot once
    across them and deletes the expired sessions; SIGTERM stops each with exit 0."""
    database = tmp_path / "db.sqlite3"
    env = recipe_env(server_url, prefix, DJANGO_DB=str(database))
    migrate = Process(tmp_path, "migrate", [sys.executable, "manage.py", "migrate"], env,
                      cwd=DJANGO_PROJECT)  # fmt: skip
    processes.append(migrate)
    assert migrate.process.wait(START_SEC) == 0, migrate.log()
    with contextlib.closing(sqlite3.connect(database)) as db, db:
        db.executemany(
            "INSERT INTO django_session VALUES (?, 'e30', ?)",
            [("old-1", "2001-01-01 00:00:00"), ("old-2", "2001-01-01 00:00:00"),
             ("live", "2999-01-01 00:00:00")],
        )  # fmt: skip
    runners = []
    for name in ("one", "two"):
        command = [sys.executable, "manage.py", "runscheduler"]
        runners.append(Process(tmp_path, name, command, env, cwd=DJANGO_PROJECT))
    processes.extend(runners)
    line = r"jobs.scheduler: clear_sessions (\d\d:\d\d:\d\d): \d+ expired"
    ids = each_slot_ran_once(server_url, prefix, "clear_sessions", runners, line)
    with contextlib.closing(sqlite3.connect(database)) as db:
        left = db.execute("SELECT session_key FROM django_session").fetchall()
    assert left == [("live",)]
    deleted = sum(int(n) for r in runners for n in re.findall(r": (\d+) expired session", r.log()))
    assert deleted == 2  # once, by whichever instance ran first
    for runner in runners:
        assert runner.stop(signal.SIGTERM) == 0, runner.log()
        assert "SIGTERM: stopping" in runner.log()
        check_clean(runner)
    assert all(any(f"instance {i} stopped" in r.log() for r in runners) for i in ids)


def fired(schedulers: list[Process], key: str) -> int:
    """How many times the schedulers fired ``key``'s reminder, by their logs."""
    return sum(s.log().count(f"reminders: remind {key}: ") for s in schedulers)


@pytest.mark.parametrize("app", ["flask", "fastapi"])
def test_a_view_sets_a_timer_that_the_scheduler_process_fires_once(
    server_url: str, prefix: str, tmp_path: Path, processes: list[Process], anyio_backend: str,
    app: str,
) -> None:  # fmt: skip
    """examples/flask_app.py under gunicorn (two sync workers, ``--preload``: the
    worker that answers opens its own connection after the fork;
    docs/how-to/flask.md) and examples/fastapi_timers.py under uvicorn
    (docs/how-to/timers-from-web.md): a POST sets a reminder, which one of two
    ``anarchon run examples.reminders:scheduler`` fires, once; a reminder set then
    cancelled through the app never fires."""
    port = free_port()
    env = recipe_env(server_url, prefix)
    if app == "flask":
        command = [
            sys.executable, "-m", "gunicorn", "examples.flask_app:app", "-w", "2",
            "-b", f"127.0.0.1:{port}", "--preload", "--no-control-socket",
        ]  # fmt: skip
    else:
        command = [
            sys.executable, "-m", "uvicorn", "examples.fastapi_timers:app",
            "--port", str(port),
        ]  # fmt: skip
    web = Process(tmp_path, app, command, env)
    processes.append(web)
    schedulers = []
    for name in ("one", "two"):
        command = [sys.executable, "-m", "anarchon", "run", "examples.reminders:scheduler"]
        schedulers.append(Process(tmp_path, name, command, env))
    processes.extend(schedulers)
    base = f"http://127.0.0.1:{port}"
    wait_serving(web, f"{base}/")
    # Set before the schedulers are up or after: a timer waits in the store either way.
    assert http("POST", f"{base}/remind/bob") == (200, {"user": "bob", "generation": 1})
    status, body = http("POST", f"{base}/remind/ada?in_seconds=1")
    assert status == 200 and body == {"user": "ada", "generation": 2}, body
    assert http("DELETE", f"{base}/remind/bob") == (200, {"user": "bob", "cancelled": True})
    wait_for(lambda: fired(schedulers, "user:ada"), START_SEC, "the reminder to fire")
    # Fired and spent: the store holds nothing more to fire, for either key.
    wait_for(
        lambda: read_timers(server_url, prefix, "user:ada", "user:bob") == [None, None],
        STOP_SEC,
        "the reminder to be spent",
    )
    assert fired(schedulers, "user:ada") == 1
    assert "{'text': 'your cart misses you'} (attempt 1" in "".join(s.log() for s in schedulers)
    assert fired(schedulers, "user:bob") == 0
    for scheduler in schedulers:
        assert scheduler.stop(signal.SIGTERM) == 0, scheduler.log()
        check_clean(scheduler)
    # gunicorn exits 0; uvicorn, one process, ends by the signal it was sent, once its
    # lifespan (and the app's connection) is closed.
    expected = 0 if app == "flask" else -signal.SIGTERM
    assert web.stop(signal.SIGTERM) == expected, web.log()
    check_clean(web)
    if app == "fastapi":
        assert "Application shutdown complete." in web.log()
