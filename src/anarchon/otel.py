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
from contextvars import Token
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
        # The last slot's text: the runs of one instant share it, so it is made once.
        self._slot: tuple[int, str] = (0, iso_ms(0))

    def start_attempt(self, run: Run) -> _AttemptTrace:
        slot_ms, slot = self._slot
        if slot_ms != run.slot_ms:
            slot = iso_ms(run.slot_ms)
            self._slot = (run.slot_ms, slot)
        span = self._tracer.start_span(
            f"anarchon run {run.job}",
            # A trace of its own: not a child of whatever was current when the
            # scheduler started.
            context=otel_context.Context(),
            attributes={
                "anarchon.job": run.job,
                "anarchon.slot": slot,
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
    """An attempt's span, and the context manager that makes it current (as
    ``trace.use_span`` does, without a generator per attempt)."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Span) -> None:
        self._span = span
        self._token: Token[otel_context.Context] | None = None

    def current(self) -> AbstractContextManager[object]:
        return self

    def __enter__(self) -> object:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            otel_context.detach(self._token)
            self._token = None

    def end(self, outcome: Outcome, error: BaseException | None) -> None:
        span = self._span
        if span.is_recording():  # not sampled: nothing to write on it
            span.set_attribute("anarchon.outcome", outcome)
            if outcome == "failed":
                if error is not None:
                    span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, f"the attempt {outcome}"))
        span.end()
