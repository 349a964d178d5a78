"""Value types that handlers and readers of history see."""

import threading
from collections.abc import Generator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from .._errors import InvalidOptionError, LeaseLostError

__all__ = [
    "InstanceInfo",
    "JobInfo",
    "LeaseInfo",
    "OverlapPolicy",
    "Run",
    "RunResult",
    "RunStatus",
    "TimerInfo",
    "TimerKindInfo",
    "TimerRun",
    "TimerStatus",
    "TimerTrigger",
    "Trigger",
]

Trigger = Literal["schedule", "catch-up", "retry", "takeover", "manual"]
#: How an attempt ended; ``skipped``: the slot did not run at all (``attempt`` 0,
#: ``error`` says why, e.g. an older run of the job was not settled yet).
RunStatus = Literal["ok", "failed", "interrupted", "cancelled", "skipped"]
#: What a slot does while an older run of its job is unsettled: ``skip`` it (recorded
#: as skipped), ``wait`` for that run to end (at most one slot waits), or ``allow``
#: it to run at once, side by side.
OverlapPolicy = Literal["skip", "wait", "allow"]


@dataclass(frozen=True, slots=True)
class Run:
    """One attempt at one slot of a job, as the handler sees it.

    A handler that declares a parameter receives it::

        @scheduler.job("*/5 * * * *")
        async def sync(run: Run) -> None:
            print(run.job, run.slot, run.attempt, run.fence)

    ``fence`` grows with every win of the job, across all instances: stores
    that the handler writes to can reject a write that carries a smaller
    fence than one they have already seen (a stale runner).

    ``lease_lost`` is set when this attempt must stop: it no longer holds its lease
    (a heartbeat was refused, none got through in time), the scheduler is stopping,
    or the job's ``timeout_ms`` has passed. Async handlers are cancelled instead; a
    plain function running in a worker thread cannot be, so it should check between
    steps, most simply
    with ``run.raise_if_lost()``::

        @scheduler.job("0 * * * *")
        def export(run: Run) -> None:
            for batch in batches():
                run.raise_if_lost()
                write(batch, fence=run.fence)

    An attempt whose handler returns after ``lease_lost`` was set is recorded as
    cancelled, not ok (it stopped early), and is retried while attempts are left.
    """

    job: str
    slot: datetime
    slot_ms: int
    attempt: int
    trigger: Trigger
    runner: str
    fence: int
    lease_lost: threading.Event = field(default_factory=threading.Event, compare=False)

    def raise_if_lost(self) -> None:
        """Raise ``LeaseLostError`` if this attempt no longer holds its lease."""
        if self.lease_lost.is_set():
            raise LeaseLostError(
                f"{self.job} slot {self.slot_ms} attempt {self.attempt} no longer holds its "
                "lease (another attempt may run, or the scheduler is stopping): stop here"
            )


@dataclass(frozen=True, slots=True)
class RunResult:
    """How one attempt at a slot ended, as recorded in the store's history."""

    job: str
    slot: datetime
    slot_ms: int
    attempt: int
    trigger: Trigger
    runner: str
    status: RunStatus
    started_at: datetime
    finished_at: datetime
    error: str | None
    fence: int


#: Why a timer fires: it is ``due`` (attempt 1), a failed attempt's ``retry``, or a
#: ``takeover`` of a firing whose runner vanished (its lease expired).
TimerTrigger = Literal["due", "retry", "takeover"]
#: A key's timer: ``pending`` (waiting for its due time), ``firing`` (an attempt holds
#: its lease), ``retry`` (a failed attempt's retry is waiting for its delay).
TimerStatus = Literal["pending", "firing", "retry"]


class _Done:
    """What ``TimerRun.rearm`` returns: awaiting it is optional (it did its work)."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # pragma: no cover - makes this a generator


@dataclass(frozen=True, slots=True)
class TimerRun:
    """One attempt at firing one generation of a key's timer, as the handler sees it::

        @scheduler.timer("remind")
        async def remind(fire: TimerRun) -> None:
            await send(fire.key, fire.payload, fence=fire.fence)
            fire.rearm(delay_ms=3_600_000)   # again in an hour (await it or not)

    ``payload`` is what ``set_timer`` was given: bytes, or the JSON-able value
    (decoded). ``generation`` identifies this set of the key (every set, rearm and
    recurrence makes a higher one); ``fence`` grows with every firing of the kind, for
    stores that reject stale writers. ``lease_lost`` is set when this attempt no longer
    holds its lease (async handlers are cancelled instead), as for jobs' ``Run``.
    """

    kind: str
    key: str
    payload: Any
    due: datetime
    due_ms: int
    generation: int
    attempt: int
    trigger: TimerTrigger
    runner: str
    fence: int
    lease_lost: threading.Event = field(default_factory=threading.Event, compare=False)
    #: The rearm asked for (at most one: the last call wins): (at_ms, delay_ms).
    _rearm: list[tuple[int | None, int | None]] = field(
        default_factory=list, compare=False, repr=False
    )

    def rearm(self, *, at: datetime | None = None, delay_ms: int | None = None) -> _Done:
        """Set the key's timer again, due ``at`` (an aware datetime) or ``delay_ms`` after
        this firing ends (on the server's clock), with the same payload: written in the
        same script as this firing's finish, when the handler returns. It is dropped if
        the handler raises (a retry may rearm again), and if the key was set again or
        cancelled while this firing ran (the newest set wins). Awaiting the result is
        optional; the last call wins."""
        if (at is None) == (delay_ms is None):
            raise InvalidOptionError("rearm() takes at= (an aware datetime) or delay_ms=, one")
        if at is not None:
            if not isinstance(at, datetime) or at.tzinfo is None:
                raise InvalidOptionError(f"rearm(at=...) needs an aware datetime, got {at!r}")
            self._rearm[:] = [(round(at.timestamp() * 1000), None)]
        else:
            if isinstance(delay_ms, bool) or not isinstance(delay_ms, int) or delay_ms < 0:
                raise InvalidOptionError(
                    f"rearm(delay_ms=...) must be a whole number of milliseconds, 0 or more, "
                    f"got {delay_ms!r}"
                )
            self._rearm[:] = [(None, delay_ms)]
        return _Done()

    @property
    def rearmed(self) -> tuple[int | None, int | None] | None:
        """The rearm the handler asked for: ``(at_ms, delay_ms)``, or None."""
        return self._rearm[-1] if self._rearm else None

    def raise_if_lost(self) -> None:
        """Raise ``LeaseLostError`` if this attempt no longer holds its lease."""
        if self.lease_lost.is_set():
            raise LeaseLostError(
                f"timer {self.kind} {self.key!r} attempt {self.attempt} no longer holds its "
                "lease (another attempt may fire it, or the scheduler is stopping): stop here"
            )


@dataclass(frozen=True, slots=True)
class TimerSetting:
    """One timer for ``set_timers``: a key and when it is due, as ``set_timer`` takes
    them (``at=``, ``delay_ms=``, ``cron=`` or ``every_ms=``, ``timezone=``,
    ``payload=``)::

        TimerSetting("cart:9", delay_ms=2 * 3_600_000, payload={"cart": 9})
    """

    key: str
    at: datetime | None = None
    delay_ms: int | None = None
    cron: str | None = None
    every_ms: int | None = None
    timezone: str = "UTC"
    payload: Any = None


@dataclass(frozen=True, slots=True)
class TimerInfo:
    """A key's timer as the store holds it (``get_timer``)."""

    kind: str
    key: str
    generation: int
    #: When the newest generation is due; None once it was cancelled while a firing
    #: of an older one is still in flight.
    due: datetime | None
    due_ms: int | None
    payload: Any
    status: TimerStatus
    #: The attempt in flight or waiting for its retry (0 while pending).
    attempt: int
    #: How it recurs: ``"every_ms=..."``, ``"cron=... timezone=..."``, or None.
    recurs: str | None


@dataclass(frozen=True, slots=True)
class JobInfo:
    """A job as the registry in the store shows it (``Inspector.jobs``).

    ``schedule`` describes it (``cron`` or ``every_ms`` is set for the built-in kinds);
    ``next_fire`` is its next slot after now in UTC (None if it never fires again or
    cannot be reckoned here: a custom schedule reports the next slot its instances
    last saw); ``options`` holds the rest of its definition (``overlap``,
    ``max_attempts``, ``catch_up_ms``, ``timeout_ms``, ...). ``paused_by`` says who
    paused it and when. ``last`` is its newest recorded attempt. ``first_seen`` is when
    it first appeared in the store (catch-up never reaches back before it)."""

    name: str
    schedule: str
    cron: str | None
    every_ms: int | None
    timezone: str
    strategy: str
    next_fire: datetime | None
    paused: bool
    paused_by: str | None
    last: RunResult | None
    first_seen: datetime | None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """A run in progress as the store holds it (``Inspector.leases``): ``status``
    ``running`` (``runner`` holds its lease for ``left_ms`` more) or ``retry`` (it waits
    for its next attempt, which may start in ``left_ms``)."""

    job: str
    slot: datetime
    slot_ms: int
    slot_id: str
    status: Literal["running", "retry"]
    attempt: int
    runner: str
    fence: int
    trigger: Trigger
    left_ms: int


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """An instance alive in the fleet, as it registered itself (``Inspector.instances``);
    ``expires_in_ms`` is how long its registration lasts unless it renews it."""

    id: str
    host: str
    pid: int
    version: str
    started: datetime
    strategy: str
    jobs: tuple[str, ...]
    timer_kinds: tuple[str, ...]
    running: int
    expires_in_ms: int


@dataclass(frozen=True, slots=True)
class TimerKindInfo:
    """A kind of timer the fleet fires (``Inspector.timers``): how many keys have a
    timer pending, and the first to fall due."""

    kind: str
    buckets: int
    pending: int
    next_due: datetime | None
    next_key: str | None
