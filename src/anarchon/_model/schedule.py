"""Schedules: when a job's slots fall due.

A slot is identified by its instant as Unix epoch milliseconds (UTC), so every
instance derives the same slot ids from the same schedule.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Protocol, runtime_checkable
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from .._errors import InvalidScheduleError

__all__ = ["CronSchedule", "IntervalSchedule", "Schedule", "SlotClock", "load_timezone"]

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
    skipped hour fires once at the first valid instant after it, a time in the
    repeated hour fires once. Jobs with a ``*`` in the minute or hour field keep
    firing by elapsed time through both changes.

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

    __slots__ = ("_zone", "expression", "timezone")

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
                f"invalid cron expression {expression!r}: {exc or 'it never fires'}"
            ) from exc

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
        local = moment.astimezone(self._zone)
        fires = (fire.astimezone(UTC) for fire in CronSim(self.expression, local))
        # Asked during the second pass of a repeated hour, cronsim starts with that
        # hour's fixed times of the first pass, which lie before ``moment``: they
        # fired already (a fixed time fires once in a repeated hour, the first time).
        return (fire for fire in fires if fire > moment)

    def __repr__(self) -> str:
        return f"CronSchedule({self.expression!r}, {self.timezone!r})"


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
        if isinstance(self._schedule, CronSchedule):
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
