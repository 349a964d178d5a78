"""Timer hints: what an instance does with a hint it hears, and how its subscription
rides through a server it cannot reach.

A hint is ``<due_ms> <due key>`` on the prefix's hint channel (``lua/timer_set.lua``
publishes it). The first tests hand hints to the listener directly (no server: they
check which claim of due timers comes forward, and to when); the last one runs an
instance on a real server behind a proxy that refuses its connections."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import anyio
import pytest
import redis

import anarchon._model.clock as clock_module
from anarchon import IntervalSchedule, RedisBackend, Scheduler, TimerRun
from anarchon._engine.agenda import Agenda
from anarchon._engine.context import EngineContext
from anarchon._engine.hints import Hints
from anarchon._model.clock import Pace, wall_ms
from anarchon._model.timer import TimerKind
from anarchon._store.keys import TimerKeys, hint_channel
from tests.faults import FaultProxy
from tests.helpers import OneShot, long_job_fleet, wait_until
from tests.test_timers import set_until_fired, subscribers

pytestmark = pytest.mark.engine_tier

PREFIX = "hints-test:"
#: Far in the future: a hint's due time is always sooner than the claims made here.
LATER_MS = 4_000_000_000_000


def a_kind(name: str, buckets: int = 1) -> TimerKind:
    return TimerKind(name, lambda: None, 3, None, buckets, False, False)


def listening(*kinds: TimerKind, offset_ms: float = 0.0) -> tuple[Hints, Agenda]:
    """A running instance's listener for ``kinds``, each bucket's claim on its agenda
    at LATER_MS (as after a poll that found nothing due)."""
    context = EngineContext(
        jobs={}, instance_id="i", lease_ms=30_000, heartbeat_ms=10_000, retry_delay_ms=1000
    )
    context.state = "running"
    context.server_offset_ms = offset_ms
    context.timer_kinds = {kind.name: kind for kind in kinds}
    agenda = Agenda(context)
    for kind in kinds:
        for bucket in range(kind.buckets):
            keys = TimerKeys.for_kind(PREFIX, kind.name, bucket, kind.buckets)
            agenda.timer_due(kind.name, keys, LATER_MS)
    return Hints(context, agenda, PREFIX), agenda


def claims_at(agenda: Agenda) -> dict[str, float]:
    """When each kind's (bucket's) claim of due timers is made, by hash tag."""
    return {tag: due.at_ms for tag, due in agenda.timer_claims.items()}


def test_a_hint_brings_its_buckets_claim_forward_to_the_due_time_on_this_clock() -> None:
    """The due time is on the server's clock: the claim is made when this instance's
    clock reads it (the server 250 ms ahead: 250 ms earlier here). Only the bucket
    named by the hint moves."""
    remind, digest = a_kind("remind", buckets=3), a_kind("digest")
    hints, agenda = listening(remind, digest, offset_ms=250.0)
    before = claims_at(agenda)
    due_ms = int(wall_ms()) + 5_000
    bucket_1 = TimerKeys.for_kind(PREFIX, "remind", 1, 3)
    hints.on_hint(f"{due_ms} {bucket_1.due}")
    after = claims_at(agenda)
    assert after[bucket_1.tag] == due_ms - 250
    assert {tag: at for tag, at in after.items() if tag != bucket_1.tag} == {
        tag: at for tag, at in before.items() if tag != bucket_1.tag
    }


def test_hints_for_two_buckets_put_their_claims_on_the_agenda_in_due_order() -> None:
    """A hint brings a bucket's claim forward behind a sooner one (not to the agenda's
    head): each claim is popped at its own due time, the sooner one first."""
    remind = a_kind("remind", buckets=3)
    hints, agenda = listening(remind)
    first, second = (TimerKeys.for_kind(PREFIX, "remind", b, 3) for b in (0, 2))
    soon = int(wall_ms()) + 1_000
    hints.on_hint(f"{soon} {first.due}")
    hints.on_hint(f"{soon + 500} {second.due}")
    assert [due.keys for due in agenda._pop_due(soon).timers] == [first]
    assert [due.keys for due in agenda._pop_due(soon + 499).timers] == []
    assert [due.keys for due in agenda._pop_due(soon + 500).timers] == [second]


def test_a_hint_heard_while_the_kinds_claim_is_in_flight_puts_one_on_the_agenda() -> None:
    """While a claim of the bucket's due timers is on its way (taken off the agenda), a
    hint puts a claim of that kind on the agenda at its due time."""
    remind = a_kind("remind")
    hints, agenda = listening(remind)
    keys = TimerKeys.for_kind(PREFIX, "remind")
    (in_flight,) = agenda._pop_due(LATER_MS).timers
    assert claims_at(agenda) == {}
    due_ms = int(wall_ms()) + 2_000
    hints.on_hint(f"{due_ms} {keys.due}")
    (claim,) = agenda._pop_due(due_ms).timers
    assert (claim.kind, claim.keys) == (remind.name, keys) == (in_flight.kind, keys)


def test_a_hint_later_than_the_claim_already_due_changes_nothing() -> None:
    remind = a_kind("remind")
    hints, agenda = listening(remind)
    keys = TimerKeys.for_kind(PREFIX, "remind")
    soon = int(wall_ms()) + 1_000
    hints.on_hint(f"{soon} {keys.due}")
    hints.on_hint(f"{soon + 60_000} {keys.due}")
    assert claims_at(agenda)[keys.tag] == soon


@pytest.mark.parametrize(
    "message",
    [
        "",
        "soon {hints-test:remind}:timer-due",
        "-5 {hints-test:remind}:timer-due",
        "1000",
        "1000 {hints-test:other}:timer-due",  # a kind this instance does not fire
        "1000 {other-prefix:remind}:timer-due",  # another prefix's kind of that name
        "1000 {hints-test:remind}:timers",  # not a due key
    ],
)
def test_a_hint_that_names_no_due_key_of_a_kind_fired_here_changes_nothing(
    message: str,
) -> None:
    hints, agenda = listening(a_kind("remind"))
    before = claims_at(agenda)
    hints.on_hint(message)
    assert claims_at(agenda) == before


def test_a_hint_heard_while_the_instance_stops_changes_nothing() -> None:
    hints, agenda = listening(a_kind("remind"))
    hints._context.begin_stopping()
    before = claims_at(agenda)
    hints.on_hint(f"1000 {TimerKeys.for_kind(PREFIX, 'remind').due}")
    assert claims_at(agenda) == before


@pytest.mark.anyio
async def test_hints_unreachable_are_warned_about_once_and_their_return_said_once(
    server_url: str,
    prefix: str,
    direct: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The proxy refuses every connection for 3 s: the subscription fails again and
    again (subscribing again after a growing pause) and says so once, at WARNING. Once
    a subscription lasts until its renewal (1 s here instead of 60) it says once, at
    INFO, that hints are back. The connection is cut once more: the listener subscribes
    again, warning once more (and saying again that they are back if a renewal comes
    before the test ends), and a timer another process sets to fall due long before the
    next poll (30 s) fires through a hint."""
    monkeypatch.setattr(clock_module, "PRODUCTION", Pace(hints_renew_sec=1.0))
    fired: list[str] = []
    with FaultProxy(server_url) as proxy:
        scheduler = Scheduler(RedisBackend(redis=proxy.url, prefix=prefix), timer_poll_ms=30_000)

        @scheduler.timer("remind")
        async def remind(timer: TimerRun) -> None:
            fired.append(timer.key)

        producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
        with caplog.at_level(logging.INFO, logger="anarchon"):
            async with scheduler:
                await subscribers(direct, prefix, 1)
                proxy.refuse(True)
                await anyio.sleep(3)
                proxy.refuse(False)
                await subscribers(direct, prefix, 1)
                await anyio.sleep(2.5)  # past a renewal of the subscription made again
                proxy.reset()  # a failure after the return: subscribed again, no word
                await anyio.sleep(0.2)
                await subscribers(direct, prefix, 1)
                # A sync client's subscription is made again in a thread of its own
                # at each renewal: a set published in between is not heard.
                await set_until_fired(producer, "after-the-outage", fired, 10)

    messages = [record.getMessage() for record in caplog.records]
    unavailable = [m for m in messages if m.startswith("hints unavailable")]
    back = [m for m in messages if m == "hints are back"]
    assert len(unavailable) == 2, unavailable  # the outage, then the cut after it
    assert 1 <= len(back) <= len(unavailable), messages  # each return said once
    assert fired == ["after-the-outage"]


@pytest.mark.anyio
async def test_a_subscription_renewed_while_the_server_answers_says_nothing(
    server_url: str,
    prefix: str,
    direct: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The subscription is made again at every renewal (1 s here instead of 60). With
    nothing failing, a renewal is not a failure: nothing is logged at WARNING, whatever
    the client (a sync client's subscription runs in a thread, which must have ended
    before the next one starts)."""
    monkeypatch.setattr(clock_module, "PRODUCTION", Pace(hints_renew_sec=1.0))
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), timer_poll_ms=30_000)

    @scheduler.timer("remind")
    async def remind(timer: TimerRun) -> None:
        pass

    with caplog.at_level(logging.INFO, logger="anarchon"):
        async with scheduler:
            await subscribers(direct, prefix, 1)
            await anyio.sleep(4.5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []


@pytest.mark.anyio
async def test_a_sync_subscription_cancelled_before_its_thread_ran_leaves_the_next_free(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """A renewal's cancellation can land before a sync client's subscription thread is
    started (a worker thread is not started under a cancelled scope). Nothing is left
    marked as running: the next subscription is made at once, and it hears messages."""
    from anarchon.clients.redis_py import RedisSyncConnection

    conn = RedisSyncConnection(redis.Redis.from_url(server_url, protocol=2), owned=True)
    channel = hint_channel(prefix)
    heard: list[str] = []
    try:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await conn.listen(channel, heard.append)
        async with anyio.create_task_group() as group:
            group.start_soon(conn.listen, channel, heard.append)
            await subscribers(direct, prefix, 1)
            direct.publish(channel, "1000 {x}:timer-due")
            with anyio.fail_after(5):
                while not heard:  # noqa: ASYNC110 - polls a list
                    await anyio.sleep(0.02)
            group.cancel_scope.cancel()
    finally:
        await conn.aclose()
    assert heard == ["1000 {x}:timer-due"]


# ------------------------------------------------------ runs given back by a stop


def test_a_release_hint_brings_the_backups_claim_of_that_slot_forward_to_now() -> None:
    """``release <slot id> <job>``: the backup's follow-up claim of that slot (made for
    when the lease it knew of runs out) is made now; a claim of another slot stays; a
    slot of the job with no claim here gets one now; a job that does not run here, or a
    slot id that is none, changes nothing."""
    hints, agenda = listening()
    job = SimpleNamespace(name="report")
    hints._context.jobs["report"] = job  # type: ignore[assignment]
    mine = agenda.push_follow_up(job, "1000", "schedule", LATER_MS)  # type: ignore[arg-type]
    other = agenda.push_follow_up(job, "2000", "schedule", LATER_MS)  # type: ignore[arg-type]
    hints.on_hint("release 1000 another-job")
    hints.on_hint("release not-a-slot report")
    assert (mine.at_ms, other.at_ms) == (LATER_MS, LATER_MS)
    assert agenda.pending == {("report", "1000"), ("report", "2000")}
    before = wall_ms()
    hints.on_hint("release 1000 report")
    assert before <= mine.at_ms <= wall_ms()
    assert other.at_ms == LATER_MS
    hints.on_hint("release 3000 report")
    assert ("report", "3000") in agenda.pending
    (new,) = [due for due in agenda._due if due.follows_up("report", "3000")]
    assert before <= new.at_ms <= wall_ms()


@pytest.mark.anyio
async def test_a_run_given_back_by_a_stopping_instance_is_taken_over_at_once(
    server_url: str, prefix: str
) -> None:
    """Two instances, a 30 s lease: the runner stops mid-run and gives its lease back;
    its backup, told on the hint channel, runs attempt 2 (with a higher fence) long
    before the lease it knew of would have run out."""
    async with long_job_fleet(
        server_url, prefix, OneShot.in_ms(1500), lease_ms=30_000, stop_grace_ms=0
    ) as fleet:
        await wait_until(lambda: bool(fleet.starts), 20, "attempt 1 to start")
        runner = fleet.runner_of(0)
        await runner.stop()
        await wait_until(lambda: len(fleet.starts) == 2, 10, "the backup to take over")
        first, second = fleet.starts
        assert second.runner != runner.instance_id and second.attempt == 2
        assert second.fence > first.fence


@pytest.mark.anyio
async def test_a_run_given_back_is_taken_over_at_once_when_the_job_fires_more_often_than_its_lease(
    server_url: str, prefix: str
) -> None:
    """A job every 6 s with a 30 s lease: the backup's claim of the running slot was
    answered "running", and it queued no follow-up (its claim of the next slot would
    find the run first). The stop of the runner gives the run back; the release hint
    must start the take-over now on the instance that runs the job, not at the next
    slot (before: 6 s less the time the run had, every deploy)."""
    async with long_job_fleet(
        server_url, prefix, IntervalSchedule(6000), lease_ms=30_000, stop_grace_ms=0
    ) as fleet:
        await wait_until(lambda: bool(fleet.starts), 20, "attempt 1 to start")
        first = fleet.starts[0]
        runner = fleet.runner_of(0)
        await runner.stop()
        await wait_until(lambda: len(fleet.starts) == 2, 10, "the backup to take over")
        seen_ms = time.time() * 1000
        second = fleet.starts[1]
    assert (second.slot_ms, second.attempt) == (first.slot_ms, 2)
    assert second.runner != runner.instance_id and second.fence > first.fence
    # Before the next slot, whose claim would have found the run given back anyway.
    next_slot_ms = first.slot_ms + 6000
    assert seen_ms < next_slot_ms - 1000, (seen_ms - first.slot_ms, "ms after the first slot")


@pytest.mark.parametrize(
    "message",
    [
        "\u00b2 {p}remind}:timer-due",
        "99999999999999999999999 x",
        "run mXYZ-fleet1 report",
        "run 12 ",
        "release",
        "release m1-x",
        "",
        "\x1b[2J run",
    ],
)
def test_a_hint_that_does_not_read_is_ignored_not_raised(
    message: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone the ACL lets publish on the channel can send anything: ``² ...`` raised a
    ValueError from the listener's callback and dropped the subscription (it came back
    after a pause, with a WARNING). Now it is nothing to act on."""
    remind = a_kind("remind")
    hints, agenda = listening(remind)
    before = claims_at(agenda)
    with caplog.at_level(logging.WARNING, logger="anarchon"):
        hints.on_hint(message)
    assert claims_at(agenda) == before
    assert all("\x1b" not in record.getMessage() for record in caplog.records)
