"""Value types that handlers and readers of history see."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

__all__ = ["Run", "RunResult", "RunStatus", "Trigger"]

Trigger = Literal["schedule", "catch-up", "retry", "manual"]
RunStatus = Literal["ok", "failed", "interrupted", "cancelled"]


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
    heartbeat was refused, or the scheduler is stopping and has released it).
    Async handlers are cancelled instead; a plain function running in a worker
    thread should check it between steps and return early.
    """

    job: str
    slot: datetime
    slot_ms: int
    attempt: int
    trigger: Trigger
    runner: str
    fence: int
    lease_lost: threading.Event = field(default_factory=threading.Event, compare=False)


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
