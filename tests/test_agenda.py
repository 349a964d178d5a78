"""The agenda's own rules (no server involved: it only decides which claims to make).

A claim that waited behind an older run may start its slot only while the store is
sure to remember the slot (defect: waiting claims kept the right to start forever,
so an instance cut off longer than the keep window could win attempt 1 again); a
failed first claim is never dropped unasked (its lost reply may have won); of a
backlog of one job's scheduled slots, only the newest starts."""

from __future__ import annotations

import logging

import anyio
import pytest

from anarchon._engine._context import EngineContext, _now_ms
from anarchon._engine.agenda import _SLEEP_CAP_SEC, Agenda, _Due
from anarchon._job import Job, overlap_policy
from anarchon._schedule import IntervalSchedule, SlotClock

LEASE_MS = 30_000


def a_job(overlap: str = "skip") -> Job:
    schedule = IntervalSchedule(3_600_000)  # hourly: no slot of its own comes due here
    return Job(
        name="job", handler=lambda: None, schedule=schedule, clock=SlotClock(schedule),
        overlap_policy=overlap_policy(overlap), max_attempts=3, catch_up_ms=0, jitter_ms=0,
        max_late_ms=60_000, takes_run=False, is_async=False,
    )  # fmt: skip


def an_agenda(job: Job) -> Agenda:
    context = EngineContext(
        jobs={job.name: job}, instance_id="i", lease_ms=LEASE_MS, heartbeat_ms=10_000,
        retry_delay_ms=1000,
    )  # fmt: skip
    context.state = "running"
    return Agenda(context)


def due(slot_ms: int, *, first: bool, may_start: bool, failures: int = 0) -> _Due:
    return _Due(
        _now_ms() - 1, 0, "job", str(slot_ms), slot_ms, "schedule", first,
        failures=failures, may_start=may_start,
    )  # fmt: skip


def pop(agenda: Agenda, *dues: _Due) -> list[_Due]:
    for item in dues:
        agenda.push(item)
    return agenda._pop_due(_now_ms())


def test_a_waiting_claim_past_the_start_limit_is_skipped_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    job = a_job("wait")
    limit_ms = job.start_limit_ms(LEASE_MS)
    assert limit_ms < job.keep_ms(LEASE_MS) - max(job.late_window_ms, job.catch_up_ms)
    now = int(_now_ms())
    young = due(now - limit_ms + 5_000, first=False, may_start=True)
    old = due(now - limit_ms - 5_000, first=False, may_start=True)
    backup = due(now - 10 * limit_ms, first=False, may_start=False)  # starts nothing
    with caplog.at_level(logging.WARNING, logger="anarchon"):
        claimed = pop(an_agenda(job), young, old, backup)
    assert young in claimed and backup in claimed and old not in claimed
    assert any("waited" in r.getMessage() for r in caplog.records)


def test_a_failed_first_claim_too_late_to_start_is_asked_without_the_right_to_start() -> None:
    job = a_job()
    now = int(_now_ms())
    failed = due(now - job.late_window_ms - 1_000, first=True, may_start=True, failures=2)
    (claimed,) = pop(an_agenda(job), failed)
    assert claimed is failed and not claimed.first and not claimed.may_start


def test_of_a_backlog_of_scheduled_slots_only_the_newest_may_start() -> None:
    job = a_job()
    now = int(_now_ms())
    older = due(now - 2_000, first=True, may_start=True)
    older_failed = due(now - 1_500, first=True, may_start=True, failures=1)
    newest = due(now - 1_000, first=True, may_start=True)
    claimed = pop(an_agenda(job), older, older_failed, newest)
    assert older not in claimed
    assert newest in claimed and newest.may_start
    assert older_failed in claimed and not older_failed.may_start


@pytest.mark.anyio
async def test_a_sleep_toward_a_far_claim_re_reads_the_clock_within_the_cap() -> None:
    """A wall-clock step (or a suspended machine) must not leave the claim loop asleep
    until a far instant computed before the step: sleeps are capped and the clock is
    read again. Here the claim's instant is moved an hour earlier without waking the
    agenda, which is what the loop sees when the wall clock jumps an hour ahead."""
    agenda = an_agenda(a_job())
    far = due(int(_now_ms()) + 3_600_000, first=False, may_start=False)
    far.at_ms = _now_ms() + 3_600_000
    agenda.push(far)
    got: list[_Due] = []

    async def claim_loop() -> None:
        got.extend(await agenda.next_batch())

    with anyio.fail_after(_SLEEP_CAP_SEC + 3):
        async with anyio.create_task_group() as group:
            group.start_soon(claim_loop)
            await anyio.sleep(0.2)
            far.at_ms = _now_ms()  # the clock "jumped": the claim is due now
    assert got == [far]
