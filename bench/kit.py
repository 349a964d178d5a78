"""``kit``: what a day of virtual time costs in real time with ``anarchon.testing``.

Runs the kit's own tests (``tests/test_testing_kit.py``, one process, both event
loops); each test appends the real seconds it took and the virtual days it simulated.
The bound next to them is the one the kit promises: a day in under 5 s."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import ROOT, child_env, median

Result = dict[str, Any]

#: The kit's promise: a simulated day takes less real time than this.
DAY_BOUND_SEC = 5.0

#: In smoke mode, the issue's two examples only.
SMOKE = "daily_report_runs_once_a_day_through_dst or reminder_after_signup"


def scenario_kit(url: str | None, mode: Any) -> Result:
    """Each kit test's real seconds per virtual day (``url`` is not used: the kit runs
    on a server of its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        timings = Path(tmp) / "timings.jsonl"
        env = {**child_env(), "ANARCHON_KIT_TIMINGS": str(timings)}
        command = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
            "tests/test_testing_kit.py",
        ]  # fmt: skip
        if mode.name == "smoke":
            command += ["-k", SMOKE]
        out = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False
        )
        lines = timings.read_text().splitlines() if timings.exists() else []
    rows = [json.loads(line) for line in lines]
    if out.returncode:
        raise RuntimeError(f"the kit's tests failed:\n{out.stdout[-3000:]}{out.stderr[-2000:]}")
    for row in rows:
        row["sec_per_day"] = row["seconds"] / row["days"]
    rows.sort(key=lambda row: -row["sec_per_day"])
    per_day = [row["sec_per_day"] for row in rows]
    return {
        "bound_sec_per_day": DAY_BOUND_SEC,
        "rows": rows,
        "median_sec_per_day": median(per_day) if per_day else None,
        "over_bound": sum(value >= DAY_BOUND_SEC for value in per_day),
    }


def markdown_kit(result: Result) -> str:
    middle = result["median_sec_per_day"]
    lines = [
        f"{len(result['rows'])} tests; real seconds per virtual day: median "
        f"{'n/a' if middle is None else format(middle, '.2f')}, {result['over_bound']} at or "
        f"over the bound of {result['bound_sec_per_day']:.0f} s.",
        "",
        "| test | virtual days | real s | s per day |",
        "| --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        name = row["test"].split("::", 1)[-1]
        lines.append(
            f"| {name} | {row['days']:g} | {row['seconds']:.2f} | {row['sec_per_day']:.2f} |"
        )
    return "\n".join(lines)
