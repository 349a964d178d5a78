"""What the engine asks of a tracer (``anarchon.otel`` implements it with OpenTelemetry):
a span per attempt, current while the handler runs, and a span per claim round trip.
Without one, the engine asks nothing."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from .._model.values import Run
from .._store.contract import Outcome

__all__ = ["AttemptTrace", "ClaimTrace", "Tracing"]


class AttemptTrace(Protocol):
    def current(self) -> AbstractContextManager[object]:
        """Make the attempt's span the current one (the handler's spans nest in it)."""
        ...

    def end(self, outcome: Outcome, error: BaseException | None) -> None:
        """The attempt ended so (what the handler raised, if it failed)."""
        ...


class ClaimTrace(Protocol):
    def failed(self, reason: BaseException | str) -> None:
        """The round trip got no answer (an error, or none in time): its claims are sent
        again later."""
        ...


class Tracing(Protocol):
    def start_attempt(self, run: Run) -> AttemptTrace:
        """A span for an attempt whose handler is about to start."""
        ...

    def claim_batch(self, size: int) -> AbstractContextManager[ClaimTrace]:
        """A span around one round trip of ``size`` claims."""
        ...
