"""The read side of a store, without a running scheduler: what the fleet runs, the runs
in progress, the instances alive, the history; and the fleet-wide operations (pause,
resume, run now). ``anarchon inspect`` and its sibling commands print what this reads.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from types import TracebackType
from typing import Any, cast

import anyio

from .._errors import (
    ConnectionFailedError,
    InvalidJobError,
    InvalidOptionError,
    SchedulerStateError,
    reason,
)
from .._model.schedule import CronSchedule, IntervalSchedule, Schedule, SlotClock, from_epoch_ms
from .._model.values import (
    InstanceInfo,
    JobInfo,
    LeaseInfo,
    RunResult,
    TimerKindInfo,
)
from .._store.backend import RedisBackend
from .._store.contract import fleet_slot_id, slot_ms_of
from .._store.keys import (
    ClaimOnlyKeys,
    JobKeys,
    RegistryKeys,
    RunRequested,
    hint_channel,
)
from .._store.lease import PAUSED_FIELD, set_paused
from .._store.records import LeaseState, history_command, parse_history, parse_result, read_history
from .._store.scripts import ScriptCall, lease_script, run_scripts
from .._store.timers import TimerStore
from ..clients import Command, Connection, ServerReplyError, TransportError

__all__ = ["Inspector", "newest_failures", "runners"]

#: Each read is one or a few round trips, each with this deadline.
_DEADLINE_SEC = 10.0
#: Reads of many jobs (their histories, their leases) go this many commands a round trip.
_COMMANDS_A_TRIP = 200
#: The statuses of a recorded attempt that did not go well.
_FAILED = ("failed", "interrupted", "cancelled")


class Inspector:
    """Reads a store (and pauses, resumes and runs its jobs) from any process, with no
    scheduler running there: a dashboard, a script, ``anarchon inspect``::

        async with Inspector(RedisBackend(redis="redis://localhost:6379")) as store:
            for job in await store.jobs():
                print(job.name, job.next_fire, job.paused, job.last)
            await store.pause("report")

    The jobs it knows are the ones the fleet's instances registered (each writes its
    jobs' definitions when it starts and every 10 s while it runs); a job name it does
    not know is an ``InvalidJobError``, not an empty answer.
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
        self._conn = await self.backend.open_connection()
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
        """The names of the jobs the fleet registered, sorted (their names alone: cheap
        at any number of jobs)."""
        return sorted(str(name) for name in await self._execute(("HKEYS", self._keys.jobs)))

    async def jobs(self, names: Sequence[str] | None = None) -> list[JobInfo]:
        """Every job the fleet registered (or those of ``names`` that it did), by name."""
        definitions = await self._definitions(names)
        now_ms = int(time.time() * 1000)
        names = sorted(definitions)  # those of ``names`` the store knows
        if not names:
            return []
        seen_ms = await self._execute(("HMGET", self._keys.first_seen, *names))
        first_seen = {
            name: str(seen) for name, seen in zip(names, seen_ms, strict=True) if seen is not None
        }
        strategies = {name: _strategy(definitions[name]) for name in names}
        leased = [name for name in names if strategies[name] == "lease"]
        # Each job's newest result, and each lease job's pause flag.
        commands: list[Command] = [
            history_command(self._results_key(name, strategies[name]), 1) for name in names
        ]
        commands += [
            ("HGET", JobKeys.for_job(self._prefix, name).state, PAUSED_FIELD) for name in leased
        ]
        replies = await self._pipeline(commands)
        newest = dict(zip(names, replies[: len(names)], strict=True))
        paused = dict(zip(leased, replies[len(names) :], strict=True))
        found = []
        for name in names:
            definition = definitions[name]
            strategy = strategies[name]
            paused_by = None if paused.get(name) is None else str(paused[name])
            members = list(newest[name] or [])
            last = parse_result(name, str(members[0])) if members else None
            seen = first_seen.get(name)
            found.append(
                JobInfo(
                    name=name,
                    schedule=str(definition.get("schedule")),
                    cron=definition.get("cron"),
                    every_ms=definition.get("every_ms"),
                    timezone=str(definition.get("timezone") or "UTC"),
                    strategy=strategy,
                    next_fire=_next_fire(definition, now_ms),
                    paused=paused_by is not None,
                    paused_by=paused_by,
                    last=last,
                    first_seen=None if seen is None else from_epoch_ms(int(seen)),
                    options={
                        key: value
                        for key, value in definition.items()
                        if key not in ("schedule", "cron", "every_ms", "timezone", "strategy")
                    },
                )
            )
        return found

    async def leases(
        self, job: str | None = None, *, names: Sequence[str] | None = None
    ) -> list[LeaseInfo]:
        """The runs in progress (holding a live lease, or waiting for their next attempt),
        of every lease-strategy job (or of ``job``, or of those of ``names``), oldest slot
        first."""
        definitions = await self._definitions(None if job is not None else names)
        names = [self._check_job(job, definitions)] if job is not None else sorted(definitions)
        leased = [name for name in names if _strategy(definitions[name]) == "lease"]
        keys = {name: JobKeys.for_job(self._prefix, name) for name in leased}
        now_ms = await self._server_now_ms()
        # Each job's slots in progress, then the state of each (only jobs that have any).
        members = await self._pipeline([("SMEMBERS", keys[name].active) for name in leased])
        active = {
            name: sorted(str(slot) for slot in slots)
            for name, slots in zip(leased, members, strict=True)
            if slots
        }
        states = await self._pipeline(
            [("HMGET", keys[name].state, *slots) for name, slots in active.items()]
        )
        found: list[LeaseInfo] = []
        for (name, slots), raws in zip(active.items(), states, strict=True):
            for slot_id, raw in zip(slots, raws, strict=True):
                lease = _lease(name, slot_id, raw, now_ms)
                if lease is not None:
                    found.append(lease)
        return sorted(found, key=lambda lease: (lease.slot_ms, lease.job))

    async def instances(self) -> list[InstanceInfo]:
        """The instances alive (registered, and renewing), by id."""
        now_ms = await self._server_now_ms()
        scored = await self._execute(
            ("ZRANGEBYSCORE", self._keys.instances, now_ms, "+inf", "WITHSCORES")
        )
        pairs = _score_pairs(scored)
        if not pairs:
            return []
        bodies = await self._execute(("MGET", *(self._keys.instance(i) for i, _ in pairs)))
        found = []
        for (instance_id, expires_ms), body in zip(pairs, bodies, strict=True):
            if body is None:
                continue  # it withdrew as this was read
            data = json.loads(str(body))
            found.append(
                InstanceInfo(
                    id=instance_id,
                    host=str(data.get("host", "")),
                    pid=int(data.get("pid", 0)),
                    version=str(data.get("version", "")),
                    started=from_epoch_ms(int(data.get("started_ms", 0))),
                    strategy=str(data.get("strategy", "lease")),
                    jobs=tuple(data.get("jobs", ())),
                    timer_kinds=tuple(data.get("timer_kinds", ())),
                    running=int(data.get("running", 0)),
                    expires_in_ms=max(int(expires_ms) - now_ms, 0),
                )
            )
        return sorted(found, key=lambda instance: instance.id)

    async def history(self, job: str, limit: int = 100) -> list[RunResult]:
        """The newest ``limit`` recorded attempts of ``job`` (and its skipped slots),
        newest first."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidOptionError(f"limit must be a whole number, 1 or more, got {limit!r}")
        definitions = await self._definitions()
        name = self._check_job(job, definitions)
        strategy = _strategy(definitions[name])
        return await self._read_history(name, strategy, limit)

    async def recent(
        self, limit: int = 100, names: Sequence[str] | None = None
    ) -> dict[str, list[RunResult]]:
        """Every job's (or those of ``names``') newest ``limit`` recorded attempts, newest
        first, by job name."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidOptionError(f"limit must be a whole number, 1 or more, got {limit!r}")
        definitions = await self._definitions(names)
        names = sorted(definitions)  # those of ``names`` the store knows
        replies = await self._pipeline(
            [
                history_command(
                    self._results_key(name, _strategy(definitions[name])),
                    limit,
                )
                for name in names
            ]
        )
        return {
            name: parse_history(name, reply) for name, reply in zip(names, replies, strict=True)
        }

    async def failures(self, limit: int = 20) -> list[RunResult]:
        """The newest ``limit`` attempts, across the jobs, that failed, were interrupted
        (their runner vanished) or were cancelled."""
        return newest_failures(await self.recent(max(limit * 5, 100)), limit)

    async def timers(self) -> list[TimerKindInfo]:
        """Each kind of timer the fleet fires: how many keys have one pending, and the
        first to fall due."""
        kinds = _mapping(await self._execute(("HGETALL", self._keys.timer_kinds)))
        store = TimerStore(self._require(), prefix=self._prefix, runner="inspector")
        found = []
        for kind in sorted(kinds):
            buckets = int(json.loads(kinds[kind]).get("buckets", 1))
            with _answered_in_time():
                peek = await store.peek(kind, buckets, 1)
            first = peek.first[0] if peek.first else None
            found.append(
                TimerKindInfo(
                    kind=kind,
                    buckets=buckets,
                    pending=peek.count,
                    next_due=None if first is None else from_epoch_ms(first[1]),
                    next_key=None if first is None else first[0].key,
                )
            )
        return found

    # -------------------------------------------------------------- operating

    async def pause(self, job: str) -> bool:
        """Pause ``job`` across the fleet (see ``Scheduler.pause``); False if it was paused
        already."""
        state = await self._lease_state_key(job, "pause")
        by = f"{self._who()} at {datetime.now().astimezone().isoformat(timespec='seconds')}"
        with _answered_in_time():
            return await set_paused(self._require(), state, by)

    async def resume(self, job: str) -> bool:
        """Resume ``job``: its next slot runs; False if it was not paused."""
        state = await self._lease_state_key(job, "resume")
        with _answered_in_time():
            return await set_paused(self._require(), state, None)

    async def run_now(self, job: str) -> str:
        """Ask the fleet to run ``job`` now, once: the run is stored as due, and the
        instances that run the job hear of it on the hint channel (any one of them takes
        it; without hints, the first to claim the job's next slot does). It is one
        attempt, recorded with trigger ``"manual"``; overlap rules apply. Returns the
        run's slot id (its history entries carry it)."""
        state = await self._lease_state_key(job, "run-now")
        if not runners(job, await self.instances()):
            raise InvalidJobError(
                f"no instance alive runs {job!r}: a run asked for now would wait until one "
                "starts; start one, then ask again"
            )
        keys = JobKeys.for_job(self._prefix, job)
        requested_ms = int(time.time() * 1000)
        slot_id = fleet_slot_id(requested_ms, secrets.token_hex(4))
        call = ScriptCall(
            lease_script("request_run"),
            (state, keys.active, keys.slots),
            (slot_id, slot_ms_of(slot_id), self._who()),
        )
        with _answered_in_time():
            (reply,) = await run_scripts(self._require(), [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        hint = RunRequested(slot_id, job).message()
        await self._execute(("PUBLISH", hint_channel(self._prefix), hint))
        return slot_id

    # ---------------------------------------------------------------- helpers

    @property
    def _prefix(self) -> str:
        return self.backend.prefix

    def _require(self) -> Connection:
        if self._conn is None:
            raise SchedulerStateError("an Inspector reads inside `async with Inspector(...)`")
        return self._conn

    async def _execute(self, command: tuple[Any, ...]) -> Any:
        with _answered_in_time():
            return await self._require().execute(command)

    async def _pipeline(self, commands: list[Command]) -> list[Any]:
        """The replies to ``commands``, ``_COMMANDS_A_TRIP`` a round trip, each within
        its deadline (so that a store of many jobs is read in a few round trips, not one
        a job); an error reply in a round trip is raised (a connection lost fails the
        round trip in the adapter)."""
        replies: list[Any] = []
        for first in range(0, len(commands), _COMMANDS_A_TRIP):
            with _answered_in_time():
                chunk = await self._require().pipeline(commands[first : first + _COMMANDS_A_TRIP])
                for reply in chunk:
                    if isinstance(reply, ServerReplyError):
                        raise reply
            replies += chunk
        return replies

    async def _server_now_ms(self) -> int:
        seconds, micros = await self._execute(("TIME",))
        return int(seconds) * 1000 + int(micros) // 1000

    async def _definitions(self, names: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
        """The jobs' stored definitions: every job's, or those of ``names`` the store
        knows (read by name, so a page of jobs costs the same at any number of them)."""
        if names is None:
            raw = _mapping(await self._execute(("HGETALL", self._keys.jobs)))
            return {name: json.loads(body) for name, body in raw.items()}
        wanted = sorted(set(names))
        if not wanted:
            return {}
        bodies = await self._execute(("HMGET", self._keys.jobs, *wanted))
        return {
            name: json.loads(str(body))
            for name, body in zip(wanted, bodies, strict=True)
            if body is not None
        }

    def _check_job(self, job: str, definitions: dict[str, dict[str, Any]]) -> str:
        if job not in definitions:
            known = ", ".join(sorted(definitions)) or "none"
            raise InvalidJobError(
                f"no job named {job!r} in the store under prefix {self._prefix!r} (jobs: "
                f"{known}); check the name and --prefix (a job appears once an instance "
                "that runs it has started)"
            )
        return job

    async def _lease_state_key(self, job: str, what: str) -> str:
        definitions = await self._definitions()
        self._check_job(job, definitions)
        strategy = _strategy(definitions[job])
        if strategy != "lease":
            raise InvalidOptionError(
                f"{what} needs the 'lease' strategy; job {job!r} runs with {strategy!r}"
            )
        return JobKeys.for_job(self._prefix, job).state

    async def _read_history(self, job: str, strategy: str, limit: int) -> list[RunResult]:
        with _answered_in_time():
            return await read_history(self._require(), self._results_key(job, strategy), job, limit)

    def _results_key(self, job: str, strategy: str) -> str:
        if strategy == "lease":
            return JobKeys.for_job(self._prefix, job).results
        return ClaimOnlyKeys.for_job(self._prefix, job).results

    @staticmethod
    def _who() -> str:
        import os
        import socket

        return f"{socket.gethostname()}:{os.getpid()}"


@contextmanager
def _answered_in_time() -> Iterator[None]:
    """A read's round trips: within their deadline, and an error that says so (a frozen
    server, a dropped connection) instead of a timeout's traceback."""
    try:
        with anyio.fail_after(_DEADLINE_SEC):
            yield
    except TimeoutError:
        raise ConnectionFailedError(
            f"the server did not answer within {_DEADLINE_SEC:g} s; check that it is not "
            "frozen or overloaded"
        ) from None
    except TransportError as exc:
        raise ConnectionFailedError(f"lost the connection to the server: {reason(exc)}") from exc


def _mapping(reply: Any) -> dict[str, str]:
    """HGETALL's reply as a dict, whatever the client gave (a dict or a flat list)."""
    if isinstance(reply, dict):
        return {str(k): str(v) for k, v in reply.items()}
    items = list(reply or [])
    return {str(items[i]): str(items[i + 1]) for i in range(0, len(items), 2)}


def _score_pairs(reply: Any) -> list[tuple[str, int]]:
    """A WITHSCORES reply as ``[(member, score)]``: flat (RESP2), pairs (RESP3) or a dict."""
    if isinstance(reply, dict):
        return [(str(m), int(float(s))) for m, s in reply.items()]
    items = list(reply or [])
    if items and isinstance(items[0], list | tuple):
        return [(str(m), int(float(s))) for m, s in items]
    return [(str(items[i]), int(float(items[i + 1]))) for i in range(0, len(items), 2)]


def _next_fire(definition: dict[str, Any], now_ms: int) -> datetime | None:
    """The next slot after now, reckoned from a built-in schedule; a custom one reports
    the next slot its instances last saw."""
    schedule: Schedule | None = None
    try:
        if definition.get("cron"):
            schedule = CronSchedule(str(definition["cron"]), str(definition.get("timezone")))
        elif definition.get("every_ms"):
            schedule = IntervalSchedule(int(definition["every_ms"]))
    except Exception:
        schedule = None
    if schedule is not None:
        slot_ms = SlotClock(schedule).next_slot_ms(now_ms)
        return None if slot_ms is None else from_epoch_ms(slot_ms)
    seen = definition.get("next_slot_ms")
    return None if seen is None else from_epoch_ms(int(seen))


def _lease(job: str, slot_id: str, raw: Any, now_ms: int) -> LeaseInfo | None:
    """A run's lease state (``LeaseState``), if it is in progress."""
    state = LeaseState.decode(raw)
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


def runners(job: str, instances: Iterable[InstanceInfo]) -> list[str]:
    """The ids of ``instances`` that run ``job`` (as they registered), sorted; none: no
    instance alive runs it, and its slots wait for one."""
    return sorted(instance.id for instance in instances if job in instance.jobs)


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
