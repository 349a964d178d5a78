"""A reference model of the lease rules, in plain Python.

Written from the design's lease section and the seed's flowchart, not from the
implementation: it imports nothing from anarchon. The state machine compares
every reply of the real scripts with this model's.

Rules (design section 3):
- claim with no state: unless overlap is allowed, a job's runs go one at a time,
  oldest first: while another run of the job is unsettled (a live lease, a
  retry pending, or an orphan) answer overlap, with the longest time left on
  those leases and retry delays (a first claim that skips when blocked settles
  the slot as skipped, attempt 0, with a result); else win attempt 1.
- claim of a running slot: the caller's own token gets its win back while the
  lease is live; a live lease answers running (time left); an expired one ends
  that attempt (interrupted; its token holds nothing any more, so the old
  runner's finish reports the loss) and, with attempts left, the run waits for
  its next attempt at once; without, the run is interrupted (done).
- claim of a run waiting for a retry: before the retry time, running (time left);
  then, unless another slot holds a live lease (running, its time left), win the
  next attempt (trigger takeover after an expired attempt, else retry).
- heartbeat: only the current token of a running slot, expired or not (but an
  expired lease is not revived while another slot holds a live one, unless
  overlap is allowed); extends the lease to now + lease.
- finish: only the current token of a running slot. ok settles ok; failed or
  cancelled with attempts left waits for a retry (cancelled: at once); without
  attempts left settles with the outcome.
- Every win raises the job's fence: to the clock in microseconds, or one more than
  the last within the same millisecond (so fences grow across a wiped store and a
  promoted replica that lacks the last wins).
- A first claim of a slot also reports orphans: other unsettled slots whose
  lease expired or whose retry is due.
- max_attempts comes with each claim and finish (a manual run is claimed with 1;
  a backup taking over an orphan sends the job's).
- Remembering: the store may forget a settled run once both its instant and its
  settling are more than keep_ms ago; it must remember every other run
  (``must_remember``). Only a first claim may start a run: a later claim (a
  backup's, a retry's) of a slot without state is told done, forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunState:
    status: str  # running, retry, ok, failed, interrupted, cancelled, skipped
    attempt: int
    token: str
    until_ms: int
    fence: int
    trigger: str
    slot_ms: int


@dataclass
class Reply:
    kind: str
    attempt: int = 0
    fence: int = 0
    wait_ms: int = 0
    trigger: str = ""
    status: str = ""
    orphans: frozenset[str] = frozenset()


@dataclass
class JobModel:
    lease_ms: int
    allow_overlap: bool
    runs: dict[str, RunState] = field(default_factory=dict)
    fence: int = 0
    # The slot of the last run that took a lease: a win, or a lease a heartbeat revived.
    holder: str | None = None
    # Results recorded per (slot, attempt): the status each attempt ended with.
    results: dict[tuple[str, int], str] = field(default_factory=dict)
    # The runs that ended ok or finally failed (max_runs counts them).
    ended: int = 0

    def active(self) -> list[str]:
        return [slot for slot, run in self.runs.items() if run.status in ("running", "retry")]

    def _scan(self, slot: str, now: int, first_claim: bool) -> tuple[int | None, frozenset[str]]:
        """What blocks a claim of ``slot``, and the orphans. Without overlap a first claim
        is blocked by every other unsettled run (live, waiting for its retry, or orphaned),
        a retry only by a live lease. The time is the longest left on a blocking lease
        or retry delay (0 when only orphans block)."""
        blocked: int | None = None
        orphans = set()
        for other in self.active():
            if other == slot:
                continue
            run = self.runs[other]
            left = max(run.until_ms - now, 0)
            if left == 0:
                orphans.add(other)
            blocks = first_claim or (run.status == "running" and left > 0)
            if blocks and not self.allow_overlap:
                blocked = max(blocked or 0, left)
        return blocked, frozenset(orphans)

    def must_remember(self, now: int, keep_ms: int) -> set[str]:
        """The runs the store may not have forgotten at ``now``."""
        horizon = now - keep_ms
        return {
            slot
            for slot, run in self.runs.items()
            if run.status in ("running", "retry")
            or run.slot_ms >= horizon
            or run.until_ms >= horizon
        }

    def _win(
        self, slot: str, slot_ms: int, attempt: int, token: str, trigger: str, now: int
    ) -> Reply:
        # Fences follow the clock in microseconds, one up within a millisecond.
        self.fence = max(self.fence + 1, now * 1000)
        self.holder = slot
        self.runs[slot] = RunState(
            "running", attempt, token, now + self.lease_ms, self.fence, trigger, slot_ms
        )
        return Reply("won", attempt, self.fence, self.lease_ms, trigger)

    def forget(self, slots: set[str]) -> None:
        """The store forgot these runs (each one it was allowed to)."""
        for slot in slots:
            del self.runs[slot]

    def claim(
        self,
        slot: str,
        slot_ms: int,
        token: str,
        trigger: str,
        now: int,
        max_attempts: int,
        may_start: bool = True,
        skip_if_blocked: bool = False,
    ) -> Reply:
        run = self.runs.get(slot)
        if run is None and not may_start:
            return Reply("done", status="forgotten")
        if run is None:
            blocked, orphans = self._scan(slot, now, first_claim=True)
            if blocked is not None:
                if skip_if_blocked:
                    self.runs[slot] = RunState("skipped", 0, "", now, 0, trigger, slot_ms)
                    self.results[(slot, 0)] = "skipped"
                return Reply("overlap", wait_ms=blocked, orphans=orphans)
            reply = self._win(slot, slot_ms, 1, token, trigger, now)
            reply.orphans = orphans
            return reply
        if run.status == "skipped" and may_start:
            # A first claim of a skipped slot still hears of orphans.
            return Reply("done", status="skipped", orphans=self._scan(slot, now, True)[1])
        if run.status == "running" and run.token == token and run.until_ms > now:
            return Reply("won", run.attempt, run.fence, run.until_ms - now, run.trigger)
        if run.status == "running":
            if run.until_ms > now:
                return Reply("running", wait_ms=run.until_ms - now)
            self.results[(slot, run.attempt)] = "interrupted"
            run.token = ""  # the expired attempt's token holds nothing any more
            if run.attempt >= max_attempts:
                run.status, run.until_ms = "interrupted", now
                self.ended += 1
                return Reply("done", status="interrupted")
            run.status, run.until_ms = "retry", now
        if run.status == "retry":
            if run.until_ms > now:
                return Reply("running", wait_ms=run.until_ms - now)
            blocked = self._scan(slot, now, first_claim=False)[0]
            if blocked is not None:
                return Reply("running", wait_ms=blocked)
            # An expired attempt left no token: its runner vanished (takeover).
            trigger = "takeover" if run.token == "" else "retry"
            return self._win(slot, run.slot_ms, run.attempt + 1, token, trigger, now)
        return Reply("done", status=run.status)

    def heartbeat(self, slot: str, token: str, now: int) -> bool:
        run = self.runs.get(slot)
        if run is None or run.token != token or run.status != "running":
            return False
        if run.until_ms <= now and not self.allow_overlap:
            # An expired lease is not revived while another run holds a live one.
            for other, other_run in self.runs.items():
                if other != slot and other_run.status == "running" and other_run.until_ms > now:
                    return False
        if run.until_ms <= now:
            self.holder = slot  # a revived lease is taken again
        run.until_ms = now + self.lease_ms
        return True

    def finish(
        self, slot: str, token: str, outcome: str, retry_delay_ms: int, now: int, max_attempts: int
    ) -> str:
        """The run's status afterwards, or 'lost'."""
        run = self.runs.get(slot)
        if run is None or run.token != token:
            return "lost"
        if run.status != "running":
            return run.status
        self.results[(slot, run.attempt)] = outcome
        if outcome == "ok":
            run.status, run.until_ms = "ok", now
        elif run.attempt < max_attempts:
            run.status = "retry"
            run.until_ms = now + (0 if outcome == "cancelled" else retry_delay_ms)
        else:
            run.status, run.until_ms = outcome, now
        if run.status in ("ok", "failed"):
            self.ended += 1
        return run.status
