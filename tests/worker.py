"""A scheduler instance in a process of its own, for tests that kill one.

    python -m tests.worker URL PREFIX INSTANCE LEASE_MS HEARTBEAT_MS EVENT_LOOP [resume]

Runs one job, ``takeover``, due once, at the slot the test hands over on stdin once
the instance has started (``SlotOnStdin``: it prints ``slot?``, then ``ready``). Its handler appends
``start|instance|attempt|fence|server_ms`` to the list ``<PREFIX>log``, works for
30 s, then appends ``finish|...``. With ``resume``, its work is 30 steps of 0.1 s from
the offset its slot's last attempt kept (``run.progress``, logged after the start as a
sixth field), keeping each step's end with ``run.save_progress`` and appending
``kept|instance|offset`` once it is kept. SIGTERM stops the instance gracefully.
"""

from __future__ import annotations

import sys

import anyio
import redis

from anarchon import RedisBackend, Run, Scheduler
from tests.helpers import SlotOnStdin, run_until_sigterm


def main() -> None:
    url, prefix, instance, lease_ms, heartbeat_ms, event_loop = sys.argv[1:7]
    resume = sys.argv[7:] == ["resume"]
    log_key = f"{prefix}log"
    direct = redis.Redis.from_url(url, decode_responses=True, protocol=2)
    scheduler = Scheduler(
        RedisBackend(redis=url, prefix=prefix),
        instance_id=instance,
        lease_ms=int(lease_ms),
        heartbeat_ms=int(heartbeat_ms),
        stop_grace_ms=200,
    )

    def note(event: str, run: Run, *more: object) -> None:
        seconds, micros = direct.time()
        server_ms = seconds * 1000 + micros // 1000
        fields = [event, instance, run.attempt, run.fence, server_ms, *more]
        direct.rpush(log_key, "|".join(map(str, fields)))

    @scheduler.job(SlotOnStdin(), name="takeover")
    async def takeover(run: Run) -> None:
        if not resume:
            await anyio.to_thread.run_sync(note, "start", run)
            await anyio.sleep(30)
            await anyio.to_thread.run_sync(note, "finish", run)
            return
        offset = run.progress or 0
        await anyio.to_thread.run_sync(note, "start", run, offset)
        for step in range(offset, 30):
            await anyio.sleep(0.1)
            await run.save_progress(step + 1)
            await anyio.to_thread.run_sync(direct.rpush, log_key, f"kept|{instance}|{step + 1}")
        await anyio.to_thread.run_sync(note, "finish", run)

    run_until_sigterm(scheduler, event_loop)


if __name__ == "__main__":
    main()
