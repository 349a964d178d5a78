"""The lease: kept by heartbeats, lost to another token, released on stop."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from datetime import timedelta

import anyio
import pytest
import redis

from anarchon import ClaimAnswered, Event, LeaseLost, RedisBackend, Run, Scheduler
from anarchon._engine.instance import Instance
from anarchon._store.contract import ClaimRequest
from anarchon._store.keys import JobKeys
from tests.helpers import Ledger, OneShot, OneShotAtFirstAsk, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


def state_of(direct: redis.Redis, prefix: str, job: str, slot_ms: int) -> list[str]:
    raw = direct.hget(JobKeys.for_job(prefix, job).state, str(slot_ms))
    assert raw is not None, "the run has no state"
    return str(raw).split("|")


def results_of(direct: redis.Redis, prefix: str, job: str) -> list[list[str]]:
    members = direct.zrange(JobKeys.for_job(prefix, job).results, 0, -1)
    return [str(m).split("|") for m in members]


@pytest.mark.slow
async def test_a_job_longer_than_its_lease_keeps_it_through_heartbeats(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    # A run of two leases. A heartbeat every 250 ms keeps a 3 s lease through a stall
    # of more than two seconds (a loaded machine's: with a 1.5 s lease, a loaded run
    # once saw no heartbeat reach the server in time, and a backup rightly took over),
    # and without heartbeats a backup would take the run over at 3 s.
    lease_ms = 3000
    ledger = Ledger(direct, prefix)
    schedule = OneShotAtFirstAsk(300)
    finished: list[int] = []
    schedulers = []
    for index in range(3):
        scheduler = Scheduler(
            RedisBackend(redis=server_url, prefix=prefix),
            lease_ms=lease_ms,
            heartbeat_ms=250,
            instance_id=f"i{index}",
        )

        @scheduler.job(schedule, name="long")
        async def long(run: Run) -> None:
            await ledger.record(run)
            await anyio.sleep(2 * lease_ms / 1000)
            finished.append(run.attempt)

        schedulers.append(scheduler)

    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await wait_until(lambda: bool(finished), 15, "the long run to finish")
        # Backups keep asking while it runs; give them one more lease to misbehave.
        await anyio.sleep(lease_ms / 1000)

    assert schedule.at is not None
    assert ledger.counts() == {("long", int(schedule.at.timestamp() * 1000)): 1}
    assert finished == [1]
    results = results_of(direct, prefix, "long")
    assert [(r[1], r[2]) for r in results] == [("1", "ok")]


async def test_a_lost_lease_cancels_the_handler_and_its_late_finish_changes_nothing(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    schedule = OneShot.in_ms(200)
    slot_ms = int(schedule.at.timestamp() * 1000)
    started = anyio.Event()
    cancelled = anyio.Event()
    scheduler = Scheduler(
        RedisBackend(redis=server_url, prefix=prefix), lease_ms=2000, heartbeat_ms=100
    )

    @scheduler.job(schedule, name="victim")
    async def victim(run: Run) -> None:
        started.set()
        try:
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise

    async with scheduler:
        with anyio.fail_after(5):
            await started.wait()
        # Another attempt takes the run: its token replaces ours in the state.
        fields = state_of(direct, prefix, "victim", slot_ms)
        fields[2] = "someone-else"
        replaced = "|".join(fields)
        direct.hset(JobKeys.for_job(prefix, "victim").state, str(slot_ms), replaced)
        with anyio.fail_after(2):
            await cancelled.wait()
        await anyio.sleep(0.3)  # the finish of the lost attempt has been sent by now

    assert direct.hget(JobKeys.for_job(prefix, "victim").state, str(slot_ms)) == replaced
    assert results_of(direct, prefix, "victim") == []


async def test_stop_lets_a_running_handler_finish_within_the_grace_period(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    schedule = OneShot.in_ms(200)
    started = anyio.Event()
    done: list[bool] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), stop_grace_ms=5000)

    @scheduler.job(schedule, name="short")
    async def short() -> None:
        started.set()
        await anyio.sleep(0.5)
        done.append(True)

    async with scheduler:
        with anyio.fail_after(15):  # the start and the first claim, on a loaded machine
            await started.wait()
        began = time.monotonic()
        await scheduler.stop()
        assert time.monotonic() - began < 3

    assert done == [True]
    assert [(r[1], r[2]) for r in results_of(direct, prefix, "short")] == [("1", "ok")]


@pytest.mark.parametrize("max_attempts", [3, 1])
async def test_stop_cancels_a_handler_after_the_grace_period_and_releases_its_lease(
    server_url: str, prefix: str, direct: redis.Redis, max_attempts: int
) -> None:
    schedule = OneShot.in_ms(200)
    slot_ms = int(schedule.at.timestamp() * 1000)
    started = anyio.Event()
    cancelled: list[bool] = []
    scheduler = Scheduler(
        RedisBackend(redis=server_url, prefix=prefix), lease_ms=30_000, heartbeat_ms=10_000
    )

    @scheduler.job(schedule, name="stuck", max_attempts=max_attempts)
    async def stuck() -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.append(True)
            raise

    async with scheduler:
        with anyio.fail_after(5):
            await started.wait()
        began = time.monotonic()
        await scheduler.stop(grace_ms=300)
        assert time.monotonic() - began < 3

    assert cancelled == [True]
    assert [(r[1], r[2]) for r in results_of(direct, prefix, "stuck")] == [("1", "cancelled")]
    status = state_of(direct, prefix, "stuck", slot_ms)[0]
    if max_attempts == 1:
        assert status == "cancelled"
        return
    # Released, not left to expire: another instance wins attempt 2 at once,
    # although the 30 s lease would still be running.
    assert status == "retry"
    backup = Scheduler(RedisBackend(redis=server_url, prefix=prefix), instance_id="backup")
    backup.add_job(stuck, schedule, name="stuck", max_attempts=max_attempts)
    async with backup:
        store = Instance.of(backup).running_store()
        assert store is not None
        (reply,) = await store.claim_many(
            [
                ClaimRequest(
                    job="stuck",
                    slot_id=str(slot_ms),
                    slot_ms=slot_ms,
                    token="backup-token",
                    lease_ms=30_000,
                    max_attempts=max_attempts,
                    allow_overlap=False,
                    trigger="schedule",
                    keep_ms=600_000,
                )
            ]
        )
        await backup.stop(grace_ms=0)
    assert not isinstance(reply, Exception)
    assert (reply.kind, reply.attempt, reply.trigger) == ("won", 2, "retry")


async def test_a_plain_function_runs_in_a_worker_thread_with_its_run(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    import threading

    schedule = OneShot.in_ms(200)
    seen: list[tuple[str, int, bool]] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(schedule, name="plain")
    def plain(run: Run) -> None:
        seen.append((run.job, run.attempt, threading.current_thread() is threading.main_thread()))

    async with scheduler:
        await wait_until(lambda: bool(seen), 5, "the plain function to run")

    assert seen == [("plain", 1, False)]


async def test_a_handler_gets_its_slot_as_an_aware_utc_datetime_and_its_runner_id(
    server_url: str, prefix: str
) -> None:
    """``Run.slot`` is the slot's instant (aware, UTC, equal to ``slot_ms``) and
    ``Run.runner`` the instance that runs it: what a handler logs and writes."""
    schedule = OneShot.in_ms(100)
    seen: list[Run] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), instance_id="here-1")

    @scheduler.job(schedule, name="who")
    async def who(run: Run) -> None:
        seen.append(run)

    async with scheduler:
        await wait_until(lambda: bool(seen), 10, "the run")
    (run,) = seen
    assert run.slot == schedule.at and run.slot.utcoffset() == timedelta(0)
    assert run.slot_ms == int(schedule.at.timestamp() * 1000)
    assert (run.runner, run.job, run.attempt, run.trigger) == ("here-1", "who", 1, "schedule")


async def test_an_attempt_whose_lease_ran_out_before_its_handler_began_is_not_run_and_is_retried(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """Two jobs fall due together and this instance wins both. The first handler to
    begin stands the event loop still past both leases (as a machine whose CPUs are all
    taken does). The other handler, next in line, must not begin: a backup may run that
    slot already. Its attempt is reported lost once (whichever task notices first), ends
    ``cancelled``, and its retry runs."""
    lease_ms = 1000
    schedule = OneShotAtFirstAsk(300)
    won: list[str] = []
    lost: list[LeaseLost] = []
    began: list[tuple[str, int]] = []
    won_before_the_stall: list[str] = []

    def on_event(event: Event) -> None:
        if isinstance(event, ClaimAnswered) and event.answer == "won":
            won.append(event.job)
        elif isinstance(event, LeaseLost):
            lost.append(event)

    async def handler(run: Run) -> None:
        began.append((run.job, run.attempt))
        if len(began) == 1:
            won_before_the_stall.extend(won)
            # The loop stands still past both leases.
            time.sleep(2 * lease_ms / 1000)  # noqa: ASYNC251 - a starved loop, on purpose

    scheduler = Scheduler(
        RedisBackend(redis=server_url, prefix=prefix), lease_ms=lease_ms, heartbeat_ms=250
    )
    for name in ("a", "b"):
        scheduler.add_job(handler, schedule, name=name)
    scheduler.on_event(on_event)
    async with scheduler:
        await wait_until(lambda: len(began) >= 2, 15, "the other job's retry to begin")
        await anyio.sleep(0.3)  # and nothing more

    # Both attempts were won before the first handler stood the loop still.
    assert sorted(won_before_the_stall) == ["a", "b"], won_before_the_stall
    first = began[0][0]
    other = "b" if first == "a" else "a"
    assert began == [(first, 1), (other, 2)]
    assert [(event.job, event.attempt) for event in lost] == [(other, 1)], lost
    results = results_of(direct, prefix, other)
    assert [(r[1], r[2]) for r in results] == [("1", "cancelled"), ("2", "ok")]
