"""Durable per-key timers (design section 9) on real servers, under asyncio and trio: set
from any process, fired once across the fleet through the real engine, rearmed,
replaced, cancelled, recurring, given back on stop, never lost while nobody runs."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest

from anarchon import (
    InvalidJobError,
    InvalidOptionError,
    InvalidScheduleError,
    RedisBackend,
    Scheduler,
    TimerRun,
)
from anarchon._timer import Recurrence

pytestmark = pytest.mark.anyio

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
    url: str, prefix: str, n: int, handler: Callable[[TimerRun], Any], **options: Any
) -> list[Scheduler[Any]]:
    """``n`` schedulers that fire the ``remind`` kind through ``handler``."""
    schedulers: list[Scheduler[Any]] = []
    for i in range(n):
        scheduler = Scheduler(
            RedisBackend(redis=url, prefix=prefix), lease_ms=LEASE_MS, instance_id=f"i{i}",
            retry_delay_ms=100, stop_grace_ms=200,
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


async def test_timers_due_together_fire_exactly_once_across_three_instances(
    server_url: str, prefix: str
) -> None:
    producer = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    keys = [f"user:{n}" for n in range(300)]
    async with producer:  # set on the running scheduler's own connection
        for key in keys:
            await producer.set_timer("remind", key, delay_ms=500, payload=key.encode())
    fired: list[Fired] = []
    await run_for(fleet(server_url, prefix, 3, recorder(fired)), 2.5)
    assert sorted(f.key for f in fired) == sorted(keys)  # each once
    assert all(f.payload == f.key.encode() for f in fired)
    assert len({f.fence for f in fired}) == len(fired)


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
    await run_for(fleet(server_url, prefix, 2, remind), 2.0)
    assert len(fired) == 3 and all(f.payload == [1, 2] for f in fired)
    dues = [f.due_ms for f in fired]
    assert [b - a for a, b in itertools.pairwise(dues)] == [200, 200]
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
    await run_for(fleet(server_url, prefix, 5, recorder(fired)), 8.0)
    counts = collections.Counter(f.key for f in fired)
    assert sorted(counts) == sorted(keys)
    assert [key for key, n in counts.items() if n > 1] == []
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
