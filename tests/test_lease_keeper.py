"""The lease keeper, on a real server: an accepted heartbeat extends the lease from
when it was sent, a refused one cancels the handler at once, and a heartbeat refused
because the run's own finish got there first is not a lost lease."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
import redis

from anarchon import RedisBackend, Run
from anarchon._engine._context import EngineContext, _Attempt
from anarchon._engine.lease_keeper import LeaseKeeper
from anarchon._lease import JobKeys
from anarchon._store import AttemptEnd, ClaimReply, ClaimRequest, Store
from tests.test_agenda import a_job

pytestmark = pytest.mark.anyio

LEASE_MS = 5_000
HEARTBEAT_MS = 1_000


@dataclass
class Kept:
    """One attempt won on the real server, watched by a lease keeper of its own."""

    store: Store
    keeper: LeaseKeeper
    attempt: _Attempt
    won: ClaimReply


@pytest.fixture
async def kept(server_url: str, prefix: str) -> AsyncIterator[Kept]:
    backend = RedisBackend(redis=server_url, prefix=prefix)
    store = await backend.open({"runner": "i", "history_size": 10, "history_ttl_ms": None})
    try:
        job = a_job()
        slot_ms = int(time.time() * 1000)
        token = secrets.token_hex(8)
        (won,) = await store.claim_many(
            [ClaimRequest(job.name, str(slot_ms), slot_ms, token, "schedule", LEASE_MS, 3)]
        )
        assert not isinstance(won, Exception) and won.kind == "won"
        run = Run(job.name, datetime.fromtimestamp(slot_ms / 1000, UTC), slot_ms, 1,
                  "schedule", "i", won.fence)  # fmt: skip
        attempt = _Attempt(job=job, run=run, slot_id=str(slot_ms), token=token)
        context = EngineContext(
            jobs={job.name: job}, instance_id="i", lease_ms=LEASE_MS, heartbeat_ms=HEARTBEAT_MS,
            retry_delay_ms=1_000, store=store,
        )  # fmt: skip
        context.attempts[(job.name, attempt.slot_id)] = attempt
        keeper = LeaseKeeper(context)
        keeper.watch(attempt, won.wait_ms, time.monotonic())
        yield Kept(store, keeper, attempt, won)
    finally:
        await store.conn.aclose()


async def test_an_accepted_heartbeat_extends_the_lease_from_when_it_was_sent(
    kept: Kept, caplog: pytest.LogCaptureFixture
) -> None:
    attempt = kept.attempt
    before = time.monotonic()

    with caplog.at_level(logging.INFO, logger="anarchon"):
        await kept.keeper._heartbeat([attempt], attempt.held_until)
    after = time.monotonic()

    assert before + LEASE_MS / 1000 <= attempt.held_until <= after + LEASE_MS / 1000
    assert before + HEARTBEAT_MS / 1000 <= attempt.next_beat <= after + HEARTBEAT_MS / 1000
    assert not attempt.lost and not attempt.run.lease_lost.is_set()
    assert caplog.records == [], "a heartbeat that got through logged something"


async def test_a_refused_heartbeat_cancels_the_handler_at_once(
    kept: Kept, prefix: str, direct: redis.Redis
) -> None:
    """The run's state is gone (the store was wiped, or failed over to a replica that
    had not seen the claim): the heartbeat is refused, and the handler is told at once,
    not when its lease would have run out here."""
    attempt = kept.attempt
    direct.delete(JobKeys.for_job(prefix, attempt.job.name).state)

    await kept.keeper._heartbeat([attempt], attempt.held_until)

    assert time.monotonic() < attempt.held_until  # the lease had not run out here
    assert attempt.lost is True and attempt.run.lease_lost.is_set()
    assert attempt.scope.cancel_called


async def test_a_heartbeat_that_crosses_the_runs_own_finish_cancels_nothing(
    kept: Kept,
) -> None:
    attempt, won = kept.attempt, kept.won
    slot_ms = attempt.run.slot_ms
    # The handler returned and its finish reached the server before the heartbeat.
    attempt.ended = True
    await kept.store.finish(
        AttemptEnd(attempt.job.name, attempt.slot_id, attempt.token, 1, "schedule", won.fence,
                   slot_ms, slot_ms, "ok", None, 3, 1_000)
    )  # fmt: skip

    await kept.keeper._heartbeat([attempt], attempt.held_until)

    assert not attempt.lost and not attempt.run.lease_lost.is_set()
