"""A deadline for a call's round trips that fails with an error saying what did not
answer, in place of a bare ``TimeoutError``: one way for every call that waits on the
server (a start's steps, reads, ``set_timer``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

import anyio

from .._errors import ConnectionFailedError, reason
from ..clients import TransportError

__all__ = ["Within", "answered_in_time"]


class Within:
    """The block's round trips within ``seconds``; past them, the block is cancelled and
    ``failure(seconds)`` is raised instead. A cancellation from outside stays one.

    One cancel scope and no generator: it is on the path of every ``set_timer``."""

    __slots__ = ("_failure", "_scope", "_seconds")

    def __init__(self, seconds: float, failure: Callable[[float], Exception]) -> None:
        self._seconds = seconds
        self._failure = failure
        self._scope: anyio.CancelScope | None = None

    def __enter__(self) -> None:
        scope = self._scope = anyio.move_on_after(self._seconds)
        scope.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        scope, self._scope = self._scope, None
        assert scope is not None
        # The scope swallows only its own cancellation, and that is raised as the
        # failure: whatever else the block raised goes on.
        scope.__exit__(exc_type, exc, tb)
        if scope.cancelled_caught:
            raise self._failure(self._seconds) from None


def not_answered(seconds: float) -> ConnectionFailedError:
    return ConnectionFailedError(
        f"the server did not answer within {seconds:g} s; check that it is not frozen or overloaded"
    )


@contextmanager
def answered_in_time(seconds: float) -> Iterator[None]:
    """A call's round trips (the ``Inspector``'s, ``Scheduler.history``, ``pause`` and
    ``resume``): within ``seconds``, and a ``ConnectionFailedError`` that says what
    happened (a frozen server, a dropped connection) instead of a timeout's traceback."""
    try:
        with Within(seconds, not_answered):
            yield
    except TransportError as exc:
        raise ConnectionFailedError(f"lost the connection to the server: {reason(exc)}") from exc
