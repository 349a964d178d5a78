"""What a scheduler decides and sees, as typed events: an async iterator for programs
(``Scheduler.events()``) and hooks for the common case (``Scheduler.on_event``).

Events cost nothing while nobody listens: the engine asks ``EventHub.on`` before it
makes one. A listener never slows the engine: each stream has a bounded buffer, and a
consumer that falls behind loses the oldest events (counted in ``EventStream.dropped``).
"""

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Literal

import anyio

from .._errors import InvalidOptionError
from .._model.clock import wall_ms
from .._model.values import Run, TimerRun
from .._store.contract import Outcome

__all__ = [
    "ClaimAnswered",
    "Event",
    "EventHub",
    "EventStream",
    "LeaseLost",
    "RunFinished",
    "RunRetried",
    "RunStarted",
    "ServerBack",
    "ServerUnreachable",
    "SlotSkipped",
    "DefinitionOutdated",
    "JobPaused",
    "TimerCancelled",
    "TimerFired",
    "TimerSet",
]

log = logging.getLogger("anarchon")

#: How long a consumer that waited lets events gather before it takes them (seconds).
GATHER_SEC = 0.05

#: How a claim of a slot was answered: this instance runs it ("won"), another runs it
#: ("running": this one backs it up), an older run of the job is not settled
#: ("overlap"), it is settled already ("done"), or the server refused the claim
#: ("refused").
ClaimAnswer = Literal["won", "running", "overlap", "done", "refused"]
#: Why a scheduled slot did not run: an older run was not settled and the job does not
#: allow overlap ("overlap"), it was found too late ("late"), or the job is paused.
SkipReason = Literal["overlap", "late", "paused", "excluded"]


#: The last millisecond an event was stamped with: (epoch ms, that instant as a datetime).
_stamp = (0, datetime.fromtimestamp(0, UTC))


def instant(epoch_ms: float) -> datetime:
    """The instant ``epoch_ms``, in UTC, truncated to the millisecond: the events of one
    millisecond (a burst of a thousand claims' answers) share one datetime, made once."""
    global _stamp
    stamp = _stamp  # read once: schedulers on loops in several threads share it
    ms = int(epoch_ms)
    if ms != stamp[0]:
        stamp = _stamp = (ms, datetime.fromtimestamp(ms / 1000, UTC))
    return stamp[1]


def _now() -> datetime:
    """Now, in UTC, truncated to the millisecond (an event's default ``at``)."""
    return instant(wall_ms())


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Something a scheduler decided or saw; the base class of every event (each
    subclass below adds its own fields). Events are made by the scheduler, and told
    through ``Scheduler.events()`` and ``Scheduler.on_event``.

    Attributes:
        instance: The id of the instance that decided or saw it
            (``Scheduler.instance_id``).
        at: When, by that instance's clock (an aware UTC datetime, truncated to the
            millisecond); by default, when the event was made.
    """

    instance: str
    at: datetime = field(default_factory=_now)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimAnswered(Event):
    """The store answered this instance's claim of a job's slot.

    Attributes:
        job: The job's name.
        slot_ms: The slot's instant in Unix epoch milliseconds.
        answer: ``"won"``: this instance runs it; ``"running"``: another instance
            runs it (this one backs it up); ``"overlap"``: an older run of the job is
            not settled (the job's ``overlap`` policy decides); ``"done"``: it is
            settled already (run, skipped or forgotten); ``"refused"``: the server
            refused the claim (an error reply).
    """

    job: str
    slot_ms: int
    answer: ClaimAnswer


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStarted(Event):
    """An attempt's handler started here.

    Attributes:
        run: The ``Run`` the handler gets.
        late_ms: Milliseconds from the slot's instant (the request, for a manual run) to
            the start, by this instance's clock, a retry's delays included.
    """

    run: Run
    late_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFinished(Event):
    """An attempt's handler ended here and its result is recorded.

    Attributes:
        run: The ``Run`` the handler got.
        outcome: ``"ok"``: the handler returned; ``"failed"``: it raised (or ran past
            the job's ``timeout_ms``); ``"cancelled"``: it was cancelled (a stop, a lost
            lease) or returned after its lease was lost.
        duration_ms: How long the handler ran, in milliseconds.
        error: What went wrong, as the history records it (``RunResult.error``): for a
            failure, the exception as Python prints its last line
            (``ValueError: bad row``); None when the handler returned.
        retried: Whether another attempt of the slot follows (a failure or a
            cancellation with attempts left).
    """

    run: Run
    outcome: Outcome
    duration_ms: float
    error: str | None
    retried: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRetried(Event):
    """A slot's attempt ended without success, and the next one is due (on whichever
    instance claims it).

    Attributes:
        job: The job's name.
        slot_ms: The slot's instant in Unix epoch milliseconds.
        attempt: The attempt that ended (the next one is ``attempt + 1``).
        in_ms: Milliseconds until the next attempt is due: the retry delay, doubled for
            each attempt after the first.
    """

    job: str
    slot_ms: int
    attempt: int
    in_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseLost(Event):
    """An attempt (or a timer's firing) this instance won lost its lease: its handler
    was cancelled or told (or, if the lease ran out before it began, not called), and
    a backup may run the slot.

    Attributes:
        job: The job's name; for a timer's firing, the timer's kind.
        slot_ms: The slot's instant in Unix epoch milliseconds; for a timer's firing,
            its due time.
        attempt: The attempt that lost its lease.
        reason: Why, in words (a heartbeat refused, none got through in time, ...).
        timer_key: The timer's key for a timer's firing; None for a job's attempt.
    """

    job: str
    slot_ms: int
    attempt: int
    reason: str
    timer_key: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotSkipped(Event):
    """A scheduled slot does not run.

    Attributes:
        job: The job's name.
        slot_ms: The slot's instant in Unix epoch milliseconds.
        reason: ``"overlap"``: an older run of the job was not settled and the job does
            not allow overlap; ``"late"``: it was found too late (past ``max_late_ms``,
            outside any catch-up); ``"paused"``: the job is paused; ``"excluded"``:
            the job's ``exclude=`` leaves it out.
    """

    job: str
    slot_ms: int
    reason: SkipReason


@dataclass(frozen=True, slots=True, kw_only=True)
class JobPaused(Event):
    """A job was paused by anarchon itself: its ``pause_after_failures`` slots in a row
    finally failed. Told once, by the instance whose finish paused it.

    Attributes:
        job: The job's name.
        reason: Why, in words.
    """

    job: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DefinitionOutdated(Event):
    """The live instances disagree on a job's definition, and this instance's is not the
    one in force (the newest: a deploy in progress): it claims no new slot of the job
    (its runs under way go on) until its definition is in force again. Told once per
    change, by each instance it concerns.

    Attributes:
        job: The job's name.
        own: The fingerprint of this instance's definition.
        in_force: The fingerprint of the definition in force ("" when a claim found
            another in force before this instance's registration said which).
    """

    job: str
    own: str
    in_force: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerSet(Event):
    """A key's timer was set through this scheduler.

    Attributes:
        kind: The timer's kind.
        key: Its key.
        generation: The generation the set made.
        due_ms: When it is due, in Unix epoch milliseconds on the server's clock.
        replaced: Whether the key had a timer (pending, waiting for its retry, or the
            next one of a firing), which this one replaced.
    """

    kind: str
    key: str
    generation: int
    due_ms: int
    replaced: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerCancelled(Event):
    """A key's timer was cancelled through this scheduler.

    Attributes:
        kind: The timer's kind.
        key: Its key.
        found: Whether the key had a timer to cancel.
    """

    kind: str
    key: str
    found: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerFired(Event):
    """A firing of a key's timer ended here and is recorded.

    Attributes:
        run: The ``TimerRun`` the handler got.
        outcome: ``"ok"``: the handler returned; ``"failed"``: it raised;
            ``"cancelled"``: it was cancelled (a stop, a lost lease) or returned after
            its lease was lost.
        duration_ms: How long the handler ran, in milliseconds.
        retried: Whether it is due again for another attempt.
    """

    run: TimerRun
    outcome: Outcome
    duration_ms: float
    retried: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerUnreachable(Event):
    """The server stopped answering; told once per outage (``ServerBack`` ends it).

    Attributes:
        what: The round trip that failed first, in words (``"heartbeat"``,
            ``"claiming 3 slot(s)"``, ...).
        error: What the failure said.
    """

    what: str
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerBack(Event):
    """The server answers again, after an outage told by ``ServerUnreachable``.

    Attributes:
        down_sec: How long it did not answer, in seconds (from the first failed round
            trip to the first answer).
    """

    down_sec: float


# The engine makes the events of every run (a claim's answer, a start, an end) through
# the three functions below. A frozen dataclass's constructor sets each field through
# ``object.__setattr__`` and takes keywords: more than half of what watching a run
# costs. These set the slots through their descriptors, positionally, and make exactly
# what the constructor makes (tests/test_events.py checks it).
_new = object.__new__


def _setters(cls: type[Event]) -> tuple[Callable[[Event, Any], None], ...]:
    """The slots' setters of ``cls``, in the order of its fields."""
    return tuple(getattr(cls, item.name).__set__ for item in fields(cls))


_claim_setters = _setters(ClaimAnswered)
_started_setters = _setters(RunStarted)
_finished_setters = _setters(RunFinished)


def claim_answered(
    instance: str, at: datetime, job: str, slot_ms: int, answer: ClaimAnswer
) -> ClaimAnswered:
    """``ClaimAnswered(instance=..., at=..., job=..., slot_ms=..., answer=...)``."""
    set_instance, set_at, set_job, set_slot_ms, set_answer = _claim_setters
    event = _new(ClaimAnswered)
    set_instance(event, instance)
    set_at(event, at)
    set_job(event, job)
    set_slot_ms(event, slot_ms)
    set_answer(event, answer)
    return event


def run_started(instance: str, at: datetime, run: Run, late_ms: float) -> RunStarted:
    """``RunStarted(instance=..., at=..., run=..., late_ms=...)``."""
    set_instance, set_at, set_run, set_late_ms = _started_setters
    event = _new(RunStarted)
    set_instance(event, instance)
    set_at(event, at)
    set_run(event, run)
    set_late_ms(event, late_ms)
    return event


def run_finished(
    instance: str,
    at: datetime,
    run: Run,
    outcome: Outcome,
    duration_ms: float,
    error: str | None,
    retried: bool,
) -> RunFinished:
    """``RunFinished(instance=..., at=..., run=..., outcome=..., duration_ms=...,
    error=..., retried=...)``."""
    set_instance, set_at, set_run, set_outcome, set_duration_ms, set_error, set_retried = (
        _finished_setters
    )
    event = _new(RunFinished)
    set_instance(event, instance)
    set_at(event, at)
    set_run(event, run)
    set_outcome(event, outcome)
    set_duration_ms(event, duration_ms)
    set_error(event, error)
    set_retried(event, retried)
    return event


class EventStream:
    """Events as they happen, from when the stream was opened until the scheduler stops
    (then the iteration ends) or the stream is closed::

        async with scheduler.events() as events:
            async for event in events:
                if isinstance(event, anarchon.RunFinished) and event.outcome == "failed":
                    alert(event.run.job, event.error)

    It holds up to ``buffer`` events a consumer has not taken yet; when full, the oldest
    is dropped to make room (``dropped`` counts them), so a slow consumer never slows
    the scheduler. ``Scheduler.events()`` makes it.

    Attributes:
        dropped: How many events were dropped because the buffer was full.
    """

    def __init__(self, hub: "EventHub", buffer: int) -> None:
        self._hub = hub
        self._queue: deque[Event] = deque(maxlen=buffer)
        #: Events dropped because the buffer was full.
        self.dropped = 0
        self._ended = False
        self._ready: anyio.Event | None = None

    def _end(self) -> None:
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        if self._ready is not None:
            self._ready.set()
            self._ready = None

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> Event:
        while not self._queue:
            if self._ended:
                raise StopAsyncIteration
            if self._ready is None:  # one event for every consumer waiting
                self._ready = anyio.Event()
            await self._ready.wait()
            # Woken by the first event of a burst: let the rest of it gather, so that a
            # consumer wakes once per burst rather than once per event.
            await anyio.sleep(GATHER_SEC)
        return self._queue.popleft()

    def close(self) -> None:
        """Stop receiving events (the ones buffered can still be taken)."""
        self._hub.streams.discard(self)
        self._end()

    async def __aenter__(self) -> "EventStream":
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class EventHub:
    """Where a scheduler's events go: its open streams and its hooks."""

    def __init__(self) -> None:
        self.streams: set[EventStream] = set()
        self.hooks: list[Callable[[Event], object]] = []
        #: Hooks that raised, logged once each.
        self._failed_hooks: set[int] = set()
        self._closed = False

    @property
    def on(self) -> bool:
        """Whether anyone listens (an event is made only then)."""
        return bool(self.streams or self.hooks)

    def open(self, buffer: int) -> EventStream:
        """A stream of the events from now on, keeping up to ``buffer`` unread."""
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise InvalidOptionError(f"buffer must be a whole number, 1 or more, got {buffer!r}")
        stream = EventStream(self, buffer)
        if self._closed:
            stream._end()
        else:
            self.streams.add(stream)
        return stream

    def add_hook(self, hook: Callable[[Event], object]) -> None:
        if not callable(hook):
            raise InvalidOptionError(f"on_event needs a function, got {hook!r}")
        self.hooks.append(hook)

    def emit(self, event: Event) -> None:
        for hook in self.hooks:
            try:
                hook(event)
            except Exception:
                if id(hook) not in self._failed_hooks:
                    self._failed_hooks.add(id(hook))
                    log.exception(
                        "an on_event hook (%r) raised; it keeps being called, and this is "
                        "logged once",
                        hook,
                    )
        for stream in self.streams:  # (inlined: this runs for every event)
            queue = stream._queue
            if len(queue) == queue.maxlen:
                stream.dropped += 1
            queue.append(event)
            if stream._ready is not None:
                stream._wake()

    def close(self) -> None:
        """The scheduler stopped: every stream ends once its buffer is taken."""
        self._closed = True
        for stream in list(self.streams):
            stream._end()
        self.streams.clear()
