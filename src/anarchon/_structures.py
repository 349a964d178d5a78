"""Value types that handlers and readers of history see."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from ._errors import LeaseLostError

__all__ = ["OverlapPolicy", "Run", "RunResult", "RunStatus", "Trigger"]

Trigger = Literal["schedule", "catch-up", "retry", "manual"]
#: How an attempt ended; ``skipped``: the slot did not run at all (``attempt`` 0,
#: ``error`` says why, e.g. an older run of the job was not settled yet).
RunStatus = Literal["ok", "failed", "interrupted", "cancelled", "skipped"]
#: What a slot does while an older run of its job is unsettled: ``skip`` it (recorded
#: as skipped), ``wait`` for that run to end (at most one slot waits), or ``allow``
#: it to run at once, side by side.
OverlapPolicy = Literal["skip", "wait", "allow"]


@dataclass(frozen=True, slots=True)
class Run:
    """One attempt at one slot of a job, as the handler sees it.

    A handler that declares a parameter receives it::

        @scheduler.job("*/5 * * * *")
        async def sync(run: Run) -> None:
            print(run.job, run.slot, run.attempt, run.fence)

    ``fence`` grows with every win of the job, across all instances: stores
    that the handler writes to can reject a write that carries a smaller
    fence than one they have already seen (a stale runner).

    ``lease_lost`` is set when this attempt no longer holds its lease (a
    heartbeat was refused, none got through in time, or the scheduler is
    stopping). Async handlers are cancelled instead; a plain function running in
    a worker thread cannot be, so it should check between steps, most simply
    with ``run.raise_if_lost()``::

        @scheduler.job("0 * * * *")
        def export(run: Run) -> None:
            for batch in batches():
                run.raise_if_lost()
                write(batch, fence=run.fence)

    An attempt whose handler returns after ``lease_lost`` was set is recorded as
    cancelled, not ok (it stopped early), and is retried while attempts are left.
    """

    job: str
    slot: datetime
    slot_ms: int
    attempt: int
    trigger: Trigger
    runner: str
    fence: int
    lease_lost: threading.Event = field(default_factory=threading.Event, compare=False)

    def raise_if_lost(self) -> None:
        """Raise ``LeaseLostError`` if this attempt no longer holds its lease."""
        if self.lease_lost.is_set():
            raise LeaseLostError(
                f"{self.job} slot {self.slot_ms} attempt {self.attempt} no longer holds its "
                "lease (another attempt may run, or the scheduler is stopping): stop here"
            )


@dataclass(frozen=True, slots=True)
class RunResult:
    """How one attempt at a slot ended, as recorded in the store's history."""

    job: str
    slot: datetime
    slot_ms: int
    attempt: int
    trigger: Trigger
    runner: str
    status: RunStatus
    started_at: datetime
    finished_at: datetime
    error: str | None
    fence: int
