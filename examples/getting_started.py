"""The app of the getting-started guide: a quick job every five seconds, and a slow one
every thirty that takes twenty, so that a runner can be killed mid-run and a backup
seen taking the run over."""

import os

import anyio

from anarchon import RedisBackend, Run, Scheduler

url = os.environ.get("REDIS_URL", "redis://localhost:6379")
# A short lease, so that a backup takes over within seconds of a runner's death.
scheduler = Scheduler(RedisBackend(redis=url, prefix="getting-started:"), lease_ms=6_000)


@scheduler.job("*/5 * * * * *")
async def tick(run: Run) -> None:
    print(f"tick   slot {run.slot:%H:%M:%S} ran here (attempt {run.attempt})", flush=True)


@scheduler.job("*/30 * * * * *")
async def report(run: Run) -> None:
    print(
        f"report slot {run.slot:%H:%M:%S} attempt {run.attempt} fence {run.fence}: started",
        flush=True,
    )
    await anyio.sleep(20)
    print(f"report slot {run.slot:%H:%M:%S} attempt {run.attempt}: done", flush=True)
