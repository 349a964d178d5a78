"""The agenda: what is due when, and the wake-up.

It holds the claims this instance will make (``DueSlot``), earliest first, and sleeps the
claim loop until the earliest is due (``next_batch``). Two kinds go in: each job's next
slot (``schedule_first_slots``; a slot's successor is scheduled when it comes due), and
follow-ups of a slot this instance already asked about (a backup's, a retry's, a
take-over's, a claim waiting behind an overlapping run), which the claimer and settle
push. Timers are the other source of due work: one claim per kind (and bucket) of the
timers due by then, at the earliest due time the last claim reported (``timer_due``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel

from .._model.clock import pace, wall_ms
from .._model.job import Job
from .._model.schedule import iso_ms
from .._model.values import Trigger
from .._store.contract import slot_ms_of
from .._store.keys import TimerKeys
from .context import EngineContext

__all__ = ["CLAIM_RETRY_MS", "Agenda", "Claim", "DueBatch", "DueSlot", "DueTimers"]

log = logging.getLogger("anarchon")

#: Delays before a failed claim is sent again: the first soon (a lost reply is learned
#: while the slot is young), then backing off; each with a random part of +-20 %.
CLAIM_RETRY_MS = (50, 250, 500, 1000, 2000, 5000)


class _Tokens:
    """Claim tokens: a random nonce per process and a counter, unique across the fleet
    (48 random bits per process) and cheap to make: one per claim and instance, where
    a token drawn from the system's random source cost more than the claim's own
    bookkeeping. Made again in a forked child, which must not share its parent's."""

    def __init__(self) -> None:
        self.renew()

    def renew(self) -> None:
        self._nonce = secrets.token_hex(6)
        self._count = itertools.count()

    def __call__(self) -> str:
        return f"{self._nonce}{next(self._count):x}"


new_token = _Tokens()
os.register_at_fork(after_in_child=new_token.renew)


@dataclass(eq=False, slots=True)
class Claim:
    """A claim this instance will make at ``at_ms`` (wall clock, epoch ms): of a job's
    slot (``DueSlot``) or of a timer kind's (bucket's) due timers (``DueTimers``). Claims
    are ordered by instant, then by when they were queued."""

    at_ms: float
    seq: int
    token: str = field(kw_only=True, default_factory=new_token)
    failures: int = field(kw_only=True, default=0)

    def __lt__(self, other: Claim) -> bool:
        return (self.at_ms, self.seq) < (other.at_ms, other.seq)

    def noted(self, agenda: Agenda) -> None:
        """It went on the agenda."""

    def forgotten(self, agenda: Agenda) -> None:
        """It left the agenda."""

    def popped(self, agenda: Agenda, batch: DueBatch, now_ms: float) -> None:
        """It is due: into the batch to claim, or dropped."""
        raise NotImplementedError

    def sort_into(self, batch: DueBatch) -> None:
        raise NotImplementedError

    def before_retry(self, agenda: Agenda, at_ms: float) -> None:
        """Its round trip failed, and it is sent again at ``at_ms``."""

    def follows_up(self, job: str, slot_id: str) -> bool:
        """Whether it is a later claim (a backup's, a retry's) of that slot."""
        return False


@dataclass(eq=False, slots=True)
class DueSlot(Claim):
    """A claim of a job's slot."""

    job: str
    slot_id: str
    slot_ms: int
    trigger: Trigger
    #: The slot's first claim by this instance (lateness applies, and the
    #: job's next slot is scheduled); later claims are a backup's or a retry's.
    first: bool
    #: Whether this claim may start the run: a first claim, or one waiting behind an
    #: overlapping run after its first claim found the slot not started. A backup's
    #: or a retry's claim of a slot whose state was forgotten must not start it again.
    may_start: bool = field(kw_only=True, default=False)
    #: Put back on the agenda for want of room for its job here (the job's own
    #: ``max_concurrent``): its successor is on the agenda already.
    held: bool = field(kw_only=True, default=False)
    #: Waiting behind an older run, it gave its place to a newer slot (overlap
    #: "buffer_one"): claimed once more, to be recorded as skipped unless it started.
    superseded: bool = field(kw_only=True, default=False)
    #: A first claim that got no answer until it could no longer start its slot (too
    #: late, or a newer slot of its job came): claimed once more only to learn whether
    #: its lost reply won, and recorded skipped (late) unless it did.
    gave_way: bool = field(kw_only=True, default=False)

    def ask_only(self) -> None:
        """This first claim, which has had no answer, may no longer start its slot: it
        asks only whether its lost reply won."""
        self.first = False
        self.may_start = False
        self.gave_way = True

    def give_way(self, job: Job, now_ms: float) -> None:
        """A newer slot of the job is due: this first claim, which has had no answer yet,
        keeps its turn as a catch-up if the job's catch-up window still holds it, and
        otherwise may no longer start its slot (its lost reply may have won)."""
        if now_ms - self.slot_ms <= job.catch_up_ms:
            self.trigger = "catch-up"
            return
        self.ask_only()

    def noted(self, agenda: Agenda) -> None:
        if not self.first:
            agenda.pending.add((self.job, self.slot_id))

    def forgotten(self, agenda: Agenda) -> None:
        agenda.pending.discard((self.job, self.slot_id))

    def popped(self, agenda: Agenda, batch: DueBatch, now_ms: float) -> None:
        agenda.pop_slot(self, batch.slots, now_ms)

    def sort_into(self, batch: DueBatch) -> None:
        batch.slots.append(self)

    def follows_up(self, job: str, slot_id: str) -> bool:
        return self.job == job and self.slot_id == slot_id and not self.first

    def before_retry(self, agenda: Agenda, at_ms: float) -> None:
        # A first claim whose job has a newer slot due by then gives way to it.
        next_slot_ms = agenda.next_slot_ms.get(self.job)
        job = agenda.job(self.job)
        if (
            self.first
            and job is not None
            and next_slot_ms is not None
            and self.slot_ms < next_slot_ms <= at_ms
        ):
            self.give_way(job, at_ms)


@dataclass(eq=False, slots=True)
class DueTimers(Claim):
    """A claim of a timer kind's (bucket's) due timers; its token is the base of the
    firings' tokens."""

    kind: str
    keys: TimerKeys

    def noted(self, agenda: Agenda) -> None:
        agenda.timer_claims[self.keys.tag] = self

    def forgotten(self, agenda: Agenda) -> None:
        if agenda.timer_claims.get(self.keys.tag) is self:
            del agenda.timer_claims[self.keys.tag]

    def popped(self, agenda: Agenda, batch: DueBatch, now_ms: float) -> None:
        if self.kind in agenda.timer_kinds:
            batch.timers.append(self)

    def sort_into(self, batch: DueBatch) -> None:
        batch.timers.append(self)


@dataclass(slots=True)
class DueBatch:
    """The claims due together: of jobs' slots, and of timer kinds' due timers."""

    slots: list[DueSlot] = field(default_factory=list)
    timers: list[DueTimers] = field(default_factory=list)


class Agenda:
    """The claims this instance will make, earliest first (a heap of ``DueSlot``)."""

    def __init__(self, context: EngineContext) -> None:
        self._context = context
        self._due: list[Claim] = []
        self._seq = itertools.count()
        self._wake = anyio.Event()
        #: Follow-up claims (backups, retries, take-overs) waiting in the heap.
        self.pending: set[tuple[str, str]] = set()
        #: Claims waiting for a run of the job on this instance to end (overlap).
        self._overlap_waiters: dict[str, list[DueSlot]] = {}
        #: The next scheduled slot of each job this instance will claim.
        self.next_slot_ms: dict[str, int] = {}
        #: The claim of each timer kind's (bucket's) due timers on the agenda, by tag.
        self.timer_claims: dict[str, DueTimers] = {}
        #: The kinds of timer this instance fires.
        self.timer_kinds = context.timer_kinds
        #: Claims of due timers that found no room here, by tag: made again when a run
        #: here ends.
        self._waiting_for_room: dict[str, tuple[str, TimerKeys]] = {}
        #: Claims of slots of a job at its own bound here: made again when a run of the
        #: job here ends.
        self._room_waiters: dict[str, list[DueSlot]] = {}
        context.capacity.on_freed(self.room_freed)

    def wake(self) -> None:
        """Wake the claim loop now (to see an earlier claim, or that the scheduler stops)."""
        self._wake.set()

    # ------------------------------------------------------------ adding claims

    def push(self, due: Claim) -> None:
        first_before = self._due[0].at_ms if self._due else math.inf
        heapq.heappush(self._due, due)
        due.noted(self)
        if due.at_ms < first_before:
            self._wake.set()

    def timer_due(self, kind: str, keys: TimerKeys, at_ms: float) -> None:
        """Claim the due timers of a kind (bucket) at ``at_ms``: the claim of them on the
        agenda comes forward to then, if it is later (one per kind and bucket)."""
        due = self.timer_claims.get(keys.tag)
        if due is None:
            self.push(DueTimers(at_ms, next(self._seq), kind, keys))
        elif at_ms < due.at_ms:
            due.at_ms = at_ms
            heapq.heapify(self._due)
            if self._due[0] is due:
                self._wake.set()

    def push_follow_up(
        self, job: Job, slot_id: str, trigger: Trigger, at_ms: float, may_start: bool = False
    ) -> DueSlot:
        """A later claim of a slot this instance already asked about: a backup's, a retry's."""
        due = DueSlot(
            at_ms,
            next(self._seq),
            job.name,
            slot_id,
            slot_ms_of(slot_id),
            trigger,
            False,
            may_start=may_start,
        )
        self.push(due)
        return due

    def claim_given_back(self, job: str, slot_id: str) -> None:
        """A stopping instance gave a run of ``job`` back: claim it now, if the job runs
        here. A follow-up claim of that slot on the agenda (a backup's) comes forward;
        without one (the backup expected to find the run at the job's next slot, sooner
        than the lease it knew of would run out) one is made."""
        found = self._context.jobs.get(job)
        if found is None or job in self._context.disabled:
            return
        if (job, slot_id) in self._context.attempts:
            return  # it runs here already
        if (job, slot_id) not in self.pending:
            try:
                slot_ms_of(slot_id)
            except ValueError:
                return  # not a slot id: no hint of ours
            self.push_follow_up(found, slot_id, "retry", wall_ms())
            return
        now_ms = wall_ms()
        for due in self._due:
            if due.follows_up(job, slot_id):
                due.at_ms = min(due.at_ms, now_ms)
        heapq.heapify(self._due)
        self._wake.set()

    def claim_now(self, job: Job, slot_id: str) -> None:
        """Claim a run the fleet was asked for (stored as due) now, unless this instance
        already has a claim of it on the agenda."""
        if (job.name, slot_id) not in self.pending:
            self.push_follow_up(job, slot_id, "manual", wall_ms())

    def retry(self, batch: Sequence[Claim]) -> None:
        """Claims whose round trip failed are sent again with the same token (the claim
        script recognises a repeat), after a growing delay (``CLAIM_RETRY_MS``).

        A slot's first claim whose job has a newer slot due by then is sent again only
        to learn whether it had won (its reply may have been lost after the server
        applied it): it may no longer start the run, so a backlog of old slots never
        runs late in place of the on-time one (``DueSlot.before_retry``)."""
        now_ms = wall_ms()
        for due in batch:
            wait_ms = CLAIM_RETRY_MS[min(due.failures, len(CLAIM_RETRY_MS) - 1)]
            self.push_again(due, now_ms + wait_ms * random.uniform(0.8, 1.2))

    def push_again(self, due: Claim, at_ms: float) -> None:
        """Queue a claim again at ``at_ms``, with its token (its round trip failed)."""
        due.failures += 1
        due.before_retry(self, at_ms)
        due.at_ms = at_ms
        due.seq = next(self._seq)
        self.push(due)

    def take_unanswered(self) -> DueBatch:
        """Remove and return the claims whose last round trip failed: the server may
        have applied them (a lost reply), so a stopping scheduler resolves them."""
        unanswered = DueBatch()
        for due in self._due:
            if due.failures > 0:
                due.forgotten(self)
                due.sort_into(unanswered)
        self._due = [due for due in self._due if due.failures == 0]
        heapq.heapify(self._due)
        return unanswered

    def wait_for_room(self, kind: str, keys: TimerKeys) -> None:
        """A kind's (bucket's) claim of due timers found this instance at its bound: it
        is made again as soon as a run here ends (``room_freed``)."""
        self._waiting_for_room[keys.tag] = (kind, keys)

    def room_freed(self) -> None:
        """A run here ended (or a claim in flight gave its room back): the claims of due
        timers that waited for room are due now."""
        if self._waiting_for_room:
            waiting, self._waiting_for_room = self._waiting_for_room, {}
            now_ms = wall_ms()
            for kind, keys in waiting.values():
                self.timer_due(kind, keys, now_ms)

    def hold_for_room(self, due: DueSlot) -> None:
        """``due``'s job is at its own bound here (``max_concurrent``): claim it again as
        soon as a run of the job here ends, or a poll interval from now. Meanwhile it
        stays in the store for the other instances; a first claim that has become too
        late by then is skipped, as any late one is."""
        due.held = True
        due.at_ms = wall_ms() + self._context.timer_poll_ms
        due.seq = next(self._seq)
        self.push(due)
        self._room_waiters.setdefault(due.job, []).append(due)

    def waiting_for_room(self) -> int:
        """Claims put off here for want of room: of slots (their job at its bound) and of
        kinds' due timers."""
        return sum(map(len, self._room_waiters.values())) + len(self._waiting_for_room)

    def wake_when_run_ends(self, job: Job, due: DueSlot) -> None:
        """Bring ``due`` forward as soon as a run of the job on this instance ends."""
        self._overlap_waiters.setdefault(job.name, []).append(due)

    def supersede_waiters(self, job: Job, newer_slot_ms: int) -> None:
        """A slot of ``job`` newer than ``newer_slot_ms``'s waiting ones runs or waits now
        (overlap "buffer_one"): the older ones waiting here are claimed at once, to be
        recorded as skipped (``DueSlot.superseded``)."""
        waiters = self._overlap_waiters.get(job.name)
        if not waiters:
            return
        older = [due for due in waiters if due.slot_ms < newer_slot_ms]
        if not older:
            return
        now_ms = wall_ms()
        for due in older:
            waiters.remove(due)
            due.superseded = True
            due.at_ms = min(due.at_ms, now_ms)
        heapq.heapify(self._due)
        self._wake.set()

    def has_waiter(self, job: Job) -> bool:
        """Whether a claim of ``job`` waits behind an older run here (overlap="wait"
        lets one slot wait at most)."""
        return bool(self._overlap_waiters.get(job.name))

    def run_ended(self, job: Job) -> None:
        """A run of ``job`` on this instance ended: claims waiting behind it, or for room
        of its own, are due now."""
        waiters = self._overlap_waiters.pop(job.name, []) + self._room_waiters.pop(job.name, [])
        if waiters:
            now_ms = wall_ms()
            for due in waiters:
                due.at_ms = min(due.at_ms, now_ms)
            heapq.heapify(self._due)
            self._wake.set()

    # ------------------------------------------------------------ a job's slots

    def _next_slot(self, job: Job, after_ms: int) -> int | None:
        """The job's first slot after ``after_ms``; a schedule that raises (or answers
        something that is not an aware datetime) disables its job alone."""
        try:
            return job.clock.next_slot_ms(after_ms)
        except Exception as exc:
            self._context.disable(
                job.name,
                f"its schedule {job.schedule!r} raised {type(exc).__name__}: {exc}; fix the "
                "schedule's next_after (it must return an aware datetime, or None when it "
                "never fires again)",
            )
            return None

    def schedule_first_slots(self, job: Job, now_ms: float) -> None:
        """On start (or when added): slots in the catch-up window (never before the job
        first appeared in the store), then the next one."""
        after = int(now_ms)
        if job.catch_up_ms:
            first_seen_ms = self._context.first_seen_ms.get(job.name, 0)
            after = min(max(after - job.catch_up_ms, first_seen_ms) - 1, after)
        slot = self._next_slot(job, after)
        if slot is not None:
            self._schedule_slot(job, slot, "catch-up" if slot < now_ms else "schedule")

    def _schedule_slot(self, job: Job, slot_ms: int, trigger: Trigger) -> None:
        jitter = random.uniform(0, job.jitter_ms) if job.jitter_ms else 0.0
        self.next_slot_ms[job.name] = slot_ms
        due = DueSlot(
            slot_ms + jitter,
            next(self._seq),
            job.name,
            str(slot_ms),
            slot_ms,
            trigger,
            True,
            may_start=True,
        )
        self.push(due)

    def _schedule_next_slot(self, job: Job, after_slot_ms: int, now_ms: float) -> None:
        """After a slot's first claim, its successor. After a gap (a stall or an
        outage) slots too old for both lateness and catch-up are skipped over."""
        oldest_wanted = int(now_ms) - max(job.late_window_ms, job.catch_up_ms) - 1
        slot = self._next_slot(job, max(after_slot_ms, oldest_wanted))
        if oldest_wanted > after_slot_ms:
            log.warning(
                "%s: slots after %s were missed (no claim in time)",
                job.name,
                iso_ms(after_slot_ms),
            )
        if slot is None:
            self.next_slot_ms.pop(job.name, None)
            return
        overdue_ms = now_ms - slot
        self._schedule_slot(
            job, slot, "catch-up" if 0 < overdue_ms <= job.catch_up_ms else "schedule"
        )

    # ------------------------------------------------------- taking what is due

    async def next_batch(self) -> DueBatch:
        """Sleep until the earliest claim is due; return every claim due by then."""
        while self._context.state == "running":
            if not self._due:
                await self._wait_for_wake(None)
                continue
            delay_sec = (self._due[0].at_ms - wall_ms()) / 1000
            timing = pace()
            if delay_sec > timing.sleep_margin_sec:
                await self._wait_for_wake(
                    min(delay_sec - timing.sleep_margin_sec, timing.sleep_cap_sec)
                )
                continue
            if delay_sec > 0:
                await anyio.lowlevel.checkpoint()
                continue
            return self._pop_due(wall_ms())
        return DueBatch()

    async def _wait_for_wake(self, timeout_sec: float | None) -> None:
        with anyio.move_on_after(math.inf if timeout_sec is None else timeout_sec):
            await self._wake.wait()
        if self._wake.is_set():
            self._wake = anyio.Event()

    def _pop_due(self, now_ms: float) -> DueBatch:
        batch = DueBatch()
        while self._due and self._due[0].at_ms <= now_ms:
            due = heapq.heappop(self._due)
            due.forgotten(self)
            due.popped(self, batch, now_ms)
        batch.slots = self._without_stale_backlog(batch.slots, now_ms)
        return batch

    def pop_slot(self, due: DueSlot, slots: list[DueSlot], now_ms: float) -> None:
        """A slot's claim is due: into ``slots``, unless its job is gone or disabled, or
        it came too late (then skipped, loudly)."""
        for waiting in (self._overlap_waiters, self._room_waiters):
            waiters = waiting.get(due.job)
            if waiters and due in waiters:
                waiters.remove(due)  # claimed now: nothing left to wake
        job = self._context.jobs.get(due.job)
        if job is None or job.name in self._context.disabled:
            return
        if due.first and due.failures == 0 and not due.held:
            self._schedule_next_slot(job, due.slot_ms, now_ms)
        if due.first and self._context.resting(job.name):
            return  # max_runs reached: not claimed (a run under way goes on)
        if due.first and not self._in_time(job, due, now_ms):
            if due.failures == 0:
                self._log_missed(job, due, now_ms)
                self._context.skipped(job.name, due.slot_ms, "late")
                return
            # Too late to start now, but its lost reply may have won: ask only that.
            due.ask_only()
        if not due.first and due.may_start and self._waited_too_long(job, due, now_ms):
            self._context.skipped(job.name, due.slot_ms, "late")
            return
        slots.append(due)

    def still_in_time(self, batch: list[DueSlot], now_ms: float) -> list[DueSlot]:
        """The claims of ``batch`` that may still be made after waiting for room here: a
        first claim that has become too late is skipped, loudly, as ``pop_slot`` skips
        one that comes due too late."""
        kept = []
        for due in batch:
            job = self._context.jobs.get(due.job)
            if job is None:
                continue
            if due.first and due.failures == 0 and not self._in_time(job, due, now_ms):
                self._log_missed(job, due, now_ms)
                self._context.skipped(job.name, due.slot_ms, "late")
                continue
            kept.append(due)
        return kept

    def _without_stale_backlog(self, batch: list[DueSlot], now_ms: float) -> list[DueSlot]:
        """After an outage or a stall, several scheduled slots of one job can be due at
        once. Without overlap they would run one after the other, late, and push the
        on-time slot out: only the newest scheduled slot of each job is claimed, the
        older ones are skipped, unless the job's catch-up window holds them (catch-up
        slots keep their turn, oldest first)."""
        newest: dict[str, DueSlot] = {}
        for due in batch:
            job = self._context.jobs[due.job]
            backlog = due.first and due.trigger == "schedule" and not job.overlap
            if backlog and (due.job not in newest or newest[due.job].slot_ms < due.slot_ms):
                newest[due.job] = due
        kept = []
        for due in batch:
            latest = newest.get(due.job)
            older = due.first and due.trigger == "schedule" and latest is not None
            if older and due is not latest and (due.failures > 0 or self._catches_up(due, now_ms)):
                # Its lost reply may have won (ask only that), or it catches up.
                due.give_way(self._context.jobs[due.job], now_ms)
            elif older and latest is not None and due is not latest:
                log.warning(
                    "%s: slot %s skipped: a newer slot (%s) is due too, after a gap",
                    due.job,
                    iso_ms(due.slot_ms),
                    iso_ms(latest.slot_ms),
                )
                self._context.skipped(due.job, due.slot_ms, "late")
                continue
            kept.append(due)
        return kept

    def _catches_up(self, due: DueSlot, now_ms: float) -> bool:
        return now_ms - due.slot_ms <= self._context.jobs[due.job].catch_up_ms

    def job(self, name: str) -> Job | None:
        """The job of that name here, or None (removed)."""
        return self._context.jobs.get(name)

    def _waited_too_long(self, job: Job, due: DueSlot, now_ms: float) -> bool:
        """A claim waiting behind an older run may start its slot only while the store
        is sure to remember the slot (another instance may have run it meanwhile)."""
        age_ms = now_ms - due.slot_ms
        if age_ms <= job.start_limit_ms(self._context.lease_ms):
            return False
        log.warning(
            "%s: slot %s skipped: it waited %.0f ms behind an older run (or for a fleet "
            "permit, max_concurrent_fleet), longer than a waiting slot may (lateness or "
            "catch-up window plus a lease plus 30 s)",
            job.name,
            iso_ms(due.slot_ms),
            age_ms,
        )
        return True

    def _in_time(self, job: Job, due: DueSlot, now_ms: float) -> bool:
        """A first claim is made only while the slot is young enough, or in catch-up."""
        age_ms = now_ms - due.slot_ms
        if age_ms <= job.late_window_ms:
            return True
        if age_ms <= job.catch_up_ms:
            due.trigger = "catch-up"
            return True
        return False

    @staticmethod
    def _log_missed(job: Job, due: DueSlot, now_ms: float) -> None:
        log.warning(
            "%s: slot %s missed: %.0f ms late, max_late_ms=%d and catch_up_ms=%d",
            job.name,
            iso_ms(due.slot_ms),
            now_ms - due.slot_ms,
            job.max_late_ms,
            job.catch_up_ms,
        )
