"""What anarchon reads back from its store is input: a foreign or malformed entry (another
client, a bad migration, a hand edit) costs that entry alone. It is quarantined (logged
once, counted, reported in ``{<prefix>}:quarantine``), and the instance, the entry's
other jobs and timers, and the rest of its bucket go on. Server tier: the scripts'
own reading of each record is what is under test."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import pytest
import redis

from anarchon import IntervalSchedule, RedisBackend, Run, Scheduler, TimerRun
from anarchon._ops.serve import health_of
from anarchon._store.keys import JobKeys, RegistryKeys, TimerKeys
from anarchon._store.lease import request_run
from anarchon._store.quarantine import MAX_WHOLE, quarantine_of
from tests.helpers import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.server_tier]


def quarantined(prefix: str) -> list[tuple[str, str]]:
    return [(entry.key, entry.field) for entry in quarantine_of(prefix).entries()]


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "malformed store entry" in r.getMessage()
        and text in r.getMessage()
    ]


async def test_a_foreign_active_entry_costs_itself_not_the_job_nor_the_instance(
    server_url: str, direct: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``HSET state garbage <a run state>`` and ``SADD active garbage``: the claim used to
    name ``garbage`` as an orphan and the take-over raised out of the claim loop, ending
    the instance at every start. Now the job and its neighbour keep their cadence, and
    the entry is quarantined once."""
    keys = JobKeys.for_job(prefix, "alpha")
    direct.hset(keys.state, "garbage", "running|1|tok|0|5|schedule|0|x")
    direct.sadd(keys.active, "garbage")
    ran: dict[str, list[int]] = {"alpha": [], "beta": []}
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), lease_ms=3000)

    for name in ran:

        async def handler(run: Run, name: str = name) -> None:
            ran[name].append(run.fence)

        scheduler.add_job(handler, IntervalSchedule(300), name=name)

    with caplog.at_level(logging.WARNING, logger="anarchon"):
        async with scheduler:
            await wait_until(
                lambda: len(ran["alpha"]) >= 3 and len(ran["beta"]) >= 3, 20, "both jobs to run"
            )
            assert health_of(scheduler)["live"]
    assert (keys.active, "garbage") in quarantined(prefix)
    assert len(warnings_about(caplog, "garbage")) == 1
    # Left as it is: the store's data is the operator's to mend.
    assert direct.sismember(keys.active, "garbage")
    reported = direct.zrange(RegistryKeys.for_prefix(prefix).quarantine, 0, -1)
    assert any("garbage" in member for member in reported), reported


async def test_a_malformed_run_state_costs_its_slot_alone(
    server_url: str, direct: redis.Redis, prefix: str
) -> None:
    """A state field of an active slot that does not read (numbers that are no numbers)
    made the claim script fail for every slot of the job; now it is skipped."""
    keys = JobKeys.for_job(prefix, "alpha")
    direct.hset(keys.state, "1000", "running|x|tok|y|5|schedule|0|r")
    direct.sadd(keys.active, "1000")
    fences: list[int] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), lease_ms=3000)

    @scheduler.job(IntervalSchedule(300), name="alpha")
    async def alpha(run: Run) -> None:
        fences.append(run.fence)

    async with scheduler:
        await wait_until(lambda: len(fences) >= 3, 20, "three runs of the job")
    assert (keys.state, "1000") in quarantined(prefix)


@pytest.mark.parametrize("fence", ["nan", "-7", "12.5", "bogus"])
async def test_a_fence_that_is_no_whole_number_is_repaired_forward(
    server_url: str, direct: redis.Redis, prefix: str, fence: str
) -> None:
    keys = JobKeys.for_job(prefix, "alpha")
    direct.hset(keys.state, "fence", fence)
    fences: list[int] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), lease_ms=3000)

    @scheduler.job(IntervalSchedule(300), name="alpha")
    async def alpha(run: Run) -> None:
        fences.append(run.fence)

    async with scheduler:
        await wait_until(lambda: len(fences) >= 2, 20, "two runs of the job")
    assert all(0 < f <= MAX_WHOLE for f in fences), fences
    assert fences == sorted(set(fences))
    assert int(str(direct.hget(keys.state, "fence"))) >= fences[-1]
    assert (keys.state, "fence") in quarantined(prefix)


@pytest.mark.parametrize("fence", ["inf", "1e300", str(2**60)])
async def test_a_fence_beyond_exact_numbers_stops_its_job_alone_until_mended(
    server_url: str, direct: redis.Redis, prefix: str, fence: str
) -> None:
    """A fence of ``inf`` used to reach handlers as -9223372036854775808 on every attempt
    (fencing silently broken). Now the job wins nothing while it is there, loudly, its
    neighbour runs on, and once an operator sets a whole fence it runs again above it."""
    keys = JobKeys.for_job(prefix, "alpha")
    direct.hset(keys.state, "fence", fence)
    ran: dict[str, list[int]] = {"alpha": [], "beta": []}
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), lease_ms=3000)

    for name in ran:

        async def handler(run: Run, name: str = name) -> None:
            ran[name].append(run.fence)

        scheduler.add_job(handler, IntervalSchedule(300), name=name)

    async with scheduler:
        await wait_until(lambda: len(ran["beta"]) >= 3, 20, "the other job to run")
        assert ran["alpha"] == []
        assert (keys.state, "fence") in quarantined(prefix)
        mended = 5_000_000_000_000_000
        direct.hset(keys.state, "fence", mended)
        await wait_until(lambda: len(ran["alpha"]) >= 1, 20, "the mended job to run")
    assert all(mended < f <= MAX_WHOLE for f in ran["alpha"]), ran["alpha"]


async def test_a_malformed_timer_costs_itself_not_its_bucket_nor_the_servers_health(
    server_url: str, direct: redis.Redis, prefix: str
) -> None:
    """A record ``xx`` due now beside a good timer made the claim script fail every
    second: the good timer never fired and the instance reported the server down."""
    fired: list[str] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), lease_ms=3000)

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        fired.append(fire.key)

    keys = TimerKeys.for_kind(prefix, "remind")
    direct.hset(keys.timers, "bad", "xx")
    direct.zadd(keys.due, {"bad": 1})
    async with scheduler:
        await scheduler.set_timer("remind", "good", delay_ms=50)
        await wait_until(lambda: fired == ["good"], 15, "the good timer to fire")
        assert health_of(scheduler)["ready"]
    assert (keys.timers, "bad") in quarantined(prefix)
    assert direct.hget(keys.timers, "bad") == "xx"  # left for the operator
    assert direct.zscore(keys.due, "bad") is None  # out of the due index


async def test_a_timer_kinds_malformed_generation_does_not_refuse_its_sets(
    server_url: str, direct: redis.Redis, prefix: str
) -> None:
    keys = TimerKeys.for_kind(prefix, "remind")
    direct.hset(keys.meta, "gen", "not a number")
    fired: list[str] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), lease_ms=3000)

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        fired.append(fire.key)

    async with scheduler:
        with anyio.fail_after(10):
            await scheduler.set_timer("remind", "k", delay_ms=50)
        await wait_until(lambda: fired == ["k"], 15, "the timer to fire")


async def test_run_now_requests_waiting_for_their_first_attempt_are_one_request(
    server_url: str, direct: redis.Redis, prefix: str
) -> None:
    """A request already waiting is the request: asking again (a double click, a loop)
    adds nothing to the job's active set."""
    conn = await RedisBackend(redis=server_url, prefix=prefix).open_connection()
    try:
        first, stored = await request_run(conn, prefix, "report", "test")
        assert stored
        for _ in range(50):
            assert await request_run(conn, prefix, "report", "test") == (first, False)
    finally:
        await conn.close_if_owned()
    keys = JobKeys.for_job(prefix, "report")
    assert direct.smembers(keys.active) == {first}


@pytest.mark.slow("fills a job's active set with 20,000 requests, then watches its neighbour")
async def test_a_storm_of_queued_run_requests_does_not_starve_the_other_jobs(
    server_url: str, direct: redis.Redis, prefix: str
) -> None:
    """20,000 queued requests (written before requests were one per job, or by another
    client) made every claim of the job scan them all and name them all as orphans: the
    instance's other jobs ran once in 12 s instead of 12 times. A claim now looks at 256
    active runs at most and names 32 orphans at most."""
    keys = JobKeys.for_job(prefix, "storm")
    pipe = direct.pipeline(transaction=False)
    now_ms = int(direct.time()[0]) * 1000
    for n in range(20_000):
        slot = f"m{now_ms - 1000}-fleet{n:08x}"
        pipe.hset(keys.state, slot, f"retry|0||{now_ms - 1000}|0|manual|{now_ms - 1000}|test")
        pipe.sadd(keys.active, slot)
        pipe.zadd(keys.slots, {slot: now_ms - 1000})
    pipe.execute()
    ran: dict[str, int] = {"storm": 0, "other": 0}
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), lease_ms=3000)

    def counter(name: str) -> Callable[[], Awaitable[None]]:
        async def handler() -> None:
            ran[name] += 1

        return handler

    for name in ran:
        scheduler.add_job(counter(name), IntervalSchedule(250), name=name)

    async with scheduler:
        started = anyio.current_time()
        await wait_until(lambda: ran["other"] >= 12, 20, "twelve runs of the other job")
        took_sec = anyio.current_time() - started
    # Twelve slots of 250 ms are 3 s; on a loaded machine, well under the 12 s of before.
    assert took_sec < 9, took_sec
    assert ran["storm"] > 0
