"""One instance of the engine: it owns the shared context and the parts, starts them,
keeps the instance registered, and stops them.

``Scheduler`` is the public facade over an ``Instance``, and ``Timers`` reaches a
scheduler's through the ``TimerHost`` protocol (``_timers.py``). What is listed here is
all that code outside the engine uses (``tests/test_architecture.py`` holds it so):

- ``state``, ``instance_id``, ``jobs``, ``timer_kinds``, ``events``, ``running``,
  ``wait_stopped()``, ``rename()``: what the facade hands on (``Scheduler.state``, ...);
- the timer host's members (``round_trip_sec``, ``server_offset_ms``,
  ``running_connection()``, ``fires_here()``, ``timer_set_here()``);
- ``create``, ``start``, ``exit``, ``stop``, ``add_job``, ``add_timer_kind``,
  ``history``, ``set_paused``, ``run_now``: the facade's lifecycle and calls.

``Instance.of(scheduler)`` is for anarchon's integrations, and they use only:

- ``server_down_since``, ``disabled``: ``serve``'s health probes;
- ``leases_held()``, ``room()``, ``read_beside(reader)``: ``anarchon.prometheus``'s
  gauges, and
  its reader of the store on the instance's connection from its start to its stop;
- ``trace_with(tracing)``: spans of attempts and claims (``anarchon.otel``);
- ``running_store()``: the store while it runs (tests and benchmarks);
- ``events``, ``copy_to(other)``: ``anarchon.testing``'s fleet (what each instance
  tells, and the copies of a user's scheduler it runs beside it).

The start opens the store, prepares the jobs and timer kinds, registers the instance
(``_store/registry.py``), makes the parts that talk to the server (``Running`` holds
what they share), then starts the claim loop, the registry's renewals, the lease keeper
and the hints in one task group. The stop ends them in the reverse order: no new claim,
unanswered claims resolved, handlers given their grace, leases released, the
registration withdrawn, the connection closed.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Coroutine, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio

from .._errors import (
    ConnectionFailedError,
    InvalidJobError,
    InvalidOptionError,
    SchedulerStateError,
    reason,
)
from .._model.clock import pace, wall_ms
from .._model.job import Job
from .._model.options import SchedulerSettings, default_instance_id
from .._model.timer import TimerKind
from .._model.values import RunResult
from .._observe.events import EventHub
from .._observe.tracing import Tracing
from .._store.audit import check_note, record_audit, who
from .._store.backend import RedisBackend, StoreOptions
from .._store.contract import Store
from .._store.deadline import answered_in_time
from .._store.keys import TimerKeys
from .._store.lease import paused_text
from .._store.registry import Registry
from .._store.server import answered_at_start, eviction_policy
from .._store.timers import TimerStore
from .._version import __version__
from ..clients import Connection, ServerReplyError, is_transient
from .agenda import Agenda
from .backfill import Backfills
from .claimer import Claimer
from .context import EngineContext, Room, Running, State
from .hints import Hints
from .lease_keeper import LeaseKeeper
from .manual import ManualRuns
from .runner import Runner
from .settle import Settler
from .timer_claims import TimerClaimer
from .work import current_attempt

__all__ = ["Instance", "Reader"]

log = logging.getLogger("anarchon")

#: How many times a start tries its first registration before it gives up.
_START_TRIES = 3

#: A task that reads the store beside the engine, given the instance's connection.
Reader = Callable[[Connection], Coroutine[Any, Any, None]]

#: The instance behind each scheduler (``Instance.of``).
_INSTANCES: weakref.WeakKeyDictionary[object, Instance] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, eq=False, slots=True)
class _Started:
    """The parts that exist once the instance has started."""

    running: Running
    registry: Registry
    lease_keeper: LeaseKeeper
    settler: Settler
    runner: Runner
    claimer: Claimer
    manual: ManualRuns
    backfills: Backfills
    #: The registry's renewals (which the stop cancels) and their end.
    renewing: anyio.CancelScope
    renewed: anyio.Event


class Instance:
    """The engine of one scheduler: its parts, its lifecycle and its registration."""

    def __init__(
        self,
        owner: object,
        backend: RedisBackend[Any],
        context: EngineContext,
        *,
        history_size: int,
        history_ttl_ms: int | None,
        stop_grace_ms: int,
        default_id_pid: int | None = None,
    ) -> None:
        self.backend = backend
        self._default_id_pid = default_id_pid
        self.context = context
        self._history_size = history_size
        self._history_ttl_ms = history_ttl_ms
        self._stop_grace_ms = stop_grace_ms
        self.agenda = Agenda(context)
        self._hints = Hints(context, self.agenda, backend.prefix)
        self._stopped = anyio.Event()
        #: What exists from the start to the stop (None before the start).
        self._started: _Started | None = None
        #: Exits the task group (entered at the start) when the scheduler's block ends.
        self._exit_stack = AsyncExitStack()
        #: The grace period of a stop in progress (None until stop() is first called).
        self._grace: anyio.CancelScope | None = None
        self._readers: list[Reader] = []
        #: The fingerprint in force of each job, as this instance last wrote it.
        self._in_force_written: dict[str, str] = {}
        _INSTANCES[owner] = self

    @classmethod
    def create(
        cls, owner: object, backend: RedisBackend[Any], settings: SchedulerSettings
    ) -> Instance:
        """The instance of a scheduler (``owner``) with these settings."""
        context = EngineContext(
            jobs={},
            instance_id=settings.instance_id,
            lease_ms=settings.lease_ms,
            heartbeat_ms=settings.heartbeat_ms,
            retry_delay_ms=settings.retry_delay_ms,
            prefix=backend.prefix,
            timer_poll_ms=settings.timer_poll_ms,
            max_concurrent=settings.max_concurrent,
        )
        return cls(
            owner,
            backend,
            context,
            history_size=settings.history_size,
            history_ttl_ms=settings.history_ttl_ms,
            stop_grace_ms=settings.stop_grace_ms,
            default_id_pid=settings.default_id_pid,
        )

    @staticmethod
    def of(owner: object) -> Instance:
        """The instance behind a ``Scheduler``."""
        return _INSTANCES[owner]

    # ------------------------------------------------------------ what it does

    @property
    def state(self) -> State:
        return self.context.state

    @property
    def instance_id(self) -> str:
        return self.context.instance_id

    @property
    def jobs(self) -> Mapping[str, Job]:
        """The jobs of this instance, by name."""
        return self.context.jobs

    @property
    def timer_kinds(self) -> Mapping[str, TimerKind]:
        """The kinds of timer this instance fires, by name."""
        return self.context.timer_kinds

    @property
    def events(self) -> EventHub:
        """Where this instance's events go."""
        return self.context.events

    @property
    def running(self) -> int:
        """How many attempts and timer firings run here now."""
        return len(self.context.attempts)

    @property
    def server_down_since(self) -> float | None:
        """Since when (monotonic) the server has not answered; None while it answers."""
        return self.context.health.down_since

    @property
    def disabled(self) -> dict[str, str]:
        """The jobs that no longer claim slots here, with the reason."""
        return dict(self.context.disabled)

    @property
    def round_trip_sec(self) -> float:
        """How long one round trip to the server may take."""
        return self.context.round_trip_sec

    @property
    def server_offset_ms(self) -> float:
        """The server's clock minus this host's, as the last claim of timers saw it."""
        return self.context.server_offset_ms

    def room(self) -> Room:
        """This instance's room under its bound on handlers at once (``Capacity``)."""
        capacity = self.context.capacity
        bound = self.context.max_concurrent
        left = 0 if bound is None else max(bound - len(self.context.attempts), 0)
        waiting = self.agenda.waiting_for_room()
        fleet_waits = dict(self.context.fleet_waits)
        return Room(bound, left, capacity.waited_sec, capacity.deferred, waiting, fleet_waits)

    def leases_held(self) -> dict[str, int]:
        """The attempts (and timer firings) this instance runs, by job (timer kind).
        Safe from another thread: the keys are copied at once."""
        held: dict[str, int] = {}
        for job, _ in list(self.context.attempts):
            held[job] = held.get(job, 0) + 1
        return held

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def running_store(self) -> Store | None:
        """The instance's store while it runs; None otherwise."""
        started = self._started
        if started is None or self.context.state != "running":
            return None
        return started.running.store

    def running_connection(self) -> Connection | None:
        """The instance's connection while it runs; None otherwise."""
        store = self.running_store()
        return None if store is None else store.conn

    def _running(self, what: str) -> _Started:
        """The started parts, for a call that needs a running instance (``what`` names
        it)."""
        started = self._started
        if started is None or self.context.state != "running":
            raise SchedulerStateError(f"{what} needs a running scheduler (inside `async with`)")
        return started

    def job(self, name: str) -> Job:
        """A job of this instance (an error that lists them, for a name it lacks)."""
        found = self.context.jobs.get(name)
        if found is None:
            raise InvalidJobError(
                f"no job named {name!r} on this scheduler; jobs: {list(self.context.jobs)}"
            )
        return found

    async def history(self, job: str, limit: int) -> list[RunResult]:
        """The job's results, read within three round trips (``ConnectionFailedError``
        after, or on a lost connection, as the ``Inspector``'s reads)."""
        store = self._running("history()").running.store
        if limit < 1:
            raise InvalidOptionError(f"limit must be 1 or more, got {limit}")
        with answered_in_time(self.context.round_trip_sec * 3):
            return await store.history(job, limit)

    async def set_paused(
        self, job: str, *, paused: bool, note: str | None = None, by: str | None = None
    ) -> bool:
        """Pause or resume a job across the fleet (``Scheduler.pause`` says how), said in
        the audit log; whether it changed anything."""
        what = "pause()" if paused else "resume()"
        store = self._running(what).running.store
        self.job(job)
        note, who_acts = check_note(note), who(by)
        paused_by = paused_text(who_acts, note) if paused else None
        with answered_in_time(self.context.round_trip_sec * 3):
            changed = await store.set_paused(job, paused_by)
        if changed:
            action = "pause" if paused else "resume"
            await record_audit(
                store.conn, store.prefix, action, job, who_acts, note,
                within_sec=self.context.round_trip_sec,
            )  # fmt: skip
        if paused:
            log.info("%s: paused%s", job, "" if changed else " (it was paused already)")
        else:
            log.info("%s: resumed%s", job, "" if changed else " (it was not paused)")
        return changed

    # ---------------------------------------------------------- before the start

    def rename(self, instance_id: str) -> None:
        """Another instance id, before the start (checked by the caller)."""
        if self.context.state != "new":
            raise SchedulerStateError("an instance id can only change before the start")
        self.context.instance_id = instance_id
        self._default_id_pid = None

    def read_beside(self, reader: Reader) -> None:
        """Run ``reader`` with the instance's connection from the start to the stop,
        which cancels it before the connection closes."""
        if self.context.state != "new":
            raise SchedulerStateError("a reader of the store is added before the start")
        self._readers.append(reader)

    def trace_with(self, tracing: Tracing) -> None:
        """Spans of attempts and claims from the next one on."""
        self.context.tracing = tracing

    # --------------------------------------------------------------- registration

    def add_job(self, job: Job) -> None:
        """A job of this instance; added while it runs, its first slot is the next one
        after now (no catch-up before it was added)."""
        self.context.jobs[job.name] = job
        if self.context.state == "running":
            now_ms = wall_ms()
            self.context.first_seen_ms.setdefault(job.name, int(now_ms))
            self.agenda.schedule_first_slots(job, now_ms)
            self._listen_for_hints()

    def add_timer_kind(self, kind: TimerKind) -> None:
        self.context.timer_kinds[kind.name] = kind
        if self.context.state == "running":
            self._claim_timers_now(kind)
            self._listen_for_hints()

    def copy_to(self, other: Instance) -> None:
        """Give ``other`` (a new instance) this instance's jobs and timer kinds."""
        for job in self.context.jobs.values():
            other.add_job(job)
        for kind in self.context.timer_kinds.values():
            other.add_timer_kind(kind)

    def fires_here(self, kind: str) -> bool:
        """Whether this instance runs and fires ``kind``."""
        return self.context.state == "running" and kind in self.context.timer_kinds

    def timer_set_here(self, kind: str, keys: TimerKeys, wake_ms: float) -> None:
        """A timer of a kind that ``fires_here``, set through this instance, falls due at
        ``wake_ms``: the agenda looks then (it may be sooner than it would have looked)."""
        self.agenda.timer_due(kind, keys, wake_ms)

    def _listen_for_hints(self) -> None:
        """From the first timer kind registered on (or the first job, with a store whose
        runs are given back and asked for by hints), hear of timers set elsewhere to fall
        due sooner than this instance would look, and of runs given back by stopping
        instances or asked of the fleet (``hints.py``)."""
        started, context = self._started, self.context
        if started is None or self._hints.listening:
            return
        store = started.running.store
        if context.timer_kinds or (context.jobs and store.hints_for_jobs):
            self._hints.listening = True
            started.running.group.start_soon(self._hints.listen, store.conn)

    def _claim_timers_now(self, kind: TimerKind) -> None:
        now = wall_ms()
        for bucket in range(kind.buckets):
            keys = TimerKeys.for_kind(self.backend.prefix, kind.name, bucket, kind.buckets)
            self.agenda.timer_due(kind.name, keys, now)

    # ---------------------------------------------------------------------- start

    async def start(self) -> None:
        context = self.context
        if context.state != "new":
            raise SchedulerStateError(
                f"this scheduler is {context.state}; a Scheduler starts once: create a new one"
            )
        if self._default_id_pid not in (None, os.getpid()):
            # Made before a fork (gunicorn --preload): this child is an instance of its own.
            context.instance_id = default_instance_id()
        options: StoreOptions = {
            "runner": context.instance_id,
            "history_size": self._history_size,
            "history_ttl_ms": self._history_ttl_ms,
        }
        store = await self.backend.open(options)
        registry = Registry(
            self.backend.prefix,
            context.instance_id,
            self.backend.strategy,
            store.remembered_slots_key,
            context.max_concurrent,
        )
        # Also when no kind is registered yet: add_timer may come later.
        timer_store = TimerStore(store.conn, prefix=self.backend.prefix, runner=context.instance_id)
        try:
            with answered_at_start(store.conn):
                await store.prepare_jobs(list(context.jobs))
            if context.timer_kinds:
                await self._prepare_timers(timer_store)
            context.first_seen_ms = await self._first_registration(store, registry)
            group = await self._exit_stack.enter_async_context(anyio.create_task_group())
        except BaseException:
            await store.conn.close_if_owned()
            raise
        started = self._started = self._make_parts(Running(store, timer_store, group), registry)
        context.state = "running"
        now = wall_ms()
        for job in context.jobs.values():
            self.agenda.schedule_first_slots(job, now)
        for kind in context.timer_kinds.values():
            self._claim_timers_now(kind)
        group.start_soon(started.claimer.claim_loop)
        group.start_soon(self._keep_registered, started)
        group.start_soon(started.lease_keeper.keep_leases)
        if store.backfills:
            self._hints.on_backfill = started.backfills.asked
        self._listen_for_hints()
        jobs, kinds = list(context.jobs), list(context.timer_kinds)
        log.info(
            "anarchon %s started: instance %s, %d job(s)%s%s, server %s, prefix %r, strategy %s",
            __version__,
            context.instance_id,
            len(jobs),
            f" ({', '.join(jobs)})" if jobs else "",
            f", timer kinds {', '.join(kinds)}" if kinds else "",
            self.backend.where(),
            self.backend.prefix,
            self.backend.strategy,
            extra={"instance": context.instance_id},
        )

    def _make_parts(self, running: Running, registry: Registry) -> _Started:
        """The parts that talk to the server, each given the others it calls."""
        context, store, timer_store = self.context, running.store, running.timer_store
        lease_keeper = LeaseKeeper(context, store, timer_store)
        settler = Settler(context, store, timer_store, self.agenda)
        runner = Runner(context, running.group, self.agenda, settler, lease_keeper)
        timers = TimerClaimer(context, timer_store, running.group, self.agenda, runner, settler)
        claimer = Claimer(context, store, self.agenda, runner, settler, timers)
        manual = ManualRuns(context, store, claimer, runner, settler)
        return _Started(
            running=running,
            registry=registry,
            lease_keeper=lease_keeper,
            settler=settler,
            runner=runner,
            claimer=claimer,
            manual=manual,
            backfills=Backfills(context, store, manual, running.group),
            renewing=anyio.CancelScope(),
            renewed=anyio.Event(),
        )

    async def _prepare_timers(self, timer_store: TimerStore) -> None:
        """Before the first claim of timers: each kind's number of buckets is the one the
        store knows (written by the first instance), and a warning if the server may
        evict timers."""
        for kind in self.context.timer_kinds.values():
            with answered_at_start(timer_store.conn):
                count = await timer_store.agree_buckets(kind.name, kind.buckets)
            if count != kind.buckets:
                raise InvalidOptionError(
                    f"timer kind {kind.name!r} has {count} bucket(s) in the store, and "
                    f"this scheduler gives it {kind.buckets}: every instance must give the "
                    "same number (timers set under another number would never fire)"
                )
        await self._warn_if_timers_may_be_evicted(timer_store.conn)

    async def _warn_if_timers_may_be_evicted(self, conn: Connection) -> None:
        """Timers live as long as the server keeps their keys: a policy that evicts keys
        under memory pressure may drop them. A server that does not tell its policy is
        said to, with how to look."""
        try:
            with anyio.fail_after(self.context.round_trip_sec):
                policy = await eviction_policy(conn)
        except Exception as exc:  # refused (NOPERM), not told, or no answer in time
            log.info(
                "could not read maxmemory-policy (%s): timers are keys without an expiry, "
                "and a server that evicts keys may drop them. An operator checks it with "
                "'INFO memory' (maxmemory_policy) or 'CONFIG GET maxmemory-policy' as a "
                "user that may: noeviction or a volatile-* policy keeps timers",
                str(exc) or type(exc).__name__,
            )
            return
        if policy != "noeviction" and not policy.startswith("volatile"):
            log.warning(
                "the server's maxmemory-policy is %r: under memory pressure it may evict "
                "timers (they are keys without an expiry); use noeviction (or a volatile-* "
                "policy) for a server that holds timers",
                policy,
            )

    async def _keep_registered(self, started: _Started) -> None:
        """Renew this instance's registration until the stop, which ends this (a renewal
        in flight too) before it withdraws the registration; the readers of the store
        run beside it."""
        try:
            with started.renewing:
                async with anyio.create_task_group() as group:
                    for reader in self._readers:
                        group.start_soon(reader, started.running.store.conn)
                    await self._renew_until_stopped(started)
                    group.cancel_scope.cancel()
        finally:
            started.renewed.set()

    async def _renew_until_stopped(self, started: _Started) -> None:
        """Every third of the registration's life: renew it, follow the definitions in
        force, report the malformed entries met, and look for backfills to drive."""
        store, registry = started.running.store, started.registry
        context = self.context
        while context.state == "running":
            with anyio.move_on_after(pace().registration_ttl_ms / 3000):
                await context.stopping.wait()
            if context.state != "running":
                return
            try:
                with anyio.fail_after(context.round_trip_sec * 3):
                    await registry.register(
                        store.conn,
                        context.jobs,
                        context.timer_kinds,
                        self.agenda.next_slot_ms,
                        len(context.attempts),
                    )
                    await self._follow_definitions(store, registry)
                    await registry.report_quarantine(store.conn)
                if store.backfills:
                    await started.backfills.look()
            except Exception as exc:
                log.debug("renewing the registration failed (tried again later): %s", exc)

    async def _first_registration(self, store: Store, registry: Registry) -> dict[str, int]:
        """Register before the first claim (when each job first appeared, and which
        definitions are in force): tried ``_START_TRIES`` times, each within three round
        trips (a loaded machine, a server busy for a moment), then
        ``ConnectionFailedError``. The server's own refusal (NOPERM, ...) is final."""
        context = self.context
        within_sec = context.round_trip_sec * 3
        failure: BaseException | str = "no reply in time"
        for _ in range(_START_TRIES):
            with anyio.move_on_after(within_sec):
                try:
                    first_seen = await registry.register(
                        store.conn, context.jobs, context.timer_kinds, {}, 0
                    )
                    await self._follow_definitions(store, registry)
                    return first_seen
                except ServerReplyError as exc:
                    if not is_transient(exc):
                        raise
                    failure = exc
                except Exception as exc:
                    failure = exc
        raise ConnectionFailedError(
            f"registering instance {context.instance_id} got no answer in {_START_TRIES} tries "
            f"(each within {within_sec:.2f} s; last: {reason(failure)}); is the server "
            "reachable, and answering in time?"
        )

    async def _follow_definitions(self, store: Store, registry: Registry) -> None:
        """After a registration: which of the jobs' definitions here are in force (the
        others' new slots are not claimed here), and the fingerprints in force written
        where the claims read them, when they changed (or a claim found the store's out
        of date)."""
        context = self.context
        context.fingerprints = dict(registry.fingerprints)
        changed = {}
        for name, own in registry.fingerprints.items():
            in_force = registry.in_force.get(name, "")
            told_by_claim = context.outdated.get(name) == ""
            context.follow_definition(name, own, in_force)
            if in_force and (self._in_force_written.get(name) != in_force or told_by_claim):
                changed[name] = in_force
        if changed:
            await store.set_in_force(changed)
            self._in_force_written.update(changed)

    # ----------------------------------------------------------------------- stop

    async def exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Leave ``async with``: stop (shielded), then exit the task group."""
        with anyio.CancelScope(shield=True):
            await self.stop(None)
        return await self._exit_stack.__aexit__(exc_type, exc, tb)

    async def stop(self, grace_ms: int | None) -> None:
        """See ``Scheduler.stop``."""
        context = self.context
        started = self._started
        if started is None:
            context.state = "stopped"
            context.events.close()
            self._stopped.set()
            return
        grace_sec = (self._stop_grace_ms if grace_ms is None else grace_ms) / 1000
        if self._grace is None:
            self._grace = anyio.CancelScope(deadline=anyio.current_time() + grace_sec)
            started.running.group.start_soon(self._stop, started, self._grace, name="anarchon stop")
        else:
            self._grace.deadline = min(self._grace.deadline, anyio.current_time() + grace_sec)
        if current_attempt.get() is not None:
            return  # from a handler: waiting here would wait for itself
        await self._stopped.wait()

    async def _stop(self, started: _Started, grace: anyio.CancelScope) -> None:
        """The stop itself, in the instance's task group, shielded: whoever asked for it
        may be cancelled, the stop still completes, and it always ends stopped."""
        context = self.context
        conn = started.running.store.conn
        with anyio.CancelScope(shield=True):
            try:
                context.begin_stopping()
                self._hints.stop()
                self.agenda.wake()
                await started.claimer.loop_done.wait()
                await started.claimer.release_unanswered()
                with grace:
                    await started.runner.wait_idle()
                started.runner.cancel_all("the scheduler is stopping")
                await started.runner.wait_idle()
                started.renewing.cancel()
                await started.renewed.wait()
                await started.registry.withdraw(conn, context.round_trip_sec)
                if conn.owned:
                    with anyio.move_on_after(context.round_trip_sec):
                        await conn.aclose()
            except Exception:
                log.exception("stopping the scheduler failed; it is stopped all the same")
            finally:
                context.state = "stopped"
                started.lease_keeper.wake()  # the lease keeper ends
                self._stopped.set()
                log.info("instance %s stopped", context.instance_id)
                context.events.close()

    # ------------------------------------------------------------------ run_now

    async def run_now(
        self, name: str, *, note: str | None = None, by: str | None = None
    ) -> RunResult:
        """See ``Scheduler.run_now``."""
        started = self._running("run_now()")
        job = self.job(name)
        note, who_acts = check_note(note), who(by)
        result = await started.manual.run_now(job)
        store = started.running.store
        await record_audit(
            store.conn, store.prefix, "run-now", name, who_acts, note,
            within_sec=self.context.round_trip_sec,
        )  # fmt: skip
        return result
