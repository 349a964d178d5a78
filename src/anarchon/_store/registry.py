"""The registry: what the fleet runs, kept in the store for the read side (``Inspector``,
``anarchon inspect``) without a running scheduler.

Each instance registers itself (id, host, pid, version, jobs, timer kinds, when it
started) with an expiry by the server's clock, and renews it every 10 s while it runs;
one that stops withdraws, one that dies expires within 30 s. Each job's definition
(schedule, time zone, options) is written by the instances that run it, and the store
keeps when each job first appeared: catch-up never reaches back before it (a first
deploy does not run the slots of the minutes before the fleet existed). The keys share
one hash tag, ``{<prefix>}``, so that the registration is one script on one node.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
from collections.abc import Callable
from typing import Any

import anyio

from .._model.clock import pace, wall_ms
from .._model.job import Job
from .._model.schedule import (
    BoundedSchedule,
    CalendarInterval,
    CombinedSchedule,
    CronSchedule,
    IntervalSchedule,
    Schedule,
    fire_times,
    to_epoch_ms,
)
from .._model.timer import TimerKind
from .._version import __version__
from ..clients import Command, Connection, ServerReplyError, score_pairs
from .coalesce import pipeline
from .keys import RegistryKeys
from .quarantine import quarantine_malformed, quarantine_of
from .scripts import ScriptCall, lease_script, run_scripts
from .timers import score_ms

__all__ = [
    "FINGERPRINT_CHARS",
    "REPORTED_FIRES",
    "Registry",
    "fingerprint",
    "job_definition",
]

log = logging.getLogger("anarchon")

#: How many next fire times an instance reports of a job whose schedule the store cannot
#: reckon from its definition (a custom or combined schedule, or one with exclusions).
REPORTED_FIRES = 10


def job_definition(job: Job, strategy: str, next_slot_ms: int | None) -> dict[str, Any]:
    """A job as the registry shows it (JSON-ready)."""
    bounded = job.schedule
    schedule = bounded.schedule if isinstance(bounded, BoundedSchedule) else bounded
    definition: dict[str, Any] = {
        "schedule": repr(schedule),
        "cron": schedule.expression if isinstance(schedule, CronSchedule) else None,
        "every_ms": schedule.every_ms if isinstance(schedule, IntervalSchedule) else None,
        "timezone": _zone_of(schedule),
        "strategy": strategy,
        "overlap": job.overlap_policy,
        "max_attempts": job.max_attempts,
        "catch_up_ms": job.catch_up_ms,
        "jitter_ms": job.jitter_ms,
        "max_late_ms": job.max_late_ms,
        "timeout_ms": job.timeout_ms,
        "retry_delay_ms": job.retry_delay_ms,
        "retry_on": None if job.retry_on is None else [t.__qualname__ for t in job.retry_on],
        "max_concurrent": job.max_concurrent,
        "max_concurrent_fleet": job.max_concurrent_fleet,
        "next_slot_ms": next_slot_ms,
    }
    if job.exclude is not None:
        definition["exclude"] = job.exclude.text
    for bound, at in (("start_at", job.start_at), ("end_at", job.end_at)):
        if at is not None:
            definition[bound] = to_epoch_ms(at)
    if job.max_runs is not None:
        definition["max_runs"] = job.max_runs
    if job.pause_after_failures is not None:
        definition["pause_after_failures"] = job.pause_after_failures
    reckoned = definition["cron"] is not None or definition["every_ms"] is not None
    if (not reckoned or bounded is not schedule or job.exclude is not None) and built_in(
        job.schedule
    ):
        # A schedule the store cannot reckon from the definition (combined, bounded, or
        # with exclusions) but made of anarchon's own: its next fire times, as this
        # instance reckons them. A custom one's code is not called here: of it, the
        # views know the next slot alone.
        try:
            fires = fire_times(job.schedule, int(wall_ms()), REPORTED_FIRES, job.excluded)
        except Exception:  # the job's own claims say what is wrong with its schedule
            fires = []
        definition["next_fires_ms"] = [to_epoch_ms(fire) for fire in fires]
    return definition


#: A fingerprint's length: hex digits of a SHA-256 of the definition.
FINGERPRINT_CHARS = 16
#: What a definition holds that is no part of how the job behaves: what its instances saw
#: last (the views' next fire times).
_NOT_BEHAVIOUR = ("next_slot_ms", "next_fires_ms")
#: An object's default repr names where it lives in memory: no two processes agree on it.
_DEFAULT_REPR = re.compile(r" (object )?at 0x[0-9a-fA-F]+>")


def fingerprint(definition: dict[str, Any]) -> str:
    """The fingerprint of a job's definition (``job_definition``): what decides which
    slots it runs and how (schedule, zone, strategy, options), the same in every process
    that defines the job alike. A custom schedule counts by its ``repr``; one without a
    repr of its own, by its class."""
    behaviour = {k: v for k, v in definition.items() if k not in _NOT_BEHAVIOUR}
    behaviour["schedule"] = _DEFAULT_REPR.sub(">", str(behaviour.get("schedule")))
    text = json.dumps(behaviour, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:FINGERPRINT_CHARS]


def _zone_of(schedule: Schedule) -> str:
    """The time zone a schedule's times are read in: a cron schedule's, or the one zone
    of a combined schedule's cron parts; UTC otherwise."""
    if isinstance(schedule, CronSchedule):
        return schedule.timezone
    if isinstance(schedule, CombinedSchedule):
        zones = {part.timezone for part in schedule.parts if isinstance(part, CronSchedule)}
        if len(zones) == 1:
            return zones.pop()
    return "UTC"


def built_in(schedule: Schedule) -> bool:
    """Whether ``schedule`` is made of anarchon's schedules alone (no custom code)."""
    if isinstance(schedule, CombinedSchedule):
        return all(built_in(part) for part in schedule.parts)
    if isinstance(schedule, BoundedSchedule):
        return built_in(schedule.schedule)
    return isinstance(schedule, CronSchedule | IntervalSchedule | CalendarInterval)


class Registry:
    """One instance's registration: made at start, renewed while it runs, withdrawn on
    stop."""

    def __init__(
        self,
        prefix: str,
        instance_id: str,
        strategy: str,
        slots_key: Callable[[str], str],
        max_concurrent: int | None = None,
    ) -> None:
        self.keys = RegistryKeys.for_prefix(prefix)
        #: The instance's bound on handlers at once (None: none), shown with its
        #: registration.
        self.max_concurrent = max_concurrent
        self.instance_id = instance_id
        self.strategy = strategy
        #: The key a job's remembered slots are scored in (the store's
        #: ``remembered_slots_key``).
        self._slots_key = slots_key
        self.prefix = prefix
        self.started_ms = int(wall_ms())
        #: The jobs whose first-seen time the store told this instance.
        self._seen: dict[str, int] = {}
        #: Each job's fingerprint here, and the one in force in the fleet (the newest
        #: among the live instances' registrations), as the last registration said.
        self.fingerprints: dict[str, str] = {}
        self.in_force: dict[str, str] = {}

    async def register(
        self,
        conn: Connection,
        jobs: dict[str, Job],
        kinds: dict[str, TimerKind],
        next_slots: dict[str, int],
        running: int,
    ) -> dict[str, int]:
        """Register (or renew): when each job first appeared in the store (server ms)."""
        keys = self.keys
        instance = {
            "id": self.instance_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "version": __version__,
            "started_ms": self.started_ms,
            "strategy": self.strategy,
            "timer_kinds": list(kinds),
            "running": running,
            "max_concurrent": self.max_concurrent,
            # Last: a reader that takes a bounded part of a long registration (thousands
            # of jobs) still has every other field.
            "jobs": list(jobs),
        }
        args: list[str | int] = [
            self.instance_id,
            pace().registration_ttl_ms,
            json.dumps(instance),
            len(jobs),
        ]
        oldest = await self._oldest_slots(conn, [name for name in jobs if name not in self._seen])
        fingerprints = {}
        for name, job in jobs.items():
            definition = job_definition(job, self.strategy, next_slots.get(name))
            fingerprints[name] = fingerprint(definition)
            args += [name, json.dumps(definition), oldest.get(name, ""), fingerprints[name]]
        for name, kind in kinds.items():
            kind_definition = {
                "buckets": kind.buckets,
                "max_attempts": kind.max_attempts,
                "max_concurrent": kind.max_concurrent,
                "max_concurrent_fleet": kind.max_concurrent_fleet,
                "rate_limit": None if kind.rate_limit is None else list(kind.rate_limit),
                "group_by": kind.group_by,
                "max_concurrent_per_group": kind.max_concurrent_per_group,
            }
            args += [name, json.dumps(kind_definition)]
        call = ScriptCall(
            lease_script("registry"),
            (
                keys.instances,
                keys.instance(self.instance_id),
                keys.jobs,
                keys.first_seen,
                keys.timer_kinds,
                keys.definitions,
            ),
            args,
        )
        (reply,) = await run_scripts(conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        quarantine_malformed(reply[-1], self.prefix, "itself")
        first_seen = {name: int(reply[1 + index]) for index, name in enumerate(jobs)}
        in_force = reply[1 + len(jobs) : 1 + 2 * len(jobs)]
        self.fingerprints = fingerprints
        self.in_force = {name: _text(found) for name, found in zip(jobs, in_force, strict=True)}
        self._seen.update(first_seen)
        return first_seen

    async def _oldest_slots(self, conn: Connection, jobs: list[str]) -> dict[str, int]:
        """Of ``jobs`` without a first-seen time in the store: the oldest slot their
        history remembers (a store written before the registry existed, or a
        registration whose reply was lost). One round trip, or two."""
        if not jobs:
            return {}
        known = await conn.execute(("HMGET", self.keys.first_seen, *jobs))
        missing = [name for name, seen in zip(jobs, known, strict=True) if seen is None]
        if not missing:
            return {}
        commands: list[Command] = [
            ("ZRANGE", self._slots_key(name), 0, 0, "WITHSCORES") for name in missing
        ]
        replies = await pipeline(conn, commands)
        oldest: dict[str, int] = {}
        for name, reply in zip(missing, replies, strict=True):
            if isinstance(reply, ServerReplyError):
                raise reply
            score = _first_score(reply)
            if score is not None:
                oldest[name] = score
        return oldest

    async def report_quarantine(self, conn: Connection) -> None:
        """Report the malformed entries this process met since the last report to the
        store (``quarantine.py``), for ``inspect`` and the dashboard of any host."""
        now_ms = int(wall_ms())
        commands = quarantine_of(self.prefix).report_commands(self.prefix, now_ms)
        if commands:
            for reply in await pipeline(conn, commands):
                if isinstance(reply, ServerReplyError):
                    raise reply

    async def withdraw(self, conn: Connection, deadline_sec: float) -> None:
        """Leave the registry (a stopping instance); its expiry covers a failure here."""
        with anyio.move_on_after(deadline_sec):
            try:
                await self.report_quarantine(conn)
                await conn.execute(("ZREM", self.keys.instances, self.instance_id))
                await conn.execute(("DEL", self.keys.instance(self.instance_id)))
            except Exception as exc:
                log.debug("leaving the registry failed (it expires instead): %s", exc)


def _text(raw: object) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def _first_score(reply: Any) -> int | None:
    """The score in a one-member ``ZRANGE ... WITHSCORES`` reply, or None if it is empty
    (or no instant)."""
    pairs = score_pairs(reply)
    return score_ms(pairs[0][1]) if pairs else None
