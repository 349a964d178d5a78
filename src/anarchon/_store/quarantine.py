"""Entries of the store that anarchon cannot read: each costs only itself.

Another client, a bad migration or a hand edit can leave anything in anarchon's keys.
Every record is decoded in one place (``records.py``, and checked again by the scripts);
one that is malformed raises ``MalformedEntry`` there (or a script reports it), and the
process that met it hands it to its ``Quarantine``:

- logged once (a WARNING naming the key, the field and what was wrong);
- counted (``Quarantine.count``, the metric ``anarchon_store_malformed_entries``);
- kept, the newest ``KEEP``, for the process's own views;
- reported in the store, in the prefix's ``{<prefix>}:quarantine`` (a sorted set scored
  by when it was last met, the newest ``STORED`` kept for ``STORED_MS``), so that
  ``anarchon inspect`` and the dashboard show what any instance met.

The entry itself is left as it is (an operator may want to see it; the scripts skip
it), except where a script must move past it to keep the rest going: a malformed
timer leaves its kind's due index, so that it does not hold the bucket's claims.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .._model.text import visible
from ..clients import Command, Connection, score_pairs
from .keys import RegistryKeys

__all__ = [
    "KEEP",
    "MAX_INSTANT_MS",
    "MAX_WHOLE",
    "STORED",
    "STORED_MS",
    "MalformedEntry",
    "Quarantine",
    "Quarantined",
    "instant_ms",
    "quarantine_malformed",
    "quarantine_of",
    "read_quarantine",
    "whole",
]

log = logging.getLogger("anarchon")

#: How many malformed entries a process keeps for its views (and logs, once each).
KEEP = 1000
#: How many the store's report keeps (the newest), and for how long after last met.
STORED = 500
STORED_MS = 7 * 24 * 3600 * 1000
#: How much of a key, a field and a raw value a report keeps.
_KEY_CHARS = 300
_EXCERPT_CHARS = 80
_PROBLEM_CHARS = 300


#: The largest whole number a record holds: 2^53 - 1, exact in the scripts' Lua numbers.
MAX_WHOLE = 2**53 - 1
#: The last millisecond of the year 9999: an instant beyond it is none anarchon writes,
#: and no date Python can show (the scripts' ``MAX_INSTANT``).
MAX_INSTANT_MS = 253_402_300_799_999
_WHOLE = re.compile(r"[0-9]{1,16}")


def whole(text: object) -> int | None:
    """A stored whole number read strictly, as the scripts read it: decimal digits, at
    most ``MAX_WHOLE`` (never ``inf``, ``nan``, ``1e3`` or ``-5``); None otherwise."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    if isinstance(text, int) and not isinstance(text, bool):
        return text if 0 <= text <= MAX_WHOLE else None
    if not isinstance(text, str) or not _WHOLE.fullmatch(text):
        return None
    number = int(text)
    return number if number <= MAX_WHOLE else None


def instant_ms(text: object) -> int | None:
    """A stored instant (epoch ms) read strictly: ``whole`` and at most ``MAX_INSTANT_MS``."""
    number = whole(text)
    return number if number is not None and number <= MAX_INSTANT_MS else None


class MalformedEntry(ValueError):
    """A stored entry anarchon cannot read: ``key`` (and its ``field``: a hash field, a
    set or sorted-set member, a stream entry id; ``""`` for the key's whole value), what
    was wrong with it (``problem``), and an excerpt of what it held."""

    def __init__(self, key: str, field: str, problem: str, raw: object = None) -> None:
        self.key = str(key)
        self.field = str(field)
        self.problem = problem
        self.excerpt = "" if raw is None else visible(_text(raw), _EXCERPT_CHARS)
        super().__init__(f"{visible(self.key, _KEY_CHARS)} {self.field_shown}: {problem}")

    @property
    def field_shown(self) -> str:
        return repr(visible(self.field, _KEY_CHARS)) if self.field else "(the whole value)"


def _text(raw: object) -> str:
    if isinstance(raw, bytes):
        return raw.decode("utf-8", "replace")
    return str(raw)


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A malformed entry as the views show it; every text is shown as text (escaped)."""

    key: str
    field: str
    problem: str
    excerpt: str
    #: When it was last met (the store's report), or None (met by this process).
    seen_at: datetime | None = None

    @classmethod
    def of(cls, entry: MalformedEntry) -> Quarantined:
        return cls(
            visible(entry.key, _KEY_CHARS),
            visible(entry.field, _KEY_CHARS),
            visible(entry.problem, _PROBLEM_CHARS),
            entry.excerpt,
        )

    def member(self) -> str:
        """Its member in the store's report: the same entry, met again, is one member."""
        return json.dumps(
            {"key": self.key, "field": self.field, "problem": self.problem, "raw": self.excerpt},
            sort_keys=True,
        )


class Quarantine:
    """The malformed entries one process met: each logged once, counted, and kept (the
    newest ``KEEP``) until it is reported to the store."""

    def __init__(self) -> None:
        self._met: OrderedDict[tuple[str, str], Quarantined] = OrderedDict()
        self._unreported: dict[str, Quarantined] = {}
        #: Malformed entries met, each counted once (while it is among the newest KEEP).
        self.count = 0

    def add(self, entry: MalformedEntry, what: str = "") -> None:
        """Quarantine ``entry`` (``what``: the part it cost, e.g. ``job 'report'``)."""
        shown = Quarantined.of(entry)
        # One entry is one, whoever described it (a script, a decoder, a view).
        identity = (shown.key, shown.field)
        if identity in self._met:
            self._met.move_to_end(identity)
            return
        self._met[identity] = shown
        if len(self._met) > KEEP:
            self._met.popitem(last=False)
        self.count += 1
        if len(self._unreported) < STORED:
            self._unreported[shown.member()] = shown
        held = f" (held {shown.excerpt!r})" if shown.excerpt else ""
        cost = f"; it costs {what} alone" if what else ""
        log.warning(
            "malformed store entry: %s %s: %s%s%s: see 'anarchon inspect' and the operations guide",
            shown.key,
            repr(shown.field) if shown.field else "(the whole value)",
            shown.problem,
            held,
            cost,
        )

    def entries(self) -> list[Quarantined]:
        """What this process met, newest first."""
        return list(reversed(self._met.values()))

    def report_commands(self, prefix: str, now_ms: int) -> list[Command]:
        """The commands that report what was met since the last report to the store's
        report (bounded: the newest ``STORED``, none older than ``STORED_MS``)."""
        if not self._unreported:
            return []
        key = RegistryKeys.for_prefix(prefix).quarantine
        members = list(self._unreported)
        self._unreported.clear()
        adds: list[Any] = []
        for member in members:
            adds += [now_ms, member]
        return [
            ("ZADD", key, *adds),
            ("ZREMRANGEBYRANK", key, 0, -(STORED + 1)),
            ("ZREMRANGEBYSCORE", key, "-inf", f"({now_ms - STORED_MS}"),
            ("PEXPIRE", key, STORED_MS),
        ]


#: The quarantine of each prefix this process used (the newest 64 prefixes).
_BY_PREFIX: OrderedDict[str, Quarantine] = OrderedDict()
_PREFIXES = 64


def quarantine_of(prefix: str) -> Quarantine:
    """The process's quarantine of ``prefix``'s store: every part of the process that
    reads it (an engine, a store, an inspector) shares it, so that an entry is logged
    once, counted once and reported once."""
    found = _BY_PREFIX.get(prefix)
    if found is None:
        found = _BY_PREFIX[prefix] = Quarantine()
        if len(_BY_PREFIX) > _PREFIXES:
            _BY_PREFIX.popitem(last=False)
    _BY_PREFIX.move_to_end(prefix)
    return found


def quarantine_malformed(reported: object, prefix: str, what: str) -> None:
    """Quarantine the malformed entries a script reported (``{key, field, problem,
    excerpt}`` each: lua/lease_state.lua); ``what``: what each cost."""
    if not reported or not isinstance(reported, list):
        return  # the usual reply: nothing malformed (a claim's: no lookup on the hot path)
    quarantine = quarantine_of(prefix)
    for entry in reported:
        if isinstance(entry, list | tuple) and len(entry) == 4:
            key, field, problem, excerpt = (_text(part) for part in entry)
            quarantine.add(MalformedEntry(key, field, problem, excerpt or None), what)


async def read_quarantine(conn: Connection, prefix: str, limit: int = 100) -> list[Quarantined]:
    """The store's report of malformed entries, newest first (at most ``limit``). Its
    own members are input too: one that is not a report is left out."""
    key = RegistryKeys.for_prefix(prefix).quarantine
    reply = await conn.execute(("ZREVRANGE", key, 0, max(limit, 1) - 1, "WITHSCORES"))
    return [entry for entry in map(_decode_report, score_pairs(reply)) if entry is not None]


def _decode_report(pair: tuple[Any, Any]) -> Quarantined | None:
    member, score = pair
    try:
        fields = json.loads(_text(member)[:4096])
        seen_ms = float(score)
        if not isinstance(fields, dict) or not 0 <= seen_ms < 1e15:
            return None
        texts = [fields.get(name) for name in ("key", "field", "problem", "raw")]
        if not all(isinstance(text, str) for text in texts):
            return None
    except ValueError:
        return None
    key, field, problem, raw = (str(text) for text in texts)
    return Quarantined(
        visible(key, _KEY_CHARS),
        visible(field, _KEY_CHARS),
        visible(problem, _PROBLEM_CHARS),
        visible(raw, _EXCERPT_CHARS),
        datetime.fromtimestamp(seen_ms / 1000, UTC),
    )
