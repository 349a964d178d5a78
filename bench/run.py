"""``python -m bench``: the numbers users ask for, each next to a floor or ceiling
measured in the same run on the same machine (absolute times drift on shared
machines; ratios do not).

Scenarios (all of them when none is named; ``--quick`` runs small sizes in a few
minutes, ``--smoke`` each scenario at its smallest size, as CI does):

- ``throughput``: decided slots per second as jobs per second rise until it
  saturates, with the raw client ceiling (the claim script pipelined by the same
  library from as many processes) and the server ceiling (valkey-benchmark).
- ``latency``: slot instant to handler start at 1x10, 4x100 (and 8x1000) instances x
  jobs per second, with the timer floor and one loopback round trip.
- ``cost``: server commands and bytes per run, per strategy.
- ``takeover``: SIGKILL of the running instance to attempt 2 starting, per
  lease_ms/heartbeat_ms.
- ``idle``: instance CPU per minute with 1,000 and 10,000 jobs every minute.
- ``memory``: server memory per job after many runs, at history_size 1000 and 100.
- ``scaling``: throughput and p99 against jobs, instances, event loop and client,
  and strategy.
- ``timers``: durable timers: fire lateness at 1,000 (and 10,000) timers/s due with 1
  and 4 instances, next to the timer floor; ``set_timer`` throughput against the raw
  client's EVALSHA; server memory per pending timer and the idle cost beside them;
  takeover of a killed firing.
- ``observe``: instance CPU per run at 1 x 1000 jobs/s with Prometheus metrics, an
  events stream and OpenTelemetry spans on, next to the same load with them off
  (twice): the ceiling is 5% more.
- ``backpressure``: 2,000 timers due at once, 2 s handlers, instances bounded at 100
  (``max_concurrent``): the most each ran at once, every timer fired, and the time it
  took next to its floor (timers / (instances x bound) x handler); the same with no
  bound, and with one instance killed mid-way.
- ``kit``: the real seconds each test of ``anarchon.testing`` takes per virtual day,
  next to the kit's bound (5 s).

``--against REV`` measures the anarchon of git revision REV and this checkout in the
same run, interleaved (``--rounds`` rounds, alternating which goes first), and prints
each scenario's headline figures side by side: a before/after that does not measure
the machine's mood of the day.

Each scenario starts its own server(s) and writes ``bench/results/<name>.json``
and a Markdown table on stdout; with matplotlib (extra ``bench``) also plots:
PNGs in ``docs/img/`` in full mode, in ``bench/results/`` with ``--quick``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from bench.common import ROOT, code_from
from bench.scenarios import SCENARIOS, Mode, Result

RESULTS = ROOT / "bench" / "results"
DOC_IMAGES = ROOT / "docs" / "img"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join((__doc__ or "").split("\n\n")[1:]),
    )
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=", ".join(SCENARIOS))
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="small sizes, a few minutes")
    sizes.add_argument(
        "--smoke",
        action="store_true",
        help="each scenario at its smallest size, about two minutes (CI: printed, not checked)",
    )
    parser.add_argument(
        "--redis",
        metavar="URL",
        help="one server of yours for every scenario instead of fresh embedded ones "
        "(its other traffic counts in cost and memory)",
    )
    parser.add_argument("--plots", metavar="DIR", type=Path, help="where to write the plots")
    parser.add_argument(
        "--against",
        metavar="REV",
        help="also measure the anarchon of git revision REV, interleaved with this "
        "checkout in the same run, and print their headline figures side by side",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        metavar="N",
        help="with --against: rounds of each scenario, each version once per round (3)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    mode_name: Literal["smoke", "quick", "full"] = (
        "smoke" if args.smoke else "quick" if args.quick else "full"
    )
    mode = Mode(mode_name)
    plots_dir = args.plots or (RESULTS if mode.quick else DOC_IMAGES)
    RESULTS.mkdir(parents=True, exist_ok=True)
    print(
        f"# anarchon benchmarks, {mode_name} mode, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"Python {platform.python_version()}, {_cpus()} CPUs\n",
        flush=True,
    )
    if args.against:
        names = args.scenarios or list(SCENARIOS)
        return _against(args.against, args.rounds, names, args.redis, mode)
    from bench import plots

    plot_problem = plots.unavailable()
    began = time.monotonic()
    for name in args.scenarios or list(SCENARIOS):
        scenario = SCENARIOS[name]
        started = time.monotonic()
        print(f"## {name}\n", flush=True)
        result = scenario.run(args.redis, mode)
        result["mode"] = mode_name
        result["seconds"] = time.monotonic() - started
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
        print(f"\n{scenario.markdown(result)}\n\n({result['seconds']:.0f} s)\n", flush=True)
        if plot_problem is None:
            for path in plots.draw(name, result, plots_dir):
                print(f"plot: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
            print()
    if plot_problem is not None:
        print(f"Plots skipped: {plot_problem}")
    print(f"Total {time.monotonic() - began:.0f} s", flush=True)
    return 0


def _against(rev: str, rounds: int, names: list[str], url: str | None, mode: Mode) -> int:
    """Each scenario ``rounds`` times per version, REV and this checkout alternating
    which goes first; then their headline figures side by side."""
    from bench.against import checkout, figures, markdown_against

    began = time.monotonic()
    with checkout(rev) as src:
        for name in names:
            scenario = SCENARIOS[name]
            pairs = []
            runs: dict[str, list[Result]] = {"before": [], "after": []}
            for index in range(rounds):
                order = ("before", "after") if index % 2 == 0 else ("after", "before")
                for which in order:
                    code = rev if which == "before" else "this checkout"
                    print(f"## {name}, round {index + 1}, {which} ({code})\n", flush=True)
                    with code_from(src) if which == "before" else contextlib.nullcontext():
                        result = scenario.run(url, mode)
                    print(f"\n{scenario.markdown(result)}\n", flush=True)
                    runs[which].append(result)
                pairs.append((figures(name, runs["before"][-1]), figures(name, runs["after"][-1])))
            (RESULTS / f"{name}.against.json").write_text(
                json.dumps({"against": rev, "mode": mode.name, **runs}, indent=2)
            )
            print(f"{markdown_against(name, rev, pairs)}\n", flush=True)
    print(f"Total {time.monotonic() - began:.0f} s", flush=True)
    return 0


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
