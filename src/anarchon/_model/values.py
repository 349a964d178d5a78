"""Value types that handlers and readers of history see."""

import threading
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from .._errors import InvalidOptionError, LeaseLostError

__all__ = [
    "AppliedTimers",
    "AuditEntry",
    "BackfillInfo",
    "BackfillStatus",
    "InstanceInfo",
    "JobInfo",
    "LeaseInfo",
    "OverlapPolicy",
    "Run",
    "RunResult",
    "RunStatus",
    "TimerInfo",
    "TimerKindInfo",
    "TimerPage",
    "TimerRun",
    "TimerStatus",
    "TimerTrigger",
    "Trigger",
]

Trigger = Literal["schedule", "catch-up", "retry", "takeover", "manual", "backfill"]
"""Why an attempt of a job's slot runs (``Run.trigger``, ``RunResult.trigger``):

- ``"schedule"``: the slot's first attempt, claimed when it came due (within the job's
  ``max_late_ms``).
- ``"catch-up"``: the first attempt of a slot missed while no instance claimed it (on
  start, or after a gap), within the job's ``catch_up_ms``.
- ``"retry"``: a later attempt, after the one before it failed, was cancelled, or was
  given back by a stopping instance.
- ``"takeover"``: a later attempt, after the one before it lost its runner (its lease
  expired; that attempt is recorded as ``"interrupted"``): it may have done part of its
  work.
- ``"manual"``: a run asked for with ``Scheduler.run_now`` or ``Inspector.run_now``
  (a slot id of its own, one attempt).
- ``"backfill"``: the first attempt of a past slot run by a backfill
  (``Inspector.backfill``, ``anarchon backfill``): the slot's own id, as if it had run
  when it fell due.
"""
RunStatus = Literal["ok", "failed", "interrupted", "cancelled", "skipped"]
"""How an attempt ended (``RunResult.status``):

- ``"ok"``: the handler returned (before its lease was lost).
- ``"failed"``: the handler raised (or ran past the job's ``timeout_ms``); ``error``
  says what.
- ``"interrupted"``: its runner vanished: the lease expired with no result (the runner
  died, stalled, or could not reach the server for a whole lease); ``error`` is
  ``"lease expired"``.
- ``"cancelled"``: the handler was cancelled by a stop, or returned after its lease was
  lost; or a newer slot replaced the run (the ``"replace"`` overlap policy; ``error``
  says which slot).
- ``"skipped"``: the slot did not run at all (``attempt`` 0, fence 0); ``error`` says
  why: an older run of the job was not settled (the ``"skip"`` overlap policy), a newer
  slot took its place in the wait (``"buffer_one"``), or the job was paused.
"""
OverlapPolicy = Literal["skip", "wait", "allow", "replace", "buffer_one"]
"""What a slot does while an older run of its job is unsettled (running, waiting for
its retry, or orphaned); a job's ``overlap`` option, where ``False`` and ``True`` are
aliases of ``"skip"`` and ``"allow"``:

- ``"skip"``: the slot does not run; it is recorded once in the history as
  ``"skipped"`` (the default).
- ``"wait"``: the slot runs when the older run ends; at most one slot waits, newer ones
  are skipped.
- ``"allow"``: the slot runs at once, side by side with the older run.
- ``"replace"``: the slot ends the older run and runs at once: the older run is recorded
  ``"cancelled"`` (its lease ends in the store, so its heartbeats, its finish and its
  fence are refused from then on, and its handler is cancelled within a heartbeat,
  wherever it runs).
- ``"buffer_one"``: the newest slot waits for the older run to end and then runs; a slot
  that was waiting is skipped (recorded) when a newer one comes, so after a burst the
  job runs once more, not once per slot.
"""


@dataclass(frozen=True, slots=True)
class Run:
    """One attempt at one slot of a job, as the handler sees it. The scheduler makes it;
    a handler that declares a parameter receives it::

        @scheduler.job("*/5 * * * *")
        async def sync(run: Run) -> None:
            print(run.job, run.slot, run.attempt, run.fence)

    ``lease_lost`` is set when this attempt must stop. Async handlers are cancelled
    instead; a plain function running in a worker thread cannot be, so it should check
    between steps, most simply with ``run.raise_if_lost()``::

        @scheduler.job("0 * * * *")
        def export(run: Run) -> None:
            for batch in batches():
                run.raise_if_lost()
                write(batch, fence=run.fence)

    An attempt whose handler returns after ``lease_lost`` was set is recorded as
    cancelled, not ok (it stopped early), and is retried while attempts are left.

    Attributes:
        job: The job's name.
        slot: The slot's instant: when it was scheduled to fire (an aware UTC datetime,
            to the millisecond); for a manual run, when it was asked for.
        slot_ms: The same instant in Unix epoch milliseconds: the slot's id for a
            scheduled slot.
        attempt: Which attempt at the slot this is, from 1 (at most the job's
            ``max_attempts``).
        trigger: Why this attempt runs: its first one on schedule, a catch-up, a retry,
            a takeover or a manual run (``Trigger``).
        runner: The id of the instance that runs it (``Scheduler.instance_id``).
        fence: A number that grows with every win of the job, across all instances:
            stores that the handler writes to can reject a write that carries a smaller
            fence than one they have already seen (it comes from a stale runner).
        lease_lost: Set when this attempt must stop: it no longer holds its lease (a
            heartbeat was refused, or none got through in time), the scheduler is
            stopping, or the job's ``timeout_ms`` has passed.
        progress: What the slot's last attempt kept with ``save_progress`` (decoded
            JSON), or None: the first attempt, or none was kept.
    """

    job: str
    slot: datetime
    slot_ms: int
    attempt: int
    trigger: Trigger
    runner: str
    fence: int
    lease_lost: threading.Event = field(default_factory=threading.Event, compare=False)
    progress: Any = field(default=None, compare=False)
    _saver: Callable[[Any], Awaitable[None]] | None = field(
        default=None, init=False, compare=False, repr=False
    )

    def keep_progress_with(self, saver: Callable[[Any], Awaitable[None]]) -> None:
        """The scheduler's: where ``save_progress`` keeps its value (a run made by hand
        keeps none).

        Args:
            saver: Keeps a value for the run's slot, fenced by the run's lease.
        """
        object.__setattr__(self, "_saver", saver)

    async def save_progress(self, value: Any) -> None:
        """Keep ``value`` as this slot's progress: the slot's next attempt (a retry, or a
        takeover after this instance died) gets it as ``run.progress``. Fenced: it is
        kept only while this attempt holds its lease, so a stale attempt never
        overwrites a newer one's; once the slot's run settles for good it is gone::

            @scheduler.job("0 2 * * *", max_attempts=5)
            async def export(run: Run) -> None:
                offset = run.progress or 0
                for batch in batches(after=offset):
                    await write(batch, fence=run.fence)
                    offset = batch.end
                    await run.save_progress(offset)

        A plain function (in a worker thread) calls it with
        ``anyio.from_thread.run(run.save_progress, value)``.

        Args:
            value: What JSON holds (dicts, lists, text, numbers, True, False, None), at
                most 64 KiB encoded: where the work is, not the work's data.

        Raises:
            InvalidOptionError: A value JSON cannot hold or too large, or a run that
                keeps no progress (one made by hand, or a claim-only strategy's).
            LeaseLostError: This attempt no longer holds its lease: nothing was kept,
                and the handler should stop (async ones are cancelled anyway).
            ConnectionFailedError: The server did not answer in time: the progress may
                or may not be kept.
        """
        await _save_with(self._saver, value)

    def raise_if_lost(self) -> None:
        """Raise ``LeaseLostError`` if this attempt must stop (``lease_lost`` is set).

        Raises:
            LeaseLostError: The attempt no longer holds its lease, the scheduler is
                stopping, or the job's ``timeout_ms`` has passed. Let it propagate: the
                attempt is recorded as cancelled and, with attempts left, retried.
        """
        if self.lease_lost.is_set():
            raise LeaseLostError(
                f"{self.job} slot {self.slot_ms} attempt {self.attempt} no longer holds its "
                "lease (another attempt may run, or the scheduler is stopping): stop here"
            )


@dataclass(frozen=True, slots=True)
class RunResult:
    """How one attempt at a slot ended, as recorded in the store's history
    (``Scheduler.history``, ``Scheduler.run_now``, ``Inspector.history``).

    Attributes:
        job: The job's name.
        slot: The slot's instant (an aware UTC datetime, to the millisecond); for a
            manual run, when it was asked for.
        slot_ms: The same instant in Unix epoch milliseconds.
        attempt: Which attempt at the slot it was, from 1; 0 for a skipped slot.
        trigger: Why the attempt ran (``Trigger``).
        runner: The id of the instance that ran it; for a skipped slot, the instance
            whose claim skipped it.
        status: How it ended (``RunStatus``).
        started_at: When the attempt started, on the server's clock (an aware UTC
            datetime, to the millisecond); for a skipped slot, when it was skipped.
        finished_at: When its end was recorded, on the server's clock: when the handler
            ended, or, for an ``"interrupted"`` attempt, when a claim found its lease
            expired; for a skipped slot, when it was skipped.
        error: What went wrong, or None (always for ``"ok"``): the exception as Python
            prints its last line (``ValueError: bad row``) for ``"failed"``, ``"lease
            expired"`` for ``"interrupted"``, the reason for ``"skipped"``.
        fence: The attempt's fence (``Run.fence``); 0 for a skipped slot.
    """

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


TimerTrigger = Literal["due", "retry", "takeover"]
"""Why a timer's attempt fires (``TimerRun.trigger``):

- ``"due"``: its first attempt, at its due time.
- ``"retry"``: a later attempt, after the one before it failed; or the same attempt
  again, after a stopping instance gave it back (that is not counted as an attempt).
- ``"takeover"``: a later attempt, after the one before it lost its runner (its lease
  expired).
"""
TimerStatus = Literal["pending", "firing", "retry"]
"""Where a key's timer is (``TimerInfo.status``):

- ``"pending"``: it waits for its due time.
- ``"firing"``: an attempt holds its lease (its handler runs).
- ``"retry"``: a failed attempt's retry waits for its delay.
"""


class _Done:
    """What ``TimerRun.rearm`` returns: an awaitable that is done already (awaiting it
    is optional: the rearm was recorded by the call)."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # pragma: no cover - makes this a generator


async def _save_with(saver: Callable[[Any], Awaitable[None]] | None, value: Any) -> None:
    """``save_progress`` of a ``Run`` or a ``TimerRun``: through the scheduler's saver."""
    if saver is None:
        raise InvalidOptionError(
            "this run keeps no progress: save_progress needs a run the scheduler made, "
            "with the lease strategy"
        )
    await saver(value)


@dataclass(frozen=True, slots=True)
class TimerRun:
    """One attempt at firing one generation of a key's timer, as the handler sees it::

        @scheduler.timer("remind")
        async def remind(fire: TimerRun) -> None:
            await send(fire.key, fire.payload, fence=fire.fence)
            fire.rearm(delay_ms=3_600_000)   # again in an hour (await it or not)

    The scheduler makes it, for the handler of the timer's kind.

    Attributes:
        kind: The timer's kind (the handler's, ``Scheduler.timer``).
        key: The key whose timer fires (``set_timer``'s ``key``).
        payload: What ``set_timer`` was given: bytes as bytes, any other value as
            decoded from its JSON (a tuple comes back as a list, a dict's keys as
            strings); None if none was given.
        due: When this generation was due (an aware UTC datetime, to the millisecond).
        due_ms: The same instant in Unix epoch milliseconds.
        generation: Identifies this set of the key: every set, rearm and recurrence
            makes a higher one.
        attempt: Which attempt at this generation this is, from 1 (at most the kind's
            ``max_attempts``).
        trigger: Why this attempt fires (``TimerTrigger``).
        runner: The id of the instance that fires it (``Scheduler.instance_id``).
        fence: A number that grows with every firing of the kind, across all
            instances, for stores that reject stale writers (as ``Run.fence``).
        lease_lost: Set when this attempt no longer holds its lease or the scheduler is
            stopping (async handlers are cancelled instead), as for a job's ``Run``.
        progress: What this firing's last attempt kept with ``save_progress`` (decoded
            JSON), or None: the first attempt, or none was kept.
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
    progress: Any = field(default=None, compare=False)
    #: The rearm asked for (at most one: the last call wins): (at_ms, delay_ms).
    _rearm: list[tuple[int | None, int | None]] = field(
        default_factory=list, init=False, compare=False, repr=False
    )
    _saver: Callable[[Any], Awaitable[None]] | None = field(
        default=None, init=False, compare=False, repr=False
    )

    def keep_progress_with(self, saver: Callable[[Any], Awaitable[None]]) -> None:
        """The scheduler's: where ``save_progress`` keeps its value (a firing made by
        hand keeps none).

        Args:
            saver: Keeps a value for the firing, fenced by its lease.
        """
        object.__setattr__(self, "_saver", saver)

    async def save_progress(self, value: Any) -> None:
        """Keep ``value`` as this firing's progress: its next attempt (a retry, or a
        takeover after this instance died) gets it as ``fire.progress``. Fenced as a
        job's ``Run.save_progress`` is: kept only while this attempt holds its lease;
        gone once the firing is over (and never seen by another generation of the
        key)::

            @scheduler.timer("onboard", max_attempts=5)
            async def onboard(fire: TimerRun) -> None:
                done = set(fire.progress or [])
                for step in ("account", "mailbox", "welcome"):
                    if step not in done:
                        await run_step(fire.key, step, fence=fire.fence)
                        done.add(step)
                        await fire.save_progress(sorted(done))

        Args:
            value: What JSON holds, at most 64 KiB encoded.

        Raises:
            InvalidOptionError: A value JSON cannot hold or too large, or a firing that
                keeps no progress (one made by hand).
            LeaseLostError: This attempt no longer holds its lease: nothing was kept.
            ConnectionFailedError: The server did not answer in time: the progress may
                or may not be kept.
        """
        await _save_with(self._saver, value)

    def rearm(self, *, at: datetime | None = None, delay_ms: int | None = None) -> Awaitable[None]:
        """Set the key's timer again, with the same payload: written in the same script as
        this firing's finish, when the handler returns. It is dropped if the handler
        raises (a retry may rearm again), and if the key was set again or cancelled while
        this firing ran (the newest set wins). The last call wins.

        Args:
            at: When the next generation is due (an aware datetime). Give it or
                ``delay_ms``, not both.
            delay_ms: How long after this firing ends it is due, in milliseconds on the
                server's clock (0 or more).

        Returns:
            An awaitable that is done already: awaiting it is optional.

        Raises:
            InvalidOptionError: Neither or both of ``at`` and ``delay_ms`` were given,
                ``at`` is not an aware datetime, or ``delay_ms`` is not a whole number,
                0 or more.
        """
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
        """The rearm the handler asked for, or None: ``(at_ms, None)`` for ``at=`` (in
        Unix epoch milliseconds), ``(None, delay_ms)`` for ``delay_ms=``."""
        return self._rearm[-1] if self._rearm else None

    def raise_if_lost(self) -> None:
        """Raise ``LeaseLostError`` if this attempt must stop (``lease_lost`` is set).

        Raises:
            LeaseLostError: The attempt no longer holds its lease, or the scheduler is
                stopping. Let it propagate: the attempt is recorded as cancelled and,
                with attempts left, fired again.
        """
        if self.lease_lost.is_set():
            raise LeaseLostError(
                f"timer {self.kind} {self.key!r} attempt {self.attempt} no longer holds its "
                "lease (another attempt may fire it, or the scheduler is stopping): stop here"
            )


@dataclass(frozen=True, slots=True)
class TimerSetting:
    """One timer for ``set_timers``: a key and when it is due, as ``set_timer`` takes
    them::

        TimerSetting("cart:9", delay_ms=2 * 3_600_000, payload={"cart": 9})

    Nothing is checked until it is set: ``set_timers`` checks every setting before it
    sends any, and raises for the first bad one (naming its key).

    Attributes:
        key: The key whose timer it is: any text of 1 to 1024 characters (a user id, an
            order id).
        at: When it is due (an aware datetime), or None.
        delay_ms: How long after it is set it is due, in milliseconds on the server's
            clock (0 or more), or None. Give ``at`` or ``delay_ms``, not both; with
            neither, a recurring timer is first due at its first fire time.
        cron: A cron expression (5 fields, or 6 with seconds first) that makes the timer
            recur: after each firing, it is due again at the expression's next fire
            time. None: it does not recur (unless ``every_ms`` is given).
        every_ms: An interval in milliseconds that makes the timer recur (more than 0):
            after each firing, it is due again a whole number of intervals after its
            last due time, the first such time after now (a timer that fired late does
            not fire once per interval it missed). Give ``cron`` or ``every_ms``, not
            both.
        timezone: The IANA time zone ``cron`` is read in (default ``"UTC"``; only with
            ``cron``).
        payload: What the handler gets back as ``TimerRun.payload``: bytes, or a
            JSON-able value (None: none). Its stored form is at most the scheduler's
            ``max_timer_payload_bytes`` (``Timers``' ``max_payload_bytes``).
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
    """A key's timer as the store holds it (``Scheduler.get_timer``, ``Timers.get``).

    Attributes:
        kind: The timer's kind.
        key: Its key.
        generation: Its newest generation (every set, rearm and recurrence makes a
            higher one).
        due: When the newest generation is due (an aware UTC datetime); None once it
            was cancelled while a firing of an older one is still in flight.
        due_ms: The same instant in Unix epoch milliseconds, or None.
        payload: Its payload, decoded as the handler gets it.
        status: Where it is: pending, firing or waiting for a retry (``TimerStatus``).
        attempt: The attempt in flight or waiting for its retry (0 while pending).
        recurs: How it recurs: ``"every_ms=..."``, ``"cron='...' timezone='...'"``, or
            None (it does not).
    """

    kind: str
    key: str
    generation: int
    due: datetime | None
    due_ms: int | None
    payload: Any
    status: TimerStatus
    attempt: int
    recurs: str | None


@dataclass(frozen=True, slots=True)
class TimerPage:
    """A page of a kind's timers (``Inspector.timer_page``), in no particular order.

    Attributes:
        timers: The timers of this page.
        cursor: Where the next page starts (pass it back as ``cursor=``), or None: this
            was the last page.
    """

    timers: tuple[TimerInfo, ...]
    cursor: str | None


@dataclass(frozen=True, slots=True)
class AppliedTimers:
    """What ``Timers.apply`` changed to make a kind's recurring timers the given set.

    Attributes:
        created: The keys that had no timer, set now.
        changed: The keys whose recurrence or payload differed (or that had a one-shot
            timer), set again: a new generation.
        removed: The keys of recurring timers not in the set, cancelled (with
            ``remove_others``).
        unchanged: How many were as given already (nothing was written for them).
    """

    created: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]
    unchanged: int


BackfillStatus = Literal["running", "done", "cancelled", "stopped"]
"""Where a backfill is (``BackfillInfo.status``):

- ``"running"``: an instance that runs the job drives it, or will.
- ``"done"``: every slot of its range was decided.
- ``"cancelled"``: an operator cancelled it; ``BackfillInfo.reason`` says who and why.
- ``"stopped"``: anarchon ended it; ``BackfillInfo.reason`` says why (its range held more
  than 10,000 slots, or the job's ``max_runs`` was reached).
"""


@dataclass(frozen=True, slots=True)
class BackfillInfo:
    """A backfill of a job: the slots of its schedule in ``[start, end)``, run once across
    the fleet, oldest first (``Inspector.backfill``, ``anarchon backfill``).

    Attributes:
        job: The job's name.
        start: The range's first instant (included; an aware UTC datetime).
        end: The range's end (excluded).
        status: ``"running"`` (an instance that runs the job drives it, or will),
            ``"done"`` (every slot of the range was decided), ``"cancelled"`` (an
            operator cancelled it: ``cancelled_by``), or ``"stopped"`` (anarchon ended it:
            ``reason`` says why).
        slots: How many slots the range holds, or None while no one has counted them (a
            schedule the store cannot reckon is counted by the instance that drives it).
        next: The range's slots from this instant on are still to be decided.
        ran_ok: The slots it ran whose run ended ok.
        ran_failed: The slots it ran whose run finally failed, was interrupted or cancelled.
        settled_before: The slots it found settled already (run or skipped before): not
            run again.
        skipped: The slots it recorded skipped (the job's ``exclude=``, a pause, its
            ``max_runs`` or its overlap rule).
        by: Who asked for it (``user@host``, or what the caller passed).
        note: Why, or None.
        started_at: When it was asked for (the server's clock).
        ended_at: When it ended, or None while it runs.
        driver: The instance that drives it (while its turn lasts), or None.
        reason: Why anarchon stopped it, or who cancelled it and why, or None.
    """

    job: str
    start: datetime
    end: datetime
    status: BackfillStatus
    slots: int | None
    next: datetime
    ran_ok: int
    ran_failed: int
    settled_before: int
    skipped: int
    by: str
    note: str | None
    started_at: datetime
    ended_at: datetime | None
    driver: str | None
    reason: str | None

    @property
    def decided(self) -> int:
        """The slots decided so far: run, found settled, or skipped."""
        return self.ran_ok + self.ran_failed + self.settled_before + self.skipped


@dataclass(frozen=True, slots=True)
class JobInfo:
    """A job as the registry in the store shows it (``Inspector.jobs``): as the fleet's
    instances that run it registered it.

    Attributes:
        name: The job's name.
        schedule: Its schedule as text (its ``repr``): ``CronSchedule('0 3 * * *',
            'UTC')``, ``IntervalSchedule(every_ms=5000)``, or a custom schedule's.
        cron: The cron expression, or None (an interval or a custom schedule).
        every_ms: The interval in milliseconds, or None (a cron or a custom schedule).
        timezone: The IANA time zone of its cron schedule (``"UTC"`` otherwise).
        strategy: The strategy its instances use: ``"lease"``, ``"stream-id"``,
            ``"idmp"`` or ``"script"``.
        next_fire: Its next slot after now (an aware UTC datetime); None if it never
            fires again (or is finished) or cannot be reckoned here (a custom schedule
            reports the next slot its instances last saw).
        paused: Whether it is paused (``Scheduler.pause``; lease strategy only).
        paused_by: Who paused it and when, as the pausing process wrote it, or None.
        last: Its newest recorded attempt (or skipped slot), or None.
        first_seen: When it first appeared in the store (catch-up never reaches back
            before it), or None if the store does not say.
        fleet_running: Its runs holding a permit of its ``max_concurrent_fleet`` now
            (its limit is ``options["max_concurrent_fleet"]``), or None without one.
        options: The rest of its definition, by option name (``overlap``,
            ``max_attempts``, ``catch_up_ms``, ``timeout_ms``, ...; ``start_at`` and
            ``end_at`` in epoch ms).
        runs: Its runs that ended ok or finally failed, as the store counts them (what
            ``max_runs`` bounds; lease strategy only), or None.
        finished: Why it claims nothing more, or None: its ``end_at`` passed (and its
            last slot with it), or its runs reached its ``max_runs``.
        last_success: When its last run that ended ok ended (the server's clock), or
            None (none yet, or not the lease strategy).
        backfill: Its backfill in progress, or the last one (kept a week after it
            ended), or None.
        definitions: The fingerprints of its definitions that live instances registered,
            the one in force first (the newest). More than one: the instances disagree
            (a deploy in progress), and those of the others claim no new slot of it.
    """

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
    fleet_running: int | None = None
    runs: int | None = None
    finished: str | None = None
    last_success: datetime | None = None
    backfill: BackfillInfo | None = None
    definitions: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """What an operator (or anarchon itself) did to a job, who and why, as the audit log
    in the store keeps it (``Inspector.audit``, ``anarchon audit``).

    Attributes:
        at: When, on the server's clock (an aware UTC datetime).
        action: ``"pause"``, ``"resume"``, ``"run-now"``, ``"forget"``, ``"backfill"`` or
            ``"cancel-backfill"``.
        job: The job's name.
        by: Who: ``user@host`` of the process that did it, or what its caller passed.
        note: Why, as the caller said it, or None.
    """

    at: datetime
    action: str
    job: str
    by: str
    note: str | None = None


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """A run in progress as the store holds it (``Inspector.leases``).

    Attributes:
        job: The job's name.
        slot: The slot's instant (an aware UTC datetime).
        slot_ms: The same instant in Unix epoch milliseconds.
        slot_id: The slot's id in the store: ``slot_ms`` as text, or a manual run's own
            id (``m<ms>-<random>``).
        status: ``"running"``: ``runner`` holds its lease, for ``left_ms`` more;
            ``"retry"``: it waits for its next attempt, which may start in ``left_ms``.
        attempt: The attempt running, or the last one that ended (waiting for its
            retry).
        runner: The id of the instance that holds (or last held) the lease.
        fence: The attempt's fence (``Run.fence``).
        trigger: Why the attempt runs (``Trigger``).
        left_ms: Milliseconds until the lease expires (running) or the retry may start
            (retry), by the server's clock; 0 once past.
    """

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
    """An instance alive in the fleet, as it registered itself (``Inspector.instances``).

    Attributes:
        id: Its id (``Scheduler.instance_id``).
        host: The name of the machine it runs on.
        pid: Its process id there.
        version: The anarchon version it runs.
        started: When it started (an aware UTC datetime).
        strategy: The strategy of its backend (``"lease"``, ``"stream-id"``, ``"idmp"``
            or ``"script"``).
        jobs: The names of the jobs it runs (a registration longer than the read allows
            holds the first of them).
        timer_kinds: The kinds of timer it fires.
        running: How many handlers it was running when it last renewed its registration.
        expires_in_ms: How long its registration lasts unless it renews it, in
            milliseconds (it renews it every 10 s while it runs; one that died expires
            within 30 s).
        max_concurrent: Its bound on handlers at once (``Scheduler(max_concurrent=)``);
            None: no bound (or an instance of a version that did not register it).
    """

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
    max_concurrent: int | None = None


@dataclass(frozen=True, slots=True)
class TimerKindInfo:
    """A kind of timer the fleet fires (``Inspector.timers``): how many keys have a
    timer pending, and the first to fall due.

    Attributes:
        kind: The kind's name.
        buckets: The number of hash tags it is spread over (``Scheduler.timer``'s
            ``buckets``).
        pending: How many keys have a timer of this kind (pending, firing or waiting for
            a retry).
        next_due: When the first of them falls due (an aware UTC datetime), or None if
            there is none.
        next_key: The key of that timer, or None.
        max_concurrent_fleet: Its limit on firings at once in the fleet, or None.
        fleet_running: Its firings holding a permit of that limit now, or None.
        rate_limit: Its rate limit, ``(count, period_ms)``, or None.
        rate_started: Its firings started within the last ``period_ms``, or None.
        max_concurrent_per_group: Its limit on one key group's firings at once, or
            None.
        groups_waiting: Its key groups with due timers waiting for a permit of their
            group, or None.
    """

    kind: str
    buckets: int
    pending: int
    next_due: datetime | None
    next_key: str | None
    max_concurrent_fleet: int | None = None
    fleet_running: int | None = None
    rate_limit: tuple[int, int] | None = None
    rate_started: int | None = None
    max_concurrent_per_group: int | None = None
    groups_waiting: int | None = None
