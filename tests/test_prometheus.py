"""Prometheus metrics from a scheduler's events, asserted against what the store recorded
on real servers."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry

from anarchon import RedisBackend, Run, RunResult, Scheduler
from anarchon.prometheus import instrument
from tests.helpers import OneShot, Seconds

pytestmark = pytest.mark.anyio


async def test_the_counters_and_histograms_match_the_recorded_runs(
    server_url: str, prefix: str
) -> None:
    """Two instances instrumented into one registry: runs by outcome, claims won,
    retries, skipped slots and the lateness histogram add up to what the store
    recorded for the fleet."""
    registry = CollectorRegistry()
    schedulers: list[Scheduler[Any]] = []
    for name in ("a", "b"):
        scheduler = Scheduler(
            RedisBackend(redis=server_url, prefix=prefix), instance_id=name, retry_delay_ms=100
        )

        @scheduler.job(Seconds(500, 3), name="tick")
        async def tick() -> None:
            pass

        @scheduler.job(OneShot.in_ms(500), name="flaky")
        async def flaky(run: Run) -> None:
            if run.attempt == 1:
                raise RuntimeError("the first attempt fails")

        @scheduler.job("* * * * * *", name="held")
        async def held() -> None:
            pass

        instrument(scheduler, registry)
        schedulers.append(scheduler)
    history: dict[str, list[RunResult]] = {}
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await schedulers[0].pause("held")

        with anyio.fail_after(30):
            for job, count in (("tick", 3), ("flaky", 2), ("held", 2)):
                while True:
                    history[job] = await schedulers[0].history(job)
                    if len([r for r in history[job] if r.status != "running"]) >= count:
                        break
                    await anyio.sleep(0.1)

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
    assert value("anarchon_runs_total", job="held", outcome="ok") == 0
