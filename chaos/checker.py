"""Checks a scenario's ledger (what the handlers did) against its fault timeline and
the store's results (what the scripts recorded).

* A **duplicate** is a slot started more than once. It is *explained* only when the
  later start has a higher fence and, unless the store was wiped in between, a
  higher attempt, and the earlier runner was dead, stalled or cut off (a fault
  window of its instance, or the server being down, that began before the later
  start and after the earlier run began and had not ended ``slack_ms`` before it).
  A **promotion** of a replica loses the wins the replica had not seen yet (the
  primary acknowledged them, then died): for those alone, a later start on the
  promoted replica is explained whatever its attempt and fence, since the replica
  knew neither the slot's state nor the fence the primary had given.
* A **miss** is a slot due in the checked range that no handler started, that the
  store did not record (any result, e.g. ``skipped`` by overlap, ``interrupted``),
  and that no fault explains: not within ``recovery_ms`` of the server being down,
  wiped or replaced by a replica, and at least one instance was healthy (ready,
  alive, outside its own fault windows widened the same way) at the slot. A slow
  link whose round trip stays within ``keep_up_ms`` leaves its instance healthy.
* **Fences** grow across a wipe (every start after it has a higher fence than any
  before) and across a promotion from the promoted replica's counter on (every
  start after it has a higher fence than that counter). A fence handed out after
  a promotion that is not above the fence of a lost win is a **reused** fence
  (``fences_reused``), and unexplained: fences follow the server's clock, so a
  win after the promotion is above every win before it, replicated or lost.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

FOREVER = 1 << 62


@dataclass(frozen=True)
class Start:
    slot: int
    job: str
    instance: str
    attempt: int
    fence: int
    server_ms: int
    wall_ms: int
    trigger: str
    line: str

    @property
    def key(self) -> tuple[str, int, str, int, int]:
        return (self.job, self.slot, self.instance, self.attempt, self.fence)


@dataclass(frozen=True)
class End:
    outcome: str
    wall_ms: int
    line: str


@dataclass(frozen=True)
class Result:
    slot: int
    attempt: int
    status: str
    fence: int
    runner: str
    error: str
    member: str


@dataclass
class Window:
    """A fault: ``instance`` None means every instance (the server was down...)."""

    kind: str
    start_ms: int
    end_ms: int = FOREVER
    instance: str | None = None
    wipe: bool = False
    #: A promotion (from the primary's kill to the proxies' redirect): each job's
    #: fence counter on the promoted replica. Replication applies the primary's
    #: writes in order, so the replica saw exactly the wins up to that fence.
    kept_fences: dict[str, int] | None = None
    #: A slow link: the longest delay each way.
    each_way_ms: int = 0


@dataclass
class Life:
    ready_ms: int
    ended_ms: int = FOREVER


@dataclass
class Report:
    slots: int = 0
    runs: int = 0
    duplicates: int = 0
    explained_duplicates: int = 0
    unexplained: list[str] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)
    ran: int = 0
    recorded: dict[str, int] = field(default_factory=dict)
    explained_gaps: int = 0
    late_max_ms: int = 0
    late_max_all_ms: int = 0
    late_p99_ms: int = 0
    takeovers_ms: list[int] = field(default_factory=list)
    explained_by: dict[str, int] = field(default_factory=dict)
    stalls: list[str] = field(default_factory=list)
    stalled_skips: list[str] = field(default_factory=list)
    stale_starts: list[str] = field(default_factory=list)
    unsettled: int = 0
    fence_checks: int = 0
    #: Starts whose win the promoted replica never saw (a promotion lost it).
    lost_wins: int = 0
    #: Duplicates explained by such a lost win, one line each.
    lost_write_duplicates: list[str] = field(default_factory=list)
    #: Fences handed out again after a promotion (a lost win had them), one line each.
    fences_reused: list[str] = field(default_factory=list)


def read_gaps(paths: list[Path], min_ms: int) -> list[Window]:
    """The event-loop stalls the instances noted, at least ``min_ms`` long, as
    ``stall`` windows (the ledger file is named ``ledger-<instance>.txt``)."""
    found = []
    for path in paths:
        if not path.exists():
            continue
        instance = path.stem.removeprefix("ledger-")
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split("|")
            if parts[0] == "gap" and len(parts) == 3 and parts[2].isdigit():
                begin, end = int(parts[1]), int(parts[2])
                if end - begin >= min_ms:
                    found.append(Window("stall", begin, end, instance))
    return found


def read_ledgers(
    paths: list[Path],
) -> tuple[list[Start], dict[tuple[str, int, str, int, int], End]]:
    starts: list[Start] = []
    ends: dict[tuple[str, int, str, int, int], End] = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split("|")
            if parts[0] == "start" and len(parts) == 9:
                starts.append(
                    Start(int(parts[1]), parts[2], parts[3], int(parts[4]), int(parts[5]),
                          int(parts[6]), int(parts[7]), parts[8], line)
                )  # fmt: skip
            elif parts[0] == "end" and len(parts) == 8:
                key = (parts[2], int(parts[1]), parts[3], int(parts[4]), int(parts[5]))
                ends[key] = End(parts[6], int(parts[7]), line)
            # A torn last line (the writer was killed mid-write) is ignored.
    return starts, ends


def parse_result(member: str) -> Result | None:
    parts = member.split("|", 8)
    if len(parts) < 9 or not parts[0].isdigit():
        return None  # a manual run, or a format this checker does not know
    return Result(int(parts[0]), int(parts[1]), parts[2], int(parts[5]), parts[7], parts[8], member)


def _percentile(values: list[int], q: float) -> int:
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def check(
    *,
    starts: list[Start],
    ends: dict[tuple[str, int, str, int, int], End],
    results: dict[str, dict[int, list[Result]]],
    windows: list[Window],
    lives: dict[str, Life],
    jobs: list[str],
    every_ms: int,
    check_from_ms: int,
    check_to_ms: int,
    slack_ms: int,
    recovery_ms: int,
    logs: dict[str, list[str]],
    loop_gaps: list[Window] | None = None,
    keep_up_ms: int = 0,
) -> Report:
    report = Report(runs=len(starts))
    by_slot: dict[tuple[str, int], list[Start]] = defaultdict(list)
    for start in starts:
        by_slot[(start.job, start.slot)].append(start)
    global_windows = [w for w in windows if w.instance is None]
    promotions = _promotions(windows)

    def windows_of(instance: str) -> list[Window]:
        return [w for w in windows if w.instance in (None, instance)]

    # -- duplicates ------------------------------------------------------------------
    for (job, slot), group in sorted(by_slot.items()):
        if len(group) < 2:
            continue
        # In the order of the wins (the fence), not of the handlers' starts: a stalled
        # runner can start an attempt after its successor started. Wins on a promoted
        # replica come after those on the primary it replaced, whatever their fences.
        group.sort(key=lambda s: (_epoch(s, promotions), s.fence, s.wall_ms))
        for earlier, later in itertools.pairwise(group):
            report.duplicates += 1
            if earlier.wall_ms > later.wall_ms:
                report.stale_starts.append(
                    f"{job} slot {slot}: {earlier.instance} started attempt {earlier.attempt} "
                    f"(fence {earlier.fence}) {earlier.wall_ms - later.wall_ms} ms after "
                    f"{later.instance} started attempt {later.attempt} (fence {later.fence}); "
                    f"store: {[r.member for r in results.get(job, {}).get(slot, [])]}"
                )
            reason = explain(earlier, later, ends.get(earlier.key), windows_of(earlier.instance),
                             global_windows, slack_ms, promotions)  # fmt: skip
            if reason is None:
                end = ends.get(earlier.key)
                report.unexplained.append(
                    f"duplicate {job} slot {slot}:\n    earlier {earlier.line}\n    "
                    f"earlier end {end.line if end else '(none)'}\n    later   {later.line}\n"
                    f"    later end {ends[later.key].line if later.key in ends else '(none)'}\n"
                    f"    store: {[r.member for r in results.get(job, {}).get(slot, [])]}\n"
                    f"    fault windows of {earlier.instance}: "
                    f"{[_fmt(w) for w in windows_of(earlier.instance)]}"
                )
            else:
                kind, takeover_ms = reason
                report.explained_duplicates += 1
                report.explained_by[kind] = report.explained_by.get(kind, 0) + 1
                if kind == "stall":
                    # Not a fault of ours: printed so that a reader can judge it.
                    gaps = [
                        _fmt(w) for w in windows_of(earlier.instance)
                        if w.kind == "stall" and w.start_ms <= later.wall_ms
                        and w.end_ms >= earlier.wall_ms - slack_ms
                    ]  # fmt: skip
                    report.stalls.append(
                        f"{job} slot {slot}: {earlier.instance} a{earlier.attempt} "
                        f"f{earlier.fence} -> {later.instance} a{later.attempt} "
                        f"f{later.fence} after {later.wall_ms - earlier.wall_ms} ms; "
                        f"stalls of {earlier.instance}: {gaps}"
                    )
                elif kind == "lost-write":
                    # The promotion lost the earlier win: printed, as a reader may not
                    # expect the attempt and fence that follow.
                    report.lost_write_duplicates.append(
                        f"{job} slot {slot}: {earlier.instance} a{earlier.attempt} "
                        f"f{earlier.fence} (a win the promoted replica never saw) -> "
                        f"{later.instance} a{later.attempt} f{later.fence}, "
                        f"{later.wall_ms - earlier.wall_ms} ms later"
                    )
                    report.takeovers_ms.append(takeover_ms)
                else:
                    report.takeovers_ms.append(takeover_ms)

    # -- fences keep growing across a wipe of the store ---------------------------------
    for w in global_windows:
        if not w.wipe:
            continue
        for job in jobs:
            before = [s for s in starts if s.job == job and s.wall_ms < w.start_ms]
            after = [s for s in starts if s.job == job and s.wall_ms > w.end_ms]
            if before and after:
                top = max(before, key=lambda s: s.fence)
                low = min(after, key=lambda s: s.fence)
                report.fence_checks += 1
                if low.fence <= top.fence:
                    report.unexplained.append(
                        f"fence regression of {job} across the wipe {_fmt(w)}:\n"
                        f"    before {top.line}\n    after  {low.line}"
                    )

    # -- and from the promoted replica's counter on, across a promotion ----------------
    for index, w in enumerate(promotions):
        kept_fences = w.kept_fences or {}
        for job in jobs:
            kept = kept_fences.get(job, 0)
            before = [s for s in starts if s.job == job and _epoch(s, promotions) == index]
            after = [s for s in starts if s.job == job and _epoch(s, promotions) == index + 1]
            lost = [s for s in before if s.fence > kept]
            report.lost_wins += len(lost)
            if not after:
                continue
            report.fence_checks += 1
            low = min(after, key=lambda s: s.fence)
            if low.fence <= kept:
                report.unexplained.append(
                    f"fence regression of {job} across the promotion {_fmt(w)}: the promoted "
                    f"replica's fence counter was {kept}, and after it\n    {low.line}"
                )
            if lost:
                # The replica's counter was behind the primary's: a counter alone would
                # hand the fences from it up to the last lost win's out a second time.
                top = max(lost, key=lambda s: s.fence)
                reused = [
                    f"{job}: fence {s.fence} handed out again after the promotion (slot "
                    f"{s.slot}, {s.instance} a{s.attempt}); the primary had given up to "
                    f"{top.fence} before it died (slot {top.slot}, {top.instance} "
                    f"a{top.attempt}), the replica had seen up to {kept}"
                    for s in sorted(after, key=lambda s: s.fence)
                    if s.fence <= top.fence
                ]
                report.fences_reused += reused
                report.unexplained += [f"fence reused: {x}" for x in reused]

    # -- settling --------------------------------------------------------------------
    killed = {w.instance for w in windows if w.kind in ("sigkill", "forced")}
    report.unsettled = sum(1 for s in starts if s.key not in ends and s.instance not in killed)

    # -- misses and lateness -----------------------------------------------------------
    first = math.ceil(check_from_ms / every_ms) * every_ms
    last = math.floor(check_to_ms / every_ms) * every_ms
    lateness_clean: list[int] = []
    for job in jobs:
        for slot in range(first, last + 1, every_ms):
            report.slots += 1
            ran = by_slot.get((job, slot))
            explained = _explained_gap(
                slot, global_windows, windows, lives, every_ms, recovery_ms, keep_up_ms
            )
            if ran:
                report.ran += 1
                first_start = min(ran, key=lambda s: s.wall_ms)
                late = first_start.wall_ms - slot
                report.late_max_all_ms = max(report.late_max_all_ms, late)
                # A slow link delays the start it carries: that lateness is the fault's.
                slowed = any(
                    w.kind == "slow" and w.instance == first_start.instance
                    and w.start_ms <= first_start.wall_ms and w.end_ms >= slot
                    for w in windows
                )  # fmt: skip
                if explained is None and not slowed:
                    lateness_clean.append(late)
                continue
            recorded = results.get(job, {}).get(slot)
            if recorded:
                status = ",".join(sorted({r.status for r in recorded}))
                report.recorded[status] = report.recorded.get(status, 0) + 1
                continue
            if explained is not None:
                report.explained_gaps += 1
                continue
            moment = str(datetime.fromtimestamp(slot / 1000, UTC))
            mentions = [
                f"      {name}: {line}"
                for name, lines in logs.items()
                for line in lines
                if f"{job}: slot {moment} " in line
            ][:12]
            healthy = _healthy(slot, windows, lives, every_ms, recovery_ms, keep_up_ms)
            stalled = [
                name
                for name in healthy
                if any(
                    w.instance == name
                    and w.start_ms <= slot + every_ms
                    and w.end_ms >= slot - every_ms // 2
                    for w in loop_gaps or []
                )
            ]
            logged_skip = any(" skipped" in m for m in mentions)
            if logged_skip and healthy and stalled == healthy:
                # Every instance's event loop stood still around the slot (nobody
                # injected that: the machine starved them), and the skip was logged.
                report.stalled_skips.append(
                    f"{job} slot {slot} ({moment}): every instance stalled "
                    f"({', '.join(stalled)}); {mentions[0].strip()}"
                )
                continue
            report.misses.append(
                f"miss {job} slot {slot}: no start in any ledger, nothing in the store, "
                f"healthy instances: {healthy}, of them with a loop stall: {stalled}\n"
                f"    neighbours: {_neighbours(by_slot, job, slot, every_ms)}"
                f"\n    windows: {[_fmt(w) for w in windows if w.kind != 'stall']}\n"
                + ("\n".join(mentions) if mentions else "      (no log line names the job)")
            )
    report.late_max_ms = max(lateness_clean, default=0)
    report.late_p99_ms = _percentile(lateness_clean, 0.99)
    return report


def explain(
    earlier: Start,
    later: Start,
    earlier_end: End | None,
    windows: list[Window],
    global_windows: list[Window],
    slack_ms: int,
    promotions: list[Window] | None = None,
) -> tuple[str, int] | None:
    """The fault and the takeover time (ms from the fault to the later start) if the
    duplicate is explained, else None. A ``stall`` (the runner's event loop noted it
    did not run) counts from a lease before the earlier start: its heartbeats may
    have stopped before its handler started. A ``lost-write``: a promotion lost the
    earlier win, and the later one was won on the promoted replica (or after)."""
    promotions = promotions or []
    lost_in = _lost_in(earlier, promotions)
    if lost_in is not None and _epoch(later, promotions) > _epoch(earlier, promotions):
        return "lost-write", later.wall_ms - lost_in.end_ms
    if later.fence <= earlier.fence:
        return None
    wiped = any(
        w.wipe and earlier.wall_ms - slack_ms <= w.start_ms <= later.wall_ms for w in global_windows
    )
    if later.attempt <= earlier.attempt and not wiped:
        return None
    for w in sorted(windows, key=lambda w: w.kind == "stall"):  # planned faults first
        began_in_time = w.start_ms <= later.wall_ms
        overlaps_run = w.end_ms >= earlier.wall_ms - (slack_ms if w.kind == "stall" else 0)
        run_alive = earlier_end is None or earlier_end.wall_ms >= w.start_ms - slack_ms
        if began_in_time and overlaps_run and run_alive:
            if w.instance is None and w.end_ms < FOREVER:
                return w.kind, later.wall_ms - w.end_ms  # after the server came back
            return w.kind, later.wall_ms - max(w.start_ms, earlier.wall_ms)
    return None


def _in(slot: int, w: Window, every_ms: int, recovery_ms: int) -> bool:
    end = w.end_ms if w.end_ms >= FOREVER else w.end_ms + recovery_ms
    return w.start_ms - every_ms <= slot <= end


def _promotions(windows: list[Window]) -> list[Window]:
    return sorted((w for w in windows if w.kept_fences is not None), key=lambda w: w.end_ms)


def _epoch(start: Start, promotions: list[Window]) -> int:
    """How many promotions came before ``start``'s win: 0 for a win on the first
    primary. A handler starts after its win's reply, and nobody reaches a promoted
    replica before the proxies are redirected to it (the window's end), so a start
    before that end was won on the primary before."""
    return sum(1 for w in promotions if start.wall_ms >= w.end_ms)


def _lost_in(start: Start, promotions: list[Window]) -> Window | None:
    """The promotion that lost ``start``'s win (the replica never saw it), if one did."""
    epoch = _epoch(start, promotions)
    if epoch >= len(promotions):
        return None
    w = promotions[epoch]
    return w if start.fence > (w.kept_fences or {}).get(start.job, 0) else None


def _impairs(w: Window, keep_up_ms: int) -> bool:
    """Whether a window of an instance makes it unhealthy: not its event loop's own
    stalls (judged apart), nor a slow link whose round trip stays within keep_up_ms."""
    if w.kind == "stall":
        return False
    return not (w.kind == "slow" and 2 * w.each_way_ms <= keep_up_ms)


def _healthy(
    slot: int,
    windows: list[Window],
    lives: dict[str, Life],
    every_ms: int,
    recovery_ms: int,
    keep_up_ms: int = 0,
) -> list[str]:
    healthy = []
    for name, life in lives.items():
        if not (life.ready_ms <= slot - every_ms and life.ended_ms > slot + every_ms):
            continue
        if any(
            w.instance == name and _impairs(w, keep_up_ms) and _in(slot, w, every_ms, recovery_ms)
            for w in windows
        ):
            continue
        healthy.append(name)
    return healthy


def _explained_gap(
    slot: int,
    global_windows: list[Window],
    windows: list[Window],
    lives: dict[str, Life],
    every_ms: int,
    recovery_ms: int,
    keep_up_ms: int = 0,
) -> str | None:
    for w in global_windows:
        if _in(slot, w, every_ms, recovery_ms):
            return w.kind
    if not _healthy(slot, windows, lives, every_ms, recovery_ms, keep_up_ms):
        return "no healthy instance"
    return None


def _fmt(w: Window) -> str:
    end = "end" if w.end_ms >= FOREVER else str(w.end_ms)
    who = w.instance or "all"
    slow = f" {w.each_way_ms}ms" if w.each_way_ms else ""
    return f"{w.kind}[{who} {w.start_ms}..{end}{' wipe' if w.wipe else ''}{slow}]"


def _neighbours(
    by_slot: dict[tuple[str, int], list[Start]], job: str, slot: int, every_ms: int
) -> list[str]:
    return [s.line for d in (-every_ms, every_ms) for s in by_slot.get((job, slot + d), [])]
