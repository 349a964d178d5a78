"""The clocks every part reads, and the deadline of one round trip to the server.

Every part reads the wall clock through ``wall_ms()`` and the monotonic clock through
``monotonic()``; sleeps and deadlines are the event loop's (anyio's). In production
both read the host's clocks. ``anarchon.testing`` runs a fleet on virtual time: it
moves the event loop's clock, and sets ``VIRTUAL`` (in the context its schedulers run
in, and nowhere else) so that these two read the same virtual time, and so that a
backend opened there connects to its server (``Virtual.connect``). Production code
never sets it.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..clients import Connection

__all__ = [
    "PRODUCTION",
    "VIRTUAL",
    "Pace",
    "Virtual",
    "monotonic",
    "pace",
    "round_trip_deadline_sec",
    "wall_ms",
]


@dataclass(frozen=True, slots=True)
class Pace:
    """How often an instance does what no slot's fate depends on (its housekeeping),
    and how it meets an instant. Production's are these defaults; virtual time, where
    every wake-up costs real time and the clocks cannot step, has its own."""

    #: How long a registration lives (it is renewed every third of it): an instance
    #: that stopped renewing is gone from the live ones after this.
    registration_ttl_ms: int = 30_000
    #: The longest single sleep of the claim loop: the wall clock is read again after
    #: it, so a clock step or a suspended machine delays a claim by at most this much.
    sleep_cap_sec: float = 5.0
    #: Sleeping to a slot's instant: the event loop's timers overshoot by about a
    #: millisecond, so the claim loop sleeps to just before the instant, then yields
    #: until it arrives.
    sleep_margin_sec: float = 0.002
    #: How long a subscription to hints lasts before it is made again (one that died
    #: without a word is noticed by then).
    hints_renew_sec: float = 60.0
    #: How many times ``timer_poll_ms`` an instance waits before it claims a timer kind
    #: again when it knows of nothing due sooner (hints tell it of a sooner one).
    timer_poll_factor: float = 1.0


#: The pace of every instance in production.
PRODUCTION = Pace()


class Virtual(Protocol):
    """Virtual time, as ``anarchon.testing`` keeps it."""

    def wall_ms(self) -> float:
        """The virtual wall clock, in epoch milliseconds."""
        ...

    def monotonic(self) -> float:
        """The virtual monotonic clock (the event loop's), in seconds."""
        ...

    def connect(self, prefix: str) -> Connection:
        """A connection to the store on virtual time (whatever the backend was given)."""
        ...

    @property
    def pace(self) -> Pace:
        """The instances' pace on virtual time."""
        ...


#: The virtual time of the context, or None: the host's clocks (always, in production).
VIRTUAL: ContextVar[Virtual | None] = ContextVar("anarchon_virtual_time", default=None)


def wall_ms() -> float:
    """This host's wall clock, in epoch milliseconds (or the virtual one)."""
    virtual = VIRTUAL.get()
    if virtual is None:
        return time.time() * 1000.0
    return virtual.wall_ms()


def monotonic() -> float:
    """This host's monotonic clock, in seconds (or the virtual one)."""
    virtual = VIRTUAL.get()
    if virtual is None:
        return time.monotonic()
    return virtual.monotonic()


def pace() -> Pace:
    """The pace of the instances of this context: production's, or virtual time's."""
    virtual = VIRTUAL.get()
    return PRODUCTION if virtual is None else virtual.pace


def round_trip_deadline_sec(lease_ms: int) -> float:
    """How long one round trip (a claim batch, a heartbeat tick, a finish) may take
    before it counts as failed: a third of the lease, between 0.25 s and 10 s. Never
    only the client's own timeout (a frozen server, a client without one). A third
    leaves a heartbeat sent half a lease after the last one time to fail and be
    retried before the lease expires."""
    return min(max(lease_ms / 3000, 0.25), 10.0)
