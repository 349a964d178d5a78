"""The timers' store: one script per operation (set, cancel, claim, heartbeat, finish),
each one round trip, on the keys of one kind (or one bucket of it). See lua/timer_state.lua
for the state a key holds and lua/timer_*.lua for each decision."""

from __future__ import annotations

import base64
import functools
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from ..clients import Command, Connection, ServerReplyError
from .coalesce import pipeline
from .scripts import ScriptCall, run_scripts, timer_script

__all__ = [
    "TimerClaim",
    "TimerEnd",
    "TimerFinishReply",
    "TimerKeys",
    "TimerState",
    "TimerStore",
    "TimerWin",
    "bucket_of",
    "bucket_tag",
    "kind_keys",
    "key_slot",
    "decode_payload",
    "encode_payload",
]

TimerStatus = Literal["pending", "firing", "retry"]
TimerTrigger = Literal["due", "retry", "takeover", "lapsed"]
TimerOutcome = Literal["ok", "failed", "cancelled", "interrupted"]

_STATUS: dict[str, TimerStatus] = {"p": "pending", "f": "firing", "r": "retry"}


def bucket_of(key: str, buckets: int) -> int:
    """The bucket a key's timer lives in: the same in every process (CRC-32 of the key)."""
    return zlib.crc32(key.encode("utf-8")) % buckets if buckets > 1 else 0


#: A cluster's hash slots.
_SLOTS = 16384


def _crc16_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
        table.append(crc)
    return table


_CRC16 = _crc16_table()


def key_slot(tag: str) -> int:
    """The cluster's hash slot of a hash tag's text: CRC-16 (XMODEM) modulo 16384."""
    crc = 0
    for byte in tag.encode("utf-8"):
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ byte) & 0xFF]
    return crc % _SLOTS


#: Up to this many buckets each bucket's tag is placed in its own part of the slot space
#: (a search of about 2N tags per bucket, made once per kind); above it, parts are too
#: small to be worth it and plain ``#<b>`` tags spread by hashing alone.
_PLACED_BUCKETS_MAX = 64


def bucket_tag(prefix: str, kind: str, bucket: int, buckets: int) -> str:
    """The hash tag of a kind's bucket: ``{<prefix><kind>}`` for a kind of one bucket.
    Up to 64 buckets, ``{<prefix><kind>#<bucket>}``, or ``{<prefix><kind>#<bucket>.<n>}``
    with the smallest ``n`` that puts it in the middle half of the bucket's own equal
    part of the slot space: a cluster whose primaries hold equal slot ranges (as
    ``--cluster create`` makes them) then gets as many of the kind's buckets on each
    primary when the buckets are a multiple of the primaries (3 on 3: one each),
    wherever CRC-16 would have put them. Above 64, ``{<prefix><kind>#<bucket>}``. The
    same in every process: it depends on the names alone."""
    if not 0 <= bucket < buckets:
        raise ValueError(f"bucket {bucket} of {buckets}")
    if buckets == 1:
        return "{" + prefix + kind + "}"
    base = f"{prefix}{kind}#{bucket}"
    if buckets > _PLACED_BUCKETS_MAX:
        return "{" + base + "}"
    part = _SLOTS / buckets
    low, high = bucket * part + part / 4, (bucket + 1) * part - part / 4
    tag, n = base, 0
    while not low <= key_slot(tag) < high:  # a 128-slot range at least: found soon
        n += 1
        tag = f"{base}.{n}"
    return "{" + tag + "}"


@dataclass(frozen=True, slots=True)
class TimerKeys:
    """The keys of one kind of timer (or one bucket of it), under one hash tag. The tag is
    a job's (``{<prefix><kind>}``, with ``#<bucket>`` when the kind is split): a job and a
    timer kind of the same name share a cluster node, never a key."""

    tag: str
    timers: str
    due: str
    meta: str

    @staticmethod
    def for_kind(prefix: str, kind: str, bucket: int = 0, buckets: int = 1) -> TimerKeys:
        return kind_keys(prefix, kind, buckets)[bucket]

    @staticmethod
    def buckets_key(prefix: str, kind: str) -> str:
        """Where the number of buckets of a kind is kept (its instances write it at
        start; a process that only sets timers reads it)."""
        return "{" + prefix + kind + "}:timer-buckets"

    @staticmethod
    def hint_channel(prefix: str) -> str:
        """Where a set that makes a key the first of its kind (bucket) to fall due is
        published (``<due_ms> <due key>``), for instances that would look later."""
        return prefix + "timer-hints"

    def claimed(self, token_base: str) -> str:
        """The set of keys a claim won, kept for a claim sent again after a lost reply."""
        return f"{self.tag}:timer-claimed:{token_base}"


@functools.lru_cache(maxsize=256)
def kind_keys(prefix: str, kind: str, buckets: int = 1) -> tuple[TimerKeys, ...]:
    """The keys of each of a kind's buckets, made once per kind: every set, claim and
    finish asks for them."""
    keys = []
    for bucket in range(buckets):
        tag = bucket_tag(prefix, kind, bucket, buckets)
        keys.append(TimerKeys(tag, f"{tag}:timers", f"{tag}:timer-due", f"{tag}:timer-meta"))
    return tuple(keys)


# ------------------------------------------------------------------ payloads


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
        (gen, due, status, attempt, token, until_ms, fence, fire_gen, fire_due, trigger,
         runner, schedule, payload) = raw.split("|", 12)  # fmt: skip
        return cls(
            key, int(gen), _int_or_none(due), _STATUS[status], int(attempt), token,
            int(until_ms), int(fence), int(fire_gen), int(fire_due), trigger, runner,
            schedule, payload,
        )  # fmt: skip


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


@dataclass(frozen=True, slots=True)
class TimerFinishReply:
    """``held`` is False when the firing had lost its lease (nothing was written).
    ``status``: retry, pending (the next generation) or done; ``in_ms``: when the retry
    may start, or when the next generation is due."""

    held: bool
    status: str
    in_ms: int = 0


def _win(raw: list[Any]) -> TimerWin:
    key, gen, due_ms, attempt, fence, token, trigger, schedule, payload, left_ms = raw
    return TimerWin(
        str(key), int(gen), int(due_ms), int(attempt), int(fence), str(token),
        cast(TimerTrigger, str(trigger)), str(schedule), str(payload), int(left_ms),
    )  # fmt: skip


def _pairs(reply: Any) -> list[tuple[Any, Any]]:
    """``ZRANGE ... WITHSCORES`` as ``(member, score)`` pairs, flat (RESP2) or nested."""
    items = list(reply or [])
    if items and isinstance(items[0], list | tuple):
        return [(item[0], item[1]) for item in items]
    return list(zip(items[::2], items[1::2], strict=True))


def _opt(value: int | None) -> str | int:
    return "" if value is None else value


class TimerStore:
    """Runs the timer scripts on one connection."""

    def __init__(self, conn: Connection, *, prefix: str, runner: str = "") -> None:
        self.conn = conn
        self.prefix = prefix
        self.runner = runner
        self.hints = TimerKeys.hint_channel(prefix)

    def keys(self, kind: str, key: str, buckets: int = 1) -> TimerKeys:
        return TimerKeys.for_kind(self.prefix, kind, bucket_of(key, buckets), buckets)

    def _set_call(
        self, kind: str, key: str, at_ms: int | None, delay_ms: int | None, schedule: str,
        payload: str, buckets: int,
    ) -> ScriptCall:  # fmt: skip
        keys = self.keys(kind, key, buckets)
        return ScriptCall(
            timer_script("timer_set"),
            (keys.timers, keys.due, keys.meta),
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
        call = ScriptCall(timer_script("timer_cancel"), (keys.timers, keys.due, keys.meta), (key,))
        (reply,) = await run_scripts(self.conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        return int(reply[0]) == 1

    async def get(self, kind: str, key: str, buckets: int = 1) -> TimerState | None:
        raw = await self.conn.execute(("HGET", self.keys(kind, key, buckets).timers, key))
        return None if raw is None else TimerState.decode(key, str(raw))

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
            flat = _pairs(replies[2 * b + 1])
            firsts += [(int(float(score)), str(key), keys) for key, score in flat]
        firsts = sorted(firsts, key=lambda item: item[0])[:limit]
        raws = await pipeline(self.conn, [("HGET", keys.timers, key) for _, key, keys in firsts])
        first = tuple(
            (TimerState.decode(key, str(raw)), at_ms)
            for (at_ms, key, _), raw in zip(firsts, raws, strict=True)
            if raw is not None and not isinstance(raw, ServerReplyError)
        )
        return TimerPeek(kind, count, first)

    async def claim(
        self,
        keys: TimerKeys,
        *,
        limit: int,
        lease_ms: int,
        token_base: str,
        max_attempts: int,
    ) -> TimerClaim:
        """Take up to ``limit`` due firings of one kind (bucket); sent again with the same
        ``token_base`` after a lost reply, it hears of the firings it won then."""
        call = ScriptCall(
            timer_script("timer_claim"),
            (keys.timers, keys.due, keys.meta, keys.claimed(token_base)),
            (limit, lease_ms, self.runner, token_base, max_attempts),
        )
        (reply,) = await run_scripts(self.conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        wins, next_ms, more, server_now_ms, spent = reply
        return TimerClaim(
            tuple(_win(win) for win in wins or []),
            int(float(next_ms)) if next_ms not in (None, "") else None,
            int(more) == 1,
            int(server_now_ms),
            tuple(str(key) for key in spent or []),
        )

    async def heartbeat_many(
        self, beats: Sequence[tuple[TimerKeys, str, str]], lease_ms: int
    ) -> list[bool | ServerReplyError]:
        """Extend the leases of firings (``(keys, key, token)``) in one round trip; False
        means that lease is lost."""
        heartbeat = timer_script("timer_heartbeat")
        calls = [
            ScriptCall(heartbeat, (keys.timers, keys.due), (key, token, lease_ms))
            for keys, key, token in beats
        ]
        replies = await run_scripts(self.conn, calls)
        return [
            reply if isinstance(reply, ServerReplyError) else int(reply[0]) == 1
            for reply in replies
        ]

    async def finish(self, end: TimerEnd, keys: TimerKeys) -> TimerFinishReply:
        call = ScriptCall(
            timer_script("timer_finish"),
            (keys.timers, keys.due, keys.meta),
            (
                end.key, end.token, end.outcome, end.max_attempts, end.retry_delay_ms,
                _opt(end.next_at_ms), _opt(end.next_delay_ms),
            ),
        )  # fmt: skip
        (reply,) = await run_scripts(self.conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        if reply[0] == "lost":
            return TimerFinishReply(held=False, status=str(reply[1]))
        status = {"r": "retry", "p": "pending"}.get(str(reply[1]), str(reply[1]))
        return TimerFinishReply(held=True, status=status, in_ms=int(reply[2]))
