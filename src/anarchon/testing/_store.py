"""The store on virtual time: the shipped scripts on a real server, with the server's
clock read swapped for the virtual one, behind connections that can fail on demand.

The scripts are the ones anarchon ships, byte for byte, but for their one clock read
(``server_now_ms()``, which reads TIME): on virtual time it returns the last argument,
which each call carries (and which the script takes off ``ARGV`` before anything else
reads it). The runs log's entry ids, which the server would take from its own clock,
are the virtual time's too. A test (``tests/test_testing_kit.py``) holds that nothing
else differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from functools import cache
from typing import Any

import anyio

from .._errors import StoreFormatError, TransportError
from .._model.clock import PRODUCTION, Pace
from .._store.keys import format_key
from .._store.scripts import Script, lease_script, lua_dir, lua_source, timer_script
from .._store.server import STORE_FORMAT, VIRTUAL_STORE_FORMAT
from ..clients import Command, Connection, open_connection
from ._clock import LoopClock
from ._pubsub import subscribe

__all__ = [
    "CLOCK_READ",
    "VirtualConnection",
    "VirtualStore",
    "virtual_body",
    "virtual_clock",
]

#: The one clock read of the shipped scripts (``lua/lease_state.lua``).
CLOCK_READ = """local function server_now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end"""

#: The same on virtual time: the last argument, taken off ``ARGV`` first.
VIRTUAL_CLOCK_READ = """local VIRTUAL_NOW_MS = tonumber(table.remove(ARGV))
local function server_now_ms()
  return VIRTUAL_NOW_MS
end"""

#: The runs log's entry of a win (``lua/claim.lua``), and the same with a virtual id.
RUNS_LOG_ENTRY = "redis.pcall('XADD', runs_key, 'MAXLEN', history_size, '*',"
VIRTUAL_RUNS_LOG_ENTRY = "redis.pcall('XADD', runs_key, 'MAXLEN', history_size, int(now) .. '-*',"

#: The instances' pace on virtual time, where each wake-up costs real time: their
#: housekeeping (what no slot's fate depends on: registrations, renewed subscriptions)
#: 60 times slower than in production, and the idle poll for timers set elsewhere 600
#: times (the kit's hints announce every set: the default 1 s becomes 10 minutes); no
#: sleep capped (the virtual clocks cannot step), and no margin before an instant
#: (virtual time jumps to it exactly).
VIRTUAL_PACE = Pace(
    registration_ttl_ms=60 * PRODUCTION.registration_ttl_ms,
    sleep_cap_sec=float("inf"),
    sleep_margin_sec=0.0,
    hints_renew_sec=60 * PRODUCTION.hints_renew_sec,
    timer_poll_factor=600.0,
)

#: ``TIME``'s reply, on virtual time (its two parts as arguments).
_TIME_REPLY = "return {ARGV[1], ARGV[2]}"

#: The instance whose task opened a connection (None: the test's own code).
OPENED_BY: ContextVar[str | None] = ContextVar("anarchon_testing_instance", default=None)


def virtual_clock(body: str) -> str:
    """A shipped script's text with its clock read taken from its last argument (what
    the property machines run on every server, against their models)."""
    if body.count(CLOCK_READ) != 1:
        raise AssertionError("a script's clock read changed: update anarchon.testing")
    return body.replace(CLOCK_READ, VIRTUAL_CLOCK_READ)


def virtual_body(body: str) -> str:
    """A shipped script's text on virtual time: its clock, and the runs log's entry ids
    (``<ms>-*``, Redis 7+ and Valkey) from the virtual time."""
    return virtual_clock(body).replace(RUNS_LOG_ENTRY, VIRTUAL_RUNS_LOG_ENTRY)


@cache
def _virtual_scripts() -> dict[str, Script]:
    """Every shipped script that reads the clock, by its SHA: its virtual twin."""
    shared = ("lease_state", "claim_first_look", "timer_state")
    names = [path.stem for path in lua_dir().glob("*.lua") if path.stem not in shared]
    found = {}
    for name in names:
        script = timer_script(name) if name.startswith("timer_") else lease_script(name)
        if CLOCK_READ in script.body:
            found[script.sha] = Script.from_body(name, virtual_body(script.body))
    return found


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class VirtualStore:
    """Virtual time as the engine reads it (``anarchon._model.clock.Virtual``), the
    server its connections reach, and the faults they suffer."""

    def __init__(self, clock: LoopClock, url: str, start_ms: int) -> None:
        self.clock = clock
        self.url = url
        self._start_ms = start_ms
        self._loop_at_start = anyio.current_time()
        #: Instances whose connections fail (killed).
        self.dead: set[str] = set()
        #: While True, every connection's round trips fail.
        self.unreachable = False
        #: While set, round trips wait (a frozen server); set again when it thaws.
        self.frozen: anyio.Event | None = None
        lua_source("lease_state")  # the scripts are readable before the first call

    # -------------------------------------------------------------- the clocks

    @property
    def pace(self) -> Pace:
        return VIRTUAL_PACE

    def monotonic(self) -> float:
        return anyio.current_time()

    def wall_ms(self) -> float:
        return self._start_ms + (anyio.current_time() - self._loop_at_start) * 1000.0

    def connect(self, prefix: str) -> Connection:
        return VirtualConnection(open_connection(self.url), self, prefix, OPENED_BY.get())


class VirtualConnection(Connection):
    """A connection to the store on virtual time: each round trip counted while in
    flight, its scripts' clock the virtual one, and failing while the fault says so."""

    owned = True
    description = "anarchon.testing's server"

    def __init__(
        self, inner: Connection, store: VirtualStore, prefix: str, instance: str | None
    ) -> None:
        self._inner = inner
        self._store = store
        self._format_key = format_key(prefix)
        self._prefix = prefix
        self.instance = instance

    async def _gate(self) -> None:
        store = self._store
        if self.instance is not None and self.instance in store.dead:
            raise TransportError(f"instance {self.instance!r} was killed (anarchon.testing)")
        if store.unreachable:
            raise TransportError("the server is unreachable (anarchon.testing)")
        frozen = store.frozen
        if frozen is not None:
            await frozen.wait()  # the engine's deadline ends the wait, as it would
            await self._gate()

    def _rewrite(self, command: Command) -> Command:
        verb = str(command[0]).upper()
        if verb == "EVALSHA":
            twin = _virtual_scripts().get(str(command[1]))
            if twin is None:
                return command
            return ("EVALSHA", twin.sha, *command[2:], int(self._store.wall_ms()))
        if verb == "EVAL":
            body = str(command[1])
            if CLOCK_READ not in body:
                return command
            return ("EVAL", virtual_body(body), *command[2:], int(self._store.wall_ms()))
        if verb == "TIME":
            now_us = int(self._store.wall_ms() * 1000)
            return ("EVAL", _TIME_REPLY, 0, now_us // 1_000_000, now_us % 1_000_000)
        if verb == "XADD":
            at = next(i for i in range(2, len(command)) if command[i] == "*")
            return (*command[:at], f"{int(self._store.wall_ms())}-*", *command[at + 1 :])
        if verb == "SET" and command[1] == self._format_key:
            return (command[0], command[1], VIRTUAL_STORE_FORMAT, *command[3:])
        return command

    async def _round_trip(self, send: Callable[[], Any]) -> Any:
        await self._gate()
        clock = self._store.clock
        clock.in_flight += 1
        try:
            return await send()
        finally:
            clock.in_flight -= 1

    async def execute(self, command: Command) -> Any:
        rewritten = self._rewrite(command)
        reply = await self._round_trip(lambda: self._inner.execute(rewritten))
        if command[0] == "GET" and command[1] == self._format_key and reply is not None:
            if _text(reply) != VIRTUAL_STORE_FORMAT:
                raise StoreFormatError(
                    f"the store under prefix {self._prefix!r} is kept by schedulers on the "
                    "real clock: anarchon.testing never runs on it; give the kit a server "
                    "of its own"
                )
            return str(STORE_FORMAT)
        return reply

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        rewritten = [self._rewrite(command) for command in commands]
        result: list[Any] = await self._round_trip(lambda: self._inner.pipeline(rewritten))
        return result

    async def listen(self, channel: str, on_message: Callable[[str], None]) -> None:
        await self._gate()
        clock = self._store.clock
        clock.in_flight += 1  # until subscribed: no hint sent meanwhile is missed
        holding = True

        def subscribed() -> None:
            nonlocal holding
            if holding:
                holding = False
                clock.in_flight -= 1

        try:
            await subscribe(self._store.url, channel, on_message, subscribed)
        finally:
            subscribed()

    async def aclose(self) -> None:
        await self._inner.close_if_owned()
