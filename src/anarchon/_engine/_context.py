"""What every part of the engine shares: the settings, the job and timer tables, the stores,
the task group and the scheduler's state (``EngineContext``); the work running here under
a lease (``_Leased``: a job's ``_Attempt`` or a timer's ``_Firing``, read by the runner,
the lease keeper, settle and the claimer); the clock."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast

import anyio
from anyio.abc import TaskGroup

from .._model.job import Job
from .._model.timer import Recurrence, TimerKind
from .._model.values import Run, TimerRun
from .._observe.events import (
    EventHub,
    LeaseLost,
    ServerBack,
    ServerUnreachable,
    SkipReason,
    SlotSkipped,
    instant,
    run_started,
)
from .._observe.tracing import AttemptTrace, Tracing
from .._store.contract import (
    HeartbeatRequest,
    LeasingStore,
    Outcome,
    Store,
    describe_slot,
    is_fleet_request,
    is_manual,
)
from .._store.keys import TimerKeys
from .._store.timers import TimerStore
from ..clients import ServerReplyError

__all__ = [
    "EngineContext",
    "ServerHealth",
    "State",
    "_Attempt",
    "_Firing",
    "_Leased",
    "_attempts_for",
    "_now_ms",
    "current_attempt",
    "firing_key",
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
    (and told as an event) once when it starts (WARNING) and once when it ends (INFO,
    with how long it lasted), not once per failed round trip; a failure while the server
    is known to be unreachable is logged at DEBUG only."""

    def __init__(self, context: EngineContext) -> None:
        self._context = context
        self.down_since: float | None = None

    def failed(self, what: str, exc: BaseException | str) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("the server does not answer (%s: %s); retrying until it does", what, exc)
            if self._context.events.on:
                self._context.events.emit(
                    ServerUnreachable(instance=self._context.instance_id, what=what, error=str(exc))
                )
        else:
            log.debug("still no answer (%s: %s)", what, exc)

    def answered(self) -> None:
        if self.down_since is not None:
            down_sec = time.monotonic() - self.down_since
            log.info("the server answers again, after %.1f s", down_sec)
            self.down_since = None
            if self._context.events.on:
                self._context.events.emit(
                    ServerBack(instance=self._context.instance_id, down_sec=down_sec)
                )


State = Literal["new", "running", "stopping", "stopped"]


def _now_ms() -> float:
    return time.time() * 1000.0


def _attempts_for(job: Job, slot_id: str) -> int:
    """A manual run (``run_now``) has one attempt, whoever claims it; a scheduled one,
    and one the fleet was asked for (``Inspector.run_now``), the job's."""
    return 1 if is_manual(slot_id) and not is_fleet_request(slot_id) else job.max_attempts


class Settles(Protocol):
    """The settle step (``settle.Settler``), as the work items call it."""

    async def settle_attempt(
        self, attempt: _Attempt, outcome: Outcome, error: str | None
    ) -> None: ...

    async def settle_firing(self, firing: _Firing, outcome: Outcome) -> None: ...


class WaitsForRuns(Protocol):
    """The agenda (``agenda.Agenda``), as an attempt that ends here tells it."""

    def run_ended(self, job: Job) -> None: ...


@dataclass(slots=True, kw_only=True)
class _Leased:
    """Work this instance won and runs under a lease: a job's attempt (``_Attempt``) or
    a timer's firing (``_Firing``). The runner, the lease keeper and settle keep its
    lease the same way, whichever it is."""

    token: str
    started_ms: int = field(default_factory=lambda: int(_now_ms()))
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    lost: bool = False
    #: The handler was called (it may have done some of its work).
    began: bool = False
    #: The handler has returned (or raised): its finish is on the way, so a heartbeat
    #: refused from now on says nothing about a lost lease.
    ended: bool = False
    #: A plain function's handler was told that its timeout_ms passed.
    timed_out: bool = False
    #: What the handler raised (None if it did not); logged with the run's end.
    failure: BaseException | None = None
    #: Set once the attempt has ended and its result is recorded (or given up).
    settled: anyio.Event = field(default_factory=anyio.Event)
    #: When the lease runs out as far as this instance knows, and when to heartbeat
    #: next (monotonic seconds; kept by the scheduler's lease keeper).
    held_until: float = 0.0
    next_beat: float = math.inf

    def ran_out(self, now: float) -> bool:
        """Whether its lease has run out by ``now`` (monotonic), as far as this
        instance knows: a backup may be running it."""
        return now >= self.held_until

    @property
    def registry_key(self) -> tuple[str, str]:
        """Its key in ``EngineContext.attempts``."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        """The job's or the timer kind's name."""
        raise NotImplementedError

    @property
    def lease_lost(self) -> threading.Event:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    @property
    def timeout_ms(self) -> int | None:
        """How long the handler may run (None: as long as it likes)."""
        return None

    @property
    def is_async(self) -> bool:
        """Whether the handler runs in the event loop (or in a worker thread)."""
        raise NotImplementedError

    async def invoke(self) -> None:
        raise NotImplementedError

    def trace(self, tracing: Tracing) -> AttemptTrace | None:
        """A span of this work, if it has one (a job's attempt)."""
        return None

    def began_event(self, context: EngineContext) -> None:
        """Tell the listeners the handler begins (a job's attempt: ``RunStarted``)."""

    def lost_event(self, instance: str, reason: str) -> LeaseLost:
        raise NotImplementedError

    async def settle_with(self, settler: Settles, outcome: Outcome, error: str | None) -> None:
        """Record how it ended, through the settle step of its kind."""
        raise NotImplementedError

    def ended_here(self, agenda: WaitsForRuns) -> None:
        """It has ended and settled: what waited for it may go on."""

    @classmethod
    async def heartbeats(
        cls, context: EngineContext, batch: Sequence[_Leased], lease_ms: int
    ) -> list[bool | ServerReplyError]:
        """Extend the leases of a batch of this class's work (the lease keeper batches
        by class), in one round trip: a reply for each, in order."""
        raise NotImplementedError

    def cancel(self, reason: str, *, lost: bool = False) -> None:
        """Tell the handler its lease is gone (threads) and cancel it (async). ``lost``:
        the lease is lost (an ERROR), not given up by a stop."""
        if lost:
            log.error("%s lost its lease, cancelling it: %s", self.describe(), reason)
        else:
            log.info("cancelling %s: %s", self.describe(), reason)
        self.lease_lost.set()
        self.scope.cancel()


@dataclass(slots=True, kw_only=True)
class _Attempt(_Leased):
    """An attempt at a job's slot this instance won and is running."""

    job: Job
    run: Run
    slot_id: str

    @property
    def registry_key(self) -> tuple[str, str]:
        return (self.job.name, self.slot_id)

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def lease_lost(self) -> threading.Event:
        return self.run.lease_lost

    @property
    def max_attempts(self) -> int:
        return _attempts_for(self.job, self.slot_id)

    def describe(self) -> str:
        return f"{self.job.name} {describe_slot(self.slot_id)} attempt {self.run.attempt}"

    @property
    def timeout_ms(self) -> int | None:
        return self.job.timeout_ms

    @property
    def is_async(self) -> bool:
        return self.job.is_async

    async def invoke(self) -> None:
        await self.job.invoke(self.run)

    def trace(self, tracing: Tracing) -> AttemptTrace | None:
        return tracing.start_attempt(self.run)

    def began_event(self, context: EngineContext) -> None:
        events = context.events
        if events.on:
            run = self.run
            now_ms = _now_ms()
            events.emit(run_started(run.runner, instant(now_ms), run, now_ms - run.slot_ms))

    def lost_event(self, instance: str, reason: str) -> LeaseLost:
        run = self.run
        return LeaseLost(
            instance=instance,
            job=run.job,
            slot_ms=run.slot_ms,
            attempt=run.attempt,
            reason=reason,
        )

    async def settle_with(self, settler: Settles, outcome: Outcome, error: str | None) -> None:
        await settler.settle_attempt(self, outcome, error)

    def ended_here(self, agenda: WaitsForRuns) -> None:
        agenda.run_ended(self.job)

    @classmethod
    async def heartbeats(
        cls, context: EngineContext, batch: Sequence[_Leased], lease_ms: int
    ) -> list[bool | ServerReplyError]:
        store = context.store
        assert isinstance(store, LeasingStore)  # attempts are heartbeated with leases only
        beats = [
            HeartbeatRequest(a.job.name, a.slot_id, a.token, lease_ms, a.job.overlap)
            for a in cast(Sequence[_Attempt], batch)
        ]
        return await store.heartbeat_many(beats)


@dataclass(slots=True, kw_only=True)
class _Firing(_Leased):
    """A firing of a key's timer this instance won and is running."""

    kind: TimerKind
    run: TimerRun
    keys: TimerKeys
    #: How the timer recurs (None: a one-shot timer).
    recurrence: Recurrence | None

    @property
    def registry_key(self) -> tuple[str, str]:
        return firing_key(self.kind.name, self.run.key, self.token)

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def lease_lost(self) -> threading.Event:
        return self.run.lease_lost

    def describe(self) -> str:
        return f"timer {self.kind.name} {self.run.key!r} attempt {self.run.attempt}"

    @property
    def is_async(self) -> bool:
        return self.kind.is_async

    async def invoke(self) -> None:
        await self.kind.invoke(self.run)

    def lost_event(self, instance: str, reason: str) -> LeaseLost:
        fire = self.run
        return LeaseLost(
            instance=instance,
            job=fire.kind,
            slot_ms=fire.due_ms,
            attempt=fire.attempt,
            reason=reason,
            timer_key=fire.key,
        )

    async def settle_with(self, settler: Settles, outcome: Outcome, error: str | None) -> None:
        await settler.settle_firing(self, outcome)

    @classmethod
    async def heartbeats(
        cls, context: EngineContext, batch: Sequence[_Leased], lease_ms: int
    ) -> list[bool | ServerReplyError]:
        timer_store = context.timer_store
        assert timer_store is not None
        beats = [(f.keys, f.run.key, f.token) for f in cast(Sequence[_Firing], batch)]
        return await timer_store.heartbeat_many(beats, lease_ms)


def firing_key(kind: str, key: str, token: str) -> tuple[str, str]:
    """A firing's key in ``EngineContext.attempts``: a job's slot ids are digits or start
    with ``m``, so ``t:`` never meets one, whatever the names. The token is part of it:
    an attempt of a key whose lease ran out here may still be settling when this
    instance wins the key's next attempt."""
    return (kind, f"t:{token}:{key}")


#: The attempt whose handler runs in this task (None outside handlers): a stop()
#: called from a handler must not wait for that handler.
current_attempt: ContextVar[_Leased | None] = ContextVar("anarchon_attempt", default=None)


@dataclass(eq=False, slots=True)
class EngineContext:
    """One scheduler's shared state. The parts read the store through it (never a copy),
    so that whoever swaps the store's connection reaches every part at once."""

    jobs: dict[str, Job]
    instance_id: str
    lease_ms: int
    heartbeat_ms: int
    retry_delay_ms: int
    #: The backend's key prefix.
    prefix: str = "cron:"
    #: Opened on start; None before.
    store: Store | None = None
    #: The task group every task of the scheduler runs in (from start on).
    group: TaskGroup | None = None
    state: State = "new"
    #: Set when the scheduler starts stopping: waits that a stop must not sit out
    #: (a finish's backoff) end early.
    stopping: anyio.Event = field(default_factory=anyio.Event)
    #: The attempts and firings this instance runs, by their ``registry_key``; only the
    #: runner adds and removes them.
    attempts: dict[tuple[str, str], _Leased] = field(default_factory=dict)
    health: ServerHealth = field(init=False)
    #: Where events go (``Scheduler.events``, ``on_event``): ask ``events.on`` before
    #: making one.
    events: EventHub = field(default_factory=EventHub)
    #: Spans of attempts and claims (``anarchon.otel``), if a tracer was given.
    tracing: Tracing | None = None
    #: Jobs that no longer claim slots, with the reason (their schedule raised, or the
    #: server answered their claims with a permanent error).
    disabled: dict[str, str] = field(default_factory=dict)
    #: The kinds of timer this instance fires, by name.
    timer_kinds: dict[str, TimerKind] = field(default_factory=dict)
    #: The timers' store (on the store's connection), from start on.
    timer_store: TimerStore | None = None
    #: How long an instance waits at most between two claims of a kind's due timers
    #: (a timer set elsewhere to fire sooner than it knew of is seen by then).
    timer_poll_ms: int = 1000
    #: When each job first appeared in the store (server ms, from the registry at
    #: start): catch-up never reaches back before it.
    first_seen_ms: dict[str, int] = field(default_factory=dict)
    #: The server's clock minus this instance's, as the last claim of timers saw it
    #: (a recurring timer's next due time is reckoned on the server's clock).
    server_offset_ms: float = 0.0

    def __post_init__(self) -> None:
        self.health = ServerHealth(self)

    @property
    def round_trip_sec(self) -> float:
        return round_trip_deadline_sec(self.lease_ms)

    def begin_stopping(self) -> None:
        self.state = "stopping"
        self.stopping.set()

    def skipped(self, job: str, slot_ms: int, reason: SkipReason) -> None:
        """Tell the listeners a scheduled slot of ``job`` does not run (logged already)."""
        if self.events.on:
            self.events.emit(
                SlotSkipped(instance=self.instance_id, job=job, slot_ms=slot_ms, reason=reason)
            )

    def disable(self, job: str, reason: str) -> None:
        """Stop claiming slots of ``job``, loudly; the other jobs go on."""
        if job not in self.disabled:
            self.disabled[job] = reason
            log.error("%s: the job is disabled until this scheduler restarts: %s", job, reason)
