"""Prometheus metrics of a scheduler's decisions (extra ``anarchon[prometheus]``).

Two lines in a program that already serves Prometheus::

    from anarchon.prometheus import instrument
    instrument(scheduler)  # into prometheus_client's default registry

or ``anarchon run app:scheduler --metrics-port 9100``. The metrics come from the
scheduler's events (``Scheduler.on_event``), gathered as each instance decides and
counted in the process that decides, a batch at a time (every 50 ms while they come,
about once a second while none do, and before each scrape). Several schedulers
instrumented into one registry add up.

Gauges: the leases this instance holds, read from the engine at each scrape; the
instances alive and the timers pending, read from the store by the scheduler beside
its work, at most every ``STORE_READ_SEC`` and only while someone scrapes: the timers
of the kinds the scheduler runs, and of at most ``PENDING_OTHER_KINDS`` others (a
store of thousands of kinds is not thousands of series; a kind gone is a series gone).
The malformed store entries the process met (``anarchon_store_malformed_entries``).
For alert rules, from the store as well: when each job this scheduler runs last
succeeded and last had a slot recorded (``anarchon_job_last_success_timestamp_seconds``,
``anarchon_job_last_slot_timestamp_seconds``), and how many registered jobs no live
instance runs (``anarchon_jobs_unrun``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ._engine.instance import Instance
from ._errors import SchedulerStateError
from ._observe.events import (
    ClaimAnswered,
    Event,
    JobPaused,
    LeaseLost,
    RunFinished,
    RunRetried,
    RunStarted,
    ServerUnreachable,
    SlotSkipped,
    TimerFired,
)
from ._ops.inspector import Inspector, inspector_over, may_run
from ._scheduler import Scheduler
from ._store.quarantine import quarantine_of
from .clients import Connection

__all__ = ["PENDING_OTHER_KINDS", "STORE_READ_SEC", "SchedulerMetrics", "instrument"]

log = logging.getLogger("anarchon")

#: The store's gauges are read again at most this often (seconds), while scraped.
STORE_READ_SEC = 10.0
#: Timer kinds that the scheduler does not run whose pending timers are shown at most
#: (the first by name), beside the kinds it runs.
PENDING_OTHER_KINDS = 20
#: How often a scheduler looks whether a scrape asked for the store's gauges.
_LOOK_SEC = 0.5
#: How often a scheduler counts the events its hook gathered while they come (and each
#: scrape does); with none to count it waits twice as long each time, up to
#: ``_COUNT_IDLE_SEC``, so an idle scheduler does not wake 20 times a second.
_COUNT_SEC = 0.05
_COUNT_IDLE_SEC = 1.0

#: Seconds: from a few milliseconds late to minutes (catch-up, a takeover).
_LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_DURATION_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 3600)
#: The same bounds in ms: the histograms count the events' ms as they come.
_LATENESS_MS = tuple(bound * 1000 for bound in _LATENESS_BUCKETS)
_DURATION_MS = tuple(bound * 1000 for bound in _DURATION_BUCKETS)

#: The counters: (name as exposed without ``_total``, help, labels).
_COUNTERS = {
    "runs": (
        "anarchon_runs",
        "Attempts that ended and were recorded, by outcome.",
        ("job", "outcome"),
    ),
    "claims": ("anarchon_claims", "Claims of slots, by the store's answer.", ("job", "answer")),
    "retries": (
        "anarchon_retries",
        "Attempts that ended without success and were retried.",
        ("job",),
    ),
    "lease_losses": (
        "anarchon_lease_losses",
        "Runs (and timer firings) won here that lost their lease.",
        ("job",),
    ),
    "skipped": (
        "anarchon_skipped_slots",
        "Scheduled slots that did not run, by reason.",
        ("job", "reason"),
    ),
    "paused_by_failures": (
        "anarchon_jobs_paused_by_failures",
        "Times a job was paused because its pause_after_failures slots in a row failed.",
        ("job",),
    ),
    "timer_firings": (
        "anarchon_timer_firings",
        "Timer firings that ended and were recorded.",
        ("kind", "outcome"),
    ),
    "outages": ("anarchon_server_unreachable", "Times the server stopped answering.", ()),
    "takeovers": (
        "anarchon_takeovers",
        "Runs (and timer firings) taken over here from a runner that vanished.",
        ("job",),
    ),
}
#: The histograms: (name, help, labels, upper bounds of the buckets).
_HISTOGRAMS = {
    "lateness": (
        "anarchon_fire_lateness_seconds",
        "From a slot's instant to its handler's start (retries included).",
        ("job",),
        _LATENESS_BUCKETS,
    ),
    "duration": (
        "anarchon_run_duration_seconds",
        "How long attempts ran, by outcome.",
        ("job", "outcome"),
        _DURATION_BUCKETS,
    ),
}


class _Counts:
    """What one scheduler counted: plain numbers by labels. The scheduler's hook only
    appends each event to ``pending`` (a C call, no Python frame); the events are
    counted a batch at a time (``flush``), every ``_COUNT_SEC`` by a task of the
    scheduler and before each scrape, which reads the numbers from another thread."""

    def __init__(self) -> None:
        #: Events not counted yet (the hook is ``pending.append``).
        self.pending: list[Event] = []
        self._flushing = threading.Lock()
        self._failed = False
        #: The counters but ``runs``, which the durations hold (``counted``).
        self.counters: dict[str, dict[tuple[str, ...], int]] = {
            name: {} for name in _COUNTERS if name != "runs"
        }
        #: Per labels: the count in each bucket (the last one +Inf), then the sum, in ms.
        self.histograms: dict[str, dict[tuple[str, ...], list[float]]] = {
            name: {} for name in _HISTOGRAMS
        }
        # What every run counts, at hand: a run's three events are counted in the
        # scheduler's hot path, so each goes straight to its own method and rows.
        self._claims = self.counters["claims"]
        self._durations = self.histograms["duration"]
        self._lateness = self.histograms["lateness"]
        self._by_type: dict[type[Event], Callable[[Any], None]] = {
            ClaimAnswered: self._claimed,
            RunStarted: self._started,
            RunFinished: self._finished,
            RunRetried: lambda event: self.count("retries", (event.job,)),
            LeaseLost: lambda event: self.count("lease_losses", (event.job,)),
            SlotSkipped: lambda event: self.count("skipped", (event.job, event.reason)),
            JobPaused: lambda event: self.count("paused_by_failures", (event.job,)),
            TimerFired: self._fired,
            ServerUnreachable: lambda event: self.count("outages", ()),
        }

    def count(self, counter: str, labels: tuple[str, ...]) -> None:
        counts = self.counters[counter]
        counts[labels] = counts.get(labels, 0) + 1

    def counted(self, counter: str) -> list[tuple[tuple[str, ...], int]]:
        """A counter's counts by labels, copied at once (at a scrape)."""
        if counter == "runs":  # each attempt recorded is one duration, by the same labels
            rows = list(self._durations.items())
            return [(labels, round(sum(row[:-1]))) for labels, row in rows]
        return list(self.counters[counter].items())

    def flush(self, *, wait: bool = True) -> int:
        """Count the pending events: at a scrape (``wait``), and in the scheduler's
        event loop, which does not wait for a scrape that is counting them already.
        Returns how many it counted."""
        if not self._flushing.acquire(blocking=wait):
            return 0
        try:
            pending = self.pending
            batch = pending[:]
            del pending[: len(batch)]  # what was appended meanwhile stays for the next
            by_type = self._by_type
            for event in batch:
                try:
                    (by_type.get(type(event)) or self._counter_of(type(event)))(event)
                except Exception:  # one event not counted; the scheduler goes on
                    if not self._failed:
                        self._failed = True
                        log.exception(
                            "counting an event for Prometheus failed (%r); it is not counted, "
                            "the others are, and this is logged once",
                            event,
                        )
            return len(batch)
        finally:
            self._flushing.release()

    def take(self, event: Event) -> None:
        """Count one event now."""
        self.pending.append(event)
        self.flush()

    def _counter_of(self, kind: type[Event]) -> Callable[[Any], None]:
        """How a subclass of a counted event is counted (as its base), or an event
        nobody counts (not at all): looked up once."""
        count = next(
            (self._by_type[base] for base in kind.__mro__ if base in self._by_type),
            lambda event: None,
        )
        self._by_type[kind] = count
        return count

    def _claimed(self, event: ClaimAnswered) -> None:
        claim = (event.job, event.answer)
        self._claims[claim] = self._claims.get(claim, 0) + 1

    def _started(self, event: RunStarted) -> None:
        run = event.run
        late_ms = event.late_ms
        _observe(self._lateness, _LATENESS_MS, (run.job,), late_ms if late_ms > 0 else 0.0)
        if run.trigger == "takeover":
            self.count("takeovers", (run.job,))

    def _finished(self, event: RunFinished) -> None:
        _observe(self._durations, _DURATION_MS, (event.run.job, event.outcome), event.duration_ms)

    def _fired(self, event: TimerFired) -> None:
        self.count("timer_firings", (event.run.kind, event.outcome))
        if event.run.trigger == "takeover":
            self.count("takeovers", (event.run.kind,))


def _observe(
    rows: dict[tuple[str, ...], list[float]],
    bounds: tuple[float, ...],
    labels: tuple[str, ...],
    value: float,
) -> None:
    """Count ``value`` into the bucket row of ``labels`` (made at its first value)."""
    buckets = rows.get(labels)
    if buckets is None:
        buckets = rows[labels] = [0.0] * (len(bounds) + 2)
    buckets[bisect_left(bounds, value)] += 1
    buckets[-1] += value


class SchedulerMetrics(Collector):
    """The metrics of the schedulers instrumented into one registry (``instrument``
    registers it once per registry): their counts added up at each scrape, and the
    gauges."""

    def __init__(self) -> None:
        self._sources: list[weakref.ref[_Source]] = []

    @classmethod
    def register(cls, registry: CollectorRegistry) -> SchedulerMetrics:
        metrics = cls()
        registry.register(metrics)
        return metrics

    def add(self, scheduler: Scheduler[Any]) -> None:
        """Count ``scheduler``'s events, and read its gauges (before its start)."""
        state = scheduler.state
        if state != "new":
            raise SchedulerStateError(
                f"instrument a scheduler before its start (this one is {state}): its gauges "
                "read the store beside its work from the start on"
            )
        source = _Source(scheduler)
        scheduler.on_event(source.counts.pending.append)
        Instance.of(scheduler).read_beside(source.read_beside)
        self._sources.append(weakref.ref(source))

    def describe(self) -> Iterator[Metric]:
        """The metrics' names (for the registry's checks and ``restricted_registry``)."""
        for name, text, labels in _COUNTERS.values():
            yield CounterMetricFamily(name, text, labels=labels)
        for name, text, labels, _ in _HISTOGRAMS.values():
            yield HistogramMetricFamily(name, text, labels=labels)
        yield from self._gauges([])

    def collect(self) -> Iterator[Metric]:
        sources = [s for s in (ref() for ref in self._sources) if s is not None]
        for source in sources:
            source.counts.flush()
        yield from self._counters(sources)
        yield from self._histograms(sources)
        yield from self._gauges(sources)

    @staticmethod
    def _counters(sources: list[_Source]) -> Iterator[Metric]:
        for counter, (name, text, labels) in _COUNTERS.items():
            family = CounterMetricFamily(name, text, labels=labels)
            added: dict[tuple[str, ...], int] = {}
            for source in sources:
                for key, value in source.counts.counted(counter):
                    added[key] = added.get(key, 0) + value
            if not labels:  # a counter without labels is 0 before its first count
                added.setdefault((), 0)
            for key, value in sorted(added.items()):
                family.add_metric(key, value)
            yield family

    @staticmethod
    def _histograms(sources: list[_Source]) -> Iterator[Metric]:
        for histogram, (name, text, labels, bounds) in _HISTOGRAMS.items():
            family = HistogramMetricFamily(name, text, labels=labels)
            added: dict[tuple[str, ...], list[float]] = {}
            for source in sources:
                for key, buckets in list(source.counts.histograms[histogram].items()):
                    into = added.setdefault(key, [0.0] * len(buckets))
                    for index, value in enumerate(buckets[:]):
                        into[index] += value
            for key, buckets in sorted(added.items()):
                cumulative, running = [], 0.0
                upper = (*map(floatToGoString, bounds), "+Inf")
                for bound, count in zip(upper, buckets[:-1], strict=True):
                    running += count
                    cumulative.append((bound, running))
                family.add_metric(key, cumulative, buckets[-1] / 1000)  # ms to seconds
            yield family

    @staticmethod
    def _gauges(sources: list[_Source]) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            "anarchon_leases_held",
            "Runs (and timer firings) holding a lease on this instance.",
            labels=["job"],
        )
        totals: dict[str, int] = {}
        for source in sources:
            source.wanted = True
            for job, count in Instance.of(source.scheduler).leases_held().items():
                totals[job] = totals.get(job, 0) + count
        for job, count in sorted(totals.items()):
            held.add_metric([job], count)
        yield held
        yield from _room(sources)
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
        malformed = CounterMetricFamily(
            "anarchon_store_malformed_entries",
            "Malformed store entries this process met (each logged once, left as it is, "
            "and skipped).",
            labels=["prefix"],
        )
        counted: set[str] = set()
        seen: set[str] = set()
        for source in sources:
            prefix = source.scheduler.backend.prefix
            if prefix not in counted:
                counted.add(prefix)
                malformed.add_metric([prefix], quarantine_of(prefix).count)
            if source.instances is None or prefix in seen:
                continue
            seen.add(prefix)
            alive.add_metric([prefix], source.instances)
            for kind, count in sorted(source.timers.items()):
                pending.add_metric([prefix, kind], count)
        yield alive
        yield pending
        yield malformed
        yield from _job_gauges(sources)


#: The metrics of each registry instrumented so far.
_registered: weakref.WeakKeyDictionary[CollectorRegistry, SchedulerMetrics] = (
    weakref.WeakKeyDictionary()
)


def _room(sources: list[_Source]) -> Iterator[Metric]:
    """The room left under the bound on handlers at once, and what waited for it, over
    the schedulers of this registry (the scrape's own ``instance`` label tells the
    processes apart)."""
    room = GaugeMetricFamily(
        "anarchon_capacity_room",
        "Handlers that may still start here under max_concurrent (absent without a bound).",
    )
    waited = CounterMetricFamily(
        "anarchon_capacity_wait_seconds",
        "Time the claim loop waited for room under max_concurrent: slots due meanwhile "
        "stayed in the store for the other instances.",
    )
    deferred = CounterMetricFamily(
        "anarchon_capacity_deferred_timer_claims",
        "Claims of due timers put off for want of room under max_concurrent (the timers "
        "stayed in the store).",
    )
    waiting = GaugeMetricFamily(
        "anarchon_capacity_waiting",
        "Claims put off for room now: slots of jobs at their own max_concurrent, and "
        "kinds' due timers (the work stays in the store for the other instances).",
    )
    fleet = CounterMetricFamily(
        "anarchon_fleet_limit_waits",
        "Claims that found a fleet-wide limit reached (max_concurrent_fleet: 'concurrent'; "
        "a timer kind's rate_limit: 'rate'): the work waited in the store.",
        labels=["owner", "name", "limit"],
    )
    fleet_totals: dict[tuple[str, str, str], int] = {}
    left_total, bounded, waited_total, deferred_total, waiting_total = 0, False, 0.0, 0, 0
    for source in sources:
        room_now = Instance.of(source.scheduler).room()
        if room_now.bound is not None:
            bounded = True
            left_total += room_now.left
        waited_total += room_now.waited_sec
        deferred_total += room_now.deferred
        waiting_total += room_now.waiting
        for key, count in room_now.fleet_waits.items():
            fleet_totals[key] = fleet_totals.get(key, 0) + count
    for labels, count in sorted(fleet_totals.items()):
        fleet.add_metric(list(labels), count)
    if bounded:
        room.add_metric([], left_total)
    waited.add_metric([], waited_total)
    deferred.add_metric([], deferred_total)
    waiting.add_metric([], waiting_total)
    yield room
    yield waited
    yield deferred
    yield waiting
    yield fleet


def instrument(
    scheduler: Scheduler[Any], registry: CollectorRegistry = REGISTRY
) -> SchedulerMetrics:
    """Count ``scheduler``'s decisions in a Prometheus registry; its metrics are then
    served wherever that registry is (``prometheus_client.start_http_server``,
    ``make_asgi_app``, ``make_wsgi_app``). Several schedulers instrumented into one
    registry add up.

    Args:
        scheduler: The scheduler to count; before its start (its gauges are read
            beside its work from the start on).
        registry: The registry to count in (default: prometheus_client's default
            registry).

    Returns:
        The registry's collector of anarchon's metrics (one per registry, shared by
        the schedulers instrumented into it).

    Raises:
        SchedulerStateError: The scheduler has started already.
    """
    metrics = _registered.get(registry)
    if metrics is None:
        metrics = _registered[registry] = SchedulerMetrics.register(registry)
    metrics.add(scheduler)
    return metrics


def _job_gauges(sources: list[_Source]) -> Iterator[Metric]:
    """What alert rules are written for, from the store: when each job this process runs
    last succeeded and last had a slot decided, and how many jobs no live instance
    runs."""
    success = GaugeMetricFamily(
        "anarchon_job_last_success_timestamp_seconds",
        "When the job's last run that ended ok ended (Unix seconds, the server's clock; "
        "fleet-wide, from the store).",
        labels=["job"],
    )
    slot = GaugeMetricFamily(
        "anarchon_job_last_slot_timestamp_seconds",
        "The instant of the job's newest recorded slot: run, failed or skipped (Unix "
        "seconds; fleet-wide, from the store).",
        labels=["job"],
    )
    unrun = GaugeMetricFamily(
        "anarchon_jobs_unrun",
        "Registered jobs that no live instance runs (fleet-wide, from the store).",
        labels=["prefix"],
    )
    seen: set[str] = set()
    for source in sources:
        for job, (succeeded, decided) in sorted(source.job_times.items()):
            if job in seen:
                continue
            seen.add(job)
            if succeeded is not None:
                success.add_metric([job], succeeded)
            if decided is not None:
                slot.add_metric([job], decided)
    prefixes: set[str] = set()
    for source in sources:
        prefix = source.scheduler.backend.prefix
        if source.unrun is not None and prefix not in prefixes:
            prefixes.add(prefix)
            unrun.add_metric([prefix], source.unrun)
    yield success
    yield slot
    yield unrun


@dataclass(eq=False)
class _Source:
    """One instrumented scheduler: what the gauges read of it."""

    scheduler: Scheduler[Any]
    counts: _Counts = field(default_factory=_Counts)
    #: The store's last answer (None until read, and after a read failed).
    instances: int | None = None
    timers: dict[str, int] = field(default_factory=dict)
    #: Of each job this scheduler runs: when its last run ended ok, and its newest
    #: recorded slot (Unix seconds; None: none yet).
    job_times: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    #: The registered jobs no live instance runs (None: not known).
    unrun: int | None = None
    #: A scrape since the last read of the store.
    wanted: bool = True

    async def read_beside(self, conn: Connection) -> None:
        """Count the events, and read the store's gauges while scrapes ask for them (a
        scheduler's task)."""
        async with anyio.create_task_group() as group:
            group.start_soon(self._count)
            await self._read_gauges(conn)

    async def _count(self) -> None:
        pause = _COUNT_SEC
        try:
            while True:
                counted = self.counts.flush(wait=False)
                pause = _COUNT_SEC if counted else min(pause * 2, _COUNT_IDLE_SEC)
                await anyio.sleep(pause)
        finally:  # cancelled as the stop begins: what comes after is counted at a scrape
            self.counts.flush(wait=False)

    async def _read_gauges(self, conn: Connection) -> None:
        inspector = inspector_over(self.scheduler.backend, conn)
        try:
            while True:
                if self.wanted:
                    self.wanted = False
                    await self._read(inspector)
                    await anyio.sleep(STORE_READ_SEC)
                await anyio.sleep(_LOOK_SEC)
        finally:  # stopped: nothing read any more, so nothing shown
            self.instances, self.timers = None, {}
            self.job_times, self.unrun = {}, None

    async def _read(self, inspector: Inspector) -> None:
        """The instances alive (counted, not read), and the timers pending of the kinds
        this scheduler runs and of at most ``PENDING_OTHER_KINDS`` others."""
        own = self.scheduler.timer_kinds
        try:
            instances = await inspector.instance_count()
            timers = await inspector.timers(own) if own else []
            others = await inspector.timers(limit=PENDING_OTHER_KINDS + len(own))
            jobs = await inspector.jobs(self.scheduler.jobs) if self.scheduler.jobs else []
            names = await inspector.job_names()
            alive = await inspector.instances()
        except Exception as exc:
            log.debug("reading the store's gauges failed (read again later): %s", exc)
            self.instances, self.timers = None, {}
            self.job_times, self.unrun = {}, None
            return
        self.job_times = {
            job.name: (
                None if job.last_success is None else job.last_success.timestamp(),
                None if job.last is None else job.last.slot.timestamp(),
            )
            for job in jobs
        }
        every_read = instances <= len(alive)
        self.unrun = sum(not may_run(name, alive) for name in names) if every_read else None
        self.instances = instances
        self.timers = {kind.kind: kind.pending for kind in timers}
        for kind in others:
            if len(self.timers) < len(own) + PENDING_OTHER_KINDS:
                self.timers.setdefault(kind.kind, kind.pending)
