"""Every key anarchon keeps in the store, and the hint channel with its messages: the one
place that names them. A prefix's keys are its own: a prefix ends with ':' and names
hold none, so a key's prefix is all up to its last ':' before the name, and nested
prefixes (``billing:``, ``billing:eu:``) never share a key (``tests/test_key_names.py``
tries the pairs). Each job's, timer kind's (or bucket's) and the registry's keys share
one hash tag, so that each script runs on one cluster node.

- ``<prefix>format``: the store format (``backend.py`` checks it at every start);
- lease strategy, a job's
  ``{<prefix><job>}:state|active|slots|runs|results|permits|backfill``
  (``JobKeys``; ``permits`` only for a job with ``max_concurrent_fleet``, ``backfill``
  only for a job backfilled);
- claim-only strategies, a job's ``<prefix><job>:runs|manual|results``
  (``ClaimOnlyKeys``: one key per command, no tag);
- timers, a kind's ``{<prefix><kind>[#<bucket>]}:timers|timer-due|timer-meta``, its
  firings' ``timer-progress``, its fleet limits' ``timer-permits|timer-starts|timer-groups``,
  a key group's
  ``timer-group-permits:<group>|timer-group-waiting:<group>`` and
  ``{<prefix><kind>}:timer-buckets`` (``TimerKeys``);
- the registry, ``{<prefix>}:instances|jobs|first-seen|timer-kinds|instance:<id>``,
  the report of malformed entries, ``{<prefix>}:quarantine``, the audit log
  ``{<prefix>}:audit``, the jobs with a backfill, ``{<prefix>}:backfills``, and the
  fingerprints of each job's definitions, ``{<prefix>}:definitions`` (``RegistryKeys``);
- the hint channel ``<prefix>timer-hints`` (named when it carried timers alone; it
  carries every hint, see ``Hint``).
"""

from __future__ import annotations

import functools
import re
import zlib
from dataclasses import dataclass

__all__ = [
    "BackfillAsked",
    "ClaimOnlyKeys",
    "Hint",
    "JobKeys",
    "RegistryKeys",
    "RunGivenBack",
    "RunRequested",
    "TimerDue",
    "TimerKeys",
    "bucket_of",
    "bucket_tag",
    "format_key",
    "glob_literal",
    "hint_channel",
    "key_slot",
    "kind_keys",
    "parse_hint",
]


_GLOB = re.compile(r"([*?\[\]\\])")


def glob_literal(text: str) -> str:
    """``text`` as a glob pattern (an ACL rule's, ``SCAN``'s ``MATCH``) matches it: its
    glob characters escaped."""
    return _GLOB.sub(r"\\\1", text)


def format_key(prefix: str) -> str:
    """Where the store format of a prefix is kept."""
    return f"{prefix}format"


# ------------------------------------------------------------------------ jobs


@dataclass(frozen=True, slots=True)
class JobKeys:
    """The keys of a job; the hash tag keeps them on one cluster node."""

    state: str
    active: str
    slots: str
    runs: str
    results: str
    #: The fleet permits of its runs (``max_concurrent_fleet``; lua/lease_state.lua).
    permits: str
    #: Its backfill in progress, or the last one (``backfill.py``; lua/backfill.lua).
    backfill: str

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def for_job(prefix: str, job: str) -> JobKeys:
        """The keys of ``job`` (kept for the most recent jobs asked for: every claim,
        heartbeat and finish names them)."""
        tag = "{" + prefix + job + "}"
        return JobKeys(
            state=f"{tag}:state",
            active=f"{tag}:active",
            slots=f"{tag}:slots",
            runs=f"{tag}:runs",
            results=f"{tag}:results",
            permits=f"{tag}:permits",
            backfill=f"{tag}:backfill",
        )


@dataclass(frozen=True, slots=True)
class ClaimOnlyKeys:
    """The three keys of a job under a claim-only strategy."""

    runs: str
    manual: str
    results: str

    @classmethod
    def for_job(cls, prefix: str, job: str) -> ClaimOnlyKeys:
        base = f"{prefix}{job}"
        return cls(runs=f"{base}:runs", manual=f"{base}:manual", results=f"{base}:results")


# ---------------------------------------------------------------------- timers


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
    #: The fleet permits of its firings in flight (``max_concurrent_fleet``).
    permits: str
    #: The firings started within its rate limit's period (``rate_limit``).
    starts: str
    #: Its key groups with timers waiting for a permit (``max_concurrent_per_group``).
    groups: str
    #: What its firings in flight kept (``TimerRun.save_progress``), by key.
    progress: str

    def group_permits(self, group: str) -> str:
        """The fleet permits of one key group's firings (``max_concurrent_per_group``)."""
        return f"{self.tag}:timer-group-permits:{group}"

    def group_waiting(self, group: str) -> str:
        """One key group's due timers waiting for a permit of the group."""
        return f"{self.tag}:timer-group-waiting:{group}"

    @staticmethod
    def for_kind(prefix: str, kind: str, bucket: int = 0, buckets: int = 1) -> TimerKeys:
        return kind_keys(prefix, kind, buckets)[bucket]

    @staticmethod
    def buckets_key(prefix: str, kind: str) -> str:
        """Where the number of buckets of a kind is kept (its instances write it at
        start; a process that only sets timers reads it)."""
        return "{" + prefix + kind + "}:timer-buckets"

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
        keys.append(
            TimerKeys(
                tag,
                f"{tag}:timers",
                f"{tag}:timer-due",
                f"{tag}:timer-meta",
                f"{tag}:timer-permits",
                f"{tag}:timer-starts",
                f"{tag}:timer-groups",
                f"{tag}:timer-progress",
            )
        )
    return tuple(keys)


# -------------------------------------------------------------------- registry


@dataclass(frozen=True, slots=True)
class RegistryKeys:
    instances: str
    jobs: str
    first_seen: str
    timer_kinds: str
    #: The malformed entries instances met (``quarantine.py``): a sorted set, bounded.
    quarantine: str
    #: What operators did to the jobs, who and why (``audit.py``): a stream, bounded.
    audit: str
    #: The jobs with a backfill in progress (``backfill.py``): a set the instances read.
    backfills: str
    #: Each job's fingerprints the live instances registered, with when each first
    #: appeared (``lua/registry.lua``): which definition is in force.
    definitions: str
    tag: str

    @classmethod
    def for_prefix(cls, prefix: str) -> RegistryKeys:
        tag = "{" + prefix + "}"
        return cls(
            instances=f"{tag}:instances",
            jobs=f"{tag}:jobs",
            first_seen=f"{tag}:first-seen",
            timer_kinds=f"{tag}:timer-kinds",
            quarantine=f"{tag}:quarantine",
            audit=f"{tag}:audit",
            backfills=f"{tag}:backfills",
            definitions=f"{tag}:definitions",
            tag=tag,
        )

    def instance(self, instance_id: str) -> str:
        return f"{self.tag}:instance:{instance_id}"


# ----------------------------------------------------------------------- hints


def hint_channel(prefix: str) -> str:
    """The channel of a prefix's hints (``Hint``): published by scripts and instances,
    heard by the instances that subscribe (``_engine/hints.py``)."""
    return prefix + "timer-hints"


@dataclass(frozen=True, slots=True)
class TimerDue:
    """``<due_ms> <due key>``: a set made its key the first of its kind (bucket) to fall
    due (published by ``lua/timer_set.lua``)."""

    due_ms: int
    due_key: str


@dataclass(frozen=True, slots=True)
class RunGivenBack:
    """``release <slot id> <job>``: a stopping instance gave a run back, with attempts
    left; a backup of the slot may claim it now."""

    slot_id: str
    job: str

    def message(self) -> str:
        return f"release {self.slot_id} {self.job}"


@dataclass(frozen=True, slots=True)
class RunRequested:
    """``run <slot id> <job>``: the fleet was asked to run the job now; every instance that
    runs it claims that manual slot, and one wins it."""

    slot_id: str
    job: str

    def message(self) -> str:
        return f"run {self.slot_id} {self.job}"


@dataclass(frozen=True, slots=True)
class BackfillAsked:
    """``backfill <job>``: a backfill of the job was asked for; an instance that runs it
    takes the turn to drive it now (without hints, at its next registration renewal)."""

    job: str

    def message(self) -> str:
        return f"backfill {self.job}"


Hint = TimerDue | RunGivenBack | RunRequested | BackfillAsked


#: A hint's due time: decimal digits (ASCII: ``str.isdigit`` also takes ``²``).
_DUE_MS = re.compile(r"[0-9]{1,16}")


def parse_hint(message: str) -> Hint | None:
    """A hint as published, or None for a message that is none of them (anyone the ACL
    lets publish on the channel can send anything: a message is read strictly, and its
    slot id checked where it is acted on)."""
    head, _, rest = message.partition(" ")
    if head == "backfill":
        return BackfillAsked(rest) if rest else None
    if head in ("release", "run"):
        slot_id, _, job = rest.partition(" ")
        if not slot_id or not job:
            return None  # (the listener checks the slot id: contract.is_slot_id)
        return RunGivenBack(slot_id, job) if head == "release" else RunRequested(slot_id, job)
    if _DUE_MS.fullmatch(head) and rest:
        return TimerDue(int(head), rest)
    return None
