"""A job: its name, schedule, handler and options, validated at definition time."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import anyio.to_thread

from .._errors import InvalidJobError, InvalidOptionError, InvalidScheduleError
from .exclusions import Exclusion
from .schedule import CombinedSchedule, CronSchedule, IntervalSchedule, Schedule, SlotClock
from .text import visible
from .values import OverlapPolicy, Run

__all__ = [
    "Handler",
    "Job",
    "ScheduleSpec",
    "check_duration_ms",
    "exception_types",
    "invoke_handler",
    "is_async_callable",
    "make_schedule",
    "overlap_policy",
    "takes_run_argument",
    "validate_job_name",
]

#: An async function or a plain function, taking a ``Run`` or nothing.
Handler = Callable[[Run], Awaitable[Any]] | Callable[[], Awaitable[Any]] | Callable[..., Any]

# Names go into key names: braces would break the cluster hash tag, whitespace or control
# characters make keys unreadable in tools, and a ':' would let a name reach into the
# prefix: 'billing:' with 'eu:x' would name the keys of 'billing:eu:' with 'x' (a prefix
# ends with ':', so with no ':' in names a key's prefix is all up to its last one).
_JOB_NAME = re.compile(r"[^\s{}:\x00-\x1f\x7f-\x9f]{1,200}")
#: Characters that are not seen, or that change how what follows is shown (zero-width,
#: bidi controls): two names differing only by them would look the same.
_HIDDEN = re.compile("[\u00ad\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u206f\ufeff]")


def validate_job_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidJobError(f"a job needs a non-empty name, got {name!r}")
    if ":" in name and _JOB_NAME.fullmatch(name.replace(":", ".")):
        raise InvalidJobError(
            f"job name {name!r} cannot hold ':': prefixes end with ':', and a name with one "
            "would share keys with another prefix's job (prefix 'billing:' with 'eu:x' is "
            "prefix 'billing:eu:' with 'x'); use '.' or '-' instead, or move the part before "
            "the ':' into the prefix"
        )
    if name in (".", ".."):
        raise InvalidJobError(
            f"job name {name!r} is a path step: a browser reads it so in the dashboard's "
            "links, however it is escaped; use another name"
        )
    if _HIDDEN.search(name):
        raise InvalidJobError(
            f"job name {visible(name)!r} holds a character that is not seen, or that "
            "changes how the name is shown (zero-width, bidi): two names would look the "
            "same; use visible characters"
        )
    if not _JOB_NAME.fullmatch(name):
        raise InvalidJobError(
            f"job name {name!r} cannot be used in a key: use up to 200 characters without "
            "spaces, control characters or braces ('{' and '}' would break the cluster hash tag)"
        )
    return name


#: The longest duration an option takes: 100 years. Durations are added to the server's
#: clock in milliseconds in the scripts, whose numbers are exact below 2^53; a duration
#: beyond this is a mistake (a unit mixed up), and one beyond what the server holds would
#: store a lease that never ends or make every claim of the job fail.
MAX_DURATION_MS = 100 * 365 * 24 * 3600 * 1000


def check_duration_ms(
    option: str, value: object, *, allow_zero: bool = False, most: int = MAX_DURATION_MS
) -> int:
    """Durations are whole milliseconds, at most ``most``; zero only where it means 'off'."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidOptionError(f"{option} must be a whole number of milliseconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = "0 or more" if allow_zero else "more than 0"
        raise InvalidOptionError(f"{option} must be {bound} milliseconds, got {value}")
    if value > most:
        raise InvalidOptionError(
            f"{option} must be at most {most:,} milliseconds ({most / 86_400_000:,.0f} days), "
            f"got {value:,}: is it in milliseconds?"
        )
    return value


def check_count(option: str, value: object, *, most: int) -> int:
    """A count (attempts, history entries): a whole number from 1 to ``most``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise InvalidOptionError(
            f"{option} must be a whole number from 1 to {most:,}, got {value!r}"
        )
    return value


def overlap_policy(value: object) -> OverlapPolicy:
    """``overlap=`` as given: a policy name, or True/False (aliases of allow/skip)."""
    if value is None or value is False:
        return "skip"
    if value is True:
        return "allow"
    if value in ("skip", "wait", "allow", "replace", "buffer_one"):
        return value
    raise InvalidOptionError(
        "overlap must be 'skip' (the default), 'wait', 'allow', 'replace' or 'buffer_one' "
        f"(or False/True for skip/allow), got {value!r}"
    )


#: What a job's ``schedule`` may be: a cron string, a ``Schedule``, or a list of them.
ScheduleSpec = str | Schedule | list[str | Schedule] | tuple[str | Schedule, ...]


def make_schedule(schedule: ScheduleSpec | None, every_ms: int | None, timezone: str) -> Schedule:
    if isinstance(schedule, list | tuple):
        if every_ms is not None:
            raise InvalidScheduleError("give either schedules or every_ms, not both")
        if not schedule:
            raise InvalidScheduleError(
                "a job's list of schedules is empty; give at least one cron string or schedule"
            )
        parts = [make_schedule(part, None, timezone) for part in schedule]
        return parts[0] if len(parts) == 1 else CombinedSchedule(*parts)
    if schedule is not None and every_ms is not None:
        raise InvalidScheduleError("give either a cron schedule or every_ms, not both")
    if every_ms is not None:
        if timezone != "UTC":
            raise InvalidScheduleError(
                "every_ms intervals are aligned to the Unix epoch and ignore time zones; "
                "drop timezone= or use a cron schedule"
            )
        return IntervalSchedule(every_ms)
    if schedule is None:
        raise InvalidScheduleError(
            "a job needs a schedule: a cron string such as '*/5 * * * *', every_ms=..., or an "
            "object with next_after(datetime)"
        )
    if isinstance(schedule, str):
        return CronSchedule(schedule, timezone)
    if isinstance(schedule, Schedule):
        return schedule
    raise InvalidScheduleError(
        f"cannot use {schedule!r} as a schedule: pass a cron string, every_ms=..., or an "
        "object with next_after(datetime)"
    )


def takes_run_argument(handler: Callable[..., Any], job: str) -> bool:
    """Whether ``handler`` is called with the ``Run`` (it has a positional parameter)
    or with nothing; a signature that can take neither is refused here, since every
    run would fail. A callable whose signature cannot be read is given the ``Run``."""
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):
        return True
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p.name for p in positional if p.default is p.empty][1:] + [
        p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty
    ]
    if required:
        name = getattr(handler, "__qualname__", None) or repr(handler)
        missing = f"parameter{'s' if len(required) > 1 else ''} {', '.join(map(repr, required))}"
        raise InvalidJobError(
            f"job {job!r}: its handler {name}{signature} cannot be called with a Run or "
            f"with nothing ({missing} would get no value): "
            "write def handler() or def handler(run: Run), sync or async, and give any "
            "other parameters defaults"
        )
    return bool(positional) or any(p.kind is p.VAR_POSITIONAL for p in params)


def exception_types(option: str, value: object) -> tuple[type[BaseException], ...] | None:
    """``retry_on=``: an exception class, or a tuple or list of them (None: every one)."""
    if value is None:
        return None
    given: tuple[object, ...] = tuple(value) if isinstance(value, tuple | list) else (value,)
    types = tuple(t for t in given if isinstance(t, type) and issubclass(t, Exception))
    if not types or len(types) != len(given):
        raise InvalidOptionError(
            f"{option} must be an exception class or a tuple of them (such as "
            f"(ConnectionError, TimeoutError)), got {value!r}"
        )
    return types


def is_async_callable(handler: Callable[..., Any]) -> bool:
    target = handler
    while isinstance(target, functools.partial):
        target = target.func
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004 - async callable objects
    )


@dataclass(frozen=True, slots=True)
class Job:
    name: str
    handler: Callable[..., Any]
    schedule: Schedule
    clock: SlotClock
    overlap_policy: OverlapPolicy
    max_attempts: int
    catch_up_ms: int
    jitter_ms: int
    max_late_ms: int
    takes_run: bool
    is_async: bool
    #: How long an attempt may run (None: as long as it likes).
    timeout_ms: int | None = None
    #: The delay before the second attempt (doubling for each later one); None: the
    #: scheduler's.
    retry_delay_ms: int | None = None
    #: The exceptions that are retried (None: every exception).
    retry_on: tuple[type[BaseException], ...] | None = None
    #: The most of its runs that go on at once on one instance (None: the instance's
    #: bound alone).
    max_concurrent: int | None = None
    #: The most of its runs that go on at once in the whole fleet, each holding a permit
    #: in the store while its lease lives (None: no limit).
    max_concurrent_fleet: int | None = None
    #: The slots of its schedule that do not run (recorded skipped, with the reason).
    exclude: Exclusion | None = None
    #: Its first slot is at or after this instant, its last before ``end_at`` (None:
    #: no bound); the schedule (a ``BoundedSchedule`` then) holds them too.
    start_at: datetime | None = None
    end_at: datetime | None = None
    #: The runs that may end (ok or finally failed) in the fleet, counted in the store;
    #: then the job is finished (None: no bound).
    max_runs: int | None = None
    #: Paused (in the store, by the finish that saw it) once this many of its slots in
    #: a row finally failed (None: never).
    pause_after_failures: int | None = None

    def excluded(self, slot_ms: int) -> str | None:
        """Why its scheduled slot at ``slot_ms`` does not run, or None."""
        return None if self.exclude is None else self.exclude.reason(slot_ms)

    def retries(self, failure: BaseException | None) -> bool:
        """Whether a failure with this exception may be retried (``retry_on``)."""
        return self.retry_on is None or isinstance(failure, self.retry_on)

    @property
    def overlap(self) -> bool:
        """Whether runs of the job may run side by side (``overlap="allow"``)."""
        return self.overlap_policy == "allow"

    @property
    def late_window_ms(self) -> int:
        """How old a slot may be when this instance first claims it."""
        return self.max_late_ms + self.jitter_ms

    def keep_ms(self, lease_ms: int) -> int:
        """How long the store keeps a slot's state after its instant and after it
        settles: twice the longest a late or catch-up claim could come after the slot
        (so instance clocks offset by up to that much still find it), plus a lease (a
        backup asks again at most a lease after its last answer), plus a minute."""
        return 2 * max(self.late_window_ms, self.catch_up_ms) + lease_ms + 60_000

    def start_limit_ms(self, lease_ms: int) -> int:
        """How old (by this instance's clock) a slot may be when a claim that waited
        behind an older run still starts it: well inside ``keep_ms``, so that the store
        still remembers the slot if another instance ran it meanwhile, whatever the
        clock offsets (up to the lateness window)."""
        return max(self.late_window_ms, self.catch_up_ms) + lease_ms + 30_000

    async def invoke(self, run: Run) -> None:
        await invoke_handler(self.handler, self.takes_run, self.is_async, run)


async def invoke_handler(
    handler: Callable[..., Any], takes_run: bool, is_async: bool, run: object
) -> None:
    """Call a job's or a timer's handler with its run (or with nothing): an async one in
    the scheduler's event loop, a plain function in a worker thread."""
    args = (run,) if takes_run else ()
    if is_async:
        await handler(*args)
    else:
        result = await anyio.to_thread.run_sync(functools.partial(handler, *args))
        if inspect.isawaitable(result):
            await result
