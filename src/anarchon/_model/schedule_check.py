"""What ``anarchon check-schedule`` says of a cron expression: what it means in words,
its next fire times, and warnings about what users trip over (wall-clock times that a
daylight-saving change skips or repeats, and what anarchon does there; 6-field
expressions, whose first field is seconds, that look like 5-field ones)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo

from cronsim import CronSim, CronSimError

from .schedule import (
    FIRE_TIMES_MAX,
    CronSchedule,
    clock_change,
    fire_times,
    load_timezone,
    to_epoch_ms,
)

__all__ = ["ScheduleCheck", "check_schedule"]

#: How far ahead clock changes are looked for.
CHECK_DAYS = 366
#: The most wall-clock times of one skipped or repeated hour that a warning names.
_NAMED = 3
_HOUR = timedelta(hours=1)
_SECOND = timedelta(seconds=1)


@dataclass(frozen=True, slots=True)
class ScheduleCheck:
    """A cron expression, checked."""

    expression: str
    timezone: str
    #: What it means, in words ("At 02:30 every day").
    meaning: str
    #: Its next fire times, aware UTC datetimes.
    fires: list[datetime]
    #: One sentence per thing worth knowing, in time order for clock changes.
    warnings: list[str]


def check_schedule(
    expression: str, timezone: str = "UTC", *, after: datetime, count: int = 10
) -> ScheduleCheck:
    """Check ``expression`` read in ``timezone`` from ``after`` on.

    Raises:
        InvalidScheduleError: The expression does not parse or never fires, or the zone
            is unknown (the same refusal a job's definition gets).
    """
    schedule = CronSchedule(expression, timezone)  # refuses what a job would refuse
    zone = load_timezone(timezone)
    count = max(1, min(count, FIRE_TIMES_MAX))
    fires = fire_times(schedule, to_epoch_ms(after), count)
    warnings = _lookalike(schedule.expression)
    by_elapsed_time = _by_elapsed_time(schedule.expression)
    said: set[str] = set()
    for change, before, later in _clock_changes(zone, after, after + timedelta(days=CHECK_DAYS)):
        text = _at_clock_change(schedule.expression, zone, change, before, later, by_elapsed_time)
        what = text.partition(": ")[2]
        if text and what not in said:  # the same change next year: said once
            said.add(what)
            warnings.append(text)
    return ScheduleCheck(
        schedule.expression, timezone, _meaning(schedule.expression), fires, warnings
    )


def _meaning(expression: str) -> str:
    try:
        return CronSim(expression, datetime(2000, 1, 1)).explain()
    except (CronSimError, ValueError, KeyError, IndexError):  # a form explain() lacks
        return expression


def _by_elapsed_time(expression: str) -> bool:
    fields = expression.split()
    return fields[-5].startswith("*") or fields[-4].startswith("*")


def _lookalike(expression: str) -> list[str]:
    """A 6-field expression reads its first field as seconds; one whose first five
    fields are a 5-field expression too, and whose last is ``*``, is most often a
    5-field one with a field too many."""
    fields = expression.split()
    if len(fields) != 6 or fields[5] != "*":
        return []
    five = " ".join(fields[:5])
    try:
        CronSchedule(five)
    except ValueError:
        return []
    return [
        f"{expression!r} has 6 fields: anarchon reads the first as seconds (second minute "
        f"hour day month weekday), so it fires {_meaning(expression).lower()}; if you meant "
        f"{_meaning(five).lower()}, write {five!r} (5 fields)"
    ]


def _clock_changes(
    zone: tzinfo, start: datetime, end: datetime
) -> list[tuple[datetime, timedelta, timedelta]]:
    """Each instant in ``[start, end)`` at which ``zone``'s offset changes, with the
    offsets before and after."""
    changes = []
    hour = start.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    offset = hour.astimezone(zone).utcoffset()
    while hour < end:
        following = (hour + _HOUR).astimezone(zone).utcoffset()
        if following != offset and offset is not None and following is not None:
            high = clock_change(zone, hour, hour + _HOUR)
            if start <= high < end:
                changes.append((high, offset, following))
        offset = following
        hour += _HOUR
    return changes


def _at_clock_change(
    expression: str,
    zone: tzinfo,
    change: datetime,
    before: timedelta,
    after: timedelta,
    by_elapsed_time: bool,
) -> str:
    """What the expression does at one clock change, or "" if it has no fire time in
    the skipped or repeated wall-clock times."""
    old_wall = (change + before).replace(tzinfo=None)  # where the clocks stood
    new_wall = (change + after).replace(tzinfo=None)  # where they were set to
    low, high = min(old_wall, new_wall), max(old_wall, new_wall)
    matched: list[datetime] = []
    for wall in CronSim(expression, low - _SECOND):
        if wall >= high:
            break
        matched.append(wall)
    if not matched:
        return ""
    day = f"{low:%Y-%m-%d}"
    name = getattr(zone, "key", str(zone))
    times = _times(matched)
    count = len(matched)
    if after > before:
        head = (
            f"{day}: the clocks jump from {old_wall:%H:%M} to {new_wall:%H:%M} ({name}), so "
            f"{times} never {'happens' if count == 1 else 'happen'} that day"
        )
        jumped = change.astimezone(zone)
        if by_elapsed_time:
            return (
                f"{head}: this job fires by elapsed time (its minute or hour field starts "
                f"with *), so {_fires(count)} in them {'is' if count == 1 else 'are'} not run"
            )
        return (
            f"{head}: anarchon fires {'it' if count == 1 else 'them'} once, at "
            f"{jumped:%H:%M} {jumped.tzname()}, when the clocks jump"
        )
    head = (
        f"{day}: the clocks go back from {old_wall:%H:%M} to {new_wall:%H:%M} ({name}), so "
        f"{low:%H:%M}-{high:%H:%M} happens twice"
    )
    first = (change - _SECOND).astimezone(zone).tzname()
    if by_elapsed_time:
        return (
            f"{head}: this job fires by elapsed time (its minute or hour field starts with "
            f"*), so {times} fire{'s' if count == 1 else ''} twice, once in each"
        )
    return f"{head}: {times} fire{'s' if count == 1 else ''} once, the first time ({first})"


def _times(walls: list[datetime]) -> str:
    shown = ", ".join(_clock(wall) for wall in walls[:_NAMED])
    more = len(walls) - _NAMED
    return f"{shown} and {more} more" if more > 0 else shown


def _clock(wall: datetime) -> str:
    return f"{wall:%H:%M:%S}" if wall.second else f"{wall:%H:%M}"


def _fires(count: int) -> str:
    return "the fire time" if count == 1 else f"the {count} fire times"
