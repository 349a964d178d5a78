"""A fleet's application for the dashboard's tests: ``anarchon run tests.web_app:make``.

Configured by ``APP_URL`` and ``APP_PREFIX``. Its jobs: ``report`` every second (a
few milliseconds of work), ``slow`` every two seconds (works 30 s, so a run is always
in progress and the slots between are skipped), ``flaky`` every two seconds (always
fails, once); and the timer kind ``remind``.
"""

from __future__ import annotations

import os

import anyio

from anarchon import RedisBackend, Run, Scheduler, TimerRun


def make() -> Scheduler:  # type: ignore[type-arg]
    scheduler = Scheduler(
        RedisBackend(redis=os.environ["APP_URL"], prefix=os.environ["APP_PREFIX"]),
        lease_ms=10_000,
        stop_grace_ms=200,
    )

    @scheduler.job("* * * * * *", name="report")
    async def report() -> None:
        await anyio.sleep(0.01)

    @scheduler.job("*/2 * * * * *", name="slow")
    async def slow() -> None:
        await anyio.sleep(30)

    @scheduler.job("*/2 * * * * *", name="flaky", max_attempts=1)
    async def flaky(run: Run) -> None:
        raise RuntimeError(f"the payment provider said no (slot {run.slot:%H:%M:%S})")

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        pass

    return scheduler
