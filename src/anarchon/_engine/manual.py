"""A manual run (``Scheduler.run_now``): claimed with a slot id of its own, run here as
one attempt, waited for, and read back from the store."""

from __future__ import annotations

import random
import secrets
import time

import anyio

from .._errors import (
    AnarchonError,
    ConnectionFailedError,
    RunOverlapError,
    SchedulerStateError,
    reason,
)
from .._model.clock import wall_ms
from .._model.job import Job
from .._model.schedule import from_epoch_ms
from .._model.values import RunResult
from .._store.contract import ClaimReply, ClaimRequest, Store, manual_slot_id
from ..clients import ServerReplyError, is_transient
from .agenda import CLAIM_RETRY_MS
from .claimer import Claimer
from .context import EngineContext
from .runner import Runner
from .settle import Settler
from .work import attempts_for

__all__ = ["ManualRuns"]

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
        token = secrets.token_hex(8)
        # Under the instance's bound (and the job's own), as any run here: it waits for
        # room, then holds it while its claim is in flight.
        capacity, owner = context.capacity, ("job", job.name)
        await capacity.wait(owner, job.max_concurrent)
        if context.state != "running":
            raise SchedulerStateError("the scheduler stopped before run_now() could start")
        capacity.reserve(1, owner)
        try:
            reply, claim_sent = await self._claim(job, slot_id, requested_ms, token)
            if context.state != "running":
                # The stop began while the manual claim was in flight: give the win back.
                await self._settler.release(job, slot_id, token, reply)
                raise SchedulerStateError("the scheduler stopped before run_now() could start")
            attempt = self._runner.start_attempt(job, slot_id, token, reply, claim_sent)
        finally:
            capacity.unreserve(1, owner)
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

    async def _claim(
        self, job: Job, slot_id: str, requested_ms: int, token: str
    ) -> tuple[ClaimReply, float]:
        """Claim a ``run_now`` slot: won, with when the winning try was sent (monotonic;
        its reply's lease is counted from then), or refused with ``RunOverlapError``."""
        store = self._store
        lease_ms = self._context.lease_ms
        request = ClaimRequest(
            job=job.name,
            slot_id=slot_id,
            slot_ms=requested_ms,
            token=token,
            trigger="manual",
            lease_ms=lease_ms,
            max_attempts=attempts_for(job, slot_id),
            allow_overlap=job.overlap,
            keep_ms=job.keep_ms(lease_ms),
            fleet_max=job.max_concurrent_fleet,
            max_runs=job.max_runs,
        )
        reply, sent = await self._claim_with_retries(store, job, request)
        for orphan in reply.orphans:
            self._claimer.take_over(job, orphan, wall_ms())
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
        if reply.kind != "won":  # a fresh slot id has no state: only won or overlap
            raise AnarchonError(f"unexpected reply to a manual claim of {job.name!r}: {reply}")
        return reply, sent

    async def _claim_with_retries(
        self, store: Store, job: Job, request: ClaimRequest
    ) -> tuple[ClaimReply, float]:
        """The manual claim's round trip, sent again with its token after a failure or a
        transient error reply (a lost reply's claim may have won: the repeat says so),
        a few times with short pauses; then the server counts as unreachable.

        Returns the reply and when its try was sent: a repeat's reply says how much of
        the lease is left at the server, so the lease is counted from the try that
        answered, not from the first (whose tries may have taken longer than a lease
        while the server was out of reach)."""
        failure: BaseException | str = "no reply in time"
        round_trip_sec = self._context.round_trip_sec
        for pause_ms in (*_MANUAL_RETRY_MS, None):
            sent = time.monotonic()
            with anyio.move_on_after(round_trip_sec):
                try:
                    return await store.claim_manual(request), sent
                except ServerReplyError as exc:
                    if not is_transient(exc):
                        # The server's answer, its kind kept (NOPERM, WRONGTYPE, ...).
                        raise ServerReplyError(
                            f"the server refused the manual claim of {job.name!r}: {reason(exc)}",
                            kind=exc.kind,
                        ) from exc
                    failure = exc
                except Exception as exc:
                    failure = exc
            if pause_ms is None:
                break
            await anyio.sleep(pause_ms / 1000 * random.uniform(0.8, 1.2))
        raise ConnectionFailedError(
            f"the manual claim of {job.name!r} got no answer in "
            f"{len(_MANUAL_RETRY_MS) + 1} tries (each within {round_trip_sec:.2f} s; last: "
            f"{reason(failure)}); is the server reachable? If a try did reach it, the run's lease "
            "expires unused and the job's next slots wait for it"
        )
