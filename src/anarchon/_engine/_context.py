"""What every part of the engine shares: the settings, the job table, the store, the task
group and the scheduler's state (``EngineContext``); the attempts running here
(``_Attempt``, read by the runner, the lease keeper, settle and the claimer); the clock."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Literal

import anyio
from anyio.abc import TaskGroup

from .._job import Job
from .._store import Store, is_manual
from .._structures import Run

__all__ = ["EngineContext", "State", "_CLAIM_TIMEOUT_SEC", "_Attempt", "_attempts_for", "_now_ms"]

log = logging.getLogger("anarchon")

# How long one claim batch (or one heartbeat round trip) may take before it counts as
# failed and is retried.
_CLAIM_TIMEOUT_SEC = 10.0

State = Literal["new", "running", "stopping", "stopped"]


def _now_ms() -> float:
    return time.time() * 1000.0


def _attempts_for(job: Job, slot_id: str) -> int:
    """A manual run has one attempt, whoever claims it; a scheduled one the job's."""
    return 1 if is_manual(slot_id) else job.max_attempts


@dataclass(slots=True)
class _Attempt:
    """An attempt this instance won and is running."""

    job: Job
    run: Run
    slot_id: str
    token: str
    started_ms: int = field(default_factory=lambda: int(_now_ms()))
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    lost: bool = False
    #: Set once the attempt has ended and its result is recorded (or given up).
    settled: anyio.Event = field(default_factory=anyio.Event)
    #: When the lease runs out as far as this instance knows, and when to heartbeat
    #: next (monotonic seconds; kept by the scheduler's lease keeper).
    held_until: float = 0.0
    next_beat: float = math.inf

    @property
    def max_attempts(self) -> int:
        return _attempts_for(self.job, self.slot_id)

    def cancel(self, reason: str) -> None:
        """Tell the handler its lease is gone (threads) and cancel it (async)."""
        log.info(
            "cancelling %s slot %s attempt %d: %s",
            self.job.name,
            self.slot_id,
            self.run.attempt,
            reason,
        )
        self.run.lease_lost.set()
        self.scope.cancel()


@dataclass(eq=False, slots=True)
class EngineContext:
    """One scheduler's shared state. The parts read the store through it (never a copy),
    so that whoever swaps the store's connection reaches every part at once."""

    jobs: dict[str, Job]
    instance_id: str
    lease_ms: int
    heartbeat_ms: int
    retry_delay_ms: int
    #: Opened on start; None before.
    store: Store | None = None
    #: The task group every task of the scheduler runs in (from start on).
    group: TaskGroup | None = None
    state: State = "new"
    #: The attempts this instance runs, by (job, slot id); only the runner adds and
    #: removes them.
    attempts: dict[tuple[str, str], _Attempt] = field(default_factory=dict)
