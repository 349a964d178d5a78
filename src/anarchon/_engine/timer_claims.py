"""The timers' claimer: claims a timer kind's (bucket's) due timers when the agenda says,
starts the firings won, and puts the kind's next claim on the agenda."""

from __future__ import annotations

import logging

import anyio
from anyio.abc import TaskGroup

from .._errors import reason
from .._model.clock import monotonic, pace, wall_ms
from .._model.text import visible
from .._model.timer import TimerKind
from .._store.timers import FleetLimits, TimerClaim, TimerStore
from ..clients import ServerReplyError, is_transient
from .agenda import Agenda, DueTimers
from .context import EngineContext
from .runner import Runner
from .settle import Settler
from .work import firing_key

__all__ = ["TimerClaimer"]

log = logging.getLogger("anarchon")

#: The most due timers of one kind (bucket) one claim takes.
_TIMER_CLAIM_MAX = 200


class TimerClaimer:
    """Claims due timers of the kinds that fire here; won firings go to the runner."""

    def __init__(
        self,
        context: EngineContext,
        timer_store: TimerStore,
        group: TaskGroup,
        agenda: Agenda,
        runner: Runner,
        settler: Settler,
    ) -> None:
        self._context = context
        self._timer_store = timer_store
        self._group = group
        self._agenda = agenda
        self._runner = runner
        self._settler = settler
        #: The timer buckets (due keys) whose last claim the server refused.
        self._refused: set[str] = set()

    async def claim(self, due: DueTimers) -> None:
        """Claim a kind's (bucket's) due timers, as many as this instance has room for
        (``Capacity``: under its bound, and the kind's own), up to a batch. With no
        room, nothing is claimed: the timers stay in the store for the other instances,
        and the claim is made again when a run here ends (or at the poll interval). A
        claim sent again after a failed round trip is always sent: its reply hears of
        the firings it may have won."""
        context = self._context
        kind = context.timer_kinds.get(due.kind)
        if kind is None:
            return
        capacity = context.capacity
        owner = ("timer", kind.name)
        room = capacity.free(owner, kind.max_concurrent)
        if room <= 0 and due.failures == 0:
            capacity.deferred += 1
            self._agenda.wait_for_room(kind.name, due.keys)
            self._agenda.timer_due(kind.name, due.keys, wall_ms() + context.timer_poll_ms)
            return
        limit = max(min(_TIMER_CLAIM_MAX, room), 0)
        capacity.reserve(limit, owner)
        try:
            await self._claim(due, kind, limit)
        finally:
            capacity.unreserve(limit, owner)

    async def _claim(self, due: DueTimers, kind: TimerKind, limit: int) -> None:
        """Claim up to ``limit`` due timers; run what was won, and put the next claim on
        the agenda: at once if the batch was full, else when the earliest timer needs
        attention, but no later than the poll interval (a timer set elsewhere to fire
        sooner is seen by then). A claim whose round trip failed is sent again with its
        token base: its reply hears of the firings it won."""
        context = self._context
        keys = due.keys
        timer_store = self._timer_store
        sent = monotonic()
        claim: TimerClaim | None = None
        failure: BaseException | str = "no reply in time"
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + context.round_trip_sec
            try:
                claim = await timer_store.claim(
                    keys,
                    limit=limit,
                    lease_ms=context.lease_ms,
                    token_base=due.token,
                    max_attempts=kind.max_attempts,
                    limits=FleetLimits.of(kind),
                )
            except Exception as exc:
                failure = exc
        if claim is None and isinstance(failure, ServerReplyError) and not is_transient(failure):
            # The server answered, with an error (a script error, a key of another
            # type): not an outage. The bucket's claims are tried again, backing off,
            # and said once until one succeeds.
            context.health.answered()
            if keys.due not in self._refused:
                self._refused.add(keys.due)
                log.error(
                    "timers of %s: the server refused the claim of %s (%s); retrying, "
                    "backing off: check what else writes to its keys",
                    kind.name,
                    visible(keys.due),
                    reason(failure),
                )
            self._agenda.retry([due])
            return
        if claim is None:
            context.health.failed(f"claiming timers of {kind.name}", failure)
            self._agenda.retry([due])
            return
        context.health.answered()
        if keys.due in self._refused:
            self._refused.discard(keys.due)
            log.info("timers of %s: the claim of %s succeeds again", kind.name, visible(keys.due))
        received_ms = wall_ms()
        context.server_offset_ms = claim.server_now_ms - received_ms
        for reached in claim.limited:
            context.fleet_waited(("timer", kind.name), reached)
        for key in claim.spent:
            log.error(
                "timer %s %r: its runners vanished %d time(s) while it fired, as many as "
                "max_attempts; it is spent, with no attempt that finished",
                kind.name,
                key,
                kind.max_attempts,
            )
        group = self._group
        for win in claim.wins:
            if firing_key(kind.name, win.key, win.token) in context.attempts:
                continue  # a claim sent again: this firing runs here already
            if monotonic() >= sent + win.lease_left_ms / 1000:
                log.warning(
                    "timer %s %r attempt %d: won, but the reply came after its lease ran "
                    "out; not started (a backup takes it over)",
                    kind.name,
                    win.key,
                    win.attempt,
                )
                continue
            if win.trigger == "lapsed":
                group.start_soon(self._settler.settle_lapsed, kind, keys, win)
                continue
            try:
                self._runner.start_firing(kind, keys, win, sent)
            except Exception as exc:
                # Its payload or recurrence cannot be read here (a time zone this host
                # lacks): the attempt fails, loudly, and nothing else stops.
                log.error(
                    "timer %s %r attempt %d cannot be fired here (%s: %s); the attempt "
                    "counts as failed",
                    kind.name,
                    win.key,
                    win.attempt,
                    type(exc).__name__,
                    exc,
                )
                group.start_soon(self._settler.fail_firing, kind, keys, win)
        at_ms = received_ms + context.timer_poll_ms * pace().timer_poll_factor
        if claim.more or len(claim.wins) >= limit > 0:
            at_ms = received_ms  # more may be due: claimed at once, if there is room
        elif claim.next_ms is not None:
            # next_ms is on the server's clock: so many ms from now on this one.
            at_ms = min(at_ms, received_ms + max(claim.next_ms - claim.server_now_ms, 0))
        self._agenda.timer_due(kind.name, keys, at_ms)

    async def release_unanswered(self, due: DueTimers) -> None:
        """On stop: a claim of due timers whose reply was lost may have won firings that
        nobody runs. Sent again with no room for more (limit 0), it hears of them; each
        is given back (not counted as an attempt), so another instance fires it at once
        instead of a lease later."""
        context = self._context
        kind = context.timer_kinds.get(due.kind)
        timer_store = self._timer_store
        if kind is None:
            return
        claim: TimerClaim | None = None
        with anyio.move_on_after(context.round_trip_sec):
            try:
                claim = await timer_store.claim(
                    due.keys,
                    limit=0,
                    lease_ms=context.lease_ms,
                    token_base=due.token,
                    max_attempts=kind.max_attempts,
                )
            except Exception as exc:
                context.health.failed(f"resolving timer claims of {kind.name} on stop", exc)
        keys = due.keys
        async with anyio.create_task_group() as group:  # together: one round trip
            for win in claim.wins if claim is not None else ():
                if win.trigger != "lapsed":  # a lapsed recurrence lapses again, a lease later
                    group.start_soon(self._settler.release_firing, kind, keys, win)
