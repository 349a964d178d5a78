"""Adapter for redis-py: ``redis.asyncio.Redis`` / ``RedisCluster`` natively, ``redis.Redis`` /
``RedisCluster`` in worker threads. valkey-py, a fork with the same interface, reuses it
(see ``valkey_py``) with its own exception classes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread

from ._protocol import (
    REPLY_ERROR_CLASSES,
    Command,
    Connection,
    ServerReplyError,
    TransportError,
    normalize_reply,
    whole_round_trip,
)
from .redact import scrub_error

__all__ = ["ClientErrors", "RedisAsyncConnection", "RedisSyncConnection", "redis_errors"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ClientErrors:
    """A client library's exception classes, mapped to anarchon's transport errors."""

    base: type[Exception]
    response: type[Exception]
    transport: tuple[type[Exception], ...]
    # The library turns an error reply's code into a class and drops the code from
    # the message; these are the codes anarchon acts on.
    reply_codes: tuple[tuple[type[Exception], str], ...]

    @classmethod
    def of(cls, exceptions: ModuleType) -> ClientErrors:
        base_name = "ValkeyError" if hasattr(exceptions, "ValkeyError") else "RedisError"
        return cls(
            base=getattr(exceptions, base_name),
            response=exceptions.ResponseError,
            # A cluster client's ClusterError ("TTL exhausted.": redirections that did
            # not settle) is no answer either; its subclasses with a code (CLUSTERDOWN,
            # MASTERDOWN) are matched by their codes first.
            transport=(
                exceptions.ConnectionError,
                exceptions.TimeoutError,
                *([exceptions.ClusterError] if hasattr(exceptions, "ClusterError") else []),
            ),
            reply_codes=tuple(
                (getattr(exceptions, name), code)
                for name, code in REPLY_ERROR_CLASSES
                if hasattr(exceptions, name)
            ),
        )

    def convert(self, exc: BaseException) -> Exception:
        """The one mapping of the library's errors: its text scrubbed of secrets (a
        connection's repr, redis-py's before 7.4 with its password) before anything
        shows or logs it."""
        text = scrub_error(exc)
        for cls, code in self.reply_codes:
            if isinstance(exc, cls):
                # The code as the server sent it, where the library kept it.
                code = getattr(exc, "status_code", None) or code
                return ServerReplyError(f"{code} {text}", code)
        if isinstance(exc, self.transport):
            return TransportError(f"{type(exc).__name__}: {text}")
        if isinstance(exc, self.response | self.base):
            return ServerReplyError(text)
        # Anything else (a cluster client's SlotNotCoveredError, a pool's exhaustion)
        # is a failure to get an answer, not an answer.
        return TransportError(f"{type(exc).__name__}: {text}")

    def batch_reply(self, item: Any) -> Any:
        if isinstance(item, BaseException):
            return self.convert(item)
        return normalize_reply(item)


def redis_errors() -> ClientErrors:
    import redis.exceptions

    return ClientErrors.of(redis.exceptions)


class RedisAsyncConnection(Connection):
    """An asyncio client of redis-py or valkey-py, standalone or cluster (asyncio only)."""

    #: The Sentinel object a client was made through (closed with it), if any.
    sentinel: Any = None

    def __init__(self, client: Any, *, owned: bool, errors: ClientErrors | None = None) -> None:
        self.client = client
        self.owned = owned
        self.errors = errors or redis_errors()
        self.description = f"{type(client).__module__}.{type(client).__qualname__}"

    async def execute(self, command: Command) -> Any:
        try:
            reply = await self.client.execute_command(*command)
        except Exception as exc:
            raise self.errors.convert(exc) from exc
        return normalize_reply(reply)

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        if not commands:
            return []
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:
            raise self.errors.convert(exc) from exc
        return whole_round_trip(replies, self.errors.batch_reply)

    async def listen(self, channel: str, on_message: Callable[[str], None]) -> None:
        own = _client_of_its_own(self.client, self.description)
        try:
            pubsub = own.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                while True:
                    message = await pubsub.get_message(timeout=None)
                    if message is not None and message.get("type") == "message":
                        on_message(_text(message["data"]))
            except self.errors.base as exc:
                raise self.errors.convert(exc) from exc
            finally:
                with anyio.move_on_after(_CLOSE_SEC, shield=True):
                    await pubsub.aclose()
        finally:
            with anyio.move_on_after(_CLOSE_SEC, shield=True):
                await own.aclose(close_connection_pool=True)

    async def aclose(self) -> None:
        await self.client.aclose()
        # A Sentinel-made client (clients/sentinel.py): its Sentinels' connections too.
        for sentinel in getattr(self.sentinel, "sentinels", ()):
            await sentinel.aclose()


class RedisSyncConnection(Connection):
    """A synchronous client of redis-py or valkey-py, standalone or cluster: each call
    runs in an anyio worker thread (works under asyncio and trio)."""

    def __init__(
        self,
        client: Any,
        *,
        owned: bool,
        errors: ClientErrors | None = None,
        max_threads: int = 8,
    ) -> None:
        self.sentinel: Any = None
        self.client = client
        self.owned = owned
        self.errors = errors or redis_errors()
        self.description = f"{type(client).__module__}.{type(client).__qualname__}"
        self._limiter = anyio.CapacityLimiter(max_threads)
        self._receiving_lock = threading.Lock()
        #: The stop of the subscription whose thread runs, if one does.
        self._receiving: threading.Event | None = None

    async def _in_thread(self, call: Callable[[], T]) -> T:
        # A deadline (or a stop) must not wait for a thread stuck on a frozen server:
        # the thread is left to finish on its own.
        return await anyio.to_thread.run_sync(call, limiter=self._limiter, abandon_on_cancel=True)

    async def execute(self, command: Command) -> Any:
        try:
            reply = await self._in_thread(lambda: self.client.execute_command(*command))
        except Exception as exc:
            raise self.errors.convert(exc) from exc
        return normalize_reply(reply)

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        if not commands:
            return []

        def send_batch() -> list[Any]:
            with self.client.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                return list(pipe.execute(raise_on_error=False))

        try:
            replies = await self._in_thread(send_batch)
        except Exception as exc:
            raise self.errors.convert(exc) from exc
        return whole_round_trip(replies, self.errors.batch_reply)

    async def listen(self, channel: str, on_message: Callable[[str], None]) -> None:
        # The last subscription's thread has ended, unless it was stuck on a server
        # that did not answer: wait a little for it, then refuse (one thread at a time).
        with anyio.move_on_after(_LAST_SUBSCRIPTION_ENDS_SEC):
            while self._receiving is not None:  # noqa: ASYNC110 - cleared by a thread
                await anyio.sleep(0.02)
        stop = threading.Event()
        began = threading.Event()
        ended = threading.Event()
        with self._receiving_lock:
            if self._receiving is not None:
                raise TransportError("the last subscription has not ended yet")
            self._receiving = stop

        def receive() -> None:
            # A thread of its own (not one of the connection's), on a connection outside
            # the user's pool: it waits for messages a little at a time, and ends soon
            # after the caller is cancelled (or once a stuck call returns).
            began.set()
            try:
                if stop.is_set():
                    return
                own = _client_of_its_own(self.client, self.description)
                pubsub = own.pubsub(ignore_subscribe_messages=True)
                try:
                    pubsub.subscribe(channel)
                    while not stop.is_set():
                        message = pubsub.get_message(timeout=_LOOK_FOR_STOP_SEC)
                        if message is not None and message.get("type") == "message":
                            text = _text(message["data"])
                            if not stop.is_set():
                                anyio.from_thread.run_sync(on_message, text)
                finally:
                    pubsub.close()
                    own.close()
                    own.connection_pool.disconnect()
            finally:
                with self._receiving_lock:
                    if self._receiving is stop:
                        self._receiving = None
                ended.set()

        try:
            await anyio.to_thread.run_sync(
                receive, limiter=anyio.CapacityLimiter(1), abandon_on_cancel=True
            )
        except self.errors.base as exc:
            raise self.errors.convert(exc) from exc
        finally:
            stop.set()
            if began.is_set():
                # The subscription's connection is closed before the caller goes on (a
                # stop returns with nothing left open), unless the thread is stuck on a
                # server that does not answer: it is then left to end on its own.
                with anyio.move_on_after(_THREAD_ENDS_SEC, shield=True):
                    while not ended.is_set():  # noqa: ASYNC110 - set by a thread
                        await anyio.sleep(0.01)
            else:  # cancelled before the thread ran: it may never
                with self._receiving_lock:
                    if self._receiving is stop:
                        self._receiving = None

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.client.close, abandon_on_cancel=True)
        for sentinel in getattr(self.sentinel, "sentinels", ()):
            await anyio.to_thread.run_sync(sentinel.close, abandon_on_cancel=True)


#: How long closing a subscription's connection may take: a local close, quick unless
#: the event loop is starved (a second was not always enough under load, and the
#: connection then stayed open after the stop).
_CLOSE_SEC = 5.0

#: How often a subscription's thread looks for its stop between messages.
_LOOK_FOR_STOP_SEC = 0.1

#: How long a stop waits for a subscription's thread to close its connection: it looks
#: for the stop every _LOOK_FOR_STOP_SEC, later on a loaded machine. One stuck on a
#: server that does not answer (subscribing) is left to end on its own.
_THREAD_ENDS_SEC = 2.0

#: How long a new subscription waits for the last one's thread to end, when that thread
#: did not end within its caller's stop (stuck on a server that does not answer).
_LAST_SUBSCRIPTION_ENDS_SEC = 1.5


def _client_of_its_own(client: Any, description: str) -> Any:
    """A client with ``client``'s connection settings and a pool of its own, for a
    subscription: it holds its connection for good, which must not be one of the
    user's (a pool of one would be left with none). A client made through Sentinels
    (``master_for``) is made again through them, with a pool of its own."""
    if hasattr(client, "get_nodes"):  # a cluster client: it has no pool of its own
        raise NotImplementedError(f"{description}: subscribing on a cluster")
    pool = client.connection_pool
    manager = getattr(pool, "sentinel_manager", None)
    if manager is not None and getattr(pool, "is_master", False):
        return manager.master_for(pool.service_name)
    try:
        own_pool = type(pool)(connection_class=pool.connection_class, **pool.connection_kwargs)
    except TypeError as exc:  # a pool made otherwise (a Sentinel's): poll instead
        raise NotImplementedError(f"{description}: no connection of its own ({exc})") from exc
    return type(client)(connection_pool=own_pool)


def _text(data: Any) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
