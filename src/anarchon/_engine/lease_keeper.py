"""The lease keeper: heartbeats the leases of the attempts running here, and fences locally.

One round trip per tick extends every lease that is due (or nearly). Each attempt knows
until when its lease is held (``held_until``, monotonic, from the send time of the last
accepted heartbeat): a refused heartbeat, or none accepted by then, cancels the handler
without waiting for any reply.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import anyio

from .._errors import ConnectionFailedError, LeaseLostError
from .._model.clock import monotonic
from .._model.job import Job
from .._model.progress import encode_progress
from .._store.contract import Store, describe_slot
from .._store.keys import JobKeys, TimerKeys
from .._store.quarantine import MalformedEntry, quarantine_of
from .._store.records import decode_progress
from .._store.timers import TimerStore
from ..clients import ServerReplyError
from .context import EngineContext
from .work import Leased

__all__ = ["LeaseKeeper"]

log = logging.getLogger("anarchon")


class LeaseKeeper:
    """Keeps the leases of ``context.attempts`` alive while they run."""

    def __init__(self, context: EngineContext, store: Store, timer_store: TimerStore) -> None:
        self._context = context
        self._store = store
        self._timer_store = timer_store
        #: Wakes the lease keeper when an attempt needs a heartbeat before its next tick.
        self._wake = anyio.Event()
        self._next_beat_at = math.inf

    def watch(self, attempt: Leased, lease_left_ms: int, since: float) -> None:
        """Keep the lease of an attempt just won: held for ``lease_left_ms`` from
        ``since`` (when the winning claim was sent, monotonic), as the store counts it (a
        claim-only win holds no lease to lose), first extended a heartbeat after that."""
        attempt.held_until = self._store.held_until(lease_left_ms, since)
        if attempt.held_until == math.inf:
            return
        attempt.next_beat = since + self._context.heartbeat_ms / 1000
        if attempt.next_beat < self._next_beat_at:
            self._wake.set()

    def wake(self) -> None:
        """Wake the keeper now (it ends once the scheduler has stopped)."""
        self._wake.set()

    async def keep_leases(self) -> None:
        """Heartbeat the leases of every running attempt, in one round trip per tick.

        An attempt's lease is extended every heartbeat_ms (those due within a quarter
        of that go along, so ticks stay few). A refused heartbeat means another attempt
        holds the run; none accepted by ``held_until`` means this instance can no longer
        tell. Either way the handler is cancelled at once, without waiting for any
        reply. Ends once the scheduler has stopped."""
        attempts = self._context.attempts
        early_sec = self._context.heartbeat_ms / 4000
        while not (self._context.state == "stopped" and not attempts):
            now = monotonic()
            live = [a for a in attempts.values() if not a.ended and not a.lost]
            for attempt in live:
                if attempt.ran_out(now):
                    self._give_up(attempt)
            live = [a for a in live if not a.lost]
            due = [a for a in live if a.next_beat <= now + early_sec]
            if due:
                # The round trip must not outlast any running attempt's local expiry:
                # those not in this tick are given up on time too.
                await self._heartbeat(due, min(a.held_until for a in live))
                continue
            self._next_beat_at = min(
                (min(a.next_beat, a.held_until) for a in live), default=math.inf
            )
            with anyio.move_on_after(self._next_beat_at - now):
                await self._wake.wait()
            self._next_beat_at = math.inf
            if self._wake.is_set():
                self._wake = anyio.Event()

    def _give_up(self, attempt: Leased) -> None:
        self.lose(
            attempt,
            "no heartbeat got through before the lease would expire (the server does not "
            "answer in time); a backup may take over",
        )

    def progress_of(self, job: Job, slot_id: str, text: str) -> Any:
        """What a won claim said the slot's last attempt kept (``Run.progress``)."""
        if not text:
            return None  # the common case, and a hot path: nothing to name
        key = JobKeys.for_job(self._context.prefix, job.name).state
        return self._decoded(key, f"p:{slot_id}", text, f"{job.name} {describe_slot(slot_id)}")

    def firing_progress(self, kind: str, keys: TimerKeys, key: str, text: str) -> Any:
        """What a won timer claim said the firing's last attempt kept
        (``TimerRun.progress``)."""
        if not text:
            return None
        return self._decoded(keys.progress, key, text, f"timer {kind} {key!r}")

    def _decoded(self, key: str, field: str, text: str, what: str) -> Any:
        """A progress as the store held it, decoded: None for one that does not read
        (quarantined, logged: the attempt starts from the beginning)."""
        try:
            return decode_progress(key, field, text)
        except MalformedEntry as entry:
            quarantine_of(self._context.prefix).add(entry, f"the progress of {what}")
            log.warning(
                "%s: the progress its last attempt kept does not read (%s); this attempt "
                "starts without it",
                what,
                entry.problem,
            )
            return None

    async def save_progress(self, attempt: Leased, value: object) -> None:
        """``save_progress`` of a run or a firing: keep ``value`` while the attempt holds
        its lease; a refusal (the fence) loses the lease here too."""
        text = encode_progress(value)
        if attempt.lease_lost.is_set():
            raise LeaseLostError(f"{attempt.describe()} no longer holds its lease: nothing kept")
        refused: str | None = None
        with anyio.move_on_after(self._context.round_trip_sec) as deadline:
            try:
                refused = await attempt.keep_progress(self._store, self._timer_store, text)
            except ServerReplyError:
                raise
            except Exception as exc:
                raise ConnectionFailedError(
                    f"{attempt.describe()}: the progress could not be kept ({exc}); it may "
                    "or may not be"
                ) from exc
        if deadline.cancelled_caught:
            raise ConnectionFailedError(
                f"{attempt.describe()}: no answer in time when keeping its progress; it may "
                "or may not be kept"
            )
        if refused is not None:
            reason = f"the store refused its progress: it is {refused}"
            self.lose(attempt, reason)
            raise LeaseLostError(f"{attempt.describe()}: {reason}; nothing kept")

    def lose(self, attempt: Leased, reason: str) -> None:
        """The attempt (or firing) no longer holds its lease: its handler is cancelled
        (or told), loudly."""
        attempt.lost = True
        attempt.cancel(reason, lost=True)
        events = self._context.events
        if events.on:
            events.emit(attempt.lost_event(self._context.instance_id, reason))

    async def _beat(self, attempts: list[Leased]) -> list[bool | ServerReplyError]:
        """One heartbeat per attempt (jobs') and firing (timers'), each kind in one
        round trip, the kinds at the same moment (so they share it); replies in the
        order of ``attempts``."""
        context = self._context
        lease_ms = context.lease_ms
        batches: dict[type[Leased], list[Leased]] = {}
        for attempt in attempts:
            batches.setdefault(type(attempt), []).append(attempt)
        by_attempt: dict[int, bool | ServerReplyError] = {}

        async def beat(kind: type[Leased], batch: list[Leased]) -> None:
            replies = await kind.heartbeats(self._store, self._timer_store, batch, lease_ms)
            by_attempt.update(zip(map(id, batch), replies, strict=True))

        if len(batches) == 1:
            ((kind, batch),) = batches.items()
            await beat(kind, batch)
        else:
            async with anyio.create_task_group() as group:
                for kind, batch in batches.items():
                    group.start_soon(beat, kind, batch)
        return [by_attempt[id(a)] for a in attempts]

    async def _heartbeat(self, attempts: list[Leased], first_expiry: float) -> None:
        context = self._context
        lease_ms = context.lease_ms
        sent = monotonic()
        # No longer than a round trip's deadline, and never past a lease's local expiry.
        deadline = min(context.round_trip_sec, first_expiry - sent)
        replies: list[bool | ServerReplyError] | None = None
        failure: BaseException | str = "no reply in time"
        with anyio.move_on_after(max(deadline, 0.001)):
            try:
                replies = await self._beat(attempts)
            except Exception as exc:
                failure = exc
        if replies is None:
            context.health.failed("heartbeat", failure)
        else:
            context.health.answered()
        now = monotonic()
        for index, attempt in enumerate(attempts):
            if context.attempts.get(attempt.registry_key) is not attempt:
                continue  # ended meanwhile
            if attempt.ended or attempt.lost:
                continue  # its finish is on the way (a refusal may just have crossed it)
            attempt.next_beat = sent + context.heartbeat_ms / 1000
            reply = replies[index] if replies is not None else None
            if reply is True:
                attempt.held_until = sent + lease_ms / 1000
            elif reply is False:
                self.lose(
                    attempt,
                    "the store refused its heartbeat: another attempt holds the run now, or "
                    "the run's state is gone (the store was wiped, or failed over to a "
                    "replica that had not seen the claim)",
                )
            elif attempt.ran_out(now):
                self._give_up(attempt)
            else:
                # Try again soon: there may be time for more than one try before the
                # lease would expire.
                retry_at = now + max((attempt.held_until - now) / 3, 0.05)
                attempt.next_beat = min(attempt.next_beat, retry_at)
                if reply is not None:
                    log.warning(
                        "%s: heartbeat refused for now, will retry: %s", attempt.name, reply
                    )
