"""The lease keeper, on a real server: an accepted heartbeat extends the lease from
when it was sent, a refused one cancels the handler at once, and a heartbeat refused
because the run's own finish got there first is not a lost lease. Heartbeats go out
when due (not at once, not for attempts that ended or were given up), a lease that
ran out here is given up without waiting for the server, and a heartbeat answered
with an error is tried again before the lease would run out."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import anyio
import pytest
import redis

from anarchon import RedisBackend, Run
from anarchon._engine.context import EngineContext
from anarchon._engine.lease_keeper import LeaseKeeper
from anarchon._engine.work import Attempt
from anarchon._model.job import Job
from anarchon._store.contract import AttemptEnd, ClaimReply, ClaimRequest, HeartbeatRequest, Store
from anarchon._store.keys import JobKeys
from anarchon._store.timers import TimerStore
from anarchon.clients import ServerReplyError
from tests.faults import FaultProxy, oom
from tests.helpers import wait_until
from tests.test_agenda import a_job

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]

LEASE_MS = 5_000
HEARTBEAT_MS = 1_000


async def open_store(url: str, prefix: str) -> Store:
    backend = RedisBackend(redis=url, prefix=prefix)
    return await backend.open({"runner": "i", "history_size": 10, "history_ttl_ms": None})


async def win(
    store: Store, job: Job, slot_ms: int, lease_ms: int = LEASE_MS
) -> tuple[Attempt, ClaimReply]:
    """Win a slot of ``job`` on the server: the attempt that runs it here, and the reply."""
    token = secrets.token_hex(8)
    (won,) = await store.claim_many(
        [ClaimRequest(job.name, str(slot_ms), slot_ms, token, "schedule", lease_ms, 3,
                      job.overlap)]
    )  # fmt: skip
    assert not isinstance(won, Exception) and won.kind == "won"
    run = Run(job.name, datetime.fromtimestamp(slot_ms / 1000, UTC), slot_ms, won.attempt,
              "schedule", "i", won.fence)  # fmt: skip
    return Attempt(job=job, run=run, slot_id=str(slot_ms), token=token), won


def a_keeper(
    store: Store, job: Job, lease_ms: int = LEASE_MS, heartbeat_ms: int = HEARTBEAT_MS
) -> tuple[EngineContext, LeaseKeeper]:
    context = EngineContext(
        jobs={job.name: job}, instance_id="i", lease_ms=lease_ms, heartbeat_ms=heartbeat_ms,
        retry_delay_ms=1_000,
    )  # fmt: skip
    return context, LeaseKeeper(context, store, TimerStore(store.conn, prefix=store.prefix))


def keep(
    context: EngineContext, keeper: LeaseKeeper, attempt: Attempt, lease_left_ms: int,
    since: float,
) -> None:  # fmt: skip
    """What the runner does with an attempt just won: watch its lease, count it as running."""
    keeper.watch(attempt, lease_left_ms, since)
    context.attempts[(attempt.job.name, attempt.slot_id)] = attempt


@dataclass
class Kept:
    """One attempt won on the real server, watched by a lease keeper of its own."""

    store: Store
    context: EngineContext
    keeper: LeaseKeeper
    attempt: Attempt
    won: ClaimReply


@pytest.fixture
async def kept(server_url: str, prefix: str) -> AsyncIterator[Kept]:
    store = await open_store(server_url, prefix)
    try:
        job = a_job()
        attempt, won = await win(store, job, int(time.time() * 1000))
        context, keeper = a_keeper(store, job)
        keep(context, keeper, attempt, won.wait_ms, time.monotonic())
        yield Kept(store, context, keeper, attempt, won)
    finally:
        await store.conn.aclose()


@pytest.fixture
def heartbeats(kept: Kept, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The heartbeat round trips ``kept``'s store sends (the slot ids of each), recorded
    as they are sent; they still go to the server."""
    sent: list[list[str]] = []
    send = kept.store.heartbeat_many

    async def recorded(beats: Sequence[HeartbeatRequest]) -> list[bool | ServerReplyError]:
        sent.append([beat.slot_id for beat in beats])
        return await send(beats)

    monkeypatch.setattr(kept.store, "heartbeat_many", recorded)
    return sent


@dataclass
class Link:
    """A store whose traffic to the server goes through a proxy the test can freeze."""

    proxy: FaultProxy
    store: Store


@pytest.fixture
async def link(server_url: str, prefix: str) -> AsyncIterator[Link]:
    with FaultProxy(server_url) as proxy:
        store = await open_store(proxy.url, prefix)
        try:
            yield Link(proxy, store)
        finally:
            proxy.resume()
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


async def test_an_attempt_just_won_gets_no_heartbeat_before_one_is_due(
    kept: Kept, heartbeats: list[list[str]]
) -> None:
    """Its lease was just granted: the first heartbeat is due a heartbeat interval
    after the claim was sent, not at once."""
    attempt = kept.attempt
    # A long interval: the keeper's first tick comes long before the first beat is
    # due, however loaded the machine.
    context, keeper = a_keeper(kept.store, attempt.job, heartbeat_ms=LEASE_MS * 4 // 5)
    keep(context, keeper, attempt, kept.won.wait_ms, time.monotonic())

    async with anyio.create_task_group() as group:
        group.start_soon(keeper.keep_leases)
        await anyio.wait_all_tasks_blocked()  # the keeper waits for the first beat
        group.cancel_scope.cancel()

    assert heartbeats == []
    assert not attempt.lost and not attempt.run.lease_lost.is_set()


async def test_a_lease_that_ran_out_here_before_its_first_heartbeat_is_given_up_without_one(
    kept: Kept, heartbeats: list[list[str]]
) -> None:
    """Its claim's reply came back a whole lease after the claim was sent: as far as
    this instance can tell the lease is gone, so the handler is cancelled at once,
    and the lease is left to run out on the server for a backup."""
    attempt, lease_ms = kept.attempt, kept.won.wait_ms
    kept.keeper.watch(attempt, lease_ms, time.monotonic() - lease_ms / 1000)

    async with anyio.create_task_group() as group:
        group.start_soon(kept.keeper.keep_leases)
        await anyio.wait_all_tasks_blocked()  # the keeper has nothing left to keep
        group.cancel_scope.cancel()

    assert attempt.lost is True and attempt.run.lease_lost.is_set()
    assert attempt.scope.cancel_called
    assert heartbeats == []


async def test_an_attempt_whose_handler_has_ended_gets_no_heartbeat_even_when_one_is_due(
    kept: Kept, heartbeats: list[list[str]]
) -> None:
    """Its finish is on the way (the runner still counts it until the finish is
    recorded): its lease is neither extended nor given up."""
    attempt = kept.attempt
    attempt.ended = True
    kept.keeper.watch(attempt, kept.won.wait_ms, time.monotonic() - HEARTBEAT_MS / 1000)

    async with anyio.create_task_group() as group:
        group.start_soon(kept.keeper.keep_leases)
        await anyio.wait_all_tasks_blocked()  # the keeper has nothing to keep
        group.cancel_scope.cancel()

    assert heartbeats == []
    assert not attempt.lost and not attempt.run.lease_lost.is_set()


@pytest.mark.parametrize("how", ["ended", "settled"])
async def test_a_heartbeat_that_crosses_one_attempts_end_still_extends_the_others(
    server_url: str, prefix: str, how: str
) -> None:
    """Two attempts share a tick; the first one's handler returns (or its run is
    already settled) before the replies come back: the second's lease is extended
    all the same, from when the heartbeat was sent."""
    job = a_job("allow")
    store = await open_store(server_url, prefix)
    try:
        slot_ms = int(time.time() * 1000)
        first, won = await win(store, job, slot_ms)
        second, _ = await win(store, job, slot_ms + 1000)
        context, keeper = a_keeper(store, job)
        for attempt in (first, second):  # both won a heartbeat ago: due now
            keep(context, keeper, attempt, won.wait_ms, time.monotonic() - HEARTBEAT_MS / 1000)
        if how == "ended":
            first.ended = True
        else:
            del context.attempts[(job.name, first.slot_id)]
        before = time.monotonic()

        await keeper._heartbeat([first, second], first.held_until)

        assert before + LEASE_MS / 1000 <= second.held_until
        assert before + HEARTBEAT_MS / 1000 <= second.next_beat
        assert not second.lost
    finally:
        await store.conn.aclose()


async def test_an_overlapping_jobs_heartbeat_keeps_a_lease_that_ran_out_beside_a_later_run(
    server_url: str, prefix: str
) -> None:
    """A job that allows overlapping runs: its attempt's lease ran out on the server
    (whose clock ran ahead of this instance's) while a later run of the job holds a
    live one. Nobody took the attempt over, so its heartbeat keeps it; a job without
    overlap would be refused here, as two of its runs would then be live."""
    job = a_job("allow")
    store = await open_store(server_url, prefix)
    try:
        slot_ms = int(time.time() * 1000)
        first, _ = await win(store, job, slot_ms, lease_ms=1)
        await anyio.sleep(0.01)  # the first lease has run out on the server
        await win(store, job, slot_ms + 1000)
        context, keeper = a_keeper(store, job)
        keep(context, keeper, first, LEASE_MS, time.monotonic())  # held here still
        before = time.monotonic()

        await keeper._heartbeat([first], first.held_until)

        assert not first.lost and not first.run.lease_lost.is_set()
        assert before + LEASE_MS / 1000 <= first.held_until
    finally:
        await store.conn.aclose()


async def test_a_heartbeat_answered_with_an_error_is_tried_again_before_the_lease_would_run_out(
    kept: Kept, direct: redis.Redis
) -> None:
    """The server is out of memory: the heartbeat's write fails. The lease has 0.9 s
    left here, less than a heartbeat interval: the next try is due before the lease
    would run out (not a heartbeat interval later), and not already due (no tight
    loop of round trips)."""
    attempt = kept.attempt
    before = time.monotonic()
    kept.keeper.watch(attempt, 900, before)

    with oom(direct):
        await kept.keeper._heartbeat([attempt], attempt.held_until)

    assert not attempt.lost and not attempt.run.lease_lost.is_set()
    assert before < attempt.next_beat < attempt.held_until


async def test_a_heartbeat_answered_with_an_error_logs_a_warning_naming_the_job_and_the_error(
    kept: Kept, direct: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The server answers, so this is no outage (a heartbeat that gets no answer is
    logged once per outage, not here): the warning says which job and why."""
    attempt = kept.attempt

    with oom(direct), caplog.at_level(logging.WARNING, logger="anarchon"):
        await kept.keeper._heartbeat([attempt], attempt.held_until)

    (warning,) = caplog.records
    assert warning.levelno == logging.WARNING
    assert attempt.job.name in warning.getMessage() and "OOM" in warning.getMessage()


async def test_a_heartbeat_the_server_does_not_answer_gives_the_attempt_up_at_its_local_expiry(
    link: Link,
) -> None:
    """The server is frozen and the lease has 0.2 s left here: the attempt is given up
    then, while the server still does not answer, not when the round trip's deadline
    (a third of the lease: 10 s) or the client's own timeout (5 s) ends the wait, by
    when a backup may have taken the run over."""
    job = a_job()
    attempt, _ = await win(link.store, job, int(time.time() * 1000), lease_ms=30_000)
    context, keeper = a_keeper(link.store, job, lease_ms=30_000)
    keep(context, keeper, attempt, 200, time.monotonic())
    link.proxy.pause()

    async with anyio.create_task_group() as group:
        group.start_soon(keeper._heartbeat, [attempt], attempt.held_until)
        await wait_until(lambda: attempt.lost, 3, "the attempt to be given up")
        assert attempt.run.lease_lost.is_set() and attempt.scope.cancel_called
        link.proxy.resume()


async def test_an_attempt_won_while_a_heartbeat_is_under_way_is_kept_too(link: Link) -> None:
    """The keeper is waiting for the server's replies to a tick when the runner wins
    another attempt: it is watched like any other, and heartbeated once due."""
    job = a_job("allow")
    slot_ms = int(time.time() * 1000)
    first, won = await win(link.store, job, slot_ms)
    claim_sent = time.monotonic()
    second, second_won = await win(link.store, job, slot_ms + 1000)
    context, keeper = a_keeper(link.store, job)
    keep(context, keeper, first, won.wait_ms, time.monotonic())

    async with anyio.create_task_group() as group:
        group.start_soon(keeper.keep_leases)
        await anyio.wait_all_tasks_blocked()  # the keeper waits for the first beat
        link.proxy.pause()
        keeper.watch(first, won.wait_ms, time.monotonic() - HEARTBEAT_MS / 1000)  # due now
        await anyio.wait_all_tasks_blocked()  # its heartbeat waits for the server
        keep(context, keeper, second, second_won.wait_ms, claim_sent)
        watched_until = second.held_until
        link.proxy.resume()
        await wait_until(lambda: second.held_until > watched_until, 10, "a heartbeat of it")
        group.cancel_scope.cancel()

    assert not first.lost and not second.lost
