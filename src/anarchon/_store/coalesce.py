"""Commands that tasks send at the same moment go out as one pipeline.

When many runs end (or heartbeat) together, each task's command would otherwise
be a round trip of its own, and with a pooled client a connection of its own.
The first task to send becomes the batch's sender: it lets the other ready tasks
add their commands (one scheduling turn), then sends them all in one pipeline
and hands each task its replies.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel

from .._errors import reason
from ..clients import Command, Connection, TransportError

__all__ = ["pipeline"]


class _Entry:
    __slots__ = ("batch", "commands", "done", "error", "replies")

    def __init__(self, commands: Sequence[Command], done: anyio.Event | None) -> None:
        self.commands = commands
        self.done = done
        self.replies: list[Any] = []
        self.error: Exception | None = None
        #: Set when this entry's caller is to send the batch (from itself on): the
        #: batch's sender was cancelled before it could.
        self.batch: list[_Entry] | None = None


def _hand_over(rest: list[_Entry]) -> None:
    """The batch's sender was cancelled before sending: the first of the others sends
    the rest (a cancellation that anyio's shield does not stop, asyncio's own, must not
    leave them waiting for replies that were never asked for)."""
    if rest:
        rest[0].batch = rest
        assert rest[0].done is not None
        rest[0].done.set()


class _Coalescer:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        #: The batch being gathered (its sender is waiting one turn), if any.
        self.gathering: list[_Entry] | None = None

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        if self.gathering is not None:
            entry = _Entry(commands, anyio.Event())
            self.gathering.append(entry)
            assert entry.done is not None
            try:
                await entry.done.wait()
            except BaseException:
                if entry.batch is not None:  # handed the batch as it was cancelled
                    _hand_over(entry.batch[1:])
                raise
            if entry.batch is not None:
                await self._send(entry.batch)
        else:
            entry = _Entry(commands, None)
            batch = self.gathering = [entry]
            try:
                with anyio.CancelScope(shield=True):
                    await anyio.lowlevel.checkpoint()
            except BaseException:
                _hand_over(batch[1:])
                raise
            finally:
                self.gathering = None
            await self._send(batch)
        if entry.error is not None:
            raise entry.error
        return entry.replies

    async def _send(self, batch: list[_Entry]) -> None:
        if len(batch) == 1:
            batch[0].replies = await self.conn.pipeline(batch[0].commands)
            return
        try:
            replies = await self.conn.pipeline([c for entry in batch for c in entry.commands])
        except BaseException as exc:
            # The sender gets the exception itself; the others a transport error each,
            # which their callers retry like any failed round trip. A sender that stopped
            # waiting (its deadline, or a cancel) leaves them without an answer: their
            # commands may or may not have been applied.
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                why = (
                    "the server did not answer in time (the task that sent the round trip "
                    "this call shared stopped waiting for it); the commands may or may not "
                    "have been applied"
                )
            else:
                why = f"the round trip this call shared failed: {reason(exc)}"
            for entry in batch[1:]:
                entry.error = TransportError(why)
                assert entry.done is not None
                entry.done.set()
            raise
        offset = 0
        for entry in batch:
            entry.replies = replies[offset : offset + len(entry.commands)]
            offset += len(entry.commands)
            if entry.done is not None:
                entry.done.set()


_coalescers: weakref.WeakKeyDictionary[Connection, _Coalescer] = weakref.WeakKeyDictionary()


async def pipeline(conn: Connection, commands: Sequence[Command]) -> list[Any]:
    """``conn.pipeline(commands)``, sharing one round trip with the commands other tasks
    send in the same scheduling turn. Replies (error replies as ``ServerReplyError``
    items) come back in order, for this call's commands only."""
    if not commands:
        return []
    coalescer = _coalescers.get(conn)
    if coalescer is None:
        coalescer = _coalescers[conn] = _Coalescer(conn)
    return await coalescer.pipeline(commands)
