"""A kind of timer (its name, handler and options) and how a timer recurs, validated at
definition time and when a timer is set."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .._errors import InvalidJobError, InvalidOptionError, InvalidScheduleError
from .job import check_duration_ms, invoke_handler, validate_job_name
from .schedule import CronSchedule, from_epoch_ms, to_epoch_ms
from .values import TimerRun

__all__ = [
    "MAX_KEY_LENGTH",
    "Recurrence",
    "TimerKind",
    "validate_kind",
    "validate_timer_key",
]

#: Keys are fields of a hash: any text, within reason.
MAX_KEY_LENGTH = 1024


def validate_kind(kind: object) -> str:
    """A kind's name goes into key names, as a job's does (and follows the same rules),
    without ``#``, which separates a kind's name from its bucket's number."""
    try:
        name = validate_job_name(kind)
    except InvalidJobError as exc:
        raise InvalidJobError(exc.message.replace("job", "timer kind", 1)) from None
    if "#" in name:
        raise InvalidJobError(
            f"timer kind {name!r} cannot hold '#': it separates a kind from its bucket in "
            "key names; choose another name"
        )
    return name


def validate_timer_key(key: object) -> str:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise InvalidOptionError(
            f"a timer's key must be a non-empty string of at most {MAX_KEY_LENGTH} characters "
            f"(e.g. 'user:42'), got {key!r}"
        )
    return key


@dataclass(frozen=True, slots=True)
class Recurrence:
    """How a recurring timer recurs, stored with the timer as text (``every;<ms>`` or
    ``cron;<timezone>;<expression>``) so that any instance computes its next due time."""

    every_ms: int | None = None
    cron: CronSchedule | None = None

    @classmethod
    def make(cls, cron: str | None, every_ms: int | None, timezone: str) -> Recurrence | None:
        if cron is None and every_ms is None:
            if timezone != "UTC":
                raise InvalidScheduleError("timezone= applies to cron= timers only")
            return None
        if cron is not None and every_ms is not None:
            raise InvalidScheduleError("give a timer either cron= or every_ms=, not both")
        if every_ms is not None:
            if timezone != "UTC":
                raise InvalidScheduleError(
                    "every_ms= timers count from their due time and ignore time zones; drop "
                    "timezone= or use cron="
                )
            return cls(every_ms=check_duration_ms("every_ms", every_ms))
        if not isinstance(cron, str):
            raise InvalidScheduleError(f"cron= must be a cron string, got {cron!r}")
        return cls(cron=CronSchedule(cron, timezone))

    def encode(self) -> str:
        if self.every_ms is not None:
            return f"every;{self.every_ms}"
        assert self.cron is not None
        return f"cron;{self.cron.timezone};{self.cron.expression}"

    @classmethod
    def decode(cls, text: str) -> Recurrence | None:
        if not text:
            return None
        what, _, rest = text.partition(";")
        if what == "every":
            return cls(every_ms=int(rest))
        timezone, _, expression = rest.partition(";")
        return cls(cron=CronSchedule(expression, timezone))

    def describe(self) -> str:
        if self.every_ms is not None:
            return f"every_ms={self.every_ms}"
        assert self.cron is not None
        return f"cron={self.cron.expression!r} timezone={self.cron.timezone!r}"

    def first_ms(self, now_ms: int) -> int:
        """The first due time of a timer set now without at= or delay_ms=."""
        if self.every_ms is not None:
            return now_ms + self.every_ms
        return self.next_ms(now_ms, now_ms)

    def next_ms(self, due_ms: int, now_ms: int) -> int:
        """The due time after a firing of ``due_ms``, at ``now_ms``: the next one after
        both (a timer that fired late, after an outage, fires once and goes on from
        now, rather than once per due time it missed)."""
        if self.every_ms is not None:
            every = self.every_ms
            after = max(due_ms, now_ms)
            return due_ms + ((after - due_ms) // every + 1) * every
        assert self.cron is not None
        fire = next(self.cron.fires_after(from_epoch_ms(max(due_ms, now_ms))), None)
        if fire is None:
            raise InvalidScheduleError(f"{self.describe()} never fires again")
        return to_epoch_ms(fire)


@dataclass(frozen=True, slots=True)
class TimerKind:
    """A kind of timer and its handler: every key's timer of this kind fires through it."""

    name: str
    handler: Any
    max_attempts: int
    retry_delay_ms: int | None
    buckets: int
    takes_run: bool
    is_async: bool
    #: The most of its firings that go on at once on one instance (None: the instance's
    #: bound alone).
    max_concurrent: int | None = None
    #: The most of its firings in flight at once in the whole fleet (None: no limit).
    #: Each bucket holds its share (a multiple of ``buckets``, checked).
    max_concurrent_fleet: int | None = None
    #: At most so many of its firings start in any so many ms across the fleet
    #: (``(count, period_ms)``; None: no limit); each bucket holds its share of the count.
    rate_limit: tuple[int, int] | None = None
    #: What separates a key's group (its text before it) from the rest (None: no key
    #: groups).
    group_by: str | None = None
    #: The most firings of one key group in flight at once in the fleet (None: no limit).
    max_concurrent_per_group: int | None = None

    @property
    def fleet_share(self) -> int:
        """Each bucket's share of ``max_concurrent_fleet`` (0: no limit)."""
        return 0 if self.max_concurrent_fleet is None else self.max_concurrent_fleet // self.buckets

    @property
    def rate_share(self) -> tuple[int, int]:
        """Each bucket's share of ``rate_limit``: ``(count, period_ms)``, ``(0, 0)`` for
        none."""
        if self.rate_limit is None:
            return (0, 0)
        count, period_ms = self.rate_limit
        return (count // self.buckets, period_ms)

    async def invoke(self, fire: TimerRun) -> None:
        await invoke_handler(self.handler, self.takes_run, self.is_async, fire)


def due_from(at: datetime | None, delay_ms: int | None) -> tuple[int | None, int | None]:
    """``set_timer``'s at= or delay_ms=, checked: ``(at_ms, delay_ms)``."""
    if at is not None and delay_ms is not None:
        raise InvalidOptionError("give a timer at= or delay_ms=, not both")
    if at is not None:
        if not isinstance(at, datetime) or at.tzinfo is None:
            raise InvalidOptionError(f"at= needs an aware datetime, got {at!r}")
        return to_epoch_ms(at), None
    if delay_ms is not None:
        return None, check_duration_ms("delay_ms", delay_ms, allow_zero=True)
    return None, None
