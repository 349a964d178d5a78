"""Prometheus metrics from a scheduler's events, asserted against what the store recorded
on real servers."""

from __future__ import annotations

import signal
import socket
import urllib.request
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry

from anarchon import RedisBackend, Run, RunResult, Scheduler
from anarchon._embedded import free_port
from anarchon.prometheus import instrument
from tests.helpers import OneShot, Seconds
from tests.test_run_command import RunCommand, app_env, commands, history, wait_for

__all__ = ["commands"]  # a fixture

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


def test_a_metrics_port_that_is_taken_fails_before_the_start_in_one_line(
    server_url: str, prefix: str, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = RunCommand(
            tmp_path, "one", app_env(server_url, prefix), "--metrics-port", str(port),
            "--metrics-host", "127.0.0.1",
        )  # fmt: skip
        assert command.wait(30) == 1, command.log()
    lines = command.log().strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], lines
    assert lines[0].startswith("anarchon: ") and "choose a free port" in lines[0]
    assert history(server_url, prefix) == []  # it never ran
