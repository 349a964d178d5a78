"""Adapter for Valkey GLIDE: ``glide`` (async, native under asyncio and trio) and
``glide_sync`` (in worker threads), standalone and cluster clients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread

from ._protocol import Command, Connection, ServerReplyError, TransportError, normalize_reply

__all__ = ["GlideAsyncConnection", "GlideSyncConnection"]

# GLIDE reports an error reply as "... - NoScriptError: No matching script ...".
_REPLY_CODES = (("NoScriptError", "NOSCRIPT"), ("ReadOnlyError", "READONLY"))


def _args(command: Command) -> list[str | bytes]:
    return [a if isinstance(a, bytes | str) else str(a) for a in command]


def _convert(exc: BaseException) -> Exception:
    name = type(exc).__name__
    text = str(exc)
    if name == "RequestError":
        for marker, code in _REPLY_CODES:
            if marker in text or text.startswith(code):
                return ServerReplyError(f"{code} {text}", code)
        return ServerReplyError(text)
    return TransportError(f"{name}: {text}")


def _batch_reply(item: Any) -> Any:
    if isinstance(item, BaseException):
        return _convert(item)
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
            raise _convert(exc) from exc
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
            raise _convert(exc) from exc
        return [_batch_reply(item) for item in replies or []]


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
            raise _convert(exc) from exc
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
            raise _convert(exc) from exc
        return [_batch_reply(item) for item in replies or []]
