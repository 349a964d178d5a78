"""The raw client ceiling in a process of its own: the lease claim script, pipelined.

    python -m bench.rawclient CONFIG_JSON      (the fields of bench.common.RawConfig)

Connects with the client library (redis-py or valkey-py asyncio pipelines, or a
Valkey GLIDE batch, as the scheduler's connections use them), prints
``{"ready": true}``, reads ``{"start_at": t, ...}`` from stdin, then from
``start_at`` claims the first slot of ``jobs`` fresh jobs in pipelines of
``batch``, one pipeline in flight at a time, and prints ``{"result": ...}``
(wall-clock start and end, process CPU time, claims won).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from bench.common import claim_args, open_glide, ready_then_wait

Send = Callable[[Sequence[Sequence[Any]]], Awaitable[list[Any]]]


async def connect(kind: str, url: str) -> tuple[Send, Callable[[], Awaitable[Any]]]:
    if kind in ("redis-py", "valkey-py"):
        client: Any
        if kind == "redis-py":
            import redis.asyncio

            # As anarchon opens its own asyncio connections: no per-reply timeout.
            client = redis.asyncio.Redis.from_url(url, protocol=2, socket_timeout=None)
        else:
            import valkey.asyncio

            client = valkey.asyncio.Valkey.from_url(url, protocol=2)

        async def send(calls: Sequence[Sequence[Any]]) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for call in calls:
                pipe.execute_command("EVALSHA", *call)
            return list(await pipe.execute())

        return send, client.aclose
    if kind == "glide":
        import glide

        glide_client = await open_glide(url)

        async def send_glide(calls: Sequence[Sequence[Any]]) -> list[Any]:
            batch = glide.Batch(is_atomic=False)
            for call in calls:
                batch.custom_command(["EVALSHA", *(str(a) for a in call)])
            return list(await glide_client.exec(batch, raise_on_error=True) or [])

        return send_glide, glide_client.close
    raise SystemExit(f"unknown client {kind!r}")


async def main() -> None:
    config = json.loads(sys.argv[1])
    send, close = await connect(config["client"], config["url"])
    calls = [
        claim_args(f"job{i:06d}", config["prefix"], config["slot_ms"], config["name"])
        for i in range(config["jobs"])
    ]
    await ready_then_wait()
    cpu_before = time.process_time()
    started = time.time()
    won = 0
    batch = config["batch"]
    for offset in range(0, len(calls), batch):
        for reply in await send(calls[offset : offset + batch]):
            head = reply[0]
            won += head in (b"won", "won")
    ended = time.time()
    cpu_sec = time.process_time() - cpu_before
    await close()
    result = {"started": started, "ended": ended, "cpu_sec": cpu_sec, "won": won}
    print(json.dumps({"result": result}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
