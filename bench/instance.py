"""One scheduler instance in a process of its own, for benchmarks.

    python -m bench.instance URL PREFIX NAME JOBS SECONDS EVENT_LOOP STRATEGY

Runs JOBS jobs firing every second for SECONDS and prints one JSON line: the
lateness of every run it started (handler start minus slot instant, ms) and its
process CPU time.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import anyio

from anarchon import RedisBackend, Run, Scheduler


def main() -> None:
    url, prefix, name, jobs, seconds, event_loop, strategy = sys.argv[1:8]
    lateness_ms: list[float] = []
    backend: Any = RedisBackend(redis=url, prefix=prefix, strategy=strategy)
    scheduler: Any = Scheduler(backend, instance_id=name)

    async def handler(run: Run) -> None:
        lateness_ms.append(time.time() * 1000 - run.slot_ms)

    for index in range(int(jobs)):
        scheduler.add_job(handler, "* * * * * *", name=f"job{index:05d}")

    async def run_for_a_while() -> None:
        async with scheduler:
            await anyio.sleep(float(seconds))

    cpu_before = time.process_time()
    anyio.run(run_for_a_while, backend=event_loop)
    print(json.dumps({"lateness_ms": lateness_ms, "cpu_sec": time.process_time() - cpu_before}))


if __name__ == "__main__":
    main()
