"""``Scheduler``, the public facade: it takes the options (``_model/options.py`` checks
them), registers jobs and timer kinds, and hands the work on: to its engine instance
(``_engine/instance.py``: start, stop, run_now) and to its ``Timers``
(``_timers.py``: setting, cancelling and reading timers)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from types import TracebackType
from typing import Any, Generic, TypeVar, Unpack, overload

from ._engine.instance import Instance
from ._errors import InvalidOptionError
from ._model.job import Handler
from ._model.options import (
    JobOptions,
    LeaseJobOptions,
    SchedulerSettings,
    TimerKindOptions,
    check_instance_id,
    make_job,
    make_timer_kind,
)
from ._model.schedule import Schedule
from ._model.values import RunResult, TimerInfo, TimerSetting
from ._observe.events import Event, EventStream
from ._store.backend import ClaimOnly, K, Leases, RedisBackend
from ._timers import DEFAULT_MAX_PAYLOAD_BYTES, bound_timers

__all__ = ["Scheduler"]

F = TypeVar("F", bound=Callable[..., Any])


class Scheduler(Generic[K]):
    """Runs jobs across all instances. Each attempt of a slot is started by exactly one
    instance, each slot that starts runs at least once (a new attempt follows a failure, a
    stop or a lost lease, while attempts are left), and a slot that does not start (skipped
    by the overlap policy, a pause or lateness) is recorded or logged, never silently lost.

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
    ``max_timer_payload_bytes`` (1 MiB) caps a timer's payload as stored.
    ``history_size`` (1000, at most 1,000,000) bounds each job's history, and
    ``history_ttl_ms`` its age. Values the server cannot hold are refused here: a
    duration is at most 100 years, ``lease_ms`` at most a day (the heartbeats keep a
    long run's lease alive), ``max_attempts`` at most 1,000.
    The lease options (``lease_ms``, ``heartbeat_ms``, ``retry_delay_ms``,
    ``timer_poll_ms``; on jobs ``overlap``, ``max_attempts``, ``catch_up_ms``,
    ``retry_delay_ms``, ``retry_on``) exist only with the lease strategy: with a
    claim-only backend they are a type error, and an error if passed anyway.
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
        max_timer_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
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
        max_timer_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
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
        max_timer_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        if backend is None:
            backend = RedisBackend()
        if not isinstance(backend, RedisBackend):
            raise InvalidOptionError(
                f"backend must be a RedisBackend or ValkeyBackend, got {type(backend).__name__}"
            )
        self.backend = backend
        settings = SchedulerSettings.make(
            strategy=backend.strategy,
            leases=backend.leases,
            lease_ms=lease_ms,
            heartbeat_ms=heartbeat_ms,
            history_size=history_size,
            history_ttl_ms=history_ttl_ms,
            instance_id=instance_id,
            stop_grace_ms=stop_grace_ms,
            retry_delay_ms=retry_delay_ms,
            timer_poll_ms=timer_poll_ms,
        )
        self.lease_ms = settings.lease_ms
        self.heartbeat_ms = settings.heartbeat_ms
        self.history_size = settings.history_size
        self.history_ttl_ms = settings.history_ttl_ms
        self.stop_grace_ms = settings.stop_grace_ms
        self.retry_delay_ms = settings.retry_delay_ms
        self._instance = Instance.create(self, backend, settings)
        self._timers = bound_timers(backend, self._instance, max_timer_payload_bytes)

    @property
    def instance_id(self) -> str:
        """This instance's id in the store (its runs' ``runner``): by default
        ``host:pid:random``, made again at the start in a process forked after the
        scheduler was made (each worker of ``gunicorn --preload`` is its own instance)."""
        return self._instance.instance_id

    @instance_id.setter
    def instance_id(self, instance_id: str) -> None:
        self._instance.rename(check_instance_id(instance_id))

    # ------------------------------------------------------------------ jobs

    @overload
    def job(
        self: Scheduler[Leases],
        schedule: str | Schedule | None = None,
        **options: Unpack[LeaseJobOptions],
    ) -> Callable[[F], F]: ...

    @overload
    def job(
        self: Scheduler[ClaimOnly],
        schedule: str | Schedule | None = None,
        **options: Unpack[JobOptions],
    ) -> Callable[[F], F]: ...

    def job(self, schedule: str | Schedule | None = None, **options: Any) -> Callable[[F], F]:
        """Register the decorated function as a job; see ``add_job`` for the options."""

        def register(handler: F) -> F:
            self._add_job(handler, schedule, options)
            return handler

        return register

    @overload
    def add_job(
        self: Scheduler[Leases],
        handler: Handler,
        schedule: str | Schedule | None = None,
        **options: Unpack[LeaseJobOptions],
    ) -> None: ...

    @overload
    def add_job(
        self: Scheduler[ClaimOnly],
        handler: Handler,
        schedule: str | Schedule | None = None,
        **options: Unpack[JobOptions],
    ) -> None: ...

    def add_job(
        self, handler: Handler, schedule: str | Schedule | None = None, **options: Any
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
        self._add_job(handler, schedule, options)

    def _add_job(
        self, handler: Handler, schedule: str | Schedule | None, options: dict[str, Any]
    ) -> None:
        backend, context = self.backend, self._instance.context
        job = make_job(
            handler,
            schedule,
            options,
            strategy=backend.strategy,
            leases=backend.leases,
            taken=context.jobs,
        )
        backend.check_job(job)
        self._instance.add_job(job)

    @property
    def jobs(self) -> list[str]:
        """The names of the registered jobs."""
        return list(self._instance.context.jobs)

    # ---------------------------------------------------------------- timers

    def timer(
        self: Scheduler[Leases], kind: str, **options: Unpack[TimerKindOptions]
    ) -> Callable[[F], F]:
        """Register the decorated function as the handler of a kind of timer; see
        ``add_timer`` for the options::

            @scheduler.timer("remind")
            async def remind(fire: TimerRun) -> None:
                await send_reminder(fire.key, fire.payload)
        """

        def register(handler: F) -> F:
            self.add_timer(handler, kind, **options)
            return handler

        return register

    def add_timer(
        self: Scheduler[Leases],
        handler: Callable[..., Any],
        kind: str,
        **options: Unpack[TimerKindOptions],
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
        backend, taken = self.backend, self._instance.context.timer_kinds
        timer_kind = make_timer_kind(
            handler, kind, options, strategy=backend.strategy, leases=backend.leases, taken=taken
        )
        self._instance.add_timer_kind(timer_kind)

    @property
    def timer_kinds(self) -> list[str]:
        """The kinds of timer this scheduler fires."""
        return list(self._instance.context.timer_kinds)

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
        scheduler runs or not (one that does not opens a connection for the call: a
        process that only sets timers keeps a ``Timers`` open instead). Many at once:
        ``set_timers``::

            await scheduler.set_timer("remind", "user:42", delay_ms=30 * 60_000,
                                      payload={"text": "your cart"})
        """
        setting = TimerSetting(key, at, delay_ms, cron, every_ms, timezone, payload)
        (generation,) = await self._timers.set_many(kind, [setting], buckets=buckets)
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
        return await self._timers.set_many(kind, timers, buckets=buckets)

    async def cancel_timer(self, kind: str, key: str, *, buckets: int | None = None) -> bool:
        """Cancel ``key``'s timer of ``kind``; False if it had none. A firing in flight
        goes on (nothing can call it back), but nothing follows it: no retry, rearm or
        recurrence."""
        return await self._timers.cancel(kind, key, buckets=buckets)

    async def get_timer(
        self, kind: str, key: str, *, buckets: int | None = None
    ) -> TimerInfo | None:
        """``key``'s timer of ``kind`` as the store holds it, or None."""
        return await self._timers.get(kind, key, buckets=buckets)

    # ------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Scheduler[K]:
        await self._instance.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._instance.exit(exc_type, exc, tb)

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
        await self._instance.stop(grace_ms)

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
        return self._instance.context.events.open(buffer)

    def on_event(self, hook: Callable[[Event], object]) -> Callable[[Event], object]:
        """Call ``hook`` with each event of this instance, in the event loop, as it
        happens; usable as a decorator. It must be quick and must not block (it runs
        inside the scheduler); what it raises is logged once and does not stop it::

            @scheduler.on_event
            def count(event: anarchon.Event) -> None:
                if isinstance(event, anarchon.RunFinished):
                    outcomes[event.outcome] += 1
        """
        self._instance.context.events.add_hook(hook)
        return hook

    # --------------------------------------------------------------- reading

    async def history(self, job: str, limit: int = 100) -> list[RunResult]:
        """The newest ``limit`` attempts of ``job`` from the store, newest first."""
        return await self._instance.history(job, limit)

    async def pause(self, job: str) -> bool:
        """Pause ``job`` across the fleet: a stored flag that every instance honours at its
        next claim. A slot that comes due while the job is paused is recorded in the
        history as skipped (``"paused: the job is paused"``) and does not run, then or
        later; runs already started, their retries, the takeover of dead runs and
        ``run_now`` go on. False if it was paused already. Lease strategy only."""
        return await self._instance.set_paused(job, paused=True)

    async def resume(self, job: str) -> bool:
        """Resume ``job`` (paused with ``pause``): its next slot runs. Slots skipped while
        it was paused stay skipped. False if it was not paused."""
        return await self._instance.set_paused(job, paused=False)

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
        return await self._instance.run_now(job)
