"""A scheduler whose server is found through Redis Sentinel (or Valkey's): anarchon asks
the Sentinels which server is the primary, and asks them again after a failover.

    REDIS_URL='redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster/0' python sentinel.py

A user and password before the hosts are the primary's
(``redis+sentinel://app:secret@10.0.0.1:26379,.../mymaster/0``); the Sentinels' own, if
they need any, go in the query (``?sentinel_username=...&sentinel_password=...``).
"""

import logging
import os

import anyio

from anarchon import RedisBackend, Run, Scheduler, serve

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
log = logging.getLogger("app")

scheduler = Scheduler(
    RedisBackend(
        redis=os.environ["REDIS_URL"],
        prefix=os.environ.get("ANARCHON_PREFIX", "sentinel-example:"),
    )
)


@scheduler.job("*/5 * * * * *")  # every five seconds
async def sync(run: Run) -> None:
    # Around a failover, a claim the old primary acknowledged but never passed on can be
    # won again on the new one: give run.fence to the stores the job writes to.
    log.info("sync %s attempt %d fence %d", f"{run.slot:%H:%M:%S}", run.attempt, run.fence)


if __name__ == "__main__":
    anyio.run(serve, scheduler)  # until SIGTERM or Ctrl-C, then a graceful stop
