"""An instance's bound on handlers running at once (``max_concurrent``), with
backpressure: at its bound an instance claims nothing more, what is due stays in the
store for the other instances, and every timer and slot still runs once."""

from __future__ import annotations

import collections
import signal
from contextlib import AsyncExitStack

import anyio
import pytest
import redis
from prometheus_client import CollectorRegistry

from anarchon import (
    IntervalSchedule,
    InvalidOptionError,
    RedisBackend,
    Run,
    Scheduler,
    TimerRun,
    TimerSetting,
)
from anarchon.prometheus import instrument
from tests.helpers import wait_until
from tests.test_timer_faults import HEARTBEAT_MS, LEASE_MS, start_worker

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]

TIMERS = 200
BOUND = 10
HANDLER_SEC = 0.2


class Peaks:
    """How many handlers run at once on each instance, and the most there ever were."""

    def __init__(self) -> None:
        self.now: collections.Counter[str] = collections.Counter()
        self.most: collections.Counter[str] = collections.Counter()
        self.fired: collections.Counter[str] = collections.Counter()

    async def run(self, runner: str, key: str) -> None:
        self.now[runner] += 1
        self.most[runner] = max(self.most[runner], self.now[runner])
        try:
            await anyio.sleep(HANDLER_SEC)
            self.fired[key] += 1
        finally:
            self.now[runner] -= 1


def timer_fleet(url: str, prefix: str, peaks: Peaks, n: int) -> list[Scheduler]:  # type: ignore[type-arg]
    schedulers = []
    for i in range(n):
        scheduler = Scheduler(
            RedisBackend(redis=url, prefix=prefix),
            instance_id=f"i{i}",
            lease_ms=3000,
            max_concurrent=BOUND,
        )

        async def remind(fire: TimerRun) -> None:
            await peaks.run(fire.runner, fire.key)

        scheduler.add_timer(remind, "remind")
        schedulers.append(scheduler)
    return schedulers


async def test_timers_due_together_run_at_most_the_bound_at_once_and_each_once(
    server_url: str, prefix: str
) -> None:
    """200 timers due at once, two instances bounded at 10: neither runs more than 10
    handlers at any moment, and every timer fires once; the work is shared."""
    peaks = Peaks()
    schedulers = timer_fleet(server_url, prefix, peaks, 2)
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await schedulers[0].set_timers(
            "remind", [TimerSetting(f"k{n}", delay_ms=0) for n in range(TIMERS)]
        )
        await wait_until(lambda: len(peaks.fired) == TIMERS, 60, "every timer to fire")
    assert max(peaks.most.values()) <= BOUND, peaks.most
    assert set(peaks.fired.values()) == {1}, [k for k, n in peaks.fired.items() if n > 1]
    assert len(peaks.most) == 2, peaks.most  # both instances took a share


async def test_an_instance_stopped_at_its_bound_loses_no_timer(
    server_url: str, prefix: str
) -> None:
    """One instance takes its bound of the timers and is stopped mid-way without grace:
    the firings it gives back and the timers it never claimed all fire on the other,
    which never runs more than its bound either."""
    peaks = Peaks()
    first, second = timer_fleet(server_url, prefix, peaks, 2)
    async with first:
        await first.set_timers(
            "remind", [TimerSetting(f"k{n}", delay_ms=0) for n in range(TIMERS // 4)]
        )
        await wait_until(lambda: peaks.now["i0"] == BOUND, 20, "the first at its bound")
        await first.stop(grace_ms=0)
    async with second:
        await wait_until(lambda: len(peaks.fired) == TIMERS // 4, 60, "every timer to fire")
        await anyio.sleep(HANDLER_SEC * 2)  # a second firing of any key would show now
    assert peaks.most["i1"] <= BOUND and peaks.most["i0"] <= BOUND, peaks.most
    assert set(peaks.fired.values()) == {1}, [k for k, n in peaks.fired.items() if n > 1]


async def test_slots_due_together_run_at_most_the_bound_at_once(
    server_url: str, prefix: str
) -> None:
    """Twelve jobs due every second on one instance bounded at 4: at most 4 run at once
    (the slots it has no room for wait in the store, or are skipped as late)."""
    running = 0
    most = 0
    started: list[float] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), max_concurrent=4)

    async def job(run: Run) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        started.append(anyio.current_time())
        try:
            await anyio.sleep(0.3)
        finally:
            running -= 1

    for n in range(12):
        scheduler.add_job(job, IntervalSchedule(1000), name=f"j{n}", max_late_ms=2000)
    async with scheduler:
        await wait_until(lambda: len(started) >= 24, 20, "two seconds of slots")
    assert most <= 4, most


def test_max_concurrent_takes_a_whole_number_or_none() -> None:
    Scheduler(RedisBackend(), max_concurrent=None)
    Scheduler(RedisBackend(), max_concurrent=1)
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(InvalidOptionError, match="max_concurrent"):
            Scheduler(RedisBackend(), max_concurrent=bad)  # type: ignore[arg-type]


async def test_the_metrics_show_the_room_left_and_what_waited_for_it(
    server_url: str, prefix: str
) -> None:
    """An instance bounded at 10 with 100 timers due: its Prometheus metrics show the
    bound's room (10 once idle) and the timer claims it put off for want of room."""
    peaks = Peaks()
    (scheduler,) = timer_fleet(server_url, prefix, peaks, 1)
    registry = CollectorRegistry()
    instrument(scheduler, registry)
    async with scheduler:
        await scheduler.set_timers(
            "remind", [TimerSetting(f"k{n}", delay_ms=0) for n in range(TIMERS // 2)]
        )
        await wait_until(lambda: len(peaks.fired) == TIMERS // 2, 60, "every timer to fire")
        await wait_until(lambda: scheduler.running == 0, 10, "the last firing to settle")
        assert registry.get_sample_value("anarchon_capacity_room") == BOUND
        deferred = registry.get_sample_value("anarchon_capacity_deferred_timer_claims_total")
    assert deferred is not None and deferred >= 1, deferred
    assert peaks.most["i0"] <= BOUND, peaks.most


async def test_a_timer_kind_s_own_bound_holds_it_alone(server_url: str, prefix: str) -> None:
    """A kind bounded at 3 runs at most 3 firings at once here, while another kind's
    timers due at the same moment go on past it; the metrics count the claims put off."""
    peaks = {"slow": Peaks(), "fast": Peaks()}
    scheduler = Scheduler(
        RedisBackend(redis=server_url, prefix=prefix), lease_ms=3000, max_concurrent=None
    )

    async def slow(fire: TimerRun) -> None:
        await peaks["slow"].run(fire.runner, fire.key)

    async def fast(fire: TimerRun) -> None:
        await peaks["fast"].run(fire.runner, fire.key)

    scheduler.add_timer(slow, "slow", max_concurrent=3)
    scheduler.add_timer(fast, "fast")
    registry = CollectorRegistry()
    instrument(scheduler, registry)
    waiting: list[float] = []
    async with scheduler:
        for kind in ("slow", "fast"):
            await scheduler.set_timers(kind, [TimerSetting(f"k{n}", delay_ms=0) for n in range(24)])

        def fired_all() -> bool:
            waiting.append(registry.get_sample_value("anarchon_capacity_waiting") or 0)
            return all(len(p.fired) == 24 for p in peaks.values())

        await wait_until(fired_all, 60, "every timer to fire")
    assert peaks["slow"].most[scheduler.instance_id] <= 3, peaks["slow"].most
    assert peaks["fast"].most[scheduler.instance_id] > 3, peaks["fast"].most
    assert all(set(p.fired.values()) == {1} for p in peaks.values())
    assert max(waiting) >= 1, "the slow kind's claims were never seen waiting for room"


async def test_a_job_s_own_bound_holds_it_alone(server_url: str, prefix: str) -> None:
    """A job with overlap="allow" due every 100 ms, whose runs take 600 ms, bounded at 2:
    never more than 2 of its runs at once here, while another job due as often is not
    held back by it."""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), max_concurrent=None)
    running: collections.Counter[str] = collections.Counter()
    most: collections.Counter[str] = collections.Counter()
    starts: collections.Counter[str] = collections.Counter()

    async def job(run: Run) -> None:
        running[run.job] += 1
        most[run.job] = max(most[run.job], running[run.job])
        starts[run.job] += 1
        try:
            await anyio.sleep(0.6)
        finally:
            running[run.job] -= 1

    schedule = IntervalSchedule(100)
    scheduler.add_job(job, schedule, name="bounded", overlap="allow", max_concurrent=2)
    scheduler.add_job(job, schedule, name="free", overlap="allow")
    async with scheduler:
        await wait_until(lambda: starts["free"] >= 20, 30, "twenty runs of the free job")
        assert most["free"] > 2, most  # the bounded job's waiting claims held nothing up
    assert most["bounded"] == 2, most
    assert starts["bounded"] >= 3, starts


async def test_run_now_waits_for_room_under_the_bound(server_url: str, prefix: str) -> None:
    """At its bound an instance starts a run_now only once a run here ends."""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), max_concurrent=1)
    release = anyio.Event()
    started: list[str] = []

    async def hold(fire: TimerRun) -> None:
        started.append("timer")
        await release.wait()

    async def report() -> None:
        started.append("report")

    scheduler.add_timer(hold, "hold")
    scheduler.add_job(report, "0 0 1 1 *")
    async with scheduler, anyio.create_task_group() as group:
        await scheduler.set_timer("hold", "k", delay_ms=0)
        await wait_until(lambda: started == ["timer"], 20, "the timer to take the room")
        group.start_soon(scheduler.run_now, "report")
        await anyio.sleep(0.3)
        assert started == ["timer"], "run_now started past the bound"
        release.set()
        await wait_until(lambda: started == ["timer", "report"], 20, "run_now once room is made")


def test_a_job_s_or_kind_s_max_concurrent_takes_a_whole_number_or_none() -> None:
    scheduler = Scheduler(RedisBackend())

    async def handler() -> None:
        pass

    scheduler.add_job(handler, "* * * * *", name="a", max_concurrent=None)
    scheduler.add_job(handler, "* * * * *", name="b", max_concurrent=5)
    scheduler.add_timer(handler, "k", max_concurrent=1)
    for n, bad in enumerate((0, -1, 1.5, True, "10", 1_000_001)):
        with pytest.raises(InvalidOptionError, match="max_concurrent"):
            scheduler.add_job(handler, "* * * * *", name=f"x{n}", max_concurrent=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidOptionError, match="max_concurrent"):
            scheduler.add_timer(handler, f"t{n}", max_concurrent=bad)  # type: ignore[arg-type]


def test_an_instance_killed_at_its_bound_loses_no_timer(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """40 timers due at once on two instances bounded at 5 (handlers of 0.5 s); one, a
    process of its own, is SIGKILLed at its bound: the other fires every timer its peer
    did not finish (those it was running, a lease later), never more than 5 at once, and
    the killed one never ran more than 5 either."""
    count, bound = 40, 5
    worker = start_worker(server_url, prefix, "a", "asyncio", str(bound))
    peaks = Peaks()
    log = f"{prefix}log"

    async def fleet() -> None:
        scheduler = Scheduler(
            RedisBackend(redis=server_url, prefix=prefix),
            instance_id="b",
            lease_ms=LEASE_MS,
            heartbeat_ms=HEARTBEAT_MS,
            max_concurrent=bound,
        )

        async def remind(fire: TimerRun) -> None:
            await peaks.run(fire.runner, fire.key)

        scheduler.add_timer(remind, "remind")
        await scheduler.set_timers(
            "remind", [TimerSetting(f"slow{n}", delay_ms=0) for n in range(count)]
        )

        def at_its_bound() -> bool:
            lines = direct.lrange(log, 0, -1)
            return sum(line.startswith("start|") for line in lines) >= bound

        await wait_until(at_its_bound, 20, "the worker at its bound")
        async with scheduler:
            worker.send_signal(signal.SIGKILL)
            await anyio.to_thread.run_sync(worker.wait)

            def all_done() -> bool:
                finished = {line.split("|")[2] for line in direct.lrange(log, 0, -1)
                            if line.startswith("done|")}  # fmt: skip
                return len(finished | set(peaks.fired)) == count

            await wait_until(all_done, 60, "every timer done")

    try:
        anyio.run(fleet)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    lines = [line.split("|") for line in direct.lrange(log, 0, -1)]
    running = most = 0
    for line in lines:  # in the order the worker pushed them
        running += 1 if line[0] == "start" else -1
        most = max(most, running)
    assert most <= bound, lines
    assert peaks.most["b"] <= bound, peaks.most
    started_there = {line[2] for line in lines if line[0] == "start"}
    done_there = {line[2] for line in lines if line[0] == "done"}
    assert started_there - done_there <= set(peaks.fired), "a firing of the dead one was lost"


async def test_every_run_now_waiting_for_room_gets_its_turn(server_url: str, prefix: str) -> None:
    """Three run_now calls wait at once for the one place an instance bounded at 1 has:
    each runs in its turn, none is left waiting (a wake-up that one waiter's look took
    from another would leave it waiting for ever, and a stop behind it)."""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), max_concurrent=1)
    release = anyio.Event()
    ran: list[str] = []

    async def hold(fire: TimerRun) -> None:
        await release.wait()

    async def report(run: Run) -> None:
        ran.append(str(run.fence))
        await anyio.sleep(0.05)

    scheduler.add_timer(hold, "hold")
    scheduler.add_job(report, "0 0 1 1 *", overlap="allow")
    async with scheduler:
        await scheduler.set_timer("hold", "k", delay_ms=0)
        await wait_until(lambda: scheduler.running == 1, 20, "the timer to take the room")
        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                for _ in range(3):
                    group.start_soon(scheduler.run_now, "report")
                await anyio.sleep(0.2)
                release.set()
    assert len(ran) == 3, ran
