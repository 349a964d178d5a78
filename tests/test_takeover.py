"""A runner that dies mid-run is replaced by a backup at its lease expiry."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from anarchon import RedisBackend, Scheduler
from tests.helpers import hand_over_slot, wait_for

pytestmark = pytest.mark.engine_tier

ROOT = Path(__file__).resolve().parents[1]
LEASE_MS = 2000
HEARTBEAT_MS = 500


def start_worker(url: str, prefix: str, name: str, loop: str, *more: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    # The caller's path first: a mutant's copy of src/ (python -m tests.mutants) must
    # be the anarchon the workers run.
    paths = [env.get("PYTHONPATH", ""), str(ROOT / "src"), str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.worker", url, prefix, name, str(LEASE_MS),
         str(HEARTBEAT_MS), loop, *more],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    return proc


def start_at_one_slot(workers: list[subprocess.Popen[str]]) -> None:
    """Hand the same slot to workers that asked for it, and wait until each is ready."""
    for proc in workers:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "slot?"
    hand_over_slot([proc.stdin for proc in workers if proc.stdin is not None])
    for proc in workers:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"


def stop_worker(proc: subprocess.Popen[str]) -> None:
    """SIGTERM (a graceful stop) and wait for the process to end."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("a worker did not stop within 10 s of SIGTERM") from None


@pytest.mark.slow
@pytest.mark.parametrize("event_loop", ["asyncio", "trio"])
def test_a_killed_runner_is_replaced_by_a_backup_within_the_lease(
    server_url: str, prefix: str, direct: redis.Redis, event_loop: str
) -> None:
    names = [f"worker-{i}" for i in range(3)]
    workers = {name: start_worker(server_url, prefix, name, event_loop) for name in names}
    try:
        start_at_one_slot(list(workers.values()))
        log_key = f"{prefix}log"

        def entries() -> list[list[str]]:
            return [str(e).split("|") for e in direct.lrange(log_key, 0, -1)]

        first = wait_for(lambda: entries(), 15, "the first attempt to start")[0]
        assert first[0] == "start" and first[2] == "1"
        victim = first[1]
        time.sleep(HEARTBEAT_MS / 1000 * 1.5)  # it has heartbeated at least once
        seconds, micros = direct.time()
        killed_ms = seconds * 1000 + micros // 1000
        workers[victim].send_signal(signal.SIGKILL)
        workers[victim].wait()

        second = wait_for(
            lambda: [e for e in entries() if e[0] == "start" and e[2] == "2"],
            (LEASE_MS + 4 * HEARTBEAT_MS) / 1000 + 5,
            "attempt 2 to start",
        )[0]
        delay_ms = int(second[4]) - killed_ms
        print(f"takeover delay: {delay_ms} ms (lease {LEASE_MS} ms, heartbeat {HEARTBEAT_MS} ms)")
        assert second[1] != victim
        assert delay_ms <= LEASE_MS + 2 * HEARTBEAT_MS
        # The fence grows across the takeover.
        assert int(second[3]) > int(first[3])
        # The slot ran twice only because the first runner died: attempt 1 never finished.
        starts = [e for e in entries() if e[0] == "start"]
        assert [(e[1], e[2]) for e in starts] == [(victim, "1"), (second[1], "2")]
        assert not [e for e in entries() if e[0] == "finish" and e[2] == "1"]
        # Stop the idle backup first, then the runner: its cancelled attempt 2 would
        # otherwise be retried at once by a backup that is still up.
        for name in names:
            if name not in (victim, second[1]):
                stop_worker(workers[name])
        stop_worker(workers[second[1]])
        starts = [e for e in entries() if e[0] == "start"]
        assert [(e[1], e[2]) for e in starts] == [(victim, "1"), (second[1], "2")]
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in workers.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    # The store recorded attempt 1 as interrupted, attempt 2 as cancelled by the stop.
    import anyio

    async def read_history() -> list[tuple[int, str]]:
        async with Scheduler(RedisBackend(redis=server_url, prefix=prefix)) as reader:
            return [(r.attempt, r.status) for r in await reader.history("takeover")]

    # The whole history: no attempt beyond these two.
    assert sorted(anyio.run(read_history)) == [(1, "interrupted"), (2, "cancelled")]
