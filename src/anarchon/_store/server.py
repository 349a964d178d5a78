"""The server behind a connection: which one it is (``check_server``), whether the
prefix's store format is one this anarchon reads (``check_store_format``), and what
it says of its eviction policy (``eviction_policy``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .._errors import (
    ConnectionFailedError,
    StoreFormatError,
    UnsupportedServerError,
    reason,
)
from .._model.text import visible
from ..clients import (
    Connection,
    ServerReplyError,
    TransportError,
    is_transient,
    refused_certificate,
)
from .deadline import Within
from .keys import format_key
from .quarantine import whole

__all__ = [
    "START_DEADLINE_SEC",
    "STORE_FORMAT",
    "answered_at_start",
    "VIRTUAL_STORE_FORMAT",
    "ServerInfo",
    "check_server",
    "check_store_format",
    "eviction_policy",
]

#: The store format this anarchon writes and reads (key ``<prefix>format``).
STORE_FORMAT = 1

#: What the format key holds in a store on ``anarchon.testing``'s virtual time: no
#: scheduler on the real clock reads it (and the kit reads no other).
VIRTUAL_STORE_FORMAT = f"{STORE_FORMAT} on virtual time"


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


#: How long each step of a start (the checks of the server and the store format; a
#: strategy's preparation of its jobs; the timer kinds' buckets) may take in all.
START_DEADLINE_SEC = 10.0


def answered_at_start(conn: Connection) -> Within:
    """A step of a start, within ``START_DEADLINE_SEC``: a server that does not answer in
    time is a ``ConnectionFailedError`` that says so (never a wait as long as the
    client's, which on anarchon's own asyncio connections has no end)."""
    return Within(
        START_DEADLINE_SEC,
        lambda seconds: ConnectionFailedError(
            f"the server behind {conn.description} did not answer within {seconds:g} s; "
            "check that it is not frozen or overloaded, and that the address leads to it"
        ),
    )


async def check_server(conn: Connection) -> ServerInfo:
    """Lease scripts need streams: Redis 5.0 or newer, or any Valkey."""
    try:
        info = await conn.execute(("INFO", "server"))
    except TransportError as exc:
        hint = "check the URL or client you passed and that the server is running"
        if refused_certificate(exc):
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


async def check_store_format(conn: Connection, prefix: str, *, writes: bool) -> None:
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
    if stored in (VIRTUAL_STORE_FORMAT, VIRTUAL_STORE_FORMAT.encode()):
        raise StoreFormatError(
            f"the store under prefix {prefix!r} runs on anarchon.testing's virtual time: "
            "a scheduler on the real clock never shares it; choose another prefix or server"
        )
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


async def eviction_policy(conn: Connection) -> str:
    """The server's ``maxmemory-policy``, as ``INFO memory`` tells it (the least ACL
    grants no ``CONFIG``, whose ``GET`` would hand out the admin's password). Raises
    what the server answers (NOPERM) or ``LookupError`` when INFO does not say it."""
    reply = await conn.execute(("INFO", "memory"))
    # INFO's text, or redis-py's mapping of it (a cluster client's: one per node).
    found = re.search(r"maxmemory_policy\W+([a-z-]+)", str(reply))
    if found is None:
        raise LookupError("INFO memory does not say it")
    return found.group(1)
