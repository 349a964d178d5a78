"""Timers under faults, on real servers and real processes: a runner SIGKILLed mid-fire
is taken over; a ``kill -9`` of Redis with its append-only file loses no timer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import pytest
import redis

from anarchon import LeaseLost, RedisBackend, Scheduler, TimerRun
from tests.restartable_server import RestartableServer
from tests.servers import ServerSpec
from tests.test_takeover import wait_for

pytestmark = pytest.mark.engine_tier

ROOT = Path(__file__).resolve().parents[1]
LEASE_MS = 2000
HEARTBEAT_MS = 500


def start_worker(url: str, prefix: str, name: str, loop: str, *more: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    paths = [env.get("PYTHONPATH", ""), str(ROOT / "src"), str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.timer_worker", url, prefix, name, str(LEASE_MS),
         str(HEARTBEAT_MS), loop, *more],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("event_loop", ["asyncio", "trio"])
def test_a_runner_sigkilled_mid_fire_is_taken_over_with_a_higher_fence(
    server_url: str, prefix: str, direct: redis.Redis, event_loop: str
) -> None:
    first = start_worker(server_url, prefix, "a", event_loop)
    procs = [first]
    try:

        async def set_it() -> None:
            producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
            await producer.set_timer("remind", "long:1", delay_ms=0)

        anyio.run(set_it)
        log = f"{prefix}log"
        wait_for(lambda: direct.llen(log) >= 1, 10, "the first firing")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        seconds, micros = direct.time()
        killed_ms = seconds * 1000 + micros // 1000
        procs.append(start_worker(server_url, prefix, "b", event_loop))
        wait_for(lambda: direct.llen(log) >= 2, 10, "the takeover")
        starts = [line.split("|") for line in direct.lrange(log, 0, -1)]
        assert [(s[1], s[2], s[3], s[5]) for s in starts] == [
            ("a", "long:1", "1", "due"), ("b", "long:1", "2", "takeover"),
        ]  # fmt: skip
        assert int(starts[1][4]) > int(starts[0][4])  # a higher fence
        # Within the lease from the last heartbeat (at most one heartbeat before the kill),
        # plus the next claim (at most timer_poll_ms after b was ready): a bound for
        # the order of things, not a benchmark.
        assert int(starts[1][6]) - killed_ms <= LEASE_MS + 1000 + 2000
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("event_loop", ["asyncio", "trio"])
def test_a_firing_whose_lease_ran_out_before_its_handler_began_is_not_run_there(
    server_url: str, prefix: str, direct: redis.Redis, event_loop: str
) -> None:
    """One claim wins two firings. The first handler to begin starves the event loop
    until a backup (another process) has taken the other firing over, their leases run
    out. The other handler, next in line on the loop, must not begin: the backup runs
    it."""
    log = f"{prefix}log"
    here: list[tuple[str, int]] = []
    backups: list[subprocess.Popen[str]] = []
    lost: list[LeaseLost] = []

    def backup_fired(key: str) -> bool:
        return f"|b|{key}|2|" in "".join(direct.lrange(log, 0, -1))

    async def remind(fire: TimerRun) -> None:
        here.append((fire.key, fire.attempt))
        if len(here) == 1:
            backups.append(start_worker(server_url, prefix, "b", event_loop))
            other = "two" if fire.key == "one" else "one"
            # The loop stands still (as on a machine whose CPUs are taken) until the
            # backup has fired the other timer.
            wait_for(lambda: backup_fired(other), 30, f"the backup to take {other} over")

    async def main() -> None:
        producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
        await producer.set_timer("remind", "one", delay_ms=0)
        await producer.set_timer("remind", "two", delay_ms=0)
        scheduler = Scheduler(
            RedisBackend(redis=server_url, prefix=prefix), instance_id="a", lease_ms=LEASE_MS,
            heartbeat_ms=HEARTBEAT_MS, stop_grace_ms=200,
        )  # fmt: skip
        scheduler.add_timer(remind, "remind")
        scheduler.on_event(
            lambda event: lost.append(event) if isinstance(event, LeaseLost) else None
        )
        async with scheduler:
            with anyio.fail_after(60):
                while not backups:  # noqa: ASYNC110 - polls what the handler recorded
                    await anyio.sleep(0.05)
            await anyio.sleep(1.0)  # the other firing's task has had its turn

    try:
        anyio.run(main, backend=event_loop)
        assert len(here) == 1, here  # the other firing ran only in the backup
        other = "two" if here[0][0] == "one" else "one"
        assert backup_fired(other)
        # and its lost lease is reported once, whichever task noticed first
        assert [event.timer_key for event in lost if event.timer_key == other] == [other], lost
    finally:
        for proc in backups:
            proc.terminate()
            proc.wait(10)


@pytest.mark.server_tier  # the server's append-only file
@pytest.mark.slow
@pytest.mark.anyio
async def test_a_kill_9_of_redis_with_its_append_only_file_loses_no_timer(
    server: ServerSpec, prefix: str
) -> None:
    if server.binary is None:
        pytest.skip(f"{server.id} is a server this run did not start: it cannot kill it")
    with tempfile.TemporaryDirectory() as directory:
        redis_server = RestartableServer(server.binary, Path(directory), appendonly=True)
        redis_server.start()
        try:
            producer = Scheduler(RedisBackend(redis=redis_server.url, prefix=prefix))
            keys = [f"user:{n}" for n in range(100)]
            for key in keys:
                await producer.set_timer("remind", key, delay_ms=500, payload=key)
            redis_server.kill()
            redis_server.start()  # from its append-only file, on the same port
            fired: list[tuple[str, object]] = []

            async def remind(fire: TimerRun) -> None:
                fired.append((fire.key, fire.payload))

            worker = Scheduler(RedisBackend(redis=redis_server.url, prefix=prefix))
            worker.add_timer(remind, "remind")
            async with worker:
                with anyio.fail_after(10):
                    while len(fired) < len(keys):  # noqa: ASYNC110 - polls a list
                        await anyio.sleep(0.05)
                await anyio.sleep(0.3)  # and nothing twice
            assert sorted(fired) == sorted((key, key) for key in keys)
        finally:
            redis_server.kill()


@pytest.mark.anyio
async def test_timer_hints_come_back_after_the_connection_is_cut(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """The instance's hint subscription goes through a proxy that cuts every connection:
    it subscribes again, and a timer another process sets to fall due long before its
    next poll (30 s) fires."""
    from tests.faults import FaultProxy
    from tests.test_timers import set_until_fired, subscribers

    fired: list[str] = []
    with FaultProxy(server_url) as proxy:
        scheduler = Scheduler(RedisBackend(redis=proxy.url, prefix=prefix), timer_poll_ms=30_000)

        @scheduler.timer("remind")
        async def remind(timer: TimerRun) -> None:
            fired.append(timer.key)

        producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
        async with scheduler:
            await subscribers(direct, prefix, 1)
            proxy.reset()
            await set_until_fired(producer, "after-the-cut", fired, 15)
    assert set(fired) == {"after-the-cut"}
