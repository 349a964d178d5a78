"""The scheduler: claims due slots, runs the ones it wins, keeps their leases alive.

``Scheduler`` is the public facade: it validates options, registers jobs, starts and
stops, and answers ``history`` and ``run_now``. The work is done by the parts in
``anarchon._engine`` (agenda, claimer, runner, lease keeper, settle).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from contextlib import asynccontextmanager
from datetime import datetime
from types import TracebackType
from typing import Any, Generic, TypeVar, overload

import anyio

from ._engine._context import EngineContext, _now_ms
from ._engine._context import current_attempt as _current_attempt
from ._engine.agenda import Agenda
from ._engine.claimer import Claimer
from ._engine.hints import Hints
from ._engine.lease_keeper import LeaseKeeper
from ._engine.runner import Runner
from ._engine.settle import Settler
from ._errors import AnarchonError, InvalidJobError, InvalidOptionError, SchedulerStateError
from ._model.job import (
    Handler,
    Job,
    check_duration_ms,
    exception_types,
    is_async_callable,
    make_schedule,
    overlap_policy,
    takes_run_argument,
    validate_job_name,
)
from ._model.schedule import Schedule, SlotClock, from_epoch_ms, iso_ms
from ._model.timer import Recurrence, TimerKind, due_from, validate_kind, validate_timer_key
from ._model.values import OverlapPolicy, RunResult, TimerInfo, TimerSetting
from ._observe.events import Event, EventStream, TimerCancelled, TimerSet
from ._store.backend import ClaimOnly, K, Leases, RedisBackend
from ._store.contract import ClaimReply, Store, manual_slot_id
from ._store.lease import LeaseStore
from ._store.registry import REGISTRATION_TTL_MS, Registry
from ._store.timers import TimerKeys, TimerStore, decode_payload, encode_payload
from ._version import __version__
from .clients import Connection

__all__ = ["Scheduler"]

log = logging.getLogger("anarchon")

#: ``set_timers`` sends its timers in round trips of this many.
_SET_TIMERS_PER_ROUND_TRIP = 1000

F = TypeVar("F", bound=Callable[..., Any])


def _refuse_lease_options(strategy: str, **options: object) -> None:
    given = sorted(name for name, value in options.items() if value is not None)
    if given:
        raise InvalidOptionError(
            f"{', '.join(given)}: lease option(s) that the {strategy!r} strategy does not have "
            "(it holds no leases: no backups, retries, overlap protection or catch-up); drop "
            "them, or use the 'lease' strategy"
        )


def _check_buckets(buckets: object) -> int:
    if isinstance(buckets, bool) or not isinstance(buckets, int) or not 1 <= buckets <= 1024:
        raise InvalidOptionError(f"buckets must be a whole number from 1 to 1024, got {buckets!r}")
    return buckets


def _check_instance_id(instance_id: object) -> str:
    if not isinstance(instance_id, str) or not instance_id or "|" in instance_id:
        raise InvalidOptionError(
            f"instance_id must be a non-empty string without '|', got {instance_id!r}"
        )
    return instance_id


def _default_instance_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Scheduler(Generic[K]):
    """Runs jobs so that each scheduled slot runs exactly once across all instances.

    Start it with ``async with``; leaving the block stops it gracefully::

        scheduler = Scheduler(backend=RedisBackend(redis="redis://localhost:6379"))

        @scheduler.job("*/5 * * * *", max_attempts=3)
        async def sync(run: Run) -> None:
            ...

        async with scheduler:
            await anyio.sleep_forever()

    ``lease_ms`` is how long a won run is held without a heartbeat;
    ``heartbeat_ms`` (at most half of it; by default a third) how often the runner
    extends it.
    ``stop_grace_ms`` is how long ``stop()`` lets running handlers finish before
    cancelling them and releasing their leases. ``retry_delay_ms`` is the delay
    before the second attempt of a failed run, doubling for each later one.
    ``timer_poll_ms`` (1 s) is how long an instance waits at most between two claims
    of a timer kind's due timers: a timer set elsewhere to fire sooner than anything
    the instance knew of is seen by then, or at once through its published hint where
    the client can subscribe (one set through this scheduler always at once).
    The lease options (``lease_ms``, ``heartbeat_ms``, ``retry_delay_ms``; on jobs
    ``overlap``, ``max_attempts``, ``catch_up_ms``) exist only with the lease
    strategy: with a claim-only backend they are a type error, and an error if
    passed anyway.
    """

    @overload
    def __init__(
        self: Scheduler[Leases],
        backend: RedisBackend[Leases] | None = None,
        *,
        lease_ms: int = 30_000,
        heartbeat_ms: int | None = None,
        history_size: int = 1000,
        history_ttl_ms: int | None = None,
        instance_id: str | None = None,
        stop_grace_ms: int = 30_000,
        retry_delay_ms: int = 1_000,
        timer_poll_ms: int = 1_000,
    ) -> None: ...

    @overload
    def __init__(
        self: Scheduler[ClaimOnly],
        backend: RedisBackend[ClaimOnly],
        *,
        history_size: int = 1000,
        history_ttl_ms: int | None = None,
        instance_id: str | None = None,
        stop_grace_ms: int = 30_000,
    ) -> None: ...

    def __init__(
        self,
        backend: RedisBackend[Any] | None = None,
        *,
        lease_ms: int | None = None,
        heartbeat_ms: int | None = None,
        history_size: int = 1000,
        history_ttl_ms: int | None = None,
        instance_id: str | None = None,
        stop_grace_ms: int = 30_000,
        retry_delay_ms: int | None = None,
        timer_poll_ms: int | None = None,
    ) -> None:
        if backend is None:
            backend = RedisBackend()
        if not isinstance(backend, RedisBackend):
            raise InvalidOptionError(
                f"backend must be a RedisBackend or ValkeyBackend, got {type(backend).__name__}"
            )
        self.backend = backend
        if not backend.leases:
            _refuse_lease_options(
                backend.strategy,
                lease_ms=lease_ms,
                heartbeat_ms=heartbeat_ms,
                retry_delay_ms=retry_delay_ms,
                timer_poll_ms=timer_poll_ms,
            )
        self.lease_ms = check_duration_ms("lease_ms", 30_000 if lease_ms is None else lease_ms)
        # By default a third of the lease (10 s for the default 30 s lease).
        self.heartbeat_ms = check_duration_ms(
            "heartbeat_ms", max(self.lease_ms // 3, 1) if heartbeat_ms is None else heartbeat_ms
        )
        if self.heartbeat_ms * 2 > self.lease_ms:
            raise InvalidOptionError(
                f"heartbeat_ms ({self.heartbeat_ms}) must be at most half of lease_ms "
                f"({self.lease_ms}), so that a late heartbeat still arrives before the lease "
                "expires; leave heartbeat_ms out to get a third of the lease"
            )
        if (
            isinstance(history_size, bool)
            or not isinstance(history_size, int)
            or (history_size < 1)
        ):
            raise InvalidOptionError(
                f"history_size must be a whole number of runs, 1 or more, got {history_size!r}"
            )
        self.history_size = history_size
        self.history_ttl_ms = (
            None if history_ttl_ms is None else check_duration_ms("history_ttl_ms", history_ttl_ms)
        )
        self.stop_grace_ms = check_duration_ms("stop_grace_ms", stop_grace_ms, allow_zero=True)
        self.retry_delay_ms = check_duration_ms(
            "retry_delay_ms", 1_000 if retry_delay_ms is None else retry_delay_ms, allow_zero=True
        )
        self.instance_id = _check_instance_id(
            _default_instance_id() if instance_id is None else instance_id
        )

        self._context = EngineContext(
            jobs={},
            instance_id=self.instance_id,
            lease_ms=self.lease_ms,
            heartbeat_ms=self.heartbeat_ms,
            retry_delay_ms=self.retry_delay_ms,
            prefix=self.backend.prefix,
            timer_poll_ms=check_duration_ms(
                "timer_poll_ms", 1_000 if timer_poll_ms is None else timer_poll_ms
            ),
        )
        self._agenda = Agenda(self._context)
        self._lease_keeper = LeaseKeeper(self._context)
        self._settler = Settler(self._context, self._agenda)
        self._runner = Runner(self._context, self._agenda, self._settler, self._lease_keeper)
        self._claimer = Claimer(self._context, self._agenda, self._runner, self._settler)
        self._hints = Hints(self._context, self._agenda, self.backend.prefix)
        self._stopped = anyio.Event()
        #: The number of buckets of kinds without a handler here, as the store said.
        self._stored_buckets: dict[str, int] = {}
        #: This instance's registration in the store (from start on), its renewals (which
        #: the stop cancels) and their end.
        self._registry: Registry | None = None
        self._renewing: anyio.CancelScope | None = None
        self._renewed: anyio.Event | None = None
        #: The grace period of a stop in progress (None until stop() is first called).
        self._grace: anyio.CancelScope | None = None
        #: Tasks that read the store beside the engine (``anarchon.prometheus``'s gauges),
        #: given the scheduler's connection; they end with the registry's renewals.
        self._readers: list[Callable[[Connection], Coroutine[Any, Any, None]]] = []

    def _rename(self, instance_id: str) -> None:
        """Give a scheduler that has not started another instance id (``anarchon run
        --instance-id``)."""
        if self._context.state != "new":
            raise SchedulerStateError("an instance id can only change before the start")
        self.instance_id = self._context.instance_id = _check_instance_id(instance_id)

    @property
    def _store(self) -> Store | None:
        """The store, once started (the one object every part reads it through)."""
        return self._context.store

    # ------------------------------------------------------------------ jobs

    @overload
    def job(
        self: Scheduler[Leases],
        schedule: str | Schedule | None = None,
        *,
        every_ms: int | None = None,
        name: str | None = None,
        timezone: str = "UTC",
        overlap: OverlapPolicy | bool = "skip",
        max_attempts: int = 3,
        catch_up_ms: int = 0,
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
        timeout_ms: int | None = None,
        retry_delay_ms: int | None = None,
        retry_on: type[Exception] | tuple[type[Exception], ...] | None = None,
    ) -> Callable[[F], F]: ...

    @overload
    def job(
        self: Scheduler[ClaimOnly],
        schedule: str | Schedule | None = None,
        *,
        every_ms: int | None = None,
        name: str | None = None,
        timezone: str = "UTC",
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
        timeout_ms: int | None = None,
    ) -> Callable[[F], F]: ...

    def job(
        self,
        schedule: str | Schedule | None = None,
        *,
        every_ms: int | None = None,
        name: str | None = None,
        timezone: str = "UTC",
        overlap: OverlapPolicy | bool | None = None,
        max_attempts: int | None = None,
        catch_up_ms: int | None = None,
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
        timeout_ms: int | None = None,
        retry_delay_ms: int | None = None,
        retry_on: type[Exception] | tuple[type[Exception], ...] | None = None,
    ) -> Callable[[F], F]:
        """Register the decorated function as a job; see ``add_job`` for the options."""

        def register(handler: F) -> F:
            self._add_job(
                handler,
                schedule,
                every_ms=every_ms,
                name=name,
                timezone=timezone,
                overlap=overlap,
                max_attempts=max_attempts,
                catch_up_ms=catch_up_ms,
                jitter_ms=jitter_ms,
                max_late_ms=max_late_ms,
                timeout_ms=timeout_ms,
                retry_delay_ms=retry_delay_ms,
                retry_on=retry_on,
            )
            return handler

        return register

    @overload
    def add_job(
        self: Scheduler[Leases],
        handler: Handler,
        schedule: str | Schedule | None = None,
        *,
        every_ms: int | None = None,
        name: str | None = None,
        timezone: str = "UTC",
        overlap: OverlapPolicy | bool = "skip",
        max_attempts: int = 3,
        catch_up_ms: int = 0,
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
        timeout_ms: int | None = None,
        retry_delay_ms: int | None = None,
        retry_on: type[Exception] | tuple[type[Exception], ...] | None = None,
    ) -> None: ...

    @overload
    def add_job(
        self: Scheduler[ClaimOnly],
        handler: Handler,
        schedule: str | Schedule | None = None,
        *,
        every_ms: int | None = None,
        name: str | None = None,
        timezone: str = "UTC",
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
        timeout_ms: int | None = None,
    ) -> None: ...

    def add_job(
        self,
        handler: Handler,
        schedule: str | Schedule | None = None,
        *,
        every_ms: int | None = None,
        name: str | None = None,
        timezone: str = "UTC",
        overlap: OverlapPolicy | bool | None = None,
        max_attempts: int | None = None,
        catch_up_ms: int | None = None,
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
        timeout_ms: int | None = None,
        retry_delay_ms: int | None = None,
        retry_on: type[Exception] | tuple[type[Exception], ...] | None = None,
    ) -> None:
        """Register a job.

        ``schedule`` is a 5-field cron string, a 6-field one with seconds first,
        or an object with ``next_after(datetime)``; ``every_ms`` instead fires at
        fixed intervals aligned to the Unix epoch. ``timezone`` is an IANA name.
        ``jitter_ms`` (default 0) waits a random part of it before claiming;
        ``max_late_ms`` (default 60 s) is how late a slot may still be claimed for
        the first time. With the lease strategy: ``overlap`` is what a slot does
        while an older run of the job is unsettled: ``"skip"`` (the default; the slot
        is recorded as skipped), ``"wait"`` (it runs when that run ends; at most one
        slot waits) or ``"allow"`` (it runs at once); False and True are aliases of
        skip and allow; ``max_attempts`` (default 3)
        counts every attempt, crashed or failed; ``catch_up_ms`` (default 0) runs
        slots missed in that window on start and after a gap; ``retry_delay_ms`` (the
        scheduler's by default) is the delay before the second attempt, doubling for each
        later one; ``retry_on`` (an exception class or a tuple of them) retries only
        those: any other exception fails the run at once. ``timeout_ms`` (with every
        strategy) is how long an attempt may run: an async handler is then cancelled, a
        plain function sees ``run.lease_lost`` set (it cannot be interrupted, and is
        waited for), and the attempt is recorded as failed with a ``TimeoutError``
        (retried like any failure, if ``retry_on`` allows it).

        Jobs can be added while the scheduler runs; their first slot is the
        next one after now.
        """
        self._add_job(
            handler,
            schedule,
            every_ms=every_ms,
            name=name,
            timezone=timezone,
            overlap=overlap,
            max_attempts=max_attempts,
            catch_up_ms=catch_up_ms,
            jitter_ms=jitter_ms,
            max_late_ms=max_late_ms,
            timeout_ms=timeout_ms,
            retry_delay_ms=retry_delay_ms,
            retry_on=retry_on,
        )

    def _add_job(
        self,
        handler: Handler,
        schedule: str | Schedule | None,
        *,
        every_ms: int | None,
        name: str | None,
        timezone: str,
        overlap: OverlapPolicy | bool | None,
        max_attempts: int | None,
        catch_up_ms: int | None,
        jitter_ms: int,
        max_late_ms: int,
        timeout_ms: int | None,
        retry_delay_ms: int | None,
        retry_on: type[Exception] | tuple[type[Exception], ...] | None,
    ) -> None:
        if not callable(handler):
            raise InvalidJobError(f"a job's handler must be callable, got {handler!r}")
        job_name = validate_job_name(
            name if name is not None else getattr(handler, "__name__", None)
        )
        if job_name in self._context.jobs:
            raise InvalidJobError(
                f"a job named {job_name!r} already exists on this scheduler; give one of them "
                "another name with name=..."
            )
        if not self.backend.leases:
            _refuse_lease_options(
                self.backend.strategy,
                overlap=overlap,
                max_attempts=max_attempts,
                catch_up_ms=catch_up_ms,
                retry_delay_ms=retry_delay_ms,
                retry_on=retry_on,
            )
        attempts = 3 if max_attempts is None else max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise InvalidOptionError(
                f"max_attempts must be a whole number, 1 or more, got {max_attempts!r}"
            )
        job_schedule = make_schedule(schedule, every_ms, timezone)
        job = Job(
            name=job_name,
            handler=handler,
            schedule=job_schedule,
            clock=SlotClock(job_schedule),
            overlap_policy=overlap_policy(overlap),
            max_attempts=attempts if self.backend.leases else 1,
            catch_up_ms=check_duration_ms(
                "catch_up_ms", 0 if catch_up_ms is None else catch_up_ms, allow_zero=True
            ),
            jitter_ms=check_duration_ms("jitter_ms", jitter_ms, allow_zero=True),
            max_late_ms=check_duration_ms("max_late_ms", max_late_ms, allow_zero=True),
            takes_run=takes_run_argument(handler, job_name),
            is_async=is_async_callable(handler),
            timeout_ms=None if timeout_ms is None else check_duration_ms("timeout_ms", timeout_ms),
            retry_delay_ms=None
            if retry_delay_ms is None
            else check_duration_ms("retry_delay_ms", retry_delay_ms, allow_zero=True),
            retry_on=exception_types("retry_on", retry_on),
        )
        window_ms = self.backend.script_window_ms
        if window_ms is not None and job.late_window_ms >= window_ms:
            raise InvalidOptionError(
                f"job {job_name!r}: jitter_ms + max_late_ms ({job.late_window_ms}) must be less "
                f"than the script strategy's window_ms ({window_ms}), or a late claim could find "
                "the slot forgotten and run it again; lower max_late_ms or raise window_ms"
            )
        duration_sec = self.backend.idmp_duration_sec
        if duration_sec is not None and job.late_window_ms >= duration_sec * 1000:
            raise InvalidOptionError(
                f"job {job_name!r}: jitter_ms + max_late_ms ({job.late_window_ms} ms) must be "
                f"less than the idmp strategy's duration_sec ({duration_sec} s), or a late claim "
                "could come after Redis forgot the slot's id and run it again; lower "
                "max_late_ms or jitter_ms, or raise duration_sec"
            )
        self._context.jobs[job_name] = job
        if self._context.state == "running":
            assert self._store is not None
            # Its first slot is the next one: no catch-up before it was added.
            now_ms = _now_ms()
            self._context.first_seen_ms.setdefault(job_name, int(now_ms))
            self._agenda.schedule_first_slots(job, now_ms)
            self._listen_for_hints()

    @property
    def jobs(self) -> list[str]:
        """The names of the registered jobs."""
        return list(self._context.jobs)

    # ---------------------------------------------------------------- timers

    def timer(
        self: Scheduler[Leases],
        kind: str,
        *,
        max_attempts: int = 3,
        retry_delay_ms: int | None = None,
        buckets: int = 1,
    ) -> Callable[[F], F]:
        """Register the decorated function as the handler of a kind of timer; see
        ``add_timer`` for the options::

            @scheduler.timer("remind")
            async def remind(fire: TimerRun) -> None:
                await send_reminder(fire.key, fire.payload)
        """

        def register(handler: F) -> F:
            self.add_timer(
                handler, kind, max_attempts=max_attempts, retry_delay_ms=retry_delay_ms,
                buckets=buckets,
            )  # fmt: skip
            return handler

        return register

    def add_timer(
        self: Scheduler[Leases],
        handler: Callable[..., Any],
        kind: str,
        *,
        max_attempts: int = 3,
        retry_delay_ms: int | None = None,
        buckets: int = 1,
    ) -> None:
        """Register the handler of a kind of timer. Every key's timer of that kind set
        with ``set_timer`` (by any process) fires through it, on one instance of the
        fleet, with the jobs' lease rules (takeover of a dead runner, heartbeats,
        fences). ``max_attempts`` (3) counts failed and crashed attempts (a firing given
        back by a stopping instance is not counted); ``retry_delay_ms`` (the scheduler's
        by default) doubles per attempt; ``buckets`` (1) spreads the kind over that many
        hash tags, so that a Redis Cluster spreads it over its nodes. The first instance
        writes the number in the store; an instance that gives another refuses to start,
        and a process that only sets timers reads it from there.
        """
        if not callable(handler):
            raise InvalidJobError(f"a timer's handler must be callable, got {handler!r}")
        if not self.backend.leases:
            raise InvalidOptionError(
                f"timers fire with the lease strategy's rules; this scheduler's backend uses "
                f"{self.backend.strategy!r}: use a backend with the 'lease' strategy (the "
                "default) for the scheduler that fires timers"
            )
        name = validate_kind(kind)
        if name in self._context.timer_kinds:
            raise InvalidJobError(f"a timer kind named {name!r} already has a handler here")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise InvalidOptionError(
                f"max_attempts must be a whole number, 1 or more, got {max_attempts!r}"
            )
        timer_kind = TimerKind(
            name=name,
            handler=handler,
            max_attempts=max_attempts,
            retry_delay_ms=None
            if retry_delay_ms is None
            else check_duration_ms("retry_delay_ms", retry_delay_ms, allow_zero=True),
            buckets=_check_buckets(buckets),
            takes_run=takes_run_argument(handler, name),
            is_async=is_async_callable(handler),
        )
        self._context.timer_kinds[name] = timer_kind
        if self._context.state == "running":
            self._claim_timers_now(timer_kind)
            self._listen_for_hints()

    @property
    def timer_kinds(self) -> list[str]:
        """The kinds of timer this scheduler fires."""
        return list(self._context.timer_kinds)

    def _listen_for_hints(self) -> None:
        """From the first job or timer kind registered on (with leases), hear of timers set
        elsewhere to fall due sooner than this instance would look, and of runs given
        back by stopping instances (``_engine/hints.py``)."""
        context = self._context
        group = context.group
        wanted = context.timer_kinds or (context.jobs and self.backend.leases)
        if group is not None and wanted and not self._hints.listening:
            self._hints.listening = True
            group.start_soon(self._hints.listen)

    def _claim_timers_now(self, kind: TimerKind) -> None:
        now = _now_ms()
        for bucket in range(kind.buckets):
            keys = TimerKeys.for_kind(self.backend.prefix, kind.name, bucket, kind.buckets)
            self._agenda.timer_due(kind.name, keys, now)

    async def _buckets_of(self, timers: TimerStore, kind: str, buckets: int | None) -> int:
        """A kind's number of buckets: the registered handler's, else the one given, else
        the one the kind's instances wrote in the store (read once), else 1."""
        registered = self._context.timer_kinds.get(kind)
        if registered is not None:
            if buckets is not None and _check_buckets(buckets) != registered.buckets:
                raise InvalidOptionError(
                    f"timer kind {kind!r} has {registered.buckets} bucket(s) here, not "
                    f"{buckets}: every process must use the same number"
                )
            return registered.buckets
        if buckets is not None:
            return _check_buckets(buckets)
        if kind not in self._stored_buckets:
            where = TimerKeys.buckets_key(self.backend.prefix, kind)
            with anyio.fail_after(self._context.round_trip_sec * 3):
                stored = await timers.conn.execute(("GET", where))
            try:
                count = 1 if stored is None else _check_buckets(int(stored))
            except (TypeError, ValueError, InvalidOptionError):
                raise InvalidOptionError(
                    f"the store holds {stored!r} as the number of buckets of timer kind "
                    f"{kind!r} ({where}), not a whole number from 1 to 1024: something else "
                    "wrote that key; pass buckets= as the kind's instances register it"
                ) from None
            self._stored_buckets[kind] = count
        return self._stored_buckets[kind]

    @asynccontextmanager
    async def _timers(self) -> AsyncIterator[TimerStore]:
        """The timers' store: on the scheduler's connection while it runs, else on a
        connection opened for the call (a process that only sets timers)."""
        if self._context.state == "running" and self._store is not None:
            yield TimerStore(self._store.conn, prefix=self.backend.prefix)
            return
        conn: Connection = await self.backend.open_connection()
        try:
            yield TimerStore(conn, prefix=self.backend.prefix)
        finally:
            if conn.owned:
                with anyio.move_on_after(5, shield=True):
                    await conn.aclose()

    async def set_timer(
        self,
        kind: str,
        key: str,
        *,
        at: datetime | None = None,
        delay_ms: int | None = None,
        cron: str | None = None,
        every_ms: int | None = None,
        timezone: str = "UTC",
        payload: object = None,
        buckets: int | None = None,
    ) -> int:
        """Set ``key``'s timer of ``kind``, replacing what was set before (the newest set
        wins), and return its generation (every set is a higher one).

        It is due ``at`` (an aware datetime) or ``delay_ms`` from now on the server's
        clock; ``cron=`` (with ``timezone=``) or ``every_ms=`` make it recur (first due
        at its first fire time, or at ``at``/``delay_ms`` if given). ``payload`` is
        bytes or a JSON-able value; the handler gets it back as it was. A firing of the
        key in flight goes on; the new setting is due once it ends. Works whether this
        scheduler runs or not (a process that only sets timers opens a connection for
        the call). Many at once: ``set_timers``::

            await scheduler.set_timer("remind", "user:42", delay_ms=30 * 60_000,
                                      payload={"text": "your cart"})
        """
        setting = TimerSetting(key, at, delay_ms, cron, every_ms, timezone, payload)
        (generation,) = await self.set_timers(kind, (setting,), buckets=buckets)
        return generation

    async def set_timers(
        self, kind: str, timers: Iterable[TimerSetting], *, buckets: int | None = None
    ) -> list[int]:
        """Set many timers of ``kind`` as ``set_timer`` sets one, in round trips of up to
        1000 timers (pipelined), and return their generations in order::

            await scheduler.set_timers("digest", [
                TimerSetting(f"tenant:{t.id}", cron="0 9 * * *", timezone=t.zone)
                for t in tenants
            ])

        Every setting is checked before anything is sent: a bad one raises (naming its
        key) and sets none. A failure on the way (the server unreachable, an error
        reply) raises; some of the timers may be set then, and calling again with the
        same settings is safe (the newest set wins)."""
        name = validate_kind(kind)
        encoded = [self._encode_timer(setting) for setting in timers]
        if not encoded:
            return []
        generations: list[int] = []
        async with self._timers() as store:
            bucket_count = await self._buckets_of(store, name, buckets)
            for start in range(0, len(encoded), _SET_TIMERS_PER_ROUND_TRIP):
                part = encoded[start : start + _SET_TIMERS_PER_ROUND_TRIP]
                with anyio.fail_after(self._context.round_trip_sec * 3):
                    replies = await store.set_many(name, part, bucket_count)
                fired_here = self._context.state == "running" and name in self._context.timer_kinds
                for (timer_key, _, delay, _, _), reply in zip(part, replies, strict=True):
                    if isinstance(reply, BaseException):
                        raise reply
                    generation, due_ms, replaced = reply
                    generations.append(generation)
                    if self._context.events.on:
                        self._context.events.emit(
                            TimerSet(
                                instance=self.instance_id, kind=name, key=timer_key,
                                generation=generation, due_ms=due_ms, replaced=replaced,
                            )
                        )  # fmt: skip
                    if fired_here:
                        # Due sooner than this instance would look: it looks then.
                        wake_ms = _now_ms() + delay if delay is not None else float(due_ms)
                        keys = store.keys(name, timer_key, bucket_count)
                        self._agenda.timer_due(name, keys, wake_ms)
        return generations

    def _encode_timer(self, setting: TimerSetting) -> tuple[str, int | None, int | None, str, str]:
        """A setting as the store's set takes it: ``(key, at_ms, delay_ms, schedule,
        payload)``; raises on a bad one."""
        timer_key = validate_timer_key(setting.key)
        try:
            at_ms, delay = due_from(setting.at, setting.delay_ms)
            recurrence = Recurrence.make(setting.cron, setting.every_ms, setting.timezone)
        except AnarchonError as exc:
            raise type(exc)(f"timer {timer_key!r}: {exc}") from exc
        if at_ms is None and delay is None:
            if recurrence is None:
                raise InvalidOptionError(
                    f"timer {timer_key!r} needs a due time: at= (an aware datetime), "
                    "delay_ms=, cron= or every_ms="
                )
            at_ms = recurrence.first_ms(int(_now_ms() + self._context.server_offset_ms))
        schedule = recurrence.encode() if recurrence else ""
        return timer_key, at_ms, delay, schedule, encode_payload(setting.payload)

    async def cancel_timer(self, kind: str, key: str, *, buckets: int | None = None) -> bool:
        """Cancel ``key``'s timer of ``kind``; False if it had none. A firing in flight
        goes on (nothing can call it back), but nothing follows it: no retry, rearm or
        recurrence."""
        name = validate_kind(kind)
        timer_key = validate_timer_key(key)
        async with self._timers() as timers:
            with anyio.fail_after(self._context.round_trip_sec * 3):
                bucket_count = await self._buckets_of(timers, name, buckets)
                found = await timers.cancel(name, timer_key, bucket_count)
        if self._context.events.on:
            self._context.events.emit(
                TimerCancelled(instance=self.instance_id, kind=name, key=timer_key, found=found)
            )
        return found

    async def get_timer(
        self, kind: str, key: str, *, buckets: int | None = None
    ) -> TimerInfo | None:
        """``key``'s timer of ``kind`` as the store holds it, or None."""
        name = validate_kind(kind)
        timer_key = validate_timer_key(key)
        async with self._timers() as timers:
            with anyio.fail_after(self._context.round_trip_sec * 3):
                bucket_count = await self._buckets_of(timers, name, buckets)
                state = await timers.get(name, timer_key, bucket_count)
        if state is None:
            return None
        recurrence = Recurrence.decode(state.schedule)
        return TimerInfo(
            kind=name,
            key=timer_key,
            generation=state.gen,
            due=None if state.due_ms is None else from_epoch_ms(state.due_ms),
            due_ms=state.due_ms,
            payload=decode_payload(state.payload),
            status=state.status,
            attempt=state.attempt,
            recurs=None if recurrence is None else recurrence.describe(),
        )

    # ------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Scheduler[K]:
        if self._context.state != "new":
            raise SchedulerStateError(
                f"this scheduler is {self._context.state}; a Scheduler starts once: create a "
                "new one"
            )
        store = await self.backend.open(
            {
                "runner": self.instance_id,
                "history_size": self.history_size,
                "history_ttl_ms": self.history_ttl_ms,
            }
        )
        self._context.store = store
        registry = self._registry = Registry(
            self.backend.prefix, self.instance_id, self.backend.strategy
        )
        try:
            await store.prepare_jobs(self.jobs)
            if self._context.timer_kinds:
                await self._prepare_timers(store.conn)
            with anyio.fail_after(self._context.round_trip_sec * 3):
                self._context.first_seen_ms = await registry.register(
                    store.conn, self._context.jobs, self._context.timer_kinds, {}, 0
                )
        except BaseException:
            if store.conn.owned:
                with anyio.move_on_after(5, shield=True):
                    await store.conn.aclose()
            raise
        if store.leases:
            # Also when no kind is registered yet: add_timer may come later.
            self._context.timer_store = TimerStore(
                store.conn, prefix=self.backend.prefix, runner=self.instance_id
            )
        group = self._context.group = anyio.create_task_group()
        await group.__aenter__()
        self._context.state = "running"
        now = _now_ms()
        for job in self._context.jobs.values():
            self._agenda.schedule_first_slots(job, now)
        for kind in self._context.timer_kinds.values():
            self._claim_timers_now(kind)
        group.start_soon(self._claimer.claim_loop)
        self._renewing, self._renewed = anyio.CancelScope(), anyio.Event()
        group.start_soon(self._keep_registered, registry)
        if store.leases:
            group.start_soon(self._lease_keeper.keep_leases)
            self._listen_for_hints()
        log.info(
            "anarchon %s started: instance %s, %d job(s)%s%s, server %s, prefix %r, strategy %s",
            __version__,
            self.instance_id,
            len(self._context.jobs),
            f" ({', '.join(self._context.jobs)})" if self._context.jobs else "",
            f", timer kinds {', '.join(self._context.timer_kinds)}"
            if self._context.timer_kinds
            else "",
            self.backend.where(),
            self.backend.prefix,
            self.backend.strategy,
            extra={"instance": self.instance_id},
        )
        return self

    async def _keep_registered(self, registry: Registry) -> None:
        """Renew this instance's registration (``_store/registry.py``) until the stop, which
        ends this (a renewal in flight too) before it withdraws the registration."""
        assert self._renewing is not None and self._renewed is not None
        try:
            with self._renewing:
                async with anyio.create_task_group() as group:
                    store = self._context.store
                    if store is not None:
                        for reader in self._readers:
                            group.start_soon(reader, store.conn)
                    await self._renew_until_stopped(registry)
                    group.cancel_scope.cancel()
        finally:
            self._renewed.set()

    def _read_beside(self, reader: Callable[[Connection], Coroutine[Any, Any, None]]) -> None:
        """Run ``reader`` with the scheduler's connection from the start to the stop,
        which cancels it before the connection closes."""
        if self._context.state != "new":
            raise SchedulerStateError("a reader of the store is added before the start")
        self._readers.append(reader)

    def _leases_held(self) -> dict[str, int]:
        """The attempts (and timer firings) this instance runs, by job (timer kind).
        Safe from another thread: the keys are copied at once."""
        held: dict[str, int] = {}
        for job, _ in list(self._context.attempts):
            held[job] = held.get(job, 0) + 1
        return held

    async def _renew_until_stopped(self, registry: Registry) -> None:
        context = self._context
        while context.state == "running":
            with anyio.move_on_after(REGISTRATION_TTL_MS / 3000):
                await context.stopping.wait()
            store = context.store
            if context.state != "running" or store is None:
                return
            try:
                with anyio.fail_after(context.round_trip_sec * 3):
                    await registry.register(
                        store.conn, context.jobs, context.timer_kinds,
                        self._agenda.next_slot_ms, len(context.attempts),
                    )  # fmt: skip
            except Exception as exc:
                log.debug("renewing the registration failed (tried again later): %s", exc)

    async def _prepare_timers(self, conn: Connection) -> None:
        """Before the first claim of timers: each kind's number of buckets is the one the
        store knows (written by the first instance), and a warning if the server may
        evict timers."""
        for kind in self._context.timer_kinds.values():
            key = TimerKeys.buckets_key(self.backend.prefix, kind.name)
            with anyio.fail_after(self._context.round_trip_sec * 3):
                await conn.execute(("SET", key, kind.buckets, "NX"))
                stored = await conn.execute(("GET", key))
            if stored is not None and int(stored) != kind.buckets:
                raise InvalidOptionError(
                    f"timer kind {kind.name!r} has {int(stored)} bucket(s) in the store, and "
                    f"this scheduler gives it {kind.buckets}: every instance must give the "
                    "same number (timers set under another number would never fire)"
                )
        await self._warn_if_timers_may_be_evicted(conn)

    async def _warn_if_timers_may_be_evicted(self, conn: Connection) -> None:
        """Timers live as long as the server keeps their keys: a policy that evicts keys
        under memory pressure may drop them."""
        try:
            with anyio.fail_after(self._context.round_trip_sec):
                reply = await conn.execute(("CONFIG", "GET", "maxmemory-policy"))
        except Exception:
            return  # CONFIG refused (a managed server): nothing to tell
        values = list(reply.values()) if isinstance(reply, dict) else list(reply or [])
        policy = str(values[-1]) if values else ""
        if policy and policy != "noeviction" and not policy.startswith("volatile"):
            log.warning(
                "the server's maxmemory-policy is %r: under memory pressure it may evict "
                "timers (they are keys without an expiry); use noeviction (or a volatile-* "
                "policy) for a server that holds timers",
                policy,
            )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        group = self._context.group
        assert group is not None
        with anyio.CancelScope(shield=True):
            await self.stop()
        return await group.__aexit__(exc_type, exc, tb)

    async def stop(self, grace_ms: int | None = None) -> None:
        """Stop claiming, let running handlers finish within the grace period, then cancel
        them and release their leases so that a backup takes over without waiting for
        the lease to expire. Closes the connection if anarchon opened it.

        Bounded: it returns within the grace period plus a few round-trip deadlines (a
        third of ``lease_ms`` each), whatever the server does. Safe to call twice (a
        second call with a shorter grace shortens the wait), to cancel (the stop goes
        on, and a later ``stop()`` or leaving ``async with`` waits for it), and from a
        handler (it starts the stop and returns at once; the handler's own run is
        settled as the stop proceeds).

        Handlers that are plain functions run in worker threads, which cannot be
        interrupted: they see ``run.lease_lost`` set and are waited for.
        """
        context = self._context
        if context.state == "new":
            context.state = "stopped"
            context.events.close()
            self._stopped.set()
            return
        grace_sec = (self.stop_grace_ms if grace_ms is None else grace_ms) / 1000
        if self._grace is None:
            self._grace = anyio.CancelScope(deadline=anyio.current_time() + grace_sec)
            assert context.group is not None
            context.group.start_soon(self._stop, name="anarchon stop")
        else:
            self._grace.deadline = min(self._grace.deadline, anyio.current_time() + grace_sec)
        if _current_attempt.get() is not None:
            return  # from a handler: waiting here would wait for itself
        await self._stopped.wait()

    async def _stop(self) -> None:
        """The stop itself, in the scheduler's task group, shielded: whoever asked for it
        may be cancelled, the stop still completes, and it always ends stopped."""
        context = self._context
        assert self._grace is not None
        with anyio.CancelScope(shield=True):
            try:
                context.begin_stopping()
                self._hints.stop()
                self._agenda.wake()
                await self._claimer.loop_done.wait()
                await self._claimer.release_unanswered()
                with self._grace:
                    await self._runner.wait_idle()
                self._runner.cancel_all("the scheduler is stopping")
                await self._runner.wait_idle()
                store = self._store
                if self._renewing is not None and self._renewed is not None:
                    self._renewing.cancel()
                    await self._renewed.wait()
                if store is not None and self._registry is not None:
                    await self._registry.withdraw(store.conn, context.round_trip_sec)
                if store is not None and store.conn.owned:
                    with anyio.move_on_after(context.round_trip_sec):
                        await store.conn.aclose()
            except Exception:
                log.exception("stopping the scheduler failed; it is stopped all the same")
            finally:
                context.state = "stopped"
                self._lease_keeper.wake()  # the lease keeper ends
                self._stopped.set()
                log.info("instance %s stopped", self.instance_id)
                context.events.close()

    # ---------------------------------------------------------------- events

    def events(self, *, buffer: int = 1000) -> EventStream:
        """The events of this instance from now until it stops (then the iteration ends),
        or until the stream is closed; open it before the start to see the start too::

            async with scheduler.events() as events:
                async for event in events:
                    ...

        Up to ``buffer`` events wait for the consumer; when it falls that far behind,
        the oldest are dropped (``stream.dropped`` counts them): a consumer never slows
        the scheduler. Nothing is made while no stream is open and no hook is set."""
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise InvalidOptionError(f"buffer must be a whole number, 1 or more, got {buffer!r}")
        return self._context.events.open(buffer)

    def on_event(self, hook: Callable[[Event], object]) -> Callable[[Event], object]:
        """Call ``hook`` with each event of this instance, in the event loop, as it
        happens; usable as a decorator. It must be quick and must not block (it runs
        inside the scheduler); what it raises is logged once and does not stop it::

            @scheduler.on_event
            def count(event: anarchon.Event) -> None:
                if isinstance(event, anarchon.RunFinished):
                    outcomes[event.outcome] += 1
        """
        if not callable(hook):
            raise InvalidOptionError(f"on_event needs a function, got {hook!r}")
        self._context.events.hooks.append(hook)
        return hook

    # --------------------------------------------------------------- reading

    async def history(self, job: str, limit: int = 100) -> list[RunResult]:
        """The newest ``limit`` attempts of ``job`` from the store, newest first."""
        if self._store is None or self._context.state != "running":
            raise SchedulerStateError("history() needs a running scheduler (inside `async with`)")
        if limit < 1:
            raise InvalidOptionError(f"limit must be 1 or more, got {limit}")
        return await self._store.history(job, limit)

    async def pause(self, job: str) -> bool:
        """Pause ``job`` across the fleet: a stored flag that every instance honours at its
        next claim. A slot that comes due while the job is paused is recorded in the
        history as skipped (``"paused: the job is paused"``) and does not run, then or
        later; runs already started, their retries, the takeover of dead runs and
        ``run_now`` go on. False if it was paused already. Lease strategy only."""
        store = self._lease_store_for("pause()", job)
        with anyio.fail_after(self._context.round_trip_sec * 3):
            changed = await store.set_paused(job, f"{self.instance_id} at {iso_ms(_now_ms())}")
        log.info("%s: paused%s", job, "" if changed else " (it was paused already)")
        return changed

    async def resume(self, job: str) -> bool:
        """Resume ``job`` (paused with ``pause``): its next slot runs. Slots skipped while
        it was paused stay skipped. False if it was not paused."""
        store = self._lease_store_for("resume()", job)
        with anyio.fail_after(self._context.round_trip_sec * 3):
            changed = await store.set_paused(job, None)
        log.info("%s: resumed%s", job, "" if changed else " (it was not paused)")
        return changed

    def _lease_store_for(self, what: str, job: str) -> LeaseStore:
        store = self._store
        if store is None or self._context.state != "running":
            raise SchedulerStateError(f"{what} needs a running scheduler (inside `async with`)")
        if not isinstance(store, LeaseStore):
            raise InvalidOptionError(
                f"{what} needs the 'lease' strategy: this scheduler uses {self.backend.strategy!r}"
            )
        if job not in self._context.jobs:
            raise InvalidJobError(f"no job named {job!r} on this scheduler; jobs: {self.jobs}")
        return store

    async def run_now(self, job: str) -> RunResult:
        """Run ``job`` now on this instance, wait for it, and return its result.

        The run gets a slot id of its own (never equal to a scheduled one), is
        recorded in the history with trigger ``"manual"``, and is one attempt (no
        retries). Unless the job allows overlapping runs, it is refused with
        ``RunOverlapError`` while another run of the job is unsettled (running,
        waiting for its retry, or orphaned). Its claim is sent again (with the same
        token) after a lost reply or a transient error reply, a few times within about
        a second plus the round-trip deadlines; then it raises ``ConnectionFailedError``::

            result = await scheduler.run_now("report")
            assert result.status == "ok"
        """
        if self._store is None or self._context.state != "running":
            raise SchedulerStateError("run_now() needs a running scheduler (inside `async with`)")
        found = self._context.jobs.get(job)
        if found is None:
            raise InvalidJobError(f"no job named {job!r} on this scheduler; jobs: {self.jobs}")
        requested_ms = int(_now_ms())
        slot_id = manual_slot_id(requested_ms, secrets.token_hex(4))
        token = secrets.token_hex(8)
        if self._store.leases:
            reply, claim_sent = await self._claimer.claim_manual(
                found, slot_id, requested_ms, token
            )
        else:
            # No lease to claim: the manual stream records the run, which runs here.
            claim_sent = time.monotonic()
            fence = await self._store.begin_manual(found.name, slot_id, token)
            reply = ClaimReply("won", attempt=1, fence=fence, trigger="manual")
        if self._context.state != "running":
            # stop() began while the manual claim was in flight: give the win back.
            await self._settler.release(found, slot_id, token, reply)
            raise SchedulerStateError("the scheduler stopped before run_now() could start")
        attempt = self._runner.start_attempt(found, slot_id, token, reply, claim_sent)
        await attempt.settled.wait()
        try:
            with anyio.fail_after(self._context.round_trip_sec):
                return await self._store.result_of(found.name, slot_id, attempt.run.attempt)
        except (LookupError, TimeoutError):
            # The lease was lost and nobody recorded the attempt (or the server did
            # not answer in time).
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
