"""The records the store keeps, read (and, for the claim-only strategies, written) in
one place: a result (``<job>:results`` members), a run's lease state (a field of a lease
job's state hash, written by ``lua/lease_state.lua``) and a key's timer state (a field
of a kind's timers hash, written by ``lua/timer_state.lua``).

What the store holds is input: each decoder checks every field as the scripts do
(whole numbers strictly, statuses and triggers from their sets) and raises
``MalformedEntry`` for a record that does not read; the caller quarantines it
(``quarantine.py``) and goes on with the rest."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, cast

from .._errors import InvalidOptionError, InvalidScheduleError
from .._model.options import check_buckets, fleet_bound, key_groups, rate_limit
from .._model.progress import PROGRESS_BYTES_MAX
from .._model.schedule import from_epoch_ms, load_timezone
from .._model.values import (
    AuditEntry,
    BackfillInfo,
    BackfillStatus,
    RunResult,
    RunStatus,
    TimerStatus,
    Trigger,
)
from ..clients import Command, Connection
from .contract import AttemptEnd, is_slot_id, slot_ms_of
from .quarantine import MAX_INSTANT_MS, MalformedEntry, instant_ms, quarantine_of, whole

__all__ = [
    "AUDIT_BY_MAX",
    "AUDIT_NOTE_MAX",
    "InstanceRecord",
    "LeaseState",
    "TimerState",
    "decode_audit",
    "decode_backfill",
    "decode_definition",
    "decode_fingerprints",
    "decode_instant",
    "decode_instance",
    "KindRecord",
    "decode_timer_kind",
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


_RUN_STATUSES = frozenset(("ok", "failed", "interrupted", "cancelled", "skipped"))
_TRIGGERS = frozenset(("schedule", "catch-up", "retry", "takeover", "manual", "backfill"))


def parse_result(job: str, member: str, key: str = "") -> RunResult:
    """Read one results member:
    ``slot|attempt|status|started_ms|finished_ms|fence|trigger|runner|error``
    (``MalformedEntry`` for one that does not read; ``key``: its results key)."""
    parts = member.split("|", 7)
    if len(parts) != 8:
        raise MalformedEntry(key, member, "not a result (9 fields separated by |)")
    slot, attempt, status, started_ms, finished_ms, fence, trigger, rest = parts
    runner, _, error = rest.partition("|")  # runner ids never hold "|"
    numbers = [whole(attempt), instant_ms(started_ms), instant_ms(finished_ms), whole(fence)]
    if not is_slot_id(slot):
        raise MalformedEntry(key, member, "its slot is not a slot id")
    if status not in _RUN_STATUSES or trigger not in _TRIGGERS:
        raise MalformedEntry(key, member, "an unknown status or trigger")
    if None in numbers:
        raise MalformedEntry(
            key,
            member,
            "attempt, started_ms, finished_ms or fence is not a whole number (or an instant)",
        )
    attempt_n, started, finished, fence_n = cast(list[int], numbers)
    slot_ms = slot_ms_of(slot)
    return RunResult(
        job=job,
        slot=from_epoch_ms(slot_ms),
        slot_ms=slot_ms,
        attempt=attempt_n,
        trigger=cast(Trigger, trigger),
        runner=runner,
        status=cast(RunStatus, status),
        started_at=from_epoch_ms(started),
        finished_at=from_epoch_ms(finished),
        error=error or None,
        fence=fence_n,
    )


async def read_history(
    conn: Connection, results_key: str, job: str, limit: int, prefix: str
) -> list[RunResult]:
    """The newest ``limit`` results of a job, newest first (malformed members left out,
    and quarantined)."""
    reply = await conn.execute(history_command(results_key, limit))
    return parse_history(job, reply, results_key, prefix)


def history_command(results_key: str, limit: int) -> Command:
    """The read of a job's newest ``limit`` results (``parse_history`` reads its reply)."""
    return ("ZREVRANGE", results_key, 0, limit - 1)


def parse_history(job: str, members: Any, results_key: str, prefix: str) -> list[RunResult]:
    """A job's results from the reply of its ``history_command``, newest first. A member
    that does not read is left out and quarantined (``quarantine_of(prefix)``)."""
    results = []
    for member in members or ():
        try:
            results.append(parse_result(job, _text(member), results_key))
        except MalformedEntry as malformed:
            quarantine_of(prefix).add(malformed, f"one history entry of {job!r}")
    results.sort(key=lambda r: (r.slot_ms, r.attempt), reverse=True)
    return results


def _text(raw: Any) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


async def read_result(
    conn: Connection, results_key: str, job: str, slot_id: str, attempt: int
) -> RunResult:
    """The recorded result of one attempt (LookupError if there is none that reads)."""
    score = slot_ms_of(slot_id)
    members = await conn.execute(("ZRANGEBYSCORE", results_key, score, score))
    head = f"{slot_id}|{attempt}|"
    for member in members:
        if _text(member).startswith(head):
            return parse_result(job, _text(member), results_key)
    raise LookupError(f"no result recorded for {job} slot {slot_id} attempt {attempt}")


# --------------------------------------------------------------- lease state

_LEASE_STATUSES = frozenset(("running", "retry")) | _RUN_STATUSES


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
    def decode(cls, raw: Any, key: str = "", slot_id: str = "") -> LeaseState | None:
        """The state as stored, or None for none; ``MalformedEntry`` (naming ``key`` and
        ``slot_id``) for a field that holds something else."""
        if raw is None:
            return None
        text = _text(raw)
        parts = text.split("|", 7)
        if len(parts) != 8:
            raise MalformedEntry(key, slot_id, "not a run state (8 fields separated by |)", raw)
        status, attempt, token, until_ms, fence, trigger, started_ms, runner = parts
        if status not in _LEASE_STATUSES or trigger not in _TRIGGERS:
            raise MalformedEntry(key, slot_id, "an unknown status or trigger", raw)
        numbers = [whole(attempt), instant_ms(until_ms), whole(fence), instant_ms(started_ms)]
        if None in numbers:
            raise MalformedEntry(
                key,
                slot_id,
                "attempt, until_ms, fence or started_ms is not a whole number (or an instant)",
                raw,
            )
        attempt_n, until, fence_n, started = cast(list[int], numbers)
        return cls(
            status, attempt_n, token, until, fence_n, cast(Trigger, trigger), started, runner
        )

    @property
    def in_progress(self) -> bool:
        """Running, or waiting for its retry."""
        return self.status in ("running", "retry")


# --------------------------------------------------------------- timer state


_STATUS: dict[str, TimerStatus] = {"p": "pending", "f": "firing", "r": "retry"}


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
    def decode(cls, key: str, raw: str, timers_key: str = "") -> TimerState:
        """``MalformedEntry`` (naming ``timers_key`` and ``key``) for a field that is no
        timer state."""
        parts = raw.split("|", 12)
        if len(parts) != 13:
            raise MalformedEntry(timers_key, key, "not a timer (13 fields separated by |)", raw)
        (gen, due, status, attempt, token, until_ms, fence, fire_gen, fire_due, trigger) = parts[
            :10
        ]
        runner, schedule, payload = parts[10:]
        numbers = [
            whole(gen),
            whole(attempt),
            instant_ms(until_ms),
            whole(fence),
            whole(fire_gen),
            instant_ms(fire_due),
        ]
        due_ms = instant_ms(due) if due else None
        # As lua/timer_state.lua reads it: a pending timer has a due time.
        wrong_due = (due and due_ms is None) or (status == "p" and due_ms is None)
        if None in numbers or wrong_due or status not in _STATUS:
            raise MalformedEntry(
                timers_key, key, "an unknown status, or a number that is not a whole number", raw
            )
        gen_n, attempt_n, until, fence_n, fire_gen_n, fire_due_n = cast(list[int], numbers)
        return cls(
            key,
            gen_n,
            due_ms,
            _STATUS[status],
            attempt_n,
            token,
            until,
            fence_n,
            fire_gen_n,
            fire_due_n,
            trigger,
            runner,
            schedule,
            payload,
        )


# ---- registry records (read side)

#: The strategies a job's definition may name (``backend.parse_strategy``'s names).
_STRATEGIES = frozenset(("lease", "stream-id", "idmp", "script"))
_JSON = json.JSONDecoder()


#: The longest note and name of who acted that an audit entry holds.
AUDIT_NOTE_MAX = 500
AUDIT_BY_MAX = 200
_AUDIT_ACTIONS = frozenset(("pause", "resume", "run-now", "forget", "backfill", "cancel-backfill"))
_JOB_NAME_MAX = 200


def decode_audit(key: str, raw: Any) -> AuditEntry:
    """An audit log entry (``audit.py``: a stream entry, ``[id, [field, value, ...]]``):
    its id's milliseconds, ``action`` one of anarchon's, ``job`` and ``by`` short text,
    ``note`` text or absent. ``MalformedEntry`` for one that is not such an entry."""
    try:
        entry_id, pairs = raw
        entry_id = _text(entry_id)
        if isinstance(pairs, dict):
            fields = {_text(k): _text(v) for k, v in pairs.items()}
        else:
            items = [_text(item) for item in pairs]
            fields = dict(zip(items[::2], items[1::2], strict=True))
    except (TypeError, ValueError):
        raise MalformedEntry(key, "", "not a stream entry of fields", raw) from None
    ms, _, _ = entry_id.partition("-")
    at = int(ms) if ms.isdigit() and len(ms) < 16 else None
    action, job, by, note = (fields.get(f) for f in ("action", "job", "by", "note"))
    if at is None or at > MAX_INSTANT_MS:
        raise MalformedEntry(key, entry_id, "its id is not an instant", raw)
    if action not in _AUDIT_ACTIONS:
        raise MalformedEntry(key, entry_id, f"an unknown action {action!r}", raw)
    if not job or len(job) > _JOB_NAME_MAX or not by or len(by) > AUDIT_BY_MAX:
        raise MalformedEntry(key, entry_id, "no job or no one who acted, or too long", raw)
    if note is not None and len(note) > AUDIT_NOTE_MAX:
        raise MalformedEntry(key, entry_id, "a note longer than any anarchon writes", raw)
    return AuditEntry(at=from_epoch_ms(at), action=action, job=job, by=by, note=note)


_BACKFILL_STATUSES = frozenset(("running", "done", "cancelled", "stopped"))
_BACKFILL_COUNTS = ("ok", "failed", "before", "skipped")
#: The longest reason a backfill record holds (who cancelled it and why, or anarchon's).
BACKFILL_REASON_MAX = AUDIT_BY_MAX + AUDIT_NOTE_MAX + 100


def decode_backfill(key: str, job: str, fields: dict[str, str]) -> BackfillInfo:
    """A job's backfill record (``lua/backfill.lua``: the ``key`` hash's fields), or
    ``MalformedEntry`` for one that is not such a record: its status one of four, its
    range, cursor and times instants, its counts whole numbers, its text bounded."""

    def instant(field: str) -> int:
        raw = fields.get(field)
        number = whole(raw) if raw is not None else None
        if number is None or number > MAX_INSTANT_MS:
            raise MalformedEntry(key, field, "not an instant in epoch ms", raw)
        return number

    status = fields.get("status")
    if status not in _BACKFILL_STATUSES:
        raise MalformedEntry(key, "status", "not a backfill status", status)
    counts = {}
    for field in _BACKFILL_COUNTS:
        number = whole(fields.get(field, "0"))
        if number is None:
            raise MalformedEntry(key, field, "not a whole number", fields.get(field))
        counts[field] = number
    slots_text = fields.get("slots", "")
    slots = whole(slots_text) if slots_text else None
    if slots_text and slots is None:
        raise MalformedEntry(key, "slots", "not a whole number", slots_text)
    by, note, reason = fields.get("by", ""), fields.get("note") or None, fields.get("reason")
    driver = fields.get("driver") or None
    if not by or len(by) > AUDIT_BY_MAX or (note is not None and len(note) > AUDIT_NOTE_MAX):
        raise MalformedEntry(key, "by", "no one who asked, or a note too long", by)
    if reason is not None and len(reason) > BACKFILL_REASON_MAX:
        raise MalformedEntry(key, "reason", "longer than any anarchon writes", reason)
    if driver is not None and len(driver) > _JOB_NAME_MAX:
        raise MalformedEntry(key, "driver", "longer than any instance id", driver)
    start, end, cursor, started = (instant(f) for f in ("from", "to", "next", "started"))
    ended = instant("ended") if "ended" in fields else None
    return BackfillInfo(
        job=job,
        start=from_epoch_ms(start),
        end=from_epoch_ms(end),
        status=cast(BackfillStatus, status),
        slots=slots,
        next=from_epoch_ms(cursor),
        ran_ok=counts["ok"],
        ran_failed=counts["failed"],
        settled_before=counts["before"],
        skipped=counts["skipped"],
        by=by,
        note=note,
        started_at=from_epoch_ms(started),
        ended_at=None if ended is None else from_epoch_ms(ended),
        driver=driver if status == "running" else None,
        reason=reason,
    )


_FINGERPRINT = re.compile(r"([0-9a-f]{16}):([0-9]{1,16}):([0-9]{1,16})")


def decode_fingerprints(key: str, job: str, raw: Any, now_ms: int) -> tuple[str, ...]:
    """The fingerprints of a job's definitions that live registrations hold
    (``lua/registry.lua``: ``fp:first_ms:until_ms`` each, ``,`` between), the one in
    force (the newest) first; ``MalformedEntry`` for an entry that is none of them."""
    live = []
    for part in _text(raw).split(",")[:64]:
        found = _FINGERPRINT.fullmatch(part)
        if found is None:
            raise MalformedEntry(key, job, "not a list of fingerprints", raw)
        fp, first, until = found.group(1), int(found.group(2)), int(found.group(3))
        if until > now_ms:
            live.append((first, fp))
    return tuple(fp for _, fp in sorted(live, reverse=True))


#: The most next fire times a stored definition may hold (instances report 10).
_REPORTED_FIRES_MAX = 100


def decode_definition(key: str, name: str, raw: Any) -> dict[str, Any]:
    """A job's definition as the registry keeps it (``registry.job_definition``, JSON in
    the ``key`` hash's field ``name``), with the fields the views read checked:
    ``schedule`` text, ``cron`` text or null, ``every_ms`` a whole number above 0 or
    null, ``timezone`` a zone this machine knows, ``strategy`` one of anarchon's,
    ``next_slot_ms`` an instant or null, ``next_fires_ms`` a short list of instants or
    absent, ``exclude`` text or absent; the other options as stored.
    ``MalformedEntry`` for one that is not such a definition."""
    definition = _json_object(key, name, raw)

    def wrong(problem: str) -> MalformedEntry:
        return MalformedEntry(key, name, problem, raw)

    for field in ("schedule", "cron"):
        if definition.get(field) is not None and not isinstance(definition[field], str):
            raise wrong(f"{field} is not text")
    every_ms = definition.get("every_ms")
    if every_ms is not None and not (_number(every_ms) or 0) > 0:
        raise wrong(f"every_ms is {every_ms!r}, not a whole number above 0")
    next_slot_ms = definition.get("next_slot_ms")
    if next_slot_ms is not None and not _instant(next_slot_ms):
        raise wrong(f"next_slot_ms is {next_slot_ms!r}, not an instant in epoch ms")
    next_fires = definition.get("next_fires_ms")
    if next_fires is not None and not (
        isinstance(next_fires, list)
        and len(next_fires) <= _REPORTED_FIRES_MAX
        and all(_instant(fire) for fire in next_fires)
    ):
        raise wrong(f"next_fires_ms is not a list of up to {_REPORTED_FIRES_MAX} instants")
    if definition.get("exclude") is not None and not isinstance(definition["exclude"], str):
        raise wrong("exclude is not text")
    for bound in ("start_at", "end_at"):
        at = definition.get(bound)
        if at is not None and not _instant(at):
            raise wrong(f"{bound} is {at!r}, not an instant in epoch ms")
    max_runs = definition.get("max_runs")
    if max_runs is not None and not (_number(max_runs) or 0) > 0:
        raise wrong(f"max_runs is {max_runs!r}, not a whole number above 0")
    strategy = definition.get("strategy", "lease")
    if not isinstance(strategy, str) or strategy not in _STRATEGIES:
        raise wrong(f"strategy is {strategy!r}, not one of {', '.join(sorted(_STRATEGIES))}")
    timezone = definition.get("timezone")
    if timezone is not None:
        if not isinstance(timezone, str):
            raise wrong(f"timezone is {timezone!r}, not a zone's name")
        try:
            load_timezone(timezone)
        except InvalidScheduleError:
            raise wrong(f"timezone {timezone!r} is no time zone this machine knows") from None
    try:
        fleet_bound(definition.get("max_concurrent_fleet"))
    except InvalidOptionError as exc:
        raise wrong(exc.message) from None
    return definition


def decode_progress(key: str, field: str, raw: Any) -> Any:
    """A slot's progress as an attempt kept it (JSON text in the ``key`` hash's field
    ``field``), decoded; ``MalformedEntry`` for text that is not JSON or is longer than
    any attempt may keep."""
    text = _text(raw)
    if len(text) > PROGRESS_BYTES_MAX:
        raise MalformedEntry(key, field, "a progress longer than an attempt may keep", raw)
    try:
        return json.loads(text)
    except ValueError:
        raise MalformedEntry(key, field, "a progress that is not JSON", raw) from None


@dataclass(frozen=True, slots=True)
class KindRecord:
    """A timer kind as its instances registered it (``registry.Registry``): its number
    of buckets and its fleet limits (None: none)."""

    buckets: int
    max_concurrent_fleet: int | None = None
    rate_limit: tuple[int, int] | None = None
    group_by: str | None = None
    max_concurrent_per_group: int | None = None


def decode_timer_kind(key: str, kind: str, raw: Any) -> KindRecord:
    """A timer kind's registry entry (JSON in the ``key`` hash's field ``kind``): its
    number of buckets, a whole number from 1 to the most a kind may have
    (``check_buckets``), and its fleet limits, each checked as the option is; else
    ``MalformedEntry``: a store read never trusts a count that would make it read a
    million buckets."""
    record = _json_object(key, kind, raw)
    try:
        buckets = check_buckets(record.get("buckets", 1))
        group_by, per_group = key_groups(
            record.get("group_by"), record.get("max_concurrent_per_group"), buckets
        )
        return KindRecord(
            buckets,
            fleet_bound(record.get("max_concurrent_fleet")),
            rate_limit(record.get("rate_limit")),
            group_by,
            per_group,
        )
    except InvalidOptionError as exc:
        raise MalformedEntry(key, kind, exc.message, raw) from None


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    """An instance's registration as the read side shows it (``registry.Registry``
    writes it as JSON). ``cut``: the record was longer than was read, and its fields are
    those that came whole before the cut (a job list cut keeps its first jobs)."""

    host: str
    pid: int
    version: str
    started_ms: int
    strategy: str
    jobs: tuple[str, ...]
    timer_kinds: tuple[str, ...]
    running: int
    cut: bool
    #: Its bound on handlers at once (None: none, or not registered).
    max_concurrent: int | None = None


def decode_instance(key: str, raw: Any, *, cut: bool = False) -> InstanceRecord:
    """An instance's registration (the value of ``key``); ``cut``: ``raw`` is the first
    part of a longer value, read so (what a read of the fleet takes is bounded whatever
    an instance registered). ``MalformedEntry`` for one that is not a registration."""
    record = _object_prefix(key, _text(raw), raw) if cut else _json_object(key, "", raw)

    def wrong(field: str) -> MalformedEntry:
        return MalformedEntry(key, "", f"its {field} is not what anarchon writes", raw)

    texts = {field: record.get(field, "") for field in ("host", "version", "strategy")}
    if not all(isinstance(value, str) for value in texts.values()):
        raise wrong("host, version or strategy")
    numbers = {field: _number(record.get(field, 0)) for field in ("pid", "running", "started_ms")}
    if None in numbers.values() or not _instant(numbers["started_ms"]):
        raise wrong("pid, running or started_ms")
    names = {field: record.get(field, []) for field in ("jobs", "timer_kinds")}
    for field, value in names.items():
        if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
            raise wrong(field)
    bound = record.get("max_concurrent")
    if bound is not None and _number(bound) is None:
        raise wrong("max_concurrent")
    return InstanceRecord(
        host=str(texts["host"]),
        pid=cast(int, numbers["pid"]),
        version=str(texts["version"]),
        started_ms=cast(int, numbers["started_ms"]),
        strategy=str(texts["strategy"] or "lease"),
        jobs=tuple(names["jobs"]),
        timer_kinds=tuple(names["timer_kinds"]),
        running=cast(int, numbers["running"]),
        cut=cut,
        max_concurrent=cast("int | None", bound),
    )


def decode_instant(key: str, field: str, raw: Any) -> int:
    """An instant the registry keeps in epoch ms (a job's first-seen time: text in the
    ``key`` hash's field ``field``), or ``MalformedEntry``."""
    number = whole(_text(raw))
    if number is None or number > MAX_INSTANT_MS:
        raise MalformedEntry(key, field, "not an instant in epoch ms", raw)
    return number


def _number(value: object) -> int | None:
    """A JSON whole number (not text, not a bool) within what a record may hold."""
    return whole(value) if isinstance(value, int) else None


def _instant(value: object) -> bool:
    number = _number(value)
    return number is not None and number <= MAX_INSTANT_MS


def _json_object(key: str, field: str, raw: Any) -> dict[str, Any]:
    try:
        value = json.loads(_text(raw))
    except ValueError:
        raise MalformedEntry(key, field, "not JSON", raw) from None
    if not isinstance(value, dict):
        raise MalformedEntry(key, field, f"a JSON {type(value).__name__}, not an object", raw)
    return value


def _object_prefix(key: str, text: str, raw: Any) -> dict[str, Any]:
    """The members of the JSON object that ``text`` is the first part of: each member
    that came whole, and of a list cut off, its whole elements. A value is taken only
    when what follows shows that it ended (``12`` cut from ``123`` is not taken)."""
    at = _skip(text, 0)
    if not text.startswith("{", at):
        raise MalformedEntry(key, "", "not a JSON object", raw)
    fields: dict[str, Any] = {}
    at += 1
    try:
        while True:
            at = _skip(text, at)
            if text.startswith(",", at):
                at = _skip(text, at + 1)
            if at >= len(text) or text[at] == "}":
                return fields
            name, at = _JSON.raw_decode(text, at)
            at = _skip(text, at)
            if not isinstance(name, str) or not text.startswith(":", at):
                return fields  # cut in a member's name, or no member there
            at = _skip(text, at + 1)
            if text.startswith("[", at):
                items, at, ended = _list_prefix(text, at + 1)
                fields[name] = items
                if not ended:
                    return fields
                continue
            value, at = _JSON.raw_decode(text, at)
            if _skip(text, at) >= len(text):
                return fields  # it may go on beyond the cut
            fields[name] = value
    except ValueError:  # cut inside a name or a value: the members before it stand
        return fields


def _list_prefix(text: str, at: int) -> tuple[list[Any], int, bool]:
    """The whole elements of a JSON list from ``at`` (just after its ``[``), where it
    ends, and whether it ended within ``text``."""
    items: list[Any] = []
    while True:
        at = _skip(text, at)
        if text.startswith("]", at):
            return items, at + 1, True
        if text.startswith(",", at):
            at = _skip(text, at + 1)
        try:
            item, after = _JSON.raw_decode(text, at)
        except ValueError:
            return items, at, False
        if _skip(text, after) >= len(text):
            return items, at, False
        items.append(item)
        at = after


def _skip(text: str, at: int) -> int:
    """Past the JSON white space at ``at``."""
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at
