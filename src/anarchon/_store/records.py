"""The records the store keeps, read (and, for the claim-only strategies, written) in
one place: a result (``<job>:results`` members), a run's lease state (a field of a lease
job's state hash, written by ``lua/lease_state.lua``) and a key's timer state (a field
of a kind's timers hash, written by ``lua/timer_state.lua``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from .._model.schedule import from_epoch_ms
from .._model.values import RunResult, RunStatus, TimerStatus, Trigger
from ..clients import Command, Connection
from .contract import AttemptEnd, slot_ms_of

__all__ = [
    "LeaseState",
    "TimerState",
    "history_command",
    "parse_history",
    "parse_result",
    "read_history",
    "read_result",
    "result_member",
]

# ------------------------------------------------------------------- results


def result_member(end: AttemptEnd, status: str, runner: str) -> str:
    """A results member as the claim-only stores write it (the lease scripts write the
    same shape, see lua/lease_state.lua)."""
    return "|".join(
        (
            end.slot_id,
            str(end.attempt),
            status,
            str(end.started_ms),
            str(end.finished_ms),
            str(end.fence),
            end.trigger,
            runner,
            end.error or "",
        )
    )


def parse_result(job: str, member: str) -> RunResult:
    """Read one results member:
    ``slot|attempt|status|started_ms|finished_ms|fence|trigger|runner|error``."""
    slot, attempt, status, started_ms, finished_ms, fence, trigger, rest = member.split("|", 7)
    runner, _, error = rest.partition("|")  # runner ids never hold "|"
    slot_ms = slot_ms_of(slot)
    return RunResult(
        job=job,
        slot=from_epoch_ms(slot_ms),
        slot_ms=slot_ms,
        attempt=int(attempt),
        trigger=cast(Trigger, trigger),
        runner=runner,
        status=cast(RunStatus, status),
        started_at=from_epoch_ms(int(started_ms)),
        finished_at=from_epoch_ms(int(finished_ms)),
        error=error or None,
        fence=int(fence),
    )


async def read_history(conn: Connection, results_key: str, job: str, limit: int) -> list[RunResult]:
    """The newest ``limit`` results of a job, newest first."""
    return parse_history(job, await conn.execute(history_command(results_key, limit)))


def history_command(results_key: str, limit: int) -> Command:
    """The read of a job's newest ``limit`` results (``parse_history`` reads its reply)."""
    return ("ZREVRANGE", results_key, 0, limit - 1)


def parse_history(job: str, members: Any) -> list[RunResult]:
    """A job's results from the reply of its ``history_command``, newest first."""
    results = [parse_result(job, str(member)) for member in members]
    results.sort(key=lambda r: (r.slot_ms, r.attempt), reverse=True)
    return results


async def read_result(
    conn: Connection, results_key: str, job: str, slot_id: str, attempt: int
) -> RunResult:
    """The recorded result of one attempt (LookupError if there is none)."""
    score = slot_ms_of(slot_id)
    members = await conn.execute(("ZRANGEBYSCORE", results_key, score, score))
    head = f"{slot_id}|{attempt}|"
    for member in members:
        if str(member).startswith(head):
            return parse_result(job, str(member))
    raise LookupError(f"no result recorded for {job} slot {slot_id} attempt {attempt}")


# --------------------------------------------------------------- lease state


@dataclass(frozen=True, slots=True)
class LeaseState:
    """A run's lease state: ``status|attempt|token|until_ms|fence|trigger|started_ms|runner``.
    ``until_ms`` is the lease's expiry while ``running``, when the next attempt may start
    while ``retry``, and when it settled otherwise."""

    status: str
    attempt: int
    token: str
    until_ms: int
    fence: int
    trigger: Trigger
    started_ms: int
    runner: str

    @classmethod
    def decode(cls, raw: Any) -> LeaseState | None:
        """The state as stored, or None for none (or a field that is no state)."""
        if raw is None:
            return None
        parts = str(raw).split("|", 7)
        if len(parts) != 8:
            return None
        status, attempt, token, until_ms, fence, trigger, started_ms, runner = parts
        return cls(
            status,
            int(attempt),
            token,
            int(until_ms),
            int(fence),
            cast(Trigger, trigger),
            int(started_ms),
            runner,
        )

    @property
    def in_progress(self) -> bool:
        """Running, or waiting for its retry."""
        return self.status in ("running", "retry")


# --------------------------------------------------------------- timer state


_STATUS: dict[str, TimerStatus] = {"p": "pending", "f": "firing", "r": "retry"}


# ------------------------------------------------------------------ payloads


def _int_or_none(text: str) -> int | None:
    return int(text) if text else None


@dataclass(frozen=True, slots=True)
class TimerState:
    """A key's timer as stored (lua/timer_state.lua)."""

    key: str
    gen: int
    #: When the newest generation is due (None: cancelled while a firing was in flight).
    due_ms: int | None
    status: TimerStatus
    attempt: int
    token: str
    until_ms: int
    fence: int
    fire_gen: int
    fire_due_ms: int
    trigger: str
    runner: str
    schedule: str
    payload: str

    @classmethod
    def decode(cls, key: str, raw: str) -> TimerState:
        (
            gen,
            due,
            status,
            attempt,
            token,
            until_ms,
            fence,
            fire_gen,
            fire_due,
            trigger,
            runner,
            schedule,
            payload,
        ) = raw.split("|", 12)
        return cls(
            key,
            int(gen),
            _int_or_none(due),
            _STATUS[status],
            int(attempt),
            token,
            int(until_ms),
            int(fence),
            int(fire_gen),
            int(fire_due),
            trigger,
            runner,
            schedule,
            payload,
        )
