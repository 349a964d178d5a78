"""The timers scenario: fire lateness, ``set_timer`` throughput, memory per pending timer,
idle cost, takeover; each next to a floor or ceiling measured in the same run."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import anyio
import redis.asyncio

from anarchon import RedisBackend, Scheduler, TimerSetting
from anarchon._store.keys import TimerKeys, hint_channel
from anarchon._store.scripts import timer_script
from anarchon._store.timers import TimerStore, encode_payload
from anarchon.clients import open_connection
from bench.common import (
    Fleet,
    cpu_at,
    in_child,
    kill_the_runner,
    median,
    new_prefix,
    redis_client,
    server,
    server_info,
    summary_ms,
    timer_floor_ms,
)

Result = dict[str, Any]
KIND = "bench"
#: 32 bytes, as the issue's memory target asks.
PAYLOAD = b"p" * 32


def instance_argv(url: str, prefix: str, name: str, **options: Any) -> list[str]:
    config = {"url": url, "prefix": prefix, "name": name, **options}
    return [sys.executable, "-m", "bench.timer_instance", json.dumps(config)]


async def set_many(url: str, prefix: str, dues_ms: list[int], chunk: int = 1000) -> None:
    """Set timers ``t0``, ``t1``, ... due at ``dues_ms``, pipelined (a driver's shortcut:
    the store's own set, in round trips of ``chunk``)."""
    conn = open_connection(url)
    try:
        store = TimerStore(conn, prefix=prefix)
        payload = encode_payload(PAYLOAD)
        for start in range(0, len(dues_ms), chunk):
            part = [
                (f"t{n}", due, None, "", payload)
                for n, due in enumerate(dues_ms[start : start + chunk], start)
            ]
            await store.set_many(KIND, part)
    finally:
        await conn.aclose()


# ------------------------------------------------------------------ lateness


def lateness(url: str, rate: int, instances: int, seconds: float) -> Result:
    """Timers due at ``rate`` per second for ``seconds`` (set beforehand, as timers are),
    fired by ``instances`` processes: due time to handler start."""
    prefix = new_prefix("tl")
    argvs = [instance_argv(url, prefix, f"i{i}", keys=True) for i in range(instances)]
    with Fleet(argvs) as fleet:
        fleet.wait_ready()
        count = int(rate * seconds)
        # Set first (100,000 take seconds), due from a moment after the fleet starts.
        first_due_ms = int((time.time() + 2.5 + count / 20_000) * 1000)
        dues = [first_due_ms + int(n * 1000 / rate) for n in range(count)]
        anyio.run(set_many, url, prefix, dues)
        start_at = time.time() + 0.5
        if start_at * 1000 > first_due_ms - 500:
            raise RuntimeError("setting the timers took longer than allowed for")
        fleet.go(start_at, first_due_ms / 1000 + seconds + 2.0)
        results = fleet.results()
    fired = [f for r in results for f in r["fired"]]
    late = [started - due for due, started, _ in fired]
    # Several timers share a due millisecond above 1,000/s: counted by key.
    keys = Counter(key for r in results for key in r["keys"])
    cpu = [r["cpu"][-1][1] - r["cpu"][0][1] for r in results]
    return {
        "rate": rate,
        "instances": instances,
        "timers": count,
        "fired": len(fired),
        "duplicates": len(fired) - len(keys),
        "missed": count - len(keys),
        **summary_ms(late),
        "cpu_sec_per_1000": 1000 * sum(cpu) / max(len(fired), 1),
    }


# ------------------------------------------------------------------ firing throughput


def _raw_firings(url: str, count: int, processes: int) -> Result:
    """The raw client ceiling of firings (``bench/rawtimers.py``): ``count`` timers due,
    claimed and finished by ``processes`` raw processes."""
    prefix = new_prefix("tr")
    anyio.run(set_many, url, prefix, [int(time.time() * 1000) - 1000] * count)
    config = {"url": url, "prefix": prefix, "kind": KIND, "limit": 200, "lease_ms": 30_000}
    argvs = [
        [sys.executable, "-m", "bench.rawtimers", json.dumps({**config, "name": f"r{i}"})]
        for i in range(processes)
    ]
    with Fleet(argvs) as fleet:
        fleet.start_soon(0)
        results = fleet.results()
    fired = sum(r["fired"] for r in results)
    elapsed = max(r["ended"] for r in results) - min(r["started"] for r in results)
    return {
        "fired": fired,
        "per_sec": fired / elapsed,
        "cpu_us_per_firing": sum(r["cpu_sec"] for r in results) / max(fired, 1) * 1e6,
    }


def saturation(url: str, count: int, instances: int, samples: int) -> Result:
    """``count`` timers due at one instant, fired by ``instances`` instances: firings per
    second from the due instant to the last handler's start, and the instances' CPU per
    firing in that time; against the raw ceiling of as many processes (the median of
    ``samples``): ``efficiency`` = fired/s / raw/s, ``overhead`` = CPU per firing / raw CPU
    per firing."""
    prefix = new_prefix("tsat")
    argvs = [instance_argv(url, prefix, f"i{i}", keys=True) for i in range(instances)]
    with Fleet(argvs) as fleet:
        fleet.wait_ready()
        due_ms = int((time.time() + 2.5 + count / 20_000) * 1000)
        anyio.run(set_many, url, prefix, [due_ms] * count)
        start_at = time.time() + 0.5
        if start_at * 1000 > due_ms - 500:
            raise RuntimeError("setting the timers took longer than allowed for")
        fleet.go(start_at, due_ms / 1000 + 2.0 + count / 1000)
        results = fleet.results()
    fired = [f for r in results for f in r["fired"]]
    keys = {key for r in results for key in r["keys"]}
    first, last = due_ms / 1000, max((f[1] for f in fired), default=due_ms) / 1000
    cpu_sec = sum(cpu_at(r["cpu"], last) - cpu_at(r["cpu"], first) for r in results)
    raws = [_raw_firings(url, count, instances) for _ in range(samples)]
    raw_rate = median([r["per_sec"] for r in raws])
    raw_cpu = median([r["cpu_us_per_firing"] for r in raws])
    per_sec = len(keys) / max(last - first, 1e-3)
    cpu_us = cpu_sec / max(len(fired), 1) * 1e6
    return {
        "instances": instances,
        "timers": count,
        "fired": len(fired),
        "missed": count - len(keys),
        "duplicates": len(fired) - len(keys),
        "per_sec": per_sec,
        "cpu_us_per_firing": cpu_us,
        "raw_per_sec": raw_rate,
        "raw_samples": [r["per_sec"] for r in raws],
        "raw_cpu_us_per_firing": raw_cpu,
        "efficiency": per_sec / raw_rate,
        "overhead": cpu_us / raw_cpu,
    }


# ------------------------------------------------------------------ set throughput


def set_rates(url: str, count: int, concurrency: int) -> Result:
    """``_set_rates`` in a process of its own, so that it measures the ``Timers`` of the
    code chosen by ``code_from`` (``--against``)."""
    rates: Result = in_child("bench.timers", "set_timer", url, count, concurrency)
    return rates


async def _set_rates(url: str, count: int, concurrency: int, rounds: int = 3) -> Result:
    """``set_timer`` awaited one by one, ``set_timers`` in lists of 100 from two tasks,
    and ``set_timer`` from ``concurrency`` tasks, each beside the raw client's ceiling (the
    same script by SHA with the same arguments from redis-py's asyncio client: awaited
    one by one, and pipelines of 100 from two tasks). The measures take turns for
    ``rounds`` rounds (a noisy machine slows both sides alike); each is the median."""
    prefix = new_prefix("ts")
    scheduler = Scheduler(RedisBackend(redis=url, prefix=prefix))
    # As anarchon opens its own asyncio connections: no per-reply timeout.
    client = redis.asyncio.Redis.from_url(url, protocol=2, socket_timeout=None)
    samples: dict[str, list[float]] = {}
    per_list = 100
    tasks = 2

    def note(name: str, done: int, started: float) -> None:
        samples.setdefault(name, []).append(done / (time.perf_counter() - started))

    async def in_tasks(name: str, how_many: int, work: Callable[[int], Awaitable[None]]) -> None:
        """``work(offset)`` in ``how_many`` tasks at once; ``count`` set in all."""
        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            for offset in range(how_many):
                group.start_soon(work, offset)
        note(name, count, started)

    try:
        sha = await client.script_load(timer_script("timer_set").body)
        keys = TimerKeys.for_kind(prefix, KIND)
        stored = encode_payload(PAYLOAD)
        hints = hint_channel(prefix)

        def args(key: str) -> list[Any]:
            return [sha, 4, keys.timers, keys.due, keys.meta, keys.progress, key, "", 3_600_000,
                    "", stored, hints]  # fmt: skip

        async with scheduler:  # set_timer on the running scheduler's own connection
            for r in range(rounds):
                awaited = count // 10
                started = time.perf_counter()
                for n in range(awaited):
                    await scheduler.set_timer(
                        KIND, f"a{r}:{n}", delay_ms=3_600_000, payload=PAYLOAD
                    )
                note("awaited", awaited, started)

                started = time.perf_counter()
                for n in range(awaited):
                    await client.execute_command("EVALSHA", *args(f"ra{r}:{n}"))
                note("raw_awaited", awaited, started)

                async def lists(offset: int, r: int = r) -> None:
                    mine = list(range(offset, count, tasks))
                    for at in range(0, len(mine), per_list):
                        await scheduler.set_timers(KIND, [
                            TimerSetting(f"p{r}:{n}", delay_ms=3_600_000, payload=PAYLOAD)
                            for n in mine[at : at + per_list]
                        ])  # fmt: skip

                await in_tasks("pipelined", tasks, lists)

                async def raw_lists(offset: int, r: int = r) -> None:
                    mine = list(range(offset, count, tasks))
                    for at in range(0, len(mine), per_list):
                        pipe = client.pipeline(transaction=False)
                        for n in mine[at : at + per_list]:
                            pipe.execute_command("EVALSHA", *args(f"rp{r}:{n}"))
                        await pipe.execute()

                await in_tasks("raw_pipelined", tasks, raw_lists)

                async def part(offset: int, r: int = r) -> None:
                    for n in range(offset, count, concurrency):
                        await scheduler.set_timer(
                            KIND, f"c{r}:{n}", delay_ms=3_600_000, payload=PAYLOAD
                        )

                await in_tasks("concurrent", concurrency, part)
    finally:
        await client.aclose()
    out: Result = {f"{name}_per_sec": median(values) for name, values in samples.items()}
    out["rounds"] = rounds
    out["concurrency"] = concurrency
    out["awaited_ratio"] = out["awaited_per_sec"] / out["raw_awaited_per_sec"]
    out["pipelined_ratio"] = out["pipelined_per_sec"] / out["raw_pipelined_per_sec"]
    out["concurrent_ratio"] = out["concurrent_per_sec"] / out["raw_pipelined_per_sec"]
    return out


# ------------------------------------------------------------------ memory, idle


def memory_and_idle(url: str, pending: int, idle_sec: float) -> Result:
    """``pending`` timers (32 B payloads) due in a day: server memory per timer; then one
    instance running beside them: its CPU and the server's commands per second."""
    prefix = new_prefix("tm")
    client = redis_client(url)
    before = int(server_info(url, "memory")["used_memory"])
    due = int(time.time() * 1000) + 86_400_000
    anyio.run(set_many, url, prefix, [due + n for n in range(pending)], 5000)
    after = int(server_info(url, "memory")["used_memory"])
    keys = TimerKeys.for_kind(prefix, KIND)
    usage = {
        name: int(client.memory_usage(key, samples=0) or 0)
        for name, key in (("timers", keys.timers), ("due", keys.due))
    }
    out: Result = {
        "pending": pending,
        "bytes_per_timer": (after - before) / pending,
        "memory_usage_per_timer": sum(usage.values()) / pending,
        "usage": usage,
    }
    commands_before = int(server_info(url, "stats")["total_commands_processed"])
    with Fleet([instance_argv(url, prefix, "idle")]) as fleet:
        start_at, end_at = fleet.start_soon(idle_sec)
        (result,) = fleet.results()
    commands = int(server_info(url, "stats")["total_commands_processed"]) - commands_before
    samples = [s for s in result["cpu"] if start_at + 1 <= s[0] <= end_at]
    cpu_sec = samples[-1][1] - samples[0][1] if len(samples) > 1 else float("nan")
    wall = samples[-1][0] - samples[0][0] if len(samples) > 1 else float("nan")
    out["idle_cpu_percent"] = 100 * cpu_sec / wall
    out["idle_commands_per_sec"] = commands / (end_at - start_at)
    out["fired_while_idle"] = len(result["fired"])
    client.close()
    return out


# ------------------------------------------------------------------ takeover


def takeover(url: str, lease_ms: int, heartbeat_ms: int) -> Result:
    """SIGKILL of the instance firing a timer to attempt 2 starting on the other."""
    prefix = new_prefix("tk")
    argvs = [
        instance_argv(url, prefix, f"i{i}", lease_ms=lease_ms, heartbeat_ms=heartbeat_ms,
                       hang=True)
        for i in range(2)
    ]  # fmt: skip
    with Fleet(argvs) as fleet:
        fleet.wait_ready()
        start_at = time.time() + 0.5
        fleet.go(start_at, start_at + 600)
        anyio.run(set_many, url, prefix, [int((start_at + 1) * 1000)])
        return kill_the_runner(fleet, heartbeat_ms, lease_ms)


# ------------------------------------------------------------------ a cluster's buckets


def _node_cpu_sec(ports: list[int]) -> list[float]:
    """Each node's CPU time (user + system), from INFO cpu."""
    seconds = []
    for port in ports:
        cpu = server_info(f"redis://127.0.0.1:{port}", "cpu")
        seconds.append(float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))
    return seconds


async def _set_on_cluster(url: str, prefix: str, due_ms: int, count: int, buckets: int) -> None:
    """``count`` timers due at ``due_ms``, set through the public API from a process that
    only sets timers, on redis-py's asyncio cluster client."""
    client = redis.asyncio.RedisCluster.from_url(url, protocol=2)
    try:
        setter = Scheduler(RedisBackend(redis=client, prefix=prefix))
        at = datetime.fromtimestamp(due_ms / 1000, UTC)
        for start in range(0, count, 1000):
            await setter.set_timers(KIND, [
                TimerSetting(f"t{n}", at=at, payload=PAYLOAD)
                for n in range(start, min(start + 1000, count))
            ], buckets=buckets)  # fmt: skip
    finally:
        await client.aclose()


def cluster_spread(count: int, instances: int, window_sec: float) -> Result:
    """One kind of timer on a three-primary cluster (the embedded Valkey), with 1 bucket
    and with 3: ``count`` timers due at one instant, fired by ``instances`` processes.
    Each node's CPU time over the firing says where the server's work went: a kind
    lives on one primary per bucket, so the busiest node's share is what bounds it."""
    from tests.servers import discover_servers, running_cluster, stop_all

    specs = [s for s in discover_servers() if s.family == "valkey" and s.binary is not None]
    if not specs:
        return {"skipped": "no Valkey binary for a cluster"}
    rows = []
    try:
        ports = running_cluster(specs[0])
        url = f"redis://127.0.0.1:{ports[0]}"
        for buckets in (1, 3):
            prefix = new_prefix(f"tc{buckets}")
            argvs = [
                instance_argv(url, prefix, f"i{i}", cluster=True, buckets=buckets, keys=True)
                for i in range(instances)
            ]
            with Fleet(argvs) as fleet:
                fleet.wait_ready()
                due_ms = int((time.time() + 2.0 + count / 5000) * 1000)  # set by then
                anyio.run(_set_on_cluster, url, prefix, due_ms, count, buckets)
                start_at = time.time() + 0.5
                if start_at * 1000 > due_ms - 300:
                    raise RuntimeError("setting the timers took longer than allowed for")
                before = _node_cpu_sec(ports)
                fleet.go(start_at, due_ms / 1000 + window_sec)
                results = fleet.results()
                node_sec = [b - a for a, b in zip(before, _node_cpu_sec(ports), strict=True)]
            fired = [f for r in results for f in r["fired"]]
            keys = Counter(key for r in results for key in r["keys"])
            last_ms = max((started for _, started, _ in fired), default=float("nan"))
            drain_sec = (last_ms - due_ms) / 1000
            rows.append({
                "buckets": buckets,
                "timers": count,
                "fired": len(fired),
                "duplicates": len(fired) - len(keys),
                "missed": count - len(keys),
                "drain_sec": drain_sec,
                "fired_per_sec": len(fired) / drain_sec if drain_sec > 0 else float("nan"),
                "node_cpu_sec": node_sec,
                "busiest_share": max(node_sec) / sum(node_sec) if sum(node_sec) else float("nan"),
                "busiest_cpu_ms_per_1000": 1e6 * max(node_sec) / max(len(fired), 1),
            })  # fmt: skip
    finally:
        stop_all()
    return {"instances": instances, "rows": rows, "server": specs[0].id}


# ------------------------------------------------------------------ the scenario


def scenario_timers(url: str | None, mode: Any) -> Result:
    loads = mode.pick([(1000, 1), (1000, 4)], [(1000, 1), (1000, 4), (10_000, 1), (10_000, 4)])
    seconds = mode.pick(4.0, 10.0, smoke=2.0)
    out: Result = {"floor": summary_ms(timer_floor_ms(mode.pick(5, 15)))}
    with server(url) as live:
        out["lateness"] = [lateness(live, rate, n, seconds) for rate, n in loads]
    with server(url) as live:
        count = mode.pick(10_000, 50_000, smoke=2_000)
        samples = mode.pick(3, 5, smoke=1)
        out["saturation"] = [saturation(live, count, n, samples) for n in (1, 4)]
    with server(url) as live:
        out["set"] = set_rates(live, mode.pick(5_000, 50_000), 200)
    with server(url) as live:
        out["memory"] = memory_and_idle(
            live, mode.pick(100_000, 1_000_000, smoke=10_000), mode.pick(12.0, 60.0, smoke=4.0)
        )
    if url is None:  # a cluster of the embedded Valkey (not of a server the user gave)
        out["cluster"] = cluster_spread(
            mode.pick(6_000, 30_000, smoke=2_000), 2, mode.pick(8.0, 12.0, smoke=4.0)
        )
    with server(url) as live:
        trials = [takeover(live, 2000, 500) for _ in range(mode.pick(2, 4, smoke=1))]
        times = [t["takeover_ms"] for t in trials if t["takeover_ms"] is not None]
        out["takeover"] = {
            "lease_ms": 2000,
            "heartbeat_ms": 500,
            "trials": len(trials),
            "times_ms": times,
            "median_ms": median(times),
            "max_ms": max(times) if times else None,
            "bound_ms": 2000 + 500 + 100,
        }
    return out


def markdown_timers(result: Result) -> str:
    floor = result["floor"]
    lines = [
        f"Timer floor (a bare event-loop sleep to a whole second): p50 {floor['p50_ms']:.2f} ms,"
        f" max {floor['max_ms']:.2f} ms.",
        "",
        "| timers/s due | instances | fired | duplicates | not fired by the end | p50 ms | p99 ms "
        "| max ms | CPU s per 1000 fired |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["lateness"]:
        lines.append(
            f"| {row['rate']:,} | {row['instances']} | {row['fired']:,} | {row['duplicates']} "
            f"| {row['missed']} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
            f"{row['max_ms']:.1f} | {row['cpu_sec_per_1000']:.2f} |"
        )
    lines += [
        "",
        "| all due at once | timers | fired | duplicates | not fired | fired/s | raw ceiling "
        "/s (median of samples) | efficiency | CPU us/firing | raw CPU us/firing | overhead |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result.get("saturation", []):
        samples = ", ".join(f"{r:,.0f}" for r in row["raw_samples"])
        lines.append(
            f"| {row['instances']} instance(s) | {row['timers']:,} | {row['fired']:,} | "
            f"{row['duplicates']} | {row['missed']} | {row['per_sec']:,.0f} | "
            f"{row['raw_per_sec']:,.0f} ({samples}) | {row['efficiency']:.2f} | "
            f"{row['cpu_us_per_firing']:.0f} | {row['raw_cpu_us_per_firing']:.0f} | "
            f"{row['overhead']:.2f}x |"
        )
    s = result["set"]
    lines += [
        "",
        f"| setting timers (median of {s['rounds']} rounds) | anarchon /s | raw EVALSHA /s "
        "(redis-py asyncio) | ratio | target |",
        "| --- | --- | --- | --- | --- |",
        f"| `set_timer` awaited one by one | {s['awaited_per_sec']:,.0f} "
        f"| {s['raw_awaited_per_sec']:,.0f} (awaited) | {s['awaited_ratio']:.0%} | 70% |",
        f"| `set_timers`, lists of 100 from 2 tasks (pipelined) | {s['pipelined_per_sec']:,.0f} "
        f"| {s['raw_pipelined_per_sec']:,.0f} (pipelines of 100) | {s['pipelined_ratio']:.0%} "
        "| 70% |",
        f"| `set_timer` from {s['concurrency']} tasks at once | {s['concurrent_per_sec']:,.0f} "
        f"| {s['raw_pipelined_per_sec']:,.0f} (pipelines of 100) | {s['concurrent_ratio']:.0%} "
        "| - |",
    ]
    m = result["memory"]
    lines += [
        "",
        f"{m['pending']:,} pending timers (32 B payloads): {m['bytes_per_timer']:.0f} B each "
        f"(used_memory), {m['memory_usage_per_timer']:.0f} B (MEMORY USAGE of the hash and "
        f"the sorted set). One instance beside them, none due: {m['idle_cpu_percent']:.2f}% of "
        f"a core, {m['idle_commands_per_sec']:.1f} server commands/s.",
    ]
    c = result.get("cluster")
    if c and "rows" in c:
        lines += [
            "",
            f"One kind on a three-primary cluster ({c['server']}), all its timers due at once,"
            f" fired by {c['instances']} instances:",
            "",
            "| buckets | timers | fired | duplicates | missed | fired/s | server CPU s per node "
            "| busiest node's share | busiest node's CPU ms per 1000 fired |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in c["rows"]:
            nodes = " / ".join(f"{sec:.2f}" for sec in row["node_cpu_sec"])
            lines.append(
                f"| {row['buckets']} | {row['timers']:,} | {row['fired']:,} | "
                f"{row['duplicates']} | {row['missed']} | {row['fired_per_sec']:,.0f} | {nodes} "
                f"| {row['busiest_share']:.0%} | {row['busiest_cpu_ms_per_1000']:.1f} |"
            )
    t = result["takeover"]
    median_ms = t["median_ms"]
    lines += [
        "",
        f"Takeover of a killed firing (lease {t['lease_ms']} ms, heartbeat "
        f"{t['heartbeat_ms']} ms): median {median_ms:.0f} ms, max {t['max_ms'] or 0:.0f} ms over "
        f"{len(t['times_ms'])}/{t['trials']} trials; target {t['bound_ms']} ms.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(anyio.run(_set_rates, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
