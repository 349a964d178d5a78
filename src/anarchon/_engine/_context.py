"""What every part of the engine shares: the settings, the job table, the store, the task
group and the scheduler's state (``EngineContext``); the attempts running here
(``_Attempt``, read by the runner, the lease keeper, settle and the claimer); the clock."""

from __future__ import annotations

import logging
import math
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal

import anyio
from anyio.abc import TaskGroup

from .._job import Job
from .._store import Store, is_manual
from .._structures import Run

__all__ = [
    "EngineContext",
    "ServerHealth",
    "State",
    "_Attempt",
    "_attempts_for",
    "_now_ms",
    "current_attempt",
    "round_trip_deadline_sec",
]

log = logging.getLogger("anarchon")


def round_trip_deadline_sec(lease_ms: int) -> float:
    """How long one round trip (a claim batch, a heartbeat tick, a finish) may take
    before it counts as failed: a third of the lease, between 0.25 s and 10 s. Never
    only the client's own timeout (a frozen server, a client without one). A third
    leaves a heartbeat sent half a lease after the last one time to fail and be
    retried before the lease expires."""
    return min(max(lease_ms / 3000, 0.25), 10.0)


class ServerHealth:
    """Whether the server answers, as this instance last saw it. An outage is logged
    once when it starts (WARNING) and once when it ends (INFO, with how long it
    lasted), not once per failed round trip; a failure while the server is known to
    be unreachable is logged at DEBUG only."""

    def __init__(self) -> None:
        self.down_since: float | None = None

    def failed(self, what: str, exc: BaseException | str) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("the server does not answer (%s: %s); retrying until it does", what, exc)
        else:
            log.debug("still no answer (%s: %s)", what, exc)

    def answered(self) -> None:
        if self.down_since is not None:
            log.info("the server answers again, after %.1f s", time.monotonic() - self.down_since)
            self.down_since = None


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
    #: The handler has returned (or raised): its finish is on the way, so a heartbeat
    #: refused from now on says nothing about a lost lease.
    ended: bool = False
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


#: The attempt whose handler runs in this task (None outside handlers): a stop()
#: called from a handler must not wait for that handler.
current_attempt: ContextVar[_Attempt | None] = ContextVar("anarchon_attempt", default=None)


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
    #: Set when the scheduler starts stopping: waits that a stop must not sit out
    #: (a finish's backoff) end early.
    stopping: anyio.Event = field(default_factory=anyio.Event)
    #: The attempts this instance runs, by (job, slot id); only the runner adds and
    #: removes them.
    attempts: dict[tuple[str, str], _Attempt] = field(default_factory=dict)
    health: ServerHealth = field(default_factory=ServerHealth)
    #: Jobs that no longer claim slots, with the reason (their schedule raised, or the
    #: server answered their claims with a permanent error).
    disabled: dict[str, str] = field(default_factory=dict)

    @property
    def round_trip_sec(self) -> float:
        return round_trip_deadline_sec(self.lease_ms)

    def begin_stopping(self) -> None:
        self.state = "stopping"
        self.stopping.set()

    def disable(self, job: str, reason: str) -> None:
        """Stop claiming slots of ``job``, loudly; the other jobs go on."""
        if job not in self.disabled:
            self.disabled[job] = reason
            log.error("%s: the job is disabled until this scheduler restarts: %s", job, reason)
