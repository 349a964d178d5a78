"""Backends: where the scheduler keeps its state, and how one winner is chosen."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from ._errors import (
    ConnectionFailedError,
    InvalidOptionError,
    StoreFormatError,
    UnsupportedServerError,
)
from ._lease import LeaseStore
from ._scripts import lease_script
from .clients import (
    Connection,
    ConnectionSpec,
    ServerReplyError,
    TransportError,
    open_connection,
)
from .clients import validate_options as validate_connection_options

__all__ = ["LeaseStrategy", "RedisBackend", "StoreOptions", "ValkeyBackend"]

#: The store format this anarchon writes and reads (key ``<prefix>format``).
STORE_FORMAT = 1


class LeaseStrategy(TypedDict):
    """``{"name": "lease"}``: leases, backups, retries, overlap protection, catch-up."""

    name: Literal["lease"]


StrategyName = Literal["lease"]
RedisStrategy = StrategyName | LeaseStrategy
ValkeyStrategy = StrategyName | LeaseStrategy

_KNOWN_STRATEGIES = ("lease", "stream-id", "idmp", "script")
_STRATEGY_SETTINGS: dict[str, frozenset[str]] = {"lease": frozenset()}
_PREFIX_PATTERN = re.compile(r"^[^\s{}]*$")


def _strategy_name(strategy: object) -> str:
    if isinstance(strategy, str):
        name = strategy
        settings: Mapping[str, Any] = {}
    elif isinstance(strategy, Mapping):
        if "name" not in strategy:
            raise InvalidOptionError("a strategy mapping needs a 'name', such as {'name': 'lease'}")
        name = strategy["name"]
        settings = {k: v for k, v in strategy.items() if k != "name"}
    else:
        raise InvalidOptionError(
            f"strategy must be a name such as 'lease' or a mapping {{'name': ...}}, "
            f"got {type(strategy).__name__}"
        )
    if name not in _KNOWN_STRATEGIES:
        raise InvalidOptionError(
            f"unknown strategy {name!r}; choose one of {', '.join(_KNOWN_STRATEGIES)}"
        )
    if name not in _STRATEGY_SETTINGS:
        raise InvalidOptionError(
            f"strategy {name!r} is not available in this version of anarchon; use 'lease'"
        )
    unknown = set(settings) - _STRATEGY_SETTINGS[name]
    if unknown:
        raise InvalidOptionError(
            f"strategy {name!r} has no setting(s) {sorted(unknown)}; "
            f"its settings are {sorted(_STRATEGY_SETTINGS[name]) or 'none'}"
        )
    return str(name)


def _validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not _PREFIX_PATTERN.match(prefix):
        raise InvalidOptionError(
            f"prefix must be a string without spaces or braces ('{{', '}}' would break the "
            f"cluster hash tag of every key), got {prefix!r}"
        )
    return prefix


class StoreOptions(TypedDict):
    """What the scheduler tells the backend when it opens the store."""

    runner: str
    history_size: int
    history_ttl_ms: int | None


class RedisBackend:
    """Keeps the scheduler's state in Redis 5+ (or Valkey).

    ``redis`` takes a URL (``redis://``, ``rediss://`` for TLS, ``unix://``; user,
    password and database in the URL), an options mapping (``host``, ``port``,
    ``password``, ``username``, ``db``, ``tls``), or a client object. A
    connection anarchon opens itself is closed on stop; a client you pass is
    left open.

    >>> backend = RedisBackend(redis="redis://localhost:6379", prefix="billing:cron:")
    """

    def __init__(
        self,
        redis: ConnectionSpec = "redis://localhost:6379",
        *,
        strategy: RedisStrategy = "lease",
        prefix: str = "cron:",
    ) -> None:
        self._connection_spec = _validate_connection_spec(redis)
        self.strategy = _strategy_name(strategy)
        self.prefix = _validate_prefix(prefix)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy!r}, prefix={self.prefix!r})"

    async def open(self, options: StoreOptions) -> LeaseStore:
        """Connect, check the server and the store format, and load the scripts."""
        conn = open_connection(self._connection_spec)
        try:
            server = await _check_server(conn)
            await _check_store_format(conn, self.prefix)
            for name in ("claim", "heartbeat", "finish"):
                script = lease_script(name)
                await conn.execute(("SCRIPT", "LOAD", script.body))
        except BaseException:
            if conn.owned:
                await conn.aclose()
            raise
        return LeaseStore(
            conn,
            prefix=self.prefix,
            runner=options["runner"],
            history_size=options["history_size"],
            history_ttl_ms=options["history_ttl_ms"],
            trim_runs_by_id=server.trims_streams_by_id,
        )


class ValkeyBackend(RedisBackend):
    """A ``RedisBackend`` for Valkey: the option is ``valkey``, and only the
    strategies Valkey supports are accepted.

    >>> backend = ValkeyBackend(valkey={"host": "localhost", "port": 6390})
    """

    def __init__(
        self,
        valkey: ConnectionSpec = "redis://localhost:6379",
        *,
        strategy: ValkeyStrategy = "lease",
        prefix: str = "cron:",
    ) -> None:
        super().__init__(valkey, strategy=strategy, prefix=prefix)


def _validate_connection_spec(spec: ConnectionSpec) -> ConnectionSpec:
    if isinstance(spec, str):
        if not re.match(r"^(redis|rediss|unix|valkey|valkeys)://", spec):
            raise InvalidOptionError(
                f"connection URL {spec!r} must start with redis://, rediss:// (TLS) or unix://"
            )
    elif isinstance(spec, Mapping):
        validate_connection_options(spec)
    return spec


@dataclass(frozen=True, slots=True)
class ServerInfo:
    family: str  # "redis" or "valkey"
    version: tuple[int, int]

    @property
    def trims_streams_by_id(self) -> bool:
        """XTRIM MINID exists from Redis 6.2 on (and in every Valkey)."""
        return self.family == "valkey" or self.version >= (6, 2)


async def _check_server(conn: Connection) -> ServerInfo:
    """Lease scripts need streams: Redis 5.0 or newer, or any Valkey."""
    try:
        info = await conn.execute(("INFO", "server"))
    except TransportError as exc:
        raise ConnectionFailedError(
            f"cannot reach the server through {conn.description}: {exc}; check the URL or "
            "client you passed and that the server is running"
        ) from exc
    except ServerReplyError as exc:
        if "HELLO" in str(exc):
            raise UnsupportedServerError(
                f"the server does not know HELLO, so it cannot speak RESP3 (Redis before 6): "
                f"create the client you pass with protocol=2 ({exc})"
            ) from exc
        raise ConnectionFailedError(f"the server refused INFO: {exc}") from exc
    text = info if isinstance(info, str) else "\n".join(f"{k}:{v}" for k, v in info.items())
    valkey = re.search(r"^valkey_version:(\d+)\.(\d+)", text, re.MULTILINE)
    if valkey:
        return ServerInfo("valkey", (int(valkey.group(1)), int(valkey.group(2))))
    match = re.search(r"^redis_version:(\d+)\.(\d+)", text, re.MULTILINE)
    if not match:
        raise UnsupportedServerError(
            f"the server behind {conn.description} does not report a redis_version in "
            "INFO server: anarchon needs Redis 5.0 or newer, or Valkey"
        )
    version = (int(match.group(1)), int(match.group(2)))
    if version < (5, 0):
        raise UnsupportedServerError(
            f"Redis {version[0]}.{version[1]} is too old: anarchon needs Redis 5.0 "
            "or newer (streams), or Valkey"
        )
    return ServerInfo("redis", version)


async def _check_store_format(conn: Connection, prefix: str) -> None:
    key = f"{prefix}format"
    try:
        stored = await conn.execute(("GET", key))
        if stored is None:
            await conn.execute(("SET", key, STORE_FORMAT, "NX"))
            stored = await conn.execute(("GET", key))
    except ServerReplyError as exc:
        raise StoreFormatError(
            f"cannot read the store format key {key!r}: {exc}; another program may use this "
            "prefix: choose another prefix"
        ) from exc
    except TransportError as exc:
        raise ConnectionFailedError(f"lost the connection while checking {key!r}: {exc}") from exc
    try:
        found = int(stored)
    except (TypeError, ValueError):
        raise StoreFormatError(
            f"the store format key {key!r} holds {stored!r}, not a format number; another "
            "program may use this prefix: choose another prefix"
        ) from None
    if found > STORE_FORMAT:
        raise StoreFormatError(
            f"the store under prefix {prefix!r} has format {found}, newer than format "
            f"{STORE_FORMAT} that this anarchon reads; upgrade anarchon on this instance "
            "(a newer anarchon wrote it)"
        )
