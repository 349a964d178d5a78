"""Adapter for Valkey GLIDE: ``glide`` (async, native under asyncio and trio) and
``glide_sync`` (in worker threads), standalone and cluster clients."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread

from ._protocol import (
    Command,
    Connection,
    ServerReplyError,
    TransportError,
    normalize_reply,
    whole_round_trip,
)
from .redact import scrub_error

__all__ = ["GlideAsyncConnection", "GlideSyncConnection", "convert_error"]

# GLIDE words an error reply in one of two ways: a code it has no name for as
# "OOM: command not allowed ..." (also BUSY, WRONGTYPE), and one it names as
# "An error was signalled by the server: - ReadOnly: You can't write ..." (also
# NOPERM: "... - PermissionDenied: ...").
_UNNAMED_CODE = re.compile(r"([A-Z][A-Z_-]*): ")
_NAMED_KIND = re.compile(r" - (\w+): ")
#: A kind at the end, with no detail: "Connection dropped- ClientError".
_LAST_KIND = re.compile(r"- (\w+)$")
#: An I/O error's kind in front of the text: "BrokenPipe: Cluster: Failed to receive
#: command response ...". A server's own code there is all capitals (_UNNAMED_CODE).
_LEADING_KIND = re.compile(r"[A-Z][a-z]\w*: ")
#: The kinds GLIDE names for its own failures to get a reply (the connection, the
#: cluster's routing), never for a server's error reply.
_CLIENT_KINDS = frozenset(
    {
        "IoError",
        "ClientError",
        "FatalSendError",
        "FatalReceiveError",
        "ProtocolDesync",
        "ParseError",
        "AllConnectionsUnavailable",
        "ConnectionNotFoundForRoute",
        "NotAllSlotsCovered",
    }
)
_KIND_CODES = {
    "ResponseError": "ERR",
    "NoScriptError": "NOSCRIPT",
    "ReadOnly": "READONLY",
    "ReadOnlyError": "READONLY",
    "BusyLoadingError": "LOADING",
    "TryAgain": "TRYAGAIN",
    "ClusterDown": "CLUSTERDOWN",
    "MasterDown": "MASTERDOWN",
    "Moved": "MOVED",
    "Ask": "ASK",
    "CrossSlot": "CROSSSLOT",
    "ExecAbortError": "EXECABORT",
    "NotBusy": "NOTBUSY",
    "TypeError": "WRONGTYPE",
    "AuthenticationFailed": "NOAUTH",
    "PermissionDenied": "NOPERM",
}


def _reply_error(text: str) -> ServerReplyError | TransportError:
    """The server's code of an error reply as GLIDE words it, in front of the text
    (as the server sent it): OOM, BUSY and READONLY must read as what they are, or a
    transient refusal would be taken for a permanent one. GLIDE words its own failures
    to get a reply in the same ways ("BrokenPipe: Cluster: Failed to receive command
    response ...", "... - IoError: ...", "Connection dropped- ClientError"): those are
    transport failures, not answers."""
    unnamed = _UNNAMED_CODE.match(text)
    if unnamed:
        return ServerReplyError(f"{unnamed.group(1)} {text[unnamed.end() :]}", unnamed.group(1))
    named = _NAMED_KIND.search(text)
    code = _KIND_CODES.get(named.group(1)) if named else None
    if named and code is not None:
        return ServerReplyError(f"{code} {text[named.end() :]}", code)
    last = _LAST_KIND.search(text)
    kind = named.group(1) if named else last.group(1) if last else None
    if kind in _CLIENT_KINDS or (kind is None and _LEADING_KIND.match(text)):
        return TransportError(text)
    return ServerReplyError(text)


def _args(command: Command) -> list[str | bytes]:
    return [a if isinstance(a, bytes | str) else str(a) for a in command]


def convert_error(exc: BaseException) -> Exception:
    """The one mapping of GLIDE's errors, their text scrubbed of secrets first."""
    name = type(exc).__name__
    text = scrub_error(exc)
    if name == "RequestError":
        return _reply_error(text)
    return TransportError(f"{name}: {text}")


def _batch_reply(item: Any) -> Any:
    if isinstance(item, BaseException):
        return convert_error(item)
    return normalize_reply(item)


def _new_batch(module: str, cluster: bool) -> Any:
    if module == "glide":
        import glide

        return glide.ClusterBatch(is_atomic=False) if cluster else glide.Batch(is_atomic=False)
    import glide_sync

    return (
        glide_sync.ClusterBatch(is_atomic=False) if cluster else glide_sync.Batch(is_atomic=False)
    )


class GlideAsyncConnection(Connection):
    """``glide.GlideClient`` or ``glide.GlideClusterClient``. A cluster client routes each
    command (and each command of a batch) by its key."""

    def __init__(self, client: Any, *, cluster: bool) -> None:
        self.client = client
        self.cluster = cluster
        self.owned = False
        self.description = f"glide.{type(client).__qualname__}"

    async def execute(self, command: Command) -> Any:
        try:
            reply = await self.client.custom_command(_args(command))
        except Exception as exc:
            raise convert_error(exc) from exc
        return normalize_reply(reply)

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        if not commands:
            return []
        batch = _new_batch("glide", self.cluster)
        for command in commands:
            batch.custom_command(_args(command))
        try:
            replies = await self.client.exec(batch, raise_on_error=False)
        except Exception as exc:
            raise convert_error(exc) from exc
        return whole_round_trip(replies or [], _batch_reply)


class GlideSyncConnection(Connection):
    """``glide_sync.GlideClient`` or ``GlideClusterClient``, called in worker threads."""

    def __init__(self, client: Any, *, cluster: bool, max_threads: int = 8) -> None:
        self.client = client
        self.cluster = cluster
        self.owned = False
        self.description = f"glide_sync.{type(client).__qualname__}"
        self._limiter = anyio.CapacityLimiter(max_threads)

    async def execute(self, command: Command) -> Any:
        try:
            reply = await anyio.to_thread.run_sync(
                self.client.custom_command,
                _args(command),
                limiter=self._limiter,
                abandon_on_cancel=True,
            )
        except Exception as exc:
            raise convert_error(exc) from exc
        return normalize_reply(reply)

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        if not commands:
            return []
        batch = _new_batch("glide_sync", self.cluster)
        for command in commands:
            batch.custom_command(_args(command))
        try:
            replies = await anyio.to_thread.run_sync(
                lambda: self.client.exec(batch, raise_on_error=False),
                limiter=self._limiter,
                abandon_on_cancel=True,
            )
        except Exception as exc:
            raise convert_error(exc) from exc
        return whole_round_trip(replies or [], _batch_reply)
