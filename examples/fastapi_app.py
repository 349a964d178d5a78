"""A FastAPI app that runs anarchon in its lifespan: the job runs while the app serves.

    REDIS_URL=redis://localhost:6379 uvicorn examples.fastapi_app:app

The same app, as is, under several workers (each runs its own scheduler, and each
slot still runs once across them):

    uvicorn examples.fastapi_app:app --workers 2
    gunicorn examples.fastapi_app:app -k uvicorn_worker.UvicornWorker -w 2
"""

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from anarchon import RedisBackend, Run, Scheduler

logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(process)d] %(name)s: %(message)s")
log = logging.getLogger("app")

scheduler = Scheduler(
    RedisBackend(
        redis=os.environ.get("REDIS_URL", "redis://localhost:6379"),
        prefix=os.environ.get("ANARCHON_PREFIX", "fastapi-app:"),  # one prefix per application
    ),
    stop_grace_ms=10_000,  # what a running job gets to finish when the server stops
)


@scheduler.job("* * * * * *")  # every second (six fields: seconds first)
async def tick(run: Run) -> None:
    log.info("tick %s attempt %d fence %d", f"{run.slot:%H:%M:%S}", run.attempt, run.fence)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with scheduler:  # starts with the app, stops gracefully when it shuts down
        yield


app = FastAPI(lifespan=lifespan)


@app.get("/")
async def index() -> dict[str, object]:
    """Which worker answered, and the job's last runs (whichever worker ran them)."""
    runs = await scheduler.history("tick", limit=5)
    return {
        "instance": scheduler.instance_id,
        "last_runs": [{"slot": r.slot, "runner": r.runner, "status": r.status} for r in runs],
    }
