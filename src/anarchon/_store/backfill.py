"""Backfills: a job's past slots in a range, run once across the fleet, oldest first.

A backfill is a record beside the job's state (``{<prefix><job>}:backfill``, a hash:
``lua/backfill.lua`` says its fields), and the job's name in the prefix's set of jobs
with a backfill (``{<prefix>}:backfills``), which the instances read every few seconds.
One instance that runs the job at a time drives it (a turn that lasts a lease and is
renewed as it goes, so that another takes over when it dies): it claims each slot of
the job's schedule in the range with trigger ``"backfill"``, as any claim of the slot,
so a slot already settled is not run again and one under way is waited for. The
record counts what was decided, and the cursor says where it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._errors import RunOverlapError
from .._model.schedule import iso_ms
from .._model.text import visible
from .._model.values import BackfillInfo
from ..clients import Connection, ServerReplyError
from .coalesce import pipeline
from .keys import JobKeys, RegistryKeys
from .quarantine import MalformedEntry, quarantine_malformed, quarantine_of, whole
from .records import decode_backfill
from .scripts import ScriptCall, lease_script, run_scripts

__all__ = [
    "BACKFILLS_READ_MAX",
    "BACKFILL_KEEP_MS",
    "BACKFILL_SLOTS_MAX",
    "Turn",
    "advance_backfill",
    "backfilling",
    "cancel_backfill",
    "forget_ended",
    "backfill_command",
    "backfill_of",
    "settled_before",
    "start_backfill",
    "take_turn",
]

#: The most slots one backfill may hold.
BACKFILL_SLOTS_MAX = 10_000
#: How long an ended backfill stays readable (``anarchon inspect``, the dashboard).
BACKFILL_KEEP_MS = 7 * 24 * 3600 * 1000
#: How many names of the set of jobs with a backfill one read looks at (a set another
#: client filled costs no more than this; a sample, so each is found in time).
BACKFILLS_READ_MAX = 100


def _call(prefix: str, job: str, *args: str | int) -> ScriptCall:
    keys = JobKeys.for_job(prefix, job)
    return ScriptCall(lease_script("backfill"), (keys.backfill, keys.state), args)


async def _run(conn: Connection, prefix: str, job: str, *args: str | int) -> list[Any]:
    (reply,) = await run_scripts(conn, [_call(prefix, job, *args)])
    if isinstance(reply, ServerReplyError):
        raise reply
    quarantine_malformed(reply[-1], prefix, f"the backfill of {visible(job, 80)!r}")
    return [_text(part) if isinstance(part, bytes) else part for part in reply]


async def start_backfill(
    conn: Connection,
    prefix: str,
    job: str,
    start_ms: int,
    end_ms: int,
    slots: int | None,
    by: str,
    note: str | None,
) -> None:
    """Store a backfill of ``job`` over ``[start_ms, end_ms)`` (``slots``: how many it
    holds, None when only an instance can count them), and name the job in the set the
    instances read. ``RunOverlapError`` when one is running already."""
    reply = await _run(
        conn, prefix, job, "start", start_ms, end_ms, "" if slots is None else slots, by,
        note or "", BACKFILL_KEEP_MS,
    )  # fmt: skip
    if reply[0] == "malformed":
        raise RunOverlapError(
            f"the backfill record of '{visible(job, 80)}' in the store is malformed (see "
            f"'anarchon inspect'): delete {JobKeys.for_job(prefix, job).backfill!r}, then ask "
            "again"
        )
    if reply[0] == "busy":
        total = f" of {reply[2]}" if reply[2] else ""
        raise RunOverlapError(
            f"a backfill of '{visible(job, 80)}' is running ({reply[3]}{total} slots decided, "
            f"next {iso_ms(int(reply[1]))}): cancel it first (anarchon backfill --cancel), or "
            "wait for it to end"
        )
    await conn.execute(("SADD", RegistryKeys.for_prefix(prefix).backfills, job))


async def cancel_backfill(conn: Connection, prefix: str, job: str, reason: str) -> bool:
    """Cancel ``job``'s running backfill (its slot under way, if any, runs to its end):
    whether one was running."""
    reply = await _run(conn, prefix, job, "cancel", reason, BACKFILL_KEEP_MS)
    return int(reply[0]) == 1


@dataclass(frozen=True, slots=True)
class Turn:
    """A turn to drive a backfill: its range, where it is, and whether the job is paused
    (the backfill waits while it is)."""

    start_ms: int
    end_ms: int
    next_ms: int
    slots: int | None
    paused: bool


async def take_turn(
    conn: Connection, prefix: str, job: str, instance: str, lease_ms: int
) -> Turn | str:
    """Take (or keep, for ``lease_ms`` more) the turn to drive ``job``'s backfill; or
    why not: ``"none"`` (no record), ``"over"`` (it ended, or does not read), ``"held"``
    (another instance's turn is live)."""
    reply = await _run(conn, prefix, job, "drive", instance, lease_ms)
    if reply[0] != "driving":
        return str(reply[0])
    slots = whole(str(reply[4])) if reply[4] else None
    return Turn(int(reply[1]), int(reply[2]), int(reply[3]), slots, int(reply[5]) == 1)


async def advance_backfill(
    conn: Connection,
    prefix: str,
    job: str,
    instance: str,
    lease_ms: int,
    *,
    next_ms: int,
    outcome: str = "",
    slots: int | None = None,
    end: str = "",
) -> bool:
    """One slot decided (``outcome``: ok, failed, before, skipped; "" for none) and the
    cursor at ``next_ms``; ``end``: "done", or why anarchon stops it. False when the
    turn was no longer this instance's (the caller stops driving)."""
    reply = await _run(
        conn, prefix, job, "advance", instance, lease_ms, next_ms, outcome,
        "" if slots is None else slots, end, BACKFILL_KEEP_MS,
    )  # fmt: skip
    if reply[0] == "ok" and end:
        await conn.execute(("SREM", RegistryKeys.for_prefix(prefix).backfills, job))
    return bool(reply[0] == "ok")


async def backfilling(conn: Connection, prefix: str) -> list[str]:
    """Names of jobs with a backfill (a sample of at most ``BACKFILLS_READ_MAX``)."""
    reply = await conn.execute(
        ("SRANDMEMBER", RegistryKeys.for_prefix(prefix).backfills, BACKFILLS_READ_MAX)
    )
    return [_text(name) for name in reply or []]


async def forget_ended(conn: Connection, prefix: str, job: str) -> None:
    """Take ``job`` out of the set of jobs with a backfill (its record ended, or went)."""
    await conn.execute(("SREM", RegistryKeys.for_prefix(prefix).backfills, job))


async def settled_before(conn: Connection, prefix: str, job: str, slot_ms: int) -> bool:
    """Whether a scheduled slot was decided before although the job's state no longer
    holds it (forgotten after its keep time): its history still has an entry for it."""
    keys = JobKeys.for_job(prefix, job)
    state, members = await pipeline(
        conn,
        [
            ("HEXISTS", keys.state, str(slot_ms)),
            ("ZRANGEBYSCORE", keys.results, slot_ms, slot_ms, "LIMIT", 0, 8),
        ],
    )
    if isinstance(state, ServerReplyError) or int(state) == 1:
        return False  # the claim reads the state itself
    if isinstance(members, ServerReplyError):
        return False
    return any(_text(member).startswith(f"{slot_ms}|") for member in members or [])


#: The fields of a backfill record (``lua/backfill.lua``), read by name.
_FIELDS = (
    "status", "from", "to", "next", "slots", "ok", "failed", "before", "skipped", "by",
    "note", "started", "ended", "driver", "reason",
)  # fmt: skip


def backfill_command(prefix: str, job: str) -> tuple[str, ...]:
    """The command that reads ``job``'s backfill record (``backfill_of`` reads its reply):
    its fields by name, so another client's fields cost nothing to read."""
    return ("HMGET", JobKeys.for_job(prefix, job).backfill, *_FIELDS)


def backfill_of(prefix: str, job: str, reply: Any) -> BackfillInfo | None:
    """``job``'s backfill from the reply of its ``backfill_command``: None for none, or
    for one that does not read (quarantined: logged once, counted, shown)."""
    key = JobKeys.for_job(prefix, job).backfill
    try:
        if isinstance(reply, ServerReplyError):
            raise MalformedEntry(key, "", f"not a hash: {reply}")
        fields = {
            name: _text(value)
            for name, value in zip(_FIELDS, reply or [], strict=False)
            if value is not None
        }
        return decode_backfill(key, job, fields) if fields else None
    except MalformedEntry as entry:
        quarantine_of(prefix).add(entry, f"the backfill of {visible(job, 80)!r}")
        return None


def _text(raw: object) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
