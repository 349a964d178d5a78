"""Schedules: when a job's slots fall due.

A slot is identified by its instant as Unix epoch milliseconds (UTC), so every
instance derives the same slot ids from the same schedule.
"""

from __future__ import annotations

import calendar
import heapq
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Literal, Protocol, runtime_checkable
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from .._errors import InvalidScheduleError

__all__ = [
    "BoundedSchedule",
    "CalendarInterval",
    "CombinedSchedule",
    "CronSchedule",
    "IntervalSchedule",
    "Schedule",
    "SlotClock",
    "clock_change",
    "count_slots",
    "fire_times",
    "load_timezone",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@runtime_checkable
class Schedule(Protocol):
    """Anything that says when a job fires next: a job's ``schedule`` may be any object
    with this method (``CronSchedule`` and ``IntervalSchedule`` are two). Every instance
    must derive the same fire times from it.
    """

    def next_after(self, moment: datetime, /) -> datetime | None:
        """The first fire time strictly after ``moment``.

        Args:
            moment: An aware datetime in UTC.

        Returns:
            An aware datetime after ``moment`` (a naive one, or one not after it, is an
            ``InvalidScheduleError`` when the scheduler asks), or None when the schedule
            never fires again.
        """
        ...


def load_timezone(name: str) -> tzinfo:
    """Return the IANA time zone ``name`` or raise a clear error."""
    if name in ("UTC", "Etc/UTC", "utc"):
        return UTC
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidScheduleError(
            f"unknown time zone {name!r}: pass an IANA name such as 'Europe/Berlin' "
            "or 'America/New_York' (on a system without tz data, pip install tzdata)"
        ) from exc


class CronSchedule:
    """A cron expression: 5 fields, or 6 with **seconds first**, in a time zone.

    Fixed-time jobs follow Debian cron on daylight-saving changes: a time in the
    skipped hour fires once, at the instant the clocks jumped, and a time in the
    repeated hour fires once, the first time. Jobs with a ``*`` at the start of the
    minute or hour field (``*``, ``*/15``) fire by elapsed time through both changes:
    at every instant whose wall-clock time matches, so not in the skipped hour and
    twice in the repeated one. The same rules hold for 6-field expressions (the
    seconds field does not make a job fixed-time or not) and for half-hour changes.

    >>> CronSchedule("0 3 * * *", "Europe/Athens").next_after(datetime(2026, 1, 1, tzinfo=UTC))
    datetime.datetime(2026, 1, 1, 1, 0, tzinfo=datetime.timezone.utc)

    Args:
        expression: The cron expression: 5 fields (minute hour day month weekday), or 6
            with seconds first (second minute hour day month weekday).
        timezone: The IANA time zone it is read in, such as ``"Europe/Berlin"``
            (default ``"UTC"``).

    Raises:
        InvalidScheduleError: The expression does not parse, or never fires (such as
            ``"0 0 30 2 *"``), or the time zone is unknown.

    Attributes:
        expression: The expression, its fields separated by single spaces.
        timezone: The time zone's name, as given.
    """

    __slots__ = ("_by_elapsed_time", "_zone", "expression", "timezone")

    def __init__(self, expression: str, timezone: str = "UTC") -> None:
        if not isinstance(expression, str):
            raise InvalidScheduleError(
                f"a cron schedule must be a string, got {type(expression).__name__}"
            )
        fields = expression.split()
        if len(fields) not in (5, 6):
            raise InvalidScheduleError(
                f"invalid cron expression {expression!r}: it has {len(fields)} fields; "
                "use 5 (minute hour day month weekday) or 6 with seconds first "
                "(second minute hour day month weekday)"
            )
        self.expression = " ".join(fields)
        self.timezone = timezone
        self._zone = load_timezone(timezone)
        try:
            # Parsing happens in the constructor; one step finds expressions
            # that parse but never fire (such as "0 0 30 2 *").
            next(CronSim(self.expression, datetime.now(self._zone)))
        except (CronSimError, ValueError, StopIteration) as exc:
            raise InvalidScheduleError(
                f"invalid cron expression {expression!r}: {_never_fires(fields) or exc}"
            ) from exc
        # Debian cron's test, for either length: the minute or hour field starts with *.
        minute, hour = fields[-5], fields[-4]
        self._by_elapsed_time = minute.startswith("*") or hour.startswith("*")

    def next_after(self, moment: datetime, /) -> datetime | None:
        """The first fire time strictly after ``moment``.

        Args:
            moment: An aware datetime.

        Returns:
            The fire time, an aware UTC datetime, or None if there is none.
        """
        return next(self.fires_after(moment), None)

    def fires_after(self, moment: datetime, /) -> Iterator[datetime]:
        """Every fire time strictly after ``moment``, in order (cheaper than
        ``next_after`` each time: the expression is parsed once).

        Args:
            moment: An aware datetime.

        Returns:
            An iterator of aware UTC datetimes.
        """
        if self._zone is UTC:
            walls = CronSim(self.expression, moment.astimezone(UTC).replace(tzinfo=None))
            return (wall.replace(tzinfo=UTC) for wall in walls)
        return self._zoned_fires_after(moment)

    def _zoned_fires_after(self, moment: datetime) -> Iterator[datetime]:
        """The fire times in a zone with clock changes: the expression's wall-clock
        times in order (no zone: cronsim's own daylight-saving rules are not used), each
        made an instant by the rules above. A job by elapsed time fires a repeated wall
        time a second time an hour or so after the first, so those second instants wait
        in a heap until the walk passes them."""
        zone = self._zone
        local = moment.astimezone(zone)
        start = local.replace(tzinfo=None)
        if local.fold == 0:
            # In the first pass of a repeated hour, the second pass of wall times a
            # little before ``start`` is still to come.
            first_offset, second_offset = local.utcoffset(), local.replace(fold=1).utcoffset()
            if first_offset is not None and second_offset is not None:
                start -= max(first_offset - second_offset, _NO_TIME)
        later: list[datetime] = []
        last = moment
        for wall in CronSim(self.expression, start - _ONE_SECOND):
            first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
            second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
            while later and later[0] <= first:
                fire = heapq.heappop(later)
                if fire > last:
                    last = fire
                    yield fire
            if first < second:  # a repeated wall time
                if self._by_elapsed_time:
                    heapq.heappush(later, second)
            elif first > second:  # a wall time the clocks skipped
                if self._by_elapsed_time:
                    continue
                first = clock_change(zone, second, first)
            if first > last:
                last = first
                yield first
        while later:
            fire = heapq.heappop(later)
            if fire > last:
                last = fire
                yield fire

    def __repr__(self) -> str:
        return f"CronSchedule({self.expression!r}, {self.timezone!r})"


def _never_fires(fields: list[str]) -> str:
    """Why an expression that is refused never fires, if that is why: its day of the
    month is one that none of its months has (``"0 0 30 2 *"``), or no day matches in
    50 years. "" if it is refused for another reason."""
    every_month = [*fields[:-2], "*", fields[-1]]
    try:
        next(CronSim(" ".join(every_month), datetime(2000, 1, 1)))
    except (CronSimError, ValueError, StopIteration):
        return ""
    return (
        "it never fires: none of the months in its month field has that day of the month "
        "(February has 28 or 29 days; April, June, September and November 30)"
    )


_NO_TIME = timedelta(0)
_ONE_SECOND = timedelta(seconds=1)


def clock_change(zone: tzinfo, low: datetime, high: datetime) -> datetime:
    """The instant in ``(low, high]`` (UTC) at which ``zone``'s clocks changed (once in
    that span): the first one with the offset ``high`` has (the change falls on a whole
    second)."""
    offset = high.astimezone(zone).utcoffset()
    while high - low > _ONE_SECOND:
        middle = low + (high - low) // 2
        middle -= timedelta(microseconds=middle.microsecond)
        if middle.astimezone(zone).utcoffset() == offset:
            high = middle
        else:
            low = middle
    return high


class IntervalSchedule:
    """Every ``every_ms`` milliseconds, aligned to the Unix epoch (UTC): the fire times
    are the multiples of ``every_ms`` since 1970-01-01T00:00:00Z, on every instance.

    Args:
        every_ms: The interval in milliseconds (more than 0).

    Raises:
        InvalidScheduleError: ``every_ms`` is not a whole number more than 0.

    Attributes:
        every_ms: The interval in milliseconds.
    """

    __slots__ = ("every_ms",)

    def __init__(self, every_ms: int) -> None:
        if isinstance(every_ms, bool) or not isinstance(every_ms, int) or every_ms <= 0:
            raise InvalidScheduleError(
                f"every_ms must be a positive whole number of milliseconds, got {every_ms!r}"
            )
        self.every_ms = every_ms

    def next_after(self, moment: datetime, /) -> datetime | None:
        """The first multiple of ``every_ms`` strictly after ``moment``.

        Args:
            moment: An aware datetime.

        Returns:
            The fire time, an aware UTC datetime.
        """
        after_ms = to_epoch_ms(moment)
        return from_epoch_ms((after_ms // self.every_ms + 1) * self.every_ms)

    def __repr__(self) -> str:
        return f"IntervalSchedule(every_ms={self.every_ms})"


_EVERY = re.compile(r"([1-9][0-9]{0,3})(d|w|mo|y)")


class CalendarInterval:
    """Every N days, weeks, months or years from a start, at the start's local time in a
    time zone: what cron cannot say ("every 2 weeks on Monday from 2027-01-04", "every 3
    months from January 15")::

        CalendarInterval("2w", start="2027-01-04 09:00", timezone="Europe/Berlin")

    Each fire time is the start moved by a whole number of intervals on the calendar, at
    the start's wall-clock time: days and weeks keep the hour across daylight-saving
    changes (a fire is 23 or 25 hours after the one before, not 24), months and years
    keep the day of the month, or take the month's last day when it has fewer (every
    month from January 31: February 28 or 29, March 31, April 30). A wall-clock time
    in a repeated hour fires once, the first time; one in a skipped hour (02:30 on a
    spring-forward night) is shifted past the gap (03:30), or, with ``missing="skip"``,
    not fired that day.

    Args:
        every: The interval: a whole number from 1 to 9999 and a unit, ``d`` (days),
            ``w`` (weeks), ``mo`` (months) or ``y`` (years): ``"2w"``, ``"3mo"``.
        start: The first fire time: a datetime (naive: the zone's wall-clock time;
            aware: converted to the zone's) or ISO 8601 text (``"2027-01-04 09:00"``).
        timezone: The IANA time zone the start and the calendar are read in (default
            ``"UTC"``).
        missing: What a fire time in a skipped hour does: ``"shift"`` (default: it
            fires at the same wall-clock time after the gap) or ``"skip"`` (that one
            does not fire).

    Raises:
        InvalidScheduleError: ``every``, ``start``, ``timezone`` or ``missing`` cannot be
            used.

    Attributes:
        every: The interval, as given.
        start: The first fire time, as the zone's wall-clock time (naive).
        timezone: The time zone's name, as given.
        missing: ``"shift"`` or ``"skip"``.
    """

    __slots__ = ("_count", "_months", "_zone", "every", "missing", "start", "timezone")

    def __init__(
        self,
        every: str,
        *,
        start: datetime | str,
        timezone: str = "UTC",
        missing: Literal["shift", "skip"] = "shift",
    ) -> None:
        found = _EVERY.fullmatch(every) if isinstance(every, str) else None
        if found is None:
            raise InvalidScheduleError(
                f"every must be a number from 1 to 9999 and a unit: d, w, mo or y (such as "
                f"'2w' or '3mo'), got {every!r}"
            )
        if missing not in ("shift", "skip"):
            raise InvalidScheduleError(f"missing must be 'shift' or 'skip', got {missing!r}")
        count, unit = int(found.group(1)), found.group(2)
        self.every = every
        self.timezone = timezone
        self.missing = missing
        self._zone = load_timezone(timezone)
        #: The interval in days (days, weeks) or in months (months, years).
        self._months = unit in ("mo", "y")
        self._count = count * {"d": 1, "w": 7, "mo": 1, "y": 12}[unit]
        self.start = self._wall_time(start)

    def _wall_time(self, start: datetime | str) -> datetime:
        if isinstance(start, str):
            try:
                start = datetime.fromisoformat(start)
            except ValueError:
                raise InvalidScheduleError(
                    f"start must be a datetime or ISO 8601 text such as '2027-01-04 09:00', "
                    f"got {start!r}"
                ) from None
        if not isinstance(start, datetime):
            raise InvalidScheduleError(f"start must be a datetime, got {start!r}")
        if start.tzinfo is not None:
            start = start.astimezone(self._zone).replace(tzinfo=None)
        return start.replace(fold=0)

    def _wall_fire(self, index: int) -> datetime:
        """The ``index``-th fire time (from 0) as the zone's wall-clock time."""
        start = self.start
        if not self._months:
            return start + timedelta(days=index * self._count)
        years, month = divmod(start.month - 1 + index * self._count, 12)
        year = start.year + years
        day = min(start.day, calendar.monthrange(year, month + 1)[1])
        return start.replace(year=year, month=month + 1, day=day)

    def _instant(self, wall: datetime) -> datetime | None:
        """A wall-clock time as an instant: the first of a repeated hour's two; one in a
        skipped hour shifted past the gap (its offset before the change), or None when
        such times are skipped."""
        instant = wall.replace(tzinfo=self._zone).astimezone(UTC)
        if self.missing == "skip" and instant.astimezone(self._zone).replace(tzinfo=None) != wall:
            return None
        return instant

    def next_after(self, moment: datetime, /) -> datetime | None:
        """The first fire time strictly after ``moment``.

        Args:
            moment: An aware datetime.

        Returns:
            The fire time, an aware UTC datetime, or None past the year 9999.
        """
        wall = moment.astimezone(self._zone).replace(tzinfo=None)
        if self._months:
            passed = (wall.year - self.start.year) * 12 + wall.month - self.start.month
        else:
            passed = (wall.date() - self.start.date()).days
        # A fire time or two before the estimate: daylight saving moves instants by hours.
        first = max(passed // self._count - 1, 0)
        for index in range(first, first + 400):  # a skipped fire time is rare: 400 is ample
            try:
                fire = self._instant(self._wall_fire(index))
            except (OverflowError, ValueError):
                return None  # past the year 9999
            if fire is not None and fire > moment:
                return fire
        return None

    def __repr__(self) -> str:
        start = self.start.isoformat(sep=" ")
        skip = ", missing='skip'" if self.missing == "skip" else ""
        return (
            f"CalendarInterval({self.every!r}, start={start!r}, timezone={self.timezone!r}{skip})"
        )


#: The most schedules one ``CombinedSchedule`` holds.
COMBINED_MAX = 100


class CombinedSchedule:
    """Several schedules as one: a slot at each instant any of them fires, once where two
    or more fire at the same instant. A job given a list of schedules gets one::

        @scheduler.job(["0 9 * * 1-5", "0 12 * * 6"], timezone="Europe/Berlin")

    Each part keeps its own rules (a cron expression its daylight-saving rules).

    Args:
        *parts: The schedules (1 to 100): ``CronSchedule``, ``IntervalSchedule``,
            ``CalendarInterval`` or any ``Schedule``.

    Raises:
        InvalidScheduleError: No part, more than 100, or one that is not a schedule.

    Attributes:
        parts: The schedules, as given.
    """

    __slots__ = ("parts",)

    def __init__(self, *parts: Schedule) -> None:
        if not 1 <= len(parts) <= COMBINED_MAX:
            raise InvalidScheduleError(
                f"a combined schedule holds 1 to {COMBINED_MAX} schedules, got {len(parts)}"
            )
        for part in parts:
            if not isinstance(part, Schedule):
                raise InvalidScheduleError(
                    f"cannot use {part!r} in a combined schedule: pass cron strings or objects "
                    "with next_after(datetime)"
                )
        self.parts = tuple(parts)

    def next_after(self, moment: datetime, /) -> datetime | None:
        """The first instant strictly after ``moment`` at which any part fires.

        Args:
            moment: An aware datetime.

        Returns:
            The fire time, an aware UTC datetime, or None when no part fires again.
        """
        return next(self.fires_after(moment), None)

    def fires_after(self, moment: datetime, /) -> Iterator[datetime]:
        """Every fire time strictly after ``moment``, in order, each instant once.

        Args:
            moment: An aware datetime.

        Returns:
            An iterator of aware UTC datetimes.
        """
        last = moment
        for fire in heapq.merge(*(_fires_of(part, moment) for part in self.parts)):
            if fire > last:
                last = fire
                yield fire

    def __repr__(self) -> str:
        return f"CombinedSchedule({', '.join(map(repr, self.parts))})"


class BoundedSchedule:
    """A job's schedule within its ``start_at`` and ``end_at``: its slots at or after
    the start and before the end (either may be None)."""

    __slots__ = ("end", "schedule", "start")

    def __init__(self, schedule: Schedule, start: datetime | None, end: datetime | None) -> None:
        self.schedule = schedule
        self.start = start
        self.end = end

    def next_after(self, moment: datetime, /) -> datetime | None:
        return next(self.fires_after(moment), None)

    def fires_after(self, moment: datetime, /) -> Iterator[datetime]:
        if self.start is not None and moment < self.start:
            moment = self.start - _ONE_MICROSECOND
        for fire in _fires_of(self.schedule, moment):
            if self.end is not None and fire >= self.end:
                return
            yield fire

    def __repr__(self) -> str:
        bounds = [
            f"{name}={at.isoformat()!r}"
            for name, at in (("start_at", self.start), ("end_at", self.end))
            if at is not None
        ]
        return f"BoundedSchedule({self.schedule!r}, {', '.join(bounds)})"


_ONE_MICROSECOND = timedelta(microseconds=1)


def _fires_of(schedule: Schedule, moment: datetime) -> Iterator[datetime]:
    """A schedule's fire times after ``moment`` in UTC, each checked as a slot clock
    checks them (aware, moving forward)."""
    if isinstance(schedule, CronSchedule | CombinedSchedule | BoundedSchedule):
        yield from schedule.fires_after(moment)
        return
    at = moment
    while (fire := schedule.next_after(at)) is not None:
        if fire.tzinfo is None or fire <= at:
            raise InvalidScheduleError(
                f"{schedule!r}.next_after() returned {fire.isoformat()}, which is naive or "
                "not after the moment it was given; return an aware datetime after it"
            )
        at = fire
        yield fire.astimezone(UTC)


def to_epoch_ms(moment: datetime) -> int:
    """Milliseconds since the Unix epoch of an aware datetime (floored)."""
    delta = moment - _EPOCH
    return delta.days * 86_400_000 + delta.seconds * 1000 + delta.microseconds // 1000


def from_epoch_ms(epoch_ms: int) -> datetime:
    """The aware UTC datetime of an epoch millisecond."""
    return _EPOCH + timedelta(milliseconds=epoch_ms)


def iso_ms(epoch_ms: int | float) -> str:
    """An epoch millisecond as logs show it: ISO 8601 in UTC, milliseconds only when
    there are some (``2026-12-02T13:40:00Z``, ``2026-12-02T13:40:00.250Z``)."""
    moment = from_epoch_ms(int(epoch_ms))
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if moment.microsecond:
        text += f".{moment.microsecond // 1000:03d}"
    return text + "Z"


#: The most fire times one preview lists.
FIRE_TIMES_MAX = 1000


#: The most slots a preview looks at, excluded ones included.
_PREVIEW_LOOKS_MAX = 100_000


def fire_times(
    schedule: Schedule,
    after_ms: int,
    count: int,
    excluded: Callable[[int], object] | None = None,
) -> list[datetime]:
    """The next ``count`` fire times of ``schedule`` after ``after_ms`` (fewer if it
    ends), as aware UTC datetimes: what a job's slots will be. Slots for which
    ``excluded`` is true are left out (fewer when more than 100 000 in a row are)."""
    clock = SlotClock(schedule)
    found: list[datetime] = []
    at_ms = after_ms
    for _ in range(_PREVIEW_LOOKS_MAX):
        next_ms = clock.next_slot_ms(at_ms) if len(found) < count else None
        if next_ms is None:
            break
        at_ms = next_ms
        if excluded is None or not excluded(at_ms):
            found.append(from_epoch_ms(at_ms))
    return found


def count_slots(schedule: Schedule, start_ms: int, end_ms: int, most: int) -> int:
    """How many slots of ``schedule`` fall in ``[start_ms, end_ms)``, counted up to
    ``most + 1`` (a range beyond ``most`` is not counted to its end)."""
    clock = SlotClock(schedule)
    count, at_ms = 0, start_ms - 1
    while count <= most:
        slot_ms = clock.next_slot_ms(at_ms)
        if slot_ms is None or slot_ms >= end_ms:
            break
        count, at_ms = count + 1, slot_ms
    return count


class SlotClock:
    """Turns a schedule into slot ids (epoch milliseconds)."""

    __slots__ = ("_fires", "_last_ms", "_schedule")

    def __init__(self, schedule: Schedule) -> None:
        self._schedule = schedule
        #: A cron schedule's fire times after the last slot returned (asked for the
        #: slot after that one, as the scheduler does, it takes the next of them).
        self._fires: Iterator[datetime] | None = None
        self._last_ms: int | None = None

    def next_slot_ms(self, after_ms: int) -> int | None:
        """The first slot strictly after ``after_ms``, or None if there is none."""
        if isinstance(self._schedule, CronSchedule | CombinedSchedule | BoundedSchedule):
            if self._fires is None or after_ms != self._last_ms:
                self._fires = self._schedule.fires_after(from_epoch_ms(after_ms))
            fire = next(self._fires, None)
        else:
            fire = self._schedule.next_after(from_epoch_ms(after_ms))
        if fire is None:
            return None
        if fire.tzinfo is None:
            raise InvalidScheduleError(
                f"{self._schedule!r}.next_after() returned a naive datetime; return an aware one"
            )
        slot_ms = self._last_ms = to_epoch_ms(fire)
        if slot_ms <= after_ms:
            raise InvalidScheduleError(
                f"{self._schedule!r}.next_after() returned {fire.isoformat()}, which is not "
                "after the moment it was given; it must move forward"
            )
        return slot_ms
