"""A round trip's deadline that costs little on asyncio.

A producer sets timers at thousands per second, each call one round trip with a
deadline. On asyncio an anyio cancel scope with a deadline costs tens of
microseconds more per call than asyncio's own ``asyncio.timeout`` (measured beside
a round trip of a few hundred), so the deadline is asyncio's there, and anyio's
(trio's) everywhere else. Both raise ``TimeoutError`` when the deadline passes, and
leave a cancellation from outside (a task group's, a ``stop()``) as it is.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from types import TracebackType

import anyio

from .clients import running_under_asyncio

__all__ = ["fail_after"]


class _AnyioDeadline(AbstractAsyncContextManager[None]):
    __slots__ = ("_scope",)

    def __init__(self, seconds: float) -> None:
        self._scope = anyio.fail_after(seconds)

    async def __aenter__(self) -> None:
        self._scope.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        return self._scope.__exit__(exc_type, exc, traceback)


def fail_after(seconds: float) -> AbstractAsyncContextManager[object]:
    """``async with fail_after(s):`` raises ``TimeoutError`` if the block takes longer."""
    if running_under_asyncio():
        return asyncio.timeout(seconds)
    return _AnyioDeadline(seconds)
