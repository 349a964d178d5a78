"""Opening a ``Connection`` from what a backend was given: a URL or an options mapping
(a redis-py client anarchon makes, directly or through Sentinels), or a client object,
recognised by its class, wrapped in its library's adapter."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Mapping
from typing import Any

from .._errors import InvalidOptionError, UnsupportedClientError
from ._protocol import Connection

# The adapters of the optional libraries (glide, valkey_py) import their library only
# when they are handed a client of it: importing the adapters here loads neither.
from .glide import GlideAsyncConnection, GlideSyncConnection
from .redis_py import RedisAsyncConnection, RedisSyncConnection
from .send import SendConnection
from .sentinel import SentinelSpec, is_sentinel_url, open_sentinel
from .spec import ConnectionSpec, url_for_redis_py, validate_options
from .valkey_py import valkey_connection

__all__ = ["describe_client", "open_connection", "running_under_asyncio"]

_TRIO_CLIENTS = (
    "a URL or an options mapping, a synchronous redis.Redis / RedisCluster or "
    "valkey.Valkey / ValkeyCluster, a Valkey GLIDE client (glide or glide_sync), or any "
    "object with send(command, args)"
)


def running_under_asyncio() -> bool:
    """True inside an asyncio event loop; False under trio."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def describe_client(client: object) -> str:
    cls = type(client)
    return f"{cls.__module__}.{cls.__qualname__}"


# Connections anarchon opens speak RESP2: every server from Redis 5 on does, while
# RESP3 (redis-py's default from version 8) needs Redis 6. Replies are normalised
# either way, so nothing above this package sees the difference.


def _own_connection() -> dict[str, Any]:
    """How anarchon's own redis-py connections are made: RESP2, and no CLIENT SETINFO
    on connect. A request that misses its deadline costs its connection (redis-py's
    asyncio client drops it), so a new one must cost no round trips of its own: on a
    link whose round trip is over a third of the deadline, nothing would get through
    again. redis-py 8.1 names the setting ``driver_info``, 5.0 to 8.0
    ``lib_name``/``lib_version``."""
    if importlib.util.find_spec("redis.driver_info") is not None:
        return {"protocol": 2, "driver_info": None}
    return {"protocol": 2, "lib_name": None, "lib_version": None}


def _own_client(kwargs: dict[str, Any], url: str | None = None) -> Connection:
    """A redis-py client anarchon makes (and closes), for the event loop it runs under:
    from ``url`` with ``kwargs`` on top, or from ``kwargs`` alone.

    redis-py is imported here, not at the top: ``import anarchon`` does not load it,
    and neither does a client of another library passed in place of a URL."""
    if running_under_asyncio():
        import redis.asyncio

        # Every round trip anarchon makes has a deadline of its own (a cancel scope), so
        # its asyncio connections read without redis-py's per-reply timeout (redis-py 8:
        # 5 s), which enters an asyncio timeout for each reply of a pipeline. A
        # socket_timeout in the URL wins over this. Under trio a blocking read in a
        # worker thread cannot be cancelled: there the client's own timeout stays.
        kwargs = {"socket_timeout": None, **kwargs}
        async_client = (
            redis.asyncio.Redis(**kwargs)
            if url is None
            else redis.asyncio.Redis.from_url(url, **kwargs)
        )
        return RedisAsyncConnection(async_client, owned=True)
    import redis

    client = redis.Redis(**kwargs) if url is None else redis.Redis.from_url(url, **kwargs)
    return RedisSyncConnection(client, owned=True)


def _open_through_sentinels(spec: SentinelSpec) -> Connection:
    client, sentinel = open_sentinel(spec, _own_connection(), running_under_asyncio())
    connection: RedisAsyncConnection | RedisSyncConnection
    if running_under_asyncio():
        connection = RedisAsyncConnection(client, owned=True)
    else:
        connection = RedisSyncConnection(client, owned=True)
    connection.sentinel = sentinel
    connection.description = spec.describe()
    return connection


def _open_from_url(url: str) -> Connection:
    if is_sentinel_url(url):
        return _open_through_sentinels(SentinelSpec.from_url(url))
    url = url_for_redis_py(url)
    kwargs = _own_connection()
    if url.lower().startswith("rediss://"):
        # The server's certificate must name the host, whatever the client library's
        # default (redis-py 5.0 checks no name); ssl_check_hostname=false in the URL,
        # which wins over these, turns it off.
        kwargs["ssl_check_hostname"] = True
    return _own_client(kwargs, url)


def _open_from_options(options: Mapping[str, Any]) -> Connection:
    validate_options(options)
    if "sentinel" in options:
        return _open_through_sentinels(SentinelSpec.from_options(options))
    kwargs: dict[str, Any] = {
        "host": options.get("host", "localhost"),
        "port": int(options.get("port", 6379)),
        "db": int(options.get("db", 0)),
        "password": options.get("password"),
        "username": options.get("username"),
        "ssl": bool(options.get("tls", False)),
        **_own_connection(),
    }
    if kwargs["ssl"]:
        # CA bundle to verify the server with; client certificate and key for mutual TLS.
        kwargs["ssl_ca_certs"] = options.get("tls_ca_certs")
        kwargs["ssl_certfile"] = options.get("tls_certfile")
        kwargs["ssl_keyfile"] = options.get("tls_keyfile")
        # The certificate must name the host, unless told otherwise (whatever the
        # client library's default).
        kwargs["ssl_check_hostname"] = bool(options.get("tls_check_hostname", True))
    elif any(key.startswith("tls_") for key in options):
        raise InvalidOptionError(
            "tls_ca_certs, tls_certfile, tls_keyfile and tls_check_hostname need tls=True"
        )
    return _own_client(kwargs)


def _classes(client: object) -> list[tuple[str, str]]:
    """(top-level package, class name) of every class in the client's MRO."""
    return [(cls.__module__.split(".", 1)[0], cls.__qualname__) for cls in type(client).__mro__]


def _has_class(client: object, package: str, *names: str, module_part: str = "") -> bool:
    return any(
        top == package and qualname in names and module_part in cls.__module__
        for (top, qualname), cls in zip(_classes(client), type(client).__mro__, strict=True)
    )


def _asyncio_only(client: object) -> None:
    if not running_under_asyncio():
        raise UnsupportedClientError(
            f"{describe_client(client)} is an asyncio client and cannot run under trio; "
            f"under trio pass {_TRIO_CLIENTS}"
        )


def open_connection(spec: ConnectionSpec) -> Connection:
    """Turn what the user passed into a ``Connection``, choosing the adapter by type.

    Never imports a client library the user did not pass (except redis-py,
    which anarchon depends on, for URLs and options).
    """
    if isinstance(spec, str):
        return _open_from_url(spec)
    if isinstance(spec, Mapping):
        return _open_from_options(spec)
    client: Any = spec
    for package in ("redis", "valkey"):
        standalone = "Redis" if package == "redis" else "Valkey"
        cluster = f"{standalone}Cluster"
        is_async = _has_class(client, package, standalone, cluster, module_part=".asyncio")
        is_sync = not is_async and _has_class(client, package, standalone, cluster)
        if is_async:
            _asyncio_only(client)
        if is_async or is_sync:
            if package == "redis":
                if is_async:
                    return RedisAsyncConnection(client, owned=False)
                return RedisSyncConnection(client, owned=False)
            return valkey_connection(client, is_async=is_async)
    for package in ("glide", "glide_sync"):
        if _has_class(client, package, "GlideClient", "GlideClusterClient"):
            is_cluster = _has_class(client, package, "GlideClusterClient")
            if package == "glide":
                return GlideAsyncConnection(client, cluster=is_cluster)
            return GlideSyncConnection(client, cluster=is_cluster)
    if callable(getattr(client, "send", None)):
        return SendConnection(client)
    raise UnsupportedClientError(
        f"cannot use {describe_client(spec)} as a Redis client: pass a URL "
        "('redis://host:6379/0'), an options mapping ({'host': ..., 'port': ...}), a client of "
        "redis-py, valkey-py or Valkey GLIDE, or an object with a send(command, args) method"
    )
