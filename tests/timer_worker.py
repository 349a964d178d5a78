"""A scheduler instance firing timers in a process of its own, for tests that kill one.

    python -m tests.timer_worker URL PREFIX INSTANCE LEASE_MS HEARTBEAT_MS EVENT_LOOP \
        [MAX_CONCURRENT]

Fires the kind ``remind``. Its handler appends
``start|instance|key|attempt|fence|trigger|server_ms`` to the list ``<PREFIX>log``; a
key starting with ``long`` then works for 30 s; one starting with ``slow`` works for
0.5 s, then appends ``done|instance|key``. SIGTERM stops the instance gracefully.
"""

from __future__ import annotations

import sys

import anyio
import redis

from anarchon import RedisBackend, Scheduler, TimerRun
from tests.helpers import run_until_sigterm


def main() -> None:
    url, prefix, instance, lease_ms, heartbeat_ms, event_loop = sys.argv[1:7]
    bound = {"max_concurrent": int(sys.argv[7])} if len(sys.argv) > 7 else {}
    log_key = f"{prefix}log"
    direct = redis.Redis.from_url(url, decode_responses=True, protocol=2)
    scheduler = Scheduler(
        RedisBackend(redis=url, prefix=prefix),
        instance_id=instance,
        lease_ms=int(lease_ms),
        heartbeat_ms=int(heartbeat_ms),
        stop_grace_ms=200,
        **bound,
    )

    def note(fire: TimerRun) -> None:
        seconds, micros = direct.time()
        server_ms = seconds * 1000 + micros // 1000
        direct.rpush(
            log_key,
            f"start|{instance}|{fire.key}|{fire.attempt}|{fire.fence}|{fire.trigger}|{server_ms}",
        )

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        await anyio.to_thread.run_sync(note, fire)
        if fire.key.startswith("long"):
            await anyio.sleep(30)
        elif fire.key.startswith("slow"):
            await anyio.sleep(0.5)
            await anyio.to_thread.run_sync(direct.rpush, log_key, f"done|{instance}|{fire.key}")

    run_until_sigterm(scheduler, event_loop)


if __name__ == "__main__":
    main()
