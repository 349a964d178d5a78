"""Durable per-key timers (design section 9) on real servers, under asyncio and trio: set
from any process, fired once across the fleet through the real engine, rearmed,
replaced, cancelled, recurring, given back on stop, never lost while nobody runs."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest
import redis

from anarchon import (
    InvalidJobError,
    InvalidOptionError,
    InvalidScheduleError,
    RedisBackend,
    Scheduler,
    SchedulerStateError,
    TimerRun,
    Timers,
    TimerSetting,
)
from anarchon._model.timer import Recurrence
from anarchon._store.keys import TimerKeys, hint_channel
from tests.helpers import CommandLog, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]

LEASE_MS = 1500


@dataclass
class Fired:
    key: str
    payload: Any
    generation: int
    attempt: int
    trigger: str
    runner: str
    fence: int
    due_ms: int
    at_ms: float


def fleet(
    url: str,
    prefix: str,
    n: int,
    handler: Callable[[TimerRun], Any],
    lease_ms: int = LEASE_MS,
    timer_poll_ms: int | None = None,
    heartbeat_ms: int | None = None,
    **options: Any,
) -> list[Scheduler[Any]]:
    """``n`` schedulers that fire the ``remind`` kind through ``handler``."""
    schedulers: list[Scheduler[Any]] = []
    for i in range(n):
        scheduler = Scheduler(
            RedisBackend(redis=url, prefix=prefix), lease_ms=lease_ms, instance_id=f"i{i}",
            retry_delay_ms=100, stop_grace_ms=200, timer_poll_ms=timer_poll_ms,
            heartbeat_ms=heartbeat_ms,
        )  # fmt: skip
        scheduler.add_timer(handler, "remind", **options)
        schedulers.append(scheduler)
    return schedulers


async def run_for(schedulers: list[Scheduler[Any]], seconds: float) -> None:
    async def run(scheduler: Scheduler[Any]) -> None:
        async with scheduler:
            await anyio.sleep(seconds)

    async with anyio.create_task_group() as group:
        for scheduler in schedulers:
            group.start_soon(run, scheduler)


async def run_until(
    schedulers: list[Scheduler[Any]], done: Callable[[], bool], timeout_sec: float = 120
) -> None:
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        with anyio.fail_after(timeout_sec):
            while not done():  # noqa: ASYNC110 - polls what the handlers recorded
                await anyio.sleep(0.05)
        await anyio.sleep(0.5)  # and nothing more fires


def recorder(fired: list[Fired]) -> Callable[[TimerRun], Any]:
    async def remind(fire: TimerRun) -> None:
        fired.append(
            Fired(fire.key, fire.payload, fire.generation, fire.attempt, fire.trigger,
                  fire.runner, fire.fence, fire.due_ms, time.time() * 1000)
        )  # fmt: skip

    return remind


async def test_a_timer_set_by_a_process_without_a_scheduler_fires_once_in_another(
    server_url: str, prefix: str
) -> None:
    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))  # never started
    generation = await producer.set_timer(
        "remind", "user:42", delay_ms=200, payload={"text": "your cart"}
    )
    info = await producer.get_timer("remind", "user:42")
    assert info is not None and info.status == "pending" and info.generation == generation
    assert info.payload == {"text": "your cart"} and info.recurs is None
    fired: list[Fired] = []
    await run_for(fleet(server_url, prefix, 2, recorder(fired)), 1.5)
    assert [(f.key, f.payload, f.generation, f.attempt, f.trigger) for f in fired] == [
        ("user:42", {"text": "your cart"}, generation, 1, "due")
    ]
    assert await producer.get_timer("remind", "user:42") is None  # spent, nothing lingers


async def test_timers_keeps_its_connection_and_a_set_after_the_first_is_one_command(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """A web app keeps one ``Timers`` open: its first set reads what it needs (the
    server, the store's format, the kind's buckets); each later set is the set script
    alone, one command on the wire, and the timers it sets fire once in a fleet."""
    monitor = CommandLog(server_url)
    try:
        async with Timers(RedisBackend(redis=server_url, prefix=prefix)) as timers:
            first = await timers.set("remind", "user:1", delay_ms=300, payload={"n": 1})
            direct.echo("before the second set")
            second = await timers.set("remind", "user:2", delay_ms=300, payload={"n": 2})
            direct.echo("after the second set")
            info = await timers.get("remind", "user:2")
        assert info is not None and info.generation == second and info.payload == {"n": 2}

        def between() -> list[str] | None:
            names = [name for _, name in monitor.seen()]
            echoes = [i for i, name in enumerate(names) if name == "ECHO"]
            return names[echoes[0] + 1 : echoes[1]] if len(echoes) == 2 else None

        await wait_until(lambda: between() is not None, 10, "both marks in MONITOR")
        assert between() == ["EVALSHA"]
    finally:
        await anyio.to_thread.run_sync(monitor.close)
    fired: list[Fired] = []
    await run_for(fleet(server_url, prefix, 2, recorder(fired)), 1.5)
    assert sorted((f.key, f.payload, f.generation) for f in fired) == [
        ("user:1", {"n": 1}, first),
        ("user:2", {"n": 2}, second),
    ]


async def test_timers_used_without_async_with_says_how_to_open_it(prefix: str) -> None:
    timers = Timers(RedisBackend(redis="redis://127.0.0.1:1", prefix=prefix))
    with pytest.raises(SchedulerStateError, match="async with Timers"):
        await timers.set("remind", "user:1", delay_ms=1000)


async def test_timers_due_together_fire_exactly_once_across_three_instances(
    server_url: str, prefix: str
) -> None:
    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    keys = [f"user:{n}" for n in range(300)]
    async with producer:  # set on the running scheduler's own connection
        for key in keys:
            await producer.set_timer("remind", key, delay_ms=500, payload=key.encode())
    fired: list[Fired] = []
    # A lease longer than the run: a firing whose finish a starved loop held back past
    # its lease may be run again by a backup (design section 3), and this test is
    # about how the instances share the due timers, not about a loaded machine.
    schedulers = fleet(server_url, prefix, 3, recorder(fired), lease_ms=10_000)
    await run_until(schedulers, lambda: len({f.key for f in fired}) >= len(keys), 60)
    counts = collections.Counter(f.key for f in fired)
    assert not [f for f in fired if counts[f.key] > 1]  # each once; else who fired it how
    assert sorted(counts) == sorted(keys)
    assert all(f.payload == f.key.encode() for f in fired)
    assert len({f.fence for f in fired}) == len(fired)


@pytest.mark.slow
async def test_a_firing_longer_than_its_lease_keeps_it_through_heartbeats(
    server_url: str, prefix: str
) -> None:
    """A firing of two leases, on three instances: heartbeats every 250 ms keep its
    3 s lease (through a loaded machine's stall of two seconds), so no backup takes it
    over, as one would at 3 s without them; it runs once and ends at attempt 1."""
    lease_ms = 3000
    fired: list[Fired] = []
    finished: list[int] = []
    record = recorder(fired)

    async def long(fire: TimerRun) -> None:
        await record(fire)
        await anyio.sleep(2 * lease_ms / 1000)
        finished.append(fire.attempt)

    schedulers = fleet(server_url, prefix, 3, long, lease_ms=lease_ms, heartbeat_ms=250)
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await schedulers[0].set_timer("remind", "user:1", delay_ms=300)
        with anyio.fail_after(20):
            while not finished:  # noqa: ASYNC110 - polls what the handler recorded
                await anyio.sleep(0.05)
        await anyio.sleep(lease_ms / 1000)  # one more lease for a backup to misbehave
    assert [(f.key, f.attempt, f.trigger) for f in fired] == [("user:1", 1, "due")]
    assert finished == [1]


async def test_a_rearm_from_the_handler_fires_the_key_again_with_its_payload(
    server_url: str, prefix: str
) -> None:
    fired: list[Fired] = []

    async def remind(fire: TimerRun) -> None:
        await recorder(fired)(fire)
        if len(fired) < 3:
            await fire.rearm(delay_ms=100)

    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    await producer.set_timer("remind", "user:1", delay_ms=0, payload=b"\xff\x00 raw")
    await run_for(fleet(server_url, prefix, 2, remind), 2.0)
    assert [f.payload for f in fired] == [b"\xff\x00 raw"] * 3
    generations = [f.generation for f in fired]
    assert generations == sorted(set(generations))  # each rearm a higher generation
    assert await producer.get_timer("remind", "user:1") is None


async def test_a_timer_set_again_while_it_fires_is_not_clobbered_by_the_old_firing(
    server_url: str, prefix: str
) -> None:
    fired: list[Fired] = []
    firing = anyio.Event()
    go_on = anyio.Event()
    fired_new = anyio.Event()

    async def remind(fire: TimerRun) -> None:
        await recorder(fired)(fire)
        if fire.payload == "new":
            fired_new.set()
        if fire.payload == "old":
            firing.set()
            await go_on.wait()
            fire.rearm(delay_ms=0)  # dropped: the key was set again meanwhile

    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    first = await producer.set_timer("remind", "k", delay_ms=0, payload="old")
    (worker,) = fleet(server_url, prefix, 1, remind)
    async with worker:
        await firing.wait()
        second = await producer.set_timer("remind", "k", delay_ms=0, payload="new")
        info = await producer.get_timer("remind", "k")
        assert info is not None and info.status == "firing" and info.generation == second
        go_on.set()
        with anyio.fail_after(5):
            await fired_new.wait()
        await anyio.sleep(0.3)  # nothing else fires
    assert [(f.payload, f.generation) for f in fired] == [("old", first), ("new", second)]
    assert await producer.get_timer("remind", "k") is None


async def test_a_recurring_timer_fires_every_interval_until_cancelled_while_firing(
    server_url: str, prefix: str
) -> None:
    fired: list[Fired] = []
    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    async def remind(fire: TimerRun) -> None:
        await recorder(fired)(fire)
        if len(fired) == 3:
            assert await producer.cancel_timer("remind", "tick") is True

    await producer.set_timer("remind", "tick", every_ms=200, payload=[1, 2])
    info = await producer.get_timer("remind", "tick")
    assert info is not None and info.recurs == "every_ms=200"
    await run_until(fleet(server_url, prefix, 2, remind), lambda: len(fired) >= 3)
    assert len(fired) == 3 and all(f.payload == [1, 2] for f in fired)
    # Each next due time is on the interval's grid: one interval on, or more when a
    # firing ended later than the next time (a loaded machine), since a recurring timer
    # that fired late goes on from now, not once per missed time (test below).
    steps = [b - a for a, b in itertools.pairwise(f.due_ms for f in fired)]
    assert all(step > 0 and step % 200 == 0 for step in steps), steps
    assert await producer.get_timer("remind", "tick") is None


async def test_a_failed_firing_is_retried_and_one_given_back_on_stop_is_not_counted(
    server_url: str, prefix: str
) -> None:
    fired: list[Fired] = []
    started = anyio.Event()

    async def remind(fire: TimerRun) -> None:
        await recorder(fired)(fire)
        if fire.key == "fails" and fire.attempt == 1:
            raise RuntimeError("the first attempt fails")
        if fire.key == "long" and fire.runner == "i0":
            started.set()
            await anyio.sleep_forever()  # until its instance stops

    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    await producer.set_timer("remind", "fails", delay_ms=0)
    first, second = fleet(server_url, prefix, 2, remind, max_attempts=1)
    async with first:
        await producer.set_timer("remind", "long", delay_ms=0)
        await started.wait()
    # max_attempts=1: the stop gave the firing back without counting it.
    await run_for([second], 1.0)
    by_key = {(f.key, f.runner, f.attempt, f.trigger) for f in fired}
    assert ("fails", "i0", 1, "due") in by_key  # failed, and with one attempt: done
    assert not any(f.key == "fails" and f.attempt > 1 for f in fired)
    assert ("long", "i0", 1, "due") in by_key and ("long", "i1", 1, "retry") in by_key


async def test_timers_due_while_every_instance_was_down_fire_when_one_starts(
    server_url: str, prefix: str
) -> None:
    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    past = datetime.now(UTC) - timedelta(minutes=5)
    for n in range(20):
        await producer.set_timer("remind", f"k{n}", at=past + timedelta(seconds=n))
    fired: list[Fired] = []
    await run_for(fleet(server_url, prefix, 1, recorder(fired)), 1.0)
    assert sorted(f.key for f in fired) == sorted(f"k{n}" for n in range(20))


async def test_bad_timer_input_is_refused_with_what_to_do(server_url: str, prefix: str) -> None:
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    with pytest.raises(InvalidJobError, match="timer kind"):
        await scheduler.set_timer("bad kind", "k", delay_ms=1)
    with pytest.raises(InvalidOptionError, match="non-empty string"):
        await scheduler.set_timer("remind", "", delay_ms=1)
    with pytest.raises(InvalidOptionError, match="needs a due time"):
        await scheduler.set_timer("remind", "k")
    with pytest.raises(InvalidOptionError, match="not both"):
        await scheduler.set_timer("remind", "k", at=datetime.now(UTC), delay_ms=1)
    with pytest.raises(InvalidOptionError, match="aware datetime"):
        await scheduler.set_timer("remind", "k", at=datetime.now())
    with pytest.raises(InvalidScheduleError, match="invalid cron"):
        await scheduler.set_timer("remind", "k", cron="every day")
    with pytest.raises(TypeError, match="JSON-able"):
        await scheduler.set_timer("remind", "k", delay_ms=1, payload=object())
    claim_only = Scheduler(RedisBackend(redis=server_url, prefix=prefix, strategy="script"))
    with pytest.raises(InvalidOptionError, match="lease"):
        claim_only.add_timer(recorder([]), "remind")  # type: ignore[misc]
    assert await scheduler.get_timer("remind", "k") is None  # nothing was stored


async def test_set_timers_sets_many_in_order_and_a_fleet_fires_each_once(
    server_url: str, prefix: str
) -> None:
    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))  # never started
    settings = [
        TimerSetting(f"user:{n}", delay_ms=300, payload={"n": n}) for n in range(2_500)
    ]  # three round trips of up to 1000
    generations = await producer.set_timers("remind", settings)
    assert len(generations) == 2_500
    assert generations == sorted(generations) and len(set(generations)) == 2_500
    info = await producer.get_timer("remind", "user:1234")
    assert info is not None and info.generation == generations[1234]
    assert info.payload == {"n": 1234}
    assert await producer.set_timers("remind", []) == []
    fired: list[Fired] = []
    # A lease of 10 s, as the 10,000-timer test below: on a loaded machine a claim of
    # hundreds of due timers answered after a short lease starts none of them (a backup
    # takes each over), and a one-shot timer that lapses max_attempts times is spent.
    schedulers = fleet(server_url, prefix, 2, recorder(fired), lease_ms=10_000)
    await run_until(schedulers, lambda: len(fired) >= 2_500)
    assert sorted(f.key for f in fired) == sorted(s.key for s in settings)  # each once
    assert all(f.payload == {"n": int(f.key.split(":")[1])} for f in fired)
    assert {(f.key, f.generation) for f in fired} == {
        (s.key, g) for s, g in zip(settings, generations, strict=True)
    }


async def test_set_timers_with_one_bad_setting_sets_none(server_url: str, prefix: str) -> None:
    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    await producer.set_timer("remind", "kept", delay_ms=3_600_000, payload="before")
    settings = [
        TimerSetting("kept", delay_ms=60_000, payload="after"),
        TimerSetting("new", delay_ms=60_000),
        TimerSetting("naive", at=datetime.now()),  # no time zone
    ]
    with pytest.raises(InvalidOptionError, match="aware datetime"):
        await producer.set_timers("remind", settings)
    kept = await producer.get_timer("remind", "kept")
    assert kept is not None and kept.payload == "before"
    assert await producer.get_timer("remind", "new") is None
    with pytest.raises(InvalidOptionError, match="'due-less' needs a due time"):
        await producer.set_timers("remind", [TimerSetting("due-less")])


async def test_a_timer_set_here_sooner_than_the_next_poll_wakes_this_instance(
    server_url: str, prefix: str
) -> None:
    """A running instance that fires the kind looks at a timer set through it when it is
    due, not at its next poll (30 s here, longer than the test)."""
    fired: list[Fired] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), timer_poll_ms=30_000)
    scheduler.add_timer(recorder(fired), "remind")
    async with scheduler:
        await anyio.sleep(0.3)  # its first claim found nothing: the next is 30 s away
        await scheduler.set_timers("remind", [TimerSetting("a", delay_ms=200)])
        await scheduler.set_timer("remind", "b", delay_ms=400)
        with anyio.fail_after(15):
            while len(fired) < 2:  # noqa: ASYNC110 - polls a list
                await anyio.sleep(0.05)
    assert sorted(f.key for f in fired) == ["a", "b"]


async def subscribers(direct: redis.Redis, prefix: str, count: int) -> None:
    """Until ``count`` instances listen for the prefix's timer hints."""
    channel = hint_channel(prefix)
    with anyio.fail_after(15):
        while dict(direct.pubsub_numsub(channel)).get(channel, 0) < count:  # noqa: ASYNC110
            await anyio.sleep(0.05)


async def set_until_fired(
    producer: Scheduler[Any], key: str, fired: list[str], within_sec: float
) -> None:
    """Set ``key``'s ``remind`` timer due in 200 ms, again every second, until it fires
    (``fired`` holds the keys fired): a set published while no subscription listens
    (one being made again) is not heard, and each set due sooner is published again."""
    with anyio.fail_after(within_sec):
        while key not in fired:
            await producer.set_timer("remind", key, delay_ms=200)
            with anyio.move_on_after(1):
                while key not in fired:  # noqa: ASYNC110 - polls a list
                    await anyio.sleep(0.05)


@pytest.mark.server_tier  # a PUBLISH from a script, heard by a subscription
async def test_a_timer_set_by_another_process_sooner_than_the_next_poll_fires_through_a_hint(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """Instances that would look again in 30 s (their poll) hear of a timer another
    process sets to fall due in 300 ms, and fire it then: the set made it the first of
    its kind, and was published."""
    fired: list[Fired] = []
    schedulers = fleet(server_url, prefix, 2, recorder(fired), timer_poll_ms=30_000)
    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))  # never started
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await subscribers(direct, prefix, 2)
        await anyio.sleep(0.3)  # their first claims found nothing: the next in 30 s
        await producer.set_timer("remind", "far", delay_ms=3_600_000)
        await producer.set_timer("remind", "soon", delay_ms=300)
        await producer.set_timer("remind", "sooner", delay_ms=100)
        with anyio.fail_after(15):
            while len(fired) < 2:  # noqa: ASYNC110 - polls a list
                await anyio.sleep(0.05)
    assert sorted(f.key for f in fired) == ["soon", "sooner"]


@pytest.mark.slow
async def test_ten_thousand_timers_due_within_seconds_fire_exactly_once_across_five_instances(
    server_url: str, prefix: str
) -> None:
    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    keys = [f"user:{n}" for n in range(10_000)]
    async with producer:

        async def set_some(part: list[str]) -> None:
            for key in part:
                await producer.set_timer("remind", key, delay_ms=2_000 + hash(key) % 2_000)

        # Sets made together share round trips (pipelined).
        async with anyio.create_task_group() as group:
            for start in range(0, len(keys), 200):
                group.start_soon(set_some, keys[start : start + 200])
    fired: list[Fired] = []
    # Until every timer fired (a loaded machine takes longer), and a moment more. A lease
    # of 10 s (the default is 30 s): a loop that all five instances share, starved by a
    # loaded machine, stalls a second or two, and a stall longer than the lease would
    # rightly let a backup fire a timer again (with a higher fence).
    schedulers = fleet(server_url, prefix, 5, recorder(fired), lease_ms=10_000)
    await run_until(schedulers, lambda: len(fired) >= 10_000)
    counts = collections.Counter(f.key for f in fired)
    assert sorted(counts) == sorted(keys)
    twice = [(f.key, f.attempt, f.trigger, f.runner) for f in fired if counts[f.key] > 1]
    assert [key for key, n in counts.items() if n > 1] == [], sorted(twice)[:12]
    assert len({f.runner for f in fired}) == 5  # the fleet shared the work


def ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def test_a_daily_timer_in_a_zone_keeps_its_local_time_across_a_dst_change() -> None:
    """09:00 in Athens is 07:00 UTC in winter and 06:00 UTC in summer: across the
    spring change the next firing comes 23 hours later, and 25 hours in autumn."""
    daily = Recurrence.make("0 9 * * *", None, "Europe/Athens")
    assert daily is not None and daily.encode() == "cron;Europe/Athens;0 9 * * *"
    decoded = Recurrence.decode(daily.encode())
    assert decoded is not None and decoded.describe() == daily.describe()
    before_spring = ms(datetime(2026, 3, 28, 7, tzinfo=UTC))
    assert daily.next_ms(before_spring, before_spring) == ms(datetime(2026, 3, 29, 6, tzinfo=UTC))
    before_autumn = ms(datetime(2026, 10, 24, 6, tzinfo=UTC))
    assert daily.next_ms(before_autumn, before_autumn) == ms(datetime(2026, 10, 25, 7, tzinfo=UTC))


def test_a_recurring_timer_that_fired_late_goes_on_from_now_not_once_per_missed_time() -> None:
    every = Recurrence.make(None, 1_000, "UTC")
    assert every is not None and every.encode() == "every;1000"
    assert every.next_ms(5_000, 5_000) == 6_000  # on time: the next interval
    assert every.next_ms(5_000, 15_500) == 16_000  # after an outage: the next one to come


async def test_an_attempt_this_instance_takes_over_from_itself_runs(
    server_url: str, prefix: str
) -> None:
    """Attempt 1 blocks the event loop past its lease (no heartbeat gets out): the same
    instance's next claim takes the firing over as attempt 2 while attempt 1 is still
    settling here. Attempt 2 must run, not be taken for attempt 1."""
    fired: list[Fired] = []

    async def remind(fire: TimerRun) -> None:
        await recorder(fired)(fire)
        if fire.attempt == 1:
            time.sleep(2.0)  # noqa: ASYNC251 - the point: the loop stands still
            await anyio.sleep(1)  # its lease is gone by now: cancelled here

    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    await producer.set_timer("remind", "k", delay_ms=0)
    (worker,) = fleet(server_url, prefix, 1, remind, max_attempts=2)
    async with worker:
        with anyio.fail_after(15):
            while len(fired) < 2:  # noqa: ASYNC110 - polls a list
                await anyio.sleep(0.05)
        await anyio.sleep(0.5)
    # Taken over, or (when attempt 1's finish got there first) retried: attempt 2 ran.
    assert [f.attempt for f in fired] == [1, 2] and fired[1].trigger in ("takeover", "retry")
    assert await producer.get_timer("remind", "k") is None  # attempt 2 finished it


async def test_a_timer_that_cannot_be_read_fails_its_attempts_and_ends_nothing_else(
    server_url: str, prefix: str, direct: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    await producer.set_timer("remind", "bad", every_ms=60_000, delay_ms=0)
    await producer.set_timer("remind", "good", delay_ms=300)
    keys = TimerKeys.for_kind(prefix, "remind")
    # As another host may see it: a recurrence in a time zone this one lacks.
    raw = str(direct.hget(keys.timers, "bad")).split("|")
    raw[11] = "cron;Nowhere/Atlantis;0 9 * * *"
    direct.hset(keys.timers, "bad", "|".join(raw))
    fired: list[Fired] = []
    await run_for(fleet(server_url, prefix, 1, recorder(fired), max_attempts=2), 1.5)
    assert [f.key for f in fired] == ["good"]  # the scheduler went on
    assert "cannot be fired here" in caplog.text
    assert await producer.get_timer("remind", "bad") is None  # both attempts failed


async def test_a_kind_added_to_a_running_scheduler_fires(server_url: str, prefix: str) -> None:
    fired: list[Fired] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    async with scheduler:
        scheduler.add_timer(recorder(fired), "remind")
        await scheduler.set_timer("remind", "k", delay_ms=0)
        with anyio.fail_after(5):
            while not fired:  # noqa: ASYNC110 - polls a list
                await anyio.sleep(0.05)
    assert [f.key for f in fired] == ["k"]


async def test_a_kinds_buckets_are_the_stores_for_every_process(
    server_url: str, prefix: str
) -> None:
    fired: list[Fired] = []
    (worker,) = fleet(server_url, prefix, 1, recorder(fired), buckets=3)
    async with worker:
        # A process that only sets timers finds the kind's three buckets in the store.
        producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
        for n in range(30):
            await producer.set_timer("remind", f"k{n}", delay_ms=0)
        with anyio.fail_after(5):
            while len(fired) < 30:  # noqa: ASYNC110 - polls a list
                await anyio.sleep(0.05)
    (other,) = fleet(server_url, prefix, 1, recorder([]), buckets=2)
    with pytest.raises(InvalidOptionError, match="has 3 bucket"):
        async with other:
            pass
    with pytest.raises(InvalidJobError, match="'#'"):
        await producer.set_timer("remind#2", "k", delay_ms=0)


async def test_a_bucket_count_in_the_store_that_is_not_one_is_an_error_that_says_so(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """Something else wrote the kind's bucket count (or wrote it out of range): a
    process that only sets timers refuses to guess, names the key and what to do, and
    sets nothing."""
    where = TimerKeys.buckets_key(prefix, "remind")
    for stored in ("many", "0", "100000"):
        direct.set(where, stored)
        producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
        with pytest.raises(InvalidOptionError, match="buckets=") as info:
            await producer.set_timer("remind", "k", delay_ms=0)
        assert where in str(info.value) and repr(stored) in str(info.value)
    assert direct.keys(f"*{prefix}remind*:timers") == []
