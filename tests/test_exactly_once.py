"""Every slot runs exactly once across instances, with every strategy, on every server
that has it, under both event loops."""

from __future__ import annotations

import math
import time
from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest
import redis

from anarchon import RedisBackend, Run, Scheduler, UnsupportedServerError
from tests.helpers import Ledger
from tests.servers import ServerSpec

pytestmark = pytest.mark.anyio

INSTANCES = 5
JOBS = 20
SECONDS = 10


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["lease", "stream-id", "idmp", "script"])
async def test_each_slot_runs_exactly_once_with_five_instances_and_twenty_jobs(
    server: ServerSpec, server_url: str, prefix: str, direct: redis.Redis, strategy: str
) -> None:
    if strategy == "idmp" and not (server.family == "redis" and server.version >= (8, 6)):
        # Refused at start (tests/test_strategies.py checks the message).
        with pytest.raises(UnsupportedServerError):
            async with Scheduler(RedisBackend(redis=server_url, prefix=prefix, strategy="idmp")):
                pass
        return
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

    counts = ledger.counts()
    duplicates = {slot: n for slot, n in counts.items() if n != 1}
    assert not duplicates, f"slots that ran more than once: {duplicates}"

    # Every slot after all instances were up and before the stop began ran.
    first_slot = math.ceil(all_started_ms / 1000) * 1000
    last_slot = math.floor(stopping_ms / 1000) * 1000 - 1000
    expected = {
        (f"job{j:02d}", slot)
        for j in range(JOBS)
        for slot in range(first_slot, last_slot + 1, 1000)
    }
    assert len(expected) >= JOBS * (SECONDS - 2)
    missed = sorted(expected - set(counts))
    assert not missed, f"{len(missed)} slots never ran, e.g. {missed[:5]}"
