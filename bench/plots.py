"""Plots of the results (PNG), when matplotlib is installed (extra ``bench``)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

Result = dict[str, Any]


def unavailable() -> str | None:
    """Why plots cannot be drawn, or None."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    return None


def _figure(width: float = 7.0, height: float = 4.2, cols: int = 1) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, cols, figsize=(width, height), squeeze=False)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def throughput(result: Result, out: Path) -> list[Path]:
    fig, axes = _figure()
    ax = axes[0][0]
    for instances in sorted({r["instances"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["instances"] == instances]
        line = ax.plot(
            [r["offered_per_sec"] for r in rows],
            [r["decided_per_sec"] for r in rows],
            marker="o",
            label=f"anarchon, {instances} instance(s)",
        )[0]
        raw = [c for c in result["raw_ceilings"] if c["processes"] == instances]
        if raw:
            ax.axhline(
                raw[0]["slots_per_sec"] / (1 + 1 / instances),
                linestyle="--",
                color=line.get_color(),
                label=f"cap: raw client ceiling / (1 + 1/{instances})",
            )
    ceiling = result["server_ceiling"].get("claims_per_sec")
    if ceiling:
        ax.axhline(ceiling, linestyle=":", color="black", label="server ceiling (1 claim/slot)")
    top = max(r["offered_per_sec"] for r in result["rows"])
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8, label="offered")
    ax.set_xlabel("jobs per second (offered slots/s)")
    ax.set_ylabel("decided slots per second")
    ax.set_title("Claim throughput against the ceilings of the same run")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return [_save(fig, out / "throughput.png")]


def latency(result: Result, out: Path) -> list[Path]:
    fig, axes = _figure()
    ax = axes[0][0]
    rows = result["loads"]
    labels = [f"{r['instances']} x {r['jobs']}" for r in rows]
    width = 0.2
    for offset, key in enumerate(("p50_ms", "p95_ms", "p99_ms", "max_ms")):
        ax.bar(
            [i + (offset - 1.5) * width for i in range(len(rows))],
            [r[key] for r in rows],
            width,
            label=key.removesuffix("_ms"),
        )
    ax.axhline(
        result["timer_floor_ms"]["median"], color="black", linestyle="--", label="timer floor"
    )
    ax.set_xticks(range(len(rows)), labels)
    ax.set_yscale("log")
    ax.set_xlabel("instances x jobs per second")
    ax.set_ylabel("slot instant to handler start, ms")
    ax.set_title("Fire latency")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return [_save(fig, out / "latency.png")]


def takeover(result: Result, out: Path) -> list[Path]:
    fig, axes = _figure()
    ax = axes[0][0]
    killed = [row for row in result["rows"] if row.get("stop", "SIGKILL") == "SIGKILL"]
    for row in killed:
        ax.scatter([row["lease_ms"]] * len(row["times_ms"]), row["times_ms"], color="C0")
    leases = [r["lease_ms"] for r in killed]
    ax.plot(leases, [r["bound_ms"] for r in killed], "k--",
            label="target: lease_ms + heartbeat_ms + 100")  # fmt: skip
    ax.plot(leases, leases, color="grey", linewidth=0.8, label="lease_ms")
    ax.set_xlabel("lease_ms (heartbeat_ms = lease_ms / 4)")
    ax.set_ylabel("SIGKILL to attempt 2 starting, ms")
    ax.set_title("Takeover")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return [_save(fig, out / "takeover.png")]


def scaling(result: Result, out: Path) -> list[Path]:
    curves = result["curves"]
    fig, axes = _figure(width=12, height=4.2, cols=len(curves))
    for ax, (curve, rows) in zip(axes[0], curves.items(), strict=True):
        if curve in ("jobs", "instances"):
            xs = [r[curve] for r in rows]
            ax.plot(xs, [r["decided_per_sec"] for r in rows], marker="o", label="decided/s")
            ax.set_xscale("log")
            ax.set_xlabel(curve if curve == "instances" else "jobs per second")
        else:
            labels = [
                f"{r['loop']}\n{r['client']}" if curve == "clients" else r["strategy"] for r in rows
            ]
            ax.bar(range(len(rows)), [r["decided_per_sec"] for r in rows], label="decided/s")
            ax.set_xticks(range(len(rows)), labels, fontsize=7)
            xs = list(range(len(rows)))
        ax.set_ylabel("decided slots per second")
        ax.set_ylim(bottom=0)
        twin = ax.twinx()
        twin.plot(xs, [r["p99_ms"] for r in rows], "r^", label="p99 ms")
        twin.set_yscale("log")
        twin.set_ylabel("p99 latency, ms", color="red")
        ax.set_title(f"vs {curve}")
        ax.grid(alpha=0.3)
    return [_save(fig, out / "scaling.png")]


DRAW: dict[str, Callable[[Result, Path], list[Path]]] = {
    "throughput": throughput,
    "latency": latency,
    "takeover": takeover,
    "scaling": scaling,
}


def draw(name: str, result: Result, out: Path) -> list[Path]:
    """The plots of one scenario's result (none for scenarios shown as tables only)."""
    drawer = DRAW.get(name)
    return drawer(result, out) if drawer is not None else []
