"""A dead man's switch (issue 44, part 6): ``pause_after_failures`` pauses a job whose
last N slots finally failed, decided once in the store and said once (an ERROR, a
``JobPaused`` event, an audit entry); ``anarchon check`` exits non-zero with one line
per problem: a job no live instance runs, one paused after failures, a slot older than
the bound that was never decided."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest

from anarchon import (
    Event,
    Inspector,
    IntervalSchedule,
    JobPaused,
    RedisBackend,
    Run,
    Scheduler,
)
from anarchon._store.audit import PAUSED_BY_FAILURES
from anarchon._store.contract import AttemptEnd, ClaimRequest
from tests.helpers import anarchon_command, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


def failing_fleet(
    url: str, prefix: str, ran: Counter[int], fails: Any, events: list[Event]
) -> list[Scheduler[Any]]:
    schedulers: list[Scheduler[Any]] = []
    for name in ("a", "b"):
        scheduler = Scheduler(RedisBackend(redis=url, prefix=prefix), instance_id=name)

        async def sync(run: Run) -> None:
            ran[run.slot_ms] += 1
            if fails(len(ran)):
                raise RuntimeError("the upstream is down")

        scheduler.add_job(sync, IntervalSchedule(300), max_attempts=1, pause_after_failures=3)
        scheduler.on_event(events.append)
        schedulers.append(scheduler)
    return schedulers


async def test_a_job_whose_last_three_slots_failed_is_paused_once_and_said_once(
    server_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two instances, every slot fails: after the third the job is paused (by the finish
    of that slot, on whichever instance ran it), no fourth slot runs, and it is said
    once: one ERROR, one JobPaused, one audit entry. Resumed, it counts from zero."""
    ran: Counter[int] = Counter()
    events: list[Event] = []
    async with AsyncExitStack() as stack:
        for scheduler in failing_fleet(server_url, prefix, ran, lambda n: True, events):
            await stack.enter_async_context(scheduler)
        await wait_until(lambda: len(ran) >= 3, 20, "three failed slots")
        await anyio.sleep(1.5)  # five more slots: none may run
        assert len(ran) == 3, ran
        async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
            (job,) = await inspector.jobs(["sync"])
            audit = await inspector.audit("sync")
            assert await inspector.resume("sync", note="fixed")
            await wait_until(lambda: len(ran) >= 6, 20, "three more failed slots")
            await anyio.sleep(1.0)
            (again,) = await inspector.jobs(["sync"])
    paused = [e for e in events if isinstance(e, JobPaused)]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "paused" in r.message]
    assert len(ran) == 6 and len(paused) == 2 and len(errors) == 2, (ran, paused, errors)
    assert job.paused and job.paused_by is not None
    assert job.paused_by.startswith(f"{PAUSED_BY_FAILURES}: its last 3 slots finally failed (")
    assert [(e.action, e.by) for e in audit] == [("pause", PAUSED_BY_FAILURES)]
    assert "pause_after_failures=3" in (audit[0].note or "")
    assert again.paused and job.last_success is None


async def test_a_success_between_failures_counts_from_zero(server_url: str, prefix: str) -> None:
    """Every third slot succeeds: never three failures in a row, never paused."""
    ran: Counter[int] = Counter()
    events: list[Event] = []
    async with AsyncExitStack() as stack:
        fleet = failing_fleet(server_url, prefix, ran, lambda n: n % 3 != 0, events)
        for scheduler in fleet:
            await stack.enter_async_context(scheduler)
        await wait_until(lambda: len(ran) >= 10, 20, "ten slots")
        async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
            (job,) = await inspector.jobs(["sync"])
    assert not job.paused and not any(isinstance(e, JobPaused) for e in events)
    assert job.last_success is not None


async def test_anarchon_check_says_each_problem_in_a_line_and_exits_non_zero(
    server_url: str, prefix: str
) -> None:
    """A healthy job (a live instance runs it): exit 0. Stopped, two seconds later with
    --max-late 1s: one line says no live instance runs it, one that a slot was never
    decided; exit 1."""
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    ran: list[int] = []

    @scheduler.job(every_ms=500, name="tick")
    async def tick(run: Run) -> None:
        ran.append(run.slot_ms)

    async with scheduler:
        await wait_until(lambda: len(ran) >= 2, 10, "two runs")
        healthy = anarchon_command(server_url, prefix, "check", "--max-late", "5s")
    assert healthy.returncode == 0 and "ok: no problem among 1 job(s)" in healthy.stdout, healthy
    await anyio.sleep(2.5)
    sick = anarchon_command(server_url, prefix, "check", "--max-late", "1s")
    listed = json.loads(
        anarchon_command(server_url, prefix, "check", "--max-late", "1s", "--json").stdout
    )
    assert sick.returncode == 1, sick
    lines = sick.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0] == listed["problems"][0], (lines, listed)
    assert lines[1].split(" (")[0] == listed["problems"][1].split(" (")[0]  # how long: later
    assert lines[0] == "tick: no live instance runs it"
    assert lines[1].startswith("tick: its slot ") and "was never decided" in lines[1]
    wrong = anarchon_command(server_url, prefix, "check", "--max-late", "soon")
    assert wrong.returncode == 2 and "must be a duration" in wrong.stderr, wrong


async def test_a_pausing_finish_sent_again_after_its_reply_was_lost_still_says_it_paused(
    server_url: str, prefix: str
) -> None:
    """The finish that paused the job lost its reply, and the repeat (same token) used
    to answer "settled" without "paused": the ERROR, the event and the audit entry were
    never said. The repeat now says the job was paused by this slot's finish."""
    backend = RedisBackend(redis=server_url, prefix=prefix)
    store: Any = await backend.open({"runner": "r", "history_size": 100, "history_ttl_ms": None})
    try:
        slot_ms = int(time.time() * 1000) // 1000 * 1000
        request = ClaimRequest("sync", str(slot_ms), slot_ms, "tok", "schedule", 30_000, 1,
                               False, 600_000)  # fmt: skip
        (won,) = await store.claim_many([request])
        assert won.kind == "won", won
        end = AttemptEnd(
            job="sync", slot_id=str(slot_ms), token="tok", attempt=1, trigger="schedule",
            fence=won.fence, started_ms=slot_ms, finished_ms=slot_ms + 5, outcome="failed",
            error="boom", max_attempts=1, retry_delay_ms=0, pause_after=1,
        )  # fmt: skip
        first, repeat = await store.finish(end), await store.finish(end)
    finally:
        await store.conn.aclose()
    assert (first.status, first.paused) == ("failed", True), first
    assert (repeat.status, repeat.paused) == ("failed", True), repeat
