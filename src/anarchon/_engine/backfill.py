"""Backfills driven here (``_store/backfill.py`` says what one is).

After each registration renewal (every 10 s), and when a hint says one was asked for,
the instance reads the prefix's set of jobs with a backfill; for each job it runs (with
its definition in force), it tries to take the turn to drive that job's backfill. The driver walks
the job's own schedule from the record's cursor, oldest first, one slot at a time:

- a slot the job's history shows decided before (its state forgotten since) is
  counted ``before``, and not claimed;
- otherwise it is claimed with trigger ``"backfill"`` as any claim of the slot, so that
  the fleet runs it once: a slot settled already is counted ``before``; one under way
  (here or elsewhere, a retry waiting for its delay, an older run of a job without
  overlap) is waited for; one won runs here, and the driver waits for it to settle,
  retries included; one the job's ``exclude=``, a pause or its ``max_runs`` leaves out
  is recorded skipped by the claim, as a scheduled slot is;
- then the cursor moves past it, with its outcome counted.

The turn is a lease on the record, renewed as the driver goes: when this instance dies,
another that runs the job takes the turn within a lease and goes on from the cursor
(the slot that was under way is taken over by the claim, as any orphaned run). While
the job is paused the driver waits; a cancel ends the walk at its next slot.
"""

from __future__ import annotations

import logging

import anyio

from .._errors import SchedulerStateError
from .._model.clock import monotonic
from .._model.job import Job
from .._model.schedule import SlotClock, count_slots, iso_ms
from .._store.backfill import (
    BACKFILL_SLOTS_MAX,
    Turn,
    advance_backfill,
    backfilling,
    forget_ended,
    settled_before,
    take_turn,
)
from .._store.contract import ClaimRequest, Store
from .agenda import new_token
from .context import EngineContext
from .manual import ManualRuns

__all__ = ["Backfills"]

log = logging.getLogger("anarchon")

#: The shortest pause before a slot that waits is claimed again.
_WAIT_MIN_SEC = 0.05


class Backfills:
    """Finds the backfills of the jobs this instance runs, and drives them in turn."""

    def __init__(
        self,
        context: EngineContext,
        store: Store,
        manual: ManualRuns,
        group: anyio.abc.TaskGroup,
    ) -> None:
        self._context = context
        self._store = store
        self._manual = manual
        self._group = group
        #: The jobs whose backfill a task of this instance drives (or tries to).
        self._driving: set[str] = set()
        #: The jobs whose backfill failed here: said once, until it goes on again.
        self._failing: set[str] = set()
        #: A read of the jobs with a backfill is in flight.
        self._looking = False

    def asked(self) -> None:
        """A backfill was asked for a job that runs here (a hint): look now."""
        if not self._looking and self._context.state == "running":
            self._group.start_soon(self.look, name="anarchon backfills")

    async def look(self) -> None:
        """Read which jobs have a backfill, and start a driver for each one that runs here
        (with its definition in force) and has none yet. After each registration
        renewal, and on a hint; a failure waits for the next."""
        context = self._context
        if self._looking:
            return
        self._looking = True
        try:
            with anyio.fail_after(context.round_trip_sec):
                names = await backfilling(self._store.conn, self._store.prefix)
        except Exception as exc:
            log.debug("reading the jobs with a backfill failed (tried again later): %s", exc)
            return
        finally:
            self._looking = False
        for name in names:
            job = context.jobs.get(name)
            if (
                job is not None
                and context.state == "running"
                and name not in self._driving
                and name not in context.outdated
            ):
                self._driving.add(name)
                self._group.start_soon(self._drive, job, name=f"anarchon backfill {name}")

    async def _drive(self, job: Job) -> None:
        try:
            await self._walk(job)
            self._failing.discard(job.name)
        except Exception as exc:
            if job.name not in self._failing:
                self._failing.add(job.name)
                log.warning(
                    "driving the backfill of %s failed here (another turn is tried at the next "
                    "registration renewal; said once): %s",
                    job.name,
                    str(exc) or type(exc).__name__,
                )
        finally:
            self._driving.discard(job.name)

    async def _take(self, job: Job) -> Turn | str:
        context = self._context
        with anyio.fail_after(context.round_trip_sec):
            return await take_turn(
                self._store.conn, self._store.prefix, job.name, context.instance_id,
                context.lease_ms,
            )  # fmt: skip

    async def _advance(
        self,
        job: Job,
        next_ms: int,
        *,
        outcome: str = "",
        slots: int | None = None,
        end: str = "",
    ) -> bool:
        context = self._context
        with anyio.fail_after(context.round_trip_sec):
            return await advance_backfill(
                self._store.conn, self._store.prefix, job.name, context.instance_id,
                context.lease_ms, next_ms=next_ms, outcome=outcome, slots=slots, end=end,
            )  # fmt: skip

    async def _rest(self, seconds: float) -> None:
        with anyio.move_on_after(seconds):
            await self._context.stopping.wait()

    async def _walk(self, job: Job) -> None:
        """Drive ``job``'s backfill while this instance has the turn."""
        context, store = self._context, self._store
        turn_sec = context.lease_ms / 3000
        said = False
        while context.state == "running":
            turn = await self._take(job)
            if isinstance(turn, str):
                if turn in ("none", "over"):
                    with anyio.fail_after(context.round_trip_sec):
                        await forget_ended(store.conn, store.prefix, job.name)
                return
            if turn.paused:
                await self._rest(turn_sec)  # it waits while the job is paused
                continue
            slots = turn.slots
            if slots is None:
                slots = count_slots(job.schedule, turn.start_ms, turn.end_ms, BACKFILL_SLOTS_MAX)
                if slots > BACKFILL_SLOTS_MAX:
                    why = (
                        f"its range holds more than {BACKFILL_SLOTS_MAX} slots of the job's "
                        "schedule: ask for a shorter range"
                    )
                    if await self._advance(job, turn.next_ms, end=why):
                        log.warning("the backfill of %s was stopped: %s", job.name, why)
                    return
                if not await self._advance(job, turn.next_ms, slots=slots):
                    return
            if not said:
                said = True
                log.info(
                    "driving the backfill of %s: %d slot(s) in [%s, %s), from %s",
                    job.name, slots, iso_ms(turn.start_ms), iso_ms(turn.end_ms),
                    iso_ms(turn.next_ms),
                )  # fmt: skip
            clock = SlotClock(job.schedule)
            slot_ms = clock.next_slot_ms(turn.next_ms - 1)
            if slot_ms is None or slot_ms >= turn.end_ms:
                if await self._advance(job, turn.end_ms, end="done"):
                    log.info("the backfill of %s is done", job.name)
                return
            outcome = await self._decide(job, slot_ms)
            if outcome is None:
                return  # stopping, or the turn went to another instance
            if outcome == "finished":
                why = f"the job is finished (its max_runs {job.max_runs} reached)"
                await self._advance(job, slot_ms, end=why)
                log.warning("the backfill of %s was stopped: %s", job.name, why)
                return
            # The cursor moves to the slot after it (the range's end after the last).
            following = clock.next_slot_ms(slot_ms)
            next_ms = turn.end_ms if following is None else min(following, turn.end_ms)
            if not await self._advance(job, next_ms, outcome=outcome):
                return

    async def _decide(self, job: Job, slot_ms: int) -> str | None:
        """Have the fleet decide one slot: its outcome for the record (ok, failed, before,
        skipped), "finished" when the job's runs reached its max_runs, or None when this
        instance stops or lost its turn."""
        context, store = self._context, self._store
        with anyio.fail_after(context.round_trip_sec):
            if await settled_before(store.conn, store.prefix, job.name, slot_ms):
                return "before"
        won = False
        turn_sec = context.lease_ms / 3000
        renew_at = monotonic() + turn_sec
        while context.state == "running":
            if monotonic() >= renew_at:
                if isinstance(await self._take(job), str):
                    return None
                renew_at = monotonic() + turn_sec
            request = self._request(job, slot_ms, new_token())
            try:
                reply, attempt = await self._manual.claim_here(job, request, "backfill claim")
            except SchedulerStateError:
                return None  # the stop began
            if attempt is not None:
                won = True
                while not attempt.settled.is_set():
                    with anyio.move_on_after(turn_sec):
                        await attempt.settled.wait()
                    if context.state != "running":
                        return None  # the stop settles the attempt
                    if not attempt.settled.is_set() and isinstance(await self._take(job), str):
                        return None
                renew_at = monotonic() + turn_sec
                continue
            if reply.kind == "done":
                if reply.status == "finished":
                    return "finished"
                if reply.status == "outdated":
                    # Another definition of the job is in force: its instances drive.
                    context.outdated_by_store(job.name)
                    return None
                if won:
                    return "ok" if reply.status == "ok" else "failed"
                if reply.status in ("excluded", "paused", "superseded", "malformed"):
                    return "skipped"
                return "before"
            # Under way, or behind another run of the job: asked again when it may be over.
            await self._rest(min(max(reply.wait_ms / 1000, _WAIT_MIN_SEC), turn_sec))
        return None

    def _request(self, job: Job, slot_ms: int, token: str) -> ClaimRequest:
        lease_ms = self._context.lease_ms
        return ClaimRequest(
            job=job.name,
            slot_id=str(slot_ms),
            slot_ms=slot_ms,
            token=token,
            trigger="backfill",
            lease_ms=lease_ms,
            max_attempts=job.max_attempts,
            allow_overlap=job.overlap,
            keep_ms=job.keep_ms(lease_ms),
            may_start=True,
            fleet_max=job.max_concurrent_fleet,
            max_runs=job.max_runs,
            excluded=job.excluded(slot_ms) if job.exclude is not None else None,
            fingerprint=self._context.fingerprints.get(job.name, ""),
        )
