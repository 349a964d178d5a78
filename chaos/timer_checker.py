"""The timers' ledger checked against what the scenario set: every timer fired, and
each one fired again only for a reason.

A key's generation may start more than once only when the runner of the earlier start
could not keep its lease: it was killed, stopped, cut off or slowed (a fault window
of its own), its event loop stalled, the server was down meanwhile, or its handler
saw the lease lost. The later start must then hold a higher fence, and a higher
attempt unless the earlier firing was given back on a stop (it ended ``cancelled``;
a give-back does not count as an attempt). Anything else is an unexplained duplicate.
A timer set and never started is a miss.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from chaos.checker import Window, _percentile

#: Faults that keep an instance from renewing its leases.
_IMPAIRING = {"sigkill", "sigstop", "partition", "slow", "stall", "forced"}
#: Faults that keep every instance from it.
_SERVER = {"server-down", "promotion"}


@dataclass(frozen=True)
class TimerStart:
    key: str
    generation: int
    instance: str
    attempt: int
    fence: int
    wall_ms: int
    trigger: str
    due_ms: int
    line: str


@dataclass
class TimerReport:
    timers: int = 0
    fired: int = 0
    firings: int = 0
    duplicates: int = 0
    explained: dict[str, int] = field(default_factory=dict)
    unexplained: list[str] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)
    late_p99_ms: int = 0
    late_max_ms: int = 0
    takeovers: int = 0


def read_timer_ledgers(
    paths: list[Path],
) -> tuple[list[TimerStart], dict[tuple[str, int, str, int], str]]:
    """The firings started, and how each ended (``(key, generation, instance, fence)``
    -> outcome)."""
    starts: list[TimerStart] = []
    ends: dict[tuple[str, int, str, int], str] = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split("|")
            if parts[0] == "tstart" and len(parts) == 9 and parts[8].isdigit():
                starts.append(
                    TimerStart(parts[1], int(parts[2]), parts[3], int(parts[4]), int(parts[5]),
                               int(parts[6]), parts[7], int(parts[8]), line)
                )  # fmt: skip
            elif parts[0] == "tend" and len(parts) == 8:
                ends[(parts[1], int(parts[2]), parts[3], int(parts[5]))] = parts[6]
            # A torn last line (the writer was killed mid-write) is ignored.
    return starts, ends


def _reason(
    earlier: TimerStart, later: TimerStart, outcome: str | None, windows: list[Window]
) -> str | None:
    """Why ``earlier``'s runner may have lost its lease before ``later`` started."""
    if outcome in ("lost", "cancelled"):
        return f"ended {outcome}"
    for w in windows:
        overlaps = w.start_ms <= later.wall_ms and w.end_ms >= earlier.wall_ms
        if not overlaps:
            continue
        if w.kind in _IMPAIRING and w.instance == earlier.instance:
            return w.kind
        if w.kind in _SERVER:
            return w.kind
    return None


def check_timers(
    starts: list[TimerStart],
    ends: dict[tuple[str, int, str, int], str],
    expected: dict[str, int],
    windows: list[Window],
) -> TimerReport:
    """``expected``: each key set and its generation."""
    report = TimerReport(timers=len(expected), firings=len(starts))
    by_firing: dict[tuple[str, int], list[TimerStart]] = {}
    for start in starts:
        by_firing.setdefault((start.key, start.generation), []).append(start)
    late: list[int] = []
    for key, generation in sorted(expected.items()):
        found = sorted(by_firing.get((key, generation), []), key=lambda s: s.wall_ms)
        if not found:
            report.misses.append(f"timer {key} generation {generation} never fired")
            continue
        report.fired += 1
        late.append(max(0, found[0].wall_ms - found[0].due_ms))
        for earlier, later in itertools.pairwise(found):
            report.duplicates += 1
            if later.trigger == "takeover":
                report.takeovers += 1
            outcome = ends.get((earlier.key, earlier.generation, earlier.instance, earlier.fence))
            given_back = outcome == "cancelled"
            higher = later.fence > earlier.fence and (later.attempt > earlier.attempt or given_back)
            reason = _reason(earlier, later, outcome, windows)
            if higher and reason is not None:
                report.explained[reason] = report.explained.get(reason, 0) + 1
            else:
                why = "no fault of its runner" if reason is None else "fence/attempt not higher"
                report.unexplained.append(
                    f"timer {key} fired twice ({why}): {earlier.line} (ended {outcome}) "
                    f"then {later.line}"
                )
    for (key, generation), found in by_firing.items():
        if expected.get(key) != generation:
            report.unexplained.append(
                f"timer {key} generation {generation} fired but was never set: {found[0].line}"
            )
    report.late_p99_ms = _percentile(late, 0.99)
    report.late_max_ms = max(late, default=0)
    return report
