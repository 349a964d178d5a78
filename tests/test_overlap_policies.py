"""The ``replace`` and ``buffer_one`` overlap policies, on two instances and a real
server: a new slot of a ``replace`` job ends the run in progress (recorded cancelled,
its handler cancelled within a heartbeat wherever it runs) and runs; behind a slow run
of a ``buffer_one`` job only the newest waiting slot runs, the older ones are recorded
skipped."""

from __future__ import annotations

import itertools
import time
from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest

from anarchon import (
    Inspector,
    IntervalSchedule,
    InvalidOptionError,
    RedisBackend,
    Run,
    Scheduler,
)
from anarchon._store.contract import ClaimRequest, HeartbeatRequest
from tests.helpers import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]

LEASE_MS = 4000
HEARTBEAT_MS = 300


def fleet(url: str, prefix: str) -> list[Scheduler[Any]]:
    return [
        Scheduler(
            RedisBackend(redis=url, prefix=prefix),
            instance_id=name,
            lease_ms=LEASE_MS,
            heartbeat_ms=HEARTBEAT_MS,
        )
        for name in ("a", "b")
    ]


async def test_a_new_slot_of_a_replace_job_ends_the_run_in_progress_and_runs(
    server_url: str, prefix: str
) -> None:
    """Every slot's run would last for ever: each new slot (every 1.5 s) starts without
    waiting for the older run's lease, with a higher fence; the run it replaces is
    recorded cancelled with the replacing slot named, and that run's handler is
    cancelled long before its lease (4 s) would have run out, whichever instance ran
    it."""
    starts: list[tuple[int, int, str, float]] = []
    ends: dict[int, float] = {}
    schedulers = fleet(server_url, prefix)
    for scheduler in schedulers:

        async def forever(run: Run) -> None:
            starts.append((run.slot_ms, run.fence, run.runner, time.time()))
            try:
                await anyio.sleep_forever()
            finally:
                ends[run.slot_ms] = time.time()

        scheduler.add_job(forever, IntervalSchedule(1500), name="sync", overlap="replace")
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await wait_until(lambda: len(starts) >= 4, 30, "four slots to start")
        ran = sorted(starts)
        await wait_until(lambda: all(slot in ends for slot, *_ in ran[:-1]), 10, "the ends")
        async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
            history = {r.slot_ms: r for r in await inspector.history("sync")}
    for (slot, fence, *_), (newer, newer_fence, _, newer_started) in itertools.pairwise(ran):
        assert newer_fence > fence
        assert newer - slot == 1500, "a slot did not run"
        # It did not wait for the older run's lease (4 s) to run out.
        assert newer_started - newer / 1000 < LEASE_MS / 1000 - 1, "it waited for the lease"
        assert ends[slot] - newer_started < LEASE_MS / 1000 - 1, "cancelled by its lease only"
        record = history[slot]
        assert record.status == "cancelled", record
        assert record.error is not None and f"slot {newer}" in record.error, record


async def test_behind_a_slow_run_a_buffer_one_job_runs_only_the_newest_waiting_slot(
    server_url: str, prefix: str
) -> None:
    """A job every 300 ms whose first run takes 1.5 s: of the slots that come during it,
    only the newest runs once it ends; each older one is recorded skipped, with the
    reason, once; no slot runs twice, and the job goes on at its pace afterwards.

    When the long run ends within a claim's time of the next slot, that slot is the
    newest and runs in place of the one that waited (which is skipped like the others)."""
    starts: list[int] = []
    long_run: list[float] = []
    schedulers = fleet(server_url, prefix)
    for scheduler in schedulers:

        async def burst(run: Run) -> None:
            starts.append(run.slot_ms)
            if not long_run:
                long_run.append(time.time())
                await anyio.sleep(1.5)
                long_run.append(time.time())

        scheduler.add_job(burst, IntervalSchedule(300), name="burst", overlap="buffer_one")
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await wait_until(lambda: len(long_run) == 2 and len(starts) >= 6, 30, "runs after it")
        async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
            history = await inspector.history("burst")
    first = starts[0]
    ended_ms = long_run[1] * 1000
    after = min(slot for slot in starts if slot > first)
    assert after < ended_ms + 300, ("a period lost after the long run", after - ended_ms)
    skipped = [r for r in history if first < r.slot_ms < after]
    assert len(skipped) >= 3, skipped  # 1.5 s of slots every 300 ms
    for record in skipped:
        assert record.status == "skipped" and record.error is not None, record
        assert "newer slot waits in its place" in record.error, record
    assert len(starts) == len(set(starts)), "a slot ran twice"
    assert len([r for r in history if r.slot_ms == skipped[0].slot_ms]) == 1


def test_the_overlap_policies_are_named_in_the_error() -> None:
    scheduler = Scheduler(RedisBackend())

    async def job() -> None:
        pass

    for policy in ("replace", "buffer_one"):
        scheduler.add_job(job, "* * * * *", name=policy, overlap=policy)
    with pytest.raises(InvalidOptionError, match="'replace' or 'buffer_one'"):
        scheduler.add_job(job, "* * * * *", name="bad", overlap="cancel")  # type: ignore[arg-type]


@pytest.mark.server_tier
async def test_the_claim_script_replaces_older_runs_and_records_a_superseded_slot(
    server_url: str, prefix: str
) -> None:
    """On every server: a replacing first claim ends the running older slot (recorded
    cancelled, naming the new slot; its heartbeat refused from then on) and wins with a
    higher fence; a superseded claim of a slot nobody started records it skipped, once."""
    backend = RedisBackend(redis=server_url, prefix=prefix)
    store = await backend.open({"runner": "a", "history_size": 100, "history_ttl_ms": None})
    base = (int(time.time() * 1000) // 1000) * 1000

    def claim(slot_ms: int, **flags: bool) -> ClaimRequest:
        return ClaimRequest(
            "swap", str(slot_ms), slot_ms, f"t{slot_ms}", "schedule", 30_000, 3, False,
            600_000, **flags,
        )  # fmt: skip

    try:
        (old,) = await store.claim_many([claim(base)])
        (new,) = await store.claim_many([claim(base + 1000, replace=True)])
        assert not isinstance(old, Exception) and not isinstance(new, Exception)
        assert (old.kind, new.kind) == ("won", "won") and new.fence > old.fence
        beat = HeartbeatRequest("swap", str(base), f"t{base}", 30_000, False)
        assert await store.heartbeat_many([beat]) == [False]
        (blocked,) = await store.claim_many([claim(base + 2000)])
        assert not isinstance(blocked, Exception) and blocked.kind == "overlap"
        first, again = await store.claim_many(
            [claim(base + 2000, superseded=True), claim(base + 2000, superseded=True)]
        )
        assert not isinstance(first, Exception) and not isinstance(again, Exception)
        assert (first.status, again.status) == ("superseded", "skipped")
        history = {r.slot_ms: r for r in await store.history("swap", 10)}
        assert history[base].status == "cancelled"
        assert f"slot {base + 1000}" in (history[base].error or "")
        assert history[base + 2000].status == "skipped"
        assert "newer slot waits" in (history[base + 2000].error or "")
    finally:
        await store.conn.aclose()
