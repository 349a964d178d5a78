"""``Scheduler``, the public facade: it takes the options (``_model/options.py`` checks
them), registers jobs and timer kinds, and hands the work on: to its engine instance
(``_engine/instance.py``: start, stop, run_now) and to its ``Timers``
(``_timers.py``: setting, cancelling and reading timers)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar, Unpack, overload

from ._engine.instance import Instance
from ._errors import InvalidJobError, InvalidOptionError, SchedulerStateError
from ._model.clock import wall_ms
from ._model.job import Handler, check_count
from ._model.options import (
    DEFAULT_MAX_CONCURRENT,
    JobOptions,
    LeaseJobOptions,
    SchedulerSettings,
    TimerKindOptions,
    check_instance_id,
    make_job,
    make_timer_kind,
)
from ._model.schedule import FIRE_TIMES_MAX, Schedule, fire_times
from ._model.text import visible
from ._model.values import AppliedTimers, BackfillInfo, RunResult, TimerInfo, TimerSetting
from ._observe.events import Event, EventStream
from ._ops.inspector import inspector_over
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

    Every option is checked here, and a value the server cannot hold is refused: a
    duration is a whole number of milliseconds, at most 100 years. The lease options
    (``lease_ms``, ``heartbeat_ms``, ``retry_delay_ms``, ``timer_poll_ms``; on jobs
    ``overlap``, ``max_attempts``, ``catch_up_ms``, ``retry_delay_ms``, ``retry_on``)
    exist only with the lease strategy: with a claim-only backend they are a type
    error, and an ``InvalidOptionError`` if passed anyway. A type checker reads the
    strategy from the backend: the scheduler is a ``Scheduler[Leases]`` or a
    ``Scheduler[ClaimOnly]``.

    Args:
        backend: Where the scheduler keeps its state and how one winner is chosen: a
            ``RedisBackend`` or ``ValkeyBackend``. None: ``RedisBackend()``, the lease
            strategy on ``redis://localhost:6379``.
        lease_ms: How long a won run is held without a heartbeat: a backup takes over
            a run whose runner was silent this long. Milliseconds, more than 0 and at
            most a day (the heartbeats keep a long run's lease alive); None: 30 000.
        heartbeat_ms: How often the runner extends its lease, in milliseconds: more
            than 0 and at most half of ``lease_ms``, so that a late heartbeat still
            arrives in time. None: a third of ``lease_ms``.
        history_size: How many results each job's history keeps (and runs-log
            entries): a whole number from 1 to 1,000,000 (default 1000).
        history_ttl_ms: Also drop history older than this many milliseconds (more than
            0); None: no age limit. The runs log is trimmed by age on Redis 6.2+ and
            Valkey only; on older servers by ``history_size`` alone.
        instance_id: This instance's id in the store, recorded as each run's
            ``runner``: up to 200 characters, without ``|`` or control characters.
            None: ``host:pid:random``, made again at the start in a process forked
            after the scheduler was made.
        stop_grace_ms: How long ``stop()`` lets running handlers finish before it
            cancels them and releases their leases, in milliseconds (0 or more;
            default 30 000).
        retry_delay_ms: The delay before the second attempt of a failed run (or
            timer firing), doubling for each later one: milliseconds, 0 or more. None:
            1 000. A job or a timer kind may set its own.
        timer_poll_ms: How long an instance waits at most between two claims of a
            timer kind's due timers, in milliseconds (more than 0; None: 1 000): a
            timer set elsewhere to fire sooner than anything the instance knew of is
            seen by then, or at once through its published hint where the client can
            subscribe (one set through this scheduler always at once).
        max_timer_payload_bytes: The largest payload a timer may hold as stored, in
            bytes (1 or more; default 1 MiB): a larger one is refused before anything
            is sent.
        max_concurrent: The most handlers (jobs' and timers' together) that run on
            this instance at once: 1 to 1,000,000 (default 100), or None for no bound.
            An instance at its bound claims nothing more: what is due stays in the
            store for the other instances, and is claimed here as runs end.

    Raises:
        InvalidOptionError: An option out of its bounds, a lease option with a
            claim-only backend, or a backend that is not a ``RedisBackend``.

    Attributes:
        backend: The backend it uses.
        lease_ms: The lease, in milliseconds (the default filled in; unused with a
            claim-only backend).
        heartbeat_ms: The heartbeat interval, in milliseconds (the default filled in).
        history_size: How many results each job's history keeps.
        history_ttl_ms: The history's age limit in milliseconds, or None.
        stop_grace_ms: How long ``stop()`` lets handlers finish, in milliseconds.
        retry_delay_ms: The delay before a second attempt, in milliseconds (the default
            filled in).
        timer_poll_ms: The longest wait between two claims of a timer kind's due
            timers, in milliseconds (the default filled in).
        max_concurrent: The most handlers that run on this instance at once, or None.
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
        max_concurrent: int | None = DEFAULT_MAX_CONCURRENT,
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
        max_concurrent: int | None = DEFAULT_MAX_CONCURRENT,
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
        max_concurrent: int | None = DEFAULT_MAX_CONCURRENT,
    ) -> None:
        if backend is None:
            backend = RedisBackend()
        if not isinstance(backend, RedisBackend):
            raise InvalidOptionError(
                f"backend must be a RedisBackend or ValkeyBackend, got {type(backend).__name__}"
            )
        self.backend = backend
        settings = SchedulerSettings.make(
            rules=backend.rules,
            lease_ms=lease_ms,
            heartbeat_ms=heartbeat_ms,
            history_size=history_size,
            history_ttl_ms=history_ttl_ms,
            instance_id=instance_id,
            stop_grace_ms=stop_grace_ms,
            retry_delay_ms=retry_delay_ms,
            timer_poll_ms=timer_poll_ms,
            max_concurrent=max_concurrent,
        )
        self.lease_ms = settings.lease_ms
        self.heartbeat_ms = settings.heartbeat_ms
        self.history_size = settings.history_size
        self.history_ttl_ms = settings.history_ttl_ms
        self.stop_grace_ms = settings.stop_grace_ms
        self.retry_delay_ms = settings.retry_delay_ms
        self.timer_poll_ms = settings.timer_poll_ms
        self.max_concurrent = settings.max_concurrent
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
        schedule: str | Schedule | list[str | Schedule] | None = None,
        **options: Unpack[LeaseJobOptions],
    ) -> Callable[[F], F]: ...

    @overload
    def job(
        self: Scheduler[ClaimOnly],
        schedule: str | Schedule | list[str | Schedule] | None = None,
        **options: Unpack[JobOptions],
    ) -> Callable[[F], F]: ...

    def job(
        self, schedule: str | Schedule | list[str | Schedule] | None = None, **options: Any
    ) -> Callable[[F], F]:
        """Register the decorated function as a job::

            @scheduler.job("*/5 * * * *", max_attempts=3)
            async def sync(run: Run) -> None:
                ...

        The function is an async function or a plain one (run in a worker thread),
        taking the ``Run`` or nothing. Jobs can be added while the scheduler runs; their
        first slot is the next one after now.

        Args:
            schedule: When the job fires: a cron string of 5 fields, or 6 with seconds
                first, read in ``timezone``; or any object with
                ``next_after(datetime)`` (a ``Schedule``); or a list of them (a
                ``CombinedSchedule``: a slot at each instant any of them fires, once
                where two fire together). None with ``every_ms``.
            **options: The job's options, below. Those marked *lease strategy only*
                are a type error with a claim-only backend, and an
                ``InvalidOptionError`` if passed anyway.

        Keyword Args: Options:
            every_ms (int | None): Fire every this many milliseconds instead, at fixed
                intervals aligned to the Unix epoch (more than 0; no ``schedule`` and
                no ``timezone`` then).
            name (str | None): The job's name, unique on the scheduler and the same on
                every instance that runs it: up to 200 visible characters, without
                spaces, ``:``, ``{`` or ``}``. None: the function's ``__name__``.
            timezone (str): The IANA time zone a cron ``schedule`` is read in, such as
                ``"Europe/Berlin"`` (default ``"UTC"``).
            jitter_ms (int): Each instance waits a random part of this before its first
                claim of a slot, in milliseconds (0 or more; default 0): it spreads the
                claims and randomises which instance runs.
            max_late_ms (int): How late a slot may still be claimed for the first time,
                in milliseconds by the instance's clock (0 or more; default 60 000); an
                older slot is skipped unless catch-up reaches it.
            timeout_ms (int | None): How long an attempt may run, in milliseconds (more
                than 0; None: as long as it likes). Then an async handler is cancelled,
                a plain function sees ``run.lease_lost`` set (it cannot be interrupted,
                and is waited for), and the attempt is recorded as failed with a
                ``TimeoutError`` (retried like any failure, if ``retry_on`` allows it).
            max_concurrent (int | None): The most of the job's runs that go on at once
                on one instance (1 to 1 000 000; None: the instance's
                ``max_concurrent`` alone). A slot due while the job is at its bound here
                is claimed once one of its runs here ends (other instances may take it
                meanwhile); it matters for ``overlap="allow"``, since otherwise one run
                of the job goes on at a time in the fleet.
            start_at (datetime | None): Its first slot is at or after this instant (an
                aware datetime; None: no bound).
            end_at (datetime | None): Its last slot is before this instant (an aware
                datetime after ``start_at``; None: no bound). Past it the job claims
                nothing more, and ``Inspector.jobs`` and the dashboard show it
                finished; its state and history stay in the store.
            max_concurrent_fleet (int | None): The most of the job's runs that go on at
                once in the whole fleet (*lease strategy only*; 1 to 100 000; None: no
                limit). Each run holds a permit in the store while its lease lives: its
                finish gives it back, and a dead instance's come back when their leases
                run out. A slot due while every permit is held waits for one (it is not
                skipped), asked again as runs here end or every ``timer_poll_ms``; a
                retry or a takeover waits in the store for whichever instance finds one
                first. It matters for ``overlap="allow"``.
            overlap (Literal['skip', 'wait', 'allow', 'replace', 'buffer_one'] | bool | None):
                What a slot does while an older run of the job is unsettled (*lease
                strategy only*): ``"skip"`` (the default; the slot is recorded as
                skipped), ``"wait"`` (it runs when that run ends; at most one slot
                waits), ``"allow"`` (it runs at once, side by side), ``"replace"`` (it
                ends the older run, recorded cancelled, and runs at once) or
                ``"buffer_one"`` (the newest slot waits and then runs, older waiting
                ones are skipped); ``False`` and ``True`` are aliases of ``"skip"`` and
                ``"allow"`` (``OverlapPolicy``).
            max_attempts (int | None): How many attempts a slot may take, crashed and
                failed alike (*lease strategy only*): 1 to 1000 (None: 3).
            catch_up_ms (int | None): How far back missed slots are run, in
                milliseconds (*lease strategy only*; 0 or more, None: 0): on start, and
                after a gap in which the instance did not claim, the slots missed within
                this window run, oldest first.
            retry_delay_ms (int | None): The delay before the second attempt of a failed
                run, doubling for each later one, in milliseconds (*lease strategy
                only*; 0 or more; None: the scheduler's ``retry_delay_ms``).
            retry_on (type[Exception] | tuple[type[Exception], ...] | None): Retry only
                these exceptions (*lease strategy only*): any other fails the run at
                once. None: every exception is retried.
            max_runs (int | None): How many of its runs may end, ok or finally failed
                (a run whose last attempt crashed counts as failed), counted once in the
                store for the fleet, manual runs included (*lease strategy only*; 1 to
                1 000 000 000; None: no bound). A slot's first claim starts no run once
                that many have ended, or have ended or are under way (then the slot is
                recorded skipped); the job is then finished: it claims nothing more and
                ``run_now`` is refused, until a higher ``max_runs`` is deployed.
            pause_after_failures (int | None): Pause the job once this many of its
                slots in a row finally failed (*lease strategy only*; 1 to 1000; None:
                never): decided in the store by the finish that fails the last of them,
                which says so once (an ERROR, a ``JobPaused`` event, an audit log entry
                by ``anarchon (pause_after_failures)``). A run that ends ok, or a
                resume, counts from zero again. A slot whose last attempt crashed (its
                lease ran out) does not count.
            exclude (str | Iterable[date | str] | Excludes | None): The slots of the
                schedule that do not run (*lease strategy only*): a cron expression read
                in ``timezone`` (a slot whose wall-clock time it matches, such as
                ``"* * 25 12 *"`` for all of December 25), a collection of dates (up to
                10 000, ``date`` or ISO text: a slot on one of them in ``timezone``), or
                an object with ``excludes(datetime) -> bool`` (a holiday calendar; it is
                given the slot in ``timezone``, and must answer the same on every
                instance). Each excluded slot is claimed as any slot is and recorded
                skipped, with the reason, once for the fleet. None: none.

        Returns:
            A decorator that registers the function and returns it unchanged.

        Raises:
            InvalidJobError: The name is taken or cannot be used, or the function cannot
                be called with a ``Run`` or with nothing.
            InvalidScheduleError: The schedule, interval or time zone cannot be used.
            InvalidOptionError: An unknown option, one out of its bounds, a lease option
                with a claim-only backend, or (with the ``"script"`` or ``"idmp"``
                strategy) a ``jitter_ms + max_late_ms`` that is not less than what the
                strategy remembers of a slot.
        """

        def register(handler: F) -> F:
            self._add_job(handler, schedule, options)
            return handler

        return register

    @overload
    def add_job(
        self: Scheduler[Leases],
        handler: Handler,
        schedule: str | Schedule | list[str | Schedule] | None = None,
        **options: Unpack[LeaseJobOptions],
    ) -> None: ...

    @overload
    def add_job(
        self: Scheduler[ClaimOnly],
        handler: Handler,
        schedule: str | Schedule | list[str | Schedule] | None = None,
        **options: Unpack[JobOptions],
    ) -> None: ...

    def add_job(
        self,
        handler: Handler,
        schedule: str | Schedule | list[str | Schedule] | None = None,
        **options: Any,
    ) -> None:
        """Register a job: ``job()`` without the decorator.

        Jobs can be added while the scheduler runs; their first slot is the
        next one after now.

        Args:
            handler: The job's function: an async function or a plain one (run in a
                worker thread), taking the ``Run`` or nothing.
            schedule: When the job fires, as ``job()`` takes it.
            **options: The job's options, as ``job()`` takes them (``every_ms``,
                ``name``, ``timezone``, ``jitter_ms``, ``max_late_ms``, ``timeout_ms``,
                ``max_concurrent``; with the lease strategy ``overlap``,
                ``max_attempts``, ``catch_up_ms``, ``retry_delay_ms``, ``retry_on``).

        Raises:
            InvalidJobError: The name is taken or cannot be used, or the handler cannot
                be called with a ``Run`` or with nothing.
            InvalidScheduleError: The schedule, interval or time zone cannot be used.
            InvalidOptionError: An unknown option, or one out of its bounds, as for
                ``job()``.
        """
        self._add_job(handler, schedule, options)

    def _add_job(
        self,
        handler: Handler,
        schedule: str | Schedule | list[str | Schedule] | None,
        options: dict[str, Any],
    ) -> None:
        backend = self.backend
        job = make_job(handler, schedule, options, rules=backend.rules, taken=self._instance.jobs)
        backend.check_job(job)
        self._instance.add_job(job)

    @property
    def jobs(self) -> list[str]:
        """The names of the registered jobs."""
        return list(self._instance.jobs)

    # ---------------------------------------------------------------- timers

    def timer(
        self: Scheduler[Leases], kind: str, **options: Unpack[TimerKindOptions]
    ) -> Callable[[F], F]:
        """Register the decorated function as the handler of a kind of timer::

            @scheduler.timer("remind")
            async def remind(fire: TimerRun) -> None:
                await send_reminder(fire.key, fire.payload)

        Every key's timer of that kind set with ``set_timer`` (by any process) fires
        through it, on one instance of the fleet, with the jobs' lease rules (takeover
        of a dead runner, heartbeats, fences). The function is an async function or a
        plain one (run in a worker thread), taking the ``TimerRun`` or nothing. Timers
        need the lease strategy.

        Args:
            kind: The kind's name, unique on the scheduler: a job name's rules, and no
                ``#``.
            **options: The kind's options, below.

        Keyword Args: Options:
            max_attempts (int): How many attempts a firing may take, failed and crashed
                alike (a firing given back by a stopping instance is not counted): 1 to
                1000 (default 3).
            retry_delay_ms (int | None): The delay before the second attempt, doubling
                for each later one, in milliseconds (0 or more; None: the scheduler's
                ``retry_delay_ms``).
            buckets (int): How many hash tags the kind is spread over, so that a Redis
                Cluster spreads it over its nodes: 1 to 1024 (default 1). The first
                instance writes the number in the store; an instance that gives another
                refuses to start, and a process that only sets timers reads it from
                there.
            max_concurrent (int | None): The most of the kind's firings that go on at
                once on one instance (1 to 1 000 000; None: the instance's
                ``max_concurrent`` alone). Beyond it the kind's due timers stay in the
                store, for the other instances or until a firing here ends; the other
                kinds and the jobs go on.
            max_concurrent_fleet (int | None): The most of the kind's firings in flight
                at once in the whole fleet (1 to 100 000, a multiple of ``buckets``:
                each bucket holds an equal share; None: no limit). Each firing holds a
                permit in the store while its lease lives: its finish gives it back,
                and a dead instance's come back when their leases run out. Beyond it
                the kind's due timers wait in the store, in due order.
            rate_limit (tuple[int, int] | None): ``(count, period_ms)``: at most
                ``count`` of the kind's firings start in any ``period_ms`` across the
                fleet (retries and takeovers count: each calls the handler), e.g.
                ``(100, 60_000)`` for 100 a minute (count 1 to 100 000, a multiple of
                ``buckets``; period up to a day; None: no limit). The firings beyond it
                wait in the store, in due order, and start as the window allows.
            group_by (str | None): What ends a key's group: a key's group is its text
                before the first ``group_by`` (the whole key without one), e.g. ``":"``
                makes ``"tenant-7:user:42"`` a timer of group ``"tenant-7"``. Given with
                ``max_concurrent_per_group`` (and ``buckets=1``).
            max_concurrent_per_group (int | None): The most firings of one key group in
                flight at once in the whole fleet (1 to 100 000), held as permits like
                ``max_concurrent_fleet``'s. A group's due timers beyond it wait apart,
                so that one tenant's thousands of timers do not hold the other groups'
                back; they go on, oldest first, as the group's firings end.

        Returns:
            A decorator that registers the function and returns it unchanged.

        Raises:
            InvalidJobError: The kind's name is taken or cannot be used, or the function
                cannot be called with a ``TimerRun`` or with nothing.
            InvalidOptionError: An unknown option, one out of its bounds, or a backend
                with a claim-only strategy.
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
        """Register the handler of a kind of timer: ``timer()`` without the decorator.

        Args:
            handler: The kind's function: an async function or a plain one (run in a
                worker thread), taking the ``TimerRun`` or nothing.
            kind: The kind's name, as ``timer()`` takes it.
            **options: The kind's options, as ``timer()`` takes them
                (``max_attempts``, ``retry_delay_ms``, ``buckets``, ``max_concurrent``,
                ``max_concurrent_fleet``, ``rate_limit``, ``group_by``,
                ``max_concurrent_per_group``).

        Raises:
            InvalidJobError: The kind's name is taken or cannot be used, or the handler
                cannot be called with a ``TimerRun`` or with nothing.
            InvalidOptionError: An unknown option, one out of its bounds, or a backend
                with a claim-only strategy.
        """
        timer_kind = make_timer_kind(
            handler, kind, options, rules=self.backend.rules, taken=self._instance.timer_kinds
        )
        self._instance.add_timer_kind(timer_kind)

    @property
    def timer_kinds(self) -> list[str]:
        """The kinds of timer this scheduler fires."""
        return list(self._instance.timer_kinds)

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
        wins)::

            await scheduler.set_timer("remind", "user:42", delay_ms=30 * 60_000,
                                      payload={"text": "your cart"})

        A firing of the key in flight goes on; the new setting is due once it ends.
        Works whether this scheduler runs or not (one that does not opens a connection
        for the call: a process that only sets timers keeps a ``Timers`` open instead).
        Many at once: ``set_timers``.

        Args:
            kind: The timer's kind (its handler's, ``timer()``; any process may set it).
            key: The key whose timer it is: any text of 1 to 1024 characters.
            at: When it is due (an aware datetime). Give ``at`` or ``delay_ms``, not
                both; with neither, a recurring timer is first due at its first fire
                time.
            delay_ms: How long from now it is due, in milliseconds on the server's clock
                (0 or more).
            cron: A cron expression (5 fields, or 6 with seconds first) that makes it
                recur: after each firing it is due at the expression's next fire time.
            every_ms: An interval in milliseconds (more than 0) that makes it recur:
                after each firing it is due a whole number of intervals after its last
                due time, the first such time after now. Give ``cron`` or ``every_ms``,
                not both.
            timezone: The IANA time zone ``cron`` is read in (default ``"UTC"``; only
                with ``cron``).
            payload: What the handler gets back as ``TimerRun.payload``: bytes, or a
                JSON-able value (None: none); at most ``max_timer_payload_bytes`` as
                stored.
            buckets: The kind's number of buckets. None: the registered handler's
                here, else the one the kind's instances wrote in the store (else 1).
                Given, it must match theirs.

        Returns:
            The timer's generation: every set of a kind makes a higher one.

        Raises:
            InvalidOptionError: A key, due time, payload or number of buckets that
                cannot be used.
            InvalidScheduleError: A recurrence (cron, interval or time zone) that cannot
                be used.
            InvalidJobError: A kind's name that cannot be used.
            ConnectionFailedError: The server could not be reached (a scheduler that
                does not run opens a connection for the call).
            TransportError: The server did not answer in time, or the connection was
                lost; the timer may or may not be set (setting it again is safe).
        """
        setting = TimerSetting(key, at, delay_ms, cron, every_ms, timezone, payload)
        (generation,) = await self._timers.set_many(kind, [setting], buckets=buckets)
        return generation

    async def set_timers(
        self, kind: str, timers: Iterable[TimerSetting], *, buckets: int | None = None
    ) -> list[int]:
        """Set many timers of ``kind`` as ``set_timer`` sets one, in round trips of up to
        1000 timers (pipelined)::

            await scheduler.set_timers("digest", [
                TimerSetting(f"tenant:{t.id}", cron="0 9 * * *", timezone=t.zone)
                for t in tenants
            ])

        Every setting is checked before anything is sent: a bad one raises (naming its
        key) and sets none. A failure on the way (the server unreachable, an error
        reply) raises; some of the timers may be set then, and calling again with the
        same settings is safe (the newest set wins).

        Args:
            kind: The timers' kind.
            timers: The timers to set, one ``TimerSetting`` each.
            buckets: The kind's number of buckets, as ``set_timer`` takes it.

        Returns:
            The timers' generations, in the order of ``timers``.
        """
        return await self._timers.set_many(kind, timers, buckets=buckets)

    async def cancel_timer(self, kind: str, key: str, *, buckets: int | None = None) -> bool:
        """Cancel ``key``'s timer of ``kind``. A firing in flight goes on (nothing can call
        it back), but nothing follows it: no retry, rearm or recurrence.

        Args:
            kind: The timer's kind.
            key: Its key.
            buckets: The kind's number of buckets, as ``set_timer`` takes it.

        Returns:
            True if the key had a timer, False if it had none.
        """
        return await self._timers.cancel(kind, key, buckets=buckets)

    async def get_timer(
        self, kind: str, key: str, *, buckets: int | None = None
    ) -> TimerInfo | None:
        """``key``'s timer of ``kind`` as the store holds it.

        Args:
            kind: The timer's kind.
            key: Its key.
            buckets: The kind's number of buckets, as ``set_timer`` takes it.

        Returns:
            The timer, or None: the key has none, or its record does not read (it is
            quarantined; a set replaces it).
        """
        return await self._timers.get(kind, key, buckets=buckets)

    async def apply_timers(
        self,
        kind: str,
        timers: Iterable[TimerSetting],
        *,
        remove_others: bool = True,
        buckets: int | None = None,
    ) -> AppliedTimers:
        """Make ``kind``'s recurring timers exactly ``timers`` (create, change, remove),
        as ``Timers.apply`` does: a table of tenants kept in sync every minute::

            applied = await scheduler.apply_timers("digest", [
                TimerSetting(f"tenant:{t.id}", cron=t.digest_cron, timezone=t.zone)
                for t in tenants
            ])

        Args:
            kind: The timers' kind.
            timers: The recurring timers the kind is to hold, each key once.
            remove_others: Cancel the kind's recurring timers whose keys are not in
                ``timers`` (default True).
            buckets: The kind's number of buckets, as ``set_timer`` takes it.

        Returns:
            What changed (``AppliedTimers``): nothing, when applied twice.
        """
        return await self._timers.apply(kind, timers, remove_others=remove_others, buckets=buckets)

    async def cancel_timers(
        self, kind: str, *, prefix: str, limit: int = 1000, buckets: int | None = None
    ) -> int:
        """Cancel ``kind``'s timers whose keys start with ``prefix`` (``"user:42:"``), at
        most ``limit`` per call, as ``Timers.cancel_prefix`` does.

        Args:
            kind: The timers' kind.
            prefix: The start of the keys, taken literally.
            limit: The most timers cancelled in this call (1 to 100 000; default 1000):
                call again while it returns ``limit``.
            buckets: The kind's number of buckets, as ``set_timer`` takes it.

        Returns:
            How many timers were cancelled.
        """
        return await self._timers.cancel_prefix(kind, prefix, limit=limit, buckets=buckets)

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

    @property
    def state(self) -> Literal["new", "running", "stopping", "stopped"]:
        """Where the scheduler is in its life: ``"new"`` (made, not started),
        ``"running"`` (inside ``async with``), ``"stopping"`` (a stop is under way) or
        ``"stopped"`` (it ran, or was stopped before its start; it does not start again)."""
        return self._instance.state

    @property
    def running(self) -> int:
        """How many attempts of jobs and firings of timers run on this instance now."""
        return self._instance.running

    async def wait_stopped(self) -> None:
        """Return once the scheduler has stopped (at once if it has): whoever stopped it,
        a signal handled by ``serve``, leaving ``async with``, or a handler's ``stop()``."""
        await self._instance.wait_stopped()

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

        Args:
            grace_ms: How long running handlers may go on before they are cancelled, in
                milliseconds (0: cancel them at once). None: the scheduler's
                ``stop_grace_ms``.
        """
        await self._instance.stop(grace_ms)

    # ---------------------------------------------------------------- events

    def events(self, *, buffer: int = 1000) -> EventStream:
        """The events of this instance from now until it stops (then the iteration ends),
        or until the stream is closed; open it before the start to see the start too::

            async with scheduler.events() as events:
                async for event in events:
                    ...

        Nothing is made while no stream is open and no hook is set.

        Args:
            buffer: How many events wait for the consumer at most (1 or more; default
                1000); when it falls that far behind, the oldest are dropped
                (``stream.dropped`` counts them): a consumer never slows the scheduler.

        Returns:
            The stream: an async iterator of ``Event``, and an async context manager
            that closes it.

        Raises:
            InvalidOptionError: ``buffer`` is not a whole number, 1 or more.
        """
        return self._instance.events.open(buffer)

    def on_event(self, hook: Callable[[Event], object]) -> Callable[[Event], object]:
        """Call ``hook`` with each event of this instance, in the event loop, as it
        happens; usable as a decorator. It must be quick and must not block (it runs
        inside the scheduler); what it raises is logged once and does not stop it::

            @scheduler.on_event
            def count(event: anarchon.Event) -> None:
                if isinstance(event, anarchon.RunFinished):
                    outcomes[event.outcome] += 1

        Args:
            hook: A function that takes an ``Event`` (what it returns is ignored).

        Returns:
            ``hook`` itself.

        Raises:
            InvalidOptionError: ``hook`` is not callable.
        """
        self._instance.events.add_hook(hook)
        return hook

    # --------------------------------------------------------------- reading

    def next_fire_times(self, job: str, n: int = 10) -> list[datetime]:
        """The job's next ``n`` fire times after now, from its schedule here (no store
        needed): aware UTC datetimes; ``dt.astimezone(ZoneInfo(zone))`` shows one in
        the job's zone. Fewer when the schedule ends. Slots its ``exclude=`` leaves out
        are not listed.

        Args:
            job: The job's name.
            n: How many (1 to 1000; default 10).

        Returns:
            The fire times, earliest first.

        Raises:
            InvalidJobError: No job of that name here.
            InvalidOptionError: ``n`` out of its bounds.
        """
        found = self._instance.jobs.get(job)
        if found is None:
            raise InvalidJobError(f"no job named {visible(job)!r} on this scheduler")
        count = check_count("n", n, most=FIRE_TIMES_MAX)
        return fire_times(found.schedule, int(wall_ms()), count, found.excluded)

    async def history(self, job: str, limit: int = 100) -> list[RunResult]:
        """The newest recorded attempts of ``job`` (and its skipped slots) from the store,
        newest first.

        Args:
            job: The job's name.
            limit: How many at most (1 or more; default 100; the store keeps
                ``history_size``).

        Returns:
            The attempts' results, newest first.

        Raises:
            SchedulerStateError: The scheduler is not running (an ``Inspector`` reads
                the history from anywhere).
            InvalidOptionError: ``limit`` is less than 1.
            ConnectionFailedError: The server did not answer within three round trips
                (a frozen or overloaded server), or the connection was lost.
        """
        return await self._instance.history(job, limit)

    async def pause(self, job: str, *, note: str | None = None, by: str | None = None) -> bool:
        """Pause ``job`` across the fleet: a stored flag that every instance honours at its
        next claim. A slot that comes due while the job is paused is recorded in the
        history as skipped (``"paused: the job is paused"``) and does not run, then or
        later; runs already started, their retries, the takeover of dead runs and
        ``run_now`` go on. Lease strategy only.

        Args:
            job: The name of a job registered on this scheduler.
            note: Why (up to 500 characters): kept with the pause (``JobInfo.paused_by``)
                and in the audit log (``Inspector.audit``).
            by: Who (up to 200 characters; None: ``user@host`` of this process).

        Returns:
            True if this call paused it, False if it was paused already (then the audit
            log is not written).

        Raises:
            SchedulerStateError: The scheduler is not running (an ``Inspector`` pauses
                from anywhere).
            InvalidJobError: No job of that name is registered here.
            InvalidOptionError: The backend's strategy is a claim-only one.
            ConnectionFailedError: The server did not answer within three round trips
                of the lease, or the connection was lost: it may or may not be paused
                (call again: pausing twice changes nothing).
        """
        return await self._instance.set_paused(job, paused=True, note=note, by=by)

    async def resume(self, job: str, *, note: str | None = None, by: str | None = None) -> bool:
        """Resume ``job`` (paused with ``pause``): its next slot runs. Slots skipped while
        it was paused stay skipped. Lease strategy only.

        Args:
            job: The name of a job registered on this scheduler.
            note: Why (up to 500 characters), for the audit log.
            by: Who (up to 200 characters; None: ``user@host`` of this process).

        Returns:
            True if this call resumed it, False if it was not paused (then the audit log
            is not written).

        Raises:
            SchedulerStateError: The scheduler is not running.
            InvalidJobError: No job of that name is registered here.
            InvalidOptionError: The backend's strategy is a claim-only one.
            ConnectionFailedError: The server did not answer within three round trips
                of the lease, or the connection was lost: it may or may not be resumed
                (call again: resuming twice changes nothing).
        """
        return await self._instance.set_paused(job, paused=False, note=note, by=by)

    async def run_now(
        self, job: str, *, note: str | None = None, by: str | None = None
    ) -> RunResult:
        """Run ``job`` now on this instance, wait for it, and return its result.

        The run gets a slot id of its own (never equal to a scheduled one), is
        recorded in the history with trigger ``"manual"``, and is one attempt (no
        retries). Unless the job allows overlapping runs, it is refused with
        ``RunOverlapError`` while another run of the job is unsettled (running,
        waiting for its retry, or orphaned). Its claim is sent again (with the same
        token) after a lost reply or a transient error reply, a few times within about
        a second plus the round-trip deadlines; then it raises ``ConnectionFailedError``.
        At the instance's ``max_concurrent`` (or the job's own) it waits for a run here
        to end before it claims::

            result = await scheduler.run_now("report")
            assert result.status == "ok"

        Args:
            job: The name of a job registered on this scheduler.
            note: Why (up to 500 characters), for the audit log (written once the run
                ended; a refused run is not written).
            by: Who (up to 200 characters; None: ``user@host`` of this process).

        Returns:
            The run's result, as recorded in the history.

        Raises:
            SchedulerStateError: The scheduler is not running, or stopped before the
                run could start.
            InvalidJobError: No job of that name is registered here.
            RunOverlapError: Another run of the job is unsettled, and the job does not
                allow overlapping runs.
            ConnectionFailedError: The claim got no answer, after a few tries.
        """
        return await self._instance.run_now(job, note=note, by=by)

    async def backfill(
        self,
        job: str,
        start: datetime,
        end: datetime,
        *,
        note: str | None = None,
        by: str | None = None,
    ) -> BackfillInfo:
        """Run the slots of ``job``'s schedule in ``[start, end)`` once across the fleet,
        oldest first, with trigger ``"backfill"``: ``Inspector.backfill`` says how, on
        this scheduler's connection::

            await scheduler.backfill("report", datetime(2027, 1, 4, tzinfo=UTC),
                                     datetime(2027, 1, 11, tzinfo=UTC), note="the outage")

        Args:
            job: The name of a job registered on this scheduler (lease strategy).
            start: The range's first instant (an aware datetime; included).
            end: The range's end (aware; excluded), at the latest now.
            note: Why (up to 500 characters), kept with it and in the audit log.
            by: Who (up to 200 characters; None: ``user@host`` of this process).

        Returns:
            The backfill as stored; ``Inspector.jobs`` shows its progress.

        Raises:
            SchedulerStateError: The scheduler is not running.
            InvalidJobError: No job of that name is registered here.
            InvalidOptionError: Not the lease strategy, or a range that is refused (empty,
                ending after now, no slot, more than 10,000 slots).
            RunOverlapError: A backfill of the job is running already, or the job is
                finished.
        """
        conn = self._instance.running_connection()
        if conn is None:
            raise SchedulerStateError("backfill() needs a running scheduler")
        if job not in self._instance.jobs:
            raise InvalidJobError(f"no job named {visible(job, 200)!r} is registered here")
        return await inspector_over(self.backend, conn).backfill(job, start, end, note=note, by=by)
