"""Where an instance's CPU per decided slot goes, sampled with py-spy under load.

    python -m bench.profile [--instances 1] [--jobs 2000] [--seconds 10] [--top 30]

Runs the load of ``bench throughput`` (every job every second, on an embedded Valkey)
with ``--instances`` processes, and samples instance 0 with ``py-spy`` (``--rate`` Hz,
idle waits left out) through the window after the warm-up. Prints the CPU per decided
slot, then the share of the event loop's samples by phase (claims, finishes, handler
tasks, heartbeats, the agenda: the outermost such frame on the stack) and by layer
(the client library, anarchon, anyio, asyncio: the innermost frame), and the
functions with the most samples of their own.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Fleet, InstanceConfig, cpu_at, new_prefix, server

#: What the instance was doing, by the outermost of these frames on the stack (checked
#: in this order): the phase a sample counts in.
PHASES: list[tuple[str, str]] = [
    ("finishes (settle)", r"Settler\.|settle_with"),
    ("due slots (agenda)", r"Agenda\."),
    ("claims (claim loop)", r"Claimer\."),
    ("heartbeats (lease keeper)", r"LeaseKeeper\."),
    ("handler tasks (start, run, end)", r"Runner\.|bench/instance\.py"),
]

#: Whose code a sample is in, by its innermost frame.
LAYERS: list[tuple[str, str]] = [
    ("client library", r"\((redis|valkey|glide)/"),
    ("anarchon", r"\(anarchon/"),
    ("anyio", r"\(anyio/"),
    ("asyncio", r"\((asyncio|selectors)/|\(selectors\.py"),
    ("the handler", r"\(bench/"),
]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    parser.add_argument("--lines", action="store_true", help="keep line numbers in --keep")
    parser.add_argument("--keep", type=Path, help="also write py-spy's raw stacks here")
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("py-spy is not installed (pip install py-spy)")
    with server() as url, tempfile.TemporaryDirectory() as tmp:
        prefix = new_prefix("prof")
        configs = [InstanceConfig(url, prefix, f"i{i}", args.jobs) for i in range(args.instances)]
        raw = Path(tmp) / "stacks.txt"
        with Fleet([c.argv() for c in configs]) as fleet:
            start_at, end_at = fleet.start_soon(args.seconds)
            time.sleep(max(0.0, start_at + args.warmup - time.time()))
            sampled_from = time.time()
            duration = int(end_at - 0.5 - sampled_from)
            subprocess.run(
                [spy, "record", "--pid", str(fleet.procs[0].pid), "--duration", str(duration),
                 "--rate", str(args.rate), "--format", "raw", "--output", str(raw),
                 *([] if args.lines else ["--nolineno"])],
                check=True, capture_output=True,
            )  # fmt: skip
            sampled_to = sampled_from + duration
            results = fleet.results()
        stacks = raw.read_text()
        if args.keep:
            args.keep.write_text(stacks)
    mine = results[0]
    started = sum(sampled_from * 1000 <= s <= sampled_to * 1000 for _, s, _ in mine["runs"])
    every = sum(
        sampled_from * 1000 <= s <= sampled_to * 1000 for r in results for _, s, _ in r["runs"]
    )
    cpu = cpu_at(mine["cpu"], sampled_to) - cpu_at(mine["cpu"], sampled_from)
    print(
        f"# {args.instances} x {args.jobs}: instance 0 started {started} runs in "
        f"{duration} s (the fleet {every}); its CPU {cpu:.2f} s: "
        f"{cpu / every * 1e6 * args.instances if every else float('nan'):.0f} us per decided "
        f"slot across the fleet's instances, {cpu / started * 1e6 if started else 0:.0f} us "
        "per run it started\n"
    )
    print(summarize(stacks, args.top))
    return 0


def summarize(stacks: str, top: int) -> str:
    """The share of the event loop's samples per phase and layer, and the functions
    with the most samples of their own (worker threads, idle in the thread pool, are
    counted apart)."""
    cells: collections.Counter[tuple[str, str]] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = threads = 0
    phases = [(name, re.compile(pattern)) for name, pattern in PHASES]
    layers = [(name, re.compile(pattern)) for name, pattern in LAYERS]
    for line in stacks.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        if frames[0].startswith("Thread._bootstrap") or frames[0].startswith("_bootstrap"):
            threads += count
            continue
        total += count
        own[frames[-1]] += count
        phase = next(
            (name for name, pattern in phases if any(pattern.search(f) for f in frames)),
            "other (the loop, timers, housekeeping)",
        )
        layer = next((name for name, pattern in layers if pattern.search(frames[-1])), "other")
        cells[phase, layer] += count
    names = [name for name, _ in LAYERS] + ["other"]
    lines = [
        f"{total} samples of the event loop's thread ({threads} more in worker threads, left out)",
        "",
        "| phase | all | " + " | ".join(names) + " |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    seen = {phase for phase, _ in cells}
    for phase in sorted(seen, key=lambda p: -sum(cells[p, n] for n in names)):
        row = [cells[phase, name] / total for name in names]
        lines.append(
            f"| {phase} | {sum(row):.1%} | " + " | ".join(f"{share:.1%}" for share in row) + " |"
        )
    column = [sum(cells[phase, name] for phase in seen) / total for name in names]
    lines.append("| all | 100% | " + " | ".join(f"{share:.1%}" for share in column) + " |")
    lines += ["", "| function (own samples) | share |", "| --- | --- |"]
    for frame, count in own.most_common(top):
        lines.append(f"| `{frame}` | {count / total:.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
