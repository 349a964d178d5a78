"""A manual run (``Scheduler.run_now``): claimed with a slot id of its own, run here as
one attempt, waited for, and read back from the store."""

from __future__ import annotations

import secrets
import time

import anyio

from .._errors import SchedulerStateError
from .._model.job import Job
from .._model.schedule import from_epoch_ms
from .._model.values import RunResult
from .._store.contract import ClaimReply, RecordingStore, Store, manual_slot_id
from ._context import EngineContext, _now_ms
from .claimer import Claimer
from .runner import Runner
from .settle import Settler

__all__ = ["run_now"]


async def run_now(
    context: EngineContext,
    store: Store,
    claimer: Claimer,
    runner: Runner,
    settler: Settler,
    job: Job,
) -> RunResult:
    """Run ``job`` here now, on a running instance's ``store``, and return its result
    (``Scheduler.run_now`` says how)."""
    requested_ms = int(_now_ms())
    slot_id = manual_slot_id(requested_ms, secrets.token_hex(4))
    token = secrets.token_hex(8)
    if isinstance(store, RecordingStore):
        # No lease to claim: the store records the run, which runs here.
        claim_sent = time.monotonic()
        fence = await store.begin_manual(job.name, slot_id, token)
        reply = ClaimReply("won", attempt=1, fence=fence, trigger="manual")
    else:
        reply, claim_sent = await claimer.claim_manual(job, slot_id, requested_ms, token)
    if context.state != "running":
        # The stop began while the manual claim was in flight: give the win back.
        await settler.release(job, slot_id, token, reply)
        raise SchedulerStateError("the scheduler stopped before run_now() could start")
    attempt = runner.start_attempt(job, slot_id, token, reply, claim_sent)
    await attempt.settled.wait()
    try:
        with anyio.fail_after(context.round_trip_sec):
            return await store.result_of(job.name, slot_id, attempt.run.attempt)
    except (LookupError, TimeoutError):
        # The lease was lost and nobody recorded the attempt (or the server did not
        # answer in time).
        now = from_epoch_ms(int(_now_ms()))
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
