"""The dashboard mounted under a path of an application of its own, as a user mounts it:
``uvicorn tests.web_mounted:app``. Configured by ``APP_URL``, ``APP_PREFIX`` and
``APP_TOKEN`` (actions allowed with it)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from anarchon import RedisBackend
from anarchon.web import dashboard

MOUNTED_AT = "/ops/anarchon"

board = dashboard(
    RedisBackend(redis=os.environ["APP_URL"], prefix=os.environ["APP_PREFIX"]),
    allow_actions=True,
    token=os.environ["APP_TOKEN"],
    refresh_sec=0,
)


@asynccontextmanager
async def lifespan(_: Starlette) -> AsyncIterator[None]:
    async with board.router.lifespan_context(board):  # closes its connection at the end
        yield


async def home(_: Request) -> PlainTextResponse:
    return PlainTextResponse("the application's own page")


app = Starlette(
    routes=[
        Route("/", home),
        Mount(MOUNTED_AT, app=board),
        # A path that holds what the request gave (the dashboard's links quote it).
        Mount("/teams/{team}/anarchon", app=board),
    ],
    lifespan=lifespan,
)
