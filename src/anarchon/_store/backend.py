"""Backends: where the scheduler keeps its state, and which strategy chooses each slot's
winner (``strategy.py``: one class each, chosen here once)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Generic, Literal, TypeVar, overload

from .._errors import InvalidOptionError
from .._model.clock import VIRTUAL
from .._model.job import Job
from .._model.options import OptionRules
from ..clients import Connection, ConnectionSpec, open_connection, url_for_redis_py
from ..clients import validate_options as validate_connection_options
from ..clients.redact import redact_url
from ..clients.sentinel import SentinelSpec, is_sentinel_url
from .contract import Store
from .server import ServerInfo, answered_at_start, check_server, check_store_format
from .strategy import (
    IdmpStrategy,
    LeaseStrategy,
    ScriptStrategy,
    StoreOptions,
    Strategy,
    StreamIdStrategy,
    parse_strategy,
)

__all__ = ["ClaimOnly", "K", "Leases", "RedisBackend", "StoreOptions", "ValkeyBackend"]


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


LeaseStrategyName = Literal["lease"]
ClaimOnlyName = Literal["stream-id", "idmp", "script"]
ValkeyClaimOnlyName = Literal["stream-id", "script"]

#: A prefix ends with ':' and job and timer kind names hold none (``_model/job.py``): a
#: key's prefix then ends at its last ':' before the name, so no two (prefix, name) pairs
#: share a key, however prefixes nest (``billing:`` and ``billing:eu:``).
_PREFIX_PATTERN = re.compile(r"[^\s{}\x00-\x1f\x7f-\x9f]*:")


def _validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not _PREFIX_PATTERN.fullmatch(prefix):
        raise InvalidOptionError(
            f"prefix must be a string that ends with ':', such as 'cron:' or 'billing:cron:', "
            f"without spaces, control characters or braces ('{{' and '}}' would break the "
            f"cluster hash tag of every key), got {prefix!r}"
        )
    return prefix


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
        self._strategy: Strategy = parse_strategy(strategy, allow_idmp=allow_idmp)
        self.prefix = _validate_prefix(prefix)

    @property
    def strategy(self) -> str:
        """The strategy's name: ``"lease"``, ``"stream-id"``, ``"idmp"`` or
        ``"script"``."""
        return self._strategy.name

    @property
    def rules(self) -> OptionRules:
        """The options the strategy's schedulers, jobs and timer kinds take."""
        return self._strategy.rules

    @property
    def leases(self) -> bool:
        """True for the lease strategy; False for the claim-only ones."""
        return self._strategy.name == "lease"

    def check_job(self, job: Job) -> None:
        """Refuse a job whose lateness window outlasts what the strategy remembers of a
        slot: a late claim could find the slot forgotten and run it again."""
        self._strategy.check_job(job)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy!r}, prefix={self.prefix!r})"

    async def _connect(self, *, writes: bool = True) -> tuple[Connection, ServerInfo]:
        """Connect, and check the server and the store format (``_check_store_format``).
        On ``anarchon.testing``'s virtual time, to its server instead."""
        virtual = VIRTUAL.get()
        if virtual is None:
            conn = open_connection(self._connection_spec)
        else:
            conn = virtual.connect(self.prefix)
        try:
            with answered_at_start(conn):
                server = await check_server(conn)
                self._strategy.check_server(server)
                await check_store_format(conn, self.prefix, writes=writes)
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
        return self._strategy.open(conn, server, self.prefix, options)

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
