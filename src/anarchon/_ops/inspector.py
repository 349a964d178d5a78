"""The read side of a store, without a running scheduler: what the fleet runs, the runs
in progress, the instances alive, the history; and the fleet-wide operations (pause,
resume, run now). ``anarchon inspect`` and its sibling commands print what this reads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from types import TracebackType
from typing import Any, Literal, cast

from .._errors import (
    InvalidJobError,
    InvalidOptionError,
    RunOverlapError,
    SchedulerStateError,
)
from .._model.clock import wall_ms
from .._model.job import check_count, check_duration_ms, validate_job_name
from .._model.schedule import (
    FIRE_TIMES_MAX,
    CronSchedule,
    IntervalSchedule,
    Schedule,
    count_slots,
    fire_times,
    from_epoch_ms,
    iso_ms,
    to_epoch_ms,
)
from .._model.text import visible
from .._model.timer import validate_kind
from .._model.values import (
    AuditEntry,
    BackfillInfo,
    InstanceInfo,
    JobInfo,
    LeaseInfo,
    RunResult,
    TimerInfo,
    TimerKindInfo,
    TimerPage,
)
from .._store.audit import (
    AUDIT_MAX,
    PAUSED_BY_FAILURES,
    check_note,
    read_audit,
    record_audit,
    who,
)
from .._store.backend import RedisBackend
from .._store.backfill import (
    BACKFILL_SLOTS_MAX,
    backfill_command,
    backfill_of,
    cancel_backfill,
    start_backfill,
)
from .._store.contract import is_slot_id, slot_ms_of
from .._store.deadline import answered_in_time
from .._store.keys import (
    BackfillAsked,
    ClaimOnlyKeys,
    JobKeys,
    RegistryKeys,
    RunRequested,
    TimerKeys,
    hint_channel,
    kind_keys,
)
from .._store.lease import (
    FINISHED_FIELD,
    LAST_OK_FIELD,
    PAUSED_FIELD,
    RUNS_FIELD,
    paused_text,
    request_run,
    set_paused,
)
from .._store.quarantine import (
    MAX_INSTANT_MS,
    MalformedEntry,
    Quarantine,
    Quarantined,
    quarantine_of,
    read_quarantine,
)
from .._store.records import (
    AUDIT_NOTE_MAX,
    KindRecord,
    LeaseState,
    decode_definition,
    decode_fingerprints,
    decode_instance,
    decode_instant,
    decode_timer_kind,
    history_command,
    parse_history,
)
from .._store.timers import TimerPeek, TimerStore, timer_info
from ..clients import Command, Connection, ServerReplyError, score_pairs

__all__ = [
    "INSTANCE_BYTES_MAX",
    "INSTANCES_READ_MAX",
    "CutInstanceInfo",
    "Inspector",
    "jobs_cut",
    "may_run",
    "newest_failures",
    "runners",
    "running_text",
]

#: Each read is one or a few round trips, each with this deadline.
_DEADLINE_SEC = 10.0
#: Reads of many jobs (their histories, their leases) go this many commands a round trip.
_COMMANDS_A_TRIP = 200
#: The statuses of a recorded attempt that did not go well.
_FAILED = ("failed", "interrupted", "cancelled")
#: What a read of the instances takes of each one's registration at most (bytes): an
#: instance registers its whole job list, and a read of the fleet stays bounded whatever
#: it holds (a longer record is read up to here: its first jobs, ``CutInstanceInfo``).
INSTANCE_BYTES_MAX = 64 * 1024
#: Instances a read of them takes at most (the first to expire; ``instance_count``
#: counts them all).
INSTANCES_READ_MAX = 200
#: Up to this many timer kinds, a bounded read of their names takes the first by name.
_NAMES_SORTED_MAX = 1000
#: How much of a name asked for an error message shows.
_NAME_SHOWN = 200


#: How old an undecided slot ``check`` reports at the least, by default.
CHECK_LATE_MS = 10 * 60_000


class Inspector:
    """Reads a store (and pauses, resumes and runs its jobs) from any process, with no
    scheduler running there: a dashboard, a script, ``anarchon inspect``::

        async with Inspector(RedisBackend(redis="redis://localhost:6379")) as store:
            for job in await store.jobs():
                print(job.name, job.next_fire, job.paused, job.last)
            await store.pause("report")

    The jobs it knows are the ones the fleet's instances registered (each writes its
    jobs' definitions when it starts and every 10 s while it runs); a job name it does
    not know is an ``InvalidJobError``, not an empty answer. It reads only inside
    ``async with`` (a ``SchedulerStateError`` otherwise), and writes nothing but a
    pause, a resume or a run asked for; each read is one or a few round trips, each
    within 10 s (a ``TransportError`` past that).

    Args:
        backend: The store's backend, with the prefix its schedulers use.

    Raises:
        InvalidOptionError: ``backend`` is not a ``RedisBackend``.

    Attributes:
        backend: The backend it reads.
    """

    def __init__(self, backend: RedisBackend[Any]) -> None:
        if not isinstance(backend, RedisBackend):
            raise InvalidOptionError(
                f"Inspector reads a RedisBackend or ValkeyBackend, got {type(backend).__name__}"
            )
        self.backend = backend
        self._keys = RegistryKeys.for_prefix(backend.prefix)
        self._conn: Connection | None = None

    async def __aenter__(self) -> Inspector:
        self._conn = await self.backend.open_connection(writes=False)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close_if_owned()

    # ------------------------------------------------------------------ reading

    async def job_names(self) -> list[str]:
        """The names of the jobs the fleet registered (their names alone: cheap at any
        number of jobs).

        Returns:
            The names, sorted.
        """
        return sorted(str(name) for name in await self._execute(("HKEYS", self._keys.jobs)))

    async def jobs(self, names: Sequence[str] | None = None) -> list[JobInfo]:
        """Every job the fleet registered, by name. A job whose stored definition is
        malformed is left out (and quarantined: ``anarchon inspect`` shows it).

        Args:
            names: Only these jobs (those of them that the fleet registered); None:
                every job.

        Returns:
            The jobs, sorted by name.
        """
        definitions, _ = await self._definitions(names)
        now_ms = int(wall_ms())
        names = sorted(definitions)  # those of ``names`` the store knows and can read
        if not names:
            return []
        seen_ms, fingerprints = (
            reply if isinstance(reply, list) else [None] * len(names)
            for reply in await self._read_each(
                [
                    ("HMGET", self._keys.first_seen, *names),
                    ("HMGET", self._keys.definitions, *names),
                ]
            )
        )
        live_definitions = dict(zip(names, fingerprints, strict=True))
        first_seen = {
            name: self._instant(self._keys.first_seen, name, seen)
            for name, seen in zip(names, seen_ms, strict=True)
            if seen is not None
        }
        strategies = {name: _strategy(definitions[name]) for name in names}
        leased = [name for name in names if strategies[name] == "lease"]
        # Each job's newest result, and each lease job's pause flag.
        commands: list[Command] = [
            history_command(self._results_key(name, strategies[name]), 1) for name in names
        ]
        commands += [
            ("HMGET", JobKeys.for_job(self._prefix, name).state, *_JOB_FLAGS) for name in leased
        ]
        # Each lease job's backfill.
        commands += [backfill_command(self._prefix, name) for name in leased]
        # The live fleet permits of each job with a limit across the fleet.
        limited = [name for name in leased if definitions[name].get("max_concurrent_fleet")]
        commands += [
            ("ZCOUNT", JobKeys.for_job(self._prefix, name).permits, f"({now_ms}", "+inf")
            for name in limited
        ]
        replies = iter(await self._read_each(commands))
        newest = {name: next(replies) for name in names}
        paused = {name: next(replies) for name in leased}
        backfills = {name: backfill_of(self._prefix, name, next(replies)) for name in leased}
        held = {name: next(replies) for name in limited}
        found = []
        for name in names:
            definition = definitions[name]
            strategy = strategies[name]
            flags = _job_flags(paused.get(name))
            paused_by = flags.get(PAUSED_FIELD)
            results = self._history_of(name, strategy, newest[name])
            seen = first_seen.get(name)
            finished = _finished(definition, flags.get(FINISHED_FIELD), now_ms)
            found.append(
                JobInfo(
                    name=name,
                    schedule=str(definition.get("schedule")),
                    cron=definition.get("cron"),
                    every_ms=definition.get("every_ms"),
                    timezone=str(definition.get("timezone") or "UTC"),
                    strategy=strategy,
                    next_fire=None if finished else _next_fire(definition, now_ms),
                    paused=paused_by is not None,
                    paused_by=paused_by,
                    last=results[0] if results else None,
                    first_seen=None if seen is None else from_epoch_ms(seen),
                    fleet_running=_count(held.get(name)),
                    runs=_runs(flags.get(RUNS_FIELD)) if name in leased else None,
                    finished=finished,
                    last_success=_at(flags.get(LAST_OK_FIELD)),
                    backfill=backfills.get(name),
                    definitions=self._fingerprints(name, live_definitions[name], now_ms),
                    options={
                        key: value
                        for key, value in definition.items()
                        if key
                        not in (
                            "schedule",
                            "cron",
                            "every_ms",
                            "timezone",
                            "strategy",
                            "next_fires_ms",
                        )
                    },
                )
            )
        return found

    async def leases(
        self, job: str | None = None, *, names: Sequence[str] | None = None
    ) -> list[LeaseInfo]:
        """The runs in progress (holding a live lease, or waiting for their next attempt)
        of the lease-strategy jobs.

        Args:
            job: Only this job's (an ``InvalidJobError`` if the fleet did not register
                it); None: every job's, or those of ``names``.
            names: Only these jobs' (those of them that the fleet registered), when
                ``job`` is None; None: every job's.

        Returns:
            The runs, oldest slot first.
        """
        definitions, malformed = await self._definitions([job] if job is not None else names)
        if job is not None:
            names = [self._check_job(job, definitions, malformed)]
        else:
            names = sorted(definitions)
        leased = [name for name in names if _strategy(definitions[name]) == "lease"]
        keys = {name: JobKeys.for_job(self._prefix, name) for name in leased}
        now_ms = await self._server_now_ms()
        # Each job's slots in progress, then the state of each (only jobs that have any).
        members = await self._read_each([("SMEMBERS", keys[name].active) for name in leased])
        active: dict[str, list[str]] = {}
        for name, slots in zip(leased, members, strict=True):
            if isinstance(slots, MalformedEntry):
                self.quarantine.add(slots, f"the runs in progress of {name!r}")
            elif slots:
                active[name] = sorted(_text(slot) for slot in slots)
        states = await self._read_each(
            [("HMGET", keys[name].state, *slots) for name, slots in active.items()]
        )
        found: list[LeaseInfo] = []
        for (name, slots), raws in zip(active.items(), states, strict=True):
            if isinstance(raws, MalformedEntry):
                self.quarantine.add(raws, f"the runs in progress of {name!r}")
                continue
            for slot_id, raw in zip(slots, raws, strict=True):
                try:
                    lease = _lease(name, keys[name], slot_id, raw, now_ms)
                except MalformedEntry as entry:
                    self.quarantine.add(entry, f"one run in progress of {name!r}")
                    continue
                if lease is not None:
                    found.append(lease)
        return sorted(found, key=lambda lease: (lease.slot_ms, lease.job))

    async def instances(self, limit: int = INSTANCES_READ_MAX) -> list[InstanceInfo]:
        """The instances alive (registered, and renewing). Of each registration, at most
        64 KiB is read: a longer one lists the jobs that came first. A registration that
        is malformed is left out (and quarantined: ``anarchon inspect`` shows it).

        Args:
            limit: How many at most (default 200): the first to expire;
                ``instance_count`` counts them all.

        Returns:
            The instances, sorted by id.
        """
        now_ms = await self._server_now_ms()
        scored = await self._execute(
            ("ZRANGEBYSCORE", self._keys.instances, now_ms, "+inf", "WITHSCORES",
             "LIMIT", 0, max(limit, 1))
        )  # fmt: skip
        pairs = _score_pairs(scored)
        if not pairs:
            return []
        commands: list[Command] = []
        for instance_id, _ in pairs:
            key = self._keys.instance(instance_id)
            commands += [("STRLEN", key), ("GETRANGE", key, 0, INSTANCE_BYTES_MAX - 1)]
        replies = await self._read_each(commands)
        found: list[InstanceInfo] = []
        for index, (instance_id, expires_ms) in enumerate(pairs):
            key = self._keys.instance(instance_id)
            length, body = replies[2 * index], replies[2 * index + 1]
            try:
                for reply in (length, body):
                    if isinstance(reply, MalformedEntry):
                        raise reply
                if not length:
                    continue  # it withdrew as this was read
                cut = int(length) > INSTANCE_BYTES_MAX
                record = decode_instance(key, body, cut=cut)
            except MalformedEntry as entry:
                self.quarantine.add(entry, f"the registration of instance {instance_id!r}")
                continue
            build = partial(CutInstanceInfo, record_bytes=int(length)) if cut else InstanceInfo
            found.append(
                build(
                    id=instance_id,
                    host=record.host,
                    pid=record.pid,
                    version=record.version,
                    started=from_epoch_ms(record.started_ms),
                    strategy=record.strategy,
                    jobs=record.jobs,
                    timer_kinds=record.timer_kinds,
                    running=record.running,
                    expires_in_ms=int(min(max(expires_ms - now_ms, 0), 2**53)),
                    max_concurrent=record.max_concurrent,
                )
            )
        return sorted(found, key=lambda instance: instance.id)

    async def instance_count(self) -> int:
        """How many instances are alive (registered, and renewing): one command, whatever
        they registered.

        Returns:
            The number of instances.
        """
        now_ms = await self._server_now_ms()
        return int(await self._execute(("ZCOUNT", self._keys.instances, now_ms, "+inf")))

    async def history(self, job: str, limit: int = 100) -> list[RunResult]:
        """The newest recorded attempts of ``job`` (and its skipped slots).

        Args:
            job: The name of a job the fleet registered (an ``InvalidJobError``
                otherwise).
            limit: How many at most (1 or more; default 100; an
                ``InvalidOptionError`` otherwise).

        Returns:
            The attempts' results, newest first.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidOptionError(f"limit must be a whole number, 1 or more, got {limit!r}")
        definitions, malformed = await self._definitions([job])
        name = self._check_job(job, definitions, malformed)
        strategy = _strategy(definitions[name])
        (reply,) = await self._read_each(
            [history_command(self._results_key(name, strategy), limit)]
        )
        return self._history_of(name, strategy, reply)

    async def recent(
        self, limit: int = 100, names: Sequence[str] | None = None
    ) -> dict[str, list[RunResult]]:
        """Every job's newest recorded attempts.

        Args:
            limit: How many at most per job (1 or more; default 100; an
                ``InvalidOptionError`` otherwise).
            names: Only these jobs (those of them that the fleet registered); None:
                every job.

        Returns:
            Each job's results, newest first, by job name.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidOptionError(f"limit must be a whole number, 1 or more, got {limit!r}")
        definitions, _ = await self._definitions(names)
        names = sorted(definitions)  # those of ``names`` the store knows and can read
        strategies = {name: _strategy(definitions[name]) for name in names}
        replies = await self._read_each(
            [history_command(self._results_key(name, strategies[name]), limit) for name in names]
        )
        return {
            name: self._history_of(name, strategies[name], reply)
            for name, reply in zip(names, replies, strict=True)
        }

    async def failures(self, limit: int = 20) -> list[RunResult]:
        """The newest attempts, across the jobs, that failed, were interrupted (their
        runner vanished) or were cancelled.

        Args:
            limit: How many at most (default 20). They are looked for among each job's
                newest ``max(5 * limit, 100)`` results.

        Returns:
            The attempts' results, newest first.
        """
        return newest_failures(await self.recent(max(limit * 5, 100)), limit)

    async def timer_kind_names(self, limit: int | None = None) -> list[str]:
        """The names of the timer kinds the fleet registered.

        Args:
            limit: How many at most: the first by name while there are at most 1000
                kinds, else those one step of a scan finds (what is read stays bounded
                whatever the store holds). None: all of them.

        Returns:
            The names, sorted.
        """
        key = self._keys.timer_kinds
        if limit is not None and await self.timer_kind_count() > _NAMES_SORTED_MAX:
            _, found = await self._execute(("HSCAN", key, 0, "COUNT", max(limit, 1)))
            names = [_text(name) for name in _mapping(found)]
        else:
            names = [_text(name) for name in await self._execute(("HKEYS", key))]
        return sorted(names)[:limit]

    async def timer_kind_count(self) -> int:
        """How many timer kinds the fleet registered (one command).

        Returns:
            The number of kinds.
        """
        return int(await self._execute(("HLEN", self._keys.timer_kinds)))

    async def timers(
        self, kinds: Sequence[str] | None = None, *, limit: int | None = None
    ) -> list[TimerKindInfo]:
        """Each kind of timer the fleet fires: how many keys have one pending, and the
        first to fall due. A kind whose registration is malformed (its number of buckets
        out of what anarchon allows, say) is left out, and quarantined: it is never
        read.

        Args:
            kinds: Only these kinds (those of them that the fleet registered); None:
                every kind.
            limit: How many kinds at most, as ``timer_kind_names`` takes it (the first
                by name of ``kinds``, when given). None: all of them.

        Returns:
            The kinds, sorted by name.
        """
        if kinds is not None:
            names = sorted(set(kinds))[:limit]
        else:
            names = await self.timer_kind_names(limit)
        if not names:
            return []
        raws = await self._execute(("HMGET", self._keys.timer_kinds, *names))
        store = TimerStore(self._require(), prefix=self._prefix, runner="inspector")
        found = []
        for kind, raw in zip(names, raws, strict=True):
            if raw is None:
                continue  # not registered
            try:
                record = decode_timer_kind(self._keys.timer_kinds, kind, raw)
                with answered_in_time(_DEADLINE_SEC):
                    peek = await self._peek(store, kind, record.buckets)
                fleet_running, started, groups = await self._kind_limits_in_use(kind, record)
            except MalformedEntry as entry:
                self.quarantine.add(entry, f"the view of timer kind {kind!r}")
                continue
            first = peek.first[0] if peek.first else None
            found.append(
                TimerKindInfo(
                    kind=kind,
                    buckets=record.buckets,
                    pending=peek.count,
                    next_due=None if first is None else from_epoch_ms(first[1]),
                    next_key=None if first is None else first[0].key,
                    max_concurrent_fleet=record.max_concurrent_fleet,
                    fleet_running=fleet_running,
                    rate_limit=record.rate_limit,
                    rate_started=started,
                    max_concurrent_per_group=record.max_concurrent_per_group,
                    groups_waiting=groups,
                )
            )
        return found

    async def next_fire_times(self, job: str, n: int = 10) -> list[datetime]:
        """A job's next ``n`` fire times after now, from the definition its instances
        registered (``anarchon next JOB``): a cron expression in its zone, or an
        interval. Of a job with a combined or bounded schedule, or with ``exclude=``,
        the next ten its instances last reported (excluded slots left out); of a custom
        schedule, only the next slot its instances last reported.

        Args:
            job: A job the fleet registered (an ``InvalidJobError`` otherwise).
            n: How many (1 to 1000; default 10).

        Returns:
            Aware UTC datetimes, earliest first.
        """
        count = check_count("n", n, most=FIRE_TIMES_MAX)
        definitions, malformed = await self._definitions([job])
        name = self._check_job(job, definitions, malformed)
        return _next_fires(definitions[name], int(wall_ms()), count)

    async def timer_page(
        self, kind: str, *, cursor: str | None = None, limit: int = 100
    ) -> TimerPage:
        """A page of ``kind``'s timers (key, next due, status, attempt, recurrence,
        payload), in no particular order: a scan of the kind's keys, so a large kind is
        read a page at a time. A timer set or cancelled while the pages are read may be
        shown twice or not at all; one that does not read is quarantined and left out.

        Args:
            kind: A kind the fleet registered (an ``InvalidJobError`` otherwise).
            cursor: Where the page starts: a ``TimerPage.cursor`` (None: the first page).
            limit: About how many timers a page holds (1 to 1000; default 100): a page
                holds at least one step of the scan, and may hold up to twice as many.

        Returns:
            The page, and the cursor of the next one (None after the last).

        Raises:
            InvalidJobError: The fleet registered no timer kind of that name.
            InvalidOptionError: A cursor no page gave, or a limit out of its bounds.
        """
        name = validate_kind(kind)
        most = check_count("limit", limit, most=_TIMER_PAGE_MAX)
        raw = await self._execute(("HGET", self._keys.timer_kinds, name))
        if raw is None:
            raise InvalidJobError(
                f"the fleet registered no timer kind named {visible(name)!r}; `anarchon "
                "inspect` lists the kinds"
            )
        record = decode_timer_kind(self._keys.timer_kinds, name, raw)
        at: tuple[int, int] | None = _page_cursor(cursor, record.buckets)
        store = TimerStore(self._require(), prefix=self._prefix, runner="inspector")
        found: list[TimerInfo] = []
        while at is not None and len(found) < most:
            where = TimerKeys.for_kind(self._prefix, name, at[0], record.buckets)
            with answered_in_time(_DEADLINE_SEC):
                states, at = await store.scan(name, record.buckets, at, most)
            for state in states:
                info = timer_info(store, name, state, where.timers)
                if info is not None:
                    found.append(info)
        next_cursor = None if at is None else f"{at[0]}-{at[1]}"
        return TimerPage(tuple(found), next_cursor)

    async def quarantined(self, limit: int = 100) -> list[Quarantined]:
        """The malformed entries of the store: those this process met (newest first),
        then those the fleet's instances reported (``{<prefix>}:quarantine``), each
        once, at most ``limit``. Each text is shown as text (escaped, cut)."""
        own = self.quarantine.entries()
        with answered_in_time(_DEADLINE_SEC):
            stored = await read_quarantine(self._require(), self._prefix, limit)
        seen = {(entry.key, entry.field) for entry in own}
        found = own + [e for e in stored if (e.key, e.field) not in seen]
        return found[:limit]

    def malformed_in(
        self, entries: Iterable[Quarantined], record: Literal["jobs", "timer kinds"]
    ) -> dict[str, Quarantined]:
        """Of ``entries`` (``quarantined()``), those of the registry's job definitions (or
        timer kinds), by the name as shown: the views mark these names malformed."""
        key = self._keys.jobs if record == "jobs" else self._keys.timer_kinds
        return {entry.field: entry for entry in entries if entry.key == visible(key)}

    # -------------------------------------------------------------- operating

    async def pause(self, job: str, *, note: str | None = None, by: str | None = None) -> bool:
        """Pause ``job`` across the fleet, as ``Scheduler.pause`` does (lease strategy
        only), and say so in the audit log.

        Args:
            job: The name of a job the fleet registered (an ``InvalidJobError``
                otherwise) that uses the lease strategy (an ``InvalidOptionError``
                otherwise).
            note: Why (up to 500 characters): kept with the pause (``JobInfo.paused_by``)
                and in the audit log.
            by: Who (up to 200 characters; None: ``user@host`` of this process).

        Returns:
            True if this call paused it, False if it was paused already (then the audit
            log is not written).
        """
        state = await self._lease_state_key(job, "pause")
        note, who_acts = check_note(note), who(by)
        with answered_in_time(_DEADLINE_SEC):
            changed = await set_paused(self._require(), state, paused_text(who_acts, note))
        if changed:
            await self._audit("pause", job, who_acts, note)
        return changed

    async def resume(self, job: str, *, note: str | None = None, by: str | None = None) -> bool:
        """Resume ``job``: its next slot runs, as ``Scheduler.resume`` does; said in the
        audit log.

        Args:
            job: The name of a job the fleet registered that uses the lease strategy.
            note: Why (up to 500 characters), for the audit log.
            by: Who (up to 200 characters; None: ``user@host`` of this process).

        Returns:
            True if this call resumed it, False if it was not paused (then the audit log
            is not written).
        """
        state = await self._lease_state_key(job, "resume")
        note, who_acts = check_note(note), who(by)
        with answered_in_time(_DEADLINE_SEC):
            changed = await set_paused(self._require(), state, None)
        if changed:
            await self._audit("resume", job, who_acts, note)
        return changed

    async def forget(self, job: str, *, note: str | None = None, by: str | None = None) -> int:
        """Remove a job from the store: its state, history, runs stream and fleet
        permits, and its registry entries (``anarchon forget``), for a job removed from
        the code. Refused while a live instance runs it; said in the audit log. An
        instance that starts with the job again registers it anew (its first slot is
        the next one after its start: no catch-up reaches back before it).

        Args:
            job: The name of a job the fleet registered (its definition may be
                malformed: forgetting it is how to clear it).
            note: Why (up to 500 characters), for the audit log.
            by: Who (up to 200 characters; None: ``user@host`` of this process).

        Returns:
            How many keys were removed (the registry entries not counted).

        Raises:
            InvalidJobError: No job of that name is registered, a live instance runs it,
                or not every instance's registration could be read (so that cannot be
                told).
        """
        name = validate_job_name(job)
        note, who_acts = check_note(note), who(by)
        shown = visible(name, _NAME_SHOWN)
        if name not in set(await self.job_names()):
            raise InvalidJobError(f"no job named '{shown}' in the store under {self._prefix!r}")
        instances = await self.instances()
        if await self.instance_count() > len(instances):
            raise InvalidJobError(
                f"cannot forget '{shown}': not every instance's registration could be read, "
                "so whether a live one runs it cannot be told; try again"
            )
        if may_run(name, instances):
            running = runners(name, instances) or ["an instance whose job list is long"]
            raise InvalidJobError(
                f"cannot forget '{shown}': live instances run it "
                f"({', '.join(visible(r, 80) for r in running[:5])}); remove it from their "
                "code and deploy (or stop them) first"
            )
        lease, claim_only = (
            JobKeys.for_job(self._prefix, name),
            ClaimOnlyKeys.for_job(self._prefix, name),
        )
        keys = [*dataclasses.astuple(lease), *dataclasses.astuple(claim_only)]
        removed = sum(int(n) for n in await self._read_each([("DEL", key) for key in keys]))
        await self._execute(("HDEL", self._keys.jobs, name))
        await self._execute(("HDEL", self._keys.first_seen, name))
        await self._execute(("HDEL", self._keys.definitions, name))
        await self._audit("forget", name, who_acts, note)
        return removed

    async def audit(self, job: str | None = None, limit: int = 100) -> list[AuditEntry]:
        """What was done to the jobs (paused, resumed, run now), who and why, newest
        first, from the prefix's audit log (its newest 1000 entries). An entry that does
        not read is quarantined and left out.

        Args:
            job: Only this job's entries (None: every job's).
            limit: How many at most (1 to 1000; default 100).

        Returns:
            The entries, newest first.
        """
        count = check_count("limit", limit, most=AUDIT_MAX)
        with answered_in_time(_DEADLINE_SEC):
            return await read_audit(self._require(), self._prefix, job, count)

    async def check(self, max_late_ms: int = CHECK_LATE_MS) -> list[str]:
        """What a monitoring system's periodic check should hear of (``anarchon
        check``): one line per problem, each starting with the job's name; none when all
        is well. A registered job has a problem when:

        - no live instance runs it (said only when every registration was read);
        - anarchon paused it, its ``pause_after_failures`` slots in a row having failed;
        - a slot of its schedule is older than ``max_late_ms`` and was never decided: not
          recorded (run, failed, skipped) and not under way. Of a schedule the store
          cannot reckon (a custom one), its next slot as its instances report it.

        Args:
            max_late_ms: How old an undecided slot may be (default 10 minutes): more than
                the jobs' ``max_late_ms`` and ``jitter_ms``.

        Returns:
            The problems, by job name.
        """
        bound = check_duration_ms("max_late_ms", max_late_ms)
        jobs = await self.jobs()
        instances = await self.instances()
        every_read = await self.instance_count() <= len(instances)
        now_ms = int(wall_ms())
        problems = []
        for job in jobs:
            name = visible(job.name, _NAME_SHOWN)
            if every_read and not may_run(job.name, instances):
                problems.append(f"{name}: no live instance runs it")
            if job.paused and (job.paused_by or "").startswith(PAUSED_BY_FAILURES):
                problems.append(f"{name}: paused by anarchon: {visible(job.paused_by, 300)}")
            if job.paused or job.finished:
                continue
            undecided = await self._undecided_slot(job, now_ms - bound)
            if undecided is not None:
                late = _span_text((now_ms - to_epoch_ms(undecided)) / 1000)
                problems.append(
                    f"{name}: its slot {undecided:%Y-%m-%dT%H:%M:%SZ} ({late} ago) was never "
                    "decided: not run, not recorded skipped, not under way"
                )
        return problems

    async def _undecided_slot(self, job: JobInfo, before_ms: int) -> datetime | None:
        """The first slot of ``job`` after its newest recorded one (or its first
        appearance) that is at or before ``before_ms`` and not under way, or None."""
        definition = dict(job.options)
        definition.update(cron=job.cron, every_ms=job.every_ms, timezone=job.timezone)
        since = job.last.slot if job.last is not None else job.first_seen
        if since is None:
            return None
        since_ms = to_epoch_ms(since)
        fires = _next_fires(definition, since_ms, 1) if job.cron or job.every_ms else []
        reported = definition.get("next_slot_ms")
        if not fires and isinstance(reported, int) and since_ms < reported:
            fires = [from_epoch_ms(reported)]
        if not fires or to_epoch_ms(fires[0]) > before_ms:
            return None
        slot_ms = to_epoch_ms(fires[0])
        if job.strategy == "lease" and any(
            lease.slot_ms == slot_ms for lease in await self.leases(job.name)
        ):
            return None  # under way: its result comes when it ends
        return fires[0]

    async def _audit(self, action: str, job: str, who_acts: str, note: str | None) -> None:
        await record_audit(
            self._require(), self._prefix, action, job, who_acts, note,
            within_sec=_DEADLINE_SEC,
        )  # fmt: skip

    async def run_now(self, job: str, *, note: str | None = None, by: str | None = None) -> str:
        """Ask the fleet to run ``job`` now, once: the run is stored as due, and the
        instances that run the job hear of it on the hint channel (any one of them takes
        it; without hints, the first to claim the job's next slot does). It is one
        attempt, recorded with trigger ``"manual"``; overlap rules apply.

        Args:
            job: The name of a job the fleet registered that uses the lease strategy.
            note: Why (up to 500 characters), for the audit log.
            by: Who (up to 200 characters; None: ``user@host`` of this process).

        Returns:
            The run's slot id (its history entries carry it): that of the run asked for
            before, if that one still waits for its first attempt (asking again adds
            nothing).

        Raises:
            InvalidJobError: The fleet did not register the job, or no instance alive
                runs it.
            InvalidOptionError: The job does not use the lease strategy.
            RunOverlapError: The job is finished (its ``max_runs`` reached, or its
                ``end_at`` passed), as ``Scheduler.run_now`` refuses it.
        """
        await self._lease_state_key(job, "run-now")
        note, who_acts = check_note(note), who(by)
        await self._refuse_finished(job, "run it again")
        await self._require_runner(job, "a run asked for now would wait until one starts")
        with answered_in_time(_DEADLINE_SEC):
            # A request that still waits for its first attempt is the one request.
            slot_id, _ = await request_run(self._require(), self._prefix, job, self._who())
        hint = RunRequested(slot_id, job).message()
        await self._execute(("PUBLISH", hint_channel(self._prefix), hint))
        await self._audit("run-now", job, who_acts, note)
        return slot_id

    async def backfill(
        self,
        job: str,
        start: datetime,
        end: datetime,
        *,
        note: str | None = None,
        by: str | None = None,
    ) -> BackfillInfo:
        """Run the slots of ``job``'s own schedule in ``[start, end)`` once across the
        fleet, oldest first: an instance that runs the job drives the backfill (another
        takes over if it dies), and claims each slot with trigger ``"backfill"`` under
        the job's overlap, retry and timeout rules. A slot already settled (run, or
        skipped, while its state or history keeps it) is not run again, and is counted
        as such; one the job's ``exclude=`` leaves out is recorded skipped. While the job
        is paused the backfill waits. ``JobInfo.backfill`` (``anarchon inspect``, the
        dashboard) shows its progress.

        Args:
            job: A job the fleet registered that uses the lease strategy.
            start: The range's first instant (an aware datetime; included).
            end: The range's end (aware; excluded), at the latest now.
            note: Why (up to 500 characters), kept with the backfill and in the audit log.
            by: Who (up to 200 characters; None: ``user@host`` of this process).

        Returns:
            The backfill as stored (``status`` ``"running"``).

        Raises:
            InvalidJobError: The fleet did not register the job, or no instance alive
                runs it.
            InvalidOptionError: The job does not use the lease strategy, or the range
                is empty, ends after now, or holds no slot or more than 10,000 slots.
            RunOverlapError: A backfill of the job is running already (cancel it first),
                or the job is finished.
        """
        await self._lease_state_key(job, "backfill")
        note, who_acts = check_note(note), who(by)
        start_ms, end_ms = _range_ms(start, end, await self._server_now_ms())
        definitions, _ = await self._definitions([job])
        schedule = _reckoned(definitions[job])
        slots = None
        if schedule is not None:
            slots = count_slots(schedule, start_ms, end_ms, BACKFILL_SLOTS_MAX)
            _check_slots(job, slots)
        await self._refuse_finished(job, "backfill it")
        await self._require_runner(job, "a backfill asked for now would wait until one starts")
        with answered_in_time(_DEADLINE_SEC):
            await start_backfill(
                self._require(), self._prefix, job, start_ms, end_ms, slots, who_acts, note
            )
        # The instances that run the job hear of it now (without hints: at their next
        # registration renewal, within 10 s).
        await self._execute(("PUBLISH", hint_channel(self._prefix), BackfillAsked(job).message()))
        what = f"[{iso_ms(start_ms)}, {iso_ms(end_ms)})"
        await self._audit("backfill", job, who_acts, _with_note(what, note))
        (info,) = [found.backfill for found in await self.jobs([job]) if found.backfill]
        return info

    async def cancel_backfill(
        self, job: str, *, note: str | None = None, by: str | None = None
    ) -> bool:
        """Cancel ``job``'s running backfill: no slot of it starts from now on (one
        under way runs to its end, as any run). Kept a week, as cancelled, with who and
        why (``JobInfo.backfill``), and in the audit log.

        Args:
            job: A job the fleet registered that uses the lease strategy.
            note: Why (up to 500 characters), for the audit log.
            by: Who (up to 200 characters; None: ``user@host`` of this process).

        Returns:
            Whether a backfill of the job was running.
        """
        await self._lease_state_key(job, "backfill")
        note, who_acts = check_note(note), who(by)
        with answered_in_time(_DEADLINE_SEC):
            cancelled = await cancel_backfill(
                self._require(), self._prefix, job, _with_note(who_acts, note)
            )
        if cancelled:
            await self._audit("cancel-backfill", job, who_acts, note)
        return cancelled

    async def _refuse_finished(self, job: str, to: str) -> None:
        """``RunOverlapError`` for a finished job (its ``max_runs`` reached, or its
        ``end_at`` passed): what the fleet would not run."""
        found = await self.jobs([job])
        if found and found[0].finished:
            raise RunOverlapError(
                f"'{visible(job, _NAME_SHOWN)}' is finished ({found[0].finished}): raise its "
                f"bound and deploy to {to}"
            )

    async def _require_runner(self, job: str, why: str) -> None:
        """``InvalidJobError`` unless a live instance runs ``job`` (or the instances could
        not all be read)."""
        instances = await self.instances()
        unread = await self.instance_count() > len(instances)
        if not unread and not may_run(job, instances):
            raise InvalidJobError(
                f"no instance alive runs '{visible(job, _NAME_SHOWN)}': {why}; start one, "
                "then ask again"
            )

    # ---------------------------------------------------------------- helpers

    @property
    def quarantine(self) -> Quarantine:
        """The malformed entries of this store that this process met (shared with any
        scheduler of the process on the same prefix: each logged and counted once)."""
        return quarantine_of(self._prefix)

    @property
    def _prefix(self) -> str:
        return self.backend.prefix

    def _require(self) -> Connection:
        if self._conn is None:
            raise SchedulerStateError("an Inspector reads inside `async with Inspector(...)`")
        return self._conn

    async def _execute(self, command: tuple[Any, ...]) -> Any:
        with answered_in_time(_DEADLINE_SEC):
            return await self._require().execute(command)

    async def _read_each(self, commands: list[Command]) -> list[Any]:
        """The replies to ``commands`` (each a read of one key), ``_COMMANDS_A_TRIP`` a
        round trip, each within its deadline (so that a store of many jobs is read in a
        few round trips, not one a job). A key that holds another type than the command
        reads is a ``MalformedEntry`` in its reply's place (it costs that key alone);
        any other error reply in a round trip is raised (a connection lost fails the
        round trip in the adapter)."""
        replies: list[Any] = []
        for first in range(0, len(commands), _COMMANDS_A_TRIP):
            trip = commands[first : first + _COMMANDS_A_TRIP]
            with answered_in_time(_DEADLINE_SEC):
                chunk = await self._require().pipeline(trip)
            for command, reply in zip(trip, chunk, strict=True):
                if isinstance(reply, ServerReplyError):
                    if reply.kind != "WRONGTYPE":
                        raise reply
                    reply = MalformedEntry(
                        str(command[1]), "", f"holds another type of value ({reply.message})"
                    )
                replies.append(reply)
        return replies

    async def _server_now_ms(self) -> int:
        seconds, micros = await self._execute(("TIME",))
        return int(seconds) * 1000 + int(micros) // 1000

    async def _definitions(
        self, names: Sequence[str] | None = None
    ) -> tuple[dict[str, dict[str, Any]], dict[str, MalformedEntry]]:
        """The jobs' stored definitions: every job's, or those of ``names`` the store
        knows (read by name, so a page of jobs costs the same at any number of them);
        and apart, those that are malformed (each quarantined)."""
        if names is None:
            pairs = list(_mapping(await self._execute(("HGETALL", self._keys.jobs))).items())
        else:
            wanted = sorted(set(names))
            if not wanted:
                return {}, {}
            bodies = await self._execute(("HMGET", self._keys.jobs, *wanted))
            pairs = [(n, b) for n, b in zip(wanted, bodies, strict=True) if b is not None]
        definitions: dict[str, dict[str, Any]] = {}
        malformed: dict[str, MalformedEntry] = {}
        for name, body in pairs:
            try:
                definitions[name] = decode_definition(self._keys.jobs, name, body)
            except MalformedEntry as entry:
                self.quarantine.add(entry, f"job {visible(name, _NAME_SHOWN)!r} in the views")
                malformed[name] = entry
        return definitions, malformed

    def _check_job(
        self,
        job: str,
        definitions: dict[str, dict[str, Any]],
        malformed: dict[str, MalformedEntry],
    ) -> str:
        """``job``, if the store holds its definition and it reads; else an error that
        says which, and shows no other stored name (they are any number, any text)."""
        shown = visible(job, _NAME_SHOWN)
        if job in malformed:
            raise InvalidJobError(
                f"job '{shown}': its definition in the store is malformed "
                f"({malformed[job].problem}); it is quarantined: see 'anarchon inspect', "
                "and the instances that run the job write it again when they renew"
            )
        if job not in definitions:
            raise InvalidJobError(
                f"no job named '{shown}' in the store under prefix {self._prefix!r}; check "
                "the name and --prefix ('anarchon inspect' lists the jobs; a job appears "
                "once an instance that runs it has started)"
            )
        return job

    async def _lease_state_key(self, job: str, what: str) -> str:
        definitions, malformed = await self._definitions([job])
        self._check_job(job, definitions, malformed)
        strategy = _strategy(definitions[job])
        if strategy != "lease":
            raise InvalidOptionError(
                f"{what} needs the 'lease' strategy; job '{visible(job, _NAME_SHOWN)}' runs "
                f"with {strategy!r}"
            )
        return JobKeys.for_job(self._prefix, job).state

    def _history_of(self, job: str, strategy: str, reply: Any) -> list[RunResult]:
        """A job's results from the reply of its ``history_command``: a results key of
        another type is quarantined (no results), a member that does not read is left
        out (``parse_history`` quarantines it)."""
        if isinstance(reply, MalformedEntry):
            self.quarantine.add(reply, f"the history of {visible(job, _NAME_SHOWN)!r}")
            return []
        return parse_history(job, reply, self._results_key(job, strategy), self._prefix)

    def _fingerprints(self, name: str, raw: Any, now_ms: int) -> tuple[str, ...]:
        """A job's live fingerprints as the registry's definitions hold them (none for
        an entry that does not read: quarantined)."""
        if raw is None:
            return ()
        try:
            return decode_fingerprints(self._keys.definitions, name, raw, now_ms)
        except MalformedEntry as entry:
            self.quarantine.add(entry, f"job {visible(name, _NAME_SHOWN)!r} in the views")
            return ()

    def _instant(self, key: str, field: str, raw: Any) -> int | None:
        """An instant stored in epoch ms, or None (quarantined) for one that is not."""
        try:
            return decode_instant(key, field, raw)
        except MalformedEntry as entry:
            self.quarantine.add(entry)
            return None

    async def _kind_limits_in_use(
        self, kind: str, record: KindRecord
    ) -> tuple[int | None, int | None, int | None]:
        """A kind's fleet permits held now, its firings started within its rate limit's
        period, and its key groups with timers waiting (each None without that limit),
        over its buckets, by this machine's clock."""
        now_ms = int(wall_ms())
        buckets = kind_keys(self._prefix, kind, record.buckets)
        reads: dict[str, list[Command]] = {}
        if record.max_concurrent_fleet is not None:
            reads["permits"] = [("ZCOUNT", k.permits, f"({now_ms}", "+inf") for k in buckets]
        if record.rate_limit is not None:
            since = now_ms - record.rate_limit[1]
            reads["starts"] = [("ZCOUNT", k.starts, f"({since}", now_ms) for k in buckets]
        if record.max_concurrent_per_group is not None:
            reads["groups"] = [("ZCARD", k.groups) for k in buckets]
        commands = [command for part in reads.values() for command in part]
        replies = iter(await self._read_each(commands)) if commands else iter(())
        counts = {
            name: sum(_count(next(replies)) or 0 for _ in part) for name, part in reads.items()
        }
        return counts.get("permits"), counts.get("starts"), counts.get("groups")

    async def _peek(self, store: TimerStore, kind: str, buckets: int) -> TimerPeek:
        """``store.peek`` of a kind; a record it cannot read is a ``MalformedEntry``."""
        try:
            return await store.peek(kind, buckets, 1)
        except MalformedEntry:
            raise
        except (ValueError, OverflowError) as exc:  # a due time that is not a number
            due = TimerKeys.for_kind(self._prefix, kind, 0, buckets).due
            raise MalformedEntry(
                due, "", f"a due time or timer that does not read ({exc})"
            ) from None

    def _results_key(self, job: str, strategy: str) -> str:
        if strategy == "lease":
            return JobKeys.for_job(self._prefix, job).results
        return ClaimOnlyKeys.for_job(self._prefix, job).results

    @staticmethod
    def _who() -> str:
        import os
        import socket

        return f"{socket.gethostname()}:{os.getpid()}"


def _mapping(reply: Any) -> dict[str, str]:
    """HGETALL's reply as a dict, whatever the client gave (a dict or a flat list)."""
    if isinstance(reply, dict):
        return {str(k): str(v) for k, v in reply.items()}
    items = list(reply or [])
    return {str(items[i]): str(items[i + 1]) for i in range(0, len(items), 2)}


def _score_pairs(reply: Any) -> list[tuple[str, float]]:
    """A WITHSCORES reply as ``[(member, score)]``: flat (RESP2), pairs (RESP3) or a dict
    (a score that is no finite number, as ``+inf`` may be stored, is the largest)."""
    found = []
    for member, score in score_pairs(reply):
        number = float(score)
        found.append((_text(member), number if math.isfinite(number) else float(2**53)))
    return found


def _text(raw: Any) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


#: The job-wide fields of a job's state hash that ``jobs()`` reads: who paused it, its
#: runs that ended, why it is finished, when its last run ended ok (lease_state.lua).
_JOB_FLAGS = (PAUSED_FIELD, RUNS_FIELD, FINISHED_FIELD, LAST_OK_FIELD)


def _job_flags(reply: Any) -> dict[str, str]:
    """HMGET's reply of ``_JOB_FLAGS`` as text, by field (those present)."""
    if not isinstance(reply, list | tuple):
        return {}  # a state key of another type: quarantined by the job's other reads
    return {
        name: _text(value)
        for name, value in zip(_JOB_FLAGS, reply, strict=False)
        if value is not None
    }


def _span_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _at(text: str | None) -> datetime | None:
    """A stored instant (server ms, as text), or None for none or one that is not."""
    if text is None or not text.isdigit() or int(text) > MAX_INSTANT_MS:
        return None
    return from_epoch_ms(int(text))


def _runs(text: str | None) -> int | None:
    """The count of a job's ended runs (None: one that is not a count)."""
    if text is None:
        return 0
    return int(text) if text.isdigit() and len(text) < 20 else None


def _finished(definition: dict[str, Any], stored: str | None, now_ms: int) -> str | None:
    """Why a job claims nothing more, or None: its ``end_at`` passed (checked by
    decode_definition), or the store marked it finished (its ``max_runs``)."""
    end_at = definition.get("end_at")
    if end_at is not None and int(end_at) <= now_ms:
        return f"end_at {iso_ms(int(end_at))} passed"
    return stored


def _range_ms(start: datetime, end: datetime, now_ms: int) -> tuple[int, int]:
    """A backfill's range in epoch ms, checked: aware datetimes, start before end, and
    end at the latest now (the server's clock)."""
    for name, moment in (("start", start), ("end", end)):
        if not isinstance(moment, datetime) or moment.tzinfo is None:
            raise InvalidOptionError(
                f"a backfill's {name} must be an aware datetime (with its zone, such as "
                f"2027-01-01T00:00:00+00:00), got {visible(repr(moment), 80)}"
            )
    start_ms, end_ms = to_epoch_ms(start), to_epoch_ms(end)
    if start_ms >= end_ms:
        raise InvalidOptionError(
            f"a backfill's start ({iso_ms(start_ms)}) must be before its end ({iso_ms(end_ms)})"
        )
    if end_ms > now_ms:
        raise InvalidOptionError(
            f"a backfill runs past slots: its end ({iso_ms(end_ms)}) is after now "
            f"({iso_ms(now_ms)}, the server's clock); the job's schedule runs the rest"
        )
    return start_ms, end_ms


def _check_slots(job: str, slots: int) -> None:
    """A backfill's count of slots: at least one, at most ``BACKFILL_SLOTS_MAX``."""
    if slots > BACKFILL_SLOTS_MAX:
        raise InvalidOptionError(
            f"the range holds more than {BACKFILL_SLOTS_MAX:,} slots of "
            f"'{visible(job, _NAME_SHOWN)}': ask for a shorter range (several backfills, "
            "one after the other)"
        )
    if slots == 0:
        raise InvalidOptionError(
            f"no slot of '{visible(job, _NAME_SHOWN)}' falls in the range: nothing to backfill"
        )


def _with_note(text: str, note: str | None) -> str:
    """``text``, and ``note`` after it (cut to fit an audit note)."""
    if not note:
        return text
    return f"{text}: {note}"[:AUDIT_NOTE_MAX]


def _reckoned(definition: dict[str, Any]) -> Schedule | None:
    """A job's schedule made from its stored definition, when the store can reckon it (a
    cron expression in its zone, an interval); None for one it cannot (custom, combined,
    bounded, or with exclusions: its instances report its fire times)."""
    if "next_fires_ms" in definition or "exclude" in definition:
        return None
    try:
        if definition.get("cron"):
            return CronSchedule(str(definition["cron"]), str(definition.get("timezone")))
        if definition.get("every_ms"):
            return IntervalSchedule(int(definition["every_ms"]))
    except Exception:
        return None
    return None


def _next_fire(definition: dict[str, Any], now_ms: int) -> datetime | None:
    """The next slot after now, reckoned from a built-in schedule; a custom one reports
    the next slot its instances last saw."""
    found = _next_fires(definition, now_ms, 1)
    return found[0] if found else None


def _next_fires(definition: dict[str, Any], now_ms: int, count: int) -> list[datetime]:
    """The next ``count`` slots after now, reckoned from a built-in schedule (a cron
    expression in its zone, an interval); of one the store cannot reckon (custom,
    combined, or with exclusions), the next ones its instances last reported (up to
    ten), or the one next slot an older instance reported (none when it is past)."""
    schedule = _reckoned(definition)
    if schedule is not None:
        return fire_times(schedule, now_ms, count)
    reported = definition.get("next_fires_ms")  # checked by decode_definition
    if reported is None:
        seen = definition.get("next_slot_ms")
        reported = [] if seen is None else [seen]
    return [from_epoch_ms(int(fire)) for fire in reported if int(fire) > now_ms][:count]


def _lease(job: str, keys: JobKeys, slot_id: str, raw: Any, now_ms: int) -> LeaseInfo | None:
    """A run's lease state (``LeaseState``), if it is in progress; ``MalformedEntry`` for
    a slot id or a state that does not read."""
    if not is_slot_id(slot_id):
        raise MalformedEntry(keys.active, slot_id, "not a slot id")
    state = LeaseState.decode(raw, keys.state, slot_id)
    if state is None or not state.in_progress:
        return None
    slot_ms = slot_ms_of(slot_id)
    return LeaseInfo(
        job=job,
        slot=from_epoch_ms(slot_ms),
        slot_ms=slot_ms,
        slot_id=slot_id,
        status=cast(Any, state.status),
        attempt=state.attempt,
        runner=state.runner,
        fence=state.fence,
        trigger=state.trigger,
        left_ms=max(state.until_ms - now_ms, 0),
    )


@dataclass(frozen=True, slots=True)
class CutInstanceInfo(InstanceInfo):
    """An instance whose registration is longer than ``INSTANCE_BYTES_MAX``: read up to
    there, its ``jobs`` are the first it registered (and its timer kinds and running
    count, when they came before the cut; else none and 0). ``record_bytes``: the
    registration's whole length."""

    record_bytes: int = 0


def jobs_cut(instance: InstanceInfo) -> bool:
    """Whether ``instance``'s job list was read in part (``CutInstanceInfo``)."""
    return isinstance(instance, CutInstanceInfo)


#: The most timers a page of ``timer_page`` asks for.
_TIMER_PAGE_MAX = 1000


def _page_cursor(cursor: str | None, buckets: int) -> tuple[int, int]:
    """A ``TimerPage.cursor`` as the scan takes it: ``(bucket, HSCAN cursor)``."""
    if cursor is None:
        return (0, 0)
    bucket, _, scan = cursor.partition("-")
    if bucket.isdigit() and scan.isdigit() and int(bucket) < buckets and len(scan) <= 20:
        return (int(bucket), int(scan))
    raise InvalidOptionError(
        f"cursor {visible(cursor, 40)!r} is no page's cursor: pass one a TimerPage gave, or "
        "none for the first page"
    )


def _count(reply: object) -> int | None:
    """A count a read answered (None for a reply that is none: a key of another type,
    quarantined where it was read)."""
    return reply if isinstance(reply, int) and not isinstance(reply, bool) else None


def fleet_text(running: int | None, limit: object) -> str:
    """A job's or a kind's runs holding a fleet permit against its limit, for the views:
    ``2 of 5``, ``5 of 5 (full)``; empty without a limit."""
    if running is None or not isinstance(limit, int):
        return ""
    return f"{running} of {limit}" + (" (full)" if running >= limit else "")


def definitions_text(job: JobInfo) -> str | None:
    """What the live instances say of a job's definition, when they disagree (None when
    they agree): which is in force, and which are not."""
    if len(job.definitions) < 2:
        return None
    in_force, *older = job.definitions
    return (
        f"the live instances disagree on its definition: {in_force} is in force (the "
        f"newest); {', '.join(older)} not (their instances claim no new slot of it)"
    )


def backfill_text(backfill: BackfillInfo | None) -> str:
    """A job's backfill in one line (``anarchon backfill``, ``inspect``, the dashboard)."""
    if backfill is None:
        return "no backfill"
    slots = "?" if backfill.slots is None else str(backfill.slots)
    start, end = (iso_ms(to_epoch_ms(at)) for at in (backfill.start, backfill.end))
    text = (
        f"backfill of {slots} slot(s) in [{start}, {end}) {backfill.status}: "
        f"{backfill.decided} decided ({backfill.ran_ok} ok, {backfill.ran_failed} failed, "
        f"{backfill.settled_before} settled before, {backfill.skipped} skipped)"
    )
    if backfill.status == "running":
        text += f", next {iso_ms(to_epoch_ms(backfill.next))}"
        if backfill.driver:
            text += f", driven by {backfill.driver}"
    if backfill.reason:
        text += f"; {backfill.reason}"
    text += f"; asked by {backfill.by}" + (f": {backfill.note}" if backfill.note else "")
    return text


def kind_limits_text(kind: TimerKindInfo) -> str:
    """A kind's fleet limits and what is held of them, for the views: ``3 of 3 (full)
    at once; 12 of 100 started in 60000 ms``; ``-`` without one."""
    parts = []
    if kind.max_concurrent_fleet is not None:
        parts.append(f"{fleet_text(kind.fleet_running, kind.max_concurrent_fleet)} at once")
    if kind.rate_limit is not None:
        count, period_ms = kind.rate_limit
        started = "?" if kind.rate_started is None else kind.rate_started
        parts.append(f"{started} of {count} started in {period_ms} ms")
    if kind.max_concurrent_per_group is not None:
        waiting = "?" if kind.groups_waiting is None else kind.groups_waiting
        parts.append(f"{kind.max_concurrent_per_group} per key group ({waiting} waiting)")
    return "; ".join(parts) or "-"


def running_text(instance: InstanceInfo) -> str:
    """How many handlers ``instance`` ran at its last renewal, and of how many its bound
    lets it (``-`` for a registration read in part, whose count may have been cut)."""
    if jobs_cut(instance):
        return "-"
    bound = instance.max_concurrent
    if bound is None:
        return str(instance.running)
    return f"{instance.running} of {bound}" + (" (full)" if instance.running >= bound else "")


def runners(job: str, instances: Iterable[InstanceInfo]) -> list[str]:
    """The ids of ``instances`` that run ``job`` (as they registered, in what was read
    of their registrations), sorted."""
    return sorted(instance.id for instance in instances if job in instance.jobs)


def may_run(job: str, instances: Iterable[InstanceInfo]) -> bool:
    """Whether an instance of ``instances`` runs ``job``, or may (its job list was read
    in part); False: no instance alive runs it, and its slots wait for one."""
    return any(job in instance.jobs or jobs_cut(instance) for instance in instances)


def _strategy(definition: dict[str, Any]) -> str:
    """The strategy of a job's stored definition."""
    return str(definition.get("strategy", "lease"))


def newest_failures(recent: dict[str, list[RunResult]], limit: int) -> list[RunResult]:
    """The newest ``limit`` attempts of ``recent`` that failed, were interrupted or were
    cancelled, across the jobs."""
    found = [r for results in recent.values() for r in results if r.status in _FAILED]
    found.sort(key=lambda r: (r.finished_at, r.slot_ms, r.attempt), reverse=True)
    return found[:limit]


def inspector_over(backend: RedisBackend[Any], conn: Connection) -> Inspector:
    """An Inspector that reads through a connection someone else opened (and closes):
    ``anarchon.prometheus`` reads its gauges on the scheduler's."""
    inspector = Inspector(backend)
    inspector._conn = conn
    return inspector
