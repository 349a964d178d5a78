"""Schedules: cron with and without seconds, intervals, time zones and DST changes."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from anarchon import CronSchedule, IntervalSchedule, InvalidScheduleError, Schedule
from anarchon._model.schedule import SlotClock, from_epoch_ms, to_epoch_ms

# (zone, spring day, autumn day, a time in the repeated hour)
DST_ZONES = [
    ("Europe/Berlin", "2026-03-29", "2026-10-25", "30 2 * * *"),
    ("America/New_York", "2026-03-08", "2026-11-01", "30 1 * * *"),
]


def fires_between(schedule: Schedule, start: datetime, end: datetime) -> list[datetime]:
    out: list[datetime] = []
    moment = start
    while (moment := schedule.next_after(moment)) is not None and moment < end:  # type: ignore[assignment]
        out.append(moment)
    return out


def local_day(zone: str, day: str) -> tuple[datetime, datetime]:
    midnight = datetime.fromisoformat(day).replace(tzinfo=ZoneInfo(zone))
    return midnight.astimezone(UTC), (midnight + timedelta(hours=8)).astimezone(UTC)


@pytest.mark.parametrize(("zone", "spring", "autumn", "repeated"), DST_ZONES)
def test_a_fixed_time_in_the_skipped_hour_runs_once_at_the_first_valid_instant_after(
    zone: str, spring: str, autumn: str, repeated: str
) -> None:
    start, end = local_day(zone, spring)
    fires = fires_between(CronSchedule("30 2 * * *", zone), start, end)
    assert len(fires) == 1
    local = fires[0].astimezone(ZoneInfo(zone))
    assert (local.hour, local.minute) == (3, 0)
    # The second before is 01:59:59: 03:00 is where the clocks jumped to, the first
    # valid instant after the 02:30 that did not exist.
    before = (fires[0] - timedelta(seconds=1)).astimezone(ZoneInfo(zone))
    assert (before.hour, before.minute, before.second) == (1, 59, 59)


@pytest.mark.parametrize(("zone", "spring", "autumn", "repeated"), DST_ZONES)
def test_a_fixed_time_in_the_repeated_hour_runs_once(
    zone: str, spring: str, autumn: str, repeated: str
) -> None:
    start, end = local_day(zone, autumn)
    fires = fires_between(CronSchedule(repeated, zone), start, end)
    assert len(fires) == 1
    local = fires[0].astimezone(ZoneInfo(zone))
    assert (local.hour, local.minute) == (int(repeated.split()[1]), 30)


@pytest.mark.parametrize("minute", [0, 10, 29, 30, 31, 59])
@pytest.mark.parametrize(("zone", "spring", "autumn", "repeated"), DST_ZONES)
def test_a_fixed_time_job_asked_during_the_second_pass_of_the_repeated_hour_is_not_disabled(
    zone: str, spring: str, autumn: str, repeated: str, minute: int
) -> None:
    """An instance starting (or back from a gap) in the second pass of the repeated hour
    gets a later slot, the next day's (that night's fired the first time round), not an
    InvalidScheduleError that would disable the job."""
    local = ZoneInfo(zone)
    hour = int(repeated.split()[1])
    wall = datetime.fromisoformat(autumn).replace(hour=hour, minute=minute, tzinfo=local, fold=1)
    after_ms = to_epoch_ms(wall.astimezone(UTC))
    slot_ms = SlotClock(CronSchedule(repeated, zone)).next_slot_ms(after_ms)
    assert slot_ms is not None and slot_ms > after_ms
    slot = from_epoch_ms(slot_ms).astimezone(local)
    next_day = datetime.fromisoformat(autumn).date() + timedelta(days=1)
    assert (slot.date(), slot.hour, slot.minute) == (next_day, hour, 30)


@pytest.mark.parametrize("day_kind", ["spring", "autumn"])
@pytest.mark.parametrize(("zone", "spring", "autumn", "repeated"), DST_ZONES)
def test_a_job_every_n_minutes_keeps_firing_by_elapsed_time_through_the_change(
    zone: str, spring: str, autumn: str, repeated: str, day_kind: str
) -> None:
    start, end = local_day(zone, spring if day_kind == "spring" else autumn)
    fires = fires_between(CronSchedule("*/15 * * * *", zone), start, end)
    gaps = {b - a for a, b in itertools.pairwise(fires)}
    assert gaps == {timedelta(minutes=15)}
    # 8 local hours are 7 real hours in spring and 9 in autumn; the fires are the
    # quarter hours strictly between start and end.
    real_hours = (end - start) / timedelta(hours=1)
    assert real_hours == (7 if day_kind == "spring" else 9)
    assert len(fires) == real_hours * 4 - 1


def test_six_fields_put_seconds_first() -> None:
    start = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    fires = fires_between(CronSchedule("15 * * * * *"), start, start + timedelta(minutes=3))
    assert fires == [start + timedelta(minutes=m, seconds=15) for m in range(3)]


def test_five_fields_fire_on_the_minute_in_the_time_zone() -> None:
    schedule = CronSchedule("0 3 * * *", "Europe/Athens")
    fire = schedule.next_after(datetime(2026, 1, 1, tzinfo=UTC))
    assert fire == datetime(2026, 1, 1, 1, 0, tzinfo=UTC)


def test_intervals_are_aligned_to_the_unix_epoch() -> None:
    schedule = IntervalSchedule(7_000)
    fire = schedule.next_after(datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC))
    assert fire is not None
    assert int(fire.timestamp() * 1000) % 7_000 == 0
    assert fire - datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC) <= timedelta(seconds=7)


@pytest.mark.parametrize(
    "expression",
    ["", "* * * *", "* * * * * * *", "61 * * * *", "* 25 * * *", "0 0 30 2 *", "every day"],
)
def test_an_invalid_cron_expression_is_refused_with_a_clear_error(expression: str) -> None:
    with pytest.raises(InvalidScheduleError, match="cron expression") as info:
        CronSchedule(expression)
    assert info.value.code == "ANARCHON_INVALID_SCHEDULE"


def test_an_unknown_time_zone_is_refused_with_a_clear_error() -> None:
    with pytest.raises(InvalidScheduleError, match="IANA"):
        CronSchedule("* * * * *", "Mars/Olympus_Mons")
