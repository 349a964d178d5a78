"""A scheduler on a Redis or Valkey Cluster, through a cluster client of your own (a URL
given to anarchon opens a connection to one server, not a cluster).

    REDIS_URL=redis://node1:7000 python cluster.py   # any node: the client finds the rest

Each job's keys share one hash tag, so each job lives on one node, and the jobs spread
over the nodes by name.
"""

import logging
import os

import anyio
from redis.asyncio import RedisCluster

from anarchon import RedisBackend, Run, Scheduler, serve

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
log = logging.getLogger("app")


async def orders(run: Run) -> None:
    log.info("orders %s attempt %d fence %d", f"{run.slot:%H:%M:%S}", run.attempt, run.fence)


async def invoices(run: Run) -> None:
    log.info("invoices %s attempt %d fence %d", f"{run.slot:%H:%M:%S}", run.attempt, run.fence)


async def main() -> None:
    client = RedisCluster.from_url(os.environ["REDIS_URL"])  # an asyncio client: asyncio only
    scheduler = Scheduler(
        RedisBackend(redis=client, prefix=os.environ.get("ANARCHON_PREFIX", "cluster-example:"))
    )
    scheduler.add_job(orders, "*/5 * * * * *")  # every five seconds
    scheduler.add_job(invoices, "*/5 * * * * *")
    try:
        await serve(scheduler)  # until SIGTERM or Ctrl-C, then a graceful stop
    finally:
        await client.aclose()  # anarchon never closes a client you passed


if __name__ == "__main__":
    anyio.run(main)
