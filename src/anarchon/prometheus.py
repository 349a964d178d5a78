"""Prometheus metrics of a scheduler's decisions (extra ``anarchon[prometheus]``).

Two lines in a program that already serves Prometheus::

    from anarchon.prometheus import instrument
    instrument(scheduler)  # into prometheus_client's default registry

or ``anarchon run app:scheduler --metrics-port 9100``. The metrics come from the
scheduler's events (``Scheduler.on_event``): counted as each instance decides, in the
process that decides. Several schedulers instrumented into one registry add up.

Gauges: the leases this instance holds, read from the engine at each scrape; the
instances alive and the timers pending, read from the store by the scheduler beside
its work, at most every ``STORE_READ_SEC`` and only while someone scrapes.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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
from ._inspector import Inspector
from ._scheduler import Scheduler
from .clients import Connection

__all__ = ["STORE_READ_SEC", "SchedulerMetrics", "instrument"]

log = logging.getLogger("anarchon")

#: The store's gauges are read again at most this often (seconds), while scraped.
STORE_READ_SEC = 10.0
#: How often a scheduler looks whether a scrape asked for the store's gauges.
_LOOK_SEC = 0.5

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
    takeovers: Counter
    lateness: Histogram
    duration: Histogram
    gauges: _Gauges

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
            takeovers=counter(
                "anarchon_takeovers",
                "Runs (and timer firings) taken over here from a runner that vanished.",
                "job",
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
            gauges=_Gauges.register(registry),
        )  # fmt: skip

    def observe(self, event: Event) -> None:
        """Count one event."""
        if isinstance(event, RunFinished):
            job, outcome = event.run.job, event.outcome
            self.runs.labels(job, outcome).inc()
            self.duration.labels(job, outcome).observe(event.duration_ms / 1000)
        elif isinstance(event, RunStarted):
            self.lateness.labels(event.run.job).observe(max(event.late_ms, 0.0) / 1000)
            if event.run.trigger == "takeover":
                self.takeovers.labels(event.run.job).inc()
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
            if event.run.trigger == "takeover":
                self.takeovers.labels(event.run.kind).inc()
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
    metrics.gauges.add(scheduler)
    return metrics


@dataclass(eq=False)
class _Source:
    """One instrumented scheduler: what the gauges read of it."""

    scheduler: Scheduler[Any]
    #: The store's last answer (None until read, and after a read failed).
    instances: int | None = None
    timers: dict[str, int] = field(default_factory=dict)
    #: A scrape since the last read of the store.
    wanted: bool = True

    async def read_beside(self, conn: Connection) -> None:
        """Read the store's gauges while scrapes ask for them (a scheduler's task)."""
        inspector = Inspector._over(self.scheduler.backend, conn)
        while True:
            if self.wanted:
                self.wanted = False
                await self._read(inspector)
                await anyio.sleep(STORE_READ_SEC)
            await anyio.sleep(_LOOK_SEC)

    async def _read(self, inspector: Inspector) -> None:
        try:
            instances = await inspector.instances()
            timers = await inspector.timers()
        except Exception as exc:
            log.debug("reading the store's gauges failed (read again later): %s", exc)
            self.instances, self.timers = None, {}
            return
        self.instances = len(instances)
        self.timers = {kind.kind: kind.pending for kind in timers}


class _Gauges(Collector):
    """The gauges of the schedulers instrumented into one registry."""

    def __init__(self) -> None:
        self._sources: list[weakref.ref[_Source]] = []

    @classmethod
    def register(cls, registry: CollectorRegistry) -> _Gauges:
        gauges = cls()
        registry.register(gauges)
        return gauges

    def add(self, scheduler: Scheduler[Any]) -> None:
        source = _Source(scheduler)
        scheduler._read_beside(source.read_beside)
        self._sources.append(weakref.ref(source))

    def describe(self) -> Iterator[Metric]:
        return iter(())  # not known before a scrape; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        sources = [s for s in (ref() for ref in self._sources) if s is not None]
        held = GaugeMetricFamily(
            "anarchon_leases_held",
            "Runs (and timer firings) holding a lease on this instance.",
            labels=["job"],
        )
        totals: dict[str, int] = {}
        for source in sources:
            source.wanted = True
            for job, count in source.scheduler._leases_held().items():
                totals[job] = totals.get(job, 0) + count
        for job, count in sorted(totals.items()):
            held.add_metric([job], count)
        yield held
        alive = GaugeMetricFamily(
            "anarchon_instances_alive",
            "Instances registered and renewing under the prefix (fleet-wide, from the store).",
            labels=["prefix"],
        )
        pending = GaugeMetricFamily(
            "anarchon_timers_pending",
            "Keys with a timer pending, by kind (fleet-wide, from the store).",
            labels=["prefix", "kind"],
        )
        seen: set[str] = set()
        for source in sources:
            prefix = source.scheduler.backend.prefix
            if source.instances is None or prefix in seen:
                continue
            seen.add(prefix)
            alive.add_metric([prefix], source.instances)
            for kind, count in sorted(source.timers.items()):
                pending.add_metric([prefix, kind], count)
        yield alive
        yield pending
