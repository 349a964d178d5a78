"""The scheduler: claims due slots, runs the ones it wins, keeps their leases alive."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import random
import secrets
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar, overload

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from ._backend import ClaimOnly, K, Leases, RedisBackend
from ._errors import (
    AnarchonError,
    InvalidJobError,
    InvalidOptionError,
    RunOverlapError,
    SchedulerStateError,
)
from ._job import (
    Handler,
    Job,
    check_duration_ms,
    is_async_callable,
    make_schedule,
    takes_run_argument,
    validate_job_name,
)
from ._schedule import Schedule, SlotClock, from_epoch_ms
from ._store import (
    AttemptEnd,
    ClaimReply,
    ClaimRequest,
    HeartbeatRequest,
    Outcome,
    Store,
    is_manual,
    manual_slot_id,
    slot_ms_of,
)
from ._structures import Run, RunResult, Trigger
from .clients import ServerReplyError, TransportError

__all__ = ["Scheduler"]

log = logging.getLogger("anarchon")

F = TypeVar("F", bound=Callable[..., Any])

# Sleeping to the slot instant: the event loop's timers overshoot by about a
# millisecond, so the scheduler sleeps to just before the instant, then yields
# until it arrives.
_SLEEP_MARGIN_SEC = 0.002
# How long one claim batch may take before it counts as failed and is retried.
_CLAIM_TIMEOUT_SEC = 10.0
#: The most claims sent in one round trip.
_CLAIM_BATCH_MAX = 200
_CLAIM_RETRY_MS = (250, 500, 1000, 2000, 5000)


def _now_ms() -> float:
    return time.time() * 1000.0


def _attempts_for(job: Job, slot_id: str) -> int:
    """A manual run has one attempt, whoever claims it; a scheduled one the job's."""
    return 1 if is_manual(slot_id) else job.max_attempts


def _refuse_lease_options(strategy: str, **options: object) -> None:
    given = sorted(name for name, value in options.items() if value is not None)
    if given:
        raise InvalidOptionError(
            f"{', '.join(given)}: lease option(s) that the {strategy!r} strategy does not have "
            "(it holds no leases: no backups, retries, overlap protection or catch-up); drop "
            "them, or use the 'lease' strategy"
        )


def _default_instance_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(order=True, slots=True)
class _Due:
    """A claim this instance will make at ``at_ms`` (wall clock, epoch ms)."""

    at_ms: float
    seq: int
    job: str = field(compare=False)
    slot_id: str = field(compare=False)
    slot_ms: int = field(compare=False)
    trigger: Trigger = field(compare=False)
    #: The slot's first claim by this instance (lateness applies, and the
    #: job's next slot is scheduled); later claims are a backup's or a retry's.
    first: bool = field(compare=False)
    token: str = field(compare=False, default_factory=lambda: secrets.token_hex(8))
    failures: int = field(compare=False, default=0)
    #: Whether this claim may start the run: a first claim, or one waiting behind an
    #: overlapping run after its first claim found the slot not started. A backup's
    #: or a retry's claim of a slot whose state was forgotten must not start it again.
    may_start: bool = field(compare=False, default=False)


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
    ``heartbeat_ms`` (at most half of it) how often the runner extends it.
    ``stop_grace_ms`` is how long ``stop()`` lets running handlers finish before
    cancelling them and releasing their leases. ``retry_delay_ms`` is the delay
    before the second attempt of a failed run, doubling for each later one.
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
        heartbeat_ms: int = 10_000,
        history_size: int = 1000,
        history_ttl_ms: int | None = None,
        instance_id: str | None = None,
        stop_grace_ms: int = 30_000,
        retry_delay_ms: int = 1_000,
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
            )
        self.lease_ms = check_duration_ms("lease_ms", 30_000 if lease_ms is None else lease_ms)
        self.heartbeat_ms = check_duration_ms(
            "heartbeat_ms", 10_000 if heartbeat_ms is None else heartbeat_ms
        )
        if self.heartbeat_ms * 2 > self.lease_ms:
            raise InvalidOptionError(
                f"heartbeat_ms ({heartbeat_ms}) must be at most half of lease_ms ({lease_ms}), "
                "so that a late heartbeat still arrives before the lease expires"
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
        if instance_id is None:
            instance_id = _default_instance_id()
        if not isinstance(instance_id, str) or not instance_id or "|" in instance_id:
            raise InvalidOptionError(
                f"instance_id must be a non-empty string without '|', got {instance_id!r}"
            )
        self.instance_id = instance_id

        self._jobs: dict[str, Job] = {}
        self._store: Store | None = None
        self._group: TaskGroup | None = None
        self._state: Literal["new", "running", "stopping", "stopped"] = "new"
        self._due: list[_Due] = []
        self._seq = itertools.count()
        self._wake = anyio.Event()
        self._attempts: dict[tuple[str, str], _Attempt] = {}
        #: Follow-up claims (backups, retries, take-overs) waiting in the heap.
        self._pending: set[tuple[str, str]] = set()
        #: Claims waiting for a run of the job on this instance to end (overlap).
        self._overlap_waiters: dict[str, list[_Due]] = {}
        #: The next scheduled slot of each job this instance will claim.
        self._next_slot_ms: dict[str, int] = {}
        self._idle = anyio.Event()
        self._idle.set()
        #: Wakes the lease keeper when an attempt needs a heartbeat before its next tick.
        self._beat_wake = anyio.Event()
        self._next_beat_at = math.inf
        self._claim_loop_done = anyio.Event()
        self._stopped = anyio.Event()

    # ------------------------------------------------------------------ jobs

    @overload
    def job(
        self: Scheduler[Leases],
        schedule: str | Schedule | None = None,
        *,
        every_ms: int | None = None,
        name: str | None = None,
        timezone: str = "UTC",
        overlap: bool = False,
        max_attempts: int = 3,
        catch_up_ms: int = 0,
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
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
    ) -> Callable[[F], F]: ...

    def job(
        self,
        schedule: str | Schedule | None = None,
        *,
        every_ms: int | None = None,
        name: str | None = None,
        timezone: str = "UTC",
        overlap: bool | None = None,
        max_attempts: int | None = None,
        catch_up_ms: int | None = None,
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
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
        overlap: bool = False,
        max_attempts: int = 3,
        catch_up_ms: int = 0,
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
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
    ) -> None: ...

    def add_job(
        self,
        handler: Handler,
        schedule: str | Schedule | None = None,
        *,
        every_ms: int | None = None,
        name: str | None = None,
        timezone: str = "UTC",
        overlap: bool | None = None,
        max_attempts: int | None = None,
        catch_up_ms: int | None = None,
        jitter_ms: int = 0,
        max_late_ms: int = 60_000,
    ) -> None:
        """Register a job.

        ``schedule`` is a 5-field cron string, a 6-field one with seconds first,
        or an object with ``next_after(datetime)``; ``every_ms`` instead fires at
        fixed intervals aligned to the Unix epoch. ``timezone`` is an IANA name.
        ``jitter_ms`` (default 0) waits a random part of it before claiming;
        ``max_late_ms`` (default 60 s) is how late a slot may still be claimed for
        the first time. With the lease strategy: ``overlap`` (default False) lets
        a slot start while an older one still runs; ``max_attempts`` (default 3)
        counts every attempt, crashed or failed; ``catch_up_ms`` (default 0) runs
        slots missed in that window on start and after a gap.

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
        )

    def _add_job(
        self,
        handler: Handler,
        schedule: str | Schedule | None,
        *,
        every_ms: int | None,
        name: str | None,
        timezone: str,
        overlap: bool | None,
        max_attempts: int | None,
        catch_up_ms: int | None,
        jitter_ms: int,
        max_late_ms: int,
    ) -> None:
        if not callable(handler):
            raise InvalidJobError(f"a job's handler must be callable, got {handler!r}")
        job_name = validate_job_name(
            name if name is not None else getattr(handler, "__name__", None)
        )
        if job_name in self._jobs:
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
            )
        attempts = 3 if max_attempts is None else max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise InvalidOptionError(
                f"max_attempts must be a whole number, 1 or more, got {max_attempts!r}"
            )
        if overlap is not None and not isinstance(overlap, bool):
            raise InvalidOptionError(f"overlap must be True or False, got {overlap!r}")
        job_schedule = make_schedule(schedule, every_ms, timezone)
        job = Job(
            name=job_name,
            handler=handler,
            schedule=job_schedule,
            clock=SlotClock(job_schedule),
            overlap=bool(overlap),
            max_attempts=attempts if self.backend.leases else 1,
            catch_up_ms=check_duration_ms(
                "catch_up_ms", 0 if catch_up_ms is None else catch_up_ms, allow_zero=True
            ),
            jitter_ms=check_duration_ms("jitter_ms", jitter_ms, allow_zero=True),
            max_late_ms=check_duration_ms("max_late_ms", max_late_ms, allow_zero=True),
            takes_run=takes_run_argument(handler),
            is_async=is_async_callable(handler),
        )
        window_ms = self.backend.script_window_ms
        if window_ms is not None and job.late_window_ms >= window_ms:
            raise InvalidOptionError(
                f"job {job_name!r}: jitter_ms + max_late_ms ({job.late_window_ms}) must be less "
                f"than the script strategy's window_ms ({window_ms}), or a late claim could find "
                "the slot forgotten and run it again; lower max_late_ms or raise window_ms"
            )
        self._jobs[job_name] = job
        if self._state == "running":
            assert self._store is not None
            self._schedule_first_slots(job, _now_ms())

    @property
    def jobs(self) -> list[str]:
        """The names of the registered jobs."""
        return list(self._jobs)

    # ------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Scheduler[K]:
        if self._state != "new":
            raise SchedulerStateError(
                f"this scheduler is {self._state}; a Scheduler starts once: create a new one"
            )
        self._store = await self.backend.open(
            {
                "runner": self.instance_id,
                "history_size": self.history_size,
                "history_ttl_ms": self.history_ttl_ms,
            }
        )
        try:
            await self._store.prepare_jobs(self.jobs)
        except BaseException:
            if self._store.conn.owned:
                await self._store.conn.aclose()
            raise
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        self._state = "running"
        now = _now_ms()
        for job in self._jobs.values():
            self._schedule_first_slots(job, now)
        self._group.start_soon(self._claim_loop)
        if self._store.leases:
            self._group.start_soon(self._lease_keeper)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._group is not None
        with anyio.CancelScope(shield=True):
            await self.stop()
        return await self._group.__aexit__(exc_type, exc, tb)

    async def stop(self, grace_ms: int | None = None) -> None:
        """Stop claiming, let running handlers finish within the grace period, then cancel
        them and release their leases so that a backup takes over without waiting for
        the lease to expire. Closes the connection if anarchon opened it.

        Handlers that are plain functions run in worker threads, which cannot be
        interrupted: they see ``run.lease_lost`` set and are waited for.
        """
        if self._state == "new":
            self._state = "stopped"
            self._stopped.set()
            return
        if self._state in ("stopping", "stopped"):
            await self._stopped.wait()
            return
        self._state = "stopping"
        grace_sec = (self.stop_grace_ms if grace_ms is None else grace_ms) / 1000
        self._wake.set()
        await self._claim_loop_done.wait()
        with anyio.move_on_after(grace_sec):
            await self._idle.wait()
        for attempt in list(self._attempts.values()):
            attempt.cancel("the scheduler is stopping")
        await self._idle.wait()
        assert self._store is not None
        if self._store.conn.owned:
            await self._store.conn.aclose()
        self._state = "stopped"
        self._beat_wake.set()  # the lease keeper ends
        self._stopped.set()

    # --------------------------------------------------------------- reading

    async def history(self, job: str, limit: int = 100) -> list[RunResult]:
        """The newest ``limit`` attempts of ``job`` from the store, newest first."""
        if self._store is None or self._state != "running":
            raise SchedulerStateError("history() needs a running scheduler (inside `async with`)")
        if limit < 1:
            raise InvalidOptionError(f"limit must be 1 or more, got {limit}")
        return await self._store.history(job, limit)

    async def run_now(self, job: str) -> RunResult:
        """Run ``job`` now on this instance, wait for it, and return its result.

        The run gets a slot id of its own (never equal to a scheduled one), is
        recorded in the history with trigger ``"manual"``, and is one attempt (no
        retries). Unless the job allows overlapping runs, it is refused with
        ``RunOverlapError`` while another run of the job holds a live lease::

            result = await scheduler.run_now("report")
            assert result.status == "ok"
        """
        if self._store is None or self._state != "running":
            raise SchedulerStateError("run_now() needs a running scheduler (inside `async with`)")
        found = self._jobs.get(job)
        if found is None:
            raise InvalidJobError(f"no job named {job!r} on this scheduler; jobs: {self.jobs}")
        requested_ms = int(_now_ms())
        slot_id = manual_slot_id(requested_ms, secrets.token_hex(4))
        token = secrets.token_hex(8)
        if self._store.leases:
            reply = await self._claim_manual(found, slot_id, requested_ms, token)
        else:
            # No lease to claim: the manual stream records the run, which runs here.
            await self._store.begin_manual(found.name, slot_id, token)
            reply = ClaimReply("won", attempt=1, fence=requested_ms, trigger="manual")
        attempt = self._start_attempt(found, slot_id, token, reply)
        await attempt.settled.wait()
        try:
            return await self._store.result_of(found.name, slot_id, attempt.run.attempt)
        except LookupError:
            # The lease was lost and nobody recorded the attempt.
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

    async def _claim_manual(
        self, job: Job, slot_id: str, requested_ms: int, token: str
    ) -> ClaimReply:
        assert self._store is not None
        request = ClaimRequest(
            job=job.name,
            slot_id=slot_id,
            slot_ms=requested_ms,
            token=token,
            trigger="manual",
            lease_ms=self.lease_ms,
            max_attempts=_attempts_for(job, slot_id),
            allow_overlap=job.overlap,
            keep_ms=job.keep_ms(self.lease_ms),
        )
        (reply,) = await self._store.claim_many([request])
        if isinstance(reply, ServerReplyError):
            raise AnarchonError(f"the server refused the manual claim of {job.name!r}: {reply}")
        for orphan in reply.orphans:
            self._take_over(job, orphan, _now_ms())
        if reply.kind == "overlap":
            raise RunOverlapError(
                f"{job.name!r} is running elsewhere (its lease has {reply.wait_ms} ms left) and "
                "does not allow overlapping runs: wait for it to end, or define the job with "
                "overlap=True"
            )
        if reply.kind != "won":  # a fresh slot id has no state: only won or overlap
            raise AnarchonError(f"unexpected reply to a manual claim of {job.name!r}: {reply}")
        return reply

    # ------------------------------------------------------------ scheduling

    def _push(self, due: _Due) -> None:
        first_before = self._due[0].at_ms if self._due else math.inf
        heapq.heappush(self._due, due)
        if not due.first:
            self._pending.add((due.job, due.slot_id))
        if due.at_ms < first_before:
            self._wake.set()

    def _push_follow_up(
        self, job: Job, slot_id: str, trigger: Trigger, at_ms: float, may_start: bool = False
    ) -> _Due:
        """A later claim of a slot this instance already asked about: a backup's, a retry's."""
        due = _Due(
            at_ms, next(self._seq), job.name, slot_id, slot_ms_of(slot_id), trigger, False,
            may_start=may_start,
        )  # fmt: skip
        self._push(due)
        return due

    def _schedule_slot(self, job: Job, slot_ms: int, trigger: Trigger) -> None:
        jitter = random.uniform(0, job.jitter_ms) if job.jitter_ms else 0.0
        self._next_slot_ms[job.name] = slot_ms
        due = _Due(
            slot_ms + jitter, next(self._seq), job.name, str(slot_ms), slot_ms, trigger, True,
            may_start=True,
        )  # fmt: skip
        self._push(due)

    def _schedule_first_slots(self, job: Job, now_ms: float) -> None:
        """On start (or when added): slots in the catch-up window, then the next one."""
        after = int(now_ms) - job.catch_up_ms - 1 if job.catch_up_ms else int(now_ms)
        slot = job.clock.next_slot_ms(after)
        if slot is not None:
            self._schedule_slot(job, slot, "catch-up" if slot < now_ms else "schedule")

    def _schedule_next_slot(self, job: Job, after_slot_ms: int, now_ms: float) -> None:
        """After a slot's first claim, its successor. After a gap (a stall or an
        outage) slots too old for both lateness and catch-up are skipped over."""
        oldest_wanted = int(now_ms) - max(job.late_window_ms, job.catch_up_ms) - 1
        slot = job.clock.next_slot_ms(max(after_slot_ms, oldest_wanted))
        if oldest_wanted > after_slot_ms:
            log.warning(
                "%s: slots after %s were missed (no claim in time)",
                job.name,
                from_epoch_ms(after_slot_ms),
            )
        if slot is None:
            self._next_slot_ms.pop(job.name, None)
            return
        overdue_ms = now_ms - slot
        self._schedule_slot(
            job, slot, "catch-up" if 0 < overdue_ms <= job.catch_up_ms else "schedule"
        )

    async def _claim_loop(self) -> None:
        try:
            while self._state == "running":
                batch = await self._next_batch()
                # A large instant goes in parts: the first runs start while the rest
                # are claimed, and no round trip outgrows a client's request timeout.
                for start in range(0, len(batch), _CLAIM_BATCH_MAX):
                    await self._claim(batch[start : start + _CLAIM_BATCH_MAX])
        finally:
            self._claim_loop_done.set()

    async def _next_batch(self) -> list[_Due]:
        """Sleep until the earliest claim is due; return every claim due by then."""
        while self._state == "running":
            if not self._due:
                await self._wait_for_wake(None)
                continue
            delay_sec = (self._due[0].at_ms - _now_ms()) / 1000
            if delay_sec > _SLEEP_MARGIN_SEC:
                await self._wait_for_wake(delay_sec - _SLEEP_MARGIN_SEC)
                continue
            if delay_sec > 0:
                await anyio.lowlevel.checkpoint()
                continue
            return self._pop_due(_now_ms())
        return []

    async def _wait_for_wake(self, timeout_sec: float | None) -> None:
        with anyio.move_on_after(math.inf if timeout_sec is None else timeout_sec):
            await self._wake.wait()
        if self._wake.is_set():
            self._wake = anyio.Event()

    def _pop_due(self, now_ms: float) -> list[_Due]:
        batch: list[_Due] = []
        while self._due and self._due[0].at_ms <= now_ms:
            due = heapq.heappop(self._due)
            self._pending.discard((due.job, due.slot_id))
            waiters = self._overlap_waiters.get(due.job)
            if waiters and due in waiters:
                waiters.remove(due)  # claimed now: nothing left to wake
            job = self._jobs.get(due.job)
            if job is None:
                continue
            if due.first and due.failures == 0:
                self._schedule_next_slot(job, due.slot_ms, now_ms)
            if due.first and not self._in_time(job, due, now_ms):
                continue
            batch.append(due)
        return batch

    def _in_time(self, job: Job, due: _Due, now_ms: float) -> bool:
        """A first claim is made only while the slot is young enough, or in catch-up."""
        age_ms = now_ms - due.slot_ms
        if age_ms <= job.late_window_ms:
            return True
        if age_ms <= job.catch_up_ms:
            due.trigger = "catch-up"
            return True
        log.warning(
            "%s: slot %s missed: %.0f ms late, max_late_ms=%d and catch_up_ms=%d",
            job.name,
            from_epoch_ms(due.slot_ms),
            age_ms,
            job.max_late_ms,
            job.catch_up_ms,
        )
        return False

    # ---------------------------------------------------------------- claims

    async def _claim(self, batch: list[_Due]) -> None:
        """Claim every slot of the batch in one round trip and act on the answers."""
        assert self._store is not None
        requests = [self._claim_request(due) for due in batch]
        replies: list[ClaimReply | ServerReplyError] | None = None
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + _CLAIM_TIMEOUT_SEC
            try:
                replies = await self._store.claim_many(requests)
            except TransportError as exc:
                log.warning("claiming %d slot(s) failed, retrying: %s", len(batch), exc)
                self._retry_claims(batch)
                return
        if replies is None:
            log.warning("claiming %d slot(s) timed out, retrying", len(batch))
            self._retry_claims(batch)
            return
        now_ms = _now_ms()
        for due, reply in zip(batch, replies, strict=True):
            if isinstance(reply, ServerReplyError):
                log.error("%s: the claim of slot %s failed: %s", due.job, due.slot_id, reply)
                continue
            self._on_claim_reply(due, reply, now_ms)

    def _claim_request(self, due: _Due) -> ClaimRequest:
        job = self._jobs[due.job]
        return ClaimRequest(
            job=job.name,
            slot_id=due.slot_id,
            slot_ms=due.slot_ms,
            token=due.token,
            trigger=due.trigger,
            lease_ms=self.lease_ms,
            max_attempts=_attempts_for(job, due.slot_id),
            allow_overlap=job.overlap,
            keep_ms=job.keep_ms(self.lease_ms),
            may_start=due.may_start,
        )

    def _retry_claims(self, batch: list[_Due]) -> None:
        """Claims whose round trip failed are sent again with the same token (the claim
        script recognises a repeat), after a growing delay."""
        now_ms = _now_ms()
        for due in batch:
            wait_ms = _CLAIM_RETRY_MS[min(due.failures, len(_CLAIM_RETRY_MS) - 1)]
            due.failures += 1
            due.at_ms = now_ms + wait_ms
            due.seq = next(self._seq)
            self._push(due)

    def _on_claim_reply(self, due: _Due, reply: ClaimReply, now_ms: float) -> None:
        job = self._jobs.get(due.job)
        if job is None:
            return
        for orphan in reply.orphans:
            self._take_over(job, orphan, now_ms)
        if reply.kind == "won":
            self._start_attempt(job, due.slot_id, due.token, reply)
        elif reply.kind == "running":
            self._back_up(job, due, reply.wait_ms, now_ms)
        elif reply.kind == "overlap":
            if due.first and due.trigger == "schedule":
                log.info(
                    "%s: slot %s skipped: an older run still holds its lease",
                    job.name,
                    due.slot_id,
                )
            else:
                # Catch-up slots and retries wait their turn behind the live run.
                self._wait_behind_overlap(job, due, reply.wait_ms, now_ms)

    def _back_up(self, job: Job, due: _Due, wait_ms: int, now_ms: float) -> None:
        """Become a backup of a run in progress: ask again when its lease (or retry delay)
        runs out. When this instance claims the job's next slot before then, that claim
        reports the run if it is orphaned, so no extra claim is needed."""
        ask_at_ms = now_ms + max(wait_ms, 1)
        next_slot_ms = self._next_slot_ms.get(job.name)
        if next_slot_ms is not None and next_slot_ms + job.jitter_ms < ask_at_ms:
            return
        self._push_follow_up(job, due.slot_id, due.trigger, ask_at_ms)

    def _take_over(self, job: Job, slot_id: str, now_ms: float) -> None:
        """Claim a slot that nobody holds any more (its runner died, or its retry is due)."""
        if (job.name, slot_id) in self._pending or (job.name, slot_id) in self._attempts:
            return
        self._push_follow_up(job, slot_id, "retry", now_ms)

    def _wait_behind_overlap(self, job: Job, due: _Due, wait_ms: int, now_ms: float) -> None:
        """Ask again when the live run's lease runs out, or as soon as a run of the job on
        this instance ends, whichever is first."""
        waiting = self._push_follow_up(
            job, due.slot_id, due.trigger, now_ms + max(wait_ms, 1), may_start=due.may_start
        )
        self._overlap_waiters.setdefault(job.name, []).append(waiting)

    def _wake_overlap_waiters(self, job: Job) -> None:
        waiters = self._overlap_waiters.pop(job.name, [])
        if waiters:
            now_ms = _now_ms()
            for due in waiters:
                due.at_ms = min(due.at_ms, now_ms)
            heapq.heapify(self._due)
            self._wake.set()

    # ------------------------------------------------------------------ runs

    def _start_attempt(self, job: Job, slot_id: str, token: str, reply: ClaimReply) -> _Attempt:
        assert self._group is not None
        slot_ms = slot_ms_of(slot_id)
        run = Run(
            job=job.name,
            slot=from_epoch_ms(slot_ms),
            slot_ms=slot_ms,
            attempt=reply.attempt,
            trigger=reply.trigger,
            runner=self.instance_id,
            fence=reply.fence,
        )
        attempt = _Attempt(job, run, slot_id, token)
        now = time.monotonic()
        attempt.held_until = now + reply.wait_ms / 1000
        attempt.next_beat = now + self.heartbeat_ms / 1000
        if attempt.next_beat < self._next_beat_at:
            self._beat_wake.set()
        self._attempts[(job.name, slot_id)] = attempt
        if self._idle.is_set():
            self._idle = anyio.Event()
        self._group.start_soon(self._run_attempt, attempt, name=f"anarchon {job.name} {slot_id}")
        return attempt

    async def _run_attempt(self, attempt: _Attempt) -> None:
        outcome: Outcome = "cancelled"
        error: str | None = None
        try:
            with attempt.scope:
                try:
                    await attempt.job.invoke(attempt.run)
                    outcome = "ok"
                except Exception as exc:
                    outcome = "failed"
                    error = "".join(traceback.format_exception_only(exc)).strip()
                    log.warning(
                        "%s slot %s attempt %d failed: %s",
                        attempt.job.name,
                        attempt.slot_id,
                        attempt.run.attempt,
                        error,
                        exc_info=exc,
                    )
            if attempt.scope.cancelled_caught:
                outcome = "cancelled"
        finally:
            with anyio.CancelScope(shield=True):
                await self._settle(attempt, outcome, error)
                del self._attempts[(attempt.job.name, attempt.slot_id)]
                attempt.settled.set()
                self._wake_overlap_waiters(attempt.job)
                if not self._attempts:
                    self._idle.set()

    async def _lease_keeper(self) -> None:
        """Heartbeat the leases of every running attempt, in one round trip per tick.

        An attempt's lease is extended every heartbeat_ms (those due within a quarter
        of that go along, so ticks stay few). A refused heartbeat, or none accepted
        for a whole lease, means the lease is lost and the handler is cancelled. Ends
        once the scheduler has stopped."""
        early_sec = self.heartbeat_ms / 4000
        while not (self._state == "stopped" and not self._attempts):
            now = time.monotonic()
            due = [a for a in self._attempts.values() if a.next_beat <= now + early_sec]
            if due:
                await self._heartbeat(due)
                continue
            self._next_beat_at = min(
                (a.next_beat for a in self._attempts.values()), default=math.inf
            )
            with anyio.move_on_after(self._next_beat_at - now):
                await self._beat_wake.wait()
            self._next_beat_at = math.inf
            if self._beat_wake.is_set():
                self._beat_wake = anyio.Event()

    async def _heartbeat(self, attempts: list[_Attempt]) -> None:
        assert self._store is not None
        beats = [
            HeartbeatRequest(a.job.name, a.slot_id, a.token, self.lease_ms, a.job.overlap)
            for a in attempts
        ]
        sent = time.monotonic()
        replies: list[bool | ServerReplyError] | None = None
        failure = "timed out"
        with anyio.move_on_after(_CLAIM_TIMEOUT_SEC):
            try:
                replies = await self._store.heartbeat_many(beats)
            except TransportError as exc:
                failure = str(exc)
        for index, attempt in enumerate(attempts):
            if self._attempts.get((attempt.job.name, attempt.slot_id)) is not attempt:
                continue  # ended meanwhile
            attempt.next_beat = sent + self.heartbeat_ms / 1000
            reply = replies[index] if replies is not None else failure
            if reply is True:
                attempt.held_until = sent + self.lease_ms / 1000
            elif reply is False:
                attempt.lost = True
                attempt.cancel("another attempt holds the run now")
            elif time.monotonic() >= attempt.held_until:
                attempt.lost = True
                attempt.cancel(f"no heartbeat got through for a whole lease ({reply})")
            else:
                log.warning("%s: heartbeat failed, will retry: %s", attempt.job.name, reply)

    async def _settle(self, attempt: _Attempt, outcome: Outcome, error: str | None) -> None:
        """Record how the attempt ended; retried a few times if the connection drops.
        Without its token in the state (lease lost) the store changes nothing."""
        assert self._store is not None
        job = attempt.job
        run = attempt.run
        end = AttemptEnd(
            job=job.name,
            slot_id=attempt.slot_id,
            token=attempt.token,
            attempt=run.attempt,
            trigger=run.trigger,
            fence=run.fence,
            started_ms=attempt.started_ms,
            finished_ms=int(_now_ms()),
            outcome=outcome,
            error=error,
            max_attempts=attempt.max_attempts,
            retry_delay_ms=self.retry_delay_ms * 2 ** (run.attempt - 1),
        )
        for wait_sec in (0.0, 0.2, 0.5, 1.0, 2.0, 5.0):
            await anyio.sleep(wait_sec)
            try:
                reply = await self._store.finish(end)
            except (TransportError, ServerReplyError) as exc:
                log.warning("%s: recording the result failed, retrying: %s", job.name, exc)
                continue
            if not reply.held:
                attempt.lost = True
                log.warning(
                    "%s slot %s attempt %d ended after losing its lease; its result "
                    "(%s) was not recorded",
                    job.name,
                    attempt.slot_id,
                    attempt.run.attempt,
                    outcome,
                )
            elif reply.status == "retry" and self._state == "running":
                self._push_follow_up(job, attempt.slot_id, "retry", _now_ms() + reply.retry_in_ms)
            return
        log.error(
            "%s slot %s attempt %d: could not record the result; the lease will expire "
            "and a backup will take over",
            job.name,
            attempt.slot_id,
            attempt.run.attempt,
        )
