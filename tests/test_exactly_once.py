"""Every slot runs exactly once across instances, with every strategy, under both event
loops (the engine tier: its pairs of server and loop; idmp on a server that has it)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest
import redis

from anarchon import RedisBackend, Run, Scheduler
from tests.helpers import Ledger
from tests.servers import ServerSpec

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]

INSTANCES = 5
JOBS = 20
SECONDS = 10


@asynccontextmanager
async def fleet(
    server_url: str,
    prefix: str,
    strategy: str,
    ledger: Ledger,
    before: Callable[[Run], None] = lambda run: None,
) -> AsyncIterator[None]:
    """Five running instances of twenty jobs every second, each run recorded in
    ``ledger`` after ``before``; each instance's skips heard by the ledger."""
    schedulers: list[Scheduler[Any]] = []
    for index in range(INSTANCES):
        backend: Any = RedisBackend(redis=server_url, prefix=prefix, strategy=strategy)  # type: ignore[call-overload]
        scheduler: Scheduler[Any] = Scheduler(backend, instance_id=f"instance-{index}")
        for job_index in range(JOBS):

            async def handler(run: Run) -> None:
                before(run)
                await ledger.record(run)

            scheduler.add_job(handler, "* * * * * *", name=f"job{job_index:02d}")
        ledger.watch(scheduler)
        schedulers.append(scheduler)
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        yield


async def each_slot_runs_exactly_once(
    server_url: str, prefix: str, direct: redis.Redis, strategy: str
) -> None:
    ledger = Ledger(direct, prefix)
    async with fleet(server_url, prefix, strategy, ledger):
        all_started_ms = time.time() * 1000
        await anyio.sleep(SECONDS)
        stopping_ms = time.time() * 1000

    jobs = [f"job{j:02d}" for j in range(JOBS)]
    expected = ledger.assert_each_slot_ran_once(jobs, all_started_ms, stopping_ms)
    assert expected >= JOBS * (SECONDS - 2)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["lease", "stream-id", "script"])
async def test_each_slot_runs_exactly_once_with_five_instances_and_twenty_jobs(
    server_url: str, prefix: str, direct: redis.Redis, strategy: str
) -> None:
    await each_slot_runs_exactly_once(server_url, prefix, direct, strategy)


@pytest.mark.slow
@pytest.mark.needs_idmp
async def test_each_slot_runs_exactly_once_with_idmp_five_instances_and_twenty_jobs(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    await each_slot_runs_exactly_once(server_url, prefix, direct, "idmp")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["lease", "script"])
async def test_no_slot_runs_twice_nor_is_lost_unheard_across_a_stall_of_the_whole_process(
    server: ServerSpec, server_url: str, prefix: str, direct: redis.Redis, strategy: str
) -> None:
    """A handler that blocks the event loop for 3.5 s stalls all five instances, as a
    starved machine does. After it, no slot runs twice; each slot that did not run was
    skipped by the store behind a run still going, or by every instance, each only once
    a newer slot was due (the stale backlog is dropped, not run late)."""
    ledger = Ledger(direct, prefix)
    stall_at = [0]  # the slot of job00 whose handler stalls, set once all are up

    def stall(run: Run) -> None:
        if run.job == "job00" and run.slot_ms == stall_at[0]:
            time.sleep(3.5)  # blocks every instance's loop

    async with fleet(server_url, prefix, strategy, ledger, stall):
        all_started_ms = time.time() * 1000
        stall_at[0] = (int(all_started_ms / 1000) + 3) * 1000
        await anyio.sleep(stall_at[0] / 1000 + 7 - time.time())
        stopping_ms = time.time() * 1000

    jobs = [f"job{j:02d}" for j in range(JOBS)]
    ledger.assert_each_slot_ran_once(jobs, all_started_ms, stopping_ms, stalled_sec=3.5)
    assert ("job00", stall_at[0]) in ledger.counts(), "the stalling slot did not run"
    assert ledger.skipped_everywhere(), "the stall made no instance skip a slot"
