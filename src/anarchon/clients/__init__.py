"""Client adapters: every way to talk to Redis or Valkey goes through ``open_connection``."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, cast

from .._errors import InvalidOptionError, UnsupportedClientError
from ._protocol import (
    Arg,
    Command,
    Connection,
    ServerReplyError,
    TransportError,
    normalize_reply,
)

__all__ = [
    "Arg",
    "Command",
    "Connection",
    "ConnectionSpec",
    "ServerReplyError",
    "TransportError",
    "describe_client",
    "normalize_reply",
    "open_connection",
    "running_under_asyncio",
]

#: What a backend's ``redis=`` / ``valkey=`` option accepts.
ConnectionSpec = str | Mapping[str, Any] | object

_OPTION_KEYS = frozenset({"host", "port", "password", "username", "db", "tls"})
_TRIO_CLIENTS = (
    "a URL or an options mapping, a sync redis.Redis, or any object with send(command, args)"
)


def running_under_asyncio() -> bool:
    """True inside an asyncio event loop; False under trio."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _type_names(client: object) -> set[str]:
    return {f"{cls.__module__}.{cls.__qualname__}" for cls in type(client).__mro__}


def describe_client(client: object) -> str:
    cls = type(client)
    return f"{cls.__module__}.{cls.__qualname__}"


def validate_options(options: Mapping[str, Any]) -> None:
    """Reject unknown keys of an options mapping early, at backend construction."""
    unknown = set(options) - _OPTION_KEYS
    if unknown:
        raise InvalidOptionError(
            f"unknown connection option(s) {sorted(unknown)}; the options mapping takes "
            f"{sorted(_OPTION_KEYS)}, or pass a URL such as 'redis://user:pass@host:6379/0'"
        )


# Connections anarchon opens speak RESP2: every server from Redis 5 on does, while
# RESP3 (redis-py's default from version 8) needs Redis 6. Replies are normalised
# either way, so nothing above this module sees the difference.


def _open_from_url(url: str) -> Connection:
    if running_under_asyncio():
        import redis.asyncio

        from .redis_py import RedisAsyncConnection

        return RedisAsyncConnection(redis.asyncio.Redis.from_url(url, protocol=2), owned=True)
    import redis

    from .redis_py import RedisSyncConnection

    return RedisSyncConnection(redis.Redis.from_url(url, protocol=2), owned=True)


def _open_from_options(options: Mapping[str, Any]) -> Connection:
    validate_options(options)
    kwargs: dict[str, Any] = {
        "host": options.get("host", "localhost"),
        "port": int(options.get("port", 6379)),
        "db": int(options.get("db", 0)),
        "password": options.get("password"),
        "username": options.get("username"),
        "ssl": bool(options.get("tls", False)),
        "protocol": 2,
    }
    if running_under_asyncio():
        import redis.asyncio

        from .redis_py import RedisAsyncConnection

        return RedisAsyncConnection(redis.asyncio.Redis(**kwargs), owned=True)
    import redis

    from .redis_py import RedisSyncConnection

    return RedisSyncConnection(redis.Redis(**kwargs), owned=True)


def open_connection(spec: ConnectionSpec) -> Connection:
    """Turn what the user passed into a ``Connection``, choosing the adapter by type.

    Never imports a client library the user did not pass (except redis-py,
    which anarchon depends on, for URLs and options).
    """
    if isinstance(spec, str):
        return _open_from_url(spec)
    if isinstance(spec, Mapping):
        return _open_from_options(spec)
    names = _type_names(spec)
    if "redis.asyncio.client.Redis" in names:
        if not running_under_asyncio():
            raise UnsupportedClientError(
                f"{describe_client(spec)} is an asyncio client and cannot run under trio; "
                f"under trio pass {_TRIO_CLIENTS}"
            )
        from .redis_py import RedisAsyncConnection

        return RedisAsyncConnection(cast(Any, spec), owned=False)
    if "redis.client.Redis" in names:
        from .redis_py import RedisSyncConnection

        return RedisSyncConnection(cast(Any, spec), owned=False)
    if callable(getattr(spec, "send", None)):
        from .send import SendConnection

        return SendConnection(spec)
    raise UnsupportedClientError(
        f"cannot use {describe_client(spec)} as a Redis client: pass a URL "
        "('redis://host:6379/0'), an options mapping ({'host': ..., 'port': ...}), "
        "a redis-py client, or an object with a send(command, args) method"
    )
