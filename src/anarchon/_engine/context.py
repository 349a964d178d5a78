"""What every part of the engine shares (``EngineContext``: the settings, the job and
timer tables, the scheduler's state, the work running here, the events), and what
exists only once the instance has started (``Running``: the store, the timers' store,
the task group)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

import anyio
from anyio.abc import TaskGroup

from .._model.clock import monotonic, round_trip_deadline_sec
from .._model.job import Job
from .._model.timer import TimerKind
from .._observe.events import (
    DefinitionOutdated,
    EventHub,
    ServerBack,
    ServerUnreachable,
    SkipReason,
    SlotSkipped,
)
from .._observe.tracing import Tracing
from .._store.contract import Store
from .._store.timers import TimerStore

if TYPE_CHECKING:
    from .work import Leased

__all__ = ["Capacity", "EngineContext", "Owner", "Room", "Running", "ServerHealth", "State"]

log = logging.getLogger("anarchon")


#: How often a finished job's slot is claimed all the same, to ask the store again.
FINISHED_RECHECK_SEC = 60.0


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
            self.down_since = monotonic()
            log.warning("the server does not answer (%s: %s); retrying until it does", what, exc)
            if self._context.events.on:
                self._context.events.emit(
                    ServerUnreachable(instance=self._context.instance_id, what=what, error=str(exc))
                )
        else:
            log.debug("still no answer (%s: %s)", what, exc)

    def answered(self) -> None:
        if self.down_since is not None:
            down_sec = monotonic() - self.down_since
            log.info("the server answers again, after %.1f s", down_sec)
            self.down_since = None
            # What the store said may have changed (a failover can lose its last writes):
            # finished jobs ask it again.
            self._context.finished.clear()
            if self._context.events.on:
                self._context.events.emit(
                    ServerBack(instance=self._context.instance_id, down_sec=down_sec)
                )


State = Literal["new", "running", "stopping", "stopped"]


class Room(NamedTuple):
    """An instance's room under its bound on handlers at once, as the metrics read it."""

    #: Its bound (None: none).
    bound: int | None
    #: How many more may start now (0 without a bound).
    left: int
    #: How long its claim loop has waited for room, in all (seconds).
    waited_sec: float
    #: How many claims of due timers were put off for room, in all.
    deferred: int
    #: Claims put off for room now: slots of jobs at their own bound, kinds' due timers.
    waiting: int
    #: Claims that found a fleet limit reached, in all: by (``"job"`` or ``"timer"``,
    #: name, ``"concurrent"`` or ``"rate"``).
    fleet_waits: Mapping[tuple[str, str, str], int] = {}


#: Whose runs a bound counts: ``("job", name)`` or ``("timer", kind)``.
Owner = tuple[str, str]


class Capacity:
    """How many more handlers may start on this instance: its bound (``max_concurrent``)
    less those running and those that claims in flight may start; and the same for a
    job or timer kind with a bound of its own. An instance at its bound claims nothing
    more (backpressure): what is due stays in the store for the other instances, and
    none of it waits here past a lease."""

    def __init__(self, context: EngineContext) -> None:
        self._context = context
        #: Runs that claims in flight may start (each claim reserves its most).
        self.reserved = 0
        #: How long the claim loop has waited for room here, in all (seconds).
        self.waited_sec = 0.0
        #: How many claims of due timers found no room here and were put off.
        self.deferred = 0
        #: Runs going on here, and runs reserved, of each job or kind with a bound.
        self._running: dict[Owner, int] = {}
        self._reserved_for: dict[Owner, int] = {}
        self._freed = anyio.Event()
        self._listeners: list[Callable[[], None]] = []

    def free(self, owner: Owner | None = None, bound: int | None = None) -> int:
        """How many more may start now (a large number without a bound); given a job's
        or a kind's own ``bound``, how many more of ``owner``'s."""
        most = self._context.max_concurrent
        room = 1 << 30 if most is None else most - len(self._context.attempts) - self.reserved
        if owner is not None and bound is not None:
            taken = self._running.get(owner, 0) + self._reserved_for.get(owner, 0)
            room = min(room, bound - taken)
        return room

    def reserve(self, count: int, owner: Owner | None = None) -> None:
        """A claim in flight may start ``count`` runs (of ``owner``'s)."""
        self.reserved += count
        if owner is not None:
            self._reserved_for[owner] = self._reserved_for.get(owner, 0) + count

    def unreserve(self, count: int, owner: Owner | None = None) -> None:
        """Its reply came (or did not): what it won runs, and the rest is room again."""
        self.reserved -= count
        if owner is not None:
            _less(self._reserved_for, owner, count)
        if count:
            self.freed()

    def started(self, owner: Owner) -> None:
        self._running[owner] = self._running.get(owner, 0) + 1

    def ended(self, owner: Owner) -> None:
        _less(self._running, owner, 1)
        self.freed()

    def on_freed(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever room may have been made."""
        self._listeners.append(listener)

    def freed(self) -> None:
        """A run ended, a claim gave its room back, or the scheduler stops: whoever
        waits for room looks again. The event is set and replaced here, by the one who
        frees, never by a waiter: a waiter that replaced it could leave another waiting
        on an event nobody will set."""
        if self._freed.statistics().tasks_waiting:
            event, self._freed = self._freed, anyio.Event()
            event.set()
        for listener in self._listeners:
            listener()

    async def wait(self, owner: Owner | None = None, bound: int | None = None) -> None:
        """Return once a run (of ``owner``'s, under its ``bound``) may start here, or the
        scheduler stops."""
        began = monotonic()
        try:
            while self.free(owner, bound) <= 0 and self._context.state == "running":
                await self._freed.wait()
        finally:
            self.waited_sec += monotonic() - began


def _less(counts: dict[Owner, int], owner: Owner, count: int) -> None:
    left = counts.get(owner, 0) - count
    if left > 0:
        counts[owner] = left
    else:
        counts.pop(owner, None)


@dataclass(frozen=True, eq=False, slots=True)
class Running:
    """What an instance has once started, and until it stops: the parts that talk to the
    server get it in their constructors, made at the start."""

    #: The store of the backend's strategy, on the instance's connection.
    store: Store
    #: The timers' store, on the same connection.
    timer_store: TimerStore
    #: The task group every task of the scheduler runs in.
    group: TaskGroup


@dataclass(eq=False, slots=True)
class EngineContext:
    """One scheduler's shared state, from its creation on; what exists only once it runs
    is ``Running``."""

    jobs: dict[str, Job]
    instance_id: str
    lease_ms: int
    heartbeat_ms: int
    retry_delay_ms: int
    #: The backend's key prefix.
    prefix: str = "cron:"
    state: State = "new"
    #: Set when the scheduler starts stopping: waits that a stop must not sit out
    #: (a finish's backoff) end early.
    stopping: anyio.Event = field(default_factory=anyio.Event)
    #: The attempts and firings this instance runs, by their ``registry_key``; only the
    #: runner adds and removes them.
    attempts: dict[tuple[str, str], Leased] = field(default_factory=dict)
    health: ServerHealth = field(init=False)
    #: Where events go (``Scheduler.events``, ``on_event``): ask ``events.on`` before
    #: making one.
    events: EventHub = field(default_factory=EventHub)
    #: Spans of attempts and claims (``anarchon.otel``), if a tracer was given.
    tracing: Tracing | None = None
    #: Jobs that no longer claim slots, with the reason (their schedule raised, or the
    #: server answered their claims with a permanent error).
    disabled: dict[str, str] = field(default_factory=dict)
    #: The jobs whose runs reached their ``max_runs`` (``finish``): why, and when
    #: (monotonic) their next slot's claim asks the store again.
    finished: dict[str, tuple[str, float]] = field(default_factory=dict)
    #: The jobs whose definition here is not the one in force (``follow_definition``):
    #: the fingerprint in force, or "" when only a claim said so.
    outdated: dict[str, str] = field(default_factory=dict)
    #: The fingerprint of each job's definition here (its claims carry it).
    fingerprints: dict[str, str] = field(default_factory=dict)
    #: The kinds of timer this instance fires, by name.
    timer_kinds: dict[str, TimerKind] = field(default_factory=dict)
    #: How long an instance waits at most between two claims of a kind's due timers
    #: (a timer set elsewhere to fire sooner than it knew of is seen by then).
    timer_poll_ms: int = 1000
    #: When each job first appeared in the store (server ms, from the registry at
    #: start): catch-up never reaches back before it.
    first_seen_ms: dict[str, int] = field(default_factory=dict)
    #: The server's clock minus this instance's, as the last claim of timers saw it
    #: (a recurring timer's next due time is reckoned on the server's clock).
    server_offset_ms: float = 0.0
    #: The most handlers (jobs' and timers' together) that run here at once (None: no
    #: bound).
    max_concurrent: int | None = None
    capacity: Capacity = field(init=False)
    #: Claims that found a fleet limit reached (``max_concurrent_fleet``, a kind's
    #: ``rate_limit``), by (owner's kind, name, which limit): the work waited in the store.
    fleet_waits: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.health = ServerHealth(self)
        self.capacity = Capacity(self)

    @property
    def round_trip_sec(self) -> float:
        return round_trip_deadline_sec(self.lease_ms)

    def begin_stopping(self) -> None:
        self.state = "stopping"
        self.stopping.set()
        self.capacity.freed()

    def fleet_waited(self, owner: Owner, limit: str) -> None:
        """A claim of ``owner``'s work found its fleet limit ``limit`` reached."""
        key = (*owner, limit)
        self.fleet_waits[key] = self.fleet_waits.get(key, 0) + 1

    def skipped(self, job: str, slot_ms: int, reason: SkipReason) -> None:
        """Tell the listeners a scheduled slot of ``job`` does not run (logged already)."""
        if self.events.on:
            self.events.emit(
                SlotSkipped(instance=self.instance_id, job=job, slot_ms=slot_ms, reason=reason)
            )

    def finish(self, job: str, reason: str) -> None:
        """``job`` reached its ``max_runs``: its new slots are not claimed here (its runs
        under way go on), but for one a minute (and the first after an outage), which
        asks the store again: a higher bound deployed elsewhere, or a count a failover
        lost, lets the job run again."""
        if job not in self.finished:
            log.info(
                "%s: the job is finished: %s; its slots are not claimed (raise max_runs and "
                "redeploy to run it again)",
                job,
                reason,
            )
        self.finished[job] = (reason, monotonic() + FINISHED_RECHECK_SEC)

    def resting(self, job: str) -> bool:
        """Whether ``job``'s new slots are not claimed here: its definition here is not
        the one in force, or it is finished and its next claim need not ask again."""
        if job in self.outdated:
            return True
        entry = self.finished.get(job)
        return entry is not None and monotonic() < entry[1]

    def follow_definition(self, job: str, own: str, in_force: str) -> None:
        """The registry's word on ``job``: the fingerprint of its definition in force, and
        this instance's (``outdated`` is kept, and said once per change)."""
        if own == in_force or not in_force:
            if self.outdated.pop(job, None):
                log.info("%s: this instance's definition of the job is in force again", job)
            return
        self._outdate(job, own, in_force)

    def outdated_by_store(self, job: str) -> None:
        """A claim of ``job`` found another definition in force (before the registry
        said so here)."""
        if job not in self.outdated:
            self._outdate(job, self.fingerprints.get(job, ""), "")

    def _outdate(self, job: str, own: str, in_force: str) -> None:
        said = self.outdated.get(job) in ("", in_force)
        self.outdated[job] = in_force
        if said:
            return
        log.warning(
            "%s: the live instances disagree on the job's definition, and this instance's "
            "(%s) is not the one in force (%s: the newest, a deploy in progress?); it "
            "claims no new slot of the job until its definition is in force again (its "
            "runs under way go on)",
            job,
            own,
            in_force or "as the store says",
        )
        if self.events.on:
            self.events.emit(
                DefinitionOutdated(instance=self.instance_id, job=job, own=own, in_force=in_force)
            )

    def unfinish(self, job: str) -> None:
        """A claim of ``job`` was won: it is not finished (any more)."""
        if self.finished.pop(job, None) is not None:
            log.info("%s: the job runs again: its runs are below its max_runs", job)

    def disable(self, job: str, reason: str) -> None:
        """Stop claiming slots of ``job``, loudly; the other jobs go on."""
        if job not in self.disabled:
            self.disabled[job] = reason
            log.error("%s: the job is disabled until this scheduler restarts: %s", job, reason)
