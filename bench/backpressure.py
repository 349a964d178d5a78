"""The backpressure scenario: many timers due at once, slow handlers, instances bounded by
``max_concurrent``; the most handlers any instance ran at once, every timer fired, and
the time it all took next to its floor, ``timers / (instances x bound) x handler``; then
the same with one instance killed mid-way."""

from __future__ import annotations

import collections
import time
from typing import Any

import anyio

from bench.common import Fleet, new_prefix, server
from bench.timers import instance_argv, set_many

Result = dict[str, Any]

LEASE_MS = 2000
HEARTBEAT_MS = 500


def flood(
    url: str, timers: int, handler_ms: int, bound: int | None, instances: int, kill: bool
) -> Result:
    """``timers`` due together on ``instances`` bounded at ``bound`` (None: no bound),
    each handler ``handler_ms`` long; with ``kill``, the first instance is SIGKILLed once
    a third have fired (its firings in progress are taken over a lease later)."""
    prefix = new_prefix("bp")
    options = {
        "max_concurrent": bound,
        "handler_ms": handler_ms,
        "progress": True,
        "lease_ms": LEASE_MS,
        "heartbeat_ms": HEARTBEAT_MS,
    }
    argvs = [instance_argv(url, prefix, f"i{i}", **options) for i in range(instances)]
    at_once = timers if bound is None else min(instances * bound, timers)
    floor_sec = timers / at_once * handler_ms / 1000
    running: collections.Counter[int] = collections.Counter()
    most: collections.Counter[int] = collections.Counter()
    done: collections.Counter[str] = collections.Counter()
    killed_at: float | None = None
    last_done = 0.0
    with Fleet(argvs) as fleet:
        fleet.wait_ready()
        start_at = time.time() + 0.5
        fleet.go(start_at, start_at + 3600)
        due_ms = int((start_at + 1.0) * 1000)
        anyio.run(set_many, url, prefix, [due_ms] * timers)
        for index, event in fleet.events(floor_sec * 4 + 3 * LEASE_MS / 1000 + 30):
            if event.get("event") == "start":
                running[index] += 1
                most[index] = max(most[index], running[index])
            elif event.get("event") == "done":
                running[index] -= 1
                done[event["key"]] += 1
                last_done = event["t"]
                if kill and killed_at is None and len(done) >= timers // 3:
                    killed_at = time.time()
                    fleet.kill(0)
                    # From here the others alone, the rest at their bound: an estimate
                    # (not a floor: the survivors' runs in progress are part done).
                    left = timers - len(done)
                    floor_sec = (
                        killed_at
                        - due_ms / 1000
                        + left / min((instances - 1) * (bound or timers), left) * handler_ms / 1000
                    )
                if len(done) == timers:
                    break
    total_sec = last_done - due_ms / 1000 if done else float("nan")
    return {
        "timers": timers,
        "handler_ms": handler_ms,
        "bound": bound,
        "instances": instances,
        "killed": kill,
        "most_at_once": [most[i] for i in range(instances)],
        "fired": len(done),
        "missed": timers - len(done),
        "done_twice": sum(1 for n in done.values() if n > 1),
        "total_sec": total_sec,
        "floor_sec": floor_sec,
        "ratio": total_sec / floor_sec if floor_sec else float("nan"),
    }


def scenario_backpressure(url: str | None, mode: Any) -> Result:
    size = mode.pick((2000, 2000, 100), (2000, 2000, 100), smoke=(200, 500, 20))
    timers, handler_ms, bounded_at = size
    fleets = mode.pick([2], [2, 4], smoke=[2])
    # Without a bound first (quick and full): what the bound is for.
    runs = [(fleets[0], None, False)] if mode.name != "smoke" else []
    runs += [(instances, bounded_at, kill) for instances in fleets for kill in (False, True)]
    rows = []
    with server(url) as live:
        for instances, bound, kill in runs:
            row = flood(live, timers, handler_ms, bound, instances, kill)
            rows.append(row)
            print(
                f"  {instances} instances{', one killed' if kill else ''}: most at once "
                f"{row['most_at_once']} (bound {bound}), fired {row['fired']:,}/{timers:,}, "
                f"{row['total_sec']:.1f} s ({'estimate' if kill else 'floor'} "
                f"{row['floor_sec']:.1f} s)",
                flush=True,
            )
    return {"rows": rows}


def markdown_backpressure(result: Result) -> str:
    lines = [
        "| timers due at once | handler | bound | instances | one killed | most at once "
        "(each) | fired | done twice | took | floor (estimate after a kill) | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['timers']:,} | {row['handler_ms'] / 1000:g} s | {row['bound'] or 'none'} "
            f"| {row['instances']} | {'yes' if row['killed'] else 'no'} "
            f"| {', '.join(map(str, row['most_at_once']))} | {row['fired']:,} "
            f"| {row['done_twice']} | {row['total_sec']:.1f} s | {row['floor_sec']:.1f} s "
            f"| {row['ratio']:.2f} |"
        )
    lines += [
        "",
        "The floor is timers / (instances x bound) x handler: every instance full from the "
        "first moment to the last. With one killed (SIGKILL once a third have fired), its "
        f"firings in progress are taken over a lease ({LEASE_MS} ms) later, and the rest "
        "runs on the others (the estimate: the moment of the kill, then the rest on the "
        "others at their bound, as if their runs in progress had just begun); a firing "
        "that finished on the killed instance but was not yet recorded runs again (timers "
        "fire at least once: done twice).",
    ]
    return "\n".join(lines)
