"""Every slot runs exactly once across instances, with every strategy, on every server
that has it, under both event loops."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest
import redis

from anarchon import RedisBackend, Run, Scheduler
from tests.helpers import Ledger
from tests.servers import NO_IDMP, ServerSpec, has_idmp

pytestmark = pytest.mark.anyio

INSTANCES = 5
JOBS = 20
SECONDS = 10


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["lease", "stream-id", "idmp", "script"])
async def test_each_slot_runs_exactly_once_with_five_instances_and_twenty_jobs(
    server: ServerSpec, server_url: str, prefix: str, direct: redis.Redis, strategy: str
) -> None:
    if strategy == "idmp" and not has_idmp(server):
        pytest.skip(NO_IDMP.format(server.id))
    ledger = Ledger(direct, prefix)
    schedulers: list[Scheduler[Any]] = []
    for index in range(INSTANCES):
        backend: Any = RedisBackend(redis=server_url, prefix=prefix, strategy=strategy)  # type: ignore[call-overload]
        scheduler: Scheduler[Any] = Scheduler(backend, instance_id=f"instance-{index}")
        for job_index in range(JOBS):

            async def handler(run: Run) -> None:
                await ledger.record(run)

            scheduler.add_job(handler, "* * * * * *", name=f"job{job_index:02d}")
        schedulers.append(scheduler)

    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        all_started_ms = time.time() * 1000
        await anyio.sleep(SECONDS)
        stopping_ms = time.time() * 1000

    jobs = [f"job{j:02d}" for j in range(JOBS)]
    expected = ledger.assert_each_slot_ran_once(jobs, all_started_ms, stopping_ms)
    assert expected >= JOBS * (SECONDS - 2)
