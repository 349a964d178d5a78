"""Backfill (issue 44, part 1): ``Inspector.backfill``, ``Scheduler.backfill`` and
``anarchon backfill`` run the slots of a job's own schedule in a past range once across
the fleet, oldest first, with trigger ``"backfill"``; slots settled already are counted,
not run again; a range beyond 10,000 slots, one that ends after now, and a job no live
instance runs are refused; a backfill can be cancelled, and the death of the instance
driving it costs a lease, not the rest of the range."""

from __future__ import annotations

import signal
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from anarchon import (
    BackfillInfo,
    Inspector,
    InvalidJobError,
    InvalidOptionError,
    RedisBackend,
    Run,
    RunOverlapError,
    Scheduler,
)
from anarchon._model.schedule import from_epoch_ms
from anarchon._store.keys import BackfillAsked, JobKeys, hint_channel
from anarchon._store.quarantine import quarantine_of
from tests.faults import FaultProxy
from tests.helpers import anarchon_command, server_ms, wait_until
from tests.test_run_command import RunCommand, app_env, commands, entries  # noqa: F401

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]

SECOND = 1000


def whole_second_ago(direct: redis.Redis, seconds: int) -> datetime:
    """The whole second ``seconds`` before the server's now (an aware UTC datetime)."""
    return from_epoch_ms((server_ms(direct) // SECOND - seconds) * SECOND)


def fleet(server_url: str, prefix: str, ran: list[tuple[str, int, str]], n: int = 2) -> list[Any]:
    """``n`` schedulers of a job ``tick`` every second whose runs append (instance, slot,
    trigger) to ``ran``."""
    schedulers = []
    for index in range(n):
        scheduler: Scheduler[Any] = Scheduler(
            RedisBackend(redis=server_url, prefix=prefix),
            instance_id=f"i{index}",
            lease_ms=3000,
        )

        @scheduler.job(every_ms=SECOND, name="tick")
        async def tick(run: Run) -> None:
            ran.append((run.runner, run.slot_ms, run.trigger))

        schedulers.append(scheduler)
    return schedulers


async def wait_ended(inspector: Inspector, job: str, timeout_sec: float = 30) -> BackfillInfo:
    found: list[BackfillInfo] = []

    async def ended() -> bool:
        (info,) = await inspector.jobs([job])
        found[:] = [info.backfill] if info.backfill else []
        return bool(found) and found[0].status != "running"

    deadline = anyio.current_time() + timeout_sec
    while not await ended():
        assert anyio.current_time() < deadline, f"the backfill of {job} did not end: {found}"
        await anyio.sleep(0.1)
    return found[0]


async def test_a_backfill_runs_each_past_slot_once_across_the_fleet_oldest_first(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """Two instances; a backfill of five past slots, then one of ten that holds them:
    each slot runs once in the fleet, oldest first, with trigger backfill; the second
    counts the first five as settled before and runs the other five."""
    ran: list[tuple[str, int, str]] = []
    start = whole_second_ago(direct, 30)
    middle, end = start + timedelta(seconds=5), start + timedelta(seconds=10)
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        first, second = fleet(server_url, prefix, ran)
        async with first, second:
            stored = await inspector.backfill("tick", start, middle, note="the outage", by="ops")
            assert (stored.status, stored.slots, stored.by) == ("running", 5, "ops")
            assert stored.note == "the outage"
            done = await wait_ended(inspector, "tick")
            assert (done.status, done.ran_ok, done.settled_before) == ("done", 5, 0), done
            again = await inspector.backfill("tick", start, end)
            again = await wait_ended(inspector, "tick")
        assert (again.status, again.ran_ok, again.settled_before, again.skipped) == (
            "done", 5, 5, 0,
        ), again  # fmt: skip
        backfilled = [(slot, trigger) for _, slot, trigger in ran if trigger == "backfill"]
        wanted = [int(start.timestamp() * 1000) + n * SECOND for n in range(10)]
        assert [slot for slot, _ in backfilled] == wanted  # once each, oldest first
        assert {runner for runner, _, trigger in ran if trigger == "backfill"} <= {"i0", "i1"}
        history = {r.slot_ms: r.trigger for r in await inspector.history("tick", limit=100)}
        assert all(history.get(slot) == "backfill" for slot in wanted), history
        (entry, _) = await inspector.audit("tick", limit=2)
        assert entry.action == "backfill" and entry.note is not None
        assert entry.note.startswith("[") and entry.note.endswith(")"), entry.note


async def test_what_a_backfill_is_refused_for_and_why(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    ran: list[tuple[str, int, str]] = []
    (scheduler,) = fleet(server_url, prefix, ran, n=1)
    now = whole_second_ago(direct, 0)
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        async with scheduler:
            with pytest.raises(InvalidOptionError, match="more than 10,000 slots"):
                await inspector.backfill("tick", now - timedelta(hours=3), now)
            with pytest.raises(InvalidOptionError, match="is after now"):
                await inspector.backfill("tick", now, now + timedelta(minutes=5))
            with pytest.raises(InvalidOptionError, match="must be before its end"):
                await inspector.backfill("tick", now, now - timedelta(seconds=5))
            with pytest.raises(InvalidOptionError, match="aware datetime"):
                await inspector.backfill("tick", now.replace(tzinfo=None), now)
            with pytest.raises(InvalidOptionError, match="no slot"):
                await inspector.backfill(
                    "tick", now - timedelta(milliseconds=800), now - timedelta(milliseconds=700)
                )
            with pytest.raises(InvalidJobError, match="no job named"):
                await inspector.backfill("nothing", now - timedelta(seconds=5), now)
        # Stopped: no live instance runs it, and the store holds no backfill of it.
        with pytest.raises(InvalidJobError, match="no instance alive runs 'tick'"):
            await inspector.backfill("tick", now - timedelta(seconds=5), now)
        assert not direct.exists(JobKeys.for_job(prefix, "tick").backfill)


async def test_a_running_backfill_is_one_and_a_cancel_ends_it_at_its_next_slot(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    started: list[int] = []
    release = anyio.Event()
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(every_ms=SECOND, name="slow", catch_up_ms=0)
    async def slow(run: Run) -> None:
        if run.trigger == "backfill":
            started.append(run.slot_ms)
            await release.wait()

    start = whole_second_ago(direct, 60)
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        async with scheduler:
            await inspector.backfill("slow", start, start + timedelta(seconds=20))
            await wait_until(lambda: len(started) == 1, 20, "the first backfilled slot")
            with pytest.raises(RunOverlapError, match="a backfill of 'slow' is running"):
                await inspector.backfill("slow", start, start + timedelta(seconds=5))
            assert await inspector.cancel_backfill("slow", note="wrong range", by="ops")
            assert not await inspector.cancel_backfill("slow")
            release.set()
            (info,) = await inspector.jobs(["slow"])
            assert info.backfill is not None and info.backfill.status == "cancelled"
            assert info.backfill.reason == "ops: wrong range"
            # A driver that went on, or one a hint (or a renewal) started again, would
            # start the next slot in this time.
            direct.publish(hint_channel(prefix), BackfillAsked("slow").message())
            await anyio.sleep(1.5)
        assert started == [int(start.timestamp() * 1000)]
        actions = [entry.action for entry in await inspector.audit("slow")]
        assert actions == ["cancel-backfill", "backfill"]


async def test_anarchon_backfill_starts_shows_and_cancels_from_a_shell(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    ran: list[tuple[str, int, str]] = []
    (scheduler,) = fleet(server_url, prefix, ran, n=1)
    start = whole_second_ago(direct, 20)
    async with scheduler:
        asked = ("--from", start.isoformat(), "--to", (start + timedelta(seconds=3)).isoformat())
        done = await anyio.to_thread.run_sync(
            lambda: anarchon_command(server_url, prefix, "backfill", "tick", *asked)
        )
        assert done.returncode == 0, done
        assert "tick: backfill of 3 slot(s)" in done.stdout, done.stdout
        await wait_until(
            lambda: sum(1 for *_, trigger in ran if trigger == "backfill") == 3, 20, "3 runs"
        )
        shown = await anyio.to_thread.run_sync(
            lambda: anarchon_command(server_url, prefix, "backfill", "tick")
        )
        assert shown.returncode == 0 and "3 slot(s)" in shown.stdout, shown
        cancel = await anyio.to_thread.run_sync(
            lambda: anarchon_command(server_url, prefix, "backfill", "tick", "--cancel")
        )
        assert cancel.returncode == 1 and "no backfill of 'tick' is running" in cancel.stderr


async def test_a_malformed_backfill_record_costs_that_backfill_alone(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """Another client's hash at a job's backfill key, and the job named in the set of
    backfills: quarantined, the job runs on, and a new backfill says what to do."""
    keys = JobKeys.for_job(prefix, "tick")
    direct.hset(keys.backfill, mapping={"status": "running", "from": "soon"})
    direct.sadd(f"{{{prefix}}}:backfills", "tick", "x" * 5000)
    ran: list[tuple[str, int, str]] = []
    (scheduler,) = fleet(server_url, prefix, ran, n=1)
    start = whole_second_ago(direct, 20)
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector, scheduler:
        await wait_until(lambda: len(ran) >= 3, 20, "three runs of the job")
        (info,) = await inspector.jobs(["tick"])
        assert info.backfill is None
        with pytest.raises(RunOverlapError, match="is malformed"):
            await inspector.backfill("tick", start, start + timedelta(seconds=2))
        await wait_until(
            lambda: any(e.key == keys.backfill for e in quarantine_of(prefix).entries()),
            10,
            "the record quarantined",
        )
        direct.delete(keys.backfill)
        await inspector.backfill("tick", start, start + timedelta(seconds=2))
        assert (await wait_ended(inspector, "tick")).ran_ok == 2


@pytest.mark.slow("an instance killed while it drives a backfill, and one started after")
async def test_a_backfill_survives_the_death_of_the_instance_driving_it(
    server_url: str,
    prefix: str,
    direct: redis.Redis,
    tmp_path: Path,
    commands: list[RunCommand],  # noqa: F811
) -> None:
    """An ``anarchon run`` process drives a backfill of five slots (each a second of
    work); it is killed while it runs the second. An instance started after takes the
    turn once the dead one's lapses and decides the rest: every slot of the range was
    started, the killed one again after it was interrupted, and none twice besides."""
    start = whole_second_ago(direct, 30)
    slots = [int(start.timestamp() * 1000) + n * SECOND for n in range(5)]
    env = app_env(server_url, prefix, work_sec=1, lease_ms=2000)
    dying = RunCommand(tmp_path, "dying", env)
    commands.append(dying)
    await anyio.to_thread.run_sync(dying.wait_live)
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        await inspector.backfill("work", start, start + timedelta(seconds=5))

        def backfilled() -> list[int]:
            started = [int(e[5]) for e in entries(direct, prefix) if e[0] == "start"]
            return [slot for slot in started if slot in slots]

        await wait_until(lambda: len(backfilled()) >= 2, 30, "two backfilled slots started")
        dying.signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(dying.wait, 10)
        ran: list[int] = []
        scheduler: Scheduler[Any] = Scheduler(
            RedisBackend(redis=server_url, prefix=prefix), instance_id="heir", lease_ms=2000
        )

        @scheduler.job("* * * * * *", name="work")
        async def work(run: Run) -> None:
            if run.slot_ms in slots:
                ran.append(run.slot_ms)

        async with scheduler:
            done = await wait_ended(inspector, "work", timeout_sec=40)
        assert done.status == "done", done
        started_by_dead = backfilled()
        assert len(ran) >= 3, (started_by_dead, ran)  # the heir decided the rest
        assert sorted(set(started_by_dead) | set(ran)) == slots
        assert len(ran) == len(set(ran))
        assert not set(ran) & (set(started_by_dead) - {started_by_dead[-1]})


def test_the_dashboards_job_page_shows_a_backfill_and_its_stored_text_as_text() -> None:
    from datetime import UTC

    from anarchon import JobInfo
    from anarchon.web import _Fleet, _job_details

    at = datetime(2027, 1, 1, tzinfo=UTC)
    backfill = BackfillInfo(
        job="report", start=at, end=at + timedelta(days=1), status="running", slots=24,
        next=at + timedelta(hours=3), ran_ok=2, ran_failed=1, settled_before=0, skipped=0,
        by="<img src=x onerror=alert(1)>", note="<script>alert(2)</script>", started_at=at,
        ended_at=None, driver="web-1", reason=None,
    )  # fmt: skip
    job = JobInfo(
        name="report", schedule="CronSchedule('0 * * * *', 'UTC')", cron="0 * * * *",
        every_ms=None, timezone="UTC", strategy="lease", next_fire=None, paused=False,
        paused_by=None, last=None, first_seen=None, backfill=backfill,
    )  # fmt: skip
    page = _job_details(job, [], _Fleet([], every_read=True))
    assert "<script>" not in page and "<img" not in page, page
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in page
    assert "backfill of 24 slot(s)" in page and "3 decided (2 ok, 1 failed" in page
    assert "driven by web-1" in page


@pytest.mark.slow("each cut may end the driver's turn here: it goes on at a renewal, 10 s")
async def test_a_backfill_through_lost_replies_and_cut_connections_runs_each_slot_once(
    server_url: str, prefix: str, direct: redis.Redis, proxy: FaultProxy
) -> None:
    """The instance reaches the server through a proxy that, after each backfilled run,
    lets the next two requests reach the server and cuts their connection before the
    reply (a claim, a finish, a turn or its cursor's move applied, and not heard of):
    the backfill ends done, and each slot of its range ran once."""
    start = whole_second_ago(direct, 30)
    slots = [int(start.timestamp() * 1000) + n * SECOND for n in range(6)]
    ran: list[int] = []
    scheduler: Scheduler[Any] = Scheduler(
        RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=3000
    )

    @scheduler.job(every_ms=SECOND, name="tick")
    async def tick(run: Run) -> None:
        if run.slot_ms in slots:
            ran.append(run.slot_ms)

    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector, scheduler:
        await inspector.backfill("tick", start, start + timedelta(seconds=6))
        for count in range(1, 5):
            await wait_until(lambda n=count: len(ran) >= n, 30, f"{count} backfilled run(s)")
            proxy.drop_after_request(2)
        done = await wait_ended(inspector, "tick", timeout_sec=60)
    assert (done.status, done.decided) == ("done", 6), done
    assert sorted(ran) == slots, ran
