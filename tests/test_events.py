"""Events: what each instance decides and sees, as typed events, asserted against what the
store recorded on real servers; a slow consumer loses the oldest events, never slows the
scheduler; a hook that raises is logged once."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from typing import Any

import anyio
import pytest

from anarchon import (
    ClaimAnswered,
    Event,
    EventStream,
    InvalidOptionError,
    LeaseLost,
    RedisBackend,
    Run,
    RunFinished,
    RunRetried,
    RunStarted,
    Scheduler,
    ServerBack,
    ServerUnreachable,
    SlotSkipped,
    TimerFired,
    TimerRun,
    TimerSet,
)
from anarchon._observe.events import claim_answered, instant, run_finished, run_started
from tests.faults import FaultProxy
from tests.helpers import (
    Seconds,
    a_long_run,
    settled_history,
    tick_and_flaky_fleet,
    wait_until,
)

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


async def collect(stream: EventStream, into: list[Event]) -> None:
    async for event in stream:
        into.append(event)


def of(events: list[Event], kind: type[Any]) -> list[Any]:
    return [event for event in events if isinstance(event, kind)]


def test_every_event_is_a_frozen_dataclass_made_by_keyword_with_its_defaults() -> None:
    """Each event takes exactly its fields, by keyword, keeps their defaults (``at``: now,
    in UTC, to the millisecond), and is frozen, equal by value and hashable."""
    import anarchon

    kinds = [k for k in vars(anarchon).values() if isinstance(k, type) and issubclass(k, Event)]
    assert len(kinds) == 14, kinds
    for kind in kinds:
        names = [item.name for item in dataclasses.fields(kind)]
        parameters = inspect.signature(kind).parameters
        assert list(parameters) == names, kind
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values()), kind
        required = {
            item.name: object()
            for item in dataclasses.fields(kind)
            if item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING
        }
        before = datetime.now(UTC).replace(microsecond=0)
        event = kind(**required)
        for name, value in required.items():
            assert getattr(event, name) is value, (kind, name)
        assert before <= event.at <= datetime.now(UTC) and event.at.microsecond % 1000 == 0
        for item in dataclasses.fields(kind):
            if item.default is not dataclasses.MISSING:
                assert getattr(event, item.name) == item.default, (kind, item.name)
        at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
        again = kind(**required, at=at)
        assert again.at == at and again == dataclasses.replace(event, at=at)
        assert hash(again) == hash(kind(**required, at=at))
        with pytest.raises(dataclasses.FrozenInstanceError):
            event.instance = "another"  # type: ignore[misc]
        with pytest.raises(TypeError, match="unexpected keyword"):
            kind(**required, nope=1)
        with pytest.raises(TypeError, match="positional"):
            kind(*required.values())
        for name in required:
            with pytest.raises(TypeError, match=f"missing 1 required keyword-only.*'{name}'"):
                kind(**{other: v for other, v in required.items() if other != name})


@pytest.mark.parametrize(
    ("make", "kind"),
    [(claim_answered, ClaimAnswered), (run_started, RunStarted), (run_finished, RunFinished)],
)
def test_the_engine_makes_a_run_s_events_exactly_as_their_constructors_do(
    make: Any, kind: type[Event]
) -> None:
    """The engine makes the events of every run through positional makers that set the
    slots directly: each takes the class's fields in their order and makes the event its
    keyword constructor makes, frozen. A field added, removed or reordered fails here."""
    names = [item.name for item in dataclasses.fields(kind)]
    assert list(inspect.signature(make).parameters) == names
    values = {name: object() for name in names}  # all distinct: a swap shows
    event = make(*values.values())
    assert type(event) is kind and event == kind(**values)
    for name, value in values.items():
        assert getattr(event, name) is value, name
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.instance = "another"  # type: ignore[misc]
    assert instant(1_780_000_000_123.9) == datetime(2026, 5, 28, 20, 26, 40, 123000, tzinfo=UTC)


async def test_the_events_of_a_fleet_match_what_the_store_recorded(
    server_url: str, prefix: str
) -> None:
    """Two instances: every attempt the store recorded was started, claimed and finished
    in the events of the instance that ran it, with its outcome; a failure's retry is an
    event; a timer set, replaced and fired is one event each; the streams end when the
    instances stop."""
    seen: dict[str, list[Event]] = {"a": [], "b": []}
    fired: list[TimerRun] = []
    schedulers = tick_and_flaky_fleet(server_url, prefix, ("a", "b"))
    for scheduler in schedulers:

        @scheduler.timer("remind")
        async def remind(fire: TimerRun) -> None:
            fired.append(fire)

    began = datetime.now(UTC).replace(microsecond=0)  # events are stamped to the ms
    # The consumers end by themselves: each stream ends once its instance has stopped.
    with anyio.fail_after(60):
        async with anyio.create_task_group() as consumers:
            for scheduler in schedulers:
                # Opened before the start: nothing of the run is missed.
                consumers.start_soon(collect, scheduler.events(), seen[scheduler.instance_id])
            async with AsyncExitStack() as stack:
                for scheduler in schedulers:
                    await stack.enter_async_context(scheduler)
                # Set, then replaced before it fires: the second one fires.
                first = await schedulers[0].set_timer("remind", "user:42", delay_ms=600_000)
                generation = await schedulers[0].set_timer("remind", "user:42", delay_ms=300)
                await wait_until(lambda: len(fired) == 1, 20, "the timer to fire")
                history = await settled_history(schedulers[0], {"tick": 3, "flaky": 2})
    ended = datetime.now(UTC)
    for name, events in seen.items():
        assert all(event.instance == name for event in events), events
        # Stamped in UTC as they happened, in the order they happened.
        stamps = [event.at for event in events]
        assert stamps == sorted(stamps) and began <= stamps[0] and stamps[-1] <= ended, stamps
    everything = [event for events in seen.values() for event in events]
    for job in ("tick", "flaky"):
        for result in history[job]:
            events = seen[result.runner]
            key = (job, result.slot_ms, result.attempt)
            started = [
                e
                for e in of(events, RunStarted)
                if (e.run.job, e.run.slot_ms, e.run.attempt) == key
            ]
            finished = [
                e
                for e in of(events, RunFinished)
                if (e.run.job, e.run.slot_ms, e.run.attempt) == key
            ]
            assert len(started) == 1 and len(finished) == 1, (result, events)
            assert finished[0].outcome == result.status, (result, finished)
            assert started[0].run.fence == result.fence and started[0].late_ms >= 0
            won = [
                e
                for e in of(events, ClaimAnswered)
                if (e.job, e.slot_ms, e.answer) == (job, result.slot_ms, "won")
            ]
            assert won, (result, events)
    # Every start was recorded, and nothing else started.
    assert len(of(everything, RunStarted)) == len(history["tick"]) + len(history["flaky"])
    (failure,) = [e for e in of(everything, RunFinished) if e.outcome == "failed"]
    assert (
        failure.run.job == "flaky"
        and failure.retried
        and "first attempt fails" in (failure.error or "")
    )
    (retry,) = of(everything, RunRetried)
    assert (retry.job, retry.attempt, retry.slot_ms) == ("flaky", 1, failure.run.slot_ms)
    assert [(s.kind, s.key, s.generation, s.replaced) for s in of(seen["a"], TimerSet)] == [
        ("remind", "user:42", first, False),
        ("remind", "user:42", generation, True),
    ]
    (timer_fired,) = of(everything, TimerFired)
    assert (timer_fired.run.key, timer_fired.run.generation, timer_fired.outcome) == (
        "user:42",
        generation,
        "ok",
    )


async def test_a_paused_slot_and_an_overlap_skip_are_events(server_url: str, prefix: str) -> None:
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), instance_id="a")
    stream = scheduler.events()

    @scheduler.job("* * * * * *", name="long", overlap="skip")
    async def long() -> None:
        await anyio.sleep(2.5)  # past the next two slots

    @scheduler.job("* * * * * *", name="held")
    async def held() -> None:
        pass

    events: list[Event] = []
    async with anyio.create_task_group() as consumers:
        consumers.start_soon(collect, stream, events)
        async with scheduler:
            await scheduler.pause("held")

            def skipped(job: str, reason: str) -> list[SlotSkipped]:
                return [e for e in of(events, SlotSkipped) if (e.job, e.reason) == (job, reason)]

            await wait_until(lambda: len(skipped("held", "paused")) >= 2, 20, "paused slots")
            await wait_until(lambda: len(skipped("long", "overlap")) >= 1, 20, "a skipped slot")
            history = {r.slot_ms: r for r in await scheduler.history("long")}
            paused = {r.slot_ms: r for r in await scheduler.history("held")}
    for event in skipped("long", "overlap"):
        assert history[event.slot_ms].status == "skipped", history.get(event.slot_ms)
    for event in skipped("held", "paused"):
        assert paused[event.slot_ms].status == "skipped", paused.get(event.slot_ms)
    assert not [e for e in of(events, RunStarted) if e.run.job == "held"]


async def test_a_slow_consumer_loses_the_oldest_events_and_counts_them(
    server_url: str, prefix: str
) -> None:
    """A stream nobody reads holds its newest ``buffer`` events and counts the rest as
    dropped; the scheduler runs every slot all the same (a hook sees every event)."""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    unread = scheduler.events(buffer=5)
    every: list[Event] = []
    scheduler.on_event(every.append)
    ran: list[int] = []

    @scheduler.job(Seconds(300, 3), name="tick")
    async def tick(run: Run) -> None:
        ran.append(run.slot_ms)

    async with scheduler:
        await wait_until(lambda: len(ran) == 3, 20, "three runs")
        await wait_until(lambda: len(of(every, RunFinished)) == 3, 20, "three finishes")
        assert len(every) > 5
        kept = list(unread._queue)
        assert (unread.dropped, kept) == (len(every) - 5, every[-5:])
    left: list[Event] = []
    with anyio.fail_after(5):
        await collect(unread, left)  # the buffered ones, then the end
    assert left == every[-5:]


async def test_a_hook_that_raises_is_logged_once_and_the_scheduler_goes_on(
    server_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    calls: list[Event] = []

    @scheduler.on_event
    def broken(event: Event) -> None:
        calls.append(event)
        raise ValueError("the hook is broken")

    ran: list[int] = []

    @scheduler.job(Seconds(300, 2), name="tick")
    async def tick(run: Run) -> None:
        ran.append(run.slot_ms)

    with caplog.at_level(logging.ERROR, logger="anarchon"):
        async with scheduler:
            await wait_until(lambda: len(ran) == 2, 20, "two runs")
            await wait_until(lambda: len(of(calls, RunFinished)) == 2, 20, "two finishes")
    logged = [r for r in caplog.records if "on_event hook" in r.getMessage()]
    assert len(logged) == 1 and len(calls) > 2, (logged, calls)


async def test_an_outage_and_a_lost_lease_are_events(proxy: FaultProxy, prefix: str) -> None:
    """The server frozen during a run longer than its lease: the instance says the server
    is unreachable, then that the run lost its lease, then that the server is back."""
    scheduler, started = a_long_run(proxy.url, prefix)
    events: list[Event] = []
    scheduler.on_event(events.append)
    async with scheduler:
        await started.wait()
        proxy.pause()
        await wait_until(lambda: bool(of(events, LeaseLost)), 20, "the lease to be lost")
        proxy.resume()
        await wait_until(lambda: bool(of(events, ServerBack)), 20, "the server to be back")
    (unreachable,) = of(events, ServerUnreachable)
    (lost,) = of(events, LeaseLost)
    back = of(events, ServerBack)[0]
    assert events.index(unreachable) < events.index(lost) < events.index(back)
    assert (lost.job, lost.attempt, lost.timer_key) == ("long", 1, None)
    assert "no heartbeat got through" in lost.reason
    assert back.down_sec > 0


async def test_a_stream_opened_after_the_stop_ends_at_once_and_bad_options_are_refused(
    server_url: str, prefix: str
) -> None:
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    async with scheduler:
        pass
    with anyio.fail_after(5):
        assert [event async for event in scheduler.events()] == []
    with pytest.raises(InvalidOptionError, match="buffer must be a whole number"):
        scheduler.events(buffer=0)
    with pytest.raises(InvalidOptionError, match="on_event needs a function"):
        scheduler.on_event("print")  # type: ignore[arg-type]


async def test_two_consumers_of_one_stream_share_its_events_and_both_end(
    server_url: str, prefix: str
) -> None:
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    every: list[Event] = []
    scheduler.on_event(every.append)
    stream = scheduler.events()

    @scheduler.job(Seconds(300, 3), name="tick")
    async def tick() -> None:
        pass

    taken: tuple[list[Event], list[Event]] = ([], [])
    with anyio.fail_after(30):
        async with anyio.create_task_group() as consumers:
            for into in taken:
                consumers.start_soon(collect, stream, into)
            async with scheduler:
                await wait_until(lambda: len(of(every, RunFinished)) == 3, 20, "three runs")
    both = taken[0] + taken[1]
    assert sorted(both, key=every.index) == every
