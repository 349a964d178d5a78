"""The scenarios: each takes the server URL (None: start its own) and the mode, returns a
JSON-able result, and has a Markdown rendering of it."""

from __future__ import annotations

import bisect
import itertools
import secrets
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import anyio

from anarchon._store.contract import AttemptEnd, ClaimRequest
from anarchon._store.keys import JobKeys
from anarchon._store.lease import LeaseStore
from anarchon.clients import open_connection
from bench.backpressure import markdown_backpressure, scenario_backpressure
from bench.common import (
    KEEP_MS,
    CommandLog,
    Fleet,
    InstanceConfig,
    bytes_between,
    cpu_at,
    kill_the_runner,
    median,
    new_prefix,
    raw_client_ceiling,
    redis_client,
    round_trip_ms,
    run_instances,
    server,
    server_ceiling,
    server_info,
    server_name,
    summary_ms,
    timer_floor_ms,
)
from bench.kit import markdown_kit, scenario_kit
from bench.servercost import PARTS, per_decided_slot, sampled_nodes_cpu, script_costs
from bench.timers import markdown_timers, scenario_timers

Result = dict[str, Any]


@dataclass(frozen=True)
class Mode:
    """How big a run is: ``full`` (the published numbers), ``quick`` (small sizes, for
    people who want numbers in minutes) or ``smoke`` (each scenario at its smallest
    size, for CI: every scenario runs, numbers are printed, none is checked)."""

    name: Literal["smoke", "quick", "full"]

    @property
    def quick(self) -> bool:
        return self.name != "full"

    def pick(self, quick: Any, full: Any, smoke: Any = None) -> Any:
        """The size for this mode; ``smoke`` defaults to the first of ``quick``'s sizes
        (a list) or ``quick`` itself."""
        if self.name == "full":
            return full
        if self.name == "quick":
            return quick
        if smoke is not None:
            return smoke
        return quick[:1] if isinstance(quick, list) else quick


# ------------------------------------------------------------------ load runs


def run_load(
    url: str,
    instances: int,
    jobs: int,
    seconds: float,
    *,
    loop: str = "asyncio",
    client: str = "redis-py",
    strategy: str = "lease",
    warmup_sec: float = 2.0,
    observe: str = "off",
    nodes: Sequence[str] = (),
) -> Result:
    """``instances`` processes each scheduling the same ``jobs`` jobs every second.

    Measured over a window after ``warmup_sec`` (connections, script loading):
    decided slots per second (runs started in the window), the lateness of the
    runs of slots in the window (slot instant to handler start), the CPU time of all
    instances per decided slot, and the server's. ``nodes``: the URLs of a cluster's
    primaries (``url`` is one of them, and ``client`` a cluster client): the server's
    CPU is then each node's, and their sum."""
    prefix = new_prefix("load")
    configs = [
        InstanceConfig(
            url,
            prefix,
            f"i{i}",
            jobs,
            loop=loop,
            client=client,
            strategy=strategy,
            observe=observe,
        )
        for i in range(instances)
    ]
    with sampled_nodes_cpu(nodes or [url]) as node_samples:
        results, start_at, end_at, logged = run_instances(configs, seconds)
    w0, w1 = start_at + warmup_sec, end_at - 0.1
    first_slot = int(w0) + 1
    last_slot = int(end_at - 1.0)  # slots at least a second before the end
    slots = range(first_slot, last_slot + 1)
    late: list[float] = []
    started_in_window = 0
    for result in results:
        for slot_ms, start_ms, _attempt in result["runs"]:
            if first_slot * 1000 <= slot_ms <= last_slot * 1000:
                late.append(start_ms - slot_ms)
            started_in_window += w0 * 1000 <= start_ms <= w1 * 1000
    cpu_sec = sum(cpu_at(r["cpu"], w1) - cpu_at(r["cpu"], w0) for r in results)
    node_sec = [cpu_at(samples, w1) - cpu_at(samples, w0) for samples in node_samples]
    server_sec = sum(node_sec)
    decided_per_sec = started_in_window / (w1 - w0)
    offered = jobs * len(slots)
    return {
        "instances": instances,
        "jobs": jobs,
        "loop": loop,
        "client": client,
        "strategy": strategy,
        "seconds": seconds,
        "offered_per_sec": float(jobs),
        "decided_per_sec": decided_per_sec,
        "ran_in_time": len(late) / offered if offered else float("nan"),
        "cpu_us_per_slot": cpu_sec / started_in_window * 1e6 if started_in_window else None,
        "cpu_core_share": cpu_sec / (w1 - w0),
        "server_us_per_slot": (server_sec / started_in_window * 1e6 if started_in_window else None),
        "server_core_share": server_sec / (w1 - w0),
        # The busiest server process's share: what bounds the decided slots it can take.
        "busiest_node_us_per_slot": (
            max(node_sec) / started_in_window * 1e6 if started_in_window else None
        ),
        **summary_ms(late),
        "log_lines": len(logged),
        "log_sample": logged[:3],
    }


# ------------------------------------------------------------------ 1: throughput


def scenario_throughput(url: str | None, mode: Mode) -> Result:
    """Decided slots per second as the jobs per second rise until it saturates, next
    to the raw client ceiling (same claim script, same library, same number of
    processes, pipelined; the median of several samples) and the server ceiling
    (valkey-benchmark), all in this run; with the server's CPU per decided slot, and
    each lease script's cost measured apart."""
    fleet_sizes = mode.pick([1, 4], [1, 2, 4], smoke=[1])
    # Doubling until decided < 0.9 x offered: the best row is then the capacity, not
    # the offered load.
    loads = mode.pick(
        [2000, 4000, 8000, 16_000, 32_000], [1000, 2000, 5000, 10_000, 20_000, 40_000], [1000]
    )
    seconds = mode.pick(5, 12)
    rows = []
    ceilings = []
    with server(url) as live:
        server_ceil = server_ceiling(live, mode.pick(100_000, 400_000), clients=1)
        scripts = script_costs(live, mode.pick(5000, 20_000, 1000))
        for instances in fleet_sizes:
            raw = raw_client_ceiling(
                live, "redis-py", instances, mode.pick(5000, 20_000), samples=mode.pick(5, 7, 3)
            )
            ceilings.append(raw)
            server_slots = (
                server_ceil["claims_per_sec"] / instances if server_ceil["claims_per_sec"] else None
            )
            for jobs in loads:
                row = run_load(live, instances, jobs, seconds)
                row["raw_slots_per_sec"] = raw["slots_per_sec"]
                row["ratio"] = row["decided_per_sec"] / raw["slots_per_sec"]
                # A decided slot is a claim from each instance and the winner's finish.
                row["cap_per_sec"] = raw["slots_per_sec"] / (1 + 1 / instances)
                row["efficiency"] = row["decided_per_sec"] / row["cap_per_sec"]
                row["server_slots_per_sec"] = server_slots
                row["server_ratio"] = (
                    row["decided_per_sec"] / server_slots if server_slots else None
                )
                cpu = row["cpu_us_per_slot"]
                floor_us = (instances + 1) * raw["cpu_us_per_claim"]
                row["cpu_floor_us_per_slot"] = floor_us
                row["overhead"] = cpu / floor_us if cpu is not None else None
                row["saturated"] = row["decided_per_sec"] < 0.9 * jobs
                rows.append(row)
                print(f"  throughput {instances}x{jobs}: {_short(row)}", flush=True)
                if row["saturated"]:
                    break  # more load only queues
        name = server_name(live)
    best: dict[int, Result] = {}
    for row in rows:
        key = row["instances"]
        if key not in best or row["decided_per_sec"] > best[key]["decided_per_sec"]:
            best[key] = row
    saturation = []
    for row in best.values():
        n = row["instances"]
        saturation.append(
            {
                **row,
                "saturated": any(r["saturated"] for r in rows if r["instances"] == n),
                "server_script_us_per_slot": per_decided_slot(scripts, n, "script_us"),
                "server_calls_us_per_slot": per_decided_slot(scripts, n, "server_us"),
            }
        )
    return {
        "server": name,
        "server_ceiling": server_ceil,
        "raw_ceilings": ceilings,
        "scripts": scripts,
        "rows": rows,
        "saturation": saturation,
    }


def _short(row: Result) -> str:
    cpu = row.get("cpu_us_per_slot")
    server_us = row.get("server_us_per_slot")
    return (
        f"decided={row['decided_per_sec']:.0f}/s p50={row['p50_ms']:.1f} ms "
        f"p99={row['p99_ms']:.1f} ms cpu={cpu if cpu is None else round(cpu)} us/slot"
        f" server={server_us if server_us is None else round(server_us, 1)} us/slot"
        + (f" efficiency={row['efficiency']:.2f}" if "efficiency" in row else "")
        + (f" overhead={row['overhead']:.2f}" if row.get("overhead") else "")
        + (f" ({row['log_lines']} log lines: {row['log_sample'][0]})" if row["log_lines"] else "")
    )


def markdown_throughput(result: Result) -> str:
    ceil = result["server_ceiling"]
    lines = [
        f"Server: {result['server']}. Server ceiling: "
        + (
            f"{ceil['claims_per_sec']:,.0f} claims/s ({ceil['tool']}, pipeline 100)"
            if ceil["claims_per_sec"]
            else f"not measured ({ceil['reason']})"
        ),
        "",
        "| processes | raw client ceiling, slots/s (median) | samples | claims/s | CPU us/claim |",
        "| --- | --- | --- | --- | --- |",
    ]
    for raw in result["raw_ceilings"]:
        samples = ", ".join(f"{value:,.0f}" for value in raw.get("samples", []))
        lines.append(
            f"| {raw['processes']} | {raw['slots_per_sec']:,.0f} | {samples} "
            f"| {raw['claims_per_sec']:,.0f} | {raw['cpu_us_per_claim']:.1f} |"
        )
    lines += [
        "",
        "| instances x jobs/s | decided/s | efficiency | overhead | p50 ms | p99 ms "
        "| CPU us/slot | server us/slot |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['instances']} x {row['jobs']} | {row['decided_per_sec']:,.0f} "
            f"| {row['efficiency']:.2f} | {_num(row['overhead'], '.2f')}x | {row['p50_ms']:.1f} "
            f"| {row['p99_ms']:.1f} | {_num(row['cpu_us_per_slot'], '.0f')} "
            f"| {_num(row['server_us_per_slot'], '.1f')} |"
        )
    lines += [
        "",
        "Each lease script apart (server CPU per call from `INFO cpu`, and the time inside "
        "the script from `INFO commandstats`):",
        "",
        "| script | calls | server us/call | in the script us/call |",
        "| --- | --- | --- | --- |",
    ]
    for name in PARTS:
        part = result["scripts"][name]
        lines.append(
            f"| {name} | {part['calls']:,} | {_num(part['server_us'], '.1f')} "
            f"| {_num(part['script_us'], '.1f')} |"
        )
    for row in result["saturation"]:
        server_us = row["server_us_per_slot"]
        per_core = 1e6 / server_us if server_us else None
        lines.append(
            f"\n{row['instances']} instance(s): ratio={row['ratio']:.2f} "
            f"efficiency={row['efficiency']:.2f} overhead={_num(row['overhead'], '.2f')} "
            f"saturated={'yes' if row['saturated'] else 'no'} "
            f"(best {row['decided_per_sec']:,.0f} decided slots/s of a cap of "
            f"{row['cap_per_sec']:,.0f}; CPU {_num(row['cpu_us_per_slot'], '.0f')} us/slot "
            f"against a floor of {row['cpu_floor_us_per_slot']:.0f}); "
            f"server {_num(server_us, '.1f')} us per decided slot "
            f"({_num(per_core, ',.0f')} decided slots/s per server core; the scripts alone "
            f"{_num(row['server_calls_us_per_slot'], '.1f')} us, inside them "
            f"{_num(row['server_script_us_per_slot'], '.1f')} us)"
        )
    return "\n".join(lines)


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


# ------------------------------------------------------------------ 2: latency


def floors(url: str, samples: int) -> Result:
    floor = timer_floor_ms(samples)
    return {
        "timer_floor_ms": {"median": median(floor), "max": max(floor)},
        "round_trip_ms": round_trip_ms(url),
    }


def scenario_latency(url: str | None, mode: Mode) -> Result:
    """Slot instant to handler start at several loads, with the floors of this run."""
    # 3 x 10: three instances of ten jobs each, a small fleet of every-second jobs.
    loads = mode.pick([(1, 10), (4, 100)], [(1, 10), (3, 10), (4, 100), (8, 1000)])
    seconds = mode.pick(5, 20)
    with server(url) as live:
        result = floors(live, mode.pick(3, 10))
        rows = []
        for instances, jobs in loads:
            row = run_load(live, instances, jobs, seconds)
            rows.append(row)
            print(f"  latency {instances}x{jobs}: {_short(row)}", flush=True)
        result["loads"] = rows
    return result


def markdown_latency(result: Result) -> str:
    lines = [
        f"Floors: a bare event-loop sleep to the next whole second wakes "
        f"{result['timer_floor_ms']['median']:.2f} ms late (median; max "
        f"{result['timer_floor_ms']['max']:.2f} ms); one loopback round trip "
        f"{result['round_trip_ms']:.3f} ms.",
        "",
        "| instances x jobs/s | runs | p50 ms | p95 ms | p99 ms | max ms | p50 - timer floor |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["loads"]:
        lines.append(
            f"| {row['instances']} x {row['jobs']} | {row['count']} | {row['p50_ms']:.2f} "
            f"| {row['p95_ms']:.2f} | {row['p99_ms']:.2f} | {row['max_ms']:.2f} "
            f"| {row['p50_ms'] - result['timer_floor_ms']['median']:+.2f} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ 3: cost per run


def _redis_86() -> Path | None:
    """A Redis 8.6 server (idempotent XADD) found the way the tests find servers."""
    from tests.servers import discover_servers

    for spec in discover_servers():
        if spec.family == "redis" and spec.version >= (8, 6) and spec.binary is not None:
            return spec.binary
    return None


def _cost_variant(url: str | None, variant: Result, seconds: float, binary: Path | None) -> Result:
    """One strategy on a server of its own: commands and bytes per run over whole seconds."""
    with server(url, binary) as live:
        log = CommandLog(live)
        prefix = new_prefix("cost")
        configs = [
            InstanceConfig(
                live,
                prefix,
                f"i{i}",
                variant["jobs"],
                strategy=variant["strategy"],
                lease_ms=variant.get("lease_ms"),
                heartbeat_ms=variant.get("heartbeat_ms"),
                handler_ms=variant.get("handler_ms", 0),
            )
            for i in range(variant["instances"])
        ]
        with Fleet([c.argv() for c in configs]) as fleet:
            start_at, _ = fleet.start_soon(seconds + 3.5)
            # The window starts 0.8 s after a whole second, when every command of the
            # slot before is done, and spans whole seconds.
            t_a = int(start_at) + 2.8
            t_b = t_a + seconds
            time.sleep(max(0.0, t_a - time.time()))
            bytes_a = log.client_bytes()
            time.sleep(max(0.0, t_b - time.time()))
            bytes_b = log.client_bytes()
            results = fleet.results()
        log.close()
        counts = log.counts(t_a, t_b)
    runs = sum(
        1 for r in results for slot_ms, _, _ in r["runs"] if t_a * 1000 < slot_ms < t_b * 1000
    )
    read, written = bytes_between(bytes_a, bytes_b)
    per_command = {name: count / runs for name, count in counts.items()}
    return {
        **variant,
        "runs": runs,
        "commands_per_run": sum(per_command.values()),
        "per_command": per_command,
        "bytes_in_per_run": read / runs,
        "bytes_out_per_run": written / runs,
    }


def scenario_cost(url: str | None, mode: Mode) -> Result:
    """Server commands and bytes per run for each strategy, 3 instances x 10 jobs every
    second, each strategy on a server of its own (run side by side)."""
    seconds = mode.pick(4, 10)
    base = {"instances": 3, "jobs": 10}
    variants: list[Result] = [
        {**base, "strategy": "lease", "label": "lease"},
        {
            **base,
            "strategy": "lease",
            "label": "lease, 500 ms handler, heartbeat 200 ms",
            "lease_ms": 1000,
            "heartbeat_ms": 200,
            "handler_ms": 500,
        },
        {**base, "strategy": "script", "label": "script"},
        {**base, "strategy": "stream-id", "label": "stream-id"},
    ]
    redis86 = None if url is not None else _redis_86()
    skipped = []
    if redis86 is not None:
        variants.append({**base, "strategy": "idmp", "label": "idmp (Redis 8.6)"})
    else:
        skipped.append(
            "idmp: needs Redis 8.6+ (python -m tests.build_servers redis-8.6)"
            if url is None
            else "idmp: not measured on a given --redis server"
        )
    binaries = [redis86 if v["strategy"] == "idmp" else None for v in variants]
    # Each strategy on a server of its own, side by side; one at a time on a given server.
    with ThreadPoolExecutor(len(variants) if url is None else 1) as pool:
        rows = list(
            pool.map(
                lambda vb: _cost_variant(url, vb[0], seconds, vb[1]),
                zip(variants, binaries, strict=True),
            )
        )
    for row in rows:
        # Lease: a claim per instance and a finish; claim-only: a claim per instance and
        # the result write.
        expected = row["instances"] + 1
        if row.get("handler_ms"):
            expected += int(row["handler_ms"] // row["heartbeat_ms"])
        row["target_commands"] = expected
    return {"rows": rows, "skipped": skipped}


def markdown_cost(result: Result) -> str:
    lines = [
        "| strategy (3 instances x 10 jobs/s) | runs | commands/run | target | "
        "commands | bytes in/run | bytes out/run |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        detail = ", ".join(f"{name} {count:.2f}" for name, count in row["per_command"].items())
        lines.append(
            f"| {row['label']} | {row['runs']} | {row['commands_per_run']:.2f} "
            f"| {row['target_commands']} | {detail} | {row['bytes_in_per_run']:,.0f} "
            f"| {row['bytes_out_per_run']:,.0f} |"
        )
    for reason in result["skipped"]:
        lines.append(f"\nNot measured: {reason}")
    return "\n".join(lines)


# ------------------------------------------------------------------ 4: takeover


def _takeover_trial(url: str, lease_ms: int, heartbeat_ms: int, how: str) -> Result:
    prefix = new_prefix("take")
    configs = [
        InstanceConfig(url, prefix, f"i{i}", 1, period_ms=3_600_000, phase_ms=1,
                       lease_ms=lease_ms, heartbeat_ms=heartbeat_ms, stop_grace_ms=0,
                       handler_ms=-1, events=True)
        for i in range(2)
    ]  # fmt: skip
    with Fleet([c.argv() for c in configs]) as fleet:
        fleet.wait_ready()
        start_at = time.time() + 0.5
        # The job's one slot: a second after both instances run.
        fleet.go(start_at, start_at + 600, phase_ms=int((start_at + 1) * 1000))
        return kill_the_runner(fleet, heartbeat_ms, lease_ms, signal.Signals[how])


def scenario_takeover(url: str | None, mode: Mode) -> Result:
    """SIGKILL of the instance running a slot to attempt 2 starting on the backup (at
    lease expiry); and SIGTERM (a graceful stop that gives the run back and tells the
    backups on the hint channel) with a 30 s lease, to attempt 2 starting."""
    pairs = mode.pick([(1000, 250), (2000, 500)], [(1000, 250), (2000, 500), (5000, 1000),
                                                   (10_000, 2500)])  # fmt: skip
    cases = [(lease, hb, "SIGKILL") for lease, hb in pairs] + [(30_000, 1000, "SIGTERM")]
    trials = mode.pick(2, 4, smoke=1)
    with server(url) as live:
        jobs = [case for case in cases for _ in range(trials)]
        # Trials run side by side (each a pair of processes on a prefix of its own).
        with ThreadPoolExecutor(len(jobs)) as pool:
            outcomes = list(pool.map(lambda case: _takeover_trial(live, *case), jobs))
    rows = []
    for case in cases:
        lease_ms, heartbeat_ms, how = case
        times = [
            o["takeover_ms"]
            for job, o in zip(jobs, outcomes, strict=True)
            if job == case and o["takeover_ms"] is not None
        ]
        rows.append(
            {
                "stop": how,
                "lease_ms": lease_ms,
                "heartbeat_ms": heartbeat_ms,
                "trials": trials,
                "takeovers": len(times),
                "times_ms": times,
                "median_ms": median(times),
                "max_ms": max(times) if times else None,
                # SIGKILL: the lease runs out first. SIGTERM: without the hint, the
                # backup would wait for the lease it knew of, so the lease is the bound.
                "bound_ms": lease_ms + heartbeat_ms + 100 if how == "SIGKILL" else lease_ms,
            }
        )
    return {"rows": rows}


def markdown_takeover(result: Result) -> str:
    lines = [
        "| stop | lease_ms | heartbeat_ms | takeovers | median ms | max ms | bound ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row.get('stop', 'SIGKILL')} | {row['lease_ms']} | {row['heartbeat_ms']} "
            f"| {row['takeovers']}/{row['trials']} | {_num(row['median_ms'], '.1f')} "
            f"| {_num(row['max_ms'], '.1f')} | {row['bound_ms']} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ 5: idle cost


def scenario_idle(url: str | None, mode: Mode) -> Result:
    """Process CPU of one instance per minute with jobs at a one-minute cadence."""
    sizes = [1000, 10_000]
    seconds = mode.pick(12, 63)
    lead_sec = 2.0
    with server(url) as live:
        configs = [
            InstanceConfig(live, new_prefix("idle"), f"i{jobs}", jobs, period_ms=60_000,
                           phase_ms=1)
            for jobs in sizes
        ]  # fmt: skip
        # Both sizes run side by side (process CPU time hardly depends on what else
        # runs); the minute's instant falls 2 s into the run.
        with Fleet([c.argv() for c in configs]) as fleet:
            fleet.wait_ready()
            start_at = time.time() + 0.5
            fire_ms = int((start_at + lead_sec) * 1000)
            fleet.go(start_at, start_at + seconds, phase_ms=fire_ms)
            results = fleet.results()
    rows = []
    fire = fire_ms / 1000
    for jobs, result in zip(sizes, results, strict=True):
        samples = result["cpu"]
        span_end = min(fire + 59, start_at + seconds - 0.1)
        span_cpu = cpu_at(samples, span_end) - cpu_at(samples, fire - 1)
        # Between instants: from a second after the instant's last handler started.
        last_start = max((start_ms / 1000 for _, start_ms, _ in result["runs"]), default=fire)
        quiet_from = max(fire + 2, last_start + 1)
        # ... to before the next minute's instant (full mode runs up to it).
        quiet_end = min(start_at + seconds - 0.1, fire + 59)
        if quiet_end - quiet_from < 1:
            # The instant outlasted the window (quick mode with many jobs): measure
            # the quiet part over the last second, an overestimate.
            quiet_from = quiet_end - 1
        idle_rate = (cpu_at(samples, quiet_end) - cpu_at(samples, quiet_from)) / (
            quiet_end - quiet_from
        )
        measured_sec = span_end - (fire - 1)
        per_minute = span_cpu + idle_rate * max(0.0, 60 - measured_sec)
        rows.append(
            {
                "jobs": jobs,
                "runs": len(result["runs"]),
                "measured_sec": measured_sec,
                "cpu_sec_per_minute": per_minute,
                "core_percent": per_minute / 60 * 100,
                "idle_cpu_ms_per_sec": idle_rate * 1000,
                "firing_cpu_sec": span_cpu - idle_rate * measured_sec,
            }
        )
    return {"rows": rows}


def markdown_idle(result: Result) -> str:
    lines = [
        "| jobs (every minute) | measured s | CPU s/minute | % of a core | CPU ms/s between "
        "instants | CPU s per instant |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['jobs']:,} | {row['measured_sec']:.0f} | {row['cpu_sec_per_minute']:.3f} "
            f"| {row['core_percent']:.2f} | {row['idle_cpu_ms_per_sec']:.2f} "
            f"| {row['firing_cpu_sec']:.3f} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ 6: memory


async def _drive_runs(url: str, prefix: str, jobs: int, runs: int, history_size: int) -> None:
    """``runs`` claim + finish pairs per job through the lease store, as the scheduler
    makes them: the claims of one instant in one batch, the finishes side by side."""
    conn = open_connection(url)
    store = LeaseStore(
        conn, prefix=prefix, runner="mem", history_size=history_size, history_ttl_ms=None,
        trim_runs_by_id=True,
    )  # fmt: skip
    names = [f"job{i:03d}" for i in range(jobs)]
    first_ms = int(time.time() * 1000) - runs * 1000
    for k in range(runs):
        slot_ms = first_ms + k * 1000
        requests = [
            ClaimRequest(name, str(slot_ms), slot_ms, secrets.token_hex(8), "schedule",
                         lease_ms=30_000, max_attempts=3, keep_ms=KEEP_MS)
            for name in names
        ]  # fmt: skip
        replies = await store.claim_many(requests)
        async with anyio.create_task_group() as group:
            for request, reply in zip(requests, replies, strict=True):
                assert not isinstance(reply, Exception) and reply.kind == "won", reply
                end = AttemptEnd(
                    request.job, request.slot_id, request.token, reply.attempt, "schedule",
                    reply.fence, slot_ms, slot_ms + 1, "ok", None, 3, 1000,
                )  # fmt: skip
                group.start_soon(store.finish, end)
    await conn.aclose()


def scenario_memory(url: str | None, mode: Mode) -> Result:
    """Server memory per job after many runs of each job, per history_size."""
    jobs = 10
    runs = mode.pick(1500, 10_000)
    rows = []
    for history_size in (1000, 100):
        with server(url) as live:
            client = redis_client(live)
            before = int(server_info(live, "memory")["used_memory"])
            prefix = new_prefix("mem")
            anyio.run(_drive_runs, live, prefix, jobs, runs, history_size)
            after = int(server_info(live, "memory")["used_memory"])
            keys = JobKeys.for_job(prefix, "job000")
            per_key = {
                name: int(client.memory_usage(getattr(keys, name), samples=0) or 0)
                for name in ("state", "active", "slots", "runs", "results")
            }
            sizes = {
                "state": client.hlen(keys.state),
                "slots": client.zcard(keys.slots),
                "runs": client.xlen(keys.runs),
                "results": client.zcard(keys.results),
            }
            client.close()
        rows.append(
            {
                "history_size": history_size,
                "jobs": jobs,
                "runs_per_job": runs,
                "bytes_per_job": (after - before) / jobs,
                "key_bytes": per_key,
                "entries": sizes,
            }
        )
        print(f"  memory history_size={history_size}: {rows[-1]['bytes_per_job']:,.0f} B/job")
    return {"rows": rows}


def markdown_memory(result: Result) -> str:
    lines = [
        "| history_size | runs per job | bytes per job | per key (MEMORY USAGE) | entries |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        keys = ", ".join(f"{k} {v:,}" for k, v in row["key_bytes"].items())
        entries = ", ".join(f"{k} {v:,}" for k, v in row["entries"].items())
        lines.append(
            f"| {row['history_size']} | {row['runs_per_job']:,} | {row['bytes_per_job']:,.0f} "
            f"| {keys} | {entries} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ 7: scaling


def scenario_scaling(url: str | None, mode: Mode) -> Result:
    """Throughput and p99 latency against jobs, instances, event loop and client, and
    strategy; each point a run of its own."""
    seconds = mode.pick(4, 10)
    curves: dict[str, list[Result]] = {}
    plan: dict[str, list[dict[str, Any]]] = {
        "jobs": [
            {"instances": 1, "jobs": j}
            for j in mode.pick([10, 1000], [10, 100, 1000, 3000, 10_000])
        ],
        "instances": [
            {"instances": i, "jobs": mode.pick(100, 1000)}
            for i in mode.pick([1, 4], [1, 2, 4, 8, 16])
        ],
        "clients": [
            {"instances": 1, "jobs": 1000, "loop": loop, "client": client}
            for loop, client in mode.pick(
                [("trio", "glide")],
                [(x, c) for x in ("asyncio", "trio") for c in ("redis-py", "glide", "valkey-py")],
            )
        ],
        "strategies": [
            {"instances": 2, "jobs": 1000, "strategy": s}
            for s in mode.pick(["script"], ["lease", "script", "stream-id", "idmp"])
        ],
    }
    redis86 = _redis_86() if url is None else None
    for curve, points in plan.items():
        rows = curves.setdefault(curve, [])
        for point in points:
            binary = redis86 if point.get("strategy") == "idmp" else None
            if point.get("strategy") == "idmp" and binary is None:
                continue
            with server(url, binary) as live:
                row = run_load(live, seconds=seconds, **point)
            rows.append(row)
            print(f"  scaling {curve} {_label(row)}: {_short(row)}", flush=True)
    cluster = _cluster_against_one(mode) if url is None else {"skipped": "--redis given"}
    return {"curves": curves, "cluster": cluster}


def _cluster_against_one(mode: Mode) -> Result:
    """The same load on one primary and on a three-primary cluster of the same Valkey,
    the jobs spread over the cluster's hash slots (a job's keys share one tag, so each
    job lives on one node). Each row gives the decided slots per second of both, and
    the server CPU per decided slot of the busiest node: its inverse is the decided
    slots per second that node's one core can take, so the ratio of the two servers'
    figures is how far the cluster scales the server side. On a shared 2-core machine the
    instances saturate the CPUs long before one server core does, so decided/s cannot
    show that scaling by itself."""
    from tests.servers import discover_servers, running_cluster, stop_all

    specs = [s for s in discover_servers() if s.family == "valkey" and s.binary is not None]
    if not specs:
        return {"skipped": "no Valkey binary for a cluster"}
    spec = specs[0]
    seconds = mode.pick(5, 10, smoke=4)
    points = mode.pick([(2, 1000), (4, 1000)], [(2, 1000), (4, 1000), (4, 2000)], smoke=[(2, 100)])
    rows = []
    try:
        nodes = [f"redis://127.0.0.1:{port}" for port in running_cluster(spec)]
        for instances, jobs in points:
            with server(None, spec.binary) as one:
                single = run_load(one, instances, jobs, seconds)
            spread = run_load(
                nodes[0], instances, jobs, seconds, client="redis-py-cluster", nodes=nodes
            )
            one_us, busiest_us = (
                single["busiest_node_us_per_slot"],
                spread["busiest_node_us_per_slot"],
            )
            row = {
                "instances": instances,
                "jobs": jobs,
                "one": single,
                "cluster": spread,
                "capacity_ratio": one_us / busiest_us if one_us and busiest_us else None,
            }
            rows.append(row)
            print(
                f"  scaling cluster {instances}x{jobs}: one primary {_short(single)}; "
                f"3 primaries {_short(spread)}; busiest node "
                f"{_num(one_us, '.0f')} -> {_num(busiest_us, '.0f')} us/slot, capacity "
                f"x{_num(row['capacity_ratio'], '.2f')}",
                flush=True,
            )
    finally:
        stop_all()
    return {"server": spec.id, "rows": rows}


def _label(row: Result) -> str:
    return f"{row['instances']}x{row['jobs']} {row['loop']} {row['client']} {row['strategy']}"


def markdown_scaling(result: Result) -> str:
    lines = [
        "| curve | instances x jobs/s | event loop | client | strategy | decided/s | p50 ms "
        "| p99 ms | CPU us/slot |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for curve, rows in result["curves"].items():
        for row in rows:
            lines.append(
                f"| {curve} | {row['instances']} x {row['jobs']} | {row['loop']} "
                f"| {row['client']} | {row['strategy']} | {row['decided_per_sec']:,.0f} "
                f"| {row['p50_ms']:.1f} | {row['p99_ms']:.1f} "
                f"| {_num(row['cpu_us_per_slot'], '.0f')} |"
            )
    cluster = result.get("cluster", {})
    if cluster.get("rows"):
        lines += [
            "",
            f"One primary against a three-primary cluster ({cluster['server']}), the jobs "
            "spread over its hash slots. Server capacity: the decided slots per second "
            "one core of the busiest node can take (1 / its CPU per decided slot).",
            "",
            "| instances x jobs/s | decided/s: one, cluster | busiest node us/slot: one, "
            "cluster | server capacity: one, cluster | ratio |",
            "| --- | --- | --- | --- | --- |",
        ]
        for row in cluster["rows"]:
            one, spread = row["one"], row["cluster"]
            busiest = [r["busiest_node_us_per_slot"] for r in (one, spread)]
            capacity = [_num(1e6 / us if us else None, ",.0f") for us in busiest]
            lines.append(
                f"| {row['instances']} x {row['jobs']} | {one['decided_per_sec']:,.0f}, "
                f"{spread['decided_per_sec']:,.0f} | {_num(busiest[0], '.0f')}, "
                f"{_num(busiest[1], '.0f')} | {capacity[0]}, {capacity[1]} "
                f"| {_num(row['capacity_ratio'], '.2f')} |"
            )
    elif cluster:
        lines += ["", f"Cluster: skipped ({cluster.get('skipped')})."]
    return "\n".join(lines)


# ------------------------------------------------------------------ registry


@dataclass(frozen=True)
class Scenario:
    run: Callable[[str | None, Mode], Result]
    markdown: Callable[[Result], str]


# ------------------------------------------------------------------ observe


def _side_by_side(url: str, observes: Sequence[str], seconds: float) -> list[Result]:
    """One instance per entry of ``observes``, each with 1000 jobs every second under a
    prefix of its own, all at once (so that the machine's state is the same for each):
    each one's runs per second and process CPU per run, after 2 s of warm-up."""
    configs = [
        InstanceConfig(url, new_prefix("observe"), f"{what}{i}", 1000, observe=what)
        for i, what in enumerate(observes)
    ]
    results, start_at, end_at, _ = run_instances(configs, seconds)
    w0, w1 = start_at + 2.0, end_at - 0.1
    rows = []
    for what, result in zip(observes, results, strict=True):
        started = sum(w0 * 1000 <= start_ms <= w1 * 1000 for _, start_ms, _ in result["runs"])
        cpu_sec = cpu_at(result["cpu"], w1) - cpu_at(result["cpu"], w0)
        rows.append(
            {
                "observe": what,
                "decided_per_sec": started / (w1 - w0),
                "cpu_us_per_slot": cpu_sec / started * 1e6 if started else None,
            }
        )
    return rows


def _watching_in_isolation_us(runs: int = 30_000) -> float:
    """Process CPU µs per run of what watching adds to a run, alone, in this process:
    its three events made, counted for Prometheus, put in a stream and taken from it
    (as an ``async for`` does when events are waiting), over 1000 jobs."""
    from anarchon import Run
    from anarchon._observe.events import (
        EventHub,
        claim_answered,
        instant,
        run_finished,
        run_started,
    )
    from anarchon.prometheus import _Counts

    hub = EventHub()
    counts = _Counts()
    hub.hooks.append(counts.pending.append)  # as instrument() hooks it
    stream = hub.open(1000)
    slot = datetime.now(UTC)
    attempts = [
        Run(job=f"job{index % 1000:05d}", slot=slot, slot_ms=index * 1000, attempt=1,
            trigger="schedule", runner="bench", fence=index)
        for index in range(runs)
    ]  # fmt: skip

    def take() -> None:
        step = stream.__anext__()
        try:
            step.send(None)
        except StopIteration:
            return
        raise AssertionError("the stream waited with events in its buffer")

    began = time.process_time()
    for run in attempts:  # as the engine makes them
        hub.emit(claim_answered("bench", instant(time.time() * 1000), run.job, run.slot_ms, "won"))
        hub.emit(run_started("bench", instant(time.time() * 1000), run, 2.0))
        hub.emit(run_finished("bench", instant(time.time() * 1000), run, "ok", 0.1, None, False))
        take()
        take()
        take()
        if run.fence % 50 == 0:  # counted about every 50 ms at 1000 runs/s, as instances do
            counts.flush(wait=False)
    return (time.process_time() - began) / runs * 1e6


def scenario_observe(url: str | None, mode: Mode) -> Result:
    """Instance CPU per run at 1 instance x 1000 jobs/s with metrics and an events stream
    on ("watched") and off, in one instance that switches between the two every two
    seconds (so that both see the same machine, server and process): the ceiling is 5%
    more CPU per run watched than off. Then OpenTelemetry spans alone ("spans"), with
    one attempt in ten sampled ("sampled") and with the rest ("all"), each in an
    instance beside one with nothing on, at the same time."""
    with server(url) as live:
        config = InstanceConfig(live, new_prefix("observe"), "switching", 1000,
                                observe="alternate")  # fmt: skip
        (result,), start_at, _, _ = run_instances([config], mode.pick(24, 124, smoke=12))
        # Each beside an instance off of its own, a pair at a time: three or four
        # instances at 1000 jobs/s would fill this machine's two cores.
        beside = {
            what: dict(row, off_cpu_us_per_slot=off["cpu_us_per_slot"])
            for what in ("spans", "sampled", "all")
            for off, row in [_side_by_side(live, ("off", what), mode.pick(10, 10, smoke=4))]
        }
    starts = sorted(start_ms / 1000 for _, start_ms, _ in result["runs"])
    # (watched, CPU s, of it in the garbage collector, runs started) per phase
    per_phase: list[tuple[bool, float, float, int]] = []
    for (t0, c0, watched, g0), (t1, c1, _, g1) in itertools.pairwise(result["phases"]):
        if t0 >= start_at + 2:  # after the warm-up
            runs = bisect.bisect_left(starts, t1) - bisect.bisect_left(starts, t0)
            per_phase.append((watched, c1 - c0, g1 - g0, runs))
    per_run: dict[str, dict[bool, float | None]] = {"cpu": {}, "outside": {}, "collector": {}}
    for watched in (False, True):
        mine = [p for p in per_phase if p[0] == watched]
        runs = sum(p[3] for p in mine)
        cpu, collector = sum(p[1] for p in mine), sum(p[2] for p in mine)
        for name, seconds in (("cpu", cpu), ("outside", cpu - collector), ("collector", collector)):
            per_run[name][watched] = seconds / runs * 1e6 if runs else None
    # Each watched phase against the phases off on either side of it: the spread, and
    # the median, which one phase with an extra full collection does not move.
    ratios: dict[str, list[float]] = {"cpu": [], "outside": []}
    for index, (watched, cpu_sec, collector_sec, runs) in enumerate(per_phase):
        around = [p for p in per_phase[max(index - 1, 0) : index + 2] if not p[0]]
        if watched and runs and around and all(p[3] for p in around):
            off_runs = sum(p[3] for p in around)
            off_cpu = sum(p[1] for p in around) / off_runs
            off_outside = sum(p[1] - p[2] for p in around) / off_runs
            ratios["cpu"].append(cpu_sec / runs / off_cpu - 1)
            ratios["outside"].append((cpu_sec - collector_sec) / runs / off_outside - 1)

    def versus(name: str) -> float | None:
        on, off = per_run[name][True], per_run[name][False]
        return on / off - 1 if on and off else None

    return {
        "off_cpu_us_per_run": per_run["cpu"][False],
        "watched_cpu_us_per_run": per_run["cpu"][True],
        "watched_vs_off": versus("cpu"),
        "off_outside_collector_us_per_run": per_run["outside"][False],
        "watched_outside_collector_us_per_run": per_run["outside"][True],
        "watched_vs_off_outside_collector": versus("outside"),
        "off_collector_us_per_run": per_run["collector"][False],
        "watched_collector_us_per_run": per_run["collector"][True],
        "phases": len(per_phase),
        "runs": sum(p[3] for p in per_phase),
        "phase_ratios": ratios["cpu"],
        "median_phase_ratio": statistics.median(ratios["cpu"]) if ratios["cpu"] else None,
        "phase_ratio_interval": _interval(ratios["cpu"]),
        "phase_ratios_outside_collector": ratios["outside"],
        "median_phase_ratio_outside_collector": (
            statistics.median(ratios["outside"]) if ratios["outside"] else None
        ),
        "beside": beside,
        "isolated_us_per_run": _watching_in_isolation_us(),
        "ceiling": 0.05,
    }


def _interval(ratios: list[float]) -> tuple[float, float] | None:
    """About 95% of the time, the mean of many more phase pairs would fall in here (the
    mean ± 1.96 standard errors; neighbouring pairs share a phase off, so it is rough)."""
    if len(ratios) < 2:
        return None
    mean, error = statistics.fmean(ratios), statistics.stdev(ratios) / len(ratios) ** 0.5
    return mean - 1.96 * error, mean + 1.96 * error


def markdown_observe(result: Result) -> str:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value * 100:+.1f}%"

    def spread(ratios: list[float]) -> str:
        ratios = sorted(ratios)
        return f"{pct(ratios[0])} to {pct(ratios[-1])}" if ratios else "-"

    beside = result["beside"]
    isolated, off = result["isolated_us_per_run"], result["off_cpu_us_per_run"]

    def beside_row(what: str, name: str, ceiling: str = "") -> str:
        on, alone = beside[what]["cpu_us_per_slot"], beside[what]["off_cpu_us_per_slot"]
        return (
            f"| {name}, beside an instance off | {on:.0f} ({alone:.0f} off) "
            f"| {pct(on / alone - 1)} | | | | | | {ceiling} |"
        )

    bounds = result.get("phase_ratio_interval")
    interval = "-"
    if bounds:  # the mean is its middle
        interval = (
            f"is {pct((bounds[0] + bounds[1]) / 2)}, within {pct(bounds[0])} to "
            f"{pct(bounds[1])} at about 95%"
        )
    lines = [
        "| 1 x 1000 jobs/s | CPU µs per run | vs off | median of phase pairs | of it outside "
        "the garbage collector | vs off | median of phase pairs | in the collector | ceiling |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| off | {_num(result['off_cpu_us_per_run'], '.0f')} | | "
        f"| {_num(result['off_outside_collector_us_per_run'], '.0f')} | | "
        f"| {_num(result['off_collector_us_per_run'], '.0f')} | |",
        f"| watched: metrics and an events stream | "
        f"{_num(result['watched_cpu_us_per_run'], '.0f')} | **{pct(result['watched_vs_off'])}** "
        f"| {pct(result['median_phase_ratio'])} "
        f"| {_num(result['watched_outside_collector_us_per_run'], '.0f')} "
        f"| {pct(result['watched_vs_off_outside_collector'])} "
        f"| {pct(result['median_phase_ratio_outside_collector'])} "
        f"| {_num(result['watched_collector_us_per_run'], '.0f')} | +5% |",
        f"| what watching adds to a run, alone (made, counted, streamed, taken) | "
        f"{isolated:.1f} | {pct(isolated / off) if off else '-'} | | | | | | |",
        beside_row("spans", "OpenTelemetry spans (SDK) alone", "+10%"),
        beside_row("sampled", "spans, one attempt in ten sampled", "+10%"),
        beside_row("all", "all: metrics, an events stream and spans"),
        "",
        f"One instance, switching every 2 s: {result['phases']} phases, {result['runs']:,} "
        f"runs; each watched phase against the phases off around it: "
        f"{spread(result['phase_ratios'])} ({spread(result['phase_ratios_outside_collector'])} "
        f"outside the collector); their mean {interval}: one run is one sample of a noisy "
        "machine, so judge the ceiling from several. Off, no event is made; watched: "
        "anarchon.prometheus and a stream of every event, consumed. The collector's full "
        "collections come every second or two and cost tens of ms each: whether a phase holds "
        "one or two moves it by several percent, which the medians and the CPU outside the "
        "collector do not feel.",
    ]
    return "\n".join(lines)


SCENARIOS: dict[str, Scenario] = {
    "throughput": Scenario(scenario_throughput, markdown_throughput),
    "latency": Scenario(scenario_latency, markdown_latency),
    "cost": Scenario(scenario_cost, markdown_cost),
    "takeover": Scenario(scenario_takeover, markdown_takeover),
    "idle": Scenario(scenario_idle, markdown_idle),
    "memory": Scenario(scenario_memory, markdown_memory),
    "scaling": Scenario(scenario_scaling, markdown_scaling),
    "timers": Scenario(scenario_timers, markdown_timers),
    "observe": Scenario(scenario_observe, markdown_observe),
    "backpressure": Scenario(scenario_backpressure, markdown_backpressure),
    "kit": Scenario(scenario_kit, markdown_kit),
}
