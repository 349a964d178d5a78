"""Backends: where the scheduler keeps its state, and how one winner is chosen."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, Required, TypedDict, TypeVar, cast, overload

import anyio

from .._errors import (
    ConnectionFailedError,
    InvalidOptionError,
    StoreFormatError,
    UnsupportedServerError,
    reason,
)
from .._model.job import Job
from .._model.text import visible
from ..clients import (
    Connection,
    ConnectionSpec,
    ServerReplyError,
    TransportError,
    is_transient,
    open_connection,
    url_for_redis_py,
)
from ..clients import validate_options as validate_connection_options
from ..clients.redact import redact_url
from ..clients.sentinel import SentinelSpec, is_sentinel_url
from .claim_only import ClaimOnlyStore, IdmpSettings, ScriptSettings
from .claim_only import StrategyName as ClaimOnlyStrategyName
from .contract import Store
from .keys import format_key
from .lease import LeaseStore
from .quarantine import whole

__all__ = [
    "ClaimOnly",
    "IdmpStrategy",
    "LeaseStrategy",
    "Leases",
    "RedisBackend",
    "ScriptStrategy",
    "StoreOptions",
    "StreamIdStrategy",
    "ValkeyBackend",
]

#: The store format this anarchon writes and reads (key ``<prefix>format``).
STORE_FORMAT = 1


class Leases:
    """Type marker: a backend whose strategy holds leases (``"lease"``), as in
    ``RedisBackend[Leases]`` and ``Scheduler[Leases]``. Type checkers infer it from the
    backend's ``strategy``; it is never made."""


class ClaimOnly:
    """Type marker: a backend whose strategy only decides who runs each slot
    (``"stream-id"``, ``"idmp"``, ``"script"``), as in ``RedisBackend[ClaimOnly]`` and
    ``Scheduler[ClaimOnly]``: the lease options are a type error there. Type checkers
    infer it from the backend's ``strategy``; it is never made."""


K = TypeVar("K", Leases, ClaimOnly)


class LeaseStrategy(TypedDict):
    """``{"name": "lease"}``: leases, backups, retries, overlap protection, catch-up
    (the same as ``strategy="lease"``, the default).

    Attributes:
        name: ``"lease"``.
    """

    name: Literal["lease"]


class StreamIdStrategy(TypedDict):
    """``{"name": "stream-id"}``: the slot is the stream entry id; remembers forever
    (the same as ``strategy="stream-id"``). A claim-only strategy.

    Attributes:
        name: ``"stream-id"``.
    """

    name: Literal["stream-id"]


class IdmpStrategy(TypedDict, total=False):
    """``{"name": "idmp", "duration_sec": 300, "max_size": 1000}``: idempotent XADD
    (Redis 8.6+; not with ``ValkeyBackend``). A claim-only strategy. A setting out of
    its bounds is an ``InvalidOptionError`` when the backend is made.

    Attributes:
        name: ``"idmp"`` (required).
        duration_sec: How long Redis remembers a run's id, in seconds: 1 to 86400
            (default 300). It must be greater than every job's
            ``jitter_ms + max_late_ms``.
        max_size: How many run ids Redis keeps per job: 1 to 10000 (default 1000).
    """

    name: Required[Literal["idmp"]]
    duration_sec: int
    max_size: int


class ScriptStrategy(TypedDict, total=False):
    """``{"name": "script", "window_ms": 300000}``: a Lua script remembers each claimed
    run for a window. A claim-only strategy. A setting out of its bounds is an
    ``InvalidOptionError`` when the backend is made.

    Attributes:
        name: ``"script"`` (required).
        window_ms: How long a claimed run is remembered, in milliseconds: 1 to 2^53
            (default 300 000). It must be greater than every job's
            ``jitter_ms + max_late_ms``.
    """

    name: Required[Literal["script"]]
    window_ms: int


LeaseStrategyName = Literal["lease"]
ClaimOnlyName = Literal["stream-id", "idmp", "script"]
ValkeyClaimOnlyName = Literal["stream-id", "script"]

_STRATEGY_SETTINGS: dict[str, dict[str, tuple[int, int]]] = {
    "lease": {},
    "stream-id": {},
    "idmp": {"duration_sec": (1, 86_400), "max_size": (1, 10_000)},
    "script": {"window_ms": (1, 2**53)},
}
#: A prefix ends with ':' and job and timer kind names hold none (``_model/job.py``): a
#: key's prefix then ends at its last ':' before the name, so no two (prefix, name) pairs
#: share a key, however prefixes nest (``billing:`` and ``billing:eu:``).
_PREFIX_PATTERN = re.compile(r"[^\s{}\x00-\x1f\x7f-\x9f]*:")


@dataclass(frozen=True, slots=True)
class StrategyConfig:
    name: str
    idmp: IdmpSettings
    script: ScriptSettings


def parse_strategy(strategy: object, *, allow_idmp: bool) -> StrategyConfig:
    """Check a strategy name or mapping; unknown or misplaced settings are errors."""
    if isinstance(strategy, str):
        name: object = strategy
        settings: dict[str, Any] = {}
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
    if name not in _STRATEGY_SETTINGS:
        raise InvalidOptionError(
            f"unknown strategy {name!r}; choose one of {', '.join(_STRATEGY_SETTINGS)}"
        )
    name = str(name)
    if name == "idmp" and not allow_idmp:
        raise InvalidOptionError(
            "ValkeyBackend does not offer the 'idmp' strategy (Valkey has no idempotent XADD): "
            "use 'lease', 'script' or 'stream-id'"
        )
    allowed = _STRATEGY_SETTINGS[name]
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        elsewhere = sorted(
            other for other, keys in _STRATEGY_SETTINGS.items() if set(unknown) <= set(keys)
        )
        hint = f" ({', '.join(unknown)} belongs to {' or '.join(elsewhere)})" if elsewhere else ""
        raise InvalidOptionError(
            f"strategy {name!r} has no setting(s) {unknown}{hint}; its settings are "
            f"{sorted(allowed) or 'none'}"
        )
    for key, (low, high) in allowed.items():
        if key in settings:
            value = settings[key]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidOptionError(
                    f"strategy {name!r} setting {key} must be a whole number from {low} to "
                    f"{high}, got {value!r}"
                )
    return StrategyConfig(
        name=name,
        idmp=IdmpSettings(**{k: v for k, v in settings.items() if name == "idmp"}),
        script=ScriptSettings(**{k: v for k, v in settings.items() if name == "script"}),
    )


def _validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not _PREFIX_PATTERN.fullmatch(prefix):
        raise InvalidOptionError(
            f"prefix must be a string that ends with ':', such as 'cron:' or 'billing:cron:', "
            f"without spaces, control characters or braces ('{{' and '}}' would break the "
            f"cluster hash tag of every key), got {prefix!r}"
        )
    return prefix


class StoreOptions(TypedDict):
    """What the scheduler tells the backend when it opens the store."""

    runner: str
    history_size: int
    history_ttl_ms: int | None


class RedisBackend(Generic[K]):
    """Keeps the scheduler's state in Redis 5+ (or Valkey), and chooses one winner for
    each slot by its strategy::

        backend = RedisBackend(redis="redis://localhost:6379", prefix="billing:cron:")
        claim_only = RedisBackend(strategy={"name": "script", "window_ms": 600_000})

    Nothing is sent to the server until a scheduler, ``Timers`` or ``Inspector`` opens
    it; the options are checked here. A connection anarchon opens itself is closed on
    stop; a client you pass is left open. A type checker reads the strategy: a
    ``RedisBackend[Leases]`` or a ``RedisBackend[ClaimOnly]``.

    Args:
        redis: The server: a URL (``redis://``, ``rediss://`` for TLS, ``unix://``,
            ``redis+sentinel://``, or their ``valkey`` forms; user, password and
            database in the URL); an options mapping (``host``, ``port``,
            ``password``, ``username``, ``db``, ``tls``, ``tls_ca_certs``,
            ``tls_certfile``, ``tls_keyfile``, ``tls_check_hostname``, ``sentinel``); or
            a client object (redis-py, valkey-py, Valkey GLIDE, or any object with
            ``send(command, args)``). Default: ``"redis://localhost:6379"``.
        strategy: How one winner is chosen: ``"lease"`` (the default: leases, backups,
            retries, overlap protection, catch-up), or one of the claim-only strategies
            ``"stream-id"``, ``"idmp"`` (Redis 8.6+) and ``"script"``; a name, or a
            mapping with its settings (``LeaseStrategy``, ``StreamIdStrategy``,
            ``IdmpStrategy``, ``ScriptStrategy``).
        prefix: What every key of the store begins with: a string that ends with
            ``:``, without spaces, control characters or braces (default
            ``"cron:"``). Schedulers that share a prefix share their jobs' state.

    Raises:
        InvalidOptionError: A URL of another scheme, an unknown connection option, an
            unknown strategy or setting (or one out of its bounds), or a prefix that
            cannot be used.

    Attributes:
        prefix: The prefix of the store's keys.
    """

    @overload
    def __init__(
        self: RedisBackend[Leases],
        redis: ConnectionSpec = ...,
        *,
        strategy: LeaseStrategyName | LeaseStrategy = ...,
        prefix: str = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: RedisBackend[ClaimOnly],
        redis: ConnectionSpec = ...,
        *,
        strategy: ClaimOnlyName | StreamIdStrategy | IdmpStrategy | ScriptStrategy,
        prefix: str = ...,
    ) -> None: ...

    def __init__(
        self,
        redis: ConnectionSpec = "redis://localhost:6379",
        *,
        strategy: object = "lease",
        prefix: str = "cron:",
    ) -> None:
        self._init(redis, strategy, prefix, allow_idmp=True)

    def _init(
        self, connection: ConnectionSpec, strategy: object, prefix: str, *, allow_idmp: bool
    ) -> None:
        self._connection_spec = _validate_connection_spec(connection)
        #: The server as the last connection found it (None before).
        self.server: ServerInfo | None = None
        self._strategy = parse_strategy(strategy, allow_idmp=allow_idmp)
        self.prefix = _validate_prefix(prefix)

    @property
    def strategy(self) -> str:
        """The strategy's name: ``"lease"``, ``"stream-id"``, ``"idmp"`` or
        ``"script"``."""
        return self._strategy.name

    @property
    def leases(self) -> bool:
        """True for the lease strategy; False for the claim-only ones."""
        return self._strategy.name == "lease"

    def check_job(self, job: Job) -> None:
        """Refuse a job whose lateness window outlasts what the strategy remembers of a
        slot: a late claim could find the slot forgotten and run it again."""
        if self._strategy.name == "script":
            window_ms = self._strategy.script.window_ms
            if job.late_window_ms >= window_ms:
                raise InvalidOptionError(
                    f"job {job.name!r}: jitter_ms + max_late_ms ({job.late_window_ms}) must "
                    f"be less than the script strategy's window_ms ({window_ms}), or a late "
                    "claim could find the slot forgotten and run it again; lower max_late_ms "
                    "or raise window_ms"
                )
        if self._strategy.name == "idmp":
            duration_sec = self._strategy.idmp.duration_sec
            if job.late_window_ms >= duration_sec * 1000:
                raise InvalidOptionError(
                    f"job {job.name!r}: jitter_ms + max_late_ms ({job.late_window_ms} ms) must "
                    f"be less than the idmp strategy's duration_sec ({duration_sec} s), or a "
                    "late claim could come after Redis forgot the slot's id and run it again; "
                    "lower max_late_ms or jitter_ms, or raise duration_sec"
                )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy!r}, prefix={self.prefix!r})"

    async def _connect(self, *, writes: bool = True) -> tuple[Connection, ServerInfo]:
        """Connect, and check the server and the store format (``_check_store_format``)."""
        conn = open_connection(self._connection_spec)
        try:
            try:
                with anyio.fail_after(_START_DEADLINE_SEC):
                    server = await _check_server(conn)
                    if self.strategy == "idmp" and not server.has_idempotent_xadd:
                        raise UnsupportedServerError(
                            f"the 'idmp' strategy needs Redis 8.6 or newer (idempotent "
                            f"XADD); this server is {server.family.capitalize()} "
                            f"{server.version[0]}.{server.version[1]}: use 'lease' (the "
                            "default), 'script' or 'stream-id'"
                        )
                    await _check_store_format(conn, self.prefix, writes=writes)
            except TimeoutError:
                raise ConnectionFailedError(
                    f"the server behind {conn.description} did not answer within "
                    f"{_START_DEADLINE_SEC:g} s; check that it is not frozen or overloaded, "
                    "and that the address leads to it"
                ) from None
        except BaseException:
            await conn.close_if_owned()
            raise
        return conn, server

    async def open_connection(self, *, writes: bool = True) -> Connection:
        """A checked connection and nothing more (what setting a timer from a process
        that runs no scheduler needs); ``writes=False`` for a reader, which writes
        nothing to check the store format."""
        conn, _ = await self._connect(writes=writes)
        return conn

    async def open(self, options: StoreOptions) -> Store:
        """Connect, and check the server and the store format. Scripts are sent by SHA and
        loaded on the first NOSCRIPT, on whichever node (or restarted server) lacks them."""
        conn, server = await self._connect()
        self.server = server
        return self._store(conn, server, options)

    def where(self) -> str:
        """The server as the logs name it.

        Returns:
            The URL without its password, ``host:port``, or the client's type; with the
            server's name and version once connected.
        """
        spec = self._connection_spec
        if isinstance(spec, str) and is_sentinel_url(spec):
            place = SentinelSpec.from_url(spec).describe()
        elif isinstance(spec, str):
            place = redact_url(spec)
        elif isinstance(spec, Mapping) and "sentinel" in spec:
            place = SentinelSpec.from_options(spec).describe()
        elif isinstance(spec, Mapping):
            place = f"{spec.get('host', 'localhost')}:{spec.get('port', 6379)}"
        else:
            place = f"a {type(spec).__module__}.{type(spec).__qualname__}"
        server = self.server
        if server is not None:
            place += f" ({server.family.capitalize()} {server.version[0]}.{server.version[1]})"
        return place

    def _store(self, conn: Connection, server: ServerInfo, options: StoreOptions) -> Store:
        if self.strategy == "lease":
            return LeaseStore(
                conn,
                prefix=self.prefix,
                runner=options["runner"],
                history_size=options["history_size"],
                history_ttl_ms=options["history_ttl_ms"],
                trim_runs_by_id=server.trims_streams_by_id,
            )
        return ClaimOnlyStore(
            conn,
            strategy=cast(ClaimOnlyStrategyName, self.strategy),
            prefix=self.prefix,
            runner=options["runner"],
            history_size=options["history_size"],
            history_ttl_ms=options["history_ttl_ms"],
            trim_runs_by_id=server.trims_streams_by_id,
            idmp=self._strategy.idmp,
            script=self._strategy.script,
        )


class ValkeyBackend(RedisBackend[K]):
    """A ``RedisBackend`` for Valkey: the option is ``valkey``, and only the
    strategies Valkey supports are accepted (no ``idmp``).

    >>> backend = ValkeyBackend(valkey={"host": "localhost", "port": 6390})

    Args:
        valkey: The server, as ``RedisBackend``'s ``redis`` takes it. Default:
            ``"redis://localhost:6379"``.
        strategy: ``"lease"`` (the default), ``"stream-id"`` or ``"script"``, or a
            mapping with its settings (``LeaseStrategy``, ``StreamIdStrategy``,
            ``ScriptStrategy``).
        prefix: What every key of the store begins with, as ``RedisBackend`` takes it
            (default ``"cron:"``).

    Raises:
        InvalidOptionError: As ``RedisBackend``; and for the ``"idmp"`` strategy.
    """

    @overload
    def __init__(
        self: ValkeyBackend[Leases],
        valkey: ConnectionSpec = ...,
        *,
        strategy: LeaseStrategyName | LeaseStrategy = ...,
        prefix: str = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: ValkeyBackend[ClaimOnly],
        valkey: ConnectionSpec = ...,
        *,
        strategy: ValkeyClaimOnlyName | StreamIdStrategy | ScriptStrategy,
        prefix: str = ...,
    ) -> None: ...

    def __init__(
        self,
        valkey: ConnectionSpec = "redis://localhost:6379",
        *,
        strategy: object = "lease",
        prefix: str = "cron:",
    ) -> None:
        self._init(valkey, strategy, prefix, allow_idmp=False)


def _validate_connection_spec(spec: ConnectionSpec) -> ConnectionSpec:
    if isinstance(spec, str):
        if not re.match(
            r"^(redis|rediss|unix|valkey|valkeys|redis\+sentinel|valkey\+sentinel)://", spec
        ):
            raise InvalidOptionError(
                f"connection URL {redact_url(spec)!r} must start with redis://, rediss:// "
                "(TLS), valkey://, valkeys:// (TLS), unix:// or redis+sentinel://"
            )
        if is_sentinel_url(spec):
            SentinelSpec.from_url(spec)  # raises on a bad one
        else:
            url_for_redis_py(spec)  # raises on one the client would misread
    elif isinstance(spec, Mapping):
        validate_connection_options(spec)
    return spec


@dataclass(frozen=True, slots=True)
class ServerInfo:
    family: str  # "redis" or "valkey"
    version: tuple[int, int]

    @property
    def has_idempotent_xadd(self) -> bool:
        """XADD IDMP exists from Redis 8.6 on (and in no Valkey yet)."""
        return self.family == "redis" and self.version >= (8, 6)

    @property
    def trims_streams_by_id(self) -> bool:
        """XTRIM MINID exists from Redis 6.2 on (and in every Valkey)."""
        return self.family == "valkey" or self.version >= (6, 2)


#: How long the checks at start (server, store format) may take in all.
_START_DEADLINE_SEC = 10.0


async def _check_server(conn: Connection) -> ServerInfo:
    """Lease scripts need streams: Redis 5.0 or newer, or any Valkey."""
    try:
        info = await conn.execute(("INFO", "server"))
    except TransportError as exc:
        hint = "check the URL or client you passed and that the server is running"
        if "certificate" in str(exc).lower() or "ssl" in str(exc).lower():
            hint = (
                "the TLS handshake failed: give the CA that signed the server's certificate "
                "(ssl_ca_certs=... in a rediss:// URL, or tls_ca_certs in the options)"
            )
        raise ConnectionFailedError(
            f"cannot reach the server through {conn.description}: {reason(exc)}; {hint}"
        ) from exc
    except ServerReplyError as exc:
        if "HELLO" in str(exc):
            raise UnsupportedServerError(
                f"the server does not know HELLO, so it cannot speak RESP3 (Redis before 6): "
                f"create the client you pass with protocol=2 ({reason(exc)})"
            ) from exc
        raise ConnectionFailedError(f"the server refused INFO: {reason(exc)}") from exc
    # redis-py parses INFO into a mapping; a cluster client may answer with one INFO
    # text per node (any of them will do).
    if isinstance(info, dict) and not ({"redis_version", "valkey_version"} & set(info)):
        info = next(iter(info.values()), "")
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


async def _check_store_format(conn: Connection, prefix: str, *, writes: bool) -> None:
    """The prefix's store format is one this anarchon reads. A process that ``writes``
    (a scheduler, a process that sets timers) writes it where it is absent, and always
    sends that write (``SET NX``): a replica refuses it (READONLY), so a scheduler
    started on a replica is refused at start instead of having every claim refused. A
    reader (``Inspector``) only reads it: a user the ACL lets read alone can inspect."""
    key = format_key(prefix)
    try:
        if writes:
            await conn.execute(("SET", key, STORE_FORMAT, "NX"))
        stored = await conn.execute(("GET", key))
        if stored is None and not writes:
            return  # nothing stored under the prefix yet: nothing to read either
    except ServerReplyError as exc:
        if is_transient(exc):
            # A replica, a server out of memory or still loading: not the prefix's fault.
            raise ConnectionFailedError(
                f"the server cannot take the store format key {key!r} now: {reason(exc)}; connect "
                "to the primary (a replica refuses writes), or wait until it has memory "
                "and has loaded its data"
            ) from exc
        if exc.kind == "NOPERM":
            raise StoreFormatError(
                f"cannot read the store format key {key!r}: {reason(exc)}; the server's ACL "
                "does not let this user use the prefix: `anarchon acl --prefix "
                f"{prefix}` prints the least ACL it needs"
            ) from exc
        raise StoreFormatError(
            f"cannot read the store format key {key!r}: {reason(exc)}; another program may "
            "use this prefix: choose another prefix"
        ) from exc
    except TransportError as exc:
        raise ConnectionFailedError(
            f"lost the connection while checking {key!r}: {reason(exc)}"
        ) from exc
    found = whole(stored)
    if not found:
        shown = visible(
            stored.decode("utf-8", "replace") if isinstance(stored, bytes) else stored, 40
        )
        raise StoreFormatError(
            f"the store format key {key!r} holds {shown!r}, not a format number (1 or "
            "more); another program may use this prefix: choose another prefix"
        )
    if found > STORE_FORMAT:
        raise StoreFormatError(
            f"the store under prefix {prefix!r} has format {found}, newer than format "
            f"{STORE_FORMAT} that this anarchon reads; upgrade anarchon on this instance "
            "(a newer anarchon wrote it)"
        )
