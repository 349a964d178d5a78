"""Timer hints: an instance that fires a kind hears of a timer set elsewhere to fall due
sooner than it would look.

``lua/timer_set.lua`` publishes a set that makes its key the first of the kind (bucket)
to need attention, as ``<due_ms> <due key>``, on the prefix's hint channel. The
listener here subscribes (on a connection of its own, where the client can) and brings
the kind's claim forward to that due time. Hints are never relied on: a hint lost (no
subscription yet, a dropped connection, a client that cannot subscribe) costs at most
``timer_poll_ms`` of lateness, since every instance also claims at least that often.
"""

from __future__ import annotations

import logging

import anyio

from .._timer_store import TimerKeys, kind_keys
from ._context import EngineContext
from .agenda import Agenda

__all__ = ["TimerHints"]

log = logging.getLogger("anarchon")

#: A subscription is made again this often: one on a link that died without a word
#: (a frozen server, a partition) hears nothing, and would never fail.
_RENEW_SEC = 60.0
#: Pauses before subscribing again after a failure: doubling up to the cap.
_FIRST_PAUSE_SEC = 0.5
_MAX_PAUSE_SEC = 5.0


class TimerHints:
    def __init__(self, context: EngineContext, agenda: Agenda, prefix: str) -> None:
        self._context = context
        self._agenda = agenda
        self._prefix = prefix
        #: Whether ``listen`` was started (with the first kind registered).
        self.listening = False
        self._stopped = False
        self._scope: anyio.CancelScope | None = None

    def stop(self) -> None:
        """End ``listen`` (the scheduler is stopping: its connection closes next)."""
        self._stopped = True
        if self._scope is not None:
            self._scope.cancel()

    async def listen(self) -> None:
        """Until ``stop()``: subscribe to the hint channel and act on each hint; after a
        failure, subscribe again after a pause. A client that cannot subscribe ends it
        (the instance polls)."""
        if self._stopped:
            return
        with anyio.CancelScope() as self._scope:
            await self._listen()

    async def _listen(self) -> None:
        store = self._context.store
        assert store is not None
        channel = TimerKeys.hint_channel(self._prefix)
        pause = _FIRST_PAUSE_SEC
        failing = False
        while True:
            try:
                with anyio.move_on_after(_RENEW_SEC) as renewal:
                    await store.conn.listen(channel, self.on_hint)
            except NotImplementedError as exc:
                log.info(
                    "timers set by other processes are seen within timer_poll_ms (%d ms): %s",
                    self._context.timer_poll_ms, exc,
                )  # fmt: skip
                return
            except Exception as exc:
                if not failing:
                    log.warning(
                        "timer hints unavailable (%s); timers set by other processes are "
                        "seen within timer_poll_ms (%d ms) until they are back",
                        exc, self._context.timer_poll_ms,
                    )  # fmt: skip
                failing = True
                await anyio.sleep(pause)
                pause = min(pause * 2, _MAX_PAUSE_SEC)
                continue
            if renewal.cancelled_caught:
                # The subscription lasted until its renewal: it worked.
                if failing:
                    log.info("timer hints are back")
                failing = False
                pause = _FIRST_PAUSE_SEC
            else:  # a client whose subscription ended by itself: not too often
                await anyio.sleep(pause)

    def on_hint(self, message: str) -> None:
        """``<due_ms> <due key>``: claim that kind (bucket) at the due time, if it fires
        here and would be claimed later."""
        if self._context.state != "running":
            return
        due_ms, _, due_key = message.partition(" ")
        if not due_ms.isdigit():
            return
        for kind in self._context.timer_kinds.values():
            for keys in kind_keys(self._prefix, kind.name, kind.buckets):
                if keys.due == due_key:
                    at_ms = int(due_ms) - self._context.server_offset_ms
                    self._agenda.timer_due(kind.name, keys, at_ms)
                    return
