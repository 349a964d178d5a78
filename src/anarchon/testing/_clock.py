"""Virtual time on the running event loop: its clock is the real one plus an offset, and
the offset jumps to the next deadline whenever the loop would wait for one while no
round trip to the server is in flight.

Every sleep and every deadline of the loop (the engine's, the handlers', the test's)
then takes as long as the work before it, not as long as it says: a day of a job every
minute passes in the time its runs take. A round trip in flight holds the jump back,
so no deadline passes while the server is answering. asyncio's default loop (its
selector) and trio are supported; the loop keeps its offset after the kit is done (a
deadline set meanwhile stays where it was), and only jumps while a kit runs.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

from .._errors import InvalidOptionError

__all__ = ["LoopClock", "loop_clock"]


class LoopClock:
    """The offset of one event loop's clock, and what holds its jumps back."""

    def __init__(self) -> None:
        #: Seconds added to the loop's real clock.
        self.offset = 0.0
        #: Round trips to the server in flight: no jump while there is one.
        self.in_flight = 0
        #: Kits running on this loop: it jumps only while there is one.
        self.users = 0
        #: How many times it jumped.
        self.jumps = 0

    def jump_by(self, timeout: float | None) -> bool:
        """The loop would wait ``timeout`` seconds for its next deadline: jump there
        instead (True), unless a round trip is in flight or no kit runs."""
        if timeout is None or timeout <= 0 or self.in_flight or not self.users:
            return False
        self.offset += timeout
        self.jumps += 1
        return True


#: The clock of each event loop a kit ran on (asyncio loops; trio's runner).
_CLOCKS: weakref.WeakKeyDictionary[Any, LoopClock] = weakref.WeakKeyDictionary()


def loop_clock() -> LoopClock:
    """The running loop's virtual clock, installed on first use."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return _trio_clock()
    found = _CLOCKS.get(loop)
    if found is None:
        found = _CLOCKS[loop] = LoopClock()
        _install_on_asyncio(loop, found)
    return found


def _install_on_asyncio(loop: asyncio.AbstractEventLoop, clock: LoopClock) -> None:
    selector = getattr(loop, "_selector", None)
    if not isinstance(loop, asyncio.BaseEventLoop) or selector is None:
        raise InvalidOptionError(
            f"anarchon.testing runs on asyncio's default event loop (a selector loop), "
            f"not on {type(loop).__module__}.{type(loop).__qualname__}: run the test "
            "without uvloop (or under trio)"
        )
    real_time = loop.time
    real_select: Callable[[float | None], Any] = selector.select

    def time() -> float:
        return real_time() + clock.offset

    def select(timeout: float | None = None) -> Any:
        # The loop waits for I/O or for its next deadline, ``timeout`` away.
        if timeout is not None and timeout > 0 and not clock.in_flight and clock.users:
            events = real_select(0)
            if events:
                return events
            clock.jump_by(timeout)
            return events
        return real_select(timeout)

    loop.time = time  # type: ignore[method-assign]
    selector.select = select


def _trio_clock() -> LoopClock:
    import trio

    try:
        from trio._core._run import GLOBAL_RUN_CONTEXT
    except ImportError as exc:  # pragma: no cover - a trio without its run context
        raise InvalidOptionError(
            "anarchon.testing cannot reach this trio's clock: use asyncio"
        ) from exc
    runner = GLOBAL_RUN_CONTEXT.runner
    known = _CLOCKS.get(runner)
    if known is not None:
        return known
    found = _CLOCKS[runner] = LoopClock()
    real: trio.abc.Clock = runner.clock

    class VirtualClock(trio.abc.Clock):
        def start_clock(self) -> None:
            pass

        def current_time(self) -> float:
            return real.current_time() + found.offset

        def deadline_to_sleep_time(self, deadline: float) -> float:
            wait = deadline - self.current_time()
            # Not while a task waits for all others to block (``settle``): that wait
            # ends first, with time where it is.
            if wait != float("inf") and not runner.waiting_for_idle and found.jump_by(wait):
                return 0.0
            return wait

    runner.clock = VirtualClock()
    return found
