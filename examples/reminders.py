"""The scheduler that fires the reminders the web apps set. Run it next to the app:

    REDIS_URL=redis://localhost:6379 anarchon run examples.reminders:scheduler

Run as many copies as you like: each reminder fires once, on one of them.
"""

import logging
import os

from anarchon import RedisBackend, Scheduler, TimerRun

log = logging.getLogger("reminders")

scheduler = Scheduler(
    RedisBackend(
        redis=os.environ.get("REDIS_URL", "redis://localhost:6379"),
        # One prefix per application: the web apps that set these timers use it too.
        prefix=os.environ.get("ANARCHON_PREFIX", "reminders:"),
    )
)


@scheduler.timer("remind")
async def remind(fire: TimerRun) -> None:
    # Send the e-mail, the push notification... Pass fire.fence to stores you write to.
    log.info(
        "remind %s: %s (attempt %d, fence %d)", fire.key, fire.payload, fire.attempt, fire.fence
    )
