"""A scheduler that connects as an ACL user with no more rights than it needs: the rules
``anarchon acl --prefix acl-example:`` prints (its keys, its hint channel, its commands).

    read -rs REDIS_URL && export REDIS_URL && python acl.py

where REDIS_URL, pasted without echo (so that the password is on no command line and in
no shell history), is ``redis://anarchon:PASSWORD@cache.internal:6379/0``.

Its job runs every five seconds and sets a timer, which fires two seconds later on
whichever instance takes it: jobs, timers and their hints all work as that user.
"""

import logging
import os

import anyio

from anarchon import RedisBackend, Run, Scheduler, TimerRun, serve

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
log = logging.getLogger("app")

scheduler = Scheduler(
    RedisBackend(
        redis=os.environ["REDIS_URL"],  # the user and its password are in the URL
        prefix=os.environ.get("ANARCHON_PREFIX", "acl-example:"),
    )
)


@scheduler.job("*/5 * * * * *")  # every five seconds
async def audit(run: Run) -> None:
    log.info("audit %s attempt %d fence %d", f"{run.slot:%H:%M:%S}", run.attempt, run.fence)
    await scheduler.set_timer("follow-up", f"audit-{run.slot_ms}", delay_ms=2_000)


@scheduler.timer("follow-up")
async def follow_up(fire: TimerRun) -> None:
    log.info("follow-up %s fired, fence %d", fire.key, fire.fence)


if __name__ == "__main__":
    anyio.run(serve, scheduler)  # until SIGTERM or Ctrl-C, then a graceful stop
