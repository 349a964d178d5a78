"""A job's ``exclude=``: the slots of its schedule that do not run. Each is claimed as any
slot is, and the store records it skipped with the reason, once for the fleet."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import date, datetime, timedelta
from typing import Protocol, runtime_checkable

from cronsim import CronSim, CronSimError

from .._errors import InvalidOptionError, InvalidScheduleError
from .schedule import CronSchedule, from_epoch_ms, load_timezone

__all__ = ["Excludes", "Exclusion", "make_exclusion"]

log = logging.getLogger("anarchon")

#: The most dates one ``exclude=`` list holds.
EXCLUDED_DATES_MAX = 10_000
#: The longest reason recorded in a skipped slot's history entry.
_REASON_MAX = 200
_SECOND = timedelta(seconds=1)


@runtime_checkable
class Excludes(Protocol):
    """Anything that says which slots of a job do not run (a holiday calendar): a job's
    ``exclude=`` may be any object with this method."""

    def excludes(self, moment: datetime, /) -> bool:
        """Whether the slot at ``moment`` does not run.

        Args:
            moment: The slot's instant, an aware datetime in the job's time zone.

        Returns:
            True for a slot that does not run (recorded skipped, with the reason).
        """
        ...


class Exclusion:
    """A job's ``exclude=``, checked: a cron expression read in the job's zone (a slot
    whose wall-clock time it matches: to the minute for 5 fields, to the second for 6),
    a collection of dates (a slot on one of them, in the job's zone), or an object with
    ``excludes(datetime)``. Every instance must give the same answer for a slot: the
    first claim of a slot decides for the fleet."""

    __slots__ = ("_cron", "_dates", "_failing", "_object", "_seconds", "_zone", "text")

    def __init__(
        self,
        *,
        cron: CronSchedule | None = None,
        dates: frozenset[date] | None = None,
        custom: Excludes | None = None,
        timezone: str = "UTC",
    ) -> None:
        self._cron = cron
        self._seconds = cron is not None and len(cron.expression.split()) == 6
        self._dates = dates
        self._object = custom
        #: Whether ``custom.excludes()`` raised the last time it was asked.
        self._failing = False
        self._zone = load_timezone(timezone)
        #: What it is, as the registry and the dashboard show it.
        self.text = self._describe()

    def _describe(self) -> str:
        if self._cron is not None:
            return f"cron {self._cron.expression!r}"
        if self._dates is not None:
            days = sorted(self._dates)
            if len(days) == 1:
                return f"1 date: {days[0]}"
            return f"{len(days)} dates, {days[0]} to {days[-1]}"
        return f"{type(self._object).__name__}.excludes()"

    def reason(self, slot_ms: int) -> str | None:
        """Why the slot at ``slot_ms`` does not run (``"excluded: ..."``, as its history
        entry says), or None when it runs. An ``excludes()`` that raises lets the slot
        run (logged)."""
        why = self._why(from_epoch_ms(slot_ms).astimezone(self._zone))
        return None if why is None else f"excluded: {why}"[:_REASON_MAX]

    def _why(self, local: datetime) -> str | None:
        if self._cron is not None:
            wall = local.replace(tzinfo=None, microsecond=0)
            if not self._seconds:
                wall = wall.replace(second=0)
            try:
                matched = next(CronSim(self._cron.expression, wall - _SECOND), None) == wall
            except (CronSimError, ValueError):
                matched = False
            return f"it matches exclude={self._cron.expression!r}" if matched else None
        if self._dates is not None:
            day = local.date()
            return f"{day} is an excluded date" if day in self._dates else None
        assert self._object is not None
        try:
            excluded = bool(self._object.excludes(local))
        except Exception:
            if not self._failing:  # logged once until it answers again
                log.exception(
                    "%s.excludes(%s) raised; the slot is not excluded (and none is, "
                    "while it raises)",
                    type(self._object).__name__,
                    local.isoformat(),
                )
            self._failing = True
            return None
        self._failing = False
        return f"{type(self._object).__name__}.excludes() is true" if excluded else None

    def __repr__(self) -> str:
        return f"Exclusion({self.text})"


def make_exclusion(value: object, timezone: str) -> Exclusion | None:
    """``exclude=`` as given: None, a cron string, dates, or an ``Excludes``."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            cron = CronSchedule(value, timezone)
        except InvalidScheduleError as exc:
            raise InvalidOptionError(f"exclude: {exc.message}") from None
        return Exclusion(cron=cron, timezone=timezone)
    if isinstance(value, Excludes):
        return Exclusion(custom=value, timezone=timezone)
    if isinstance(value, Iterable) and not isinstance(value, bytes | dict):
        days: set[date] = set()
        for item in value:
            days.add(_day(item))
            if len(days) > EXCLUDED_DATES_MAX:
                raise InvalidOptionError(
                    f"exclude holds more than {EXCLUDED_DATES_MAX:,} dates; give a cron "
                    "expression or an object with excludes(datetime) instead"
                )
        if not days:
            raise InvalidOptionError("exclude is an empty collection; drop it, or give dates")
        return Exclusion(dates=frozenset(days), timezone=timezone)
    raise InvalidOptionError(
        "exclude must be a cron expression (such as '* * 25 12 *'), a collection of dates, "
        f"or an object with excludes(datetime) -> bool, got {value!r}"[:400]
    )


def _day(item: object) -> date:
    if isinstance(item, datetime):
        raise InvalidOptionError(
            f"exclude takes dates, not datetimes (got {item!r}): give {item.date()!r}, or a "
            "cron expression to exclude times of day"
        )
    if isinstance(item, date):
        return item
    if isinstance(item, str):
        try:
            return date.fromisoformat(item)
        except ValueError:
            pass
    raise InvalidOptionError(
        f"exclude's dates must be dates or ISO dates such as '2027-12-25', got {item!r}"[:400]
    )
