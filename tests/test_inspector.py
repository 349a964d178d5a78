"""The registry (instances and jobs in the store) and the read side that needs no running
scheduler (``Inspector``): jobs with their next fire time, pause flag and last result,
live leases, instances alive (and gone once stopped), history (an unknown job is an
error), failures, timers; pause, resume and run-now asked of the fleet. And the
registry's first-seen time, which bounds catch-up on a first deploy."""

from __future__ import annotations

import json
import time
from contextlib import AsyncExitStack
from zoneinfo import ZoneInfo

import anyio
import pytest
import redis

from anarchon import (
    ConnectionFailedError,
    Inspector,
    InvalidJobError,
    RedisBackend,
    Run,
    Scheduler,
    TimerKindInfo,
    TimerRun,
)
from anarchon._model.clock import PRODUCTION
from anarchon._model.options import DEFAULT_MAX_CONCURRENT
from anarchon._ops.inspector import fleet_text, kind_limits_text
from anarchon._store.keys import JobKeys, RegistryKeys
from tests.faults import FaultProxy
from tests.helpers import NEVER, CommandLog, OneShot, long_job_fleet, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


async def test_the_inspector_sees_jobs_leases_instances_and_history_of_a_running_fleet(
    server_url: str, prefix: str
) -> None:
    started = anyio.Event()
    release = anyio.Event()
    schedulers = []
    for name in ("a", "b"):
        scheduler = Scheduler(
            RedisBackend(redis=server_url, prefix=prefix), instance_id=name, lease_ms=20_000
        )

        @scheduler.job(OneShot.in_ms(300), name="long", overlap="allow", max_concurrent_fleet=3)
        async def long(run: Run) -> None:
            started.set()
            await release.wait()

        @scheduler.job("0 3 1 1 *", name="report", timezone="Europe/Athens", max_attempts=5)
        async def report() -> None:
            pass

        @scheduler.timer("remind", group_by=":", max_concurrent_per_group=4)
        async def remind(fire: TimerRun) -> None:
            pass

        schedulers.append(scheduler)
    backend = RedisBackend(redis=server_url, prefix=prefix)
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await schedulers[0].set_timer("remind", "user:42", delay_ms=3_600_000)
        with anyio.fail_after(20):
            await started.wait()
        async with Inspector(backend) as inspector:
            jobs = {job.name: job for job in await inspector.jobs()}
            leases = await inspector.leases()
            instances = await inspector.instances()
            timers = await inspector.timers()
        release.set()

    assert sorted(jobs) == ["long", "report"]
    # 03:00 Athens on 1 January: no clock change that day, and no slot during a run.
    yearly = jobs["report"]
    assert (yearly.cron, yearly.timezone, yearly.strategy) == (
        "0 3 1 1 *",
        "Europe/Athens",
        "lease",
    )
    assert yearly.options["max_attempts"] == 5 and not yearly.paused and yearly.last is None
    assert yearly.next_fire is not None and yearly.next_fire.timestamp() > time.time()
    local = yearly.next_fire.astimezone(ZoneInfo("Europe/Athens"))
    assert (local.month, local.day, local.hour, local.minute) == (1, 1, 3, 0)
    assert yearly.first_seen is not None and yearly.fleet_running is None
    # The job with a limit across the fleet: its run in progress holds one permit of 3.
    assert (jobs["long"].fleet_running, jobs["long"].options["max_concurrent_fleet"]) == (1, 3)

    (lease,) = leases
    assert (lease.job, lease.status, lease.attempt) == ("long", "running", 1)
    assert lease.runner in ("a", "b") and lease.fence > 0
    assert 0 < lease.left_ms <= 20_000

    assert [i.id for i in instances] == ["a", "b"]
    for instance in instances:
        assert instance.jobs == ("long", "report") and instance.timer_kinds == ("remind",)
        assert 0 < instance.expires_in_ms <= PRODUCTION.registration_ttl_ms
        assert instance.max_concurrent == DEFAULT_MAX_CONCURRENT
    (kind,) = timers
    assert (kind.kind, kind.pending, kind.next_key) == ("remind", 1, "user:42")
    assert (kind.max_concurrent_per_group, kind.groups_waiting) == (4, 0)
    assert (kind.max_concurrent_fleet, kind.rate_limit, kind.fleet_running) == (None, None, None)

    async with Inspector(backend) as inspector:
        assert await inspector.instances() == []  # both withdrew on stop
        history = await inspector.history("long")
        assert [(r.attempt, r.status) for r in history] == [(1, "ok")]
        assert (await inspector.jobs())[0].last == history[0]
        with pytest.raises(InvalidJobError, match="no job named 'typo'"):
            await inspector.history("typo")
        with pytest.raises(InvalidJobError, match="no job named 'typo'"):
            await inspector.pause("typo")


async def test_an_instance_that_dies_leaves_the_registry_when_its_entry_expires(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    keys = RegistryKeys.for_prefix(prefix)
    direct.zadd(keys.instances, {"ghost": int(time.time() * 1000) - 1})
    direct.set(keys.instance("ghost"), '{"host": "gone"}')
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        assert await inspector.instances() == []


@pytest.mark.server_tier  # request_run.lua, checked nowhere else
async def test_pause_resume_and_run_now_from_the_inspector_reach_every_instance(
    server_url: str, prefix: str
) -> None:
    ran: list[tuple[str, str, int]] = []
    schedulers = []
    for name in ("a", "b"):
        scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), instance_id=name)

        @scheduler.job("* * * * * *", name="tick")
        async def tick(run: Run) -> None:
            ran.append((run.trigger, run.runner, run.slot_ms))

        schedulers.append(scheduler)
    backend = RedisBackend(redis=server_url, prefix=prefix)
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await wait_until(lambda: len(ran) >= 1, 20, "a first run")
        async with Inspector(backend) as inspector:
            assert await inspector.pause("tick") is True
            paused_ms = time.time() * 1000
            assert (await inspector.jobs())[0].paused
            await anyio.sleep(2.2)
            slot_id = await inspector.run_now("tick")  # a manual run goes on while paused
            await wait_until(
                lambda: any(t == "manual" for t, _, _ in ran), 10, "the fleet's manual run"
            )
            assert await inspector.resume("tick") is True
            resumed_ms = time.time() * 1000
            await wait_until(
                lambda: any(s > resumed_ms and t != "manual" for t, _, s in ran), 20, "a run"
            )
            history = await inspector.history("tick", limit=100)

    scheduled_while_paused = [
        s for t, _, s in ran if t != "manual" and paused_ms < s <= resumed_ms - 50
    ]
    assert scheduled_while_paused == []
    manual = [r for r in history if r.trigger == "manual"]
    assert len(manual) == 1 and manual[0].status == "ok" and manual[0].attempt == 1
    assert len([t for t, _, _ in ran if t == "manual"]) == 1
    assert slot_id.startswith("m")
    skipped = [r for r in history if r.status == "skipped"]
    assert skipped and all(r.error == "paused: the job is paused" for r in skipped)


def _ticking(server_url: str, prefix: str, ran: list[tuple[int, str]]) -> Scheduler:  # type: ignore[type-arg]
    """An instance of a fleet with one job every second that catches up a minute; each
    run appends its slot and trigger to ``ran``."""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job("* * * * * *", name="tick", catch_up_ms=60_000)
    async def tick(run: Run) -> None:
        ran.append((run.slot_ms, run.trigger))

    return scheduler


async def test_a_first_deploy_catches_up_nothing_from_before_the_job_existed(
    server_url: str, prefix: str
) -> None:
    """catch_up_ms of a minute, a job every second, a store that never saw the job: the
    first start runs no slot from before it (the registry's first-seen time bounds
    catch-up). A restart after a gap catches up the slots it missed."""
    ran: list[tuple[int, str]] = []

    first_start_ms = time.time() * 1000
    async with _ticking(server_url, prefix, ran):
        await wait_until(lambda: len(ran) >= 2, 20, "runs")
    assert all(slot >= first_start_ms - 1000 for slot, _ in ran), ran
    assert all(trigger == "schedule" for _, trigger in ran), ran
    stopped_ms = time.time() * 1000
    await anyio.sleep(2.5)
    ran.clear()
    async with _ticking(server_url, prefix, ran):
        await wait_until(lambda: any(t == "catch-up" for _, t in ran), 20, "a catch-up run")
    caught_up = [slot for slot, trigger in ran if trigger == "catch-up"]
    assert caught_up and all(slot > stopped_ms - 1000 for slot in caught_up), ran


async def test_a_fleet_run_given_back_by_a_stopping_instance_is_run_by_another(
    server_url: str, prefix: str
) -> None:
    """A run the fleet was asked for keeps the job's attempts: the instance running it
    stops (and gives it back), and another one runs attempt 2 at once."""
    async with (
        long_job_fleet(server_url, prefix, NEVER, stop_grace_ms=0) as fleet,
        Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector,
    ):
        await inspector.run_now("long")
        await wait_until(lambda: bool(fleet.starts), 10, "the fleet's run")
        await fleet.runner_of(0).stop()
        await wait_until(lambda: len(fleet.starts) == 2, 10, "another instance to take it")
    first, second = fleet.starts
    assert (first.attempt, first.trigger) == (1, "manual")
    assert second.runner != first.runner and second.attempt == 2


async def test_run_now_of_a_job_no_instance_alive_runs_is_refused(
    server_url: str, prefix: str
) -> None:
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job("0 0 1 1 *", name="gone")
    async def gone() -> None:
        pass

    async with scheduler:
        pass  # registered, then withdrawn
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        with pytest.raises(InvalidJobError, match="no instance alive runs 'gone'"):
            await inspector.run_now("gone")
        assert await inspector.leases() == []


async def test_a_store_written_before_the_registry_still_catches_up_after_a_gap(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """The job has history but no first-seen time (an older anarchon wrote the store):
    its first-seen time is its oldest remembered slot, so a restart after a gap catches
    up the slots it missed."""
    ran: list[tuple[int, str]] = []

    async with _ticking(server_url, prefix, ran):
        await wait_until(lambda: len(ran) >= 2, 20, "runs")
    stopped_ms = time.time() * 1000
    direct.delete(RegistryKeys.for_prefix(prefix).first_seen)
    await anyio.sleep(2.5)
    ran.clear()
    async with _ticking(server_url, prefix, ran):
        await wait_until(lambda: any(t == "catch-up" for _, t in ran), 20, "a catch-up run")
    assert all(slot > stopped_ms - 1000 for slot, t in ran if t == "catch-up"), ran


async def test_the_inspector_against_a_frozen_server_fails_within_its_deadline(
    server_url: str, prefix: str
) -> None:
    with FaultProxy(server_url) as proxy:
        async with Inspector(RedisBackend(redis=proxy.url, prefix=prefix)) as inspector:
            proxy.pause()
            with anyio.fail_after(30), pytest.raises(ConnectionFailedError):
                await inspector.jobs()
            proxy.resume()


def test_the_logged_server_name_hides_every_password() -> None:
    for url in (
        "redis://user:secret@h:6379/0",
        "redis://h:6379/0?password=secret",
        "redis+sentinel://u:secret@h1,h2/m?sentinel_username=s&sentinel_password=secret",
    ):
        assert "secret" not in RedisBackend(redis=url).where(), url


async def test_reads_of_many_jobs_keep_each_reply_with_its_job_across_round_trips(
    server_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three commands a round trip (instead of hundreds), seven jobs: each job's pause
    flag, last result and history are its own, across the round trips' edges; an error
    reply in a later round trip is raised, not read as a job's history."""
    names = [f"job{index}" for index in range(7)]
    paused = {"job2", "job5"}
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), instance_id="one")
    for name in names:

        async def fail(run: Run) -> None:
            raise RuntimeError(f"{run.job} failed")

        scheduler.add_job(fail, "* * * * * *", name=name, max_attempts=1)
    backend = RedisBackend(redis=server_url, prefix=prefix)
    async with scheduler, Inspector(backend) as inspector:
        for name in sorted(paused):
            await inspector.pause(name)
        monkeypatch.setattr("anarchon._ops.inspector._COMMANDS_A_TRIP", 3)
        with anyio.fail_after(30):
            while True:  # until every job has a result
                jobs = await inspector.jobs()
                if all(job.last for job in jobs):
                    break
                await anyio.sleep(0.2)
        recent = await inspector.recent(5)
    assert [job.name for job in jobs] == names
    assert {job.name for job in jobs if job.paused} == paused
    for job in jobs:  # a paused job's slots are skipped (one may have run before)
        own = f"RuntimeError: {job.name} failed"
        expected = {own, "paused: the job is paused"} if job.name in paused else {own}
        assert job.last is not None and job.last.error in expected, job
    for name, results in recent.items():
        failed = {r.error for r in results if r.status == "failed"}
        own = {f"RuntimeError: {name} failed"}
        assert failed <= own if name in paused else failed == own, (name, results)
    # The last job's results are not a sorted set any more: its read, in the third
    # round trip, is refused; that refusal costs the last job alone (quarantined), the
    # replies of the others stay theirs.
    direct = redis.Redis.from_url(server_url, protocol=2)
    results = JobKeys.for_job(prefix, names[-1]).results
    try:
        direct.set(results, "not a sorted set")
    finally:
        direct.close()
    async with Inspector(backend) as inspector:
        again = await inspector.recent(5)
        met = await inspector.quarantined()
    assert again[names[-1]] == [] and all(again[name] for name in names[:-1])
    assert [(entry.key, "WRONGTYPE" in entry.problem) for entry in met] == [(results, True)]


# ------------------------------------------------- what the store holds is input


async def _register_good_jobs(server_url: str, prefix: str) -> None:
    """Jobs 'good' and 'other' (and timer kind 'remind', with one timer pending),
    registered by an instance that then stops, with one recorded run of 'good'."""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), instance_id="one")

    @scheduler.job("0 0 1 1 *", name="good")
    async def good() -> None:
        pass

    @scheduler.job("0 0 1 1 *", name="other")
    async def other() -> None:
        pass

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        pass

    async with scheduler:
        await scheduler.run_now("good")
        await scheduler.set_timer("remind", "user:1", delay_ms=3_600_000)


#: Registry entries that are no job definition anarchon wrote, by what is wrong.
MALFORMED_DEFINITIONS = {
    "not-json": "{not json",
    "a-list": "[1, 2]",
    "bad-zone": '{"schedule": "x", "cron": "0 0 * * *", "timezone": "Nope/Zone"}',
    "bad-every": '{"schedule": "x", "every_ms": "soon"}',
    "bad-strategy": '{"schedule": "x", "every_ms": 1000, "strategy": ["lease"]}',
    "bad-next": '{"schedule": "x", "next_slot_ms": 1e300}',
    "bad-fires": '{"schedule": "x", "next_fires_ms": [1, "soon"]}',
    "many-fires": '{"schedule": "x", "next_fires_ms": [' + ", ".join(["1"] * 101) + "]}",
    "bad-exclude": '{"schedule": "x", "exclude": {"dates": []}}',
}


async def test_a_malformed_job_definition_costs_that_job_alone_and_is_quarantined(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """Registry entries that are not JSON, not an object, or hold a field the views use
    with a wrong type (an unknown zone, a number that is not one): each is left out of
    the jobs and quarantined (once, with its key and what was wrong); the other jobs are
    read, paused, shown and their history read as usual; asked for by name, the
    malformed one is an error that says so."""
    await _register_good_jobs(server_url, prefix)
    keys = RegistryKeys.for_prefix(prefix)
    direct.hset(keys.jobs, mapping=MALFORMED_DEFINITIONS)
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        assert [job.name for job in await inspector.jobs()] == ["good", "other"]
        assert [job.name for job in await inspector.jobs(["good", "not-json"])] == ["good"]
        assert [r.status for r in await inspector.history("good")] == ["ok"]
        assert await inspector.leases() == [] and await inspector.leases("good") == []
        assert set(await inspector.recent(5)) == {"good", "other"}
        assert await inspector.pause("other") is True
        for name in MALFORMED_DEFINITIONS:
            with pytest.raises(InvalidJobError, match="malformed"):
                await inspector.history(name)
        quarantined = await inspector.quarantined()
    met = {(entry.key, entry.field) for entry in quarantined}
    assert met == {(keys.jobs, name) for name in MALFORMED_DEFINITIONS}
    problems = {entry.field: entry.problem for entry in quarantined}
    assert "Nope/Zone" in problems["bad-zone"] and "JSON" in problems["not-json"]


async def test_a_malformed_result_costs_that_result_alone(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """A results member that is no result, and a results key that is not a sorted set:
    the job's other results (and the other jobs' results) are read; each bad entry is
    quarantined."""
    await _register_good_jobs(server_url, prefix)
    good = JobKeys.for_job(prefix, "good").results
    direct.zadd(good, {"garbage": 1, "1|x|ok|a|b|c|schedule|r|": 2})
    direct.set(JobKeys.for_job(prefix, "other").results, "not a sorted set")
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        assert [r.status for r in await inspector.history("good")] == ["ok"]
        jobs = {job.name: job for job in await inspector.jobs()}
        assert jobs["good"].last is not None and jobs["good"].last.status == "ok"
        assert jobs["other"].last is None
        recent = await inspector.recent(5)
        assert [r.status for r in recent["good"]] == ["ok"] and recent["other"] == []
        assert await inspector.history("other") == []
        met = {(entry.key, entry.field) for entry in await inspector.quarantined()}
    assert {(good, "garbage"), (good, "1|x|ok|a|b|c|schedule|r|")} <= met
    assert any(key == JobKeys.for_job(prefix, "other").results for key, _ in met)


async def test_an_unknown_job_is_an_error_that_lists_no_stored_name_and_escapes_its_own(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """The error of a job the store does not know is small whatever the store holds: it
    lists none of the stored names (they are any number, and any text), and shows the
    name asked for with its control characters escaped."""
    await _register_good_jobs(server_url, prefix)
    direct.hset(RegistryKeys.for_prefix(prefix).jobs, "evil\x1b]0;pwned\x07", "{}")
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        with pytest.raises(InvalidJobError) as refused:
            await inspector.history("typo\x1b[2J")
    message = str(refused.value)
    assert "good" not in message and "evil" not in message, message
    assert "\x1b" not in message and r"typo\x1b[2J" in message, message


async def test_a_timer_kind_s_stored_buckets_are_checked_when_read(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """A kind's number of buckets is read from the store: one out of the range anarchon
    allows (a million would read a million buckets), not a whole number, or an entry
    that is not a kind's record, is quarantined and that kind alone is not read; so is
    one whose fleet limits are none a kind may have."""
    await _register_good_jobs(server_url, prefix)
    bad = {
        "huge": '{"buckets": 1000000, "max_attempts": 3}',
        "zero": '{"buckets": 0}',
        "words": '{"buckets": "many"}',
        "fraction": '{"buckets": 1.5}',
        "listed": "[1]",
        "garbage": "{{",
        "fleet": '{"buckets": 1, "max_concurrent_fleet": 0}',
        "rate": '{"rate_limit": [5]}',
        "grouped": '{"group_by": ":"}',
        "shared": '{"buckets": 2, "group_by": ":", "max_concurrent_per_group": 2}',
    }
    direct.hset(RegistryKeys.for_prefix(prefix).timer_kinds, mapping=bad)
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        with anyio.fail_after(5):
            timers = await inspector.timers()
        met = {entry.field for entry in await inspector.quarantined()}
    assert [(t.kind, t.buckets, t.pending, t.next_key) for t in timers] == [
        ("remind", 1, 1, "user:1")
    ]
    assert met == set(bad)


async def test_timers_reads_the_kinds_asked_for_and_at_most_a_bound_of_them(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """``timers(kinds)`` reads those kinds alone; ``timers(limit=N)`` the first N by name,
    whatever the number of kinds the store holds."""
    direct.hset(
        RegistryKeys.for_prefix(prefix).timer_kinds,
        mapping={f"kind{index:03d}": '{"buckets": 1}' for index in range(300)},
    )
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        assert [t.kind for t in await inspector.timers(["kind007", "nope"])] == ["kind007"]
        assert [t.kind for t in await inspector.timers(limit=3)] == [
            "kind000",
            "kind001",
            "kind002",
        ]
        assert await inspector.timer_kind_count() == 300


async def test_instance_records_are_read_within_a_bound_and_a_malformed_one_alone_is_left_out(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """An instance registered with 20,000 jobs: a read of the instances takes at most
    ``INSTANCE_BYTES_MAX`` bytes of its record (the jobs that fit, and it says the list
    was cut); a record that is not JSON is quarantined and the others are shown."""
    from anarchon._ops import inspector as inspector_module

    keys = RegistryKeys.for_prefix(prefix)
    alive_until = int(time.time() * 1000) + 60_000
    many = [f"job-number-{index:05d}" for index in range(20_000)]
    records = {
        "big": {"id": "big", "host": "h", "pid": 1, "version": "v", "started_ms": 1,
                "strategy": "lease", "jobs": many, "timer_kinds": [], "running": 0},
        "small": {"id": "small", "host": "h", "pid": 2, "version": "v", "started_ms": 1,
                  "strategy": "lease", "jobs": ["a"], "timer_kinds": ["k"], "running": 3},
    }  # fmt: skip
    for instance_id, record in records.items():
        direct.set(keys.instance(instance_id), json.dumps(record))
    direct.set(keys.instance("broken"), "not json")
    direct.zadd(keys.instances, {"big": alive_until, "small": alive_until, "broken": alive_until})
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        instances = {i.id: i for i in await inspector.instances()}
        assert await inspector.instance_count() == 3
        met = {(entry.key, entry.field) for entry in await inspector.quarantined()}
    assert sorted(instances) == ["big", "small"]
    small, big = instances["small"], instances["big"]
    assert (small.jobs, small.timer_kinds, small.running) == (("a",), ("k",), 3)
    assert 0 < len(big.jobs) < len(many) and big.jobs == tuple(many[: len(big.jobs)])
    assert len(json.dumps(list(big.jobs))) <= inspector_module.INSTANCE_BYTES_MAX
    assert inspector_module.jobs_cut(big) and not inspector_module.jobs_cut(small)
    # A job beyond the part read may be run by "big": none is said to run on no instance.
    assert inspector_module.may_run(many[-1], instances.values())
    assert not inspector_module.may_run("unknown", [small])
    assert (keys.instance("broken"), "") in met


async def test_a_bounded_read_of_many_timer_kinds_reads_one_scan_step_not_every_name(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """Past 1,000 kinds, ``timers(limit=N)`` reads one step of a scan of their names (no
    HKEYS of them all), and still at most N kinds."""
    direct.hset(
        RegistryKeys.for_prefix(prefix).timer_kinds,
        mapping={f"kind{index:04d}": '{"buckets": 1}' for index in range(1500)},
    )
    monitor = CommandLog(server_url)
    try:
        async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
            timers = await inspector.timers(limit=5)
    finally:
        sent = [name for _, name in monitor.close()]
    assert 0 < len(timers) <= 5 and "HKEYS" not in sent and "HSCAN" in sent, sent


def test_the_views_say_what_a_fleet_limit_holds() -> None:
    """The CLI's and the dashboard's words for a job's and a kind's fleet limits."""
    assert fleet_text(2, 5) == "2 of 5" and fleet_text(5, 5) == "5 of 5 (full)"
    assert fleet_text(None, 5) == "" and fleet_text(3, None) == ""
    kind = TimerKindInfo(
        "send", 1, 10, None, None, max_concurrent_fleet=3, fleet_running=3,
        rate_limit=(100, 60_000), rate_started=42, max_concurrent_per_group=2,
        groups_waiting=7,
    )  # fmt: skip
    assert kind_limits_text(kind) == (
        "3 of 3 (full) at once; 42 of 100 started in 60000 ms; 2 per key group (7 waiting)"
    )
    assert kind_limits_text(TimerKindInfo("plain", 1, 0, None, None)) == "-"
