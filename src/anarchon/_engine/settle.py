"""Settle: record how an attempt or a firing ended (its finish), and queue the retry the
store asks for.

The finish round trip is retried a few times if the connection drops; if it never gets
through, the lease expires and a backup takes over (so a dead run still settles). A
finish without the attempt's token in the state (its lease was lost) changes nothing
and says so in a warning. A timer's finish also writes what follows the firing: the
rearm its handler asked for, or a recurring timer's next due time.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from .._model.clock import wall_ms
from .._model.job import Job
from .._model.schedule import iso_ms
from .._model.timer import Recurrence, TimerKind
from .._observe.events import JobPaused, RunRetried, TimerFired, instant, run_finished
from .._store.audit import PAUSED_BY_FAILURES, record_audit
from .._store.coalesce import pipeline
from .._store.contract import AttemptEnd, ClaimReply, FinishReply, Outcome, Store
from .._store.keys import RunGivenBack, TimerKeys, hint_channel
from .._store.timers import (
    FleetLimits,
    TimerEnd,
    TimerFinishReply,
    TimerOutcome,
    TimerStore,
    TimerWin,
)
from ..clients import ServerReplyError, is_transient
from .agenda import Agenda
from .context import EngineContext
from .work import Attempt, Firing, Leased, attempts_for

__all__ = ["Settler"]

log = logging.getLogger("anarchon")

R = TypeVar("R")


class Settler:
    """Finishes attempts in the store; a retry the store schedules goes on the agenda."""

    def __init__(
        self, context: EngineContext, store: Store, timer_store: TimerStore, agenda: Agenda
    ) -> None:
        self._context = context
        self._store = store
        self._timer_store = timer_store
        self._agenda = agenda

    async def release(self, job: Job, slot_id: str, token: str, won: ClaimReply) -> None:
        """Give back an attempt won but never started (the scheduler is stopping): it is
        finished as cancelled, so a backup runs it at once instead of after the lease."""
        store = self._store
        now_ms = int(wall_ms())
        end = AttemptEnd(
            job=job.name,
            slot_id=slot_id,
            token=token,
            attempt=won.attempt,
            trigger=won.trigger,
            fence=won.fence,
            started_ms=now_ms,
            finished_ms=now_ms,
            outcome="cancelled",
            error="released unstarted: the scheduler stopped",
            max_attempts=attempts_for(job, slot_id),
            retry_delay_ms=0,
            fleet=job.max_concurrent_fleet is not None,
        )
        reply = None
        with anyio.move_on_after(self._context.round_trip_sec):
            try:
                reply = await store.finish(end)
            except Exception as exc:
                self._context.health.failed(f"releasing a claim of {job.name}", exc)
        if reply is not None and reply.held and reply.status == "retry":
            await self._announce_release(job, slot_id)

    async def _announce_release(self, job: Job, slot_id: str) -> None:
        """Tell the backups of a run given back by this stopping instance to claim it now
        (``_engine/hints.py``); without the hint, they claim it when the lease they knew
        of would have run out."""
        store = self._store
        channel = hint_channel(self._context.prefix)
        with anyio.move_on_after(self._context.round_trip_sec):
            try:
                # Through the coalescer: the runs a stop gives back together share a trip.
                (reply,) = await pipeline(
                    store.conn, [("PUBLISH", channel, RunGivenBack(slot_id, job.name).message())]
                )
                if isinstance(reply, ServerReplyError):
                    raise reply
            except Exception as exc:
                self._context.health.failed(f"announcing a run of {job.name} given back", exc)

    async def release_firing(self, kind: TimerKind, keys: TimerKeys, win: TimerWin) -> None:
        """Give back a firing won but never started (the scheduler is stopping): finished
        as cancelled, it is not counted as an attempt, and a backup fires it at once."""
        timer_store = self._timer_store
        end = TimerEnd(
            kind.name,
            win.key,
            win.token,
            "cancelled",
            kind.max_attempts,
            0,
            limits=FleetLimits.of(kind),
        )
        with anyio.move_on_after(self._context.round_trip_sec):
            try:
                await timer_store.finish(end, keys)
            except Exception as exc:
                self._context.health.failed(f"releasing a firing of {kind.name}", exc)

    async def settle_attempt(self, attempt: Attempt, outcome: Outcome, error: str | None) -> None:
        """Record how the attempt ended; retried a few times if the connection drops.
        Without its token in the state (lease lost) the store changes nothing."""
        store = self._store
        job = attempt.job
        run = attempt.run
        end = AttemptEnd(
            job=job.name,
            slot_id=attempt.slot_id,
            token=attempt.token,
            attempt=run.attempt,
            trigger=run.trigger,
            fence=run.fence,
            started_ms=attempt.started_ms,
            finished_ms=int(wall_ms()),
            outcome=outcome,
            error=error,
            # A failure retry_on does not name is the run's last attempt.
            max_attempts=attempt.max_attempts
            if outcome != "failed" or job.retries(attempt.failure)
            else run.attempt,
            retry_delay_ms=self._retry_delay_ms(job) * 2 ** (run.attempt - 1),
            fleet=job.max_concurrent_fleet is not None,
            pause_after=job.pause_after_failures or 0,
        )
        reply, _ = await self._send(job.name, lambda: store.finish(end))
        if reply is None:
            self._could_not_record(attempt)
            return
        if not reply.held:
            self._lost(attempt, outcome)
            return
        _log_ended(attempt, end, reply)
        if reply.paused:
            await self._paused_by_failures(job)
        events = self._context.events
        if events.on:
            retried = reply.status == "retry"
            events.emit(
                run_finished(
                    run.runner,
                    instant(wall_ms()),
                    run,
                    outcome,
                    end.finished_ms - end.started_ms,
                    error,
                    retried,
                )
            )
            if retried:
                events.emit(
                    RunRetried(
                        instance=run.runner,
                        job=job.name,
                        slot_ms=run.slot_ms,
                        attempt=run.attempt,
                        in_ms=reply.retry_in_ms,
                    )
                )
        if reply.status == "retry" and self._context.state == "running":
            self._agenda.push_follow_up(
                job, attempt.slot_id, "retry", wall_ms() + reply.retry_in_ms
            )
        elif reply.status == "retry" and reply.retry_in_ms == 0:
            await self._announce_release(job, attempt.slot_id)  # given back by a stop

    async def _paused_by_failures(self, job: Job) -> None:
        """This finish paused ``job`` (its ``pause_after_failures`` slots in a row
        finally failed): said once, here, in the log, the events and the audit log."""
        count = job.pause_after_failures
        note = f"its last {count} slots finally failed (pause_after_failures={count})"
        log.error(
            "%s: paused: %s; resume it (anarchon resume %s) once it can run",
            job.name,
            note,
            job.name,
            extra={"job": job.name},
        )
        if self._context.events.on:
            self._context.events.emit(
                JobPaused(instance=self._context.instance_id, job=job.name, reason=note)
            )
        store = self._store
        await record_audit(
            store.conn, store.prefix, "pause", job.name, PAUSED_BY_FAILURES, note,
            within_sec=self._context.round_trip_sec,
        )  # fmt: skip

    def _retry_delay_ms(self, job: Job) -> int:
        return self._context.retry_delay_ms if job.retry_delay_ms is None else job.retry_delay_ms

    async def settle_firing(self, firing: Firing, outcome: Outcome) -> None:
        """Record how the firing ended (and what follows it: a rearm, the next
        recurrence, a retry), as ``settle_attempt`` records an attempt."""
        fire = firing.run
        timer_outcome: TimerOutcome = outcome
        if (
            outcome == "cancelled"
            and firing.began
            and (firing.lost or self._context.state == "running")
        ):
            # A firing that never began, or one a stop cancelled, is given back
            # uncounted; one whose handler ran and was cancelled because its lease could
            # not be kept (or gave up by itself) spent an attempt.
            timer_outcome = "failed"
        next_at_ms: int | None = None
        next_delay_ms: int | None = None
        rearmed = fire.rearmed
        if outcome == "ok" and rearmed is not None:
            next_at_ms, next_delay_ms = rearmed
        elif firing.recurrence is not None:
            # Sent whatever the outcome: the store ignores it when the firing is retried.
            next_at_ms = self._next_due_ms(firing.kind, fire.key, firing.recurrence, fire.due_ms)
        reply = await self._finish_firing(
            firing.kind,
            firing.keys,
            fire.key,
            firing.token,
            timer_outcome,
            fire.attempt,
            next_at_ms,
            next_delay_ms,
        )
        if reply[0] is not None and reply[0].held:
            _log_fired(firing, outcome, reply[0])
            events = self._context.events
            if events.on:
                events.emit(
                    TimerFired(
                        instance=fire.runner,
                        run=fire,
                        outcome=outcome,
                        duration_ms=wall_ms() - firing.started_ms,
                        retried=reply[0].status == "retry",
                    )
                )
        self._firing_settled(firing.kind, firing.keys, firing.describe(), outcome, reply)

    def _firing_settled(
        self,
        kind: TimerKind,
        keys: TimerKeys,
        what: str,
        outcome: str,
        sent: tuple[TimerFinishReply | None, bool],
    ) -> None:
        reply, retried = sent
        if reply is None:
            log.error(
                "%s: could not record the result; the lease will expire and a backup will "
                "take over",
                what,
            )
        elif not reply.held:
            if retried:
                # A try whose reply was lost may have recorded it: the firing moved on.
                log.info("%s: its result (%s) was recorded, or its lease was lost", what, outcome)
            else:
                log.warning(
                    "%s ended after losing its lease; its result (%s) was not recorded",
                    what,
                    outcome,
                )
        elif reply.status in ("retry", "pending") and self._context.state == "running":
            self._agenda.timer_due(kind.name, keys, wall_ms() + reply.in_ms)

    def _next_due_ms(
        self, kind: TimerKind, key: str, recurrence: Recurrence, due_ms: int
    ) -> int | None:
        """A recurring timer's next due time, on the server's clock (as this instance
        reckons it from its last claim); None, loudly, if it cannot be reckoned here."""
        try:
            return recurrence.next_ms(due_ms, int(wall_ms() + self._context.server_offset_ms))
        except Exception as exc:
            log.error(
                "timer %s %r: its next due time (%s) cannot be reckoned here (%s: %s); it "
                "does not recur",
                kind.name,
                key,
                recurrence.describe(),
                type(exc).__name__,
                exc,
            )
            return None

    async def settle_lapsed(self, kind: TimerKind, keys: TimerKeys, win: TimerWin) -> None:
        """A recurring timer out of attempts (its runners died): nothing runs; it is
        finished as interrupted with its next due time, so it goes on recurring."""
        log.warning(
            "timer %s %r: its firing due at %s was interrupted %d time(s), as many as "
            "max_attempts; it recurs at its next due time",
            kind.name,
            win.key,
            iso_ms(win.due_ms),
            win.attempt,
        )
        next_ms: int | None = None
        try:
            recurrence = Recurrence.decode(win.schedule)
        except Exception as exc:
            log.error(
                "timer %s %r: its recurrence cannot be read here: %s", kind.name, win.key, exc
            )
        else:
            if recurrence is not None:
                next_ms = self._next_due_ms(kind, win.key, recurrence, win.due_ms)
        sent = await self._finish_firing(
            kind, keys, win.key, win.token, "interrupted", win.attempt, next_ms, None
        )
        self._firing_settled(kind, keys, f"timer {kind.name} {win.key!r}", "interrupted", sent)

    async def fail_firing(self, kind: TimerKind, keys: TimerKeys, win: TimerWin) -> None:
        """A firing that cannot even start here (its payload or recurrence cannot be read):
        the attempt counts as failed; retried while attempts are left, then over."""
        sent = await self._finish_firing(
            kind, keys, win.key, win.token, "failed", win.attempt, None, None
        )
        self._firing_settled(kind, keys, f"timer {kind.name} {win.key!r}", "failed", sent)

    async def _finish_firing(
        self,
        kind: TimerKind,
        keys: TimerKeys,
        key: str,
        token: str,
        outcome: TimerOutcome,
        attempt: int,
        next_at_ms: int | None,
        next_delay_ms: int | None,
    ) -> tuple[TimerFinishReply | None, bool]:
        timer_store = self._timer_store
        retry_delay_ms = (
            self._context.retry_delay_ms if kind.retry_delay_ms is None else kind.retry_delay_ms
        )
        end = TimerEnd(
            kind.name,
            key,
            token,
            outcome,
            kind.max_attempts,
            retry_delay_ms * 2 ** (attempt - 1),
            next_at_ms,
            next_delay_ms,
            FleetLimits.of(kind),
        )
        return await self._send(kind.name, lambda: timer_store.finish(end, keys))

    async def _send(self, name: str, finish: Callable[[], Awaitable[R]]) -> tuple[R | None, bool]:
        """A finish's round trip, sent again after a failure with a growing pause (which
        a stop ends: one last try, then the lease expires for a backup). The reply (None
        if none got through), and whether a try failed before it."""
        context = self._context
        retried = False
        for wait_sec in (0.0, 0.2, 0.5, 1.0, 2.0, 5.0):
            if wait_sec:  # (a scope that expires at once costs more than the round trip)
                with anyio.move_on_after(wait_sec):
                    await context.stopping.wait()
            failure: BaseException | str = "no reply in time"
            reply: R | None = None
            with anyio.move_on_after(context.round_trip_sec):
                try:
                    reply = await finish()
                except Exception as exc:
                    failure = exc
            if reply is None:
                retried = True
                context.health.failed(f"recording a result of {name}", failure)
                if context.state != "running" or (
                    isinstance(failure, BaseException) and not is_transient(failure)
                ):
                    break  # stopping: one try, then the lease expires for a backup
                continue
            context.health.answered()
            return reply, retried
        return None, retried

    @staticmethod
    def _lost(leased: Leased, outcome: str) -> None:
        log.error(
            "%s ended after losing its lease; its result (%s) was not recorded",
            leased.describe(),
            outcome,
        )

    @staticmethod
    def _could_not_record(leased: Leased) -> None:
        log.error(
            "%s: could not record the result; the lease will expire and a backup will take over",
            leased.describe(),
        )


def _log_ended(attempt: Attempt, end: AttemptEnd, reply: FinishReply) -> None:
    """One line per attempt, once recorded: INFO when it went well or was given back
    for another attempt, WARNING for a failure that is retried, ERROR for a run that
    ends failed or cancelled. The run's fields go in ``extra`` (the slot as epoch ms)."""
    if end.outcome == "ok" and not log.isEnabledFor(logging.INFO):
        return  # the common line, with INFO off: nothing to make
    run = attempt.run
    duration_ms = end.finished_ms - end.started_ms
    extra = {
        "job": run.job,
        "slot_ms": run.slot_ms,
        "attempt": run.attempt,
        "runner": run.runner,
        "fence": run.fence,
        "trigger": run.trigger,
        "outcome": end.outcome,
        "duration_ms": duration_ms,
    }
    what = attempt.describe()
    seconds = duration_ms / 1000
    last = reply.status != "retry"
    if end.outcome == "ok":
        log.info("%s: ok in %.3f s", what, seconds, extra=extra)
    elif end.outcome == "failed" and not last:
        log.warning(
            "%s failed after %.3f s; attempt %d of %d, retried in %.1f s: %s",
            what,
            seconds,
            run.attempt,
            end.max_attempts,
            reply.retry_in_ms / 1000,
            end.error,
            exc_info=attempt.failure,
            extra=extra,
        )
    elif end.outcome == "failed" and end.max_attempts < attempt.max_attempts:
        log.error(
            "%s failed after %.3f s, not retried (retry_on does not name it): the run failed: %s",
            what,
            seconds,
            end.error,
            exc_info=attempt.failure,
            extra=extra,
        )
    elif end.outcome == "failed":
        log.error(
            "%s failed after %.3f s, its last attempt (%d of %d): the run failed: %s",
            what,
            seconds,
            run.attempt,
            end.max_attempts,
            end.error,
            exc_info=attempt.failure,
            extra=extra,
        )
    elif not last:
        log.info(
            "%s cancelled after %.3f s; given back for attempt %d",
            what,
            seconds,
            run.attempt + 1,
            extra=extra,
        )
    else:
        log.error(
            "%s cancelled after %.3f s, its last attempt (%d of %d): the run is cancelled",
            what,
            seconds,
            run.attempt,
            end.max_attempts,
            extra=extra,
        )


def _log_fired(firing: Firing, outcome: Outcome, reply: TimerFinishReply) -> None:
    """One line per firing, once recorded, at the levels of ``_log_ended``."""
    fire = firing.run
    duration_ms = int(wall_ms()) - firing.started_ms
    extra = {
        "timer_kind": fire.kind,
        "timer_key": fire.key,
        "due_ms": fire.due_ms,
        "attempt": fire.attempt,
        "runner": fire.runner,
        "fence": fire.fence,
        "outcome": outcome,
        "duration_ms": duration_ms,
    }
    what = firing.describe()
    seconds = duration_ms / 1000
    retried = reply.status == "retry"
    if outcome == "ok":
        log.info("%s: ok in %.3f s", what, seconds, extra=extra)
    elif outcome == "failed" and retried:
        log.warning(
            "%s failed after %.3f s; attempt %d of %d, retried in %.1f s",
            what,
            seconds,
            fire.attempt,
            firing.kind.max_attempts,
            reply.in_ms / 1000,
            exc_info=firing.failure,
            extra=extra,
        )
    elif outcome == "failed":
        log.error(
            "%s failed after %.3f s, its last attempt (%d of %d)",
            what,
            seconds,
            fire.attempt,
            firing.kind.max_attempts,
            exc_info=firing.failure,
            extra=extra,
        )
    elif retried:
        log.info("%s cancelled after %.3f s; given back", what, seconds, extra=extra)
    else:
        log.error("%s cancelled after %.3f s, with no attempt left", what, seconds, extra=extra)
