"""The real engine on virtual time (``anarchon.testing``): the long horizons the engine
machine on the real clock cannot reach in CI's budget.

Each example is a fresh fleet of up to three instances, run for days of virtual time
from just before Europe's spring change, with jobs whose rules need hours to show:
catch-up across an outage, a fixed-time and an elapsed-time job through the change,
retries hours apart, runs longer than their period (overlap), attempts that hang past
their timeout, bounds (``start_at``, ``end_at``, ``max_runs``), excluded weekend days,
and timers set along the way (some rearmed). Between spans of time the example kills
an instance (a crash: its leases stay until they expire), starts one, makes the server
unreachable, frozen or out of memory (every write refused) for minutes to hours, or
asks for a manual run.

Time is exact here: a fault is a known span, and no load of the machine shifts
anything, so the checks allow no slack. After the last step every fault heals, an
instance runs, and a day passes; then, in words:

1. **Once.** Each attempt of a slot starts once; a slot's later attempt starts only
   after the earlier one ended, unless the earlier one's runner was killed or the
   server was out of reach between the two starts (the earlier runner then lost its
   lease); attempt numbers and fences grow.
2. **Healthy slots run.** A slot due while the fleet was healthy (an instance alive,
   the server answering) from 10 s before it to ``max_late_ms`` after it started, or
   is recorded skipped for a reason its rules give (overlap, excluded).
3. **Nothing is lost silently.** Every slot due while an instance was alive (from a
   second before it to the end) started or was recorded skipped; a slot of the
   catch-up job whose window held a healthy minute started.
4. **Runs settle.** Every attempt started ends (recorded, or its lease lost: a backup
   goes on) unless its runner was killed or the server could not record its end, and
   every slot that started has a final outcome by the end.
5. **Timers fire once.** Each generation of a key fires ok at most once, and a timer set
   while an instance lived fires by the end.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anarchon import (
    LeaseLost,
    RedisBackend,
    Run,
    RunFinished,
    RunStarted,
    Scheduler,
    SlotSkipped,
    TimerFired,
    TimerRun,
)
from anarchon._model.schedule import fire_times
from anarchon.testing import TestFleet
from property_tests.profiles import examples

START = datetime(2027, 3, 26, 20, 0, tzinfo=UTC)  # Friday; London springs forward on Sunday
MAX_LATE_MS = 60_000
CATCH_UP_MS = 12 * 3_600_000
LEASE_MS = 30_000
MAX_INSTANCES = 3


def _mix(*parts: object) -> int:
    """A number from the parts, the same on every run (a handler's behaviour)."""
    text = "|".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "big")


@dataclass
class Ledger:
    """What the handlers did, kept apart from the store and the events."""

    ran: list[tuple[str, int, int, str]] = field(default_factory=list)


def make_scheduler(ledger: Ledger) -> Scheduler[Any]:
    scheduler: Scheduler[Any] = Scheduler(
        RedisBackend("redis://machine.invalid:6379", prefix="vm:"), lease_ms=LEASE_MS
    )

    def note(run: Run) -> None:
        ledger.ran.append((run.job, run.slot_ms, run.attempt, run.runner))

    # Fixed time in London: on 2027-03-28 01:30 is skipped (it fires as the clocks
    # jump); it catches up half a day, and fails its first attempt on odd days.
    @scheduler.job(
        "30 1 * * *",
        timezone="Europe/London",
        name="daily",
        catch_up_ms=CATCH_UP_MS,
        max_attempts=3,
        retry_delay_ms=30 * 60_000,
    )
    async def daily(run: Run) -> None:
        note(run)
        if run.attempt == 1 and run.slot.day % 2:
            raise RuntimeError("the first try fails on odd days")

    # Runs of 20 or 75 minutes: a long one makes the next slot skip (overlap).
    @scheduler.job("0 * * * *", name="hourly")
    async def hourly(run: Run) -> None:
        note(run)
        await anyio.sleep(60 * (75 if _mix(run.slot_ms) % 4 == 0 else 20))

    # By elapsed time in London; one slot in five hangs past its timeout (retried).
    @scheduler.job(
        "*/15 * * * *",
        timezone="Europe/London",
        name="quarter",
        timeout_ms=10 * 60_000,
        max_attempts=2,
        retry_delay_ms=60_000,
    )
    async def quarter(run: Run) -> None:
        note(run)
        if run.attempt == 1 and _mix(run.slot_ms) % 5 == 0:
            await anyio.sleep(30 * 60)

    @scheduler.job(
        every_ms=20 * 60_000,
        name="bounded",
        start_at=START + timedelta(hours=6),
        end_at=START + timedelta(hours=40),
        max_runs=60,
    )
    async def bounded(run: Run) -> None:
        note(run)

    @scheduler.job("0 9 * * *", name="weekday", exclude="* * * * 6,0")
    async def weekday(run: Run) -> None:
        note(run)

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        if fire.key.endswith("r") and fire.generation < 3:
            fire.rearm(delay_ms=3 * 3_600_000)

    return scheduler


Step = tuple[Any, ...]

steps = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.integers(1, 480)),
        st.tuples(st.just("kill"), st.integers(0, MAX_INSTANCES - 1)),
        st.tuples(st.just("start")),
        st.tuples(st.just("unreachable"), st.integers(1, 240)),
        st.tuples(st.just("frozen"), st.integers(1, 90)),
        st.tuples(st.just("oom"), st.integers(1, 120)),
        st.tuples(st.just("timer"), st.integers(0, 5), st.integers(1, 600)),
        st.tuples(st.just("run_now"), st.sampled_from(["daily", "weekday"])),
    ),
    min_size=3,
    max_size=10,
)


@dataclass
class World:
    """What the example did and when (virtual ms): the faults' spans, each instance's
    life, the timers set."""

    outages: list[tuple[int, int]] = field(default_factory=list)
    lives: dict[str, list[int]] = field(default_factory=dict)  # id -> [from, until]
    timers: list[tuple[str, int, int]] = field(default_factory=list)  # key, set at, due
    #: The slots whose end the store recorded (its history), by the end.
    recorded: set[tuple[str, int]] = field(default_factory=set)
    end_ms: int = 0

    def alive_through(self, start: int, end: int) -> bool:
        return any(life[0] <= start and end <= life[1] for life in self.lives.values())

    def healthy_through(self, start: int, end: int) -> bool:
        if any(a < end and start < b for a, b in self.outages):
            return False
        return self.alive_through(start, end)

    def troubled_between(self, start: int, end: int) -> bool:
        return any(a <= end and start <= b for a, b in self.outages)

    def killed_by(self, runner: str, moment: int) -> bool:
        life = self.lives.get(runner)
        return life is not None and life[1] <= moment


def ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


async def play(example: list[Step]) -> None:
    ledger = Ledger()
    world = World()
    scheduler = make_scheduler(ledger)
    async with TestFleet(scheduler, start=START, instances=2) as fleet:
        for instance in fleet.instances:
            world.lives[instance.instance_id] = [ms(fleet.now()), 2**62]

        async def outage(kind: str, minutes: int) -> None:
            began = ms(fleet.now())
            faults = {
                "unreachable": fleet.server_unreachable,
                "frozen": fleet.server_frozen,
                "oom": fleet.server_out_of_memory,
            }
            async with faults[kind]():
                await fleet.advance(minutes=minutes)
            world.outages.append((began, ms(fleet.now())))

        for step in example:
            kind = step[0]
            if kind == "advance":
                await fleet.advance(minutes=step[1])
            elif kind == "kill" and fleet.instances:
                victim = fleet.instances[step[1] % len(fleet.instances)]
                await fleet.kill_instance(victim)
                world.lives[victim.instance_id][1] = ms(fleet.now())
            elif kind == "start" and len(fleet.instances) < MAX_INSTANCES:
                started = await fleet.start_instance()
                world.lives[started.instance_id] = [ms(fleet.now()), 2**62]
            elif kind in ("unreachable", "frozen", "oom"):
                await outage(kind, step[1])
            elif kind == "timer" and fleet.instances:
                key = f"k{step[1]}" + ("r" if step[1] % 2 else "")
                runner = fleet.instances[0]
                try:
                    await runner.set_timer("remind", key, delay_ms=step[2] * 60_000)
                except Exception:
                    pass  # refused (the server out of reach): nothing was set
                else:
                    now = ms(fleet.now())
                    world.timers.append((key, now, now + step[2] * 60_000))
            elif kind == "run_now" and fleet.instances:
                # Refused at times (overlap, unreachable): judged by the rules alone.
                with anyio.move_on_after(3600), contextlib.suppress(Exception):
                    await fleet.instances[0].run_now(step[1])
        # Heal, make sure an instance runs, and let a day pass.
        if not fleet.instances:
            started = await fleet.start_instance()
            world.lives[started.instance_id] = [ms(fleet.now()), 2**62]
        await fleet.advance(days=1)
        world.end_ms = ms(fleet.now())
        events = list(fleet.events)
        reader = fleet.instances[0]
        for job in reader.jobs:
            world.recorded |= {(job, r.slot_ms) for r in await reader.history(job, 1000)}
    check(scheduler, ledger, world, events)


def check(scheduler: Scheduler[Any], ledger: Ledger, world: World, events: list[Any]) -> None:
    started = [e for e in events if isinstance(e, RunStarted)]
    finished = [e for e in events if isinstance(e, RunFinished)]
    skipped = {(e.job, e.slot_ms) for e in events if isinstance(e, SlotSkipped)}
    ended = {(e.run.job, e.run.slot_ms, e.run.attempt, e.run.runner) for e in finished}
    # An attempt whose lease was lost ends there (its slot is another attempt's then).
    ended |= {
        (e.job, e.slot_ms, e.attempt, e.instance)
        for e in events
        if isinstance(e, LeaseLost) and e.timer_key is None
    }

    # 1. Once.
    by_slot: dict[tuple[str, int], list[RunStarted]] = {}
    for event in started:
        by_slot.setdefault((event.run.job, event.run.slot_ms), []).append(event)
    for (job, slot), attempts in by_slot.items():
        for earlier, later in itertools.pairwise(attempts):
            assert later.run.attempt > earlier.run.attempt, (job, slot, earlier.run, later.run)
            assert later.run.fence > earlier.run.fence, (job, slot)
            earlier_end = [
                ms(f.at)
                for f in finished
                if (f.run.job, f.run.slot_ms, f.run.attempt) == (job, slot, earlier.run.attempt)
            ]
            begun = ms(later.at)
            assert (
                (earlier_end and earlier_end[0] <= begun)
                or world.killed_by(earlier.run.runner, begun)
                or world.troubled_between(ms(earlier.at), begun)
            ), f"engine virtual: {job} {slot} attempt {later.run.attempt} overlapped"

    ran_slots = {(e.run.job, e.run.slot_ms) for e in started}
    first_ms = ms(START)
    horizon = world.end_ms - 2 * 3_600_000  # the last slots may still be settling
    for job in scheduler.jobs:
        if job == "bounded":
            continue  # its bounds decide its slots (rule 3 alone)
        definition = scheduler_job(scheduler, job)
        slots = fire_times(definition.schedule, first_ms, 2000, definition.excluded)
        for slot_dt in slots:
            slot = ms(slot_dt)
            if slot > horizon:
                break
            key = (job, slot)
            # 2. Healthy slots run.
            if world.healthy_through(slot - 10_000, slot + MAX_LATE_MS):
                assert key in ran_slots or key in skipped, f"engine virtual: {key} not run"
            # 3. Nothing is lost silently.
            if world.alive_through(slot - 1000, world.end_ms):
                assert key in ran_slots or key in skipped, f"engine virtual: {key} lost"
                if job == "daily" and _healthy_minute(world, slot, slot + CATCH_UP_MS):
                    assert key in ran_slots, f"engine virtual: {key} not caught up"

    # 4. Runs settle.
    for event in started:
        run = event.run
        begun = ms(event.at)
        if begun < horizon and (run.job, run.slot_ms, run.attempt, run.runner) not in ended:
            # Its runner died, or the server could not record its end (a backup then
            # takes the slot over: the slot's final outcome is judged below).
            assert world.killed_by(run.runner, world.end_ms) or world.troubled_between(
                begun, begun + 2 * 3_600_000
            ), f"engine virtual: {run} unsettled"
    # A slot settles when its last attempt ends here, or in the store alone (a backup
    # records a dead or unrecorded last attempt).
    finals = {(f.run.job, f.run.slot_ms) for f in finished if not f.retried} | world.recorded
    for key in ran_slots:
        if max(ms(e.at) for e in by_slot[key]) < horizon:
            assert key in finals, f"engine virtual: {key} has no final outcome"

    # 5. Timers fire once.
    fired = [e for e in events if isinstance(e, TimerFired) and e.outcome == "ok"]
    generations = [(e.run.key, e.run.generation) for e in fired]
    assert len(generations) == len(set(generations)), "engine virtual: a timer fired twice"
    fired_keys = {e.run.key for e in fired}
    for key, set_at, due in world.timers:
        later_sets = [t for t in world.timers if t[0] == key and t[1] > set_at]
        if due < horizon and world.alive_through(set_at, world.end_ms) and not later_sets:
            assert key in fired_keys, f"engine virtual: timer {key} due {due} never fired"


def _healthy_minute(world: World, start: int, end: int) -> bool:
    """A minute of health (and a few seconds to claim) within [start, end]."""
    moment = start
    while moment + 90_000 <= end:
        if world.healthy_through(moment, moment + 90_000):
            return True
        moment += 60_000
    return False


def scheduler_job(scheduler: Scheduler[Any], name: str) -> Any:
    from anarchon._engine.instance import Instance

    return Instance.of(scheduler).jobs[name]


@pytest.fixture(params=["asyncio", "trio"])
def loop(request: pytest.FixtureRequest) -> Iterator[str]:
    yield str(request.param)


@pytest.mark.slow("6 examples per loop, each days of virtual time: the engine's long horizons")
@settings(max_examples=examples(6), suppress_health_check=list(HealthCheck), deadline=None)
@given(example=steps)
def test_the_engine_keeps_its_rules_over_days_of_virtual_time(
    loop: str, example: list[Step]
) -> None:
    anyio.run(play, example, backend=loop)


def test_the_day_rule_judges_slots_it_could_not_see_run() -> None:
    """The checks read what they should: a slot the ledger never saw and no event
    recorded, in a healthy world, is reported."""
    world = World(lives={"a": [0, 2**62]}, end_ms=ms(START) + 3 * 86_400_000)
    scheduler = make_scheduler(Ledger())
    with pytest.raises(AssertionError, match="engine virtual"):
        check(scheduler, Ledger(), world, [])
