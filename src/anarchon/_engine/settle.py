"""Settle: record how an attempt ended (its finish), and queue the retry the store asks for.

The finish round trip is retried a few times if the connection drops; if it never gets
through, the lease expires and a backup takes over (so a dead run still settles). A
finish without the attempt's token in the state (its lease was lost) changes nothing
and says so in a warning.
"""

from __future__ import annotations

import logging

import anyio

from .._job import Job
from .._store import AttemptEnd, ClaimReply, Outcome
from ..clients import is_transient
from ._context import EngineContext, _Attempt, _attempts_for, _now_ms
from .agenda import Agenda

__all__ = ["Settler"]

log = logging.getLogger("anarchon")


class Settler:
    """Finishes attempts in the store; a retry the store schedules goes on the agenda."""

    def __init__(self, context: EngineContext, agenda: Agenda) -> None:
        self._context = context
        self._agenda = agenda

    async def release(self, job: Job, slot_id: str, token: str, won: ClaimReply) -> None:
        """Give back an attempt won but never started (the scheduler is stopping): it is
        finished as cancelled, so a backup runs it at once instead of after the lease."""
        store = self._context.store
        assert store is not None
        now_ms = int(_now_ms())
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
            max_attempts=_attempts_for(job, slot_id),
            retry_delay_ms=0,
        )
        with anyio.move_on_after(self._context.round_trip_sec):
            try:
                await store.finish(end)
            except Exception as exc:
                self._context.health.failed(f"releasing a claim of {job.name}", exc)

    async def settle(self, attempt: _Attempt, outcome: Outcome, error: str | None) -> None:
        """Record how the attempt ended; retried a few times if the connection drops.
        Without its token in the state (lease lost) the store changes nothing."""
        store = self._context.store
        assert store is not None
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
            finished_ms=int(_now_ms()),
            outcome=outcome,
            error=error,
            max_attempts=attempt.max_attempts,
            retry_delay_ms=self._context.retry_delay_ms * 2 ** (run.attempt - 1),
        )
        context = self._context
        for wait_sec in (0.0, 0.2, 0.5, 1.0, 2.0, 5.0):
            # A stop ends the backoff: one last try, then the lease expires for a backup.
            with anyio.move_on_after(wait_sec):
                await context.stopping.wait()
            failure: BaseException | str = "no reply in time"
            reply = None
            with anyio.move_on_after(context.round_trip_sec):
                try:
                    reply = await store.finish(end)
                except Exception as exc:
                    failure = exc
            if reply is None:
                context.health.failed(f"recording a result of {job.name}", failure)
                if context.state != "running" or (
                    isinstance(failure, BaseException) and not is_transient(failure)
                ):
                    break  # stopping: one try, then the lease expires for a backup
                continue
            context.health.answered()
            if not reply.held:
                log.warning(
                    "%s slot %s attempt %d ended after losing its lease; its result "
                    "(%s) was not recorded",
                    job.name,
                    attempt.slot_id,
                    attempt.run.attempt,
                    outcome,
                )
            elif reply.status == "retry" and context.state == "running":
                self._agenda.push_follow_up(
                    job, attempt.slot_id, "retry", _now_ms() + reply.retry_in_ms
                )
            return
        log.error(
            "%s slot %s attempt %d: could not record the result; the lease will expire "
            "and a backup will take over",
            job.name,
            attempt.slot_id,
            attempt.run.attempt,
        )
