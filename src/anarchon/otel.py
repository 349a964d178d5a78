"""OpenTelemetry spans of a scheduler's work (extra ``anarchon[otel]``).

::

    from anarchon.otel import instrument
    instrument(scheduler)  # the global tracer provider, or tracer_provider=...

Each attempt of a job is a span, ``anarchon run <job>``, current while its handler runs
(the handler's own spans nest in it), with the job, slot, attempt, fence, runner,
trigger and outcome as attributes; a failed attempt's span has an error status and the
exception. Each round trip of claims is a span, ``anarchon claim``; one that got no
answer (an error, or none in time: its claims are sent again later) has an error status
that says why. Both start traces of their own. anarchon imports OpenTelemetry only here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer, TracerProvider

from ._engine.instance import Instance
from ._model.schedule import iso_ms
from ._model.values import Run
from ._scheduler import Scheduler
from ._store.contract import Outcome
from ._version import __version__

__all__ = ["instrument"]


def instrument(scheduler: Scheduler[Any], tracer_provider: TracerProvider | None = None) -> None:
    """Trace ``scheduler``'s attempts and claims, from its next attempt on: a span per
    attempt (current while the handler runs) and per round trip of claims.

    Args:
        scheduler: The scheduler to trace.
        tracer_provider: The tracer provider to take a tracer from. None:
            OpenTelemetry's global one.
    """
    tracer = trace.get_tracer("anarchon", __version__, tracer_provider=tracer_provider)
    Instance.of(scheduler).trace_with(_Tracing(tracer))


class _Tracing:
    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def start_attempt(self, run: Run) -> _AttemptTrace:
        span = self._tracer.start_span(
            f"anarchon run {run.job}",
            # A trace of its own: not a child of whatever was current when the
            # scheduler started.
            context=otel_context.Context(),
            attributes={
                "anarchon.job": run.job,
                "anarchon.slot": iso_ms(run.slot_ms),
                "anarchon.slot_ms": run.slot_ms,
                "anarchon.attempt": run.attempt,
                "anarchon.fence": run.fence,
                "anarchon.runner": run.runner,
                "anarchon.trigger": run.trigger,
            },
        )
        return _AttemptTrace(span)

    @contextmanager
    def claim_batch(self, size: int) -> Iterator[_ClaimTrace]:
        with self._tracer.start_as_current_span(
            "anarchon claim",
            context=otel_context.Context(),
            attributes={"anarchon.claims": size},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            yield _ClaimTrace(span)


class _ClaimTrace:
    def __init__(self, span: Span) -> None:
        self._span = span

    def failed(self, reason: BaseException | str) -> None:
        if isinstance(reason, BaseException):
            self._span.record_exception(reason)
        self._span.set_status(Status(StatusCode.ERROR, f"the claims got no answer: {reason}"))


class _AttemptTrace:
    def __init__(self, span: Span) -> None:
        self._span = span

    def current(self) -> AbstractContextManager[object]:
        return trace.use_span(
            self._span, end_on_exit=False, record_exception=False, set_status_on_exception=False
        )

    def end(self, outcome: Outcome, error: BaseException | None) -> None:
        self._span.set_attribute("anarchon.outcome", outcome)
        if outcome == "failed":
            if error is not None:
                self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, f"the attempt {outcome}"))
        self._span.end()
