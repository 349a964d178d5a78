"""The lease keeper: heartbeats the leases of the attempts running here, and fences locally.

One round trip per tick extends every lease that is due (or nearly). Each attempt knows
until when its lease is held (``held_until``, monotonic, from the send time of the last
accepted heartbeat): a refused heartbeat, or none accepted by then, cancels the handler
without waiting for any reply.
"""

from __future__ import annotations

import logging
import math
import time

import anyio

from .._store import HeartbeatRequest
from ..clients import ServerReplyError, TransportError
from ._context import _CLAIM_TIMEOUT_SEC, EngineContext, _Attempt

__all__ = ["LeaseKeeper"]

log = logging.getLogger("anarchon")


class LeaseKeeper:
    """Keeps the leases of ``context.attempts`` alive while they run."""

    def __init__(self, context: EngineContext) -> None:
        self._context = context
        #: Wakes the lease keeper when an attempt needs a heartbeat before its next tick.
        self._wake = anyio.Event()
        self._next_beat_at = math.inf

    def watch(self, attempt: _Attempt, lease_left_ms: int) -> None:
        """Keep the lease of an attempt just won: held for ``lease_left_ms`` from now,
        first extended a heartbeat from now."""
        now = time.monotonic()
        attempt.held_until = now + lease_left_ms / 1000
        attempt.next_beat = now + self._context.heartbeat_ms / 1000
        if attempt.next_beat < self._next_beat_at:
            self._wake.set()

    def wake(self) -> None:
        """Wake the keeper now (it ends once the scheduler has stopped)."""
        self._wake.set()

    async def keep_leases(self) -> None:
        """Heartbeat the leases of every running attempt, in one round trip per tick.

        An attempt's lease is extended every heartbeat_ms (those due within a quarter
        of that go along, so ticks stay few). A refused heartbeat, or none accepted
        for a whole lease, means the lease is lost and the handler is cancelled. Ends
        once the scheduler has stopped."""
        attempts = self._context.attempts
        early_sec = self._context.heartbeat_ms / 4000
        while not (self._context.state == "stopped" and not attempts):
            now = time.monotonic()
            due = [a for a in attempts.values() if a.next_beat <= now + early_sec]
            if due:
                await self._heartbeat(due)
                continue
            self._next_beat_at = min((a.next_beat for a in attempts.values()), default=math.inf)
            with anyio.move_on_after(self._next_beat_at - now):
                await self._wake.wait()
            self._next_beat_at = math.inf
            if self._wake.is_set():
                self._wake = anyio.Event()

    async def _heartbeat(self, attempts: list[_Attempt]) -> None:
        store = self._context.store
        assert store is not None
        lease_ms = self._context.lease_ms
        beats = [
            HeartbeatRequest(a.job.name, a.slot_id, a.token, lease_ms, a.job.overlap)
            for a in attempts
        ]
        sent = time.monotonic()
        replies: list[bool | ServerReplyError] | None = None
        failure = "timed out"
        with anyio.move_on_after(_CLAIM_TIMEOUT_SEC):
            try:
                replies = await store.heartbeat_many(beats)
            except TransportError as exc:
                failure = str(exc)
        for index, attempt in enumerate(attempts):
            if self._context.attempts.get((attempt.job.name, attempt.slot_id)) is not attempt:
                continue  # ended meanwhile
            attempt.next_beat = sent + self._context.heartbeat_ms / 1000
            reply = replies[index] if replies is not None else failure
            if reply is True:
                attempt.held_until = sent + lease_ms / 1000
            elif reply is False:
                attempt.lost = True
                attempt.cancel("another attempt holds the run now")
            elif time.monotonic() >= attempt.held_until:
                attempt.lost = True
                attempt.cancel(f"no heartbeat got through for a whole lease ({reply})")
            else:
                log.warning("%s: heartbeat failed, will retry: %s", attempt.job.name, reply)
