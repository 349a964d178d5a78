"""Pause and resume: a flag in the job's state that every instance's claim script reads, so
the whole fleet honours it at its next claim. Paused slots are recorded as skipped, once
each (not once per instance); manual runs go on; resume runs the next slot."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import anyio
import pytest

from anarchon import (
    InvalidJobError,
    InvalidOptionError,
    RedisBackend,
    Run,
    Scheduler,
    SchedulerStateError,
)
from tests.helpers import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


@pytest.mark.server_tier  # the claim script's paused branch, checked nowhere else
async def test_a_pause_is_honoured_by_every_instance_and_its_slots_are_recorded_skipped(
    server_url: str, prefix: str
) -> None:
    ran: list[tuple[int, str]] = []
    schedulers = []
    for name in ("a", "b", "c"):
        scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), instance_id=name)

        @scheduler.job("* * * * * *", name="tick")
        async def tick(run: Run) -> None:
            ran.append((run.slot_ms, run.runner))

        schedulers.append(scheduler)
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await wait_until(lambda: len(ran) >= 2, 20, "runs before the pause")
        assert await schedulers[0].pause("tick") is True
        paused_ms = time.time() * 1000
        assert await schedulers[1].pause("tick") is False  # paused already
        await anyio.sleep(3.2)
        assert await schedulers[2].resume("tick") is True
        resumed_ms = time.time() * 1000
        assert await schedulers[2].resume("tick") is False
        await wait_until(
            lambda: any(slot > resumed_ms for slot, _ in ran), 20, "a run after the resume"
        )
        history = await schedulers[0].history("tick", limit=1000)

    during = [slot for slot, _ in ran if paused_ms < slot <= resumed_ms - 50]
    assert during == [], during
    skipped = [r for r in history if r.status == "skipped"]
    assert len(skipped) >= 2, history
    for result in skipped:
        assert result.error == "paused: the job is paused" and result.attempt == 0
        assert paused_ms - 1000 < result.slot_ms <= resumed_ms, result
    skipped_slots = [r.slot_ms for r in skipped]
    assert len(set(skipped_slots)) == len(skipped_slots)  # once each, for the fleet
    ran_slots = [slot for slot, _ in ran]
    assert len(set(ran_slots)) == len(ran_slots)
    assert not set(skipped_slots) & set(ran_slots)


async def test_a_manual_run_of_a_paused_job_runs(server_url: str, prefix: str) -> None:
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job("0 0 1 1 *", name="yearly")
    async def yearly() -> None:
        pass

    async with scheduler:
        await scheduler.pause("yearly")
        result = await scheduler.run_now("yearly")
    assert (result.status, result.trigger) == ("ok", "manual")


async def test_pause_names_a_job_of_this_scheduler_and_needs_it_running(
    server_url: str, prefix: str
) -> None:
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job("* * * * *", name="known")
    async def known() -> None:
        pass

    with pytest.raises(SchedulerStateError, match="running scheduler"):
        await scheduler.pause("known")
    async with scheduler:
        with pytest.raises(InvalidJobError, match="no job named 'typo'"):
            await scheduler.pause("typo")
        with pytest.raises(InvalidJobError, match="no job named 'typo'"):
            await scheduler.resume("typo")


async def test_pause_needs_the_lease_strategy(server_url: str, prefix: str) -> None:
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix, strategy="stream-id"))

    @scheduler.job("* * * * *", name="known")
    async def known() -> None:
        pass

    async with scheduler:
        with pytest.raises(InvalidOptionError, match="'lease' strategy"):
            await scheduler.pause("known")
