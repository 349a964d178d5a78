"""Calendars (issue 44, part 3): a job with several schedules runs each slot once, even
where two fire at the same instant; a job's ``exclude=`` (a cron expression, dates, or an
object with ``excludes()``) leaves slots out, each claimed and recorded skipped with the
reason once for the fleet; previews leave them out too."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import AsyncExitStack
from datetime import UTC, date, datetime
from typing import Any

import anyio
import pytest

from anarchon import (
    CombinedSchedule,
    CronSchedule,
    Inspector,
    IntervalSchedule,
    InvalidOptionError,
    InvalidScheduleError,
    RedisBackend,
    Run,
    Scheduler,
    SlotSkipped,
)
from anarchon._store.contract import ClaimRequest
from tests.helpers import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


class EveryThirdSecond:
    """A calendar object: excludes the slots whose second is a multiple of 3."""

    def excludes(self, moment: datetime) -> bool:
        return moment.second % 3 == 0


async def test_two_schedules_and_exclusions_run_each_slot_once_and_record_the_left_out(
    server_url: str, prefix: str
) -> None:
    """Two instances. ``calendar``: every 2nd and every 3rd second (the 6th seconds are
    both: one slot), excluding every 5th second by cron. ``odd``: every second, excluding
    every third by an ``excludes()`` object. Over eight seconds each slot that is not
    excluded runs once in the fleet; each excluded one runs nowhere and is in the history
    as skipped with the reason, told by one instance's event."""
    runs: Counter[tuple[str, int]] = Counter()
    skipped: list[SlotSkipped] = []
    schedulers: list[Scheduler[Any]] = []
    for name in ("a", "b"):
        scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), instance_id=name)

        async def calendar(run: Run) -> None:
            runs["calendar", run.slot_ms] += 1

        async def odd(run: Run) -> None:
            runs["odd", run.slot_ms] += 1

        scheduler.add_job(calendar, ["*/2 * * * * *", "*/3 * * * * *"], exclude="*/5 * * * * *")
        scheduler.add_job(odd, IntervalSchedule(1000), exclude=EveryThirdSecond())
        scheduler.on_event(
            lambda event: skipped.append(event) if isinstance(event, SlotSkipped) else None
        )
        schedulers.append(scheduler)
    start_ms = (int(time.time()) + 2) * 1000
    end_ms = start_ms + 8000
    seconds = range(start_ms, end_ms, 1000)
    calendar_slots = {s for s in seconds if s // 1000 % 2 == 0 or s // 1000 % 3 == 0}
    calendar_left_out = {s for s in calendar_slots if s // 1000 % 5 == 0}
    odd_left_out = {s for s in seconds if s // 1000 % 3 == 0}
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await wait_until(
            lambda: (
                max((slot for _, slot in runs), default=0) >= end_ms
                and max((e.slot_ms for e in skipped), default=0) >= end_ms
            ),
            30,
            "slots after the eight seconds to run and be left out",
        )
        async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
            for _ in range(100):
                history = {
                    job: {r.slot_ms: r for r in await inspector.history(job, 100)}
                    for job in ("calendar", "odd")
                }
                if calendar_slots <= set(history["calendar"]) and set(seconds) <= set(
                    history["odd"]
                ):
                    break
                await anyio.sleep(0.1)
    assert {s for (job, s), n in runs.items() if job == "calendar" and s in seconds} == (
        calendar_slots - calendar_left_out
    )
    assert {s for (job, s), n in runs.items() if job == "odd" and s in seconds} == (
        set(seconds) - odd_left_out
    )
    assert set(runs.values()) == {1}, "a slot ran twice"
    for slot in calendar_left_out:
        entry = history["calendar"][slot]
        assert entry.status == "skipped", entry
        assert entry.error == "excluded: it matches exclude='*/5 * * * * *'", entry
    for slot in odd_left_out:
        entry = history["odd"][slot]
        assert (entry.status, entry.error) == (
            "skipped", "excluded: EveryThirdSecond.excludes() is true"
        ), entry  # fmt: skip
    told = Counter((e.job, e.slot_ms) for e in skipped if e.reason == "excluded")
    expected = {("calendar", s) for s in calendar_left_out} | {("odd", s) for s in odd_left_out}
    assert {key for key in told if start_ms <= key[1] < end_ms} == expected
    assert all(told[key] == 1 for key in expected), "told by more than one instance"


async def test_the_preview_here_and_from_the_store_leaves_excluded_slots_out(
    server_url: str, prefix: str
) -> None:
    """A weekday report at 09:00 Berlin and a Saturday one at 12:00, with two
    holidays: ``next_fire_times`` here and ``anarchon next`` (from what the instances
    reported) list the same times, none on a holiday; the definition shows the
    exclusion."""
    holidays = [date(2027, 12, 24), date(2027, 12, 25)]
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(
        ["0 9 * * 1-5", "0 12 * * 6"], name="report", timezone="Europe/Berlin", exclude=holidays
    )
    async def report() -> None:
        pass

    here = scheduler.next_fire_times("report", n=10)
    assert len(here) == 10 and here == sorted(here)
    assert all(f.astimezone(CronSchedule("* * * * *", "Europe/Berlin")._zone).date()
               not in holidays for f in here)  # fmt: skip
    async with scheduler, Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        stored = await inspector.next_fire_times("report", n=20)
        (info,) = await inspector.jobs(["report"])
    assert stored[:5] == here[:5] and len(stored) == 10
    assert info.options["exclude"] == "2 dates, 2027-12-24 to 2027-12-25"
    assert info.schedule.startswith("CombinedSchedule(CronSchedule('0 9 * * 1-5'")
    assert info.timezone == "Europe/Berlin"  # its parts' zone: the views show times in it


def test_the_fire_times_of_a_calendar_skip_holidays_and_count_coinciding_slots_once() -> None:
    """Around Christmas 2027 (a Friday and a Saturday) in Berlin: weekdays at 09:00 and
    Mondays at 09:00 too (one slot), Saturdays at 12:00; the 24th and 25th left out."""
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis="redis://localhost:1"))
    scheduler.add_job(
        lambda: None,
        ["0 9 * * 1-5", "0 9 * * 1", "0 12 * * 6"],
        name="report",
        timezone="Europe/Berlin",
        exclude=["2027-12-24", date(2027, 12, 25)],
    )
    job = scheduler._instance.jobs["report"]
    moment = datetime(2027, 12, 22, tzinfo=UTC)
    fires = []
    for _ in range(6):
        fire = job.schedule.next_after(moment)
        assert fire is not None
        moment = fire
        if job.excluded(int(fire.timestamp() * 1000)) is None:
            fires.append(fire.isoformat())
    assert fires == [
        "2027-12-22T08:00:00+00:00", "2027-12-23T08:00:00+00:00",  # Wed, Thu
        "2027-12-27T08:00:00+00:00", "2027-12-28T08:00:00+00:00",  # Mon (once), Tue
    ]  # fmt: skip


def test_a_calendar_object_that_raises_lets_the_slot_run_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        def excludes(self, moment: datetime) -> bool:
            raise LookupError("the holiday service is down")

    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis="redis://localhost:1"))
    scheduler.add_job(lambda: None, "* * * * *", name="x", exclude=Broken())
    job = scheduler._instance.jobs["x"]
    assert [job.excluded(60_000 * n) for n in range(5)] == [None] * 5
    logged = [r for r in caplog.records if "Broken.excludes(" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None, logged


@pytest.mark.parametrize(
    ("schedule", "options", "error", "said"),
    [
        ([], {}, InvalidScheduleError, "list of schedules is empty"),
        (["* * * * *", 5], {}, InvalidScheduleError, "cannot use 5 as a schedule"),
        (["* * * * *"], {"every_ms": 1000}, InvalidScheduleError, "not both"),
        ("* * * * *", {"exclude": []}, InvalidOptionError, "empty collection"),
        ("* * * * *", {"exclude": [datetime(2027, 1, 1)]}, InvalidOptionError, "not datetimes"),
        ("* * * * *", {"exclude": ["25.12.2027"]}, InvalidOptionError, "ISO dates"),
        ("* * * * *", {"exclude": "61 * * * *"}, InvalidOptionError, "exclude: invalid cron"),
        ("* * * * *", {"exclude": 5}, InvalidOptionError, "an object with excludes(datetime)"),
        ("* * * * *", {"exclude": ["2027-01-01"] * 2 + [f"{d}" for d in range(3)]},
         InvalidOptionError, "ISO dates"),
    ],
)  # fmt: skip
def test_a_calendar_that_cannot_be_used_is_refused_with_what_to_give(
    schedule: Any, options: dict[str, Any], error: type[Exception], said: str
) -> None:
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis="redis://localhost:1"))
    with pytest.raises(error, match=said.replace("(", r"\(").replace(")", r"\)")):
        scheduler.add_job(lambda: None, schedule, name="bad", **options)


def test_exclude_is_refused_by_a_claim_only_strategy_and_bounded_in_dates() -> None:
    scheduler: Scheduler[Any] = Scheduler(
        RedisBackend(redis="redis://localhost:1", strategy="stream-id")
    )
    with pytest.raises(InvalidOptionError, match="exclude"):
        scheduler.add_job(lambda: None, "* * * * *", name="x", exclude=["2027-01-01"])  # type: ignore[call-arg]
    lease: Scheduler[Any] = Scheduler(RedisBackend(redis="redis://localhost:1"))
    many = [date.fromordinal(date(2027, 1, 1).toordinal() + n) for n in range(10_001)]
    with pytest.raises(InvalidOptionError, match="more than 10,000 dates"):
        lease.add_job(lambda: None, "* * * * *", name="x", exclude=many)
    assert repr(CombinedSchedule(CronSchedule("0 9 * * *"), IntervalSchedule(60_000))) == (
        "CombinedSchedule(CronSchedule('0 9 * * *', 'UTC'), IntervalSchedule(every_ms=60000))"
    )


@pytest.mark.server_tier
async def test_the_claim_script_records_an_excluded_slot_skipped_with_its_reason_once(
    server_url: str, prefix: str
) -> None:
    """On every server: the first claim of an excluded slot records it skipped with the
    reason and answers 'excluded'; a second (even one that does not say it is excluded)
    finds it settled; a manual run is never excluded."""
    backend = RedisBackend(redis=server_url, prefix=prefix)
    store = await backend.open({"runner": "a", "history_size": 100, "history_ttl_ms": None})
    base = (int(time.time() * 1000) // 1000) * 1000

    def claim(slot: str, slot_ms: int, excluded: str | None) -> ClaimRequest:
        return ClaimRequest(
            "cal", slot, slot_ms, f"t{slot}", "schedule", 30_000, 3, False, 600_000,
            excluded=excluded,
        )  # fmt: skip

    try:
        first, again = await store.claim_many(
            [claim(str(base), base, "excluded: a holiday"), claim(str(base), base, None)]
        )
        assert not isinstance(first, Exception) and not isinstance(again, Exception)
        assert (first.kind, first.status) == ("done", "excluded")
        assert (again.kind, again.status) == ("done", "skipped")
        (manual,) = await store.claim_many([claim(f"m{base}", base, "excluded: a holiday")])
        assert not isinstance(manual, Exception) and manual.kind == "won"
        history = {(r.trigger, r.slot_ms): r for r in await store.history("cal", 10)}
        assert ("manual", base) not in history or history["manual", base].status != "skipped"
        assert (history["schedule", base].status, history["schedule", base].error) == (
            "skipped", "excluded: a holiday"
        )  # fmt: skip
    finally:
        await store.conn.aclose()
