"""Adapter for redis-py: ``redis.asyncio.Redis`` natively, ``redis.Redis`` in worker threads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import redis
import redis.asyncio
import redis.exceptions

from ._protocol import Command, Connection, ServerReplyError, TransportError, normalize_reply

__all__ = ["RedisAsyncConnection", "RedisSyncConnection", "convert_error"]

T = TypeVar("T")


# redis-py turns an error reply's code into an exception class and drops the
# code from the message; these are the codes anarchon acts on.
_REPLY_CODES: tuple[tuple[type[Exception], str], ...] = (
    (redis.exceptions.NoScriptError, "NOSCRIPT"),
    (redis.exceptions.ReadOnlyError, "READONLY"),
)


def convert_error(exc: BaseException) -> Exception:
    """Map a redis-py exception to anarchon's transport-level errors."""
    for cls, code in _REPLY_CODES:
        if isinstance(exc, cls):
            return ServerReplyError(f"{code} {exc}", code)
    if isinstance(exc, redis.exceptions.ResponseError):
        return ServerReplyError(str(exc))
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return TransportError(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, redis.exceptions.RedisError):
        return ServerReplyError(str(exc))
    return TransportError(f"{type(exc).__name__}: {exc}")


def _batch_reply(item: Any) -> Any:
    if isinstance(item, BaseException):
        return convert_error(item)
    return normalize_reply(item)


class RedisAsyncConnection(Connection):
    """``redis.asyncio.Redis`` (asyncio only)."""

    def __init__(self, client: redis.asyncio.Redis, *, owned: bool) -> None:
        self.client = client
        self.owned = owned
        self.description = "redis.asyncio.Redis"

    async def execute(self, command: Command) -> Any:
        try:
            reply = await self.client.execute_command(*command)  # type: ignore[no-untyped-call]
        except redis.exceptions.RedisError as exc:
            raise convert_error(exc) from exc
        return normalize_reply(reply)

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        if not commands:
            return []
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                replies = await pipe.execute(raise_on_error=False)
        except redis.exceptions.RedisError as exc:
            raise convert_error(exc) from exc
        return [_batch_reply(item) for item in replies]

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.client.aclose()


class RedisSyncConnection(Connection):
    """``redis.Redis``: each call runs in an anyio worker thread (works under asyncio and trio)."""

    def __init__(self, client: redis.Redis, *, owned: bool, max_threads: int = 8) -> None:
        self.client = client
        self.owned = owned
        self.description = "redis.Redis"
        self._limiter = anyio.CapacityLimiter(max_threads)

    async def _in_thread(self, call: Callable[[], T]) -> T:
        return await anyio.to_thread.run_sync(call, limiter=self._limiter)

    async def execute(self, command: Command) -> Any:
        try:
            reply = await self._in_thread(lambda: self.client.execute_command(*command))  # type: ignore[no-untyped-call]
        except redis.exceptions.RedisError as exc:
            raise convert_error(exc) from exc
        return normalize_reply(reply)

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        if not commands:
            return []

        def send_batch() -> list[Any]:
            with self.client.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)  # type: ignore[no-untyped-call]
                return pipe.execute(raise_on_error=False)

        try:
            replies = await self._in_thread(send_batch)
        except redis.exceptions.RedisError as exc:
            raise convert_error(exc) from exc
        return [_batch_reply(item) for item in replies]

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.client.close)
