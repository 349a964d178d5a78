"""Schedules as properties: slots move forward, and none is skipped or invented.

For any cron expression of the grammar below, any time zone of the list and
any moment: ``next_after`` returns a later instant, and asking again from any
moment between the two returns the same instant (so no slot lies in between
and repeated asks agree: every instance derives the same slots).

And cron against an independent oracle written here from the documented rules
(``CronSchedule``'s docstring, the README): the oracle parses the fields itself
and steps through real time minute by minute (second by second inside a
matching minute), reading each instant's wall clock in the job's zone. A fire
is an instant whose wall clock matches every field (day of month and day of
week: either one when both are restricted, as in Debian cron). Jobs with a
``*`` in the minute or hour field (Debian cron's test: the field starts with
``*``) fire by elapsed time: at every matching instant, so twice in a repeated
hour and never in a skipped one. Fixed-time jobs follow Debian cron: a
matching wall time that the spring change skips fires once at the first valid
instant after it (the instant the clocks jumped), and a matching wall time
that the autumn change repeats fires once, the first time. Moments are drawn
around every clock change of 2025-2027 in Europe/London, America/New_York and
Australia/Lord_Howe (half-hour changes) on purpose.

The same rules hold for 6-field expressions and half-hour changes: the cases
where anarchon once disagreed (before it walked wall-clock times itself) are
pinned by the tests at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from functools import cache
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anarchon import CronSchedule, IntervalSchedule
from anarchon._model.schedule import SlotClock, from_epoch_ms, to_epoch_ms
from property_tests.profiles import examples

ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata"]


def field(low: int, high: int) -> st.SearchStrategy[str]:
    number = st.integers(low, high).map(str)
    step = st.integers(1, max(1, (high - low) // 2)).map(lambda n: f"*/{n}")
    rng = st.tuples(st.integers(low, high), st.integers(low, high)).map(
        lambda ab: f"{min(ab)}-{max(ab)}"
    )
    return st.one_of(st.just("*"), number, step, rng)


cron_expressions = st.one_of(
    st.tuples(field(0, 59), field(0, 23), st.just("*"), st.just("*"), field(0, 6)).map(" ".join),
    st.tuples(
        field(0, 59), field(0, 59), field(0, 23), st.just("*"), st.just("*"), st.just("*")
    ).map(" ".join),
)
# Half an hour before each clock change of 2026 in the zones above.
DST_CHANGES = [
    datetime(2026, 3, 29, 0, 30, tzinfo=UTC),  # Berlin, spring
    datetime(2026, 10, 25, 0, 30, tzinfo=UTC),  # Berlin, autumn
    datetime(2026, 3, 8, 6, 30, tzinfo=UTC),  # New York, spring
    datetime(2026, 11, 1, 5, 30, tzinfo=UTC),  # New York, autumn
    datetime(2026, 4, 4, 14, 30, tzinfo=UTC),  # Lord Howe, autumn (half an hour)
    datetime(2026, 10, 3, 15, 30, tzinfo=UTC),  # Lord Howe, spring
]
moments = st.datetimes(
    min_value=datetime(2024, 1, 1), max_value=datetime(2030, 12, 31), timezones=st.just(UTC)
)


@settings(max_examples=examples(200), deadline=None)
@given(
    expression=cron_expressions,
    zone=st.sampled_from(ZONES),
    moment=moments,
    fraction=st.floats(0, 1, exclude_max=True),
)
def test_cron_slots_move_forward_and_nothing_lies_between(
    expression: str, zone: str, moment: datetime, fraction: float
) -> None:
    schedule = CronSchedule(expression, zone)
    fire = schedule.next_after(moment)
    assert fire is not None
    assert fire > moment
    span_us = (fire - moment) // timedelta(microseconds=1)
    between = moment + timedelta(microseconds=min(int(span_us * fraction), span_us - 1))
    assert schedule.next_after(between) == fire


@settings(max_examples=examples(200), deadline=None)
@given(every_ms=st.integers(1, 10 * 86_400_000), moment=moments)
def test_interval_slots_are_the_next_multiple_of_the_interval(
    every_ms: int, moment: datetime
) -> None:
    fire = IntervalSchedule(every_ms).next_after(moment)
    assert fire is not None
    assert fire > moment
    assert fire - moment <= timedelta(milliseconds=every_ms)
    assert round(fire.timestamp() * 1000) % every_ms == 0


@settings(max_examples=examples(200), deadline=None)
@given(
    expression=cron_expressions,
    zone=st.sampled_from(ZONES),
    moment=moments | st.sampled_from(DST_CHANGES),
)
def test_a_slot_clock_walking_a_cron_schedule_finds_what_next_after_finds(
    expression: str, zone: str, moment: datetime
) -> None:
    """The scheduler asks its clock for the slot after the last one; the clock then
    walks one parsed schedule instead of parsing it again: the same slots."""
    schedule = CronSchedule(expression, zone)
    clock = SlotClock(schedule)
    after_ms = to_epoch_ms(moment)
    for _ in range(30):
        slot_ms = clock.next_slot_ms(after_ms)
        fire = schedule.next_after(from_epoch_ms(after_ms))
        assert fire is not None and slot_ms == to_epoch_ms(fire)
        after_ms = slot_ms


# -- an independent oracle of cron's fire times (nothing from anarchon's parser)

MINUTE = timedelta(minutes=1)


def field_values(text: str, low: int, high: int) -> frozenset[int]:
    """The values a cron field allows: ``*``, ``n``, ``a-b``, each with ``/step``, and
    comma-separated lists of those."""
    values: set[int] = set()
    for part in text.split(","):
        span, _, step = part.partition("/")
        if span == "*":
            first, last = low, high
        elif "-" in span:
            first, last = (int(n) for n in span.split("-"))
        else:
            first = last = int(span)
        values.update(range(first, last + 1, int(step) if step else 1))
    return frozenset(values)


@dataclass(frozen=True)
class CronOracle:
    seconds: frozenset[int]
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 is Sunday
    either_day: bool  # both day fields restricted: a day matches if either does
    fixed_time: bool  # neither the minute nor the hour field starts with *

    @classmethod
    def parse(cls, expression: str) -> CronOracle:
        fields = expression.split()
        if len(fields) == 5:
            fields = ["0", *fields]
        second, minute, hour, day, month, weekday = fields
        return cls(
            field_values(second, 0, 59),
            field_values(minute, 0, 59),
            field_values(hour, 0, 23),
            field_values(day, 1, 31),
            field_values(month, 1, 12),
            field_values(weekday, 0, 6),
            either_day=not day.startswith("*") and not weekday.startswith("*"),
            # Debian cron's test: the field starts with a * ("*", "*/15"); "0,*/2" does not.
            fixed_time=not minute.startswith("*") and not hour.startswith("*"),
        )

    def day_matches(self, day: date) -> bool:
        by_date = day.day in self.days
        by_weekday = day.isoweekday() % 7 in self.weekdays
        matches = by_date or by_weekday if self.either_day else by_date and by_weekday
        return day.month in self.months and matches

    def wall_minute_matches(self, wall: datetime) -> bool:
        """A wall-clock minute (naive) in which some second fires."""
        return (
            self.day_matches(wall.date())
            and wall.hour in self.hours
            and wall.minute in self.minutes
        )

    def next_after(self, moment: datetime, zone: tzinfo) -> datetime | None:
        """The first fire strictly after ``moment``, stepping through real time. (Every
        offset of the zones here is whole minutes, so wall seconds are UTC seconds.)"""
        instant = moment.astimezone(UTC).replace(second=0, microsecond=0, fold=0)
        for _ in range(200_000):
            wall = instant.astimezone(zone)
            before = (instant - MINUTE).astimezone(zone)
            jump = wall.utcoffset() - before.utcoffset()  # type: ignore[operator]
            if self.fixed_time and jump > timedelta(0) and instant > moment:
                # The clocks jumped forward at this instant: the wall minutes from where
                # the old offset would be now up to the new one never happened. One of
                # them matching fires once, here.
                skipped = before.replace(tzinfo=None) + MINUTE
                while skipped < wall.replace(tzinfo=None):
                    if self.wall_minute_matches(skipped):
                        return instant
                    skipped += MINUTE
            if not self.day_matches(wall.date()):
                # Skip to an hour before the next matching local day's midnight (a clock
                # change moves the wall clock by an hour at most).
                day = wall.date() + timedelta(days=1)
                while not self.day_matches(day):
                    day += timedelta(days=1)
                wall_left = datetime.combine(day, time()) - wall.replace(tzinfo=None)
                instant += max(MINUTE, wall_left - timedelta(hours=1))
                continue
            repeated = wall.fold == 1  # the second time this wall minute happens
            if (
                wall.hour in self.hours
                and wall.minute in self.minutes
                and not (self.fixed_time and repeated)
            ):
                for second in sorted(self.seconds):
                    fire = instant + timedelta(seconds=second)
                    if fire > moment:
                        return fire
            instant += MINUTE
        return None


def cron_field(low: int, high: int, *near: str) -> st.SearchStrategy[str]:
    """A cron field: ``*``, a number, a step, a range (with a step), a list; ``near``
    adds values worth drawing often (the hours and minutes of clock changes)."""
    number = st.integers(low, high)
    step = st.integers(1, max(1, (high - low) // 2))
    span = st.tuples(number, number).map(sorted)
    part = st.one_of(
        number.map(str),
        step.map(lambda n: f"*/{n}"),
        span.map(lambda ab: f"{ab[0]}-{ab[1]}"),
        st.tuples(span, step).map(lambda t: f"{t[0][0]}-{t[0][1]}/{t[1]}"),
    )
    listed = st.lists(part, min_size=2, max_size=3).map(",".join)
    return st.one_of(st.just("*"), part, listed, *(st.just(v) for v in near))


DAY_FIELDS = st.tuples(
    st.one_of(st.just("*"), cron_field(1, 28)),
    st.one_of(st.just("*"), cron_field(1, 12)),
    st.one_of(st.just("*"), cron_field(0, 6)),
)
HOURS = cron_field(0, 23, "1", "2", "3", "1-3", "2,3", "0-2/2")
MINUTES = cron_field(0, 59, "0", "15", "30", "45", "0,30", "*/15")
any_cron = st.one_of(
    st.tuples(MINUTES, HOURS, DAY_FIELDS).map(lambda t: " ".join([t[0], t[1], *t[2]])),
    st.tuples(cron_field(0, 59, "0", "30"), MINUTES, HOURS, DAY_FIELDS).map(
        lambda t: " ".join([t[0], t[1], t[2], *t[3]])
    ),
)

DST_ZONES = ["Europe/London", "America/New_York", "Australia/Lord_Howe"]
LORD_HOWE = "Australia/Lord_Howe"


def zone_of(name: str) -> tzinfo:
    return UTC if name == "UTC" else ZoneInfo(name)


@cache
def clock_changes(zone_name: str, first_year: int = 2025, last_year: int = 2027) -> list[datetime]:
    """The instants (UTC) at which the zone's offset changed in those years."""
    zone = zone_of(zone_name)
    changes = []
    hour = datetime(first_year, 1, 1, tzinfo=UTC)
    while hour < datetime(last_year + 1, 1, 1, tzinfo=UTC):
        offset = hour.astimezone(zone).utcoffset()
        if (hour + timedelta(hours=1)).astimezone(zone).utcoffset() != offset:
            minute = hour + MINUTE
            while minute.astimezone(zone).utcoffset() == offset:
                minute += MINUTE
            changes.append(minute)
        hour += timedelta(hours=1)
    return changes


def oracle_fires(expression: str, zone: str, moment: datetime, count: int) -> list[datetime]:
    oracle = CronOracle.parse(expression)
    fires: list[datetime] = []
    while len(fires) < count:
        fire = oracle.next_after(fires[-1] if fires else moment, zone_of(zone))
        if fire is None:
            break
        fires.append(fire)
    return fires


def assert_fires_agree(expression: str, zone: str, moment: datetime, count: int) -> None:
    """``count`` fires from ``moment`` on, each asked from the one before, are the
    oracle's."""
    expected = oracle_fires(expression, zone, moment, count)
    schedule = CronSchedule(expression, zone)
    asked = moment
    for want in [*expected, None][:count]:
        got = schedule.next_after(asked)
        local = zone_of(zone)
        assert got == want, (
            f"{expression!r} in {zone} after {asked.astimezone(local).isoformat()}: got "
            f"{got and got.astimezone(local).isoformat()}, the oracle says "
            f"{want and want.astimezone(local).isoformat()}"
        )
        if got is None:
            return
        asked = got


@st.composite
def around_a_clock_change(draw: st.DrawFn) -> tuple[str, datetime]:
    """A DST zone and a moment within four hours of one of its clock changes."""
    zone = draw(st.sampled_from(DST_ZONES))
    change = draw(st.sampled_from(clock_changes(zone)))
    offset_s = draw(st.one_of(st.integers(-90, 90), st.integers(-4 * 3600, 4 * 3600)))
    micros = draw(st.sampled_from([0, 0, 1, 999_999]))
    return zone, change + timedelta(seconds=offset_s, microseconds=micros)


def test_the_oracle_sees_the_clock_changes_it_is_drawn_around() -> None:
    """Spring and autumn each year, the half-hour ones of Lord Howe too."""
    for zone in DST_ZONES:
        changes = clock_changes(zone)
        assert len(changes) == 6, (zone, changes)
        local = ZoneInfo(zone)
        shifts = {
            abs(c.astimezone(local).utcoffset() - (c - MINUTE).astimezone(local).utcoffset())  # type: ignore[operator]
            for c in changes
        }
        assert shifts == {timedelta(minutes=30 if zone == LORD_HOWE else 60)}


@settings(max_examples=examples(200), deadline=None)
@given(expression=any_cron, zone=st.sampled_from(ZONES), moment=moments)
def test_cron_fires_are_the_instants_an_independent_oracle_finds(
    expression: str, zone: str, moment: datetime
) -> None:
    assert_fires_agree(expression, zone, moment, count=3)


@settings(max_examples=examples(300), deadline=None)
@given(expression=any_cron, around=around_a_clock_change())
def test_cron_fires_around_clock_changes_follow_the_documented_rules(
    expression: str, around: tuple[str, datetime]
) -> None:
    """The spring gap (a fixed time in it fires once, when the clocks jump; a job with
    a * fires by elapsed time, not in it) and the autumn repeat (a fixed time fires the
    first time only; a job with a * both times), for hour and half-hour changes."""
    zone, moment = around
    assert_fires_agree(expression, zone, moment, count=4)


def fires_from(expression: str, zone: str, moment: datetime) -> list[str]:
    """The schedule's next two fires from ``moment``, each asked from the one before,
    as local ISO times."""
    schedule = CronSchedule(expression, zone)
    fires = []
    for _ in range(2):
        fire = schedule.next_after(moment)
        assert fire is not None
        fires.append(fire.astimezone(zone_of(zone)).isoformat())
        moment = fire
    return fires


def test_a_fixed_time_job_asked_during_the_repeated_hour_answers_a_later_instant() -> None:
    """01:10 EST, the second 01:10 of New York's autumn change: that night's 01:30 fired
    the first time round (01:30 EDT); the next fire is the next night's."""
    expression, zone = "30 1 * * *", "America/New_York"
    moment = datetime(2026, 11, 1, 6, 10, tzinfo=UTC)
    documented = ["2026-11-02T01:30:00-05:00", "2026-11-03T01:30:00-05:00"]
    oracle = oracle_fires(expression, zone, moment, 2)
    assert [fire.astimezone(zone_of(zone)).isoformat() for fire in oracle] == documented
    assert fires_from(expression, zone, moment) == documented


# -- where anarchon once disagreed with the documented rules (cronsim's own
# daylight-saving handling: none for 6-field expressions, hours stepped in UTC)

#: name: (expression, zone, moment, the documented next two fires as local ISO times)
DISAGREEMENTS: dict[str, tuple[str, str, datetime, list[str]]] = {
    # From midnight of New York's spring day: 02:30 is skipped, it fires at 03:00 EDT.
    "six fields, skipped hour": (
        "0 30 2 * * *", "America/New_York", datetime(2026, 3, 8, 5, 0, tzinfo=UTC),
        ["2026-03-08T03:00:00-04:00", "2026-03-09T02:30:00-04:00"],
    ),
    # From midnight of New York's autumn day: 01:30 fires once, the first time (EDT).
    "six fields, repeated hour": (
        "0 30 1 * * *", "America/New_York", datetime(2026, 11, 1, 4, 0, tzinfo=UTC),
        ["2026-11-01T01:30:00-04:00", "2026-11-02T01:30:00-05:00"],
    ),
    # Every minute of 03:00-03:59, right after Lord Howe's autumn change (01:30 LHST)...
    "half-hour change, autumn": (
        "* 3 * * *", LORD_HOWE, datetime(2026, 4, 4, 15, 0, 1, tzinfo=UTC),
        ["2026-04-05T03:00:00+10:30", "2026-04-05T03:01:00+10:30"],
    ),
    # ... and from just before its spring change (01:30 LHST, 02:00 becomes 02:30).
    "half-hour change, spring": (
        "* 3 * * *", LORD_HOWE, datetime(2026, 10, 3, 14, 0, tzinfo=UTC),
        ["2026-10-04T03:00:00+11:00", "2026-10-04T03:01:00+11:00"],
    ),
    # Minute 5 of every hour: a range of one value, stepped through.
    "one-value range with a step": (
        "5-5/2 * * * *", "UTC", datetime(2026, 1, 1, tzinfo=UTC),
        ["2026-01-01T00:05:00+00:00", "2026-01-01T01:05:00+00:00"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(DISAGREEMENTS))
def test_the_oracle_finds_the_documented_fires_where_anarchon_once_disagreed(name: str) -> None:
    expression, zone, moment, documented = DISAGREEMENTS[name]
    fires = oracle_fires(expression, zone, moment, 2)
    assert [fire.astimezone(zone_of(zone)).isoformat() for fire in fires] == documented


def test_a_six_field_fixed_time_in_the_skipped_hour_fires_once_when_the_clocks_jump() -> None:
    expression, zone, moment, documented = DISAGREEMENTS["six fields, skipped hour"]
    assert fires_from(expression, zone, moment) == documented


def test_a_six_field_fixed_time_in_the_repeated_hour_fires_once() -> None:
    expression, zone, moment, documented = DISAGREEMENTS["six fields, repeated hour"]
    assert fires_from(expression, zone, moment) == documented


@pytest.mark.parametrize("name", ["half-hour change, autumn", "half-hour change, spring"])
def test_a_job_every_minute_of_an_hour_fires_from_its_first_minute_after_a_half_hour_change(
    name: str,
) -> None:
    expression, zone, moment, documented = DISAGREEMENTS[name]
    assert fires_from(expression, zone, moment) == documented


def test_a_range_of_one_value_with_a_step_is_that_value() -> None:
    expression, zone, moment, documented = DISAGREEMENTS["one-value range with a step"]
    assert fires_from(expression, zone, moment) == documented
