"""The timers' store: one script per operation (set, cancel, claim, heartbeat, finish),
each one round trip, on the keys of one kind (or one bucket of it). See lua/timer_state.lua
for the state a key holds and lua/timer_*.lua for each decision."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from .._model.progress import PROGRESS_BYTES_MAX
from .._model.schedule import from_epoch_ms
from .._model.timer import Recurrence, TimerKind
from .._model.values import TimerInfo
from ..clients import Command, Connection, ServerReplyError, score_pairs
from .coalesce import pipeline
from .keys import TimerKeys, bucket_of, hint_channel
from .quarantine import (
    MAX_INSTANT_MS,
    MalformedEntry,
    instant_ms,
    quarantine_malformed,
    quarantine_of,
    whole,
)
from .records import TimerState
from .scripts import ScriptCall, run_scripts, timer_script

__all__ = [
    "NO_FLEET_LIMITS",
    "FleetLimits",
    "TimerClaim",
    "TimerCursor",
    "TimerEnd",
    "TimerFinishReply",
    "TimerStore",
    "TimerWin",
    "decode_payload",
    "encode_payload",
    "timer_info",
]

TimerTrigger = Literal["due", "retry", "takeover", "lapsed"]
#: Where a scan of a kind's timers goes on: (bucket, HSCAN cursor).
TimerCursor = tuple[int, int]
#: The fleet limits a claim may say held due timers back.
_LIMITS = ("concurrent", "rate", "group")
TimerOutcome = Literal["ok", "failed", "cancelled", "interrupted"]


def encode_payload(payload: object) -> str:
    """A payload as the store keeps it (replies are read as UTF-8 text):

    - ``None``: empty;
    - ``bytes``: ``u`` and the bytes, when they are UTF-8 text; ``x`` and their base64
      otherwise;
    - anything else: ``j`` and its JSON (``json.dumps``; it must be JSON-able).
    """
    if payload is None:
        return ""
    if isinstance(payload, bytes | bytearray | memoryview):
        raw = bytes(payload)
        try:
            return "u" + raw.decode("utf-8")
        except UnicodeDecodeError:
            return "x" + base64.b64encode(raw).decode("ascii")
    try:
        return "j" + json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"a timer's payload must be bytes or a JSON-able value (dict, list, str, int, "
            f"float, bool, None), not {type(payload).__name__}: {exc}"
        ) from None


def decode_payload(stored: str) -> Any:
    """The payload ``encode_payload`` stored: bytes for bytes, the JSON value otherwise."""
    if not stored:
        return None
    tag, data = stored[0], stored[1:]
    if tag == "u":
        return data.encode("utf-8")
    if tag == "x":
        return base64.b64decode(data)
    return json.loads(data)


# ------------------------------------------------------------------ state and replies


@dataclass(frozen=True, slots=True)
class TimerPeek:
    """What a kind of timer holds, read without changing it (the read side's seam):
    how many keys have a timer, and the first ones to need attention."""

    kind: str
    #: Keys with a timer: pending, firing, or waiting for a retry (every bucket).
    count: int
    #: The first keys to need attention, earliest first, each with when (on the
    #: server's clock): its due time while pending, its lease's expiry while it fires
    #: (``status`` ``firing``: ``attempt``, ``runner``, ``fence``), its retry time.
    first: tuple[tuple[TimerState, int], ...]


@dataclass(frozen=True, slots=True)
class TimerWin:
    """A firing the claimer won: run it (or, ``lapsed``, finish it at once)."""

    key: str
    gen: int
    due_ms: int
    attempt: int
    fence: int
    token: str
    trigger: TimerTrigger
    schedule: str
    payload: str
    lease_left_ms: int
    #: What the firing's last attempt kept (``TimerRun.save_progress``), as the store
    #: holds it (JSON text, read with ``records.decode_progress``); "" for none.
    progress: str = ""


@dataclass(frozen=True, slots=True)
class TimerClaim:
    wins: tuple[TimerWin, ...]
    #: When the earliest key of the kind (bucket) needs attention next; None if none.
    next_ms: int | None
    #: The claim took as many keys as it could: more may be due now.
    more: bool
    #: The server's clock when it claimed (``next_ms`` is on it, not on the caller's).
    server_now_ms: int
    #: One-shot timers whose runners vanished ``max_attempts`` times: forgotten now.
    spent: tuple[str, ...] = ()
    #: The fleet limits (``"concurrent"``, ``"rate"``, ``"group"``) that held due
    #: timers back.
    limited: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FleetLimits:
    """One bucket's share of a timer kind's fleet limits (0: none): at most
    ``concurrent`` firings in flight at once, at most ``rate`` started in any
    ``period_ms``, at most ``group_max`` of one key group (the key's text before
    ``group_by``) at once."""

    concurrent: int = 0
    rate: int = 0
    period_ms: int = 0
    group_by: str = ""
    group_max: int = 0

    @classmethod
    def of(cls, kind: TimerKind) -> FleetLimits:
        return cls(
            kind.fleet_share,
            *kind.rate_share,
            kind.group_by or "",
            kind.max_concurrent_per_group or 0,
        )

    @property
    def held(self) -> bool:
        """Whether its firings hold permits (of the kind's, or of a key group's)."""
        return self.concurrent > 0 or self.group_max > 0

    def group_args(self, keys: TimerKeys) -> tuple[str, int, str]:
        """The scripts' arguments of the key groups: separator, limit, the name of a
        group's permits before the group."""
        return (self.group_by, self.group_max, keys.group_permits(""))


NO_FLEET_LIMITS = FleetLimits()


@dataclass(frozen=True, slots=True)
class TimerEnd:
    """How a firing ended, and the key's next generation (a rearm or a recurrence)."""

    kind: str
    key: str
    token: str
    outcome: TimerOutcome
    max_attempts: int
    retry_delay_ms: int
    next_at_ms: int | None = None
    next_delay_ms: int | None = None
    #: The kind's fleet limits: the firing gives its key group's permit back.
    limits: FleetLimits = NO_FLEET_LIMITS


@dataclass(frozen=True, slots=True)
class TimerFinishReply:
    """``held`` is False when the firing had lost its lease (nothing was written).
    ``status``: retry, pending (the next generation) or done; ``in_ms``: when the retry
    may start, or when the next generation is due."""

    held: bool
    status: str
    in_ms: int = 0


def _win(raw: list[Any], keys: TimerKeys) -> TimerWin:
    """One won firing of a claim's reply; ``MalformedEntry`` if its numbers do not read
    (never a fence that is not a whole number handed to a handler)."""
    key, gen, due_ms, attempt, fence, token, trigger, schedule, payload, left_ms = raw[:10]
    numbers = [whole(_text(gen)), instant_ms(_text(due_ms)), whole(_text(attempt))]
    numbers += [whole(_text(fence)), whole(_text(left_ms))]
    if None in numbers or not numbers[3]:
        raise MalformedEntry(keys.timers, _text(key), "a won firing whose numbers do not read")
    gen_n, due_n, attempt_n, fence_n, left_n = cast(list[int], numbers)
    return TimerWin(
        _text(key),
        gen_n,
        due_n,
        attempt_n,
        fence_n,
        _text(token),
        cast(TimerTrigger, _text(trigger)),
        _text(schedule),
        _text(payload),
        left_n,
        _text(raw[10]) if len(raw) > 10 else "",
    )


def _text(raw: object) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def score_ms(score: object) -> int | None:
    """A sorted set's score as an instant in whole milliseconds; None for one that is no
    instant anarchon writes (``+inf`` or ``-5`` from another client, or past the year
    9999)."""
    try:
        value = float(_text(score))
    except ValueError:
        return None
    return int(value) if 0 <= value <= MAX_INSTANT_MS else None


def _opt(value: int | None) -> str | int:
    return "" if value is None else value


class TimerStore:
    """Runs the timer scripts on one connection."""

    def __init__(self, conn: Connection, *, prefix: str, runner: str = "") -> None:
        self.conn = conn
        self.prefix = prefix
        self.runner = runner
        self.hints = hint_channel(prefix)

    def keys(self, kind: str, key: str, buckets: int = 1) -> TimerKeys:
        return TimerKeys.for_kind(self.prefix, kind, bucket_of(key, buckets), buckets)

    async def agree_buckets(self, kind: str, buckets: int) -> int:
        """Write a kind's number of buckets where the store has none (the first
        instance's number holds), and return the number the store holds. One that is no
        whole number from 1 to 1024 (something else wrote the key) is quarantined, for an
        operator to mend, and ``buckets`` is returned."""
        key = TimerKeys.buckets_key(self.prefix, kind)
        await self.conn.execute(("SET", key, buckets, "NX"))
        stored = await self.conn.execute(("GET", key))
        count = whole(stored)
        if stored is None:
            return buckets
        if count is None or not 1 <= count <= 1024:
            quarantine_of(self.prefix).add(
                MalformedEntry(key, "", "not a number of buckets from 1 to 1024", stored),
                f"timer kind {kind!r}'s check of its buckets",
            )
            return buckets
        return count

    def _set_call(
        self,
        kind: str,
        key: str,
        at_ms: int | None,
        delay_ms: int | None,
        schedule: str,
        payload: str,
        buckets: int,
    ) -> ScriptCall:
        keys = self.keys(kind, key, buckets)
        return ScriptCall(
            timer_script("timer_set"),
            (keys.timers, keys.due, keys.meta, keys.progress),
            (key, _opt(at_ms), _opt(delay_ms), schedule, payload, self.hints),
        )

    async def set_many(
        self,
        kind: str,
        timers: Sequence[tuple[str, int | None, int | None, str, str]],
        buckets: int = 1,
    ) -> list[tuple[int, int, bool] | ServerReplyError]:
        """Set timers in one round trip: each ``(key, at_ms, delay_ms, schedule,
        payload)``; replies ``(generation, due_ms, replaced)`` or the error reply."""
        calls = [self._set_call(kind, *timer, buckets) for timer in timers]
        replies = await run_scripts(self.conn, calls)
        return [
            reply
            if isinstance(reply, ServerReplyError)
            else (int(reply[0]), int(reply[1]), int(reply[2]) == 1)
            for reply in replies
        ]

    async def cancel(self, kind: str, key: str, buckets: int = 1) -> bool:
        keys = self.keys(kind, key, buckets)
        call = ScriptCall(
            timer_script("timer_cancel"), (keys.timers, keys.due, keys.meta, keys.progress), (key,)
        )
        (reply,) = await run_scripts(self.conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        return int(reply[0]) == 1

    async def cancel_many(
        self, kind: str, keys: Sequence[str], buckets: int = 1
    ) -> list[bool | ServerReplyError]:
        """Cancel timers in one round trip; True for each key that had one."""
        calls = []
        for key in keys:
            where = self.keys(kind, key, buckets)
            calls.append(
                ScriptCall(
                    timer_script("timer_cancel"),
                    (where.timers, where.due, where.meta, where.progress),
                    (key,),
                )
            )
        replies = await run_scripts(self.conn, calls)
        return [
            reply if isinstance(reply, ServerReplyError) else int(reply[0]) == 1
            for reply in replies
        ]

    async def scan(
        self, kind: str, buckets: int, at: TimerCursor, count: int, match: str | None = None
    ) -> tuple[list[TimerState], TimerCursor | None]:
        """One step of a scan of a kind's timers (``HSCAN`` of one bucket, from ``at``):
        the timers read (those that do not read are quarantined and left out), and where
        the next step starts (None: every bucket was scanned). A timer may come twice
        across steps, as ``HSCAN`` may return a field twice."""
        bucket, cursor = at
        keys = TimerKeys.for_kind(self.prefix, kind, bucket, buckets)
        command: list[str | int] = ["HSCAN", keys.timers, cursor]
        if match is not None:
            command += ["MATCH", match]
        command += ["COUNT", count]
        reply = await self.conn.execute(tuple(command))
        following = int(_text(reply[0]))
        found = []
        # The fields and values as the client gave them: flat, as pairs, or a map.
        for field, raw in score_pairs(reply[1]):
            state = self._decode(_text(field), raw, keys.timers)
            if state is not None:
                found.append(state)
        if following != 0:
            return found, (bucket, following)
        return found, (bucket + 1, 0) if bucket + 1 < buckets else None

    async def get(self, kind: str, key: str, buckets: int = 1) -> TimerState | None:
        """The key's timer; None if it has none, or a record that does not read (which is
        quarantined: a set replaces it)."""
        timers_key = self.keys(kind, key, buckets).timers
        raw = await self.conn.execute(("HGET", timers_key, key))
        return None if raw is None else self._decode(key, raw, timers_key)

    def _decode(self, key: str, raw: object, timers_key: str) -> TimerState | None:
        try:
            return TimerState.decode(key, _text(raw), timers_key)
        except MalformedEntry as malformed:
            quarantine_of(self.prefix).add(malformed, "that timer")
            return None

    async def peek(self, kind: str, buckets: int = 1, limit: int = 10) -> TimerPeek:
        """How many keys of ``kind`` have a timer, and the first ``limit`` to need
        attention across its buckets: two round trips, whatever the kind holds."""
        every = [TimerKeys.for_kind(self.prefix, kind, b, buckets) for b in range(buckets)]
        commands: list[Command] = []
        for keys in every:
            commands += [("ZCARD", keys.due), ("ZRANGE", keys.due, 0, limit - 1, "WITHSCORES")]
        replies = await pipeline(self.conn, commands)
        for reply in replies:
            if isinstance(reply, ServerReplyError):
                raise reply
        count = sum(int(replies[2 * b]) for b in range(buckets))
        firsts: list[tuple[int, str, TimerKeys]] = []
        for b, keys in enumerate(every):
            for key, score in score_pairs(replies[2 * b + 1]):
                at_ms = score_ms(score)
                if at_ms is None:
                    quarantine_of(self.prefix).add(
                        MalformedEntry(keys.due, _text(key), "a due time that is no time", score),
                        "that timer",
                    )
                else:
                    firsts.append((at_ms, _text(key), keys))
        firsts = sorted(firsts, key=lambda item: item[0])[:limit]
        raws = await pipeline(self.conn, [("HGET", keys.timers, key) for _, key, keys in firsts])
        first = []
        for (at_ms, key, keys), raw in zip(firsts, raws, strict=True):
            if raw is not None and not isinstance(raw, ServerReplyError):
                state = self._decode(key, raw, keys.timers)
                if state is not None:
                    first.append((state, at_ms))
        return TimerPeek(kind, count, tuple(first))

    async def claim(
        self,
        keys: TimerKeys,
        *,
        limit: int,
        lease_ms: int,
        token_base: str,
        max_attempts: int,
        limits: FleetLimits = NO_FLEET_LIMITS,
    ) -> TimerClaim:
        """Take up to ``limit`` due firings of one kind (bucket), within the bucket's
        share of the kind's fleet limits; sent again with the same ``token_base`` after a
        lost reply, it hears of the firings it won then."""
        call = ScriptCall(
            timer_script("timer_claim"),
            (
                keys.timers,
                keys.due,
                keys.meta,
                keys.claimed(token_base),
                keys.permits,
                keys.starts,
                keys.groups,
                keys.progress,
            ),
            (
                limit,
                lease_ms,
                self.runner,
                token_base,
                max_attempts,
                limits.concurrent,
                limits.rate,
                limits.period_ms,
                *limits.group_args(keys),
                keys.group_waiting(""),
            ),
        )
        (reply,) = await run_scripts(self.conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        wins, next_ms, more, server_now_ms, spent, malformed, limited = reply
        quarantine_malformed(malformed, self.prefix, "that timer")
        quarantine = quarantine_of(self.prefix)
        won = []
        for win in wins or []:
            try:
                won.append(_win(win, keys))
            except MalformedEntry as bad_win:
                quarantine.add(bad_win, "that firing")
        return TimerClaim(
            tuple(won),
            score_ms(next_ms) if next_ms not in (None, "", b"") else None,
            int(more) == 1,
            int(server_now_ms),
            tuple(_text(key) for key in spent or []),
            tuple(name for name in map(_text, limited or []) if name in _LIMITS),
        )

    async def save_progress(self, keys: TimerKeys, key: str, token: str, text: str) -> str | None:
        """Keep a firing's progress (lua/timer_save_progress.lua) while ``token`` holds its
        lease: None, or why it was refused (the firing's state: ``retry``, ``expired``)."""
        call = ScriptCall(
            timer_script("timer_save_progress"),
            (keys.timers, keys.progress),
            (key, token, text, PROGRESS_BYTES_MAX),
        )
        (reply,) = await run_scripts(self.conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        return None if int(reply[0]) == 1 else _text(reply[1])

    async def heartbeat_many(
        self, beats: Sequence[tuple[TimerKeys, str, str, FleetLimits]], lease_ms: int
    ) -> list[bool | ServerReplyError]:
        """Extend the leases of firings (``(keys, key, token, limits)``: the bucket's share
        of the kind's fleet limits, whose permits the firing keeps) in one round trip;
        False means that lease is lost."""
        heartbeat = timer_script("timer_heartbeat")
        calls = [
            # A kind with fleet limits keeps its permits; the others send no more than
            # before (heartbeats are hot).
            ScriptCall(
                heartbeat,
                (keys.timers, keys.due, keys.permits),
                (key, token, lease_ms, limits.concurrent, *limits.group_args(keys)),
            )
            if limits.held
            else ScriptCall(heartbeat, (keys.timers, keys.due), (key, token, lease_ms))
            for keys, key, token, limits in beats
        ]
        replies = await run_scripts(self.conn, calls)
        return [
            reply if isinstance(reply, ServerReplyError) else int(reply[0]) == 1
            for reply in replies
        ]

    async def finish(self, end: TimerEnd, keys: TimerKeys) -> TimerFinishReply:
        call = ScriptCall(
            timer_script("timer_finish"),
            (
                keys.timers,
                keys.due,
                keys.meta,
                keys.progress,
                *((keys.permits, keys.groups) if end.limits.held else ()),
            ),
            (
                end.key,
                end.token,
                end.outcome,
                end.max_attempts,
                end.retry_delay_ms,
                _opt(end.next_at_ms),
                _opt(end.next_delay_ms),
                *(end.limits.group_args(keys) if end.limits.held else ()),
            ),
        )
        (reply,) = await run_scripts(self.conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        if reply[0] == "lost":
            return TimerFinishReply(held=False, status=str(reply[1]))
        status = {"r": "retry", "p": "pending"}.get(str(reply[1]), str(reply[1]))
        return TimerFinishReply(held=True, status=status, in_ms=int(reply[2]))


def timer_info(
    store: TimerStore, kind: str, state: TimerState, timers_key: str
) -> TimerInfo | None:
    """A stored timer as the read side shows it; None for one whose recurrence or payload
    does not read (quarantined)."""
    try:
        recurrence = Recurrence.decode(state.schedule)
        payload = decode_payload(state.payload)
    except Exception as exc:
        problem = f"its recurrence or payload does not read ({type(exc).__name__})"
        quarantine_of(store.prefix).add(
            MalformedEntry(timers_key, state.key, problem), "that timer"
        )
        return None
    return TimerInfo(
        kind=kind,
        key=state.key,
        generation=state.gen,
        due=None if state.due_ms is None else from_epoch_ms(state.due_ms),
        due_ms=state.due_ms,
        payload=payload,
        status=state.status,
        attempt=state.attempt,
        recurs=None if recurrence is None else recurrence.describe(),
    )
