"""A user's application for ``anarchon run`` tests: ``anarchon run tests.run_app:make``.

Configured by the environment: ``APP_URL``, ``APP_PREFIX``, ``APP_LEASE_MS``,
``APP_STOP_GRACE_MS``, and ``APP_ONE_SLOT`` (set: its job ``work`` fires once, at the
slot the test hands over on stdin once the instance has started, ``SlotOnStdin``;
unset, ``work`` fires by ``APP_CRON``, every second unless given). The handler appends
``start|instance|attempt|fence|server_ms`` to the list ``<APP_PREFIX>log``, then
works for ``APP_WORK_SEC`` (30 s) and appends ``finish|...``.
"""

from __future__ import annotations

import os

import anyio
import redis

from anarchon import RedisBackend, Run, Scheduler
from tests.helpers import SlotOnStdin


def make() -> Scheduler:  # type: ignore[type-arg]
    url, prefix = os.environ["APP_URL"], os.environ["APP_PREFIX"]
    scheduler = Scheduler(
        RedisBackend(redis=url, prefix=prefix),
        lease_ms=int(os.environ.get("APP_LEASE_MS", "30000")),
        stop_grace_ms=int(os.environ.get("APP_STOP_GRACE_MS", "200")),
    )
    work_sec = float(os.environ.get("APP_WORK_SEC", "30"))
    cron = os.environ.get("APP_CRON", "* * * * * *")
    schedule = SlotOnStdin() if os.environ.get("APP_ONE_SLOT") else cron

    def note(event: str, run: Run) -> None:
        direct = redis.Redis.from_url(url, decode_responses=True, protocol=2)
        seconds, micros = direct.time()
        server_ms = seconds * 1000 + micros // 1000
        entry = f"{event}|{run.runner}|{run.attempt}|{run.fence}|{server_ms}|{run.slot_ms}"
        direct.rpush(f"{prefix}log", entry)
        direct.close()

    @scheduler.job(schedule, name="work")
    async def work(run: Run) -> None:
        await anyio.to_thread.run_sync(note, "start", run)
        await anyio.sleep(work_sec)
        await anyio.to_thread.run_sync(note, "finish", run)

    return scheduler


not_a_scheduler = 42
