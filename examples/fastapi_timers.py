"""A FastAPI app that sets durable timers from its endpoints, on one connection for the
app's life; examples/reminders.py fires them. Run both, then set a reminder:

    REDIS_URL=redis://localhost:6379 uvicorn examples.fastapi_timers:app
    REDIS_URL=redis://localhost:6379 anarchon run examples.reminders:scheduler

    curl -X POST 'localhost:8000/remind/ada?in_seconds=5'
"""

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

from anarchon import RedisBackend, Timers

backend = RedisBackend(
    redis=os.environ.get("REDIS_URL", "redis://localhost:6379"),
    prefix=os.environ.get("ANARCHON_PREFIX", "reminders:"),  # the prefix of reminders.py
)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Timers]]:
    async with Timers(backend) as timers:  # opened at startup, closed at shutdown
        yield {"timers": timers}  # each request finds it in request.state


app = FastAPI(lifespan=lifespan)


@app.post("/remind/{user}")
async def remind(user: str, request: Request, in_seconds: int = 30 * 60) -> dict[str, object]:
    timers: Timers = request.state.timers
    generation = await timers.set(
        "remind",
        f"user:{user}",
        delay_ms=in_seconds * 1000,
        payload={"text": "your cart misses you"},
    )
    return {"user": user, "generation": generation}


@app.delete("/remind/{user}")
async def forget(user: str, request: Request) -> dict[str, object]:
    timers: Timers = request.state.timers
    return {"user": user, "cancelled": await timers.cancel("remind", f"user:{user}")}
