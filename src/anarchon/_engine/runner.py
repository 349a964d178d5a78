"""The runner: starts the attempts (of jobs) and firings (of timers) this instance won and
runs their handlers.

Each is a task of the scheduler's task group, with a cancel scope of its own (a lost
lease or a stop cancels that handler alone), registered in ``context.attempts`` while it
runs. However the handler ends, it is settled under a shield and leaves the registry,
and a job's claims waiting behind it come due. The runner knows when none is left
(idle), and cancels them all when the scheduler stops.
"""

from __future__ import annotations

import logging
import traceback
from functools import partial

import anyio
from anyio.abc import TaskGroup

from .._errors import LeaseLostError
from .._model.clock import monotonic
from .._model.job import Job
from .._model.schedule import from_epoch_ms
from .._model.timer import Recurrence, TimerKind
from .._model.values import Run, TimerRun
from .._store.contract import ClaimReply, Outcome, slot_ms_of
from .._store.keys import TimerKeys
from .._store.timers import TimerWin, decode_payload
from .agenda import Agenda
from .context import EngineContext
from .lease_keeper import LeaseKeeper
from .settle import Settler
from .work import Attempt, Firing, Leased, current_attempt

__all__ = ["Runner"]

log = logging.getLogger("anarchon")


class Runner:
    """Runs won attempts in the task group; settles each when it ends."""

    def __init__(
        self,
        context: EngineContext,
        group: TaskGroup,
        agenda: Agenda,
        settler: Settler,
        lease_keeper: LeaseKeeper,
    ) -> None:
        self._context = context
        self._group = group
        self._agenda = agenda
        self._settler = settler
        self._lease_keeper = lease_keeper
        self._idle = anyio.Event()
        self._idle.set()

    def start_attempt(
        self, job: Job, slot_id: str, token: str, reply: ClaimReply, claim_sent: float
    ) -> Attempt:
        """Run an attempt this instance won. ``claim_sent`` is when the winning claim
        was sent (monotonic): the lease is counted from then, not from the reply."""
        slot_ms = slot_ms_of(slot_id)
        run = Run(
            job=job.name,
            slot=from_epoch_ms(slot_ms),
            slot_ms=slot_ms,
            attempt=reply.attempt,
            trigger=reply.trigger,
            runner=self._context.instance_id,
            fence=reply.fence,
            progress=self._lease_keeper.progress_of(job, slot_id, reply.progress),
        )
        attempt = Attempt(job=job, run=run, slot_id=slot_id, token=token)
        run.keep_progress_with(partial(self._lease_keeper.save_progress, attempt))
        self._start(attempt, reply.wait_ms, claim_sent, f"anarchon {job.name} {slot_id}")
        return attempt

    def start_firing(
        self, kind: TimerKind, keys: TimerKeys, win: TimerWin, claim_sent: float
    ) -> Firing:
        """Run a firing of a key's timer this instance won (counted from ``claim_sent``)."""
        fire = TimerRun(
            kind=kind.name,
            key=win.key,
            payload=decode_payload(win.payload),
            due=from_epoch_ms(win.due_ms),
            due_ms=win.due_ms,
            generation=win.gen,
            attempt=win.attempt,
            trigger="due" if win.trigger == "lapsed" else win.trigger,
            runner=self._context.instance_id,
            fence=win.fence,
            progress=self._lease_keeper.firing_progress(kind.name, keys, win.key, win.progress),
        )
        firing = Firing(
            kind=kind,
            run=fire,
            keys=keys,
            token=win.token,
            recurrence=Recurrence.decode(win.schedule),
        )
        fire.keep_progress_with(partial(self._lease_keeper.save_progress, firing))
        self._start(firing, win.lease_left_ms, claim_sent, f"anarchon timer {kind.name}")
        return firing

    def _start(self, leased: Leased, lease_left_ms: int, since: float, name: str) -> None:
        self._lease_keeper.watch(leased, lease_left_ms, since)
        self._context.attempts[leased.registry_key] = leased
        self._context.capacity.started(leased.owner)
        if self._idle.is_set():
            self._idle = anyio.Event()
        self._group.start_soon(self._run, leased, name=name)

    async def _run(self, leased: Leased) -> None:
        outcome: Outcome = "cancelled"
        error: str | None = None
        current_attempt.set(leased)
        tracing = self._context.tracing
        trace = None if tracing is None else leased.trace(tracing)
        try:
            with leased.scope:
                try:
                    if not leased.lost and leased.ran_out(monotonic()):
                        # Its lease ran out before its task even began (a starved event
                        # loop; the lease keeper, starved too, has not seen it yet): a
                        # backup may run it already, so the handler must not.
                        self._lease_keeper.lose(
                            leased,
                            "its lease ran out before its handler began (the event loop "
                            "did not give it a turn in time); a backup may take over",
                        )
                    if leased.lease_lost.is_set():
                        raise LeaseLostError("the lease ran out before the handler began")
                    leased.began = True
                    leased.began_event(self._context.events)
                    if trace is None:
                        await self._invoke(leased)
                    else:
                        with trace.current():
                            await self._invoke(leased)
                    # A handler that returns once its lease is gone (a plain function
                    # checking run.lease_lost, e.g. on stop) stopped early: its run is
                    # released for a retry, not recorded as done.
                    outcome = "cancelled" if leased.lease_lost.is_set() else "ok"
                except LeaseLostError:
                    outcome = "cancelled"
                except Exception as exc:
                    outcome = "failed"
                    error = "".join(traceback.format_exception_only(exc)).strip()
                    leased.failure = exc  # logged with the run's end, once recorded
            if leased.scope.cancelled_caught:
                outcome = "cancelled"
        finally:
            leased.ended = True
            if trace is not None:
                trace.end(outcome, leased.failure)
            with anyio.CancelScope(shield=True):
                try:
                    await leased.settle_with(self._settler, outcome, error)
                finally:
                    del self._context.attempts[leased.registry_key]
                    leased.settled.set()
                    leased.ended_here(self._agenda)
                    self._context.capacity.ended(leased.owner)
                    if not self._context.attempts:
                        self._idle.set()

    async def _invoke(self, leased: Leased) -> None:
        """Call the handler; at its ``timeout_ms`` an async one is cancelled, and a plain
        function (which cannot be) is told through ``lease_lost``. Then the attempt
        raises ``TimeoutError``, however the handler ended; a handler that returned
        before either happened is done, even if the loop noticed late."""
        timeout_ms = leased.timeout_ms
        if timeout_ms is None:
            await leased.invoke()
            return
        timed_out = False
        with anyio.move_on_after(timeout_ms / 1000) as limit:
            telling = anyio.CancelScope()
            if not leased.is_async:
                self._group.start_soon(self._tell_at_timeout, leased, limit.deadline, telling)
            try:
                await leased.invoke()
            except Exception:
                if not (limit.cancel_called or leased.timed_out):
                    raise  # it failed before its time was up
                timed_out = True  # what it raised on its way out, once cancelled or told
            finally:
                telling.cancel()
        if timed_out or limit.cancelled_caught or leased.timed_out:
            raise TimeoutError(f"the handler ran longer than timeout_ms ({timeout_ms} ms)")

    @staticmethod
    async def _tell_at_timeout(leased: Leased, deadline: float, scope: anyio.CancelScope) -> None:
        """A plain function past its timeout is told through ``run.lease_lost``."""
        with scope:
            await anyio.sleep_until(deadline)
            log.warning(
                "%s ran past its timeout_ms (%d ms): it runs in a worker thread and cannot be "
                "interrupted; it sees run.lease_lost set, and is waited for",
                leased.describe(),
                leased.timeout_ms,
            )
            leased.timed_out = True
            leased.lease_lost.set()

    async def wait_idle(self) -> None:
        """Return once no attempt runs here."""
        await self._idle.wait()

    def cancel_all(self, reason: str) -> None:
        """Cancel every running attempt (their leases are released as they settle)."""
        for attempt in list(self._context.attempts.values()):
            attempt.cancel(reason)
