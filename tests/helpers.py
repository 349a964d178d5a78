"""Small tools the tests share."""

from __future__ import annotations

import math
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, TypeVar

import anyio
import redis
import redis.asyncio

from anarchon import (
    Event,
    RedisBackend,
    Run,
    RunResult,
    RunStarted,
    Scheduler,
    SlotSkipped,
)
from anarchon._store.contract import ClaimReply, ClaimRequest
from anarchon._store.keys import JobKeys
from anarchon.clients import ServerReplyError


class OneShot:
    """A schedule that fires once, at ``at`` (a custom schedule object)."""

    def __init__(self, at: datetime) -> None:
        self.at = at

    def next_after(self, moment: datetime, /) -> datetime | None:
        return self.at if moment < self.at else None

    @classmethod
    def in_ms(cls, delay_ms: int) -> OneShot:
        """A whole second at least ``delay_ms`` from now."""
        at = datetime.now(UTC) + timedelta(milliseconds=delay_ms)
        return cls(at.replace(microsecond=0) + timedelta(seconds=1))


class SecondsAtFirstAsk:
    """A schedule that fires at ``count`` whole seconds in a row, the first at least
    ``delay_ms`` after the scheduler first asks it (started, connected, registered). A
    slot chosen before the start (``OneShot.in_ms``, ``Seconds``) would pass unseen if
    the start were slow, as it is on a loaded machine (a TLS handshake, a worker starved
    of CPU): a custom schedule's slot in the past is never due. One object shared by a
    fleet's instances gives them all the instants its first asker chose."""

    def __init__(self, delay_ms: int, count: int) -> None:
        self.delay_ms = delay_ms
        self.count = count
        self.instants: list[datetime] = []

    def next_after(self, moment: datetime, /) -> datetime | None:
        if not self.instants:
            first = OneShot.in_ms(self.delay_ms).at
            self.instants = [first + timedelta(seconds=index) for index in range(self.count)]
        return next((at for at in self.instants if at > moment), None)


class OneShotAtFirstAsk(SecondsAtFirstAsk):
    """A schedule that fires once, a whole second at least ``delay_ms`` after the
    scheduler first asks it (see ``SecondsAtFirstAsk``)."""

    def __init__(self, delay_ms: int) -> None:
        super().__init__(delay_ms, 1)

    @property
    def at(self) -> datetime | None:
        """The instant, once the first asker chose it."""
        return self.instants[0] if self.instants else None


class SlotOnStdin:
    """A one-shot schedule for an instance in a process of its own, whose instant the
    test hands over once the instance has started. The scheduler first asks a schedule
    when it starts, connected and registered: then this prints ``slot?`` and reads the
    slot (epoch milliseconds, a line) from stdin. A slot the test chose before it
    spawned the process would pass unseen if the process were slow to start, as it is
    on a loaded machine. See ``hand_over_slot``."""

    def __init__(self) -> None:
        self.at: datetime | None = None

    def next_after(self, moment: datetime, /) -> datetime | None:
        if self.at is None:
            print("slot?", flush=True)
            self.at = datetime.fromtimestamp(int(sys.stdin.readline()) / 1000, UTC)
        return self.at if moment < self.at else None


def hand_over_slot(stdins: list[IO[str]], lead_ms: int = 2000) -> int:
    """Hand the same slot, a whole second at least ``lead_ms`` from now, to instances
    that each printed ``slot?`` (``SlotOnStdin``); returns it."""
    slot_ms = (int(time.time() * 1000 + lead_ms) // 1000 + 1) * 1000
    for stdin in stdins:
        stdin.write(f"{slot_ms}\n")
        stdin.flush()
    return slot_ms


#: A schedule that is never due: only ``run_now`` runs the job (a cron string, even a
#: yearly one, strikes during some test run).
NEVER = OneShot(datetime(2000, 1, 1, tzinfo=UTC))


class Seconds:
    """A schedule that fires at ``count`` whole seconds in a row, the first at least
    ``delay_ms`` from now."""

    def __init__(self, delay_ms: int, count: int) -> None:
        first = OneShot.in_ms(delay_ms).at
        self.instants = [first + timedelta(seconds=index) for index in range(count)]

    def next_after(self, moment: datetime, /) -> datetime | None:
        return next((at for at in self.instants if at > moment), None)


#: The share of an exactly-once test's slots that may go unrun, each for a proven reason.
MOST_NOT_RUN = 0.4


class Ledger:
    """Counts runs per job and slot in the server, on a connection of its own.

    Independent of anarchon's own bookkeeping: a handler calls ``record`` and the
    test reads the counts back.
    """

    def __init__(self, client: redis.Redis | redis.RedisCluster, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        # One hash tag for all ledger keys: on a cluster they share a node.
        self.key_prefix = "{" + prefix + "ledger}:"
        self.instances: set[str] = set()
        #: (job, slot) -> {instance: when it said it skips the slot, ms}
        self.skips: dict[tuple[str, int], dict[str, float]] = {}
        #: (job, slot) -> when an instance first began its handler, ms
        self.started: dict[tuple[str, int], float] = {}

    def watch(self, scheduler: Scheduler[Any]) -> None:
        """Hear the slots ``scheduler`` decides not to run (before it starts)."""
        self.instances.add(scheduler.instance_id)
        scheduler.on_event(self._heard)

    def _heard(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.started.setdefault((event.run.job, event.run.slot_ms), time.time() * 1000)
        elif isinstance(event, SlotSkipped) and event.reason == "late":
            heard = self.skips.setdefault((event.job, event.slot_ms), {})
            heard.setdefault(event.instance, time.time() * 1000)

    def skipped_everywhere(self) -> list[tuple[str, int]]:
        """The slots every watched instance said it skips as too late."""
        return sorted(slot for slot in self.skips if self._heard_everywhere(slot))

    def _heard_everywhere(self, slot: tuple[str, int]) -> bool:
        return bool(self.instances) and self.skips.get(slot, {}).keys() >= self.instances

    async def record(self, run: Run) -> None:
        key = f"{self.key_prefix}{run.job}:{run.slot_ms}"
        await anyio.to_thread.run_sync(self.client.incr, key)

    def assert_each_slot_ran_once(
        self,
        jobs: list[str],
        started_ms: float,
        stopping_ms: float,
        every_ms: int = 1000,
        stalled_sec: float = 0.0,
    ) -> int:
        """No slot ran twice, and every slot due after ``started_ms`` (all instances up)
        and a period before ``stopping_ms`` (the stop began) ran, or was skipped for a
        reason the test checks: the store recorded it skipped while an older run of its
        job was still going (overlap protection, when a run ends after its job's next
        instant), or every watched instance said it skips it, each only once a newer
        slot was due (the stale backlog after a stall of the process), or the stop came
        first: no instance had begun the slot's handler before the stop began (its
        claims were still in flight, or it was won and given back unstarted as the fleet
        stopped), and the slot was due less than three periods before. On a
        loaded machine all three happen; none loses a slot a healthy instance could
        run. Still,
        at most ``MOST_NOT_RUN`` of the slots may not run (CI's worst stall, 4 s of a
        15 s window, left 28% not run; an engine that skips every other slot fails), or,
        for a test that stalls the process for ``stalled_sec``, the slots the stall
        spans and the one it ends in, if more (a 3.5 s stall in a 9 s window cost 80 of
        180 slots in CI, each of them skipped for a proven reason).
        Returns the count of slots due."""
        counts = self.counts()
        duplicates = {slot: n for slot, n in counts.items() if n != 1}
        assert not duplicates, f"slots that ran more than once: {duplicates}"
        first = math.ceil(started_ms / every_ms) * every_ms
        last = math.floor(stopping_ms / every_ms) * every_ms - every_ms
        expected = {(job, slot) for job in jobs for slot in range(first, last + 1, every_ms)}
        not_run = sorted(expected - set(counts))
        history = {job: self.history(job) for job in {job for job, _ in not_run}}
        missed = [
            (job, slot)
            for job, slot in not_run
            if not _skipped_behind_a_run(history[job], slot)
            and not self._skipped_late_everywhere(job, slot, every_ms)
            and not self._caught_by_the_stop(job, slot, stopping_ms, every_ms)
        ]
        assert not missed, f"{len(missed)} slots never ran nor were skipped, e.g. {missed[:5]}"
        # A stall of the whole process costs the slots it spans and the one it ends in.
        stall_allows = (
            len(jobs) * (math.ceil(stalled_sec * 1000 / every_ms) + 1) if stalled_sec else 0
        )
        assert len(not_run) <= max(MOST_NOT_RUN * len(expected), stall_allows), (
            f"{len(not_run)} of {len(expected)} slots did not run, e.g. {not_run[:5]}"
        )
        return len(expected)

    def _caught_by_the_stop(
        self, job: str, slot_ms: int, stopping_ms: float, every_ms: int
    ) -> bool:
        """No instance began ``slot_ms``'s handler before the stop began, which came less
        than three periods after the slot's instant: its claims were still in flight, or
        it was won and given back unstarted (a loaded loop can hear a win a second
        before it starts the handler, and a stop gives back what has not started)."""
        if not self.instances or slot_ms < stopping_ms - 3 * every_ms:
            return False  # (without instances watched, no start is heard of)
        return self.started.get((job, slot_ms), math.inf) >= stopping_ms

    def _skipped_late_everywhere(self, job: str, slot_ms: int, every_ms: int) -> bool:
        return self._heard_everywhere((job, slot_ms)) and all(
            at_ms >= slot_ms + every_ms for at_ms in self.skips[(job, slot_ms)].values()
        )

    def history(self, job: str) -> list[tuple[int, str, int]]:
        """The store's history of ``job``: (slot, status, when it ended or was skipped,
        by the server's clock), oldest slot first."""
        members = self.client.zrange(JobKeys.for_job(self.prefix, job).results, 0, -1)
        entries = []
        for member in members:
            text = member.decode() if isinstance(member, bytes) else str(member)
            slot, _attempt, status, _started, ended, _rest = text.split("|", 5)
            entries.append((int(slot), status, int(ended)))
        return entries

    def counts(self) -> dict[tuple[str, int], int]:
        keys = list(self.client.scan_iter(match=f"{self.key_prefix}*", count=1000))
        values = self.client.mget(keys) if keys else []
        counts = {}
        for key, value in zip(keys, values, strict=True):
            job, slot = str(key)[len(self.key_prefix) :].rsplit(":", 1)
            counts[(job, int(slot))] = int(value)
        return counts


def _skipped_behind_a_run(history: list[tuple[int, str, int]], slot_ms: int) -> bool:
    """The store recorded ``slot_ms`` skipped while an older slot's run had not ended."""
    skipped_at = [at for slot, status, at in history if slot == slot_ms and status == "skipped"]
    return bool(skipped_at) and any(
        slot < slot_ms and status != "skipped" and ended >= skipped_at[0]
        for slot, status, ended in history
    )


class PinnedConnection:
    """One connection of a redis-py client's pool, and the id the server gave it.

    ``ping()`` cannot tell whether a client was closed: redis-py reconnects on the next
    command. The connection itself can: a connection that was closed and opened again
    answers ``CLIENT ID`` with a new id. Pin one before handing the client to anarchon
    (it goes back to the pool, where anarchon picks it up first: the pool is LIFO) and
    check it once anarchon is done: ``still_open()`` asks the same connection object.
    """

    def __init__(self, connection: Any, client_id: int) -> None:
        self.connection = connection
        self.client_id = client_id

    @classmethod
    def of(cls, client: redis.Redis) -> PinnedConnection:
        pool = client.connection_pool
        connection = pool.get_connection()
        try:
            return cls(connection, cls._ask(connection))
        finally:
            pool.release(connection)

    @classmethod
    async def of_async(cls, client: redis.asyncio.Redis) -> PinnedConnection:
        pool = client.connection_pool
        connection = await pool.get_connection()
        try:
            await connection.send_command("CLIENT", "ID")
            return cls(connection, int(await connection.read_response()))
        finally:
            await pool.release(connection)

    @staticmethod
    def _ask(connection: Any) -> int:
        connection.send_command("CLIENT", "ID")
        return int(connection.read_response())

    def still_open(self) -> bool:
        """The same connection, never closed: it answers with the id it had."""
        return self._ask(self.connection) == self.client_id

    async def still_open_async(self) -> bool:
        await self.connection.send_command("CLIENT", "ID")
        return int(await self.connection.read_response()) == self.client_id


T = TypeVar("T")


def wait_for(condition: Callable[[], T | None], timeout_sec: float, what: str) -> T:
    """The first true value of ``condition``, polled (blocking: for tests that drive
    processes) until ``timeout_sec``."""
    deadline = time.monotonic() + timeout_sec
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_sec} s waiting for {what}")


async def wait_until(condition: Callable[[], bool], timeout_sec: float, what: str) -> None:
    deadline = time.monotonic() + timeout_sec
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_sec}s waiting for {what}")
        await anyio.sleep(0.01)


def tick_and_flaky_fleet(
    server_url: str, prefix: str, names: tuple[str, ...]
) -> list[Scheduler[Any]]:
    """Instances ``names`` of one fleet (not started; retry delay 100 ms), each with
    "tick" (three whole seconds in a row, from half a second after the start on) and
    "flaky" (once, from half a second after the start on; its first attempt fails, the
    second succeeds). The instances share the schedules, so they share the slots."""
    schedulers = []
    ticks, once = SecondsAtFirstAsk(500, 3), OneShotAtFirstAsk(500)
    for name in names:
        scheduler = Scheduler(
            RedisBackend(redis=server_url, prefix=prefix), instance_id=name, retry_delay_ms=100
        )

        @scheduler.job(ticks, name="tick")
        async def tick() -> None:
            pass

        @scheduler.job(once, name="flaky")
        async def flaky(run: Run) -> None:
            if run.attempt == 1:
                raise RuntimeError("the first attempt fails")

        schedulers.append(scheduler)
    return schedulers


async def settled_history(
    scheduler: Scheduler[Any], settled: dict[str, int]
) -> dict[str, list[RunResult]]:
    """Each job's history once ``settled[job]`` of its attempts have ended."""
    history: dict[str, list[RunResult]] = {}
    for job, count in settled.items():
        while len([r for r in history.get(job, []) if r.status != "running"]) < count:
            await anyio.sleep(0.1)
            history[job] = await scheduler.history(job)
    return history


@dataclass
class LongJobFleet:
    """Two instances of one fleet, "a" and "b", that both run the job "long"."""

    schedulers: list[Scheduler[Any]]
    #: Each attempt of "long" as it started, in order.
    starts: list[Run] = field(default_factory=list)

    def runner_of(self, start: int) -> Scheduler[Any]:
        """The instance that ran ``starts[start]``."""
        return next(s for s in self.schedulers if s.instance_id == self.starts[start].runner)


def a_long_run(url: str, prefix: str) -> tuple[Scheduler[Any], anyio.Event]:
    """An instance (1.5 s leases, a heartbeat every 0.5 s) whose job "long" starts once,
    soon, sets the returned event and then takes 30 s: freeze its server mid-run and the
    run loses its lease. Its stop cancels a run still going after 0.1 s (not the default
    30 s grace, which no test of it is about)."""
    scheduler: Scheduler[Any] = Scheduler(
        RedisBackend(redis=url, prefix=prefix), lease_ms=1500, heartbeat_ms=500, stop_grace_ms=100
    )
    started = anyio.Event()

    @scheduler.job(OneShot.in_ms(100), name="long")
    async def long() -> None:
        started.set()
        await anyio.sleep(30)

    return scheduler, started


@asynccontextmanager
async def long_job_fleet(
    server_url: str,
    prefix: str,
    schedule: Any,
    setup: Callable[[Scheduler[Any]], object] = lambda scheduler: None,
    **options: Any,
) -> AsyncIterator[LongJobFleet]:
    """Two running instances (``options`` go to each Scheduler, and each goes through
    ``setup`` before its start) of a fleet whose job "long" (on ``schedule``) records
    its run and then takes a minute: a stop of its runner gives it back mid-run (after
    ``stop_grace_ms``, 0.1 s unless given)."""
    options.setdefault("stop_grace_ms", 100)
    fleet = LongJobFleet(
        [
            Scheduler(RedisBackend(redis=server_url, prefix=prefix), instance_id=name, **options)
            for name in ("a", "b")
        ]
    )
    for scheduler in fleet.schedulers:

        @scheduler.job(schedule, name="long")
        async def long(run: Run) -> None:
            fleet.starts.append(run)
            await anyio.sleep(60)

        setup(scheduler)
    async with AsyncExitStack() as stack:
        for scheduler in fleet.schedulers:
            await stack.enter_async_context(scheduler)
        yield fleet


class CommandLog:
    """Every command clients send to the server, read from MONITOR on a socket of its own.

    Commands that scripts run inside the server are marked ``lua`` by MONITOR and
    left out: only round trips from clients count.
    """

    def __init__(self, url: str) -> None:
        host_port = url.split("//", 1)[1].split("/", 1)[0]
        host, port = host_port.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.sendall(b"MONITOR\r\n")
        self.buffer = b""
        self.lines: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                return
            self.buffer += data
            *lines, self.buffer = self.buffer.split(b"\r\n")
            self.lines += [line.decode(errors="replace") for line in lines]

    def seen(self) -> list[tuple[float, str]]:
        """The commands seen so far, as (server time in seconds, NAME)."""
        commands = []
        for line in list(self.lines):
            match = re.match(r'^\+([\d.]+) \[\d+ ([^\]]+)\] "([^"]+)"', line)
            if match and match.group(2) != "lua":
                commands.append((float(match.group(1)), match.group(3).upper()))
        return commands

    def close(self) -> list[tuple[float, str]]:
        """Stop listening; the commands seen, as (server time in seconds, NAME)."""
        self.stop.set()
        self.thread.join()
        self.sock.close()
        return self.seen()


async def claim_as(
    runner: str, url: str, prefix: str, job: str, slot_ms: int, lease_ms: int
) -> ClaimReply | ServerReplyError:
    """``runner``'s scheduled claim of ``slot_ms`` of ``job`` (another instance's, on a
    connection of its own), and the store's answer."""
    backend = RedisBackend(redis=url, prefix=prefix)
    store = await backend.open({"runner": runner, "history_size": 100, "history_ttl_ms": None})
    try:
        request = ClaimRequest(
            job, str(slot_ms), slot_ms, secrets.token_hex(8), "schedule", lease_ms, 3, False,
            600_000,
        )  # fmt: skip
        (reply,) = await store.claim_many([request])
        return reply
    finally:
        await store.conn.aclose()


async def claim_for_a_dead_runner(
    url: str, prefix: str, job: str, slot_ms: int, lease_ms: int
) -> None:
    """Win ``slot_ms`` of ``job`` for a runner that then vanishes (never heartbeats,
    never finishes)."""
    reply = await claim_as("dead", url, prefix, job, slot_ms, lease_ms)
    assert not isinstance(reply, ServerReplyError) and reply.kind == "won", reply


def run_until_sigterm(scheduler: Any, event_loop: str) -> None:
    """A worker process's life: run ``scheduler``, print ``ready``, and stop it
    gracefully on SIGTERM."""

    async def run_until_terminated() -> None:
        async with scheduler:
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                print("ready", flush=True)
                async for _ in signals:
                    return

    anyio.run(run_until_terminated, backend=event_loop)


def write_history(url: str, prefix: str, names: list[str], per_job: int) -> None:
    """``per_job`` recorded attempts of each lease job of ``names`` (failed, a minute
    apart, the newest a minute ago), written as the store records them."""
    client = redis.Redis.from_url(url)
    now_ms = int(time.time() * 1000)
    with client.pipeline(transaction=False) as pipe:
        for index, name in enumerate(names):
            members = {}
            for attempt in range(per_job):
                slot = now_ms - (per_job - attempt) * 60_000
                member = f"{slot}|1|failed|{slot + 5}|{slot + 9}|{attempt + 1}|schedule|i1|boom"
                members[member] = slot
            pipe.zadd(f"{{{prefix}{name}}}:results", members)
            if index % 500 == 499:
                pipe.execute()
        pipe.execute()
    client.close()


def anarchon_command(url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``anarchon ARGS --redis URL --prefix PREFIX`` as a shell runs it, from this
    checkout's source: its exit code and what it printed."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    return subprocess.run(
        [sys.executable, "-m", "anarchon", *args, "--redis", url, "--prefix", prefix],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip


def server_ms(direct: Any) -> int:
    """The server's clock now (``TIME``), in epoch ms."""
    seconds, micros = direct.time()
    return int(seconds) * 1000 + int(micros) // 1000
