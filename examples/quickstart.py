"""Every five seconds, one instance of the fleet says hello: start this file in two or
three terminals and each slot runs in one of them. Ctrl-C stops it gracefully."""

import logging
import os

import anyio

from anarchon import RedisBackend, Run, Scheduler, serve

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
url = os.environ.get("REDIS_URL", "redis://localhost:6379")
scheduler = Scheduler(RedisBackend(redis=url, prefix="quickstart:"))  # one prefix per app


@scheduler.job("*/5 * * * * *")  # six fields, seconds first: every five seconds
async def hello(run: Run) -> None:
    print(f"hello from {run.runner}: slot {run.slot:%H:%M:%S}, attempt {run.attempt}")


if __name__ == "__main__":
    anyio.run(serve, scheduler)  # until Ctrl-C or SIGTERM, then a graceful stop
