"""A ``Run`` or a ``TimerRun`` made by hand, for a unit test of a handler alone."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from .._errors import InvalidOptionError
from .._model.values import Run, TimerRun, TimerTrigger, Trigger

__all__ = ["make_run", "make_timer_run"]


def _instant(at: datetime) -> tuple[datetime, int]:
    if not isinstance(at, datetime) or at.tzinfo is None:
        raise InvalidOptionError(f"give an aware datetime, got {at!r}")
    ms = int(at.timestamp() * 1000)
    return datetime.fromtimestamp(ms / 1000, UTC), ms


def make_run(
    job: str,
    slot: datetime,
    *,
    attempt: int = 1,
    trigger: Trigger = "schedule",
    runner: str = "test",
    fence: int = 1,
    progress: Any = None,
    lease_lost: bool = False,
    saved: list[Any] | None = None,
) -> Run:
    """A ``Run`` of ``job`` for ``slot``, as the scheduler would hand it to the handler::

        saved: list[Any] = []
        run = make_run("export", datetime(2027, 1, 1, 2, tzinfo=UTC), attempt=2,
                       progress=100, saved=saved)
        await export(run)
        assert saved == [200, 300]

    Args:
        job: The job's name.
        slot: The slot's instant (an aware datetime; kept to the millisecond, in UTC).
        attempt: Which attempt (from 1).
        trigger: Why it runs (``Trigger``).
        runner: The instance id it runs on.
        fence: Its fence.
        progress: What an earlier attempt kept (``run.progress``).
        lease_lost: Whether ``run.lease_lost`` is set from the start (set it later with
            ``run.lease_lost.set()``).
        saved: Where ``run.save_progress`` appends what it is given; None: it raises,
            as for a run that keeps no progress.
    """
    at, ms = _instant(slot)
    run = Run(job, at, ms, attempt, trigger, runner, fence, progress=progress)
    if lease_lost:
        run.lease_lost.set()
    if saved is not None:
        run.keep_progress_with(_appender(saved))
    return run


def make_timer_run(
    kind: str,
    key: str,
    due: datetime,
    *,
    payload: Any = None,
    generation: int = 1,
    attempt: int = 1,
    trigger: TimerTrigger = "due",
    runner: str = "test",
    fence: int = 1,
    progress: Any = None,
    lease_lost: bool = False,
    saved: list[Any] | None = None,
) -> TimerRun:
    """A ``TimerRun`` of ``kind``'s timer for ``key``, due at ``due``, as the scheduler
    would hand it to the handler (``fire.rearmed`` tells what the handler asked).

    Args:
        kind: The timer's kind.
        key: The key whose timer fires.
        due: When it was due (an aware datetime; kept to the millisecond, in UTC).
        payload: What ``set_timer`` was given.
        generation: Which setting of the key fires.
        attempt: Which attempt (from 1).
        trigger: Why it fires (``TimerTrigger``).
        runner: The instance id it fires on.
        fence: Its fence.
        progress: What an earlier attempt kept (``fire.progress``).
        lease_lost: Whether ``fire.lease_lost`` is set from the start.
        saved: Where ``fire.save_progress`` appends what it is given; None: it raises.
    """
    at, ms = _instant(due)
    fire = TimerRun(
        kind, key, payload, at, ms, generation, attempt, trigger, runner, fence, progress=progress
    )
    if lease_lost:
        fire.lease_lost.set()
    if saved is not None:
        fire.keep_progress_with(_appender(saved))
    return fire


def _appender(saved: list[Any]) -> Any:
    async def save(value: Any) -> None:
        saved.append(value)

    return save
