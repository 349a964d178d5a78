"""A dead run always settles (design section 8): an expired lease is retried or
settled interrupted whatever the job's cadence, and the active set stays bounded.

The dead runner here is a real claim by an instance that then vanishes: its
attempt is won on the server and never heartbeated or finished."""

from __future__ import annotations

import secrets
import time
from contextlib import AsyncExitStack

import anyio
import pytest
import redis

from anarchon import RedisBackend, Run, Scheduler
from anarchon._store.contract import ClaimRequest
from anarchon._store.keys import JobKeys
from anarchon.clients import ServerReplyError
from tests.helpers import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]

LEASE_MS = 1500
EVERY_MS = 250  # the job fires six times per lease
BUSY_SEC = 0.2  # and each run takes most of its period, so a newer run is nearly always live


async def claim_as_a_runner_that_then_dies(server_url: str, prefix: str, slot_ms: int) -> int:
    """Win ``slot_ms`` of job ``fast`` for a runner that is never heard of again."""
    backend = RedisBackend(redis=server_url, prefix=prefix)
    store = await backend.open({"runner": "dead", "history_size": 100, "history_ttl_ms": None})
    try:
        request = ClaimRequest(
            "fast", str(slot_ms), slot_ms, secrets.token_hex(8), "schedule", LEASE_MS, 3,
            False, 600_000,
        )  # fmt: skip
        (reply,) = await store.claim_many([request])
        assert not isinstance(reply, ServerReplyError) and reply.kind == "won", reply
        return reply.fence
    finally:
        await store.conn.aclose()


def schedulers(server_url: str, prefix: str, count: int) -> list[Scheduler]:  # type: ignore[type-arg]
    made = []
    for index in range(count):
        made.append(
            Scheduler(
                RedisBackend(redis=server_url, prefix=prefix),
                lease_ms=LEASE_MS,
                heartbeat_ms=300,
                retry_delay_ms=200,
                instance_id=f"i{index}",
            )
        )
    return made


async def test_a_dead_runner_of_a_job_faster_than_its_lease_is_replaced(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """The job fires every 250 ms, its lease is 1.5 s. The dead run must be taken
    over (attempt 2, a higher fence, by a live instance) and settle; newer slots
    do not start while it is unsettled, and the active set does not grow."""
    dead_slot = (int(time.time() * 1000) // EVERY_MS + 2) * EVERY_MS
    dead_fence = await claim_as_a_runner_that_then_dies(server_url, prefix, dead_slot)
    runs: list[tuple[int, int, int, str]] = []
    fleet = schedulers(server_url, prefix, 2)
    for scheduler in fleet:

        @scheduler.job(every_ms=EVERY_MS, name="fast")
        async def fast(run: Run) -> None:
            runs.append((run.slot_ms, run.attempt, run.fence, run.runner))
            await anyio.sleep(BUSY_SEC)

    keys = JobKeys.for_job(prefix, "fast")
    async with AsyncExitStack() as stack:
        for scheduler in fleet:
            await stack.enter_async_context(scheduler)
        await wait_until(
            lambda: any(slot == dead_slot for slot, *_ in runs),
            3 * LEASE_MS / 1000 + 2,
            "the dead run to be taken over",
        )
        await anyio.sleep(1.0)
        active = direct.smembers(keys.active)

    taken_over = [r for r in runs if r[0] == dead_slot]
    assert len(taken_over) == 1, taken_over
    _, attempt, fence, runner = taken_over[0]
    assert attempt == 2 and fence > dead_fence and runner in ("i0", "i1")
    state = str(direct.hget(keys.state, str(dead_slot))).split("|")
    assert state[0] == "ok", state
    # Nothing piles up: at most the run in flight when the block was left.
    assert len(active) <= 1, active
    # Later slots ran again once the dead run was settled.
    assert any(slot > dead_slot for slot, *_ in runs)


async def test_a_failed_runs_retry_is_not_starved_by_newer_slots(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """A failed attempt waits for its retry delay; slots due meanwhile do not start
    (they would block the retry), and the retry runs."""
    attempts: list[tuple[int, int]] = []
    failing_slot: list[int] = []
    fleet = schedulers(server_url, prefix, 2)
    for scheduler in fleet:

        @scheduler.job(every_ms=EVERY_MS, name="fast")
        async def fast(run: Run) -> None:
            attempts.append((run.slot_ms, run.attempt))
            if not failing_slot:
                failing_slot.append(run.slot_ms)
            if run.slot_ms == failing_slot[0] and run.attempt == 1:
                # Fails late enough that the retry is due after the next slot's instant.
                await anyio.sleep(0.1)
                raise RuntimeError("the first attempt fails")
            await anyio.sleep(BUSY_SEC)

    async with AsyncExitStack() as stack:
        for scheduler in fleet:
            await stack.enter_async_context(scheduler)
        await wait_until(
            lambda: bool(failing_slot) and (failing_slot[0], 2) in attempts,
            5,
            "the retry of the failed run",
        )
        await anyio.sleep(0.5)

    keys = JobKeys.for_job(prefix, "fast")
    state = str(direct.hget(keys.state, str(failing_slot[0]))).split("|")
    assert state[:2] == ["ok", "2"], state
