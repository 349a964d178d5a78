"""An application's scheduled code: a report every day at 03:00 Athens time, and a
reminder 30 minutes after a user signs up (a durable timer).

``test_app.py`` beside it tests both on virtual time, days in seconds."""

from __future__ import annotations

from anarchon import RedisBackend, Run, Scheduler, TimerRun

#: Stands in for the application's mail service.
outbox: list[str] = []


async def report(run: Run) -> None:
    outbox.append(f"the report of {run.slot:%Y-%m-%d}")


async def remind(fire: TimerRun) -> None:
    outbox.append(f"a reminder to {fire.key}")


def make_scheduler(url: str = "redis://localhost:6379") -> Scheduler:
    """The application's scheduler (a new one for each start: a scheduler starts once)."""
    scheduler = Scheduler(RedisBackend(url, prefix="shop:"))
    scheduler.add_job(report, "0 3 * * *", timezone="Europe/Athens", name="report")
    scheduler.timer("remind")(remind)
    return scheduler


async def signup(scheduler: Scheduler, user: int) -> None:
    """What the application does when a user signs up."""
    await scheduler.set_timer("remind", f"user:{user}", delay_ms=30 * 60_000)
