"""The runner: starts the attempts this instance won and runs their handlers.

Each attempt is a task of the scheduler's task group, with a cancel scope of its own
(a lost lease or a stop cancels that handler alone), registered in
``context.attempts`` while it runs. However the handler ends, the attempt is settled
under a shield, leaves the registry, and claims waiting behind it come due. The runner
knows when none is left (idle), and cancels them all when the scheduler stops.
"""

from __future__ import annotations

import logging
import traceback

import anyio

from .._errors import LeaseLostError
from .._job import Job
from .._schedule import from_epoch_ms
from .._store import ClaimReply, Outcome, slot_ms_of
from .._structures import Run
from ._context import EngineContext, _Attempt, current_attempt
from .agenda import Agenda
from .lease_keeper import LeaseKeeper
from .settle import Settler

__all__ = ["Runner"]

log = logging.getLogger("anarchon")


class Runner:
    """Runs won attempts in the task group; settles each when it ends."""

    def __init__(
        self,
        context: EngineContext,
        agenda: Agenda,
        settler: Settler,
        lease_keeper: LeaseKeeper,
    ) -> None:
        self._context = context
        self._agenda = agenda
        self._settler = settler
        self._lease_keeper = lease_keeper
        self._idle = anyio.Event()
        self._idle.set()

    def start_attempt(
        self, job: Job, slot_id: str, token: str, reply: ClaimReply, claim_sent: float
    ) -> _Attempt:
        """Run an attempt this instance won. ``claim_sent`` is when the winning claim
        was sent (monotonic): the lease is counted from then, not from the reply."""
        group = self._context.group
        assert group is not None
        slot_ms = slot_ms_of(slot_id)
        run = Run(
            job=job.name,
            slot=from_epoch_ms(slot_ms),
            slot_ms=slot_ms,
            attempt=reply.attempt,
            trigger=reply.trigger,
            runner=self._context.instance_id,
            fence=reply.fence,
        )
        attempt = _Attempt(job, run, slot_id, token)
        self._lease_keeper.watch(attempt, reply.wait_ms, claim_sent)
        self._context.attempts[(job.name, slot_id)] = attempt
        if self._idle.is_set():
            self._idle = anyio.Event()
        group.start_soon(self._run_attempt, attempt, name=f"anarchon {job.name} {slot_id}")
        return attempt

    async def _run_attempt(self, attempt: _Attempt) -> None:
        outcome: Outcome = "cancelled"
        error: str | None = None
        current_attempt.set(attempt)
        try:
            with attempt.scope:
                try:
                    await attempt.job.invoke(attempt.run)
                    # A handler that returns once its lease is gone (a plain function
                    # checking run.lease_lost, e.g. on stop) stopped early: its run is
                    # released for a retry, not recorded as done.
                    outcome = "cancelled" if attempt.run.lease_lost.is_set() else "ok"
                except LeaseLostError:
                    outcome = "cancelled"
                except Exception as exc:
                    outcome = "failed"
                    error = "".join(traceback.format_exception_only(exc)).strip()
                    log.warning(
                        "%s slot %s attempt %d failed: %s",
                        attempt.job.name,
                        attempt.slot_id,
                        attempt.run.attempt,
                        error,
                        exc_info=exc,
                    )
            if attempt.scope.cancelled_caught:
                outcome = "cancelled"
        finally:
            attempt.ended = True
            with anyio.CancelScope(shield=True):
                try:
                    await self._settler.settle(attempt, outcome, error)
                finally:
                    del self._context.attempts[(attempt.job.name, attempt.slot_id)]
                    attempt.settled.set()
                    self._agenda.run_ended(attempt.job)
                    if not self._context.attempts:
                        self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no attempt runs here."""
        await self._idle.wait()

    def cancel_all(self, reason: str) -> None:
        """Cancel every running attempt (their leases are released as they settle)."""
        for attempt in list(self._context.attempts.values()):
            attempt.cancel(reason)
