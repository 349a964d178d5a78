"""Hints: an instance hears of work that falls due sooner than it would look.

Four kinds of message come on the prefix's hint channel (``_store/keys.py`` defines
them, ``Hint``):

- ``TimerDue``: a set made its key the first of the kind (bucket) to need attention; an
  instance that fires the kind brings the kind's claim forward to that due time.
- ``RunGivenBack``: a stopping instance gave a run back (it was cancelled with attempts
  left); an instance that runs the job claims it now, instead of when the
  lease it knew of would have run out.
- ``RunRequested``: the fleet was asked to run the job now (``anarchon run-now``,
  ``Inspector.run_now``); every instance that runs the job claims that manual slot, and
  one of them wins it.
- ``BackfillAsked``: a backfill of the job was asked for; an instance that runs the job
  reads the jobs with a backfill now (``backfill.py``), instead of at its next
  registration renewal.

The listener here subscribes (on a connection of its own, where the client can). Hints
are never relied on: a hint lost (no subscription yet, a dropped connection, a client
that cannot subscribe) costs at most ``timer_poll_ms`` of lateness for a timer, a
lease for a given-back run, and a registration renewal (10 s) for a backfill.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio

from .._model.clock import pace
from .._model.text import visible
from .._store.contract import is_slot_id
from .._store.keys import (
    BackfillAsked,
    RunGivenBack,
    RunRequested,
    TimerDue,
    hint_channel,
    kind_keys,
    parse_hint,
)
from ..clients import Connection
from .agenda import Agenda
from .context import EngineContext

__all__ = ["Hints"]

log = logging.getLogger("anarchon")

#: Pauses before subscribing again after a failure: doubling up to the cap.
_FIRST_PAUSE_SEC = 0.5
_MAX_PAUSE_SEC = 5.0


class Hints:
    def __init__(self, context: EngineContext, agenda: Agenda, prefix: str) -> None:
        self._context = context
        self._agenda = agenda
        self._prefix = prefix
        #: Whether ``listen`` was started (with the first kind registered).
        self.listening = False
        self._stopped = False
        self._scope: anyio.CancelScope | None = None
        self._told_of_bad_hint = False
        #: Told of a backfill asked for a job that runs here (the backfills, once started).
        self.on_backfill: Callable[[], None] | None = None

    def stop(self) -> None:
        """End ``listen`` (the scheduler is stopping: its connection closes next)."""
        self._stopped = True
        if self._scope is not None:
            self._scope.cancel()

    async def listen(self, conn: Connection) -> None:
        """Until ``stop()``: subscribe to the hint channel and act on each hint; after a
        failure, subscribe again after a pause. A client that cannot subscribe ends it
        (the instance polls)."""
        if self._stopped:
            return
        with anyio.CancelScope() as self._scope:
            await self._listen(conn)

    async def _listen(self, conn: Connection) -> None:
        channel = hint_channel(self._prefix)
        pause = _FIRST_PAUSE_SEC
        failing = False
        while True:
            try:
                with anyio.move_on_after(pace().hints_renew_sec) as renewal:
                    await conn.listen(channel, self.on_hint)
            except NotImplementedError as exc:
                log.info("hints are off (%s): %s", exc, self._without_hints())
                return
            except Exception as exc:
                if not failing:
                    log.warning(
                        "hints unavailable (%s); until they are back, %s",
                        exc,
                        self._without_hints(),
                    )
                failing = True
                await anyio.sleep(pause)
                pause = min(pause * 2, _MAX_PAUSE_SEC)
                continue
            if renewal.cancelled_caught:
                # The subscription lasted until its renewal: it worked.
                if failing:
                    log.info("hints are back")
                failing = False
                pause = _FIRST_PAUSE_SEC
            else:  # a client whose subscription ended by itself: not too often
                await anyio.sleep(pause)

    def _without_hints(self) -> str:
        return (
            f"timers set by other processes are seen within timer_poll_ms "
            f"({self._context.timer_poll_ms} ms), and a run given back by a stopping "
            "instance is taken over when its lease would have run out"
        )

    def on_hint(self, message: str) -> None:
        """Act on a hint (``Hint``): a timer due sooner is claimed then, if its kind fires
        here; a run given back is claimed now, if this instance is one of its backups; a
        run the fleet was asked for is claimed now, if the job runs here."""
        if self._context.state != "running":
            return
        try:
            self._act_on(message)
        except Exception as exc:
            # Anyone the ACL lets publish here can send anything: a hint is never relied
            # on, and one that cannot be acted on costs itself, never the subscription.
            if not self._told_of_bad_hint:
                self._told_of_bad_hint = True
                log.warning(
                    "a hint that cannot be acted on was ignored (%s: %s): %r; later ones "
                    "are logged at DEBUG",
                    type(exc).__name__,
                    exc,
                    visible(message, 200),
                )
            else:
                log.debug("a hint that cannot be acted on was ignored: %r", visible(message, 200))

    def _act_on(self, message: str) -> None:
        hint = parse_hint(message)
        if isinstance(hint, RunGivenBack | RunRequested) and not is_slot_id(hint.slot_id):
            raise ValueError("its slot is no slot id anarchon writes")
        match hint:
            case RunGivenBack(slot_id, job):
                self._agenda.claim_given_back(job, slot_id)
            case RunRequested(slot_id, job):
                asked = self._context.jobs.get(job)
                if asked is not None and slot_id.startswith("m"):
                    self._agenda.claim_now(asked, slot_id)
            case BackfillAsked(job):
                if job in self._context.jobs and self.on_backfill is not None:
                    self.on_backfill()
            case TimerDue(due_ms, due_key):
                for kind in self._context.timer_kinds.values():
                    for keys in kind_keys(self._prefix, kind.name, kind.buckets):
                        if keys.due == due_key:
                            at_ms = due_ms - self._context.server_offset_ms
                            self._agenda.timer_due(kind.name, keys, at_ms)
                            return
