"""One scheduler instance in a process of its own, for benchmarks.

    python -m bench.instance CONFIG_JSON      (the fields of bench.common.InstanceConfig)

Registers the jobs, prints ``{"ready": true}``, reads ``{"start_at": t, "end_at": t}``
(wall clock; optionally ``phase_ms``) from stdin, runs the scheduler from
``start_at`` to ``end_at`` and prints ``{"result": ...}``: every run it started
(slot, handler start, attempt) and samples of its process CPU time. With
``events`` it also prints each handler start as it happens.
"""

from __future__ import annotations

import gc
import json
import signal
import sys
import time
from datetime import UTC, datetime
from typing import Any

import anyio
import anyio.to_thread

from anarchon import RedisBackend, Run, Scheduler
from anarchon._engine.instance import Instance
from bench.common import open_glide


class Phased:
    """Fires every ``period_ms`` at ``phase_ms`` modulo it (epoch milliseconds)."""

    def __init__(self, period_ms: int, phase_ms: int) -> None:
        self.period_ms = period_ms
        self.phase_ms = phase_ms

    def next_after(self, moment: datetime, /) -> datetime:
        after_ms = int(moment.timestamp() * 1000)
        ticks = (after_ms - self.phase_ms) // self.period_ms + 1
        return datetime.fromtimestamp((self.phase_ms + ticks * self.period_ms) / 1000, UTC)

    def __repr__(self) -> str:
        return f"Phased({self.period_ms}, {self.phase_ms})"


def schedule_for(period_ms: int, phase_ms: int) -> Any:
    # The cron path users take, where one exists.
    if phase_ms == 0 and period_ms == 1000:
        return "* * * * * *"
    if phase_ms == 0 and period_ms == 60_000:
        return "* * * * *"
    return Phased(period_ms, phase_ms)


async def open_client(kind: str, url: str, loop: str) -> tuple[Any, Any]:
    """The ``redis=`` value for a client kind, and how to close it afterwards."""
    if kind == "redis-py":
        return url, None  # anarchon opens (and closes) the connection itself
    if kind == "redis-py-cluster":  # asyncio only: redis-py's asyncio cluster client
        import redis.asyncio

        cluster: Any = redis.asyncio.RedisCluster.from_url(url, protocol=2)
        return cluster, cluster.aclose
    if kind == "valkey-py":
        if loop == "asyncio":
            import valkey.asyncio

            client: Any = valkey.asyncio.Valkey.from_url(url, protocol=2)
            return client, client.aclose
        import valkey

        sync_client = valkey.Valkey.from_url(url, protocol=2)
        return sync_client, lambda: anyio.to_thread.run_sync(sync_client.close)
    if kind == "glide":
        glide_client = await open_glide(url)
        return glide_client, glide_client.close
    raise SystemExit(f"unknown client {kind!r}")


class CollectorTime:
    """Process CPU time spent in Python's garbage collector so far. Its full collections
    come every second or two in a busy instance and cost tens of ms each, so whether a
    two-second phase holds one or two of them moves its CPU by several percent."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0

    def __call__(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.process_time()
        else:
            self.seconds += time.process_time() - self._began


async def alternate(
    scheduler: Any, phases: list[tuple[float, float, bool, float]], collector: CollectorTime
) -> None:
    """Watch ``scheduler`` (metrics and an events stream) every other two seconds, from
    half a second after a whole second (between its slots' instants): ``phases`` gets
    (time, process CPU time, watched from then on, of it in the collector) at each
    switch."""
    hub = Instance.of(scheduler).context.events
    (counting,) = hub.hooks  # what instrument() added; taken off while not watched
    hub.hooks.remove(counting)
    watched = False
    async with anyio.create_task_group() as group:
        while True:
            now = time.time()
            await anyio.sleep(int(now) + 2.5 - (int(now) % 2) - now)
            watched = not watched
            if watched:
                hub.hooks.append(counting)
                stream = scheduler.events()
                group.start_soon(consume, stream)
            else:
                hub.hooks.remove(counting)
                stream.close()
            phases.append((time.time(), time.process_time(), watched, collector.seconds))


def observe(scheduler: Any, what: str) -> None:
    """Metrics and spans of ``scheduler``, as ``what`` asks (see InstanceConfig)."""
    if what in ("watched", "all", "metrics", "alternate"):
        from prometheus_client import CollectorRegistry

        from anarchon.prometheus import instrument

        instrument(scheduler, CollectorRegistry())
    if what in ("all", "spans", "sampled"):
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        from anarchon.otel import instrument as trace

        sampler = ParentBased(TraceIdRatioBased(0.1 if what == "sampled" else 1.0))
        trace(scheduler, tracer_provider=TracerProvider(sampler=sampler))


async def consume(stream: Any) -> None:
    """Take every event of ``stream`` until the scheduler stops."""
    async with stream as events:
        async for _ in events:
            pass


def main() -> None:
    config = json.loads(sys.argv[1])
    runs: list[tuple[int, float, int]] = []
    samples: list[tuple[float, float]] = []
    phases: list[tuple[float, float, bool, float]] = []
    collector = CollectorTime()
    handler_ms = float(config["handler_ms"])
    events = bool(config["events"])

    async def handler(run: Run) -> None:
        started_ms = time.time() * 1000
        runs.append((run.slot_ms, round(started_ms, 2), run.attempt))
        if events:
            event = {"job": run.job, "slot_ms": run.slot_ms, "attempt": run.attempt}
            print(json.dumps({"event": "start", "t": started_ms / 1000, **event}), flush=True)
        if handler_ms < 0:
            await anyio.sleep_forever()
        elif handler_ms > 0:
            await anyio.sleep(handler_ms / 1000)

    schedule = schedule_for(config["period_ms"], config["phase_ms"])
    options: dict[str, Any] = {"instance_id": config["name"]}
    options["history_size"] = config["history_size"]
    if config["max_concurrent"] != "default":
        options["max_concurrent"] = config["max_concurrent"]
    for name in ("lease_ms", "heartbeat_ms", "stop_grace_ms"):
        if config[name] is not None:
            options[name] = config[name]
    job_names = [f"job{index:05d}" for index in range(config["jobs"])]

    async def sample_cpu() -> None:
        while True:
            samples.append((time.time(), time.process_time()))
            await anyio.sleep(0.25)

    async def run_for_a_while() -> None:
        redis_value, close = await open_client(config["client"], config["url"], config["loop"])
        backend: Any = RedisBackend(
            redis=redis_value, prefix=config["prefix"], strategy=config["strategy"]
        )
        scheduler: Any = Scheduler(backend, **options)
        for name in job_names:
            scheduler.add_job(handler, schedule, name=name)
        observe(scheduler, config["observe"])
        print(json.dumps({"ready": True}), flush=True)
        window = json.loads(await anyio.to_thread.run_sync(sys.stdin.readline))
        if "phase_ms" in window:  # the slot instant, chosen once every instance is ready
            schedule.phase_ms = window["phase_ms"]
        await anyio.sleep(window["start_at"] - time.time())
        async with anyio.create_task_group() as group:
            group.start_soon(sample_cpu)
            if config["observe"] in ("watched", "all", "events"):
                group.start_soon(consume, scheduler.events())
            if config["observe"] == "alternate":
                gc.callbacks.append(collector)
                group.start_soon(alternate, scheduler, phases, collector)
            # SIGTERM: a graceful stop before end_at (leases given back, as on a deploy).
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                async with scheduler:
                    with anyio.move_on_after(window["end_at"] - time.time()):
                        async for _ in signals:
                            break
            samples.append((time.time(), time.process_time()))
            group.cancel_scope.cancel()
        if close is not None:
            await close()

    anyio.run(run_for_a_while, backend=config["loop"])
    result = {"name": config["name"], "runs": runs, "cpu": samples, "phases": phases}
    print(json.dumps({"result": result}))


if __name__ == "__main__":
    main()
