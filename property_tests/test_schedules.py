"""Schedules as properties: slots move forward, and none is skipped or invented.

For any cron expression of the grammar below, any time zone of the list and
any moment: ``next_after`` returns a later instant, and asking again from any
moment between the two returns the same instant (so no slot lies in between
and repeated asks agree: every instance derives the same slots).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from anarchon import CronSchedule, IntervalSchedule
from anarchon._schedule import SlotClock, from_epoch_ms, to_epoch_ms
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
