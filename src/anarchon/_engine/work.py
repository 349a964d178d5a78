"""The work an instance runs under a lease: a job's ``Attempt`` or a timer's ``Firing``
(both ``Leased``), read by the runner, the lease keeper, settle and the claimer."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol, cast

import anyio

from .._model.clock import wall_ms
from .._model.job import Job
from .._model.timer import Recurrence, TimerKind
from .._model.values import Run, TimerRun
from .._observe.events import EventHub, LeaseLost, instant, run_started
from .._observe.tracing import AttemptTrace, Tracing
from .._store.contract import (
    HeartbeatRequest,
    Outcome,
    Store,
    describe_slot,
    is_fleet_request,
    is_manual,
)
from .._store.keys import TimerKeys
from .._store.timers import FleetLimits, TimerStore
from ..clients import ServerReplyError
from .context import Owner

__all__ = [
    "Attempt",
    "Firing",
    "Leased",
    "Settles",
    "WaitsForRuns",
    "attempts_for",
    "current_attempt",
    "firing_key",
]

log = logging.getLogger("anarchon")


def attempts_for(job: Job, slot_id: str) -> int:
    """A manual run (``run_now``) has one attempt, whoever claims it; a scheduled one,
    and one the fleet was asked for (``Inspector.run_now``), the job's."""
    return 1 if is_manual(slot_id) and not is_fleet_request(slot_id) else job.max_attempts


class Settles(Protocol):
    """The settle step (``settle.Settler``), as the work items call it."""

    async def settle_attempt(
        self, attempt: Attempt, outcome: Outcome, error: str | None
    ) -> None: ...

    async def settle_firing(self, firing: Firing, outcome: Outcome) -> None: ...


class WaitsForRuns(Protocol):
    """The agenda (``agenda.Agenda``), as an attempt that ends here tells it."""

    def run_ended(self, job: Job) -> None: ...


@dataclass(slots=True, kw_only=True)
class Leased:
    """Work this instance won and runs under a lease: a job's attempt (``Attempt``) or
    a timer's firing (``Firing``). The runner, the lease keeper and settle keep its
    lease the same way, whichever it is."""

    token: str
    started_ms: int = field(default_factory=lambda: int(wall_ms()))
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
    def owner(self) -> Owner:
        """Whose run it is, as a bound counts it (``Capacity``)."""
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

    def began_event(self, events: EventHub) -> None:
        """Tell the listeners the handler begins (a job's attempt: ``RunStarted``)."""

    def lost_event(self, instance: str, reason: str) -> LeaseLost:
        raise NotImplementedError

    async def settle_with(self, settler: Settles, outcome: Outcome, error: str | None) -> None:
        """Record how it ended, through the settle step of its kind."""
        raise NotImplementedError

    async def keep_progress(self, store: Store, timer_store: TimerStore, text: str) -> str | None:
        """Keep its progress (JSON text) in the store while it holds its lease: None, or
        why the store refused it."""
        raise NotImplementedError

    def ended_here(self, agenda: WaitsForRuns) -> None:
        """It has ended and settled: what waited for it may go on."""

    @classmethod
    async def heartbeats(
        cls, store: Store, timer_store: TimerStore, batch: Sequence[Leased], lease_ms: int
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
class Attempt(Leased):
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
    def owner(self) -> Owner:
        return ("job", self.job.name)

    @property
    def lease_lost(self) -> threading.Event:
        return self.run.lease_lost

    @property
    def max_attempts(self) -> int:
        return attempts_for(self.job, self.slot_id)

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

    def began_event(self, events: EventHub) -> None:
        if events.on:
            run = self.run
            now_ms = wall_ms()
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

    async def keep_progress(self, store: Store, timer_store: TimerStore, text: str) -> str | None:
        return await store.save_progress(self.job.name, self.slot_id, self.token, text)

    async def settle_with(self, settler: Settles, outcome: Outcome, error: str | None) -> None:
        await settler.settle_attempt(self, outcome, error)

    def ended_here(self, agenda: WaitsForRuns) -> None:
        agenda.run_ended(self.job)

    @classmethod
    async def heartbeats(
        cls, store: Store, timer_store: TimerStore, batch: Sequence[Leased], lease_ms: int
    ) -> list[bool | ServerReplyError]:
        beats = [
            HeartbeatRequest(
                a.job.name, a.slot_id, a.token, lease_ms, a.job.overlap, a.job.max_concurrent_fleet
            )
            for a in cast(Sequence[Attempt], batch)
        ]
        return await store.heartbeat_many(beats)


@dataclass(slots=True, kw_only=True)
class Firing(Leased):
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
    def owner(self) -> Owner:
        return ("timer", self.kind.name)

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

    async def keep_progress(self, store: Store, timer_store: TimerStore, text: str) -> str | None:
        return await timer_store.save_progress(self.keys, self.run.key, self.token, text)

    async def settle_with(self, settler: Settles, outcome: Outcome, error: str | None) -> None:
        await settler.settle_firing(self, outcome)

    @classmethod
    async def heartbeats(
        cls, store: Store, timer_store: TimerStore, batch: Sequence[Leased], lease_ms: int
    ) -> list[bool | ServerReplyError]:
        beats = [
            (f.keys, f.run.key, f.token, FleetLimits.of(f.kind))
            for f in cast(Sequence[Firing], batch)
        ]
        return await timer_store.heartbeat_many(beats, lease_ms)


def firing_key(kind: str, key: str, token: str) -> tuple[str, str]:
    """A firing's key in ``EngineContext.attempts``: a job's slot ids are digits or start
    with ``m``, so ``t:`` never meets one, whatever the names. The token is part of it:
    an attempt of a key whose lease ran out here may still be settling when this
    instance wins the key's next attempt."""
    return (kind, f"t:{token}:{key}")


#: The attempt whose handler runs in this task (None outside handlers): a stop()
#: called from a handler must not wait for that handler.
current_attempt: ContextVar[Leased | None] = ContextVar("anarchon_attempt", default=None)
