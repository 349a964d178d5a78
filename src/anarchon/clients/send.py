"""Adapter for any object with ``send(command, args)``, sync or async."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread

from ._protocol import (
    REPLY_ERROR_CLASSES,
    Command,
    Connection,
    ServerReplyError,
    TransportError,
    normalize_reply,
)
from .redact import scrub_error

__all__ = ["SendConnection", "convert_error"]

# Error replies start with an upper-case code word (ERR, NOSCRIPT, WRONGTYPE, ...).
# A client that raises with such a message, or with an exception class named for
# a reply (OutOfMemoryError, ResponseError, ...), reports a server reply; anything
# else is taken as a transport failure.
_REPLY_CODE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ_-")


def convert_error(exc: BaseException) -> Exception:
    """The one mapping of a ``send()`` client's errors, their text scrubbed of secrets
    first (a client may name the URL it was made with)."""
    text = scrub_error(exc)
    name = type(exc).__name__
    # A library that drops the code from the message names it in the class (or a
    # base class: a user's own subclass of redis-py's OutOfMemoryError).
    classes = {cls.__name__ for cls in type(exc).__mro__}
    for class_name, code in REPLY_ERROR_CLASSES:
        if class_name in classes:
            return ServerReplyError(f"{code} {text}", code)
    word = text.split(" ", 1)[0]
    if (word and set(word) <= _REPLY_CODE_CHARS) or "Response" in name:
        return ServerReplyError(text)
    return TransportError(f"{name}: {text}")


class SendConnection(Connection):
    """Wraps ``client.send(command, args)``; a coroutine function is awaited, a plain one
    runs in a worker thread. A batch is sent concurrently (async) or in one thread (sync)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.owned = False
        self.description = f"{type(client).__qualname__}.send"
        self._is_async = inspect.iscoroutinefunction(client.send)

    async def _send(self, command: Command) -> Any:
        name, *args = command
        if self._is_async:
            reply = await self.client.send(str(name), [str(a) for a in args])
        else:
            reply = await anyio.to_thread.run_sync(
                self.client.send, str(name), [str(a) for a in args], abandon_on_cancel=True
            )
            if inspect.isawaitable(reply):
                reply = await reply
        return normalize_reply(reply)

    async def execute(self, command: Command) -> Any:
        try:
            return await self._send(command)
        except (ServerReplyError, TransportError):
            raise
        except Exception as exc:
            raise convert_error(exc) from exc

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        replies: list[Any] = [None] * len(commands)
        failures: list[TransportError] = []

        async def one(index: int, command: Command) -> None:
            try:
                replies[index] = await self.execute(command)
            except ServerReplyError as exc:
                replies[index] = exc
            except TransportError as exc:
                # Kept, not raised: raised in the task group it would reach the caller
                # wrapped in an exception group, which no caller expects.
                failures.append(exc)

        async with anyio.create_task_group() as group:
            for index, command in enumerate(commands):
                group.start_soon(one, index, command)
        if failures:
            raise failures[0]
        return replies
