"""``python -m chaos``: the quick selection, or ``--long`` for the soak."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from chaos.scenarios import QUICK, Config, FaultScript, f_random, run_scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    parser.add_argument("--long", action="store_true", help="the soak with random faults")
    parser.add_argument("--instances", type=int, help="instances (quick: 3, long: 10)")
    parser.add_argument("--jobs", type=int, help="jobs, every 1 s (quick: 8, long: 200)")
    parser.add_argument("--minutes", type=float, help="soak duration (long: 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", help="comma-separated scenario names (quick selection)")
    parser.add_argument("--keep", action="store_true", help="keep ledgers and logs")
    args = parser.parse_args(argv)

    started = time.monotonic()
    outcomes = []
    plan: list[tuple[str, FaultScript, Config]]
    if args.long:
        config = Config(
            instances=args.instances or 10,
            jobs=args.jobs or 200,
            seconds=(args.minutes if args.minutes is not None else 10.0) * 60,
            appendonly=True,
            seed=args.seed,
        )
        plan = [("soak", f_random, config)]
    else:
        base = Config(seed=args.seed)
        if args.instances:
            base = replace(base, instances=args.instances)
        if args.jobs:
            base = replace(base, jobs=args.jobs)
        wanted = set(args.only.split(",")) if args.only else None
        plan = [
            (name, script, replace(base, **overrides))  # type: ignore[arg-type]
            for name, script, overrides in QUICK
            if wanted is None or name in wanted
        ]
        if not plan:
            parser.error(f"no scenario named {args.only}; known: {[q[0] for q in QUICK]}")
    for name, script, config in plan:
        outcome = run_scenario(name, script, config, keep=args.keep)
        outcomes.append(outcome)
        print(outcome.line, flush=True)
    duplicates = sum(o.unexplained for o in outcomes)
    misses = sum(o.misses for o in outcomes)
    runs = sum(o.runs for o in outcomes)
    print(f"(ran {time.monotonic() - started:.0f} s)", flush=True)
    print(
        f"chaos: scenarios={len(outcomes)} runs={runs} unexplained_duplicates={duplicates} "
        f"misses={misses}",
        flush=True,
    )
    return 0 if duplicates == 0 and misses == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
