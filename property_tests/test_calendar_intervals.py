"""Calendar intervals (and cron's last weekday and last Friday of a month) as
properties, against an oracle written here from the documented rules
(``CalendarInterval``'s docstring): the n-th fire time is the start moved by n
intervals on the calendar (days and weeks: whole days; months and years: the same day of
the month, or the month's last day), at the start's wall-clock time in the zone; a wall
time the zone repeats fires once, the first time; one the zone skips fires at the same
wall time after the gap (``shift``), or not at all (``skip``).

The oracle finds instants its own way: a wall time's instants are the UTC moments
whose wall time, read in the zone, is it (tried at each offset the zone has near it);
in a gap, the instant is the wall time at the offset before the change. Starts are
drawn in the small hours (where clock changes are) of 2025-2027 in zones with
whole-hour and half-hour changes.
"""

from __future__ import annotations

import calendar
import itertools
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from anarchon import CalendarInterval, CronSchedule, InvalidScheduleError
from anarchon._model.schedule import SlotClock, from_epoch_ms, to_epoch_ms
from property_tests.profiles import examples

ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata"]


def add_months(day: date, months: int) -> date:
    """``day`` moved by whole months, one month at a time, clamped to the month's end
    (counted from the start each time: the day of the month is the start's)."""
    year, month = day.year, day.month
    for _ in range(months):
        month += 1
        if month == 13:
            year, month = year + 1, 1
    return date(year, month, min(day.day, calendar.monthrange(year, month)[1]))


def wall_times(every: str, start: datetime, count: int) -> list[datetime]:
    number, unit = int(every.rstrip("dwmoy")), every.lstrip("0123456789")
    walls = []
    for n in range(count):
        if unit in ("d", "w"):
            day = start.date() + timedelta(days=n * number * (7 if unit == "w" else 1))
        else:
            day = add_months(start.date(), n * number * (12 if unit == "y" else 1))
        walls.append(datetime.combine(day, start.time()))
    return walls


def instants_of(wall: datetime, zone: ZoneInfo) -> list[datetime]:
    """The UTC instants whose wall time in ``zone`` is ``wall``, earliest first."""
    offsets = set()
    for hours in range(-36, 37, 3):
        probe = (wall + timedelta(hours=hours)).replace(tzinfo=UTC).astimezone(zone)
        offset = probe.utcoffset()
        assert offset is not None
        offsets.add(offset)
    found = set()
    for offset in offsets:
        instant = (wall - offset).replace(tzinfo=UTC)
        if instant.astimezone(zone).replace(tzinfo=None) == wall:
            found.add(instant)
    return sorted(found)


def oracle(every: str, start: datetime, zone_name: str, missing: str, count: int) -> list[datetime]:
    zone = ZoneInfo(zone_name)
    fires = []
    for wall in wall_times(every, start, count):
        found = instants_of(wall, zone)
        if found:
            fires.append(found[0])  # a repeated wall time: the first
        elif missing == "shift":
            before = (wall - timedelta(hours=6)).replace(tzinfo=zone).utcoffset()
            assert before is not None
            fires.append((wall - before).replace(tzinfo=UTC))
    return fires


@st.composite
def intervals(draw: st.DrawFn) -> tuple[str, datetime, str, str]:
    every = f"{draw(st.integers(1, 5))}{draw(st.sampled_from(['d', 'w', 'mo', 'y']))}"
    day = draw(st.dates(min_value=date(2025, 1, 1), max_value=date(2027, 12, 31)))
    hour = draw(st.sampled_from([0, 1, 2, 2, 2, 3, 9, 23]))
    minute = draw(st.sampled_from([0, 15, 30, 45]))
    zone = draw(st.sampled_from(ZONES))
    missing = draw(st.sampled_from(["shift", "skip"]))
    return every, datetime.combine(day, time(hour, minute)), zone, missing


@settings(max_examples=examples(300), deadline=None)
@given(spec=intervals(), offset_days=st.integers(-40, 2000), fraction=st.floats(0, 1))
def test_calendar_interval_fires_are_the_instants_the_oracle_finds(
    spec: tuple[str, datetime, str, str], offset_days: int, fraction: float
) -> None:
    every, start, zone, missing = spec
    schedule = CalendarInterval(every, start=start, timezone=zone, missing=missing)  # type: ignore[arg-type]
    expected = oracle(every, start, zone, missing, 400)
    moment = (start + timedelta(days=offset_days, seconds=fraction * 86_400)).replace(tzinfo=UTC)
    later = [fire for fire in expected if fire > moment]
    if not later:
        return  # beyond the fires the oracle listed
    got = schedule.next_after(moment)
    assert got == later[0], (schedule, moment, got, later[0])
    local = got.astimezone(ZoneInfo(zone))
    event("shifted past a gap" if local.time() != start.time() else "at the start's wall time")


@settings(max_examples=examples(200), deadline=None)
@given(spec=intervals())
def test_calendar_interval_fires_move_forward_with_nothing_between(
    spec: tuple[str, datetime, str, str],
) -> None:
    """Walked by a slot clock from before the start, the fires are the oracle's first
    ones, in order; asked from a moment between two fires, the later one."""
    every, start, zone, missing = spec
    schedule = CalendarInterval(every, start=start, timezone=zone, missing=missing)  # type: ignore[arg-type]
    expected = oracle(every, start, zone, missing, 40)
    clock = SlotClock(schedule)
    at_ms = to_epoch_ms(start.replace(tzinfo=UTC) - timedelta(days=2))
    walked = []
    for _ in range(len(expected)):
        slot = clock.next_slot_ms(at_ms)
        assert slot is not None
        walked.append(from_epoch_ms(slot))
        at_ms = slot
    assert walked == expected
    for earlier, later in itertools.pairwise(walked):
        between = earlier + (later - earlier) / 2
        assert schedule.next_after(between) == later


def test_the_documented_examples() -> None:
    """Every 2 weeks on Monday from 2027-01-04 at 09:00 Berlin; every month from January
    31 (the month's last day when shorter); 02:30 on the spring-forward night shifted to
    03:30 or skipped; 02:30 on the autumn night fired once."""
    berlin = ZoneInfo("Europe/Berlin")
    weekly = CalendarInterval("2w", start="2027-01-04 09:00", timezone="Europe/Berlin")
    fires = [weekly.next_after(datetime(2027, 1, 1, tzinfo=UTC))]
    for _ in range(12):
        fires.append(weekly.next_after(fires[-1]))  # type: ignore[arg-type]
    locals_ = [fire.astimezone(berlin) for fire in fires if fire is not None]
    assert all(f.weekday() == 0 and (f.hour, f.minute) == (9, 0) for f in locals_)
    assert [f.date() for f in locals_[:3]] == [
        date(2027, 1, 4),
        date(2027, 1, 18),
        date(2027, 2, 1),
    ]
    monthly = CalendarInterval("1mo", start=datetime(2027, 1, 31, 8), timezone="UTC")
    days = []
    moment = datetime(2027, 1, 1, tzinfo=UTC)
    for _ in range(4):
        moment = monthly.next_after(moment)  # type: ignore[assignment]
        days.append(moment.date())
    assert days == [date(2027, 1, 31), date(2027, 2, 28), date(2027, 3, 31), date(2027, 4, 30)]
    night = datetime(2027, 3, 27, 12, tzinfo=UTC)
    shifted = CalendarInterval("1d", start="2027-03-01 02:30", timezone="Europe/Berlin")
    spring = shifted.next_after(night)
    assert spring is not None and spring.astimezone(berlin).time() == time(3, 30)
    skipped = CalendarInterval(
        "1d", start="2027-03-01 02:30", timezone="Europe/Berlin", missing="skip"
    )
    after = skipped.next_after(night)
    assert after is not None and after.astimezone(berlin).date() == date(2027, 3, 29)
    autumn = CalendarInterval("1d", start="2027-10-01 02:30", timezone="Europe/Berlin")
    first = autumn.next_after(datetime(2027, 10, 30, 12, tzinfo=UTC))
    assert first is not None and first == datetime(2027, 10, 31, 0, 30, tzinfo=UTC)
    assert autumn.next_after(first) == datetime(2027, 11, 1, 1, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    ("every", "start", "why"),
    [
        ("2", "2027-01-01", "a number from 1 to 9999 and a unit"),
        ("0d", "2027-01-01", "a number from 1 to 9999 and a unit"),
        ("3 weeks", "2027-01-01", "a number from 1 to 9999 and a unit"),
        ("1d", "soon", "ISO 8601"),
    ],
)
def test_a_calendar_interval_that_cannot_be_used_says_why(every: str, start: str, why: str) -> None:
    with pytest.raises(InvalidScheduleError, match=why):
        CalendarInterval(every, start=start)
    with pytest.raises(InvalidScheduleError, match="'shift' or 'skip'"):
        CalendarInterval("1d", start="2027-01-01", missing="later")  # type: ignore[arg-type]


def last_weekday(year: int, month: int, weekdays: range | tuple[int, ...]) -> date:
    """The month's last day whose weekday (Monday 0) is one of ``weekdays``."""
    day = date(year, month, calendar.monthrange(year, month)[1])
    while day.weekday() not in weekdays:
        day -= timedelta(days=1)
    return day


@settings(max_examples=examples(100), deadline=None)
@given(
    zone=st.sampled_from(ZONES),
    hour=st.sampled_from([0, 1, 2, 3, 9, 18]),
    minute=st.sampled_from([0, 30]),
    which=st.sampled_from(["LW", "5L"]),
    first=st.dates(min_value=date(2025, 1, 1), max_value=date(2027, 6, 30)),
)
def test_the_last_weekday_and_the_last_friday_of_each_month_fire_once(
    zone: str, hour: int, minute: int, which: str, first: date
) -> None:
    """``M H LW * *`` (the last weekday of the month) and ``M H * * 5L`` (its last
    Friday) fire once a month, on that day in the zone, at that wall time (or, in a
    skipped hour, the instant the clocks jumped), through a year of clock changes."""
    expression = f"{minute} {hour} LW * *" if which == "LW" else f"{minute} {hour} * * 5L"
    schedule = CronSchedule(expression, zone)
    here = ZoneInfo(zone)
    moment = datetime.combine(first, time(0)).replace(tzinfo=here).astimezone(UTC)
    weekdays = range(5) if which == "LW" else (4,)
    months: list[tuple[int, int]] = []
    for _ in range(12):
        fire = schedule.next_after(moment)
        assert fire is not None
        local = fire.astimezone(here)
        day = last_weekday(local.year, local.month, weekdays)
        assert local.date() == day, (expression, zone, local)
        if (local.hour, local.minute) != (hour, minute):
            event("in a skipped hour: at the jump")
            assert not instants_of(datetime.combine(day, time(hour, minute)), here)
        months.append((local.year, local.month))
        moment = fire
    # One a month, month after month.
    for (year, month), following in itertools.pairwise(months):
        assert following == ((year + 1, 1) if month == 12 else (year, month + 1)), months
