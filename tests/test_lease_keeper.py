"""The lease keeper, on a real server: a heartbeat refused because the run's own finish
got there first is not a lost lease."""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime

import pytest

from anarchon import RedisBackend, Run
from anarchon._engine._context import EngineContext, _Attempt
from anarchon._engine.lease_keeper import LeaseKeeper
from anarchon._store import AttemptEnd, ClaimRequest
from tests.test_agenda import a_job

pytestmark = pytest.mark.anyio


async def test_a_heartbeat_that_crosses_the_runs_own_finish_cancels_nothing(
    server_url: str, prefix: str
) -> None:
    backend = RedisBackend(redis=server_url, prefix=prefix)
    store = await backend.open({"runner": "i", "history_size": 10, "history_ttl_ms": None})
    try:
        job = a_job()
        slot_ms = int(time.time() * 1000)
        token = secrets.token_hex(8)
        (won,) = await store.claim_many(
            [ClaimRequest(job.name, str(slot_ms), slot_ms, token, "schedule", 5_000, 3)]
        )
        assert not isinstance(won, Exception) and won.kind == "won"
        run = Run(job.name, datetime.fromtimestamp(slot_ms / 1000, UTC), slot_ms, 1,
                  "schedule", "i", won.fence)  # fmt: skip
        attempt = _Attempt(job, run, str(slot_ms), token)
        context = EngineContext(
            jobs={job.name: job}, instance_id="i", lease_ms=5_000, heartbeat_ms=1_000,
            retry_delay_ms=1_000, store=store,
        )  # fmt: skip
        context.attempts[(job.name, attempt.slot_id)] = attempt
        keeper = LeaseKeeper(context)
        keeper.watch(attempt, won.wait_ms, time.monotonic())
        # The handler returned and its finish reached the server before the heartbeat.
        attempt.ended = True
        await store.finish(
            AttemptEnd(job.name, attempt.slot_id, token, 1, "schedule", won.fence, slot_ms,
                       slot_ms, "ok", None, 3, 1_000)
        )  # fmt: skip

        await keeper._heartbeat([attempt], attempt.held_until)

        assert not attempt.lost and not run.lease_lost.is_set()
    finally:
        await store.conn.aclose()
