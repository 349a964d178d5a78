"""Prometheus metrics of a scheduler's decisions (extra ``anarchon[prometheus]``).

Two lines in a program that already serves Prometheus::

    from anarchon.prometheus import instrument
    instrument(scheduler)  # into prometheus_client's default registry

or ``anarchon run app:scheduler --metrics-port 9100``. The metrics come from the
scheduler's events (``Scheduler.on_event``): counted as each instance decides, in the
process that decides. Several schedulers instrumented into one registry add up.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from ._events import (
    ClaimAnswered,
    Event,
    LeaseLost,
    RunFinished,
    RunRetried,
    RunStarted,
    ServerUnreachable,
    SlotSkipped,
    TimerFired,
)
from ._scheduler import Scheduler

__all__ = ["SchedulerMetrics", "instrument"]

#: Seconds: from a few milliseconds late to minutes (catch-up, a takeover).
_LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_DURATION_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 3600)


@dataclass(frozen=True)
class SchedulerMetrics:
    """The metrics, registered once per registry (``instrument`` makes them)."""

    runs: Counter
    claims: Counter
    retries: Counter
    lease_losses: Counter
    skipped: Counter
    timer_firings: Counter
    outages: Counter
    lateness: Histogram
    duration: Histogram

    @classmethod
    def register(cls, registry: CollectorRegistry) -> SchedulerMetrics:
        def counter(name: str, text: str, *labels: str) -> Counter:
            return Counter(name, text, labels, registry=registry)

        return cls(
            runs=counter(
                "anarchon_runs", "Attempts that ended and were recorded, by outcome.",
                "job", "outcome",
            ),
            claims=counter(
                "anarchon_claims", "Claims of slots, by the store's answer.", "job", "answer"
            ),
            retries=counter(
                "anarchon_retries", "Attempts that ended without success and were retried.",
                "job",
            ),
            lease_losses=counter(
                "anarchon_lease_losses",
                "Runs (and timer firings) that lost their lease while running here.", "job",
            ),
            skipped=counter(
                "anarchon_skipped_slots", "Scheduled slots that did not run, by reason.",
                "job", "reason",
            ),
            timer_firings=counter(
                "anarchon_timer_firings", "Timer firings that ended and were recorded.",
                "kind", "outcome",
            ),
            outages=counter(
                "anarchon_server_unreachable", "Times the server stopped answering."
            ),
            lateness=Histogram(
                "anarchon_fire_lateness_seconds",
                "From a slot's instant to its handler's start (retries included).",
                ["job"], registry=registry, buckets=_LATENESS_BUCKETS,
            ),
            duration=Histogram(
                "anarchon_run_duration_seconds", "How long attempts ran, by outcome.",
                ["job", "outcome"], registry=registry, buckets=_DURATION_BUCKETS,
            ),
        )  # fmt: skip

    def observe(self, event: Event) -> None:
        """Count one event."""
        if isinstance(event, RunFinished):
            job, outcome = event.run.job, event.outcome
            self.runs.labels(job, outcome).inc()
            self.duration.labels(job, outcome).observe(event.duration_ms / 1000)
        elif isinstance(event, RunStarted):
            self.lateness.labels(event.run.job).observe(max(event.late_ms, 0.0) / 1000)
        elif isinstance(event, ClaimAnswered):
            self.claims.labels(event.job, event.answer).inc()
        elif isinstance(event, RunRetried):
            self.retries.labels(event.job).inc()
        elif isinstance(event, LeaseLost):
            self.lease_losses.labels(event.job).inc()
        elif isinstance(event, SlotSkipped):
            self.skipped.labels(event.job, event.reason).inc()
        elif isinstance(event, TimerFired):
            self.timer_firings.labels(event.run.kind, event.outcome).inc()
        elif isinstance(event, ServerUnreachable):
            self.outages.inc()


#: The metrics of each registry instrumented so far.
_registered: weakref.WeakKeyDictionary[CollectorRegistry, SchedulerMetrics] = (
    weakref.WeakKeyDictionary()
)


def instrument(
    scheduler: Scheduler[Any], registry: CollectorRegistry = REGISTRY
) -> SchedulerMetrics:
    """Count ``scheduler``'s decisions in ``registry`` (prometheus_client's default
    registry unless given); its metrics are then served wherever that registry is
    (``prometheus_client.start_http_server``, ``make_asgi_app``, ``make_wsgi_app``)."""
    metrics = _registered.get(registry)
    if metrics is None:
        metrics = _registered[registry] = SchedulerMetrics.register(registry)
    scheduler.on_event(metrics.observe)
    return metrics
