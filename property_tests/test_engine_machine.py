"""The real engine in a state machine: three ``Scheduler`` instances, each with its own
connection through a ``FaultProxy``, on a server the machine can ``kill -9``.

The lease machine proves the scripts; this one proves the engine around them (the
agenda, the claimer, the runner, the lease keeper, settle), which the scripts cannot
see: a takeover that starves, a scheduler ended by a wrapped connection error, a
``stop()`` that hangs, a claim dropped after one error reply. Nothing is simulated:
the schedulers run in an event loop of their own (a blocking portal, asyncio or trio)
on the real clock, with leases of 900 ms and jobs firing every 250 ms to 6 s (and one
whose schedule raises after a few slots: that disables its job alone), and the rules
act on them from the test's thread:

- ``wait``: time passes;
- ``fault_connection``: one instance's connection drops replies the server applied,
  refuses and resets connections, or cuts each connection after its next request;
- ``lose_a_claim_reply_at_a_slot``: one instance's claims of a slot are applied and
  their replies lost (the others' arrive later, so it won): its next try must hear
  that and run the slot on time, not leave it to a backup a lease later (unless an
  older run of the job, a late takeover after an earlier fault, still held it, or
  waited for its next attempt: then the slot is rightly skipped);
- ``stall``: one instance's traffic freezes both ways (its heartbeats stop, its
  handlers go on, as a ``SIGSTOP`` looks from outside), then flows again, late
  (``partition_a_run_as_it_is_replaced``: the runner of the ``replace`` job's run, from
  just before the slot that replaces it);
- ``server_error``: the server itself answers OOM, READONLY or BUSY for a while
  (``server_error_past_a_slot``: until just past a slot of a job 1.5 s apart or more);
- ``freeze_server``: the server stands still (SIGSTOP), then goes on (SIGCONT), applying
  what was sent meanwhile (``freeze_server_past_a_slot``: until 400 ms after a slot);
- ``kill``: an instance's connection is cut and refused, then its task is cancelled:
  it releases nothing, so its leases expire as a dead process's would;
- ``interrupt``: an instance's task is cancelled while its connection works: it
  stops as ``stop()`` does and releases what it holds;
- ``stop``: a graceful ``stop()``, sometimes cancelled part way and called again;
- ``restart``: a killed or stopped instance starts again, as a new runner;
- ``run_now``: a manual run on one instance;
- ``restart_server``: ``kill -9`` of the server and a start on the same port, from
  its append-only file (fsynced on every write) or empty (``restart_server_past_a_slot``:
  down from before a slot of a job 1.5 s apart or more until just after it).

Handlers write to a ledger in the test process, independent of the store (a wiped
store cannot wipe it). After every step the machine checks, in words:

1. No slot starts twice unless the earlier attempt failed (a retry), or its runner
   was dead, stalled, stopping or cut off (or the server was down, slow or wiped)
   before the later one started; and the later attempt always has a higher attempt
   number and a higher fence (after a wipe, attempts count from 1 again, but the
   fence still grows). No attempt number exceeds ``max_attempts``. After a wipe,
   every job's fences are above all it had before.
2. Every slot due while the server and at least one instance were healthy (from
   a second before the slot until its lateness window closed) started, or the store
   records it skipped (overlap) or interrupted. Healthy means: no fault of the
   machine's, and none of the load a shared 2-core machine puts on it either: the
   machine watches the schedulers' event loop (a 50 ms sleep that overshoots by
   100 ms) and the server (a PING on a connection of its own that takes 100 ms)
   and counts such spans as faults. A slot of a job 1.5 s apart or more whose first
   claims failed because the server refused them (OOM, READONLY, BUSY) or was down
   is judged all the same when the server was back within 300 ms of the slot (a
   frozen one, 600 ms: the claim that missed its deadline is sent again at once): the
   engine's next try of a failed claim comes in time, and must start the slot within
   ``max_late_ms``.
3. Every run settles: no unsettled run stays in the active set without a live lease
   for longer than a lease plus one period of its job plus a claim cycle (for a job
   much slower than the lease, than a second: its backups ask when the lease runs
   out), once the server and an instance were healthy that long.
4. The store stays bounded: the history within ``history_size``, the active set
   within a few runs, the state within the slots since the start.
5. The store agrees with the handlers: an attempt recorded ok (failed) is one
   whose handler returned (raised), never one cancelled or told its lease was lost.
6. No instance's task dies; ``stop()`` (and a kill) returns within its bound
   (``stop_grace_ms`` plus a few round-trip deadlines, plus slack for a loaded
   machine), no handler of a stopped instance is left running, and no connection of
   it is left open; an interrupted instance leaves no live lease of its own behind.
7. No instance ever runs more handlers at once than its ``max_concurrent``, nor more
   runs of a job with a bound of its own (``burst``, whose runs overlap) than that
   bound, whatever the faults.
8. A run of the job with ``overlap="replace"`` ends within two heartbeats of a newer
   slot's start (its runner's next heartbeat is refused), or within a lease when its
   runner or the server was not healthy meanwhile; a slot of the ``buffer_one`` job that
   a newer one took the place of is recorded skipped (rule 2 judges it so).
9. No more runs of the job with a fleet-wide limit (``permit``, ``max_concurrent_fleet``)
   go on at once across the fleet than the limit, unless the runner of each one beyond
   it (or the server) was not healthy since its win (its permit ran out with its lease:
   a dead, stalled or cut-off runner's handler goes on until it hears); and its permits
   come back: while the server and an instance were healthy for a lease and two polls,
   a run of it started.
10. Resumable attempts are fenced: a later attempt of a ``long`` slot (a takeover, or a
    retry) starts with the progress an earlier attempt of the slot saved (never one
    whose save was refused), and no older than the newest save answered as kept before
    the later attempt won (unless the store was wiped meanwhile).

At the end every fault is healed, each instance runs again, the machine waits for
the last windows to close, checks everything once more, and stops the instances.
"""

from __future__ import annotations

import itertools
import logging
import math
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from concurrent import futures
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Literal, NoReturn

import anyio
import anyio.from_thread
import pytest
import redis
from anyio.abc import TaskStatus
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from anarchon import (
    ConnectionFailedError,
    LeaseLostError,
    OverlapPolicy,
    RedisBackend,
    Run,
    RunOverlapError,
    Scheduler,
)
from anarchon._model.clock import round_trip_deadline_sec
from anarchon._store.contract import is_manual
from anarchon._store.keys import JobKeys
from property_tests.profiles import PROFILE
from tests.clients import Target, make_client
from tests.faults import FaultProxy, busy, oom, read_only
from tests.restartable_server import RestartableServer
from tests.servers import ServerSpec, discover_servers

pytestmark = pytest.mark.engine_tier

LEASE_MS = 900
HEARTBEAT_MS = 300
RETRY_DELAY_MS = 200
MAX_LATE_MS = 1500
STOP_GRACE_MS = 300
HISTORY_SIZE = 60
MAX_ATTEMPTS = 3
ROUND_TRIP_SEC = round_trip_deadline_sec(LEASE_MS)
#: stop() returns within its grace plus a few round trips (claim batch in flight,
#: unanswered claims, finishes, closing); the slack is for a loaded 2-core machine.
STOP_BOUND_SEC = STOP_GRACE_MS / 1000 + 4 * ROUND_TRIP_SEC + 2.0
#: A window is healthy only if it starts this long after a fault healed: a batch in
#: flight times out, a dropped connection reconnects.
SETTLE_AFTER_FAULT_MS = 1000 * ROUND_TRIP_SEC + 700
#: The schedulers' event loop counts as starved when a 50 ms sleep overshoots by this
#: much, and the server as slow when a PING takes this long: a loaded machine, which
#: delays every instance's round trips as a fault would.
SLOW_MS = 100
#: Shorter overshoots are not faults, but they delay what the loop does all the same
#: (a cancellation, a start): the checks that allow for a starved loop count them too.
LAG_MS = 20
#: A slot whose first claims failed because the server refused them with an error
#: reply (OOM, READONLY, BUSY) or was down (killed, then started again) is still owed
#: a run when the server was back this soon after the slot: the claim is sent again
#: after 50 ms, 250 ms and 500 ms (+-20 %), so the try after the server is back comes
#: well within ``MAX_LATE_MS``, and before the next slot for a job at least
#: ``BACK_JOB_MIN_EVERY_MS`` apart (sooner, the engine rightly drops the old slot for
#: the on-time one).
SERVER_BACK_BY_MS = 300
BACK_JOB_MIN_EVERY_MS = 1500
#: The jobs that far apart, whose slot a fault may end just after.
SPARSE_JOBS = ("hang", "long")
#: A lost claim reply at a slot (``lose_a_claim_reply_at_a_slot``): of jobs whose runs
#: end before their next slot; from ``LOST_REPLY_LEAD_MS`` before the slot until 100 ms
#: after, the instance's next two requests are applied and their replies lost. Its next
#: try then hears it won, so the slot starts within ``LOST_REPLY_LATE_MS`` (a backup
#: would start it a lease after the slot); it is judged that long after the slot.
LOST_REPLY_JOBS = ("long", "sync")
LOST_REPLY_LEAD_MS = 60
LOST_REPLY_LATE_MS = 700
LOST_REPLY_JUDGED_AFTER_MS = 1400
NAMES = ("a", "b", "c")

Behaviour = Literal["quick", "slow", "flaky", "long", "hang", "sync", "burst", "permit"]


@dataclass(frozen=True)
class JobSpec:
    name: str
    every_ms: int
    behaviour: Behaviour
    overlap: OverlapPolicy = "skip"


#: Cadences faster and slower than the lease; handlers that succeed, fail, hang,
#: run longer than the lease (heartbeats) and run in a worker thread.
JOBS = (
    JobSpec("tick", 250, "quick"),
    JobSpec("slow", 600, "slow", overlap="wait"),
    JobSpec("flaky", 700, "flaky"),
    JobSpec("long", 2000, "long"),
    JobSpec("hang", 1500, "hang"),
    JobSpec("sync", 1000, "sync"),
    # Much slower than the lease: a dead runner's lease is taken over by a backup (every
    # instance up claimed the slot too), not by the next slot's claim.
    JobSpec("rare", 6000, "long"),
    # Each run outlasts its job's period: every new slot ends the run in progress
    # (overlap="replace"), or waits in the one place behind it ("buffer_one").
    JobSpec("swap", 900, "long", overlap="replace"),
    JobSpec("buffer", 500, "slow", overlap="buffer_one"),
)
#: The job whose new slots end its run in progress.
REPLACING = "swap"
#: How each instance connects, per event loop: a URL, a user's send() client, and a
#: client library's own async client.
CLIENT_KINDS = {
    "asyncio": ("url", "send", "redis-py-async"),
    "trio": ("url", "send", "glide-async"),
}
#: Jobs whose handlers end soon (run_now waits for the run).
QUICK_JOBS = ("tick", "flaky")
#: A job beside JOBS whose schedule breaks: it disables that job alone (its slots are
#: not judged), and must end nothing else.
BRITTLE = JobSpec("brittle", 2000, "quick")
#: Each instance's bound on handlers at once (``max_concurrent``), above what the jobs
#: need: a bound the engine keeps under every fault, not one that starves a slot.
MAX_CONCURRENT = 10
#: A job beside JOBS whose runs overlap (every 400 ms, each 0.7 s), bounded at one run
#: at once per instance (its own ``max_concurrent``): with fewer than two instances up
#: the fleet has rightly no room for all of its slots, so they are not judged; what is
#: judged is that no instance ever runs more than its bounds allow.
BURST = JobSpec("burst", 400, "burst", overlap="allow")
BURST_BOUND = 1
#: A job beside JOBS whose runs overlap (every 300 ms; one in three takes 0.9 s, the
#: others 0.2 s), at most two at once in the fleet (``max_concurrent_fleet``): its slots
#: wait for a permit at times, so they are not judged by rule 2; rule 9 judges the limit
#: and that a dead runner's permits come back.
PERMITTED = JobSpec("permit", 300, "permit", overlap="allow")
FLEET_BOUND = 2
#: How long an instance waits at most between two claims of a slot waiting for a permit
#: (the scheduler's ``timer_poll_ms``, its default).
PERMIT_POLL_MS = 1000


class BrittleSchedule:
    """Every 2 s, until its fourth answer on an instance: then it raises."""

    def __init__(self) -> None:
        self.answers = 0

    def next_after(self, moment: datetime, /) -> datetime:
        self.answers += 1
        if self.answers >= 4:
            raise RuntimeError("the brittle schedule broke")
        every_ms = BRITTLE.every_ms
        after_ms = int(moment.timestamp() * 1000)
        return datetime.fromtimestamp(next_slot_ms(every_ms, after_ms) / 1000, UTC)


def fail(message: str) -> NoReturn:
    """Fail the step, and print why at once: the engine runs on the real clock, so
    Hypothesis's replay of a failing example may fail elsewhere or not at all, and then
    reports the first failure inside a ``FlakyFailure``. That is an ``AssertionError``
    (not ``pytest.fail``'s ``Failed``, a ``BaseException`` that Hypothesis wraps bare),
    so the report's one-line summary, all a CI log may keep, says why."""
    print(f"engine machine: {message}", file=sys.stderr, flush=True)
    raise AssertionError(f"engine machine: {message}")


def check(condition: bool, message: str | Callable[[], str]) -> None:
    if not condition:
        fail(message() if callable(message) else message)


def how_it_ended(future: Future[Any]) -> str | None:
    """None when an instance's ended task returned, else what ended it, on the
    failure's first line (a CI log may keep no more): each exception a group holds and
    where it was raised, then the traceback. An exception that is no ``Exception`` (a
    ``CancelledError`` that escaped its scope, in a group) would otherwise reach
    Hypothesis bare, and it would report only that the example was flaky."""
    if future.cancelled():
        return "its task was cancelled from outside the instance's own cancel scope"
    exc = future.exception()
    if exc is None:
        return None
    leaves: list[BaseException] = []
    pending = [exc]
    while pending:
        current = pending.pop()
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        else:
            leaves.append(current)
    where = []
    for leaf in leaves:
        frames = traceback.extract_tb(leaf.__traceback__)
        at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
        where.append(f"{leaf!r}{at}")
    return f"{type(exc).__name__}: {'; '.join(where)}\n" + "".join(traceback.format_exception(exc))


def wall_ms() -> float:
    return time.time() * 1000


# ------------------------------------------------------------------ the ledger


@dataclass
class Start:
    """One handler start, as the handler saw it."""

    job: str
    slot_id: str
    slot_ms: int
    attempt: int
    fence: int
    runner: str
    trigger: str
    started_ms: float
    ended_ms: float | None = None
    #: ok, raised, cancelled (async), lost (a sync handler told its lease is gone)
    outcome: str | None = None
    #: What ``run.progress`` said at the start (a ``long`` run: an earlier attempt's).
    progress_seen: object = None
    #: Each ``save_progress`` of a ``long`` run: (value, "ok" | "refused" | "unknown",
    #: when it returned).
    saves: list[tuple[str, str, float]] = field(default_factory=list)


class Ledger:
    """Every handler start and end, written by the handlers (in the portal's thread,
    or a worker thread), read by the rules."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.starts: list[Start] = []

    def started(self, run: Run) -> Start:
        # A manual run's slot is its own (the fence tells two apart).
        slot_id = f"manual:{run.fence}" if run.trigger == "manual" else str(run.slot_ms)
        entry = Start(
            run.job, slot_id, run.slot_ms, run.attempt, run.fence, run.runner, run.trigger,
            wall_ms(),
        )  # fmt: skip
        with self._lock:
            self.starts.append(entry)
        return entry

    def ended(self, entry: Start, outcome: str) -> None:
        with self._lock:
            entry.ended_ms = wall_ms()
            entry.outcome = outcome

    def snapshot(self) -> list[Start]:
        with self._lock:
            return list(self.starts)


def progress_order(value: str) -> tuple[int, int]:
    """A ``long`` run's progress value (``<fence>:<step>``) in the order it was kept."""
    fence, _, step = value.partition(":")
    return int(fence), int(step)


def next_slot_ms(every_ms: int, after_ms: float) -> int:
    """The first slot of a job every ``every_ms`` after ``after_ms``."""
    return (int(after_ms) // every_ms + 1) * every_ms


def every_ms_of(job: str) -> int:
    return next(spec.every_ms for spec in JOBS if spec.name == job)


def slot_index(spec: JobSpec, slot_ms: int) -> int:
    return slot_ms // spec.every_ms


async def save(run: Run, entry: Start, value: str) -> None:
    """``run.save_progress(value)``, its answer written in the ledger (never raised: the
    engine ends an attempt that lost its lease on its own). It is in the ledger as
    "unknown" from before it is sent: a handler cancelled while the save is in flight
    (its lease lost, on a loaded machine) may have had it applied."""
    index = len(entry.saves)
    entry.saves.append((value, "unknown", wall_ms()))
    try:
        await run.save_progress(value)
        outcome = "ok"
    except LeaseLostError:
        outcome = "refused"
    except Exception:
        outcome = "unknown"  # no answer in time: it may or may not have been applied
    entry.saves[index] = (value, outcome, wall_ms())


async def behave(spec: JobSpec, run: Run, entry: Start | None = None) -> None:
    """What a run of ``spec`` does; the same on every instance for the same attempt."""
    index = slot_index(spec, run.slot_ms)
    if spec.behaviour == "quick":
        await anyio.sleep(0.005)
    elif spec.behaviour == "slow":
        await anyio.sleep(0.4 + (index % 5) * 0.1)  # 0.4-0.8 s, often past the next slot
    elif spec.behaviour == "flaky":
        await anyio.sleep(0.01)
        if run.attempt == 1 and index % 3 == 0:
            raise RuntimeError(f"attempt {run.attempt} of slot {run.slot_ms} fails")
    elif spec.behaviour == "long":
        # Longer than the lease: it lives on heartbeats, and keeps where it is (a value
        # per step that names its attempt) as a resumable attempt would.
        for step in (1, 2):
            await anyio.sleep(0.5)
            if entry is not None and run.trigger != "manual":
                await save(run, entry, f"{run.fence}:{step}")
        await anyio.sleep(0.5)
    elif spec.behaviour == "burst":
        await anyio.sleep(0.7)
    elif spec.behaviour == "permit":
        await anyio.sleep(0.9 if index % 3 == 0 else 0.2)
    elif spec.behaviour == "hang":
        if run.attempt == 1 and index % 4 == 0:
            await anyio.sleep_forever()  # until its lease is lost or its instance stops
        await anyio.sleep(0.05)


def make_handler(spec: JobSpec, ledger: Ledger) -> Callable[..., Any]:
    if spec.behaviour == "sync":

        def sync_handler(run: Run) -> None:
            entry = ledger.started(run)
            outcome = "ok"
            try:
                # 0.6 s in steps, checking the lease: longer than a stop's grace, so a
                # stop meanwhile tells it its lease is gone.
                for _ in range(60):
                    if run.lease_lost.is_set():
                        outcome = "lost"
                        return
                    time.sleep(0.01)
            finally:
                ledger.ended(entry, outcome)

        return sync_handler

    async def handler(run: Run) -> None:
        entry = ledger.started(run)
        entry.progress_seen = run.progress
        outcome = "cancelled"
        try:
            await behave(spec, run, entry)
            outcome = "ok"
        except Exception:
            outcome = "raised"
            raise
        finally:
            ledger.ended(entry, outcome)

    return handler


# ------------------------------------------------------------- what was wrong when


@dataclass
class Window:
    """A span of wall time (epoch ms) when ``who`` (a runner id, or "server") was not
    healthy."""

    who: str
    start_ms: float
    end_ms: float = math.inf
    what: str = ""
    #: For the load the machine observed: how long the loop stood still (or the PING
    #: took), without the settling time added to ``end_ms``.
    took_ms: float = 0.0
    #: For the server's error replies, its restart or its freeze: when it answered
    #: again, without the settling time; and how soon after a slot it must have
    #: answered again for the slot to be owed a run all the same.
    healed_ms: float | None = None
    back_by_ms: float = 0.0

    def overlaps(self, start_ms: float, end_ms: float) -> bool:
        return self.start_ms <= end_ms and start_ms <= self.end_ms


@dataclass
class Stated:
    """A slot an instance said it skipped or missed (a log line), with when."""

    job: str
    first_slot_ms: int
    last_slot_ms: int
    said_ms: float
    reason: str


class SkipLog(logging.Handler):
    """Collects the engine's own statements that it skips or misses slots."""

    _SKIPS: ClassVar[dict[str, str]] = {
        "%s: slot %s skipped: a newer slot (%s) is due too, after a gap": "backlog",
        "%s: slot %s missed: %.0f ms late, max_late_ms=%d and catch_up_ms=%d": "too late",
        "%s: slot %s skipped: it waited %.0f ms behind an older run, longer than a "
        "waiting slot may (lateness or catch-up window plus a lease plus 30 s)": "waited",
    }

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._lock2 = threading.Lock()
        self.stated: list[Stated] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) < 2 or not isinstance(args[1], datetime):
            return
        job, moment = str(args[0]), int(args[1].timestamp() * 1000)
        said_ms = record.created * 1000
        reason = self._SKIPS.get(str(record.msg))
        if reason is not None:
            stated = Stated(job, moment, moment, said_ms, reason)
        elif record.msg == "%s: slots after %s were missed (no claim in time)":
            # Every slot after ``moment`` older than the lateness window then.
            stated = Stated(job, moment + 1, int(said_ms) - MAX_LATE_MS, said_ms, "gap")
        else:
            return
        with self._lock2:
            self.stated.append(stated)

    def explains(self, job: str, slot_ms: int) -> Stated | None:
        with self._lock2:
            for stated in self.stated:
                if stated.job == job and stated.first_slot_ms <= slot_ms <= stated.last_slot_ms:
                    return stated
        return None


# ---------------------------------------------------------------- the instances


@dataclass
class Instance:
    """One scheduler, behind its own proxy; a restart makes a new runner."""

    name: str
    proxy: FaultProxy
    #: "url" (anarchon opens and closes its own connection) or a kind of
    #: ``tests.clients.make_client`` (the user's own client, closed by the machine).
    client_kind: str = "url"
    generation: int = 0
    close_client: Callable[[], Awaitable[None]] | None = None
    scheduler: Scheduler[Any] | None = None
    future: Future[None] | None = None
    scope: anyio.CancelScope | None = None
    runner: str = ""

    @property
    def up(self) -> bool:
        return self.scheduler is not None


def newest_servers() -> list[ServerSpec]:
    """The newest Redis and the newest Valkey with a binary to start (the machine
    kills and restarts its own server)."""
    newest: dict[str, ServerSpec] = {}
    for spec in discover_servers():
        if spec.binary is None:
            continue
        if spec.family not in newest or spec.version > newest[spec.family].version:
            newest[spec.family] = spec
    return [newest[family] for family in ("valkey", "redis") if family in newest]


class EngineMachine(RuleBasedStateMachine):
    server_spec: ServerSpec
    event_loop: str = "asyncio"

    def __init__(self) -> None:
        super().__init__()
        self._tmp = tempfile.TemporaryDirectory(prefix="anarchon-engine-machine-")
        assert self.server_spec.binary is not None
        self.server = RestartableServer(self.server_spec.binary, Path(self._tmp.name), True)
        self.server.start()
        self.admin = self._admin()
        self.prefix = "em:"
        self.ledger = Ledger()
        self.skips = SkipLog()
        logging.getLogger("anarchon").addHandler(self.skips)
        self.windows: list[Window] = []
        #: The loop's shorter overshoots (``LAG_MS`` to ``SLOW_MS``): when, how long.
        self.lags: list[tuple[float, float]] = []
        self._watching = threading.Event()
        self.wipes: list[float] = []
        #: When each wiped server was killed and when it was up again, empty.
        self.wipe_spans: list[tuple[float, float]] = []
        #: How long the server took to start (answer PING) the last time.
        self._start_took_ms = 200.0
        #: Each job's state as it was just before each wipe.
        self.forgotten: dict[str, dict[str, str]] = {spec.name: {} for spec in JOBS}
        self.checked_until: dict[str, int] = {}
        #: Slots judged with a healthy window (True) and without one (False).
        self.judged = {True: 0, False: 0}
        #: When each runner (an instance's generation) was up, its scheduler started.
        self.runner_up_ms: dict[str, float] = {}
        self.began_ms = wall_ms()
        self._portal_cm = anyio.from_thread.start_blocking_portal(self.event_loop)
        self.portal = self._portal_cm.__enter__()
        self._lag_future = self.portal.start_task_soon(self._watch_loop)
        self._server_watch = threading.Thread(target=self._watch_server, daemon=True)
        self._server_watch.start()
        self.instances = {
            name: Instance(name, FaultProxy(self.server.url), kind)
            for name, kind in zip(NAMES, CLIENT_KINDS[self.event_loop], strict=True)
        }
        for instance in self.instances.values():
            self._start(instance)
        for spec in JOBS:
            # The first slot each job may be asked to have run: one every instance saw.
            self.checked_until[spec.name] = int(self.began_ms)

    # -------------------------------------------------------------- plumbing

    def _admin(self) -> redis.Redis:
        return redis.Redis(
            port=self.server.port, socket_timeout=10, protocol=2, decode_responses=True
        )

    async def _watch_loop(self) -> None:
        """Records when the schedulers' event loop was starved (a loaded machine): every
        instance is then as good as stalled."""
        while True:
            before = time.monotonic()
            await anyio.sleep(0.05)
            lag_ms = (time.monotonic() - before - 0.05) * 1000
            if lag_ms > SLOW_MS:
                self._slow("loop", lag_ms + 50, f"starved {lag_ms:.0f} ms")
            elif lag_ms > LAG_MS:
                self.lags.append((wall_ms() - lag_ms, lag_ms))

    def _watch_server(self) -> None:
        """Records when the server answered slowly, on a connection of its own."""
        client = redis.Redis(port=self.server.port, socket_timeout=5, protocol=2)
        try:
            while not self._watching.wait(0.05):
                before = time.monotonic()
                try:
                    client.ping()
                except redis.RedisError:
                    continue  # down: the rule that took it down says so
                took_ms = (time.monotonic() - before) * 1000
                if took_ms > SLOW_MS:
                    self._slow("server", took_ms, f"slow {took_ms:.0f} ms")
        finally:
            client.close()

    def _slow(self, who: str, took_ms: float, what: str) -> None:
        now = wall_ms()
        # What it delays comes after it, by about as long as it lasted (a claim batch
        # or a heartbeat that waited behind it), not by a fault's settling time.
        self.windows.append(Window(who, now - took_ms, now + max(took_ms, 200), what, took_ms))

    def _start(self, instance: Instance) -> None:
        instance.generation += 1
        runner = f"{instance.name}{instance.generation}"
        client: Any = instance.proxy.url
        if instance.client_kind != "url":
            target = Target(url=instance.proxy.url)
            client, instance.close_client = self.portal.call(
                make_client, instance.client_kind, target
            )
        scheduler: Scheduler[Any] = Scheduler(
            RedisBackend(redis=client, prefix=self.prefix),
            lease_ms=LEASE_MS,
            heartbeat_ms=HEARTBEAT_MS,
            retry_delay_ms=RETRY_DELAY_MS,
            history_size=HISTORY_SIZE,
            stop_grace_ms=STOP_GRACE_MS,
            instance_id=runner,
            max_concurrent=MAX_CONCURRENT,
        )
        for spec in JOBS:
            scheduler.add_job(
                make_handler(spec, self.ledger),
                every_ms=spec.every_ms,
                name=spec.name,
                overlap=spec.overlap,
                max_attempts=MAX_ATTEMPTS,
                max_late_ms=MAX_LATE_MS,
            )

        scheduler.add_job(
            make_handler(BRITTLE, self.ledger), BrittleSchedule(), name=BRITTLE.name,
            max_late_ms=MAX_LATE_MS,
        )  # fmt: skip
        scheduler.add_job(
            make_handler(BURST, self.ledger), every_ms=BURST.every_ms, name=BURST.name,
            overlap=BURST.overlap, max_late_ms=MAX_LATE_MS, max_concurrent=BURST_BOUND,
        )  # fmt: skip
        scheduler.add_job(
            make_handler(PERMITTED, self.ledger), every_ms=PERMITTED.every_ms,
            name=PERMITTED.name, overlap=PERMITTED.overlap, max_late_ms=MAX_LATE_MS,
            max_concurrent_fleet=FLEET_BOUND,
        )  # fmt: skip

        async def host(task_status: TaskStatus[anyio.CancelScope]) -> None:
            with anyio.CancelScope() as scope:
                async with scheduler:
                    task_status.started(scope)
                    await anyio.sleep_forever()

        future, scope = self.portal.start_task(host, name=f"instance {runner}")
        instance.scheduler, instance.future, instance.scope = scheduler, future, scope
        instance.runner = runner
        self.runner_up_ms[runner] = wall_ms()

    def _end(self, instance: Instance, how: str, started: float) -> None:
        """Wait for the instance's task to end (after a kill or a stop) within the bound."""
        assert instance.future is not None and instance.scope is not None
        self.portal.call(instance.scope.cancel)
        began_ms = wall_ms() - (time.monotonic() - started) * 1000
        left = 3 * STOP_BOUND_SEC - (time.monotonic() - started)
        if not futures.wait([instance.future], timeout=max(left, 0.1)).done:
            fail(f"{how} of {instance.runner} did not return within {3 * STOP_BOUND_SEC} s")
        ended = how_it_ended(instance.future)
        check(ended is None, lambda: f"{how} of {instance.runner} raised {ended}")
        took = time.monotonic() - started
        # A starved loop runs the stop late by as long as it stood still.
        starved_sec = self._starved_ms(began_ms, wall_ms()) / 1000
        check(
            took <= STOP_BOUND_SEC + starved_sec,
            f"{how} of {instance.runner} took {took:.2f} s (bound {STOP_BOUND_SEC} s, the "
            f"event loop stood still for {starved_sec:.2f} s of it)",
        )
        event(f"{how} took {'<1' if took < 1 else '>=1'} s")
        # Nothing leaks: every handler of the runner has returned.
        running = [
            s for s in self.ledger.snapshot() if s.runner == instance.runner and s.ended_ms is None
        ]
        check(not running, f"handlers of {instance.runner} still run after its {how}: {running}")
        instance.scheduler = instance.future = instance.scope = None
        self._close_client(instance)
        if instance.client_kind == "url":
            # Nothing leaks: anarchon closes the connection it opened from a URL (the
            # proxy sees the close a moment later). A user's own client is the user's:
            # a sync one may still finish, in a worker thread, a command anarchon gave
            # up waiting for.
            give_up = time.monotonic() + 2
            while instance.proxy.connections_open and time.monotonic() < give_up:
                time.sleep(0.01)
            check(
                instance.proxy.connections_open == 0,
                f"after its {how}, {instance.runner} still has "
                f"{instance.proxy.connections_open} connection(s) open to the server: the "
                "connection anarchon opened from its URL was not closed",
            )

    def _close_client(self, instance: Instance) -> None:
        """The user's own client outlives the scheduler: the user closes it."""
        if instance.close_client is not None:
            close, instance.close_client = instance.close_client, None

            async def close_in_time() -> None:
                with anyio.move_on_after(5):
                    await close()

            self.portal.call(close_in_time)

    def _hurt(self, who: str, what: str) -> Window:
        window = Window(who, wall_ms(), what=what)
        self.windows.append(window)
        return window

    @contextmanager
    def _impaired(self, who: str, what: str) -> Iterator[Window]:
        window = self._hurt(who, what)
        try:
            yield window
        finally:
            window.end_ms = wall_ms() + SETTLE_AFTER_FAULT_MS

    def _up(self) -> list[Instance]:
        return [instance for instance in self.instances.values() if instance.up]

    # ---------------------------------------------------------------- rules

    @rule(ms=st.integers(100, 1500))
    def wait(self, ms: int) -> None:
        time.sleep(ms / 1000)

    @precondition(lambda self: bool(self._up()))
    @rule(
        data=st.data(),
        kind=st.sampled_from(["drop_replies", "refuse", "reset", "drop_after_request"]),
        ms=st.integers(100, 1500),
    )
    def fault_connection(self, data: st.DataObject, kind: str, ms: int) -> None:
        instance = data.draw(st.sampled_from(self._up()))
        proxy = instance.proxy
        event(f"fault: {kind}")
        with self._impaired(instance.runner, kind):
            if kind == "drop_replies":
                proxy.drop_replies(True)
                time.sleep(ms / 1000)
                proxy.drop_replies(False)
                proxy.reset()  # connections that lost a reply are out of step
            elif kind == "refuse":
                proxy.refuse(True)
                time.sleep(ms / 1000)
                proxy.refuse(False)
            elif kind == "reset":
                proxy.reset()
                time.sleep(ms / 1000)
            else:
                proxy.drop_after_request(data.draw(st.integers(1, 3), label="requests"))
                time.sleep(ms / 1000)
                proxy.drop_after_request(0)

    @precondition(lambda self: bool(self._up()))
    @rule(data=st.data(), job=st.sampled_from(LOST_REPLY_JOBS))
    def lose_a_claim_reply_at_a_slot(self, data: st.DataObject, job: str) -> None:
        """One instance's claims of the next slot of ``job`` reach the server, which
        applies them, and their connection is cut before the reply: it won (the
        others' claims arrive 80 ms later: their links are slowed meanwhile) but does
        not know. Its next try, sent again with the same token, hears it won and runs
        the slot on time; a claim dropped after a lost reply would leave the slot to a
        backup, once the lease nobody runs has expired."""
        instance = data.draw(st.sampled_from(self._up()))
        others = [other for other in self._up() if other is not instance]
        # At a slot after the faults still settling have settled (if that is soon), so
        # that the slot can be judged.
        live = {"server"} | {other.runner for other in self._up()}
        settled_ms = max(
            [w.end_ms for w in self.windows if w.who in live and w.end_ms < math.inf],
            default=0.0,
        )
        calm_ms = min(settled_ms + SETTLE_AFTER_FAULT_MS, wall_ms() + 3000)
        slot = next_slot_ms(every_ms_of(job), max(wall_ms() + 300, calm_ms))
        time.sleep(max(0.0, (slot - LOST_REPLY_LEAD_MS - wall_ms()) / 1000))
        event("fault: a claim reply lost at a slot")
        with self._impaired(instance.runner, "claim reply lost") as window:
            for other in others:
                other.proxy.delay(80)
            instance.proxy.drop_after_request(2)
            try:
                time.sleep(max(0.0, (slot + 100 - wall_ms()) / 1000))
            finally:
                instance.proxy.drop_after_request(0)
                for other in others:
                    other.proxy.delay(0)
        time.sleep(max(0.0, (slot + LOST_REPLY_JUDGED_AFTER_MS - wall_ms()) / 1000))
        span = (slot - SETTLE_AFTER_FAULT_MS, wall_ms())
        # The server's troubles, and the instances': those up, and those gone just
        # before the slot (a dead runner's lease of the previous slot may block it).
        troubles = [
            w
            for w in self.windows
            if w is not window
            and w.who != "loop"
            and w.overlaps(*span)
            and (w.who in live or w.start_ms >= slot - LEASE_MS - 300)
        ]
        if troubles or not instance.up:
            what = sorted(
                {
                    ("server " if w.who == "server" else "instance ") + (w.what or "?").split()[0]
                    for w in troubles
                }
            )
            event(f"a lost claim reply not judged: {', '.join(what) or 'its instance went'}")
            return

        def scheduled_runs() -> tuple[list[Start], list[float]]:
            """The job's scheduled runs in the ledger, and the starts of the slot's."""
            runs = [s for s in self.ledger.snapshot() if s.job == job and s.trigger != "manual"]
            return runs, [s.started_ms for s in runs if s.slot_ms == slot]

        runs, starts = scheduled_runs()
        starved_ms = self._starved_ms(slot, wall_ms())
        if not starts and starved_ms:
            # A loop that stood still starts the slot as much later.
            time.sleep(starved_ms / 1000)
            runs, starts = scheduled_runs()
        if not starts:
            keys = JobKeys.for_job(self.prefix, job)
            state = self.admin.hget(keys.state, str(slot)) or ""
            # An older run of the job held it at the slot: its handler still ran, or had
            # just ended and its finish was among the requests cut at the slot, or it
            # waited between two attempts (a retry, or a takeover, starts after the
            # slot). A fault healed before the slot can leave one: a takeover of the run
            # it orphaned starts a lease later and runs for its whole length. The slot
            # is then rightly skipped (overlap="skip"), whoever's claim was first.
            held_from_ms = slot - LOST_REPLY_LEAD_MS - 1000 * ROUND_TRIP_SEC
            older: dict[int, list[Start]] = {}
            for s in runs:
                if s.slot_ms < slot:
                    older.setdefault(s.slot_ms, []).append(s)
            holders = [
                attempts
                for attempts in older.values()
                if min(s.started_ms for s in attempts) <= slot
                and any(s.ended_ms is None or s.ended_ms >= held_from_ms for s in attempts)
            ]
            if state.split("|")[0] == "skipped" and holders:
                event("a lost claim reply not judged: an older run of the job held it")
                return
            near = [s for s in runs if abs(s.started_ms - slot) < 4 * every_ms_of(job)]
            fail(
                f"{job} slot {slot} did not start, though only {instance.runner}'s claim "
                f"reply was lost and its connection worked again at once; its state: "
                f"{state!r}; the job's runs around it: {near}"
            )
        late_ms = min(starts) - slot
        check(
            late_ms <= LOST_REPLY_LATE_MS + self._starved_ms(slot, min(starts)),
            f"{job} slot {slot} started {late_ms:.0f} ms late, though only "
            f"{instance.runner}'s claim reply was lost and its connection worked again "
            "at once: its next try of the claim should have heard that it won",
        )
        event("a lost claim reply judged")

    @precondition(lambda self: bool(self._up()))
    @rule(data=st.data(), ms=st.integers(200, 2500))
    def stall(self, data: st.DataObject, ms: int) -> None:
        instance = data.draw(st.sampled_from(self._up()))
        with self._impaired(instance.runner, "stall"):
            instance.proxy.pause()
            time.sleep(ms / 1000)
            instance.proxy.resume()

    @precondition(lambda self: bool(self._up()))
    @rule(ms=st.integers(300, 1500))
    def partition_a_run_as_it_is_replaced(self, ms: int) -> None:
        """The runner of the ``replace`` job's run in progress loses touch with the
        server (both ways) from just before the next slot, whose first claim ends that
        run: its refused heartbeat cannot reach it, so its handler must end by its own
        lease (rule 8), and the new slot must not wait for it."""
        going = [s for s in self.ledger.snapshot() if s.job == REPLACING and s.ended_ms is None]
        instance = next((i for i in self._up() if going and i.runner == going[-1].runner), None)
        if instance is None:
            event("partition at a replace: no run in progress on an instance up")
            return
        slot = next_slot_ms(every_ms_of(REPLACING), wall_ms())
        time.sleep(max(slot - 100 - wall_ms(), 0) / 1000)
        event("partition at a replace")
        with self._impaired(instance.runner, "stall"):
            instance.proxy.pause()
            time.sleep(ms / 1000)
            instance.proxy.resume()

    @rule(kind=st.sampled_from(["oom", "read_only", "busy"]), ms=st.integers(100, 1500))
    def server_error(self, kind: str, ms: int) -> None:
        """The server refuses writes (or, busy, everything) for ``ms``."""
        self._refuse(kind, ms)

    @rule(
        kind=st.sampled_from(["oom", "read_only", "busy"]),
        ms=st.integers(100, 1500),
        job=st.sampled_from(SPARSE_JOBS),
    )
    def server_error_past_a_slot(self, kind: str, ms: int, job: str) -> None:
        """The server refuses until just past the next slot of ``job`` after ``ms``: the
        slot's first claims are refused, and the engine's next try must run it."""
        self._refuse(kind, int(next_slot_ms(every_ms_of(job), wall_ms() + ms) + 100 - wall_ms()))

    def _refuse(self, kind: str, ms: int) -> None:
        event(f"server error: {kind}")
        fault: AbstractContextManager[None]
        if kind == "oom":
            fault = oom(self.admin)
        elif kind == "read_only":
            fault = read_only(self.admin)
        else:
            fault = busy(self.server.url, seconds=ms / 1000 + 10)
        with self._impaired("server", kind) as window:
            with fault:
                time.sleep(ms / 1000)
            window.healed_ms, window.back_by_ms = wall_ms(), SERVER_BACK_BY_MS

    @precondition(lambda self: bool(self._up()))
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        instance = data.draw(st.sampled_from(self._up()))
        started = time.monotonic()
        self._hurt(instance.runner, "killed")
        instance.proxy.refuse(True)  # nothing it sends from now on arrives
        self._end(instance, "kill", started)

    @precondition(lambda self: bool(self._up()))
    @rule(data=st.data())
    def interrupt(self, data: st.DataObject) -> None:
        """The task that runs an instance is cancelled (Ctrl-C, a task group ending) while
        its connection works: leaving ``async with`` stops it as ``stop()`` does, so it
        releases what it holds and backups need not wait for its leases to expire."""
        instance = data.draw(st.sampled_from(self._up()))
        started = time.monotonic()
        window = self._hurt(instance.runner, "interrupted")
        runner = instance.runner
        self._end(instance, "interrupt", started)
        if not self._healthy("server", window.start_ms, wall_ms()):
            return  # its releases may not have got through
        seconds, micros = self.admin.time()
        now = seconds * 1000 + micros // 1000
        for spec in JOBS:
            keys = JobKeys.for_job(self.prefix, spec.name)
            for slot_id in self.admin.smembers(keys.active):
                state = self.admin.hget(keys.state, slot_id) or ""
                fields = state.split("|")
                held = len(fields) == 8 and fields[0] == "running" and fields[7] == runner
                check(
                    not (held and int(fields[3]) > now),
                    f"{runner} was interrupted, but {spec.name} slot {slot_id} still holds "
                    f"its live lease (it was not released): {state}",
                )

    @precondition(lambda self: bool(self._up()))
    @rule(data=st.data(), cancel_after_ms=st.none() | st.integers(0, 400))
    def stop(self, data: st.DataObject, cancel_after_ms: int | None) -> None:
        instance = data.draw(st.sampled_from(self._up()))
        scheduler = instance.scheduler
        assert scheduler is not None
        started = time.monotonic()
        self._hurt(instance.runner, "stopping")

        async def stop() -> None:
            if cancel_after_ms is not None:
                with anyio.move_on_after(cancel_after_ms / 1000):
                    await scheduler.stop()
            await scheduler.stop()

        self.portal.call(stop)
        self._end(instance, "stop" if cancel_after_ms is None else "cancelled stop", started)

    @precondition(lambda self: any(not instance.up for instance in self.instances.values()))
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        down = [instance for instance in self.instances.values() if not instance.up]
        instance = data.draw(st.sampled_from(down))
        instance.proxy.refuse(False)
        self._start(instance)

    @precondition(lambda self: bool(self._up()))
    @rule(data=st.data(), job=st.sampled_from(QUICK_JOBS))
    def run_now(self, data: st.DataObject, job: str) -> None:
        instance = data.draw(st.sampled_from(self._up()))
        scheduler = instance.scheduler
        assert scheduler is not None

        async def run_now() -> str:
            try:
                with anyio.fail_after(10):
                    return (await scheduler.run_now(job)).status
            except RunOverlapError:
                return "refused: overlap"
            except ConnectionFailedError as exc:
                return f"unreachable: {exc}"

        called_ms = wall_ms()
        outcome = self.portal.call(run_now)
        event(f"run_now: {outcome.split(':')[0]}")
        if outcome.startswith("unreachable") and not (
            self._healthy(instance.runner, called_ms, wall_ms())
            and self._healthy("server", called_ms, wall_ms())
        ):
            return  # the loop stood still, or the server was slow: every try missed
        check(outcome in ("ok", "failed", "refused: overlap"), f"run_now answered {outcome}")

    @rule(ms=st.integers(100, 1500))
    def freeze_server(self, ms: int) -> None:
        """The server stands still (SIGSTOP) for ``ms``, then goes on (SIGCONT): every
        round trip meanwhile misses its deadline, and the server applies the commands
        queued meanwhile once it goes on (replies the clients gave up on)."""
        self._freeze(ms)

    @rule(ms=st.integers(100, 1500), job=st.sampled_from(SPARSE_JOBS))
    def freeze_server_past_a_slot(self, ms: int, job: str) -> None:
        """Frozen from before the next slot of ``job`` (after ``ms``) until 400 ms after
        it: the slot's first claims miss their deadline (a third of the lease, 300 ms),
        and their next try, sent again with the same tokens, must run the slot."""
        slot = next_slot_ms(every_ms_of(job), wall_ms() + ms)
        self._freeze(int(slot + 400 - wall_ms()))

    def _freeze(self, ms: int) -> None:
        process = self.server.process
        assert process is not None
        event("server frozen")
        with self._impaired("server", "frozen") as window:
            process.send_signal(signal.SIGSTOP)
            try:
                time.sleep(ms / 1000)
            finally:
                process.send_signal(signal.SIGCONT)
            # The claim that missed its deadline is sent again after 50 ms (+-20 %) and
            # waits for the server within its own deadline: 600 ms after the slot.
            window.healed_ms, window.back_by_ms = wall_ms(), 2 * 1000 * ROUND_TRIP_SEC

    @rule(persist=st.booleans(), down_ms=st.integers(0, 1000))
    def restart_server(self, persist: bool, down_ms: int) -> None:
        self._restart_server(persist, lambda: time.sleep(down_ms / 1000))

    @rule(persist=st.booleans(), ms=st.integers(0, 1000), job=st.sampled_from(SPARSE_JOBS))
    def restart_server_past_a_slot(self, persist: bool, ms: int, job: str) -> None:
        """The server is down from about ``ms`` before the next slot of ``job`` (after
        ``ms``) until just after it: the slot's first claims fail, and the engine's next
        try, once the server is back, must run it."""
        slot = next_slot_ms(every_ms_of(job), wall_ms() + ms)
        # Started again so that it answers about 100 ms after the slot: starting takes
        # about as long as it took last time.
        start_at_ms = slot + 100 - self._start_took_ms
        self._restart_server(
            persist, lambda: time.sleep(max(0.0, (start_at_ms - wall_ms()) / 1000))
        )

    def _restart_server(self, persist: bool, down: Callable[[], None]) -> None:
        # Slots whose windows close now are judged on the store before it may be wiped.
        self.check_misses()
        event(f"server restart {'from AOF' if persist else 'empty'}")
        with self._impaired("server", "restart") as window:
            if not persist:
                # What the store said before it forgot, for the slots judged later.
                for spec in JOBS:
                    keys = JobKeys.for_job(self.prefix, spec.name)
                    self.forgotten[spec.name].update(self.admin.hgetall(keys.state))
            self.admin.close()
            self.server.kill()
            if not persist:
                self.wipes.append(wall_ms())
            down()
            starting_ms = wall_ms()
            self.server.start(wipe=not persist)
            window.healed_ms, window.back_by_ms = wall_ms(), SERVER_BACK_BY_MS
            self._start_took_ms = window.healed_ms - starting_ms
            self.admin = self._admin()
            if not persist:
                self.wipe_spans.append((self.wipes[-1], wall_ms()))

    # ------------------------------------------------------------ invariants

    def _healthy(self, who: str, start_ms: float, end_ms: float) -> bool:
        """No fault of ``who`` (a runner, or the server) overlaps the span; a runner is
        not healthy while the event loop all instances share was starved either."""
        whom = (who,) if who == "server" else (who, "loop")
        return not any(w.who in whom and w.overlaps(start_ms, end_ms) for w in self.windows)

    def _some_instance_healthy(self, start_ms: float, end_ms: float, server: bool = True) -> bool:
        """Whether the server (unless ``server`` is False) and some runner up since
        ``start_ms`` were healthy throughout the span."""
        if server and not self._healthy("server", start_ms, end_ms):
            return False
        return any(
            up_ms <= start_ms and self._healthy(runner, up_ms, end_ms)
            for runner, up_ms in self.runner_up_ms.items()
        )

    @invariant()
    def no_instance_task_died(self) -> None:
        for instance in self._up():
            assert instance.future is not None
            if instance.future.done():
                ended = how_it_ended(instance.future) or "it returned"
                fail(f"instance {instance.runner} ended by itself: {ended}")

    @invariant()
    def no_slot_started_twice_without_reason(self) -> None:
        by_slot: dict[tuple[str, str], list[Start]] = {}
        for start in self.ledger.snapshot():
            check(1 <= start.attempt <= MAX_ATTEMPTS, f"attempt out of bounds: {start}")
            by_slot.setdefault((start.job, start.slot_id), []).append(start)
        for starts in by_slot.values():
            starts.sort(key=lambda s: s.started_ms)
            for earlier, later in itertools.pairwise(starts):
                # The earlier attempt was won before its handler started (by a starved
                # loop's lag at most, on an old server that may be wiped since).
                if self._wiped(earlier.started_ms - 1000, later.started_ms):
                    # The store forgot the slot: attempts count again from 1, but fences
                    # keep growing (they start from the server's clock).
                    event("second start: the store was wiped meanwhile")
                    check(
                        later.fence > earlier.fence,
                        f"after a wipe {later.job} slot {later.slot_id} started with a fence "
                        f"no higher than before: {earlier} then {later}",
                    )
                    continue
                check(
                    later.attempt > earlier.attempt and later.fence > earlier.fence,
                    f"a later start of {later.job} slot {later.slot_id} has no higher attempt "
                    f"and fence: {earlier} then {later}",
                )
                self._check_self_fencing(earlier, later)
                if self._explained(earlier, later):
                    continue
                fail(
                    f"{later.job} slot {later.slot_id} started twice with no dead, stalled "
                    f"or cut-off runner in between: {earlier} then {later}"
                )

    @invariant()
    def no_instance_runs_more_than_its_bounds(self) -> None:
        """No runner ever has more handlers running at once than ``max_concurrent``, nor
        more runs of the bounded job than its own bound: the engine counts a run from
        before its handler starts until after it ends, so the handlers' own spans (the
        ledger's) can only be shorter."""
        now = wall_ms()
        spans: dict[str, list[tuple[float, int, str]]] = {}
        for start in self.ledger.snapshot():
            ended = now if start.ended_ms is None else start.ended_ms
            spans.setdefault(start.runner, []).extend(
                [(start.started_ms, 1, start.job), (ended, -1, start.job)]
            )
        for runner, marks in spans.items():
            running = burst = 0
            for _, step, job in sorted(marks, key=lambda mark: (mark[0], mark[1])):
                running += step
                burst += step if job == BURST.name else 0
                check(
                    running <= MAX_CONCURRENT,
                    f"{runner} ran {running} handlers at once, above its bound",
                )
                check(
                    burst <= BURST_BOUND,
                    f"{runner} ran {burst} runs of {BURST.name} at once, above its own bound",
                )

    @invariant()
    def a_later_attempt_resumes_from_the_newest_progress_kept(self) -> None:
        """Rule 10."""
        long_jobs = {spec.name for spec in JOBS if spec.behaviour == "long"}
        by_slot: dict[tuple[str, str], list[Start]] = {}
        for start in self.ledger.snapshot():
            if start.job in long_jobs and start.trigger != "manual":
                by_slot.setdefault((start.job, start.slot_id), []).append(start)
        for starts in by_slot.values():
            starts.sort(key=lambda s: s.fence)
            for index, later in enumerate(starts[1:], 1):
                earlier = starts[:index]
                if self._wiped(earlier[0].started_ms, later.started_ms):
                    continue
                saves = [save for start in earlier for save in list(start.saves)]
                seen = later.progress_seen
                if seen is not None:
                    check(
                        any(value == seen and how != "refused" for value, how, _ in saves),
                        f"{later.job} slot {later.slot_id} attempt {later.attempt} started "
                        f"with progress {seen!r}, which no earlier attempt kept: {saves}",
                    )
                won_ms = later.fence / 1000
                kept = [value for value, how, at_ms in saves if how == "ok" and at_ms < won_ms]
                if kept:
                    event("progress: a later attempt of a slot resumed")
                    newest = max(kept, key=progress_order)
                    check(
                        seen is not None and progress_order(str(seen)) >= progress_order(newest),
                        f"{later.job} slot {later.slot_id} attempt {later.attempt} started "
                        f"with progress {seen!r}, older than {newest!r}, kept before it won",
                    )

    @invariant()
    def no_more_runs_go_on_in_the_fleet_than_its_limit(self) -> None:
        """Rule 9, the bound: at each start of the ``permit`` job, the runs of it going on
        then beyond the limit are each explained (their runner, or the server, was not
        healthy since their win: their permits ran out with their leases)."""
        starts = sorted(
            (s for s in self.ledger.snapshot() if s.job == PERMITTED.name),
            key=lambda s: s.started_ms,
        )
        for index, later in enumerate(starts):
            going = [  # its runs last a second at most, unless their runner stands still
                s
                for s in starts[max(index - 50, 0) : index]
                if s.ended_ms is None or s.ended_ms > later.started_ms
            ]
            if len(going) == FLEET_BOUND - 1:
                event("fleet limit: a start took the last permit")
            if len(going) < FLEET_BOUND:
                continue
            explained = [s for s in going if self._explained(s, later)]
            if len(going) - len(explained) >= FLEET_BOUND:
                fail(
                    f"{len(going) + 1} runs of {PERMITTED.name} at once in the fleet (limit "
                    f"{FLEET_BOUND}), {len(explained)} of them explained: {going} and {later}"
                )

    @invariant()
    def the_permits_come_back(self) -> None:
        """Rule 9, the liveness: a dead runner's permits are free a lease later, so
        while the server and an instance were healthy for a lease and two polls (plus
        whatever the loop stood still), a run of the ``permit`` job started."""
        now = wall_ms()
        starts = [s.started_ms for s in self.ledger.snapshot() if s.job == PERMITTED.name]
        since = max(starts, default=self.began_ms)
        span_ms = LEASE_MS + 2 * PERMIT_POLL_MS + SETTLE_AFTER_FAULT_MS
        span_ms += self._starved_ms(since, now)
        if now - since < span_ms:
            return
        check(
            not self._some_instance_healthy(now - span_ms, now),
            f"no run of {PERMITTED.name} started for {now - since:.0f} ms while the server "
            "and an instance were healthy: its permits did not come back",
        )

    @invariant()
    def a_replaced_run_ends_within_a_heartbeat_or_two(self) -> None:
        now = wall_ms()
        starts = sorted(
            (s for s in self.ledger.snapshot() if s.job == REPLACING and s.trigger != "manual"),
            key=lambda s: s.started_ms,
        )
        for index, earlier in enumerate(starts):
            later = next((s for s in starts[index + 1 :] if s.slot_ms > earlier.slot_ms), None)
            if later is None:
                continue
            ended_ms = now if earlier.ended_ms is None else earlier.ended_ms
            overlap_ms = ended_ms - later.started_ms
            if overlap_ms <= 0:
                continue
            told = self._healthy(earlier.runner, later.started_ms, ended_ms) and self._healthy(
                "server", later.started_ms, ended_ms
            )
            bound_ms = (2 * HEARTBEAT_MS if told else LEASE_MS) + 200
            bound_ms += self._starved_ms(later.started_ms, ended_ms)
            check(
                overlap_ms <= bound_ms,
                f"{REPLACING} slot {earlier.slot_id} ran on {overlap_ms:.0f} ms after slot "
                f"{later.slot_id} replaced it (bound {bound_ms:.0f} ms): {earlier} then {later}",
            )

    @invariant()
    def fences_grow_across_a_wipe(self) -> None:
        """A store that lost its data still hands out fences above every fence it gave
        before (a downstream store that trusts fences must not accept a stale writer):
        each job's starts won after a wipe have higher fences than all before it."""
        starts = self.ledger.snapshot()
        for killed_ms, up_ms in self.wipe_spans:
            for spec in JOBS:
                before = [
                    s.fence for s in starts if s.job == spec.name and s.started_ms < killed_ms
                ]
                # Won on the new server: started after it was up (a reply in flight when
                # the old one died is delivered at once, or never; a starved loop acts
                # on it late by as long as it stood still).
                after = [
                    s
                    for s in starts
                    if s.job == spec.name
                    and s.started_ms > up_ms + 100 + self._starved_ms(killed_ms, s.started_ms)
                ]
                if before and after:
                    lowest = min(after, key=lambda s: s.fence)
                    check(
                        lowest.fence > max(before),
                        f"{spec.name}: after the store was wiped, {lowest} started with fence "
                        f"{lowest.fence}, not above {max(before)}, the highest before the wipe",
                    )

    def _check_self_fencing(self, earlier: Start, later: Start) -> None:
        """A later attempt starts only after the earlier one's lease expired on the
        server, and a runner that could not renew its lease cancels (or tells) its
        handler by then: the two handlers overlap only by the time a starved event
        loop takes to deliver that cancellation."""
        if later.attempt <= earlier.attempt:
            return  # a wipe: the store forgot the earlier run, so nothing fenced it
        ended_ms = wall_ms() if earlier.ended_ms is None else earlier.ended_ms
        overlap_ms = ended_ms - later.started_ms
        if overlap_ms <= 100:
            return
        # A starved loop delivers the cancellation late, by about as long as it stood.
        if self._starved_ms(later.started_ms - LEASE_MS, ended_ms) >= overlap_ms - 100:
            event("attempts overlapped: the event loop was starved that long")
            return
        fail(
            f"{later.job} slot {later.slot_id}: attempt {later.attempt} started while "
            f"attempt {earlier.attempt} still ran (its runner did not fence itself when "
            f"its lease ran out): {earlier} then {later}"
        )

    def _starved_ms(self, start_ms: float, end_ms: float) -> float:
        """How long the schedulers' event loop stood still within the span: its stalls,
        and its shorter overshoots, which add up under load."""
        stalls = sum(
            w.took_ms
            for w in self.windows
            if w.who == "loop" and start_ms <= w.start_ms + w.took_ms and w.start_ms <= end_ms
        )
        lags = sum(
            lag_ms
            for at_ms, lag_ms in list(self.lags)
            if start_ms <= at_ms + lag_ms and at_ms <= end_ms
        )
        return stalls + lags

    def _wiped(self, start_ms: float, end_ms: float) -> bool:
        return any(start_ms <= wipe_ms <= end_ms for wipe_ms in self.wipes)

    def _explained(self, earlier: Start, later: Start) -> bool:
        ended_ms = earlier.ended_ms
        if earlier.outcome == "raised" and ended_ms is not None and ended_ms <= later.started_ms:
            event("second start: a retry after a failure")
            return True
        # The earlier lease began at its win, not when its handler started: a loaded loop
        # can start the handler most of a lease later, and heartbeats that failed before
        # then lose the lease all the same. The fence is the server's clock at the win
        # (in microseconds), unless an older fence was higher.
        won_ms = min(earlier.started_ms, earlier.fence / 1000)
        if not self._healthy(earlier.runner, won_ms, later.started_ms):
            event("second start: its earlier runner was dead, stalled, stopping or cut off")
            return True
        if not self._healthy("server", won_ms, later.started_ms):
            event("second start: the server failed meanwhile")
            return True
        return False

    @invariant()
    def check_misses(self) -> None:
        """Slots whose lateness window (and a takeover's lease) closed since the last
        check: each started, or the store or an instance says why not."""
        now = wall_ms()
        # A takeover of a won-but-dead first attempt comes up to two leases later.
        horizon = int(now) - MAX_LATE_MS - 2 * LEASE_MS - 1000
        # The store first, then the ledger: a handler starts before the store can
        # say anything that depends on it.
        states = {
            spec.name: self.admin.hgetall(JobKeys.for_job(self.prefix, spec.name).state)
            for spec in JOBS
        }
        starts: dict[tuple[str, int], float] = {}
        for s in self.ledger.snapshot():
            if s.trigger != "manual":
                key = (s.job, s.slot_ms)
                starts[key] = min(starts.get(key, math.inf), s.started_ms)
        for spec in JOBS:
            first = self.checked_until[spec.name]
            slot = next_slot_ms(spec.every_ms, first)
            while slot <= horizon:
                self.checked_until[spec.name] = slot
                window = (slot - SETTLE_AFTER_FAULT_MS, slot + MAX_LATE_MS)
                back_in_time = False
                healthy = self._some_instance_healthy(*window)
                if not healthy:
                    healthy = back_in_time = self._server_back_in_time(spec, slot, window)
                self.judged[healthy] += 1
                started_ms = starts.get((spec.name, slot))
                if started_ms is not None:
                    if back_in_time:
                        # The next try of the failed claim ran it, in time: not a backup's
                        # takeover of a win nobody heard of, a lease later.
                        late_ms = started_ms - slot
                        check(
                            late_ms <= MAX_LATE_MS + self._starved_ms(slot, started_ms),
                            f"{spec.name} slot {slot} started {late_ms:.0f} ms late, though "
                            "the server was back in time for the next try of its claims",
                        )
                elif not healthy:
                    event("slot not judged: no healthy instance or server")
                else:
                    state = states[spec.name].get(str(slot)) or self.forgotten[spec.name].get(
                        str(slot)
                    )
                    self._judge_unstarted(spec, slot, state)
                slot += spec.every_ms

    def _server_back_in_time(self, spec: JobSpec, slot: int, window: tuple[float, float]) -> bool:
        """Whether the only trouble of the server around ``slot`` was error replies or
        a restart that ended soon enough for the engine's next try of a failed claim to
        run the slot (and an instance was healthy throughout)."""
        if spec.every_ms < BACK_JOB_MIN_EVERY_MS:
            return False
        troubles = [w for w in self.windows if w.who == "server" and w.overlaps(*window)]
        healed = [w for w in troubles if w.healed_ms is not None]
        # A server busy with a script answers nothing for its first 100 ms, a frozen
        # one nothing at all (the PING watch sees it slow, from a PING sent up to 50 ms
        # before the fault began): that slowness is part of the fault.
        troubles = [
            w
            for w in troubles
            if not (
                w.took_ms
                and any(r.start_ms - 100 <= w.start_ms <= (r.healed_ms or 0) for r in healed)
            )
        ]
        if not troubles or not all(
            w.healed_ms is not None and w.healed_ms <= slot + w.back_by_ms for w in troubles
        ):
            return False
        if not self._some_instance_healthy(*window, server=False):
            return False
        refused = any(w.start_ms <= slot < (w.healed_ms or 0) for w in troubles)
        event(f"slot judged: the server was back {'just after' if refused else 'before'} it")
        return True

    def _judge_unstarted(self, spec: JobSpec, slot: int, state: str | None) -> None:
        status = state.split("|")[0] if state else None
        if status in ("skipped", "interrupted"):
            event(f"slot not started: recorded {status}")
            return
        stated = self.skips.explains(spec.name, slot)
        said = f"; an instance said it skipped it: {stated.reason}" if stated else ""
        fail(
            f"{spec.name} slot {slot} ({datetime.fromtimestamp(slot / 1000)}) never started "
            f"and nothing says why, though the server and an instance were healthy from "
            f"{SETTLE_AFTER_FAULT_MS} ms before it until {MAX_LATE_MS} ms after; its state: "
            f"{state!r}{said}"
        )

    @invariant()
    def the_store_agrees_with_the_handlers(self) -> None:
        """An attempt the store records ok (or failed) is one whose handler returned
        (or raised): never one that was cancelled or told its lease was lost."""
        # The store first, then the ledger: a handler's end is in the ledger before
        # its finish is sent.
        states = {
            spec.name: self.admin.hgetall(JobKeys.for_job(self.prefix, spec.name).state)
            for spec in JOBS
        }
        outcomes = {(s.job, s.slot_id, s.attempt): s.outcome for s in self.ledger.snapshot()}
        last_wipe_ms = max(self.wipes, default=-math.inf)
        for spec in JOBS:
            for slot_id, state in states[spec.name].items():
                fields = state.split("|")
                if len(fields) < 8:
                    continue  # the job's fence counter lives in the same hash
                status, attempt, fence = fields[0], int(fields[1]), fields[4]
                if status not in ("ok", "failed"):
                    continue
                key = f"manual:{fence}" if is_manual(slot_id) else slot_id
                if not is_manual(slot_id) and int(slot_id) < last_wipe_ms + 1000:
                    continue  # the ledger may hold the same attempt from before a wipe
                outcome = outcomes.get((spec.name, key, attempt))
                expected = "ok" if status == "ok" else "raised"
                check(
                    outcome == expected,
                    f"the store records {spec.name} slot {slot_id} attempt {attempt} {status}, "
                    f"but its handler's outcome was {outcome!r}",
                )

    @invariant()
    def every_run_settles_and_the_store_is_bounded(self) -> None:
        seconds, micros = self.admin.time()
        now = seconds * 1000 + micros // 1000
        for spec in JOBS:
            keys = JobKeys.for_job(self.prefix, spec.name)
            active = self.admin.smembers(keys.active)
            states = self.admin.hmget(keys.state, sorted(active)) if active else []
            for slot_id, state in zip(sorted(active), states, strict=True):
                if state is None:
                    continue
                status, until_ms = state.split("|")[0], int(state.split("|")[3])
                if spec.every_ms >= 3 * LEASE_MS and not is_manual(slot_id):
                    # Its backups (the instances that claimed the slot too) ask again
                    # when the lease or retry delay runs out.
                    bound_ms = 1000
                    healthy_from = int(slot_id) - SETTLE_AFTER_FAULT_MS
                else:
                    # Or the job's next slot's claim reports the orphan.
                    bound_ms = LEASE_MS + max(spec.every_ms, LEASE_MS) + 1000
                    healthy_from = until_ms
                if until_ms + bound_ms < now and self._some_instance_healthy(
                    healthy_from, until_ms + bound_ms
                ):
                    fail(
                        f"{spec.name} slot {slot_id} is {status} without a live lease since "
                        f"{now - until_ms} ms, though an instance and the server were healthy"
                    )
            check(len(active) <= 4, f"{spec.name}: the active set grew: {sorted(active)}")
            check(self.admin.xlen(keys.runs) <= HISTORY_SIZE, f"{spec.name}: runs past the bound")
            check(self.admin.zcard(keys.results) <= HISTORY_SIZE, f"{spec.name}: too many results")
            manual = sum(
                1 for s in self.ledger.snapshot() if s.job == spec.name and s.trigger == "manual"
            )
            slots_so_far = int((wall_ms() - self.began_ms) / spec.every_ms) + 2
            # The runs the state holds: its fields but the job's own (the fence counter,
            # the lease holder, the pause flag, the waiting run-now request, the runs that
            # ended, max_runs' mark, the failures in a row, the last success).
            own = (
                "fence", "holder", "paused", "requested", "runs", "finished", "failed-in-row",
                "in-force",
                "last-ok",
            )  # fmt: skip
            held = self.admin.hlen(keys.state) - sum(
                int(self.admin.hexists(keys.state, field)) for field in own
            )
            check(
                held <= slots_so_far + manual + len(active),
                f"{spec.name}: the state holds {held} entries, more than the {slots_so_far} "
                f"slots since the start, {manual} manual runs and {len(active)} active",
            )

    # -------------------------------------------------------------- the end

    def teardown(self) -> None:
        try:
            if self.server.process is not None:
                for instance in self.instances.values():
                    instance.proxy.refuse(False)
                    instance.proxy.resume()
                    if not instance.up:
                        self._start(instance)
                # Let every window close on a healthy fleet, then judge them all.
                time.sleep((MAX_LATE_MS + 2 * LEASE_MS + 1500 + SETTLE_AFTER_FAULT_MS) / 1000)
                self.check_misses()
                self.no_slot_started_twice_without_reason()
                self.every_run_settles_and_the_store_is_bounded()
                self.no_instance_task_died()
                healthy = self.judged[True] / max(1, sum(self.judged.values()))
                event(f"slots whose window was healthy: {int(healthy * 10) * 10}%+")
                for what in ("starved", "slow"):
                    seen = any(w.what.startswith(what) for w in self.windows)
                    event(f"the {'loop' if what == 'starved' else 'server'} was {what}: {seen}")
                for instance in self.instances.values():
                    started = time.monotonic()
                    self.portal.call(instance.scheduler.stop)  # type: ignore[union-attr]
                    self._end(instance, "stop", started)
        finally:
            for instance in self.instances.values():
                if instance.up and instance.scope is not None:
                    self.portal.call(instance.scope.cancel)
                self._close_client(instance)
            self._lag_future.cancel()
            self._watching.set()
            self._server_watch.join()
            self._portal_cm.__exit__(None, None, None)
            logging.getLogger("anarchon").removeHandler(self.skips)
            for instance in self.instances.values():
                instance.proxy.close()
            self.admin.close()
            self.server.kill()
            self._tmp.cleanup()


SERVERS = newest_servers()
#: The newest Valkey under asyncio, the newest Redis under trio.
PAIRS = list(zip(SERVERS, ("asyncio", "trio"), strict=False))

for _spec, _loop in PAIRS:
    _name = f"TestEngine_{_spec.id}_{_loop}".replace("-", "_").replace(".", "_")
    _machine = type(_name, (EngineMachine,), {"server_spec": _spec, "event_loop": _loop})
    _test = _machine.TestCase
    _test.settings = settings(
        # A mutant (python -m tests.mutants --engine) gets twice the ci examples: a
        # fault that meets the defect is drawn in a few examples out of six.
        max_examples={"deep": 200, "mutants": 12}.get(PROFILE, 6),
        stateful_step_count=60 if PROFILE == "deep" else 12,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        # The engine runs on the real clock: a replay is not the same run, so shrinking
        # would spend minutes on examples that pass for other reasons. The failing
        # steps are printed as they ran.
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        # A mutant's failures (python -m tests.mutants) must not be replayed later.
        database=None if PROFILE == "mutants" else settings.default.database,
    )
    _test.pytestmark = [
        pytest.mark.slow("real schedulers on the real clock: 6 examples of up to 12 steps of slots")
    ]
    globals()[_name] = _test
del _spec, _loop, _name, _machine, _test
