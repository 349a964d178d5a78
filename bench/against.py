"""``python -m bench --against REV``: two versions of anarchon measured in one run,
interleaved, because this machine's speed changes from one hour to the next and a
before/after taken on different days measures the days.

REV's ``src`` is taken out of git into a temporary directory. Each round runs each
scenario once with REV and once with this checkout, alternating which goes first; the
harness (this checkout's ``bench``), the servers and the ceilings are the same for
both. What is compared is each scenario's headline figures: the median over the
rounds of each version, their change, and each round's pair, so a difference smaller
than the rounds' spread reads as what it is."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import ROOT, child_env, code_from, median

Result = dict[str, Any]
Figures = dict[str, float]


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """REV's ``src`` in a temporary directory (removed on exit)."""
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "src"],
        capture_output=True, check=False,
    )  # fmt: skip
    if tar.returncode:
        raise SystemExit(f"--against {rev}: git archive failed: {tar.stderr.decode()[-500:]}")
    with tempfile.TemporaryDirectory(prefix="anarchon-against-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as archive:
            archive.extractall(tmp, filter="data")
        src = Path(tmp) / "src"
        with code_from(src):
            where = subprocess.run(
                [sys.executable, "-c", "import anarchon; print(anarchon.__file__)"],
                capture_output=True, text=True, env=child_env(), cwd=ROOT, check=False,
            )  # fmt: skip
        if not where.stdout.strip().startswith(str(src)):
            raise SystemExit(f"--against {rev}: its anarchon would not be imported: {where}")
        yield src


def _throughput(result: Result) -> Figures:
    out: Figures = {}
    for row in result["saturation"]:
        n = row["instances"]
        out[f"{n} instance(s): decided slots/s"] = row["decided_per_sec"]
        out[f"{n} instance(s): efficiency"] = row["efficiency"]
        out[f"{n} instance(s): overhead"] = row["overhead"]
        out[f"{n} instance(s): CPU us/slot"] = row["cpu_us_per_slot"]
        out[f"{n} instance(s): server us/slot"] = row["server_us_per_slot"]
    for name, part in result["scripts"].items():
        out[f"server us per {name}"] = part["server_us"]
    return out


def _each(rows: list[Result], name: Callable[[Result], str], fields: dict[str, str]) -> Figures:
    """``fields`` (key: label) of each row, named by ``name(row)``."""
    return {f"{name(row)}: {label}": row[key] for row in rows for key, label in fields.items()}


_LATE = {"p50_ms": "p50 ms", "p99_ms": "p99 ms"}


def _latency(result: Result) -> Figures:
    fields = {**_LATE, "cpu_us_per_slot": "CPU us/slot"}
    return _each(result["loads"], lambda row: f"{row['instances']} x {row['jobs']}", fields)


def _cost(result: Result) -> Figures:
    return {f"{row['label']}: commands/run": row["commands_per_run"] for row in result["rows"]}


def _idle(result: Result) -> Figures:
    return {f"{r['jobs']} jobs: CPU s/minute": r["cpu_sec_per_minute"] for r in result["rows"]}


def _takeover(result: Result) -> Figures:
    return {
        f"{row['stop']} lease {row['lease_ms']} ms: median ms": row["median_ms"]
        for row in result["rows"]
    }


def _timers(result: Result) -> Figures:
    fields = {
        "per_sec": "fired/s",
        "efficiency": "efficiency",
        "cpu_us_per_firing": "CPU us/firing",
        "overhead": "overhead",
    }
    return {
        **_each(
            result["lateness"], lambda row: f"timers {row['rate']}/s x {row['instances']}", _LATE
        ),
        **_each(
            result.get("saturation", []),
            lambda row: f"timers all due, {row['instances']} instance(s)",
            fields,
        ),
        **{
            f"set: {name}": result["set"][key]
            for key, name in (
                ("awaited_ratio", "set_timer awaited / raw"),
                ("pipelined_ratio", "set_timers lists / raw"),
            )
            if "set" in result
        },
    }


def _observe(result: Result) -> Figures:
    out: Figures = {}
    if result["watched_vs_off"] is not None:
        out["watched vs off"] = result["watched_vs_off"]
    for what, row in result["beside"].items():
        out[f"{what} vs off (beside)"] = row["cpu_us_per_slot"] / row["off_cpu_us_per_slot"] - 1
    return out


def _kit(result: Result) -> Figures:
    days = [row["sec_per_day"] for row in result["rows"]]
    return {"kit: median s per virtual day": median(days), "kit: slowest": max(days)}


FIGURES: dict[str, Callable[[Result], Figures]] = {
    "throughput": _throughput,
    "latency": _latency,
    "cost": _cost,
    "idle": _idle,
    "takeover": _takeover,
    "timers": _timers,
    "kit": _kit,
    "observe": _observe,
}


def figures(name: str, result: Result) -> Figures:
    """The scenario's headline figures (none for a scenario without any)."""
    pick = FIGURES.get(name)
    if pick is None:
        return {}
    return {key: float(value) for key, value in pick(result).items() if value is not None}


def markdown_against(name: str, rev: str, rounds: list[tuple[Figures, Figures]]) -> str:
    """A table: each figure's median with REV and with this checkout, the change, and
    each round's pair (REV -> this checkout)."""
    keys = list(dict.fromkeys(k for before, after in rounds for k in (*before, *after)))
    if not keys:
        return f"{name}: no headline figures to compare."
    lines = [
        f"{name}: {rev} (before) against this checkout (after), {len(rounds)} interleaved round(s)",
        "",
        "| figure | before (median) | after (median) | change | rounds, before -> after |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key in keys:
        before = [b[key] for b, _ in rounds if key in b]
        after = [a[key] for _, a in rounds if key in a]
        if not before or not after:
            continue
        b, a = median(before), median(after)
        change = f"{(a - b) / b * 100:+.1f}%" if b else "n/a"
        pairs = "; ".join(
            f"{_fmt(x[key])} -> {_fmt(y[key])}" for x, y in rounds if key in x and key in y
        )
        lines.append(f"| {key} | {_fmt(b)} | {_fmt(a)} | {change} | {pairs} |")
    return "\n".join(lines)


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
