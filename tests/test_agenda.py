"""The agenda's own rules (no server involved: it only decides which claims to make).

A claim that waited behind an older run may start its slot only while the store is
sure to remember the slot (defect: waiting claims kept the right to start forever,
so an instance cut off longer than the keep window could win attempt 1 again); a
failed first claim is never dropped unasked (its lost reply may have won); of a
backlog of one job's scheduled slots, only the newest starts."""

from __future__ import annotations

import logging
import os

import anyio
import pytest

from anarchon._engine.agenda import Agenda, DueSlot, new_token
from anarchon._engine.context import EngineContext
from anarchon._model.clock import PRODUCTION, wall_ms
from anarchon._model.job import Job, overlap_policy
from anarchon._model.schedule import IntervalSchedule, SlotClock

LEASE_MS = 30_000
# The agenda's clock is its caller's ``now_ms``: the tests hand it a fixed instant (half
# past an hour, on a 10 s boundary), so slot ages are exact to the millisecond and no
# slot of an hourly job comes due of its own (on the wall clock, one did when a run
# happened within 2 s after an hour struck).
NOW_MS = 1_800_001_800_000


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


def due(slot_ms: int, *, first: bool, may_start: bool, failures: int = 0) -> DueSlot:
    """A claim due at its slot's instant (claims compare by instant and sequence, so
    each of a test's claims has an instant of its own)."""
    return DueSlot(
        slot_ms, 0, "job", str(slot_ms), slot_ms, "schedule", first,
        failures=failures, may_start=may_start,
    )  # fmt: skip


def pop(agenda: Agenda, *dues: DueSlot) -> list[DueSlot]:
    for item in dues:
        agenda.push(item)
    return agenda._pop_due(NOW_MS).slots


def test_a_waiting_claim_past_the_start_limit_is_skipped_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    job = a_job("wait")
    limit_ms = job.start_limit_ms(LEASE_MS)
    assert limit_ms < job.keep_ms(LEASE_MS) - max(job.late_window_ms, job.catch_up_ms)
    now = NOW_MS
    young = due(now - limit_ms + 5_000, first=False, may_start=True)
    old = due(now - limit_ms - 5_000, first=False, may_start=True)
    backup = due(now - 10 * limit_ms, first=False, may_start=False)  # starts nothing
    with caplog.at_level(logging.WARNING, logger="anarchon"):
        claimed = pop(an_agenda(job), young, old, backup)
    assert young in claimed and backup in claimed and old not in claimed
    assert any("waited" in r.getMessage() for r in caplog.records)


def test_a_failed_first_claim_too_late_to_start_is_asked_without_the_right_to_start() -> None:
    job = a_job()
    now = NOW_MS
    failed = due(now - job.late_window_ms - 1_000, first=True, may_start=True, failures=2)
    (claimed,) = pop(an_agenda(job), failed)
    assert claimed is failed and not claimed.first and not claimed.may_start


def test_of_a_backlog_of_scheduled_slots_only_the_newest_may_start() -> None:
    job = a_job()
    now = NOW_MS
    older = due(now - 2_000, first=True, may_start=True)
    older_failed = due(now - 1_500, first=True, may_start=True, failures=1)
    newest = due(now - 1_000, first=True, may_start=True)
    claimed = pop(an_agenda(job), older, older_failed, newest)
    assert older not in claimed
    assert newest in claimed and newest.may_start
    assert older_failed in claimed and not older_failed.may_start


def test_a_backlog_of_an_overlapping_job_is_claimed_whole() -> None:
    """Only a job without overlap keeps the newest of a backlog: slots of a job that
    allows overlap may run side by side, so each of them is claimed."""
    job = a_job("allow")
    now = NOW_MS
    backlog = [due(now - gap, first=True, may_start=True) for gap in (2_000, 1_500, 1_000)]
    claimed = pop(an_agenda(job), *backlog)
    assert sorted(d.slot_ms for d in claimed) == sorted(d.slot_ms for d in backlog)
    assert all(d.first and d.may_start for d in claimed)


@pytest.mark.anyio
async def test_a_sleep_toward_a_far_claim_re_reads_the_clock_within_the_cap() -> None:
    """A wall-clock step (or a suspended machine) must not leave the claim loop asleep
    until a far instant computed before the step: sleeps are capped and the clock is
    read again. Here the claim's instant is moved an hour earlier without waking the
    agenda, which is what the loop sees when the wall clock jumps an hour ahead."""
    agenda = an_agenda(a_job())
    far = due(int(wall_ms()) + 3_600_000, first=False, may_start=False)
    far.at_ms = wall_ms() + 3_600_000
    agenda.push(far)
    got: list[DueSlot] = []

    async def claim_loop() -> None:
        got.extend((await agenda.next_batch()).slots)

    with anyio.fail_after(PRODUCTION.sleep_cap_sec + 3):
        async with anyio.create_task_group() as group:
            group.start_soon(claim_loop)
            await anyio.sleep(0.2)
            far.at_ms = wall_ms()  # the clock "jumped": the claim is due now
    assert got == [far]


def a_job_with(
    every_ms: int = 3_600_000,
    *,
    name: str = "job",
    overlap: str = "skip",
    catch_up_ms: int = 0,
    jitter_ms: int = 0,
    max_late_ms: int = 60_000,
) -> Job:
    schedule = IntervalSchedule(every_ms)
    return Job(
        name=name, handler=lambda: None, schedule=schedule, clock=SlotClock(schedule),
        overlap_policy=overlap_policy(overlap), max_attempts=3, catch_up_ms=catch_up_ms,
        jitter_ms=jitter_ms, max_late_ms=max_late_ms, takes_run=False, is_async=False,
    )  # fmt: skip


def an_agenda_of(*jobs: Job) -> Agenda:
    context = EngineContext(
        jobs={job.name: job for job in jobs}, instance_id="i", lease_ms=LEASE_MS,
        heartbeat_ms=10_000, retry_delay_ms=1000,
    )  # fmt: skip
    context.state = "running"
    return Agenda(context)


def first_claim(slot_ms: int, job: str = "job") -> DueSlot:
    """A slot's first claim as the agenda schedules it (no jitter: due at the slot)."""
    return DueSlot(slot_ms, 0, job, str(slot_ms), slot_ms, "schedule", True, may_start=True)


def test_a_first_claim_is_made_up_to_its_lateness_window_and_skipped_loudly_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    job = a_job_with()
    just_in_time = first_claim(NOW_MS - job.late_window_ms)
    agenda = an_agenda(job)
    agenda.push(just_in_time)
    assert agenda._pop_due(NOW_MS).slots == [just_in_time]
    too_late = first_claim(NOW_MS - job.late_window_ms - 1)
    agenda = an_agenda(job)
    agenda.push(too_late)
    with caplog.at_level(logging.WARNING, logger="anarchon"):
        assert agenda._pop_due(NOW_MS).slots == []
    assert any("missed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "max_late_ms", [15_000, 60_000], ids=["lateness-shorter", "lateness-longer"]
)
def test_on_start_the_slots_in_the_catch_up_window_are_claimed_oldest_first(
    max_late_ms: int,
) -> None:
    """Every 10 s, catching up 30 s: the slots 30, 20 and 10 s old are claimed as
    catch-up, in order, with the on-time slot; none is dropped as too late or as a
    backlog, whether the lateness window is shorter or longer than the catch-up one."""
    job = a_job_with(10_000, catch_up_ms=30_000, max_late_ms=max_late_ms)
    agenda = an_agenda(job)
    agenda.schedule_first_slots(job, NOW_MS)
    claimed = agenda._pop_due(NOW_MS).slots
    assert [(due.slot_ms - NOW_MS, due.trigger) for due in claimed] == [
        (-30_000, "catch-up"),
        (-20_000, "catch-up"),
        (-10_000, "catch-up"),
        (0, "schedule"),
    ]
    assert all(due.first and due.may_start for due in claimed)


def test_a_claim_waiting_behind_a_run_here_is_due_as_soon_as_that_run_ends() -> None:
    job = a_job_with(overlap="wait")
    agenda = an_agenda(job)
    now = wall_ms()
    # It asks again when the live run's lease runs out, or when a run here ends.
    slot_id = str(int(now))
    waiting = agenda.push_follow_up(job, slot_id, "schedule", now + LEASE_MS, may_start=True)
    agenda.wake_when_run_ends(job, waiting)
    assert agenda._pop_due(wall_ms()).slots == []
    agenda.run_ended(job)
    assert agenda._pop_due(wall_ms()).slots == [waiting]
    assert waiting.may_start  # it may still start its slot


def test_a_waiting_claim_made_on_its_own_time_no_longer_counts_as_the_waiter() -> None:
    """overlap="wait" lets one slot wait behind a run here: the job's next blocked
    slot is skipped while one waits. A waiting claim that comes due on its own time
    (the run's lease ran out) is made then, and stops counting as the waiter, or every
    later blocked slot would be skipped until some run here ended."""
    job = a_job_with(overlap="wait")
    agenda = an_agenda(job)
    assert not agenda.has_waiter(job)
    slot_id = str(int(wall_ms()))
    later = agenda.push_follow_up(job, slot_id, "schedule", wall_ms() + LEASE_MS, True)
    agenda.wake_when_run_ends(job, later)
    assert agenda.has_waiter(job)
    agenda.run_ended(job)
    assert not agenda.has_waiter(job)
    own_time = agenda.push_follow_up(job, slot_id, "schedule", wall_ms() - 1, True)
    agenda.wake_when_run_ends(job, own_time)
    assert agenda.has_waiter(job)
    assert own_time in agenda._pop_due(wall_ms()).slots
    assert not agenda.has_waiter(job)


def test_a_follow_up_claim_is_pending_until_it_is_made() -> None:
    """The claimer takes over an orphaned slot unless a claim of it is pending: a claim
    made must stop counting, or the slot's later take-over is never claimed."""
    job = a_job_with()
    agenda = an_agenda(job)
    slot_id = str(NOW_MS - 1_000)
    backup = agenda.push_follow_up(job, slot_id, "schedule", NOW_MS)
    assert agenda.pending == {(job.name, slot_id)}
    assert agenda._pop_due(NOW_MS).slots == [backup]
    assert agenda.pending == set()


def test_a_backup_claim_is_not_a_first_claim() -> None:
    """A backup asks about a slot this instance claimed already, however old the slot:
    no lateness applies, it may not start the slot (its state may have been forgotten),
    and it schedules nothing (the job's next slot has its one claim already)."""
    job = a_job_with()
    agenda = an_agenda(job)
    agenda.schedule_first_slots(job, NOW_MS)
    (next_slot,) = agenda._due
    old_slot_ms = NOW_MS - 10 * job.late_window_ms
    backup = agenda.push_follow_up(job, str(old_slot_ms), "schedule", NOW_MS)
    assert agenda._pop_due(NOW_MS).slots == [backup]
    assert not backup.first and not backup.may_start
    assert len(agenda._due) == 1 and agenda._due[0] is next_slot


def test_a_jittered_slot_is_claimed_at_or_after_its_instant_within_the_jitter() -> None:
    job = a_job_with(10_000, jitter_ms=1_000)
    agenda = an_agenda(job)
    agenda.schedule_first_slots(job, NOW_MS)
    offsets = []
    for _ in range(20):
        (due,) = agenda._due
        offsets.append(due.at_ms - due.slot_ms)
        assert agenda._pop_due(due.at_ms).slots == [due]  # and schedules the next slot
    assert all(0 <= offset <= job.jitter_ms for offset in offsets)
    assert any(offset > 0 for offset in offsets)  # spread, not all at the instant


def test_after_a_gap_only_the_newest_slot_starts_though_dropped_claims_lie_among_them() -> None:
    """After a stall, several jobs' claims are due at once. Claims dropped on the way
    (another job's slot too late to claim, a disabled job's slot) must not cut the
    batch short: the older slots would go out alone, start late and push the on-time
    slot out."""
    every_second = a_job_with(1_000, name="every-second")
    strict = a_job_with(name="strict", max_late_ms=1_000)
    broken = a_job_with(name="broken")
    agenda = an_agenda_of(every_second, strict, broken)
    agenda._context.disable(broken.name, "the server refused its claims")
    agenda.push(first_claim(NOW_MS - 3_000, every_second.name))
    agenda.push(first_claim(NOW_MS - 2_500, strict.name))  # 2.5 s late, 1 s allowed
    agenda.push(first_claim(NOW_MS - 2_200, broken.name))
    claimed = agenda._pop_due(NOW_MS).slots
    assert [(due.job, due.slot_ms) for due in claimed] == [(every_second.name, NOW_MS)]


def test_claim_tokens_are_unique_and_a_forked_child_makes_its_own() -> None:
    """Claim tokens come from a per-process nonce and a counter: all distinct, and a
    forked child (a pre-forking web server's worker) draws a nonce of its own instead
    of repeating its parent's tokens, which the claim script would take for the
    parent's claims."""
    tokens = [new_token() for _ in range(1000)]
    assert len(set(tokens)) == 1000
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next token, then out at once
        os.write(write, new_token().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        child = pipe.read()
    mine = new_token()
    assert child and child != mine
    assert child[:12] != mine[:12], (child, mine)  # another nonce, not the next count
