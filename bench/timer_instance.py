"""One scheduler instance firing timers, in a process of its own, for benchmarks.

    python -m bench.timer_instance CONFIG_JSON
        (url, prefix, name; optional loop, lease_ms, heartbeat_ms, hang: each handler runs
        until its process dies, printing {"event": "start", ...} as it begins; cluster: the
        url is a cluster node's, reached through redis-py's asyncio cluster client;
        buckets: the kind's buckets; keys: the result lists each firing's key too;
        handler_ms: each handler sleeps so long; max_concurrent: the instance's bound,
        "default" or absent for the library's; progress: print {"event": "start"|"done",
        "key": ..., "t": ...} as each handler begins and ends)

Registers the timer kind ``bench``, prints ``{"ready": true}``, reads ``{"start_at": t,
"end_at": t}`` (wall clock) from stdin, runs the scheduler from ``start_at`` to
``end_at`` and prints ``{"result": ...}``: each firing's due time and handler start
(epoch ms), and samples of its process CPU time.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import anyio
import anyio.to_thread

from anarchon import RedisBackend, Scheduler, TimerRun


def main() -> None:
    config = json.loads(sys.argv[1])
    fired: list[tuple[int, float, int]] = []
    samples: list[tuple[float, float]] = []
    keys: list[str] = []

    async def handler(fire: TimerRun) -> None:
        started_ms = time.time() * 1000
        fired.append((fire.due_ms, round(started_ms, 2), fire.attempt))
        if config.get("keys"):
            keys.append(fire.key)
        if config.get("hang"):
            event = {"event": "start", "t": started_ms / 1000, "attempt": fire.attempt}
            print(json.dumps(event), flush=True)
            await anyio.sleep_forever()
        progress = bool(config.get("progress"))
        if progress:
            print(json.dumps({"event": "start", "key": fire.key, "t": started_ms / 1000}))
        await anyio.sleep(config.get("handler_ms", 0) / 1000)
        if progress:
            print(json.dumps({"event": "done", "key": fire.key, "t": time.time()}), flush=True)

    async def sample_cpu() -> None:
        while True:
            samples.append((time.time(), time.process_time()))
            await anyio.sleep(0.25)

    async def run_for_a_while() -> None:
        options: dict[str, Any] = {"instance_id": config["name"]}
        for name in ("lease_ms", "heartbeat_ms"):
            if config.get(name):
                options[name] = config[name]
        if config.get("max_concurrent", "default") != "default":
            options["max_concurrent"] = config["max_concurrent"]
        target: Any = config["url"]
        if config.get("cluster"):  # asyncio only: redis-py's cluster client
            import redis.asyncio

            target = redis.asyncio.RedisCluster.from_url(config["url"], protocol=2)
        scheduler = Scheduler(RedisBackend(redis=target, prefix=config["prefix"]), **options)
        scheduler.add_timer(handler, "bench", buckets=config.get("buckets", 1))
        print(json.dumps({"ready": True}), flush=True)
        window = json.loads(await anyio.to_thread.run_sync(sys.stdin.readline))
        await anyio.sleep(window["start_at"] - time.time())
        async with anyio.create_task_group() as group:
            group.start_soon(sample_cpu)
            async with scheduler:
                await anyio.sleep(window["end_at"] - time.time())
            samples.append((time.time(), time.process_time()))
            group.cancel_scope.cancel()
        if not isinstance(target, str):
            await target.aclose()

    anyio.run(run_for_a_while, backend=config.get("loop", "asyncio"))
    result = {"name": config["name"], "fired": fired, "cpu": samples, "keys": keys}
    print(json.dumps({"result": result}))


if __name__ == "__main__":
    main()
