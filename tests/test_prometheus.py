"""Prometheus metrics from a scheduler's events, asserted against what the store recorded
on real servers."""

from __future__ import annotations

import logging
import signal
import time
import urllib.request
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

import anarchon._ops.inspector
import anarchon.prometheus
from anarchon import (
    RedisBackend,
    Run,
    RunFinished,
    RunRetried,
    RunStarted,
    Scheduler,
    SchedulerStateError,
    ServerBack,
    TimerRun,
)
from anarchon._engine.instance import Instance
from anarchon._ops.embedded import free_port
from anarchon._store.keys import RegistryKeys
from anarchon._store.quarantine import MalformedEntry, quarantine_of
from anarchon.prometheus import instrument
from tests.faults import FaultProxy
from tests.helpers import (
    OneShot,
    OneShotAtFirstAsk,
    a_long_run,
    claim_for_a_dead_runner,
    long_job_fleet,
    settled_history,
    tick_and_flaky_fleet,
    wait_until,
)
from tests.test_run_command import RunCommand, app_env, commands, history, wait_for

__all__ = ["commands"]  # a fixture

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


async def test_the_counters_and_histograms_match_the_recorded_runs(
    server_url: str, prefix: str
) -> None:
    """Two instances instrumented into one registry: runs by outcome, claims won,
    retries, skipped slots and the lateness histogram add up to what the store
    recorded for the fleet."""
    registry = CollectorRegistry()
    schedulers = tick_and_flaky_fleet(server_url, prefix, ("a", "b"))
    for scheduler in schedulers:

        @scheduler.job("* * * * * *", name="held")
        async def held() -> None:
            pass

        instrument(scheduler, registry)
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await schedulers[0].pause("held")
        with anyio.fail_after(30):
            history = await settled_history(schedulers[0], {"tick": 3, "flaky": 2, "held": 2})

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    ran = {job: [r for r in history[job] if r.status in ("ok", "failed")] for job in history}
    assert value("anarchon_runs_total", job="tick", outcome="ok") == len(ran["tick"]) == 3
    assert value("anarchon_runs_total", job="flaky", outcome="failed") == 1
    assert value("anarchon_runs_total", job="flaky", outcome="ok") == 1
    assert value("anarchon_retries_total", job="flaky") == 1
    assert value("anarchon_claims_total", job="tick", answer="won") == 3
    assert value("anarchon_fire_lateness_seconds_count", job="tick") == 3
    assert value("anarchon_run_duration_seconds_count", job="tick", outcome="ok") == 3
    # Paused slots: each skipped once for the fleet, and said by the instance whose
    # claim found the job paused.
    skipped = [r for r in history["held"] if r.status == "skipped"]
    assert value("anarchon_skipped_slots_total", job="held", reason="paused") == len(skipped)
    # A slot may have run before the pause: what ran is what the store recorded.
    held_ok = [r for r in history["held"] if r.status == "ok"]
    assert value("anarchon_runs_total", job="held", outcome="ok") == len(held_ok)


def scrape(port: int) -> dict[str, float]:
    """The samples ``GET /metrics`` on ``port`` serves, by name and labels as written."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_anarchon_run_serves_its_metrics_on_the_metrics_port(
    server_url: str, prefix: str, tmp_path: Path, commands: list[RunCommand]
) -> None:
    port = free_port()
    command = RunCommand(
        tmp_path, "one", app_env(server_url, prefix, work_sec=0),
        "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
    )  # fmt: skip
    commands.append(command)
    command.wait_live()
    # Where the metrics are is said once, as the health port's place is.
    assert command.log().count(f"metrics on http://127.0.0.1:{port}/metrics") == 1
    ok = 'anarchon_runs_total{job="work",outcome="ok"}'
    wait_for(lambda: scrape(port).get(ok, 0) >= 2, 30, "two runs counted")
    before = sum(1 for _, _, status in history(server_url, prefix) if status == "ok")
    counted = scrape(port)[ok]
    after = sum(1 for _, _, status in history(server_url, prefix) if status == "ok")
    # A run is counted once its result is recorded (at most one is in between).
    assert before - 1 <= counted <= after, (before, counted, after)
    samples = scrape(port)
    assert samples['anarchon_fire_lateness_seconds_count{job="work"}'] >= counted
    assert samples['anarchon_claims_total{answer="won",job="work"}'] >= counted
    command.signal(signal.SIGTERM)
    assert command.wait(30) == 0, command.log()


async def test_a_run_taken_over_from_a_vanished_runner_is_counted_as_a_takeover(
    server_url: str, prefix: str
) -> None:
    """A runner won the slot and vanished: the instance that claims it after the lease
    ran out runs attempt 2 with the trigger takeover, and counts one takeover; an
    ordinary retry (the flaky job's) is not one."""
    registry = CollectorRegistry()
    # Chosen as the instance starts, 5 s ahead: the dead runner wins it first, well
    # before the instance's own claim. The rest of the start and the dead runner's claim
    # took over 1.5 s in CI, and the instance ran the slot itself first.
    slot = OneShotAtFirstAsk(5000)
    runs: list[Run] = []
    (scheduler,) = tick_and_flaky_fleet(server_url, prefix, ("a",))

    @scheduler.job(slot, name="orphan")
    async def orphan(run: Run) -> None:
        runs.append(run)

    instrument(scheduler, registry)
    async with scheduler:
        assert slot.at is not None
        slot_ms = int(slot.at.timestamp() * 1000)
        await claim_for_a_dead_runner(server_url, prefix, "orphan", slot_ms, lease_ms=200)
        with anyio.fail_after(30):
            history = await settled_history(scheduler, {"orphan": 2, "flaky": 2})

    assert [(r.attempt, r.trigger) for r in runs] == [(2, "takeover")]
    assert sorted((r.attempt, r.status, r.trigger) for r in history["orphan"]) == [
        (1, "interrupted", "schedule"),
        (2, "ok", "takeover"),
    ]
    assert [r.trigger for r in history["flaky"] if r.attempt == 2] == ["retry"]
    assert registry.get_sample_value("anarchon_takeovers_total", {"job": "orphan"}) == 1
    assert registry.get_sample_value("anarchon_takeovers_total", {"job": "flaky"}) is None
    assert registry.get_sample_value("anarchon_retries_total", {"job": "flaky"}) == 1


async def test_the_gauges_show_the_leases_held_the_instances_alive_and_the_timers_pending(
    server_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet of two in one registry: while one runs "long", the leases held add up to
    one; the store's gauges say two instances alive and the three timers set; once the
    run ends, no lease is held, and a timer cancelled is one fewer pending."""
    monkeypatch.setattr(anarchon.prometheus, "STORE_READ_SEC", 0.2)
    registry = CollectorRegistry()

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    def set_up(scheduler: Scheduler[Any]) -> None:
        @scheduler.timer("remind")
        async def remind(fire: TimerRun) -> None:
            pass

        instrument(scheduler, registry)

    pending = {"prefix": prefix, "kind": "remind"}
    async with long_job_fleet(server_url, prefix, OneShotAtFirstAsk(300), set_up) as fleet:
        await wait_until(lambda: len(fleet.starts) == 1, 30, "the long run to start")
        assert value("anarchon_leases_held", job="long") == 1
        for key in ("user:1", "user:2", "user:3"):
            await fleet.schedulers[0].set_timer("remind", key, delay_ms=600_000)
        await wait_until(
            lambda: value("anarchon_timers_pending", **pending) == 3, 30, "three timers pending"
        )
        assert value("anarchon_instances_alive", prefix=prefix) == 2
        await fleet.schedulers[1].cancel_timer("remind", "user:2")
        await wait_until(
            lambda: value("anarchon_timers_pending", **pending) == 2, 30, "two timers pending"
        )
    # Stopped: no lease held, and nothing read of the store any more, so nothing shown.
    assert value("anarchon_leases_held", job="long") is None
    assert value("anarchon_instances_alive", prefix=prefix) is None


async def test_the_store_s_gauges_vanish_while_the_server_is_frozen_and_return_after(
    server_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen server: the scrapes go on answering from memory (they never wait for
    the store), and the gauges read from the store are left out rather than shown stale
    once a read of them fails; the server back, they are read and shown again."""
    monkeypatch.setattr(anarchon.prometheus, "STORE_READ_SEC", 0.2)
    monkeypatch.setattr(anarchon._ops.inspector, "_DEADLINE_SEC", 2.0)  # a frozen read's wait
    registry = CollectorRegistry()

    def alive() -> float | None:
        return registry.get_sample_value("anarchon_instances_alive", {"prefix": prefix})

    with FaultProxy(server_url) as proxy:
        scheduler, _ = a_long_run(proxy.url, prefix)
        instrument(scheduler, registry)
        async with scheduler:
            await wait_until(lambda: alive() == 1, 30, "the instance counted alive")
            proxy.pause()
            await wait_until(lambda: alive() is None, 30, "the gauge left out while frozen")
            assert b"anarchon_claims_total" in generate_latest(registry)  # still served
            proxy.resume()
            await wait_until(lambda: alive() == 1, 30, "the gauge read again")


async def test_a_lost_lease_an_outage_and_a_timer_firing_are_counted(
    server_url: str, prefix: str
) -> None:
    """The server frozen during a run longer than its lease: one lease lost and one
    outage counted; then a timer set and fired: one firing counted, by outcome."""
    registry = CollectorRegistry()
    fired: list[TimerRun] = []
    with FaultProxy(server_url) as proxy:
        scheduler, started = a_long_run(proxy.url, prefix)

        @scheduler.timer("remind")
        async def remind(fire: TimerRun) -> None:
            fired.append(fire)

        instrument(scheduler, registry)
        back = anyio.Event()
        scheduler.on_event(lambda event: back.set() if isinstance(event, ServerBack) else None)

        def value(name: str, **labels: str) -> float:
            return registry.get_sample_value(name, labels) or 0.0

        lost = ("anarchon_lease_losses_total", {"job": "long"})
        async with scheduler:
            await started.wait()
            proxy.pause()
            await wait_until(lambda: value(lost[0], **lost[1]) == 1, 20, "a lost lease")
            proxy.resume()
            with anyio.fail_after(20):
                await back.wait()
            await scheduler.set_timer("remind", "user:42", delay_ms=300)
            await wait_until(lambda: len(fired) == 1, 20, "the timer to fire")
            firings = ("anarchon_timer_firings_total", {"kind": "remind", "outcome": "ok"})
            await wait_until(lambda: value(firings[0], **firings[1]) == 1, 20, "a firing")
    assert value("anarchon_server_unreachable_total") == 1
    assert value(lost[0], **lost[1]) == 1 and value(firings[0], **firings[1]) == 1


async def test_a_started_scheduler_is_refused_and_a_restricted_registry_has_the_metrics(
    server_url: str, prefix: str
) -> None:
    registry = CollectorRegistry()
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(OneShot.in_ms(100), name="once")
    async def once() -> None:
        pass

    async with scheduler:
        with pytest.raises(SchedulerStateError, match="before its start"):
            instrument(scheduler, registry)
        assert Instance.of(scheduler).context.events.hooks == []  # nothing was hooked
    other = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    instrument(other, registry)
    unreachable = "anarchon_server_unreachable_total"
    only = generate_latest(registry.restricted_registry([unreachable])).decode()
    assert f"{unreachable} 0.0" in only and "anarchon_claims" not in only, only


def test_an_event_of_a_subclass_is_counted_as_its_base_and_others_are_ignored() -> None:
    """The counts go by the event's type; a subclass of a counted event (made by code
    beside anarchon's) counts as its base, and an event nobody counts changes nothing."""
    counts = anarchon.prometheus._Counts()

    class Retried(RunRetried):
        __slots__ = ()

    for _ in range(2):
        counts.take(Retried(instance="a", job="flaky", slot_ms=1000, attempt=1, in_ms=500))
        counts.take(ServerBack(instance="a", down_sec=1.0))
    assert counts.counters["retries"] == {("flaky",): 2}
    others = [name for name in anarchon.prometheus._COUNTERS if name != "retries"]
    assert all(not counts.counted(name) for name in others)
    assert all(not rows for rows in counts.histograms.values())


def test_lateness_and_durations_are_bucketed_in_seconds_and_each_is_a_run() -> None:
    """A run's lateness and duration (its events say ms) land in the buckets and sums of
    seconds that Prometheus shows (a value on a bound in the bucket of that bound), and
    each duration is one run of its job and outcome."""
    registry = CollectorRegistry()
    scheduler = Scheduler(RedisBackend(redis="redis://127.0.0.1:6379/0"))  # never started
    instrument(scheduler, registry)
    (count,) = Instance.of(scheduler).context.events.hooks
    run = Run(job="work", slot=datetime.now(UTC), slot_ms=0, attempt=1, trigger="schedule",
              runner="a", fence=1)  # fmt: skip
    for late_ms, duration_ms, outcome in ((30.0, 7000.0, "ok"), (-2.0, 20.0, "ok"),
                                          (400.0, 90.0, "failed"), (5.0, 50.0, "ok"),
                                          (50.0, 5.0, "ok")):  # fmt: skip
        count(RunStarted(instance="a", run=run, late_ms=late_ms))
        count(RunFinished(instance="a", run=run, outcome=outcome, duration_ms=duration_ms,
                          error=None, retried=False))  # fmt: skip

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"job": "work", **labels})

    lateness = "anarchon_fire_lateness_seconds"
    assert value(f"{lateness}_sum") == pytest.approx(0.485)  # early counts as 0
    assert value(f"{lateness}_bucket", le="0.005") == 2
    assert value(f"{lateness}_bucket", le="0.025") == 2
    assert value(f"{lateness}_bucket", le="0.05") == 4
    assert value(f"{lateness}_bucket", le="0.5") == 5
    duration = "anarchon_run_duration_seconds"
    assert value(f"{duration}_sum", outcome="ok") == pytest.approx(7.075)
    assert value(f"{duration}_bucket", outcome="ok", le="0.005") == 1
    assert value(f"{duration}_bucket", outcome="ok", le="0.01") == 1
    assert value(f"{duration}_bucket", outcome="ok", le="0.05") == 3
    assert value(f"{duration}_bucket", outcome="ok", le="5.0") == 3
    assert value(f"{duration}_bucket", outcome="ok", le="10.0") == 4
    assert value(f"{duration}_count", outcome="failed") == 1
    assert value("anarchon_runs_total", outcome="ok") == 4
    assert value("anarchon_runs_total", outcome="failed") == 1


async def test_a_running_scheduler_counts_its_events_without_a_scrape(
    server_url: str, prefix: str
) -> None:
    """The hook only gathers the events; the scheduler counts them itself, in its event
    loop, within a moment, whether anyone scrapes or not."""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job("* * * * * *", name="often")
    async def often() -> None:
        pass

    metrics = instrument(scheduler, CollectorRegistry())
    (source,) = [ref() for ref in metrics._sources]
    assert source is not None
    finished: list[RunFinished] = []
    scheduler.on_event(lambda e: finished.append(e) if isinstance(e, RunFinished) else None)
    async with scheduler:
        await wait_until(lambda: len(finished) >= 2, 30, "two runs to finish")
        seen = len(finished)  # counted by now, or pending until the next count
        await wait_until(lambda: not source.counts.pending, 5, "the events to be counted")
        (runs,) = source.counts.counted("runs")
        assert runs[0] == ("often", "ok") and runs[1] >= seen
        (claims,) = source.counts.counted("claims")
        assert claims[0] == ("often", "won") and claims[1] >= seen


async def test_an_idle_instrumented_scheduler_counts_seldom_and_comes_back_when_busy(
    server_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing to count, the scheduler's counting task backs off to about once a
    second instead of waking 20 times a second; events counted again within a second
    of coming."""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    scheduler.add_job(_nothing, "0 0 1 1 *", name="yearly")
    woke: list[float] = []
    flush = anarchon.prometheus._Counts.flush

    def counting(self: Any, *, wait: bool = True) -> int:
        if not wait:  # the scheduler's own counting, not a scrape's
            woke.append(time.monotonic())
        return flush(self, wait=wait)

    monkeypatch.setattr(anarchon.prometheus._Counts, "flush", counting)
    metrics = instrument(scheduler, CollectorRegistry())
    (source,) = [ref() for ref in metrics._sources]
    assert source is not None
    async with scheduler:
        await wait_until(lambda: bool(woke) and time.monotonic() - woke[0] >= 4, 30, "4 s idle")
        idle_since = woke[0] + 2  # past the backing off
        assert len([t for t in woke if t >= idle_since]) <= 4, woke
        now = time.monotonic()
        source.counts.pending.append(  # as the hook gathers an event
            RunRetried(instance="a", job="often", slot_ms=1000, attempt=1, in_ms=500)
        )
        await wait_until(lambda: not source.counts.pending, 5, "the event to be counted")
        assert time.monotonic() - now < 2.5
        (retries,) = source.counts.counted("retries")
        assert retries == (("often",), 1)


async def _nothing() -> None:
    pass


def test_an_event_that_cannot_be_counted_is_logged_once_and_the_others_are_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Counting runs in the scheduler's task (and at scrapes): an event it cannot count
    is left out and logged once; the events around it are counted, nothing raises."""
    counts = anarchon.prometheus._Counts()
    unhashable: Any = _Unhashable()  # its label cannot be a key
    broken = RunRetried(instance="a", job=unhashable, slot_ms=1, attempt=1, in_ms=0)
    good = RunRetried(instance="a", job="flaky", slot_ms=1000, attempt=1, in_ms=500)
    with caplog.at_level(logging.ERROR, logger="anarchon"):
        for _ in range(2):
            counts.pending.extend([good, broken, good])
            counts.flush()
    assert counts.counted("retries") == [(("flaky",), 4)] and not counts.pending
    failures = [r for r in caplog.records if "counting an event" in r.getMessage()]
    assert len(failures) == 1, caplog.records


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]


async def test_timers_pending_has_a_bounded_number_of_series_and_drops_a_kind_gone(
    server_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, direct: redis.Redis
) -> None:
    """The store holds 3,000 timer kinds (another program's, or a bad migration's): the
    scheduler's pending-timers gauge has a series for each kind it runs, and for at most
    ``PENDING_OTHER_KINDS`` others; a kind that leaves the store leaves the gauge; a
    kind of a million buckets is not read."""
    monkeypatch.setattr(anarchon.prometheus, "STORE_READ_SEC", 0.2)
    registry = CollectorRegistry()
    kinds_key = RegistryKeys.for_prefix(prefix).timer_kinds
    direct.hset(kinds_key, mapping={f"other{index:04d}": '{"buckets": 1}' for index in range(3000)})
    direct.hset(kinds_key, "zzz-huge", '{"buckets": 1000000}')
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), instance_id="one")

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        pass

    instrument(scheduler, registry)

    def series() -> dict[str, float]:
        return {
            sample.labels["kind"]: sample.value
            for metric in registry.collect()
            if metric.name == "anarchon_timers_pending"
            for sample in metric.samples
        }

    async with scheduler:
        await scheduler.set_timer("remind", "user:1", delay_ms=600_000)
        await wait_until(lambda: series().get("remind") == 1, 30, "remind's pending timer")
        shown = series()
        assert len(shown) <= 1 + anarchon.prometheus.PENDING_OTHER_KINDS, len(shown)
        assert "zzz-huge" not in shown
        gone = sorted(kind for kind in shown if kind != "remind")[0]
        direct.hdel(kinds_key, gone)
        await wait_until(lambda: gone not in series(), 30, "the kind gone from the gauge")


def test_the_malformed_store_entries_the_process_met_are_counted_by_prefix() -> None:
    """Each malformed entry the process met under the scheduler's prefix (its engine's,
    an inspector's, a dashboard's) is counted once."""
    registry = CollectorRegistry()
    prefix = "counted-malformed:"
    scheduler = Scheduler(RedisBackend(redis="redis://127.0.0.1:6379/0", prefix=prefix))
    instrument(scheduler, registry)

    def counted() -> float | None:
        return registry.get_sample_value(
            "anarchon_store_malformed_entries_total", {"prefix": prefix}
        )

    assert counted() == 0
    for _ in range(2):  # the same entry, met twice, is one
        quarantine_of(prefix).add(MalformedEntry("{counted-malformed:}:jobs", "x", "not JSON"))
    quarantine_of(prefix).add(MalformedEntry("{counted-malformed:}:jobs", "y", "not JSON"))
    assert counted() == 2


async def test_the_job_gauges_say_when_a_job_last_succeeded_and_how_many_jobs_no_one_runs(
    server_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job every 300 ms, half its runs failing: the last success and the newest slot
    gauges follow the store (the slot at most a few slots old, the success no later than
    now); a job registered by an instance that stopped counts as unrun; and a job paused
    by its pause_after_failures is counted once."""
    monkeypatch.setattr(anarchon.prometheus, "STORE_READ_SEC", 0.2)
    registry = CollectorRegistry()
    retired: Scheduler[Any] = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    retired.add_job(lambda: None, "0 0 1 1 *", name="retired")
    async with retired:
        pass
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    ran: list[int] = []

    @scheduler.job(every_ms=300, name="sync", max_attempts=1)
    async def sync(run: Run) -> None:
        ran.append(run.slot_ms)
        if len(ran) % 2:
            raise RuntimeError("flaky")

    @scheduler.job(every_ms=300, name="doomed", max_attempts=1, pause_after_failures=2)
    async def doomed() -> None:
        raise RuntimeError("always")

    instrument(scheduler, registry)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    async with scheduler:
        await wait_until(
            lambda: (
                value("anarchon_job_last_success_timestamp_seconds", job="sync") is not None
                and value("anarchon_jobs_paused_by_failures_total", job="doomed") == 1
            ),
            30,
            "a success of sync and the pause of doomed",
        )
        await wait_until(
            lambda: value("anarchon_jobs_unrun", prefix=prefix) == 1, 30, "the unrun count"
        )
        succeeded = value("anarchon_job_last_success_timestamp_seconds", job="sync")
        newest = value("anarchon_job_last_slot_timestamp_seconds", job="sync")
    assert succeeded is not None and succeeded <= time.time()
    assert newest is not None and time.time() - newest < 5
