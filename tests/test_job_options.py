"""Per-job options beyond the schedule: ``timeout_ms`` (an attempt that runs too long is
cancelled, or told, and counts as failed with a ``TimeoutError``), ``retry_delay_ms``
(the job's own delay before a retry) and ``retry_on`` (only those exceptions are
retried), on real servers; and their validation."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from anarchon import InvalidOptionError, RedisBackend, Run, RunResult, Scheduler
from tests.helpers import OneShot

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


async def settled_history(
    scheduler: Scheduler[Any], job: str, statuses: int, timeout_sec: float = 20
) -> list[RunResult]:
    """The job's history, oldest first, once it holds ``statuses`` settled attempts."""
    found: list[RunResult] = []

    async def check() -> bool:
        nonlocal found
        found = await scheduler.history(job)
        return len([r for r in found if r.status != "running"]) >= statuses

    deadline = time.monotonic() + timeout_sec
    while not await check():
        assert time.monotonic() < deadline, f"{job}: {statuses} settled attempts not seen"
        await anyio.sleep(0.05)
    return sorted(found, key=lambda r: r.attempt)


async def test_an_async_handler_past_its_timeout_is_cancelled_and_each_attempt_fails(
    server_url: str, prefix: str
) -> None:
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    entered: list[int] = []
    cancelled: list[int] = []

    @scheduler.job(OneShot.in_ms(200), timeout_ms=300, max_attempts=2, retry_delay_ms=0)
    async def slow(run: Run) -> None:
        entered.append(run.attempt)
        try:
            await anyio.sleep(60)
        except anyio.get_cancelled_exc_class():
            cancelled.append(run.attempt)
            raise

    async with scheduler:
        history = await settled_history(scheduler, "slow", 2)
    assert [(r.attempt, r.status) for r in history] == [(1, "failed"), (2, "failed")]
    for result in history:
        assert result.error is not None and "TimeoutError" in result.error
        assert "timeout_ms (300 ms)" in result.error
        took_ms = (result.finished_at - result.started_at).total_seconds() * 1000
        assert took_ms >= 300, took_ms
    assert entered == cancelled == [1, 2]


async def test_a_plain_function_past_its_timeout_is_told_and_recorded_as_timed_out(
    server_url: str, prefix: str
) -> None:
    """A worker thread cannot be interrupted: it sees ``run.lease_lost`` set at its
    timeout, stops by itself, and its attempt is recorded as failed with the timeout
    (not as the LeaseLostError it raised on the way out)."""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    told: list[float] = []

    @scheduler.job(OneShot.in_ms(200), timeout_ms=300, max_attempts=1)
    def steps(run: Run) -> None:
        began = time.monotonic()
        while time.monotonic() - began < 30:
            if run.lease_lost.wait(0.02):
                # From the slot's instant: the timeout runs from the attempt's start,
                # which comes after it (the worker thread may begin later still).
                told.append(time.time() - run.slot_ms / 1000)
                run.raise_if_lost()
        raise AssertionError("never told")

    async with scheduler:
        (result,) = await settled_history(scheduler, "steps", 1)
    assert result.status == "failed"
    assert result.error is not None and "TimeoutError" in result.error
    # Not told before its timeout (10 ms for the two clocks: wall and monotonic).
    assert len(told) == 1 and told[0] >= 0.29, told


async def test_a_handler_done_before_its_timeout_is_ok(server_url: str, prefix: str) -> None:
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(OneShot.in_ms(200), timeout_ms=10_000)
    async def quick() -> None:
        await anyio.sleep(0.05)

    @scheduler.job(OneShot.in_ms(200), timeout_ms=10_000)
    def quick_thread() -> None:
        time.sleep(0.05)

    async with scheduler:
        for job in ("quick", "quick_thread"):
            (result,) = await settled_history(scheduler, job, 1)
            assert (result.status, result.error) == ("ok", None), result


async def test_retry_on_retries_the_exceptions_it_names_and_fails_the_others_at_once(
    server_url: str, prefix: str
) -> None:
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), retry_delay_ms=0)
    attempts: dict[str, list[int]] = {"named": [], "other": []}

    @scheduler.job(OneShot.in_ms(200), retry_on=(ConnectionError, TimeoutError))
    async def named(run: Run) -> None:
        attempts["named"].append(run.attempt)
        if run.attempt == 1:
            raise ConnectionRefusedError("down")  # a subclass of a named one

    @scheduler.job(OneShot.in_ms(200), retry_on=ConnectionError, max_attempts=5)
    async def other(run: Run) -> None:
        attempts["other"].append(run.attempt)
        raise ValueError("a bug, not a passing fault")

    async with scheduler:
        named_history = await settled_history(scheduler, "named", 2)
        (other_result,) = await settled_history(scheduler, "other", 1)
        await anyio.sleep(0.3)  # time for a retry that must not come
        assert len(await scheduler.history("other")) == 1
    assert [(r.attempt, r.status) for r in named_history] == [(1, "failed"), (2, "ok")]
    assert (other_result.attempt, other_result.status) == (1, "failed")
    assert other_result.error is not None and "ValueError" in other_result.error
    assert attempts == {"named": [1, 2], "other": [1]}


async def test_a_jobs_retry_delay_is_its_own_not_the_schedulers(
    server_url: str, prefix: str
) -> None:
    """The scheduler waits a minute before a retry; the job's own retry_delay_ms=0 retries
    at once."""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), retry_delay_ms=60_000)

    @scheduler.job(OneShot.in_ms(200), retry_delay_ms=0)
    async def eager(run: Run) -> None:
        if run.attempt == 1:
            raise RuntimeError("once")

    async with scheduler:
        history = await settled_history(scheduler, "eager", 2)
    assert [(r.attempt, r.status) for r in history] == [(1, "failed"), (2, "ok")]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"timeout_ms": 0}, "timeout_ms must be more than 0"),
        ({"timeout_ms": 1.5}, "timeout_ms must be a whole number"),
        ({"retry_delay_ms": -1}, "retry_delay_ms must be 0 or more"),
        ({"retry_on": "ValueError"}, "retry_on must be an exception class"),
        ({"retry_on": ()}, "retry_on must be an exception class"),
        ({"retry_on": KeyboardInterrupt}, "retry_on must be an exception class"),
    ],
)
async def test_bad_job_options_are_refused_with_what_to_do(
    options: dict[str, Any], says: str
) -> None:
    scheduler = Scheduler(RedisBackend(redis="redis://127.0.0.1:1"))
    with pytest.raises(InvalidOptionError, match=says):
        scheduler.add_job(lambda: None, "* * * * *", name="job", **options)
    assert scheduler.jobs == []


async def test_a_claim_only_strategy_takes_timeout_ms_and_refuses_the_retry_options() -> None:
    scheduler = Scheduler(RedisBackend(redis="redis://127.0.0.1:1", strategy="stream-id"))
    scheduler.add_job(lambda: None, "* * * * *", name="timed", timeout_ms=1000)
    for option in ({"retry_delay_ms": 10}, {"retry_on": ValueError}):
        with pytest.raises(InvalidOptionError, match="lease option"):
            scheduler.add_job(lambda: None, "* * * * *", name="retried", **option)  # type: ignore[call-overload]
    assert scheduler.jobs == ["timed"]
