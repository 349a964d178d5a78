"""One scheduler instance of a chaos scenario, in a process of its own.

    python -m chaos.worker URL PREFIX INSTANCE JOBS EVERY_MS LEASE_MS HEARTBEAT_MS
        LEDGER EVENT_LOOP

Runs JOBS jobs ``j000``... every EVERY_MS. Each handler appends to the ledger file
(``O_APPEND``, one ``write`` per line, no fsync: a line written survives a SIGKILL
of this process and of the server):

    start|slot_ms|job|instance|attempt|fence|server_ms|wall_ms|trigger
    end|slot_ms|job|instance|attempt|fence|outcome|wall_ms
    gap|from_wall_ms|to_wall_ms      (this event loop did not run for that long)

It also fires the timers of kind ``chaos-timer`` (set by the scenario), each for
150-750 ms (some longer than a heartbeat), noting them as

    tstart|key|generation|instance|attempt|fence|wall_ms|trigger|due_ms
    tend|key|generation|instance|attempt|fence|outcome|wall_ms

``server_ms`` is the server's TIME read on a direct connection of the ledger's
own (``-1`` when the server did not answer within 200 ms). Logs go to stderr at
INFO. SIGTERM stops the instance gracefully; ``ready`` on stdout once running.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import anyio
import redis

from anarchon import RedisBackend, Run, Scheduler, TimerRun

TICK_SEC = 0.05
GAP_SEC = 0.3
LONG_EVERY = 5  # every 5th job works longer than its period (overlap skips, heartbeats)


TIMER_KIND = "chaos-timer"


def timer_duration_sec(key: str) -> float:
    """How long the firing of ``key`` (``t<n>``) works: 150-750 ms."""
    return (150 + (int(key[1:]) * 53) % 600) / 1000


def job_name(index: int) -> str:
    return f"j{index:03d}"


def job_duration_sec(index: int, every_ms: int) -> float:
    if index % LONG_EVERY == LONG_EVERY - 1:
        return every_ms * 1.5 / 1000
    return (100 + (index * 37) % 150) / 1000


def main() -> None:
    url, prefix, instance, jobs, every_ms, lease_ms, heartbeat_ms, ledger, event_loop = sys.argv[
        1:10
    ]
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {instance} %(levelname)s %(name)s: %(message)s",
    )
    direct_url = os.environ.get("CHAOS_DIRECT_URL", url)
    direct = redis.Redis.from_url(
        direct_url, socket_timeout=0.2, socket_connect_timeout=0.2, protocol=2
    )
    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    def server_ms() -> int:
        try:
            seconds, micros = direct.time()
        except (redis.RedisError, OSError):
            return -1
        return int(seconds) * 1000 + int(micros) // 1000

    def note_start(run: Run) -> None:
        now = server_ms()
        wall = time.time_ns() // 1_000_000
        write(
            f"start|{run.slot_ms}|{run.job}|{instance}|{run.attempt}|{run.fence}|{now}|{wall}"
            f"|{run.trigger}"
        )

    def note_end(run: Run, outcome: str) -> None:
        wall = time.time_ns() // 1_000_000
        write(f"end|{run.slot_ms}|{run.job}|{instance}|{run.attempt}|{run.fence}|{outcome}|{wall}")

    scheduler = Scheduler(
        RedisBackend(redis=url, prefix=prefix),
        instance_id=instance,
        lease_ms=int(lease_ms),
        heartbeat_ms=int(heartbeat_ms),
        stop_grace_ms=3000,
        history_size=5000,
    )

    def make_handler(duration: float):  # type: ignore[no-untyped-def]
        async def handler(run: Run) -> None:
            await anyio.to_thread.run_sync(note_start, run)
            try:
                await anyio.sleep(duration)
            except BaseException:
                note_end(run, "cancelled")
                raise
            note_end(run, "lost" if run.lease_lost.is_set() else "ok")

        return handler

    for index in range(int(jobs)):
        scheduler.job(every_ms=int(every_ms), name=job_name(index))(
            make_handler(job_duration_sec(index, int(every_ms)))
        )

    @scheduler.timer(TIMER_KIND)
    async def fire(timer: TimerRun) -> None:
        wall = time.time_ns() // 1_000_000
        head = f"{timer.key}|{timer.generation}|{instance}|{timer.attempt}|{timer.fence}"
        write(f"tstart|{head}|{wall}|{timer.trigger}|{timer.due_ms}")
        try:
            await anyio.sleep(timer_duration_sec(timer.key))
        except BaseException:
            write(f"tend|{head}|cancelled|{time.time_ns() // 1_000_000}")
            raise
        outcome = "lost" if timer.lease_lost.is_set() else "ok"
        write(f"tend|{head}|{outcome}|{time.time_ns() // 1_000_000}")

    async def watch_loop() -> None:
        """Notes every stall of this event loop longer than GAP_SEC (CPU starvation of
        a loaded machine looks like a short SIGSTOP): ``gap|from_wall_ms|to_wall_ms``."""
        before = time.monotonic()
        while True:
            await anyio.sleep(TICK_SEC)
            now = time.monotonic()
            if now - before > GAP_SEC:
                wall = time.time_ns() // 1_000_000
                write(f"gap|{wall - int((now - before - TICK_SEC) * 1000)}|{wall}")
            before = now

    async def run_until_terminated() -> None:
        async with scheduler, anyio.create_task_group() as group:
            group.start_soon(watch_loop)
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                print("ready", flush=True)
                async for _ in signals:
                    break
            group.cancel_scope.cancel()

    try:
        anyio.run(run_until_terminated, backend=event_loop)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
