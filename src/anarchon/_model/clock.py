"""The clock every part reads, and the deadline of one round trip to the server."""

from __future__ import annotations

import time

__all__ = ["wall_ms", "round_trip_deadline_sec"]


def wall_ms() -> float:
    """This host's wall clock, in epoch milliseconds."""
    return time.time() * 1000.0


def round_trip_deadline_sec(lease_ms: int) -> float:
    """How long one round trip (a claim batch, a heartbeat tick, a finish) may take
    before it counts as failed: a third of the lease, between 0.25 s and 10 s. Never
    only the client's own timeout (a frozen server, a client without one). A third
    leaves a heartbeat sent half a lease after the last one time to fail and be
    retried before the lease expires."""
    return min(max(lease_ms / 3000, 0.25), 10.0)
