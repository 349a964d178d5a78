"""A manual run (``Scheduler.run_now``): claimed with a slot id of its own, run here as
one attempt, waited for, and read back from the store."""

from __future__ import annotations

import random
import secrets
from typing import NoReturn

import anyio

from .._errors import (
    AnarchonError,
    ConnectionFailedError,
    RunOverlapError,
    SchedulerStateError,
    reason,
)
from .._model.clock import monotonic, wall_ms
from .._model.job import Job
from .._model.schedule import from_epoch_ms
from .._model.values import RunResult
from .._store.contract import ClaimReply, ClaimRequest, Store, manual_slot_id
from ..clients import ServerReplyError, is_transient
from .agenda import CLAIM_RETRY_MS, new_token
from .claimer import Claimer
from .context import EngineContext
from .runner import Runner
from .settle import Settler
from .work import Attempt, attempts_for

__all__ = ["ManualRuns", "claim_in_time"]

#: run_now's manual claim pauses as a failed claim does, for its first three tries only:
#: the caller waits for an answer.
_MANUAL_RETRY_MS = CLAIM_RETRY_MS[:3]


class ManualRuns:
    """Runs ``run_now``'s manual runs on a running instance."""

    def __init__(
        self,
        context: EngineContext,
        store: Store,
        claimer: Claimer,
        runner: Runner,
        settler: Settler,
    ) -> None:
        self._context = context
        self._store = store
        self._claimer = claimer
        self._runner = runner
        self._settler = settler

    async def run_now(self, job: Job) -> RunResult:
        """Run ``job`` here now and return its result (``Scheduler.run_now`` says how)."""
        context, store = self._context, self._store
        requested_ms = int(wall_ms())
        slot_id = manual_slot_id(requested_ms, secrets.token_hex(4))
        request = self._request(job, slot_id, requested_ms)
        reply, attempt = await self.claim_here(job, request, "manual claim")
        if attempt is None:
            self._refuse(job, reply)
        await attempt.settled.wait()
        try:
            with anyio.fail_after(context.round_trip_sec):
                return await store.result_of(job.name, slot_id, attempt.run.attempt)
        except (LookupError, TimeoutError):
            # The lease was lost and nobody recorded the attempt (or the server did not
            # answer in time).
            now = from_epoch_ms(int(wall_ms()))
            run = attempt.run
            return RunResult(
                job=run.job,
                slot=run.slot,
                slot_ms=run.slot_ms,
                attempt=run.attempt,
                trigger=run.trigger,
                runner=run.runner,
                status="interrupted",
                started_at=now,
                finished_at=now,
                error="the lease was lost before the result was recorded",
                fence=run.fence,
            )

    async def claim_here(
        self, job: Job, request: ClaimRequest, what: str
    ) -> tuple[ClaimReply, Attempt | None]:
        """A claim someone waits for (``run_now``, a backfilled slot), under the
        instance's bound and the job's own, as any run here: it waits for room, holds it
        while the claim is in flight (sent again as ``claim_in_time`` says), hands the
        orphans it heard of to backups, and starts a won attempt here. The attempt is
        None when the claim was not won (its reply says why); ``SchedulerStateError``
        when the stop began first (a win is given back)."""
        context = self._context
        capacity, owner = context.capacity, ("job", job.name)
        await capacity.wait(owner, job.max_concurrent)
        if context.state != "running":
            raise SchedulerStateError(
                f"the scheduler stopped before the {what} of {job.name!r} could start"
            )
        capacity.reserve(1, owner)
        try:
            reply, sent = await claim_in_time(context, self._store, job, request, what)
            for orphan in reply.orphans:
                self._claimer.take_over(job, orphan, wall_ms())
            if reply.kind != "won":
                return reply, None
            if context.state != "running":
                # The stop began while the claim was in flight: give the win back.
                await self._settler.release(job, request.slot_id, request.token, reply)
                raise SchedulerStateError(
                    f"the scheduler stopped before the {what} of {job.name!r} could start"
                )
            attempt = self._runner.start_attempt(job, request.slot_id, request.token, reply, sent)
            return reply, attempt
        finally:
            capacity.unreserve(1, owner)

    def _request(self, job: Job, slot_id: str, requested_ms: int) -> ClaimRequest:
        lease_ms = self._context.lease_ms
        return ClaimRequest(
            job=job.name,
            slot_id=slot_id,
            slot_ms=requested_ms,
            token=new_token(),
            trigger="manual",
            lease_ms=lease_ms,
            max_attempts=attempts_for(job, slot_id),
            allow_overlap=job.overlap,
            keep_ms=job.keep_ms(lease_ms),
            fleet_max=job.max_concurrent_fleet,
            max_runs=job.max_runs,
        )

    def _refuse(self, job: Job, reply: ClaimReply) -> NoReturn:
        """Why a manual claim was not won, raised (``RunOverlapError``)."""
        if reply.kind == "done" and reply.status == "finished":
            self._context.finish(job.name, f"its runs reached its max_runs ({job.max_runs})")
            raise RunOverlapError(
                f"{job.name!r} is finished: its runs in the fleet reached its max_runs "
                f"({job.max_runs}); raise max_runs to run it again"
            )
        if reply.kind == "overlap" and reply.status == "fleet":
            raise RunOverlapError(
                f"{job.name!r} has as many runs in the fleet as its max_concurrent_fleet "
                f"({job.max_concurrent_fleet}) allows; the soonest permit is free in "
                f"{reply.wait_ms} ms at the latest: try again once one of them ends"
            )
        if reply.kind == "overlap":
            here = any(name == job.name for name, _ in self._context.attempts)
            where = "on this instance" if here else "elsewhere"
            raise RunOverlapError(
                f"{job.name!r} has a run that is not settled yet ({where}; "
                f"{reply.wait_ms} ms left on its lease or retry delay) and does not allow "
                "overlapping runs: wait for it to end, or define the job with overlap=True"
            )
        # A fresh slot id has no state: only won or overlap.
        raise AnarchonError(f"unexpected reply to a manual claim of {job.name!r}: {reply}")


async def claim_in_time(
    context: EngineContext, store: Store, job: Job, request: ClaimRequest, what: str
) -> tuple[ClaimReply, float]:
    """A claim someone waits for (a manual run, a backfilled slot): sent again with its
    token after a failure or a transient error reply (a lost reply's claim may have won:
    the repeat says so), a few times with short pauses; then the server counts as
    unreachable (``ConnectionFailedError``).

    Returns the reply and when its try was sent: a repeat's reply says how much of
    the lease is left at the server, so the lease is counted from the try that
    answered, not from the first (whose tries may have taken longer than a lease
    while the server was out of reach)."""
    failure: BaseException | str = "no reply in time"
    round_trip_sec = context.round_trip_sec
    for pause_ms in (*_MANUAL_RETRY_MS, None):
        sent = monotonic()
        with anyio.move_on_after(round_trip_sec):
            try:
                return await store.claim_manual(request), sent
            except ServerReplyError as exc:
                if not is_transient(exc):
                    # The server's answer, its kind kept (NOPERM, WRONGTYPE, ...).
                    raise ServerReplyError(
                        f"the server refused the {what} of {job.name!r}: {reason(exc)}",
                        kind=exc.kind,
                    ) from exc
                failure = exc
            except Exception as exc:
                failure = exc
        if pause_ms is None:
            break
        await anyio.sleep(pause_ms / 1000 * random.uniform(0.8, 1.2))
    raise ConnectionFailedError(
        f"the {what} of {job.name!r} got no answer in "
        f"{len(_MANUAL_RETRY_MS) + 1} tries (each within {round_trip_sec:.2f} s; last: "
        f"{reason(failure)}); is the server reachable? If a try did reach it, the run's lease "
        "expires unused and the job's next slots wait for it"
    )
