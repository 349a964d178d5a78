"""The application of the deployment recipes (Docker Compose, Kubernetes, systemd).

Every copy of it runs the same jobs, and each slot runs on one copy::

    REDIS_URL=redis://localhost:6379 anarchon run app:scheduler

The server's URL comes from the environment (``REDIS_URL``), never from the command
line, where every user of the machine can read it.
"""

import logging
import os

from anarchon import RedisBackend, Run, Scheduler

log = logging.getLogger("app")

scheduler = Scheduler(
    RedisBackend(
        redis=os.environ.get("REDIS_URL", "redis://localhost:6379"),
        prefix=os.environ.get("ANARCHON_PREFIX", "myapp:"),  # one prefix per application
    ),
    # What a running job gets to finish when the copy is stopped: keep it shorter than
    # the grace period of whatever stops it (compose.yaml's stop_grace_period,
    # Kubernetes' terminationGracePeriodSeconds, systemd's TimeoutStopSec).
    stop_grace_ms=20_000,
)


@scheduler.job("*/5 * * * * *")  # six fields, seconds first: every five seconds
async def heartbeat(run: Run) -> None:
    slot = f"{run.slot:%H:%M:%S}"
    log.info("heartbeat %s on %s, attempt %d, fence %d", slot, run.runner, run.attempt, run.fence)


@scheduler.job("0 3 * * *", max_attempts=3)  # every night at 03:00 UTC, retried twice
def nightly_report(run: Run) -> None:  # a plain function runs in a worker thread
    log.info("building the report of %s", f"{run.slot:%Y-%m-%d}")
