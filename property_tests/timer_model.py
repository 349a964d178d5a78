"""A reference model of the durable timers' rules, in plain Python.

Written from the design's timers section (and docs/concepts/timers.md), not from the scripts:
it imports nothing from anarchon. The timer machine compares every reply of the real
scripts with this model's. Rules, per kind of timer:

- set(key, at or delay, schedule, payload): the newest set wins. It takes the kind's
  next generation (generations grow across a cancel and a new set of the key) and is
  due at ``at`` or ``now + delay``. A firing of the key in flight goes on (nothing can
  call it back) and the new generation waits until it settles; an old generation
  waiting for its retry is dropped.
- cancel(key): a pending timer (or one waiting for its retry) is forgotten. One whose
  firing is in flight keeps firing, but nothing follows it; cancelling it again, or a
  key with no timer, answers "nothing to cancel".
- claim(limit): takes the keys that need attention by now, earliest first (ties by
  key), at most ``limit`` of them. A key needs attention at its due time while it is
  pending, at its lease's expiry while it fires, at its retry time while it waits for a
  retry. For each taken key:
  - pending and due: the claimer wins attempt 1 (trigger ``due``);
  - firing with an expired lease: that attempt is over (its token holds nothing any
    more). If the key was set again or cancelled meanwhile, what is left is the new
    generation (pending, and won at once if it is due already) or nothing. Otherwise,
    with attempts left, the claimer wins the next attempt (``takeover``); out of
    attempts, a recurring timer is won as ``lapsed`` (same attempt: the claimer runs
    nothing and writes the next due time) and a one-shot timer is spent (the reply
    names it, so that the claimer can say so);
  - waiting for a retry that is due: the claimer wins the next attempt (``retry``).
  Every win holds a lease for ``lease_ms`` and raises the kind's fence (to the clock in
  microseconds, or one more than the last). The reply also says when the earliest key
  needs attention next, and whether the limit was reached.
  The same claim sent again (after a lost reply) also hears of the firings it won and
  still holds (with the time left on their leases).
- fleet limits (``max_concurrent_fleet``, ``rate_limit``): a firing in flight holds a
  permit while its lease lives (its finish gives it back; an expired one is free), and
  each win is a start; a claim takes no more keys than the permits free and the starts
  left in the window (``(now - period, now]``), so the rest wait in due order. When a
  limit leaves nothing to take, the reply's next time is no sooner than when a permit
  may free (the soonest lease's end) or the window opens (the oldest start + period).
- key groups (``group_by``, ``max_concurrent_per_group``): a key's group is its text
  before the first separator (the whole key without one). A win needs a permit of its
  group too (checked first); a key whose group holds every permit is not won but
  parked: it leaves the due index for the group's waiting set (at its score), and the
  groups index says when to look at the group again (its soonest permit's end, a
  second at most; a finish of one of its firings: at once). A claim first looks at up
  to 16 groups due in the index (by score, then name): as many of their waiting keys
  as they have permits free (64 at most, oldest first) go back to the due index (a key
  with no timer any more is dropped), and the group leaves the index once none waits,
  else is looked at again at once (more room than it moved), at its soonest permit's
  end, or a second later, whichever is first. The reply's next time is no later than
  the index's first. A set, a cancel that stores, a heartbeat or a finish writes the key
  to the due index again (it may stay in its group's waiting set too: moving it back
  reads it again).
- heartbeat(key, token): only the token of the firing in flight, expired or not (until
  someone took over), extends the lease to ``now + lease_ms``; with a fleet limit, only
  while a permit is free to it (its own, or one nobody else holds), and the same for its
  key group's, both checked before either is taken.
- finish(key, token, outcome, next): only the token of the firing in flight (a finish
  sent again after the firing moved on to a retry hears "settled" again). A cancelled
  attempt of the newest generation (given back: its instance stopped) is not counted:
  the same attempt may fire again at once. A failed one with attempts left waits for
  its retry delay. Otherwise the firing is over: if the key was set again or
  cancelled meanwhile, the new generation is pending (or nothing is left); else a rearm
  or a recurrence (``next``) makes the next generation, due then, with the same
  schedule and payload; else the timer is spent and forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class Timer:
    gen: int
    due_ms: int | None
    status: str  # pending, firing, retry
    schedule: str
    payload: str
    attempt: int = 0
    token: str = ""
    until_ms: int = 0
    fence: int = 0
    fire_gen: int = 0
    fire_due_ms: int = 0
    trigger: str = ""
    runner: str = ""

    def attention_ms(self) -> int:
        if self.status == "pending":
            assert self.due_ms is not None
            return self.due_ms
        return self.until_ms


@dataclass(frozen=True)
class Win:
    key: str
    gen: int
    due_ms: int
    attempt: int
    fence: int
    token: str
    trigger: str
    schedule: str
    payload: str
    lease_left_ms: int


@dataclass
class KindModel:
    timers: dict[str, Timer] = field(default_factory=dict)
    gen: int = 0
    fence: int = 0
    #: The keys each claim (by its token base) won.
    claimed: dict[str, set[str]] = field(default_factory=dict)
    #: The fleet limits (0: none): permits, and starts in any ``period_ms``.
    fleet_max: int = 0
    rate_max: int = 0
    period_ms: int = 0
    #: key -> when its permit expires; token -> when its firing started.
    permits: dict[str, int] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)
    #: Key groups: the separator and the limit (0: none); each group's permits (key ->
    #: expiry) and waiting keys (key -> score); the groups index (group -> when).
    group_by: str = ""
    group_max: int = 0
    group_permits: dict[str, dict[str, int]] = field(default_factory=dict)
    waiting: dict[str, dict[str, int]] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)
    #: Keys parked and not written to the due index since.
    out_of_due: set[str] = field(default_factory=set)

    def group_of(self, key: str) -> str:
        return key.split(self.group_by, 1)[0]

    @staticmethod
    def _free(permits: dict[str, int], key: str | None, now: int, most: int) -> int:
        """Drop the permits whose lease ended; those free to ``key``."""
        for member in [m for m, until in permits.items() if until <= now]:
            del permits[member]
        return most - len(permits) + (1 if key in permits else 0)

    def _stored(self, key: str) -> None:
        """The key was written to the due index again (or forgotten)."""
        self.out_of_due.discard(key)

    def _recheck_groups(self, now: int) -> None:
        due_groups = sorted(
            ((when, group.encode()), group) for group, when in self.groups.items() if when <= now
        )[:16]
        for _, group in due_groups:
            permits = self.group_permits.setdefault(group, {})
            free = self._free(permits, None, now, self.group_max)
            soonest = max(min(permits.values()) - now, 1) if permits else None
            waiting = self.waiting.setdefault(group, {})
            back = min(max(free, 0), 64)
            order = sorted(waiting, key=lambda k: (waiting[k], k.encode()))
            for key in order[:back]:
                del waiting[key]
                if key in self.timers:
                    self._stored(key)
            if not waiting:
                del self.groups[group]
            else:
                when = now + 1000
                if free > 64:
                    when = now
                elif soonest is not None:
                    when = min(now + soonest, when)
                self.groups[group] = when

    def _park(self, key: str, group: str, score: int, now: int) -> None:
        self.waiting.setdefault(group, {})[key] = score
        self.out_of_due.add(key)
        permits = self.group_permits.get(group, {})
        when = min([now + 1000, *permits.values()])
        if group not in self.groups or when < self.groups[group]:
            self.groups[group] = when

    def _next_gen(self) -> int:
        self.gen += 1
        return self.gen

    def set(self, key: str, now: int, at_ms: int | None, delay_ms: int | None,
            schedule: str, payload: str) -> tuple[int, int, bool]:  # fmt: skip
        """The new generation, when it is due, and whether it replaced a timer the key
        had (what a cancel would have found)."""
        due_ms = at_ms if at_ms is not None else now + (delay_ms or 0)
        gen = self._next_gen()
        old = self.timers.get(key)
        replaced = old is not None and not (old.status == "firing" and old.due_ms is None)
        if old is not None and old.status == "firing":
            old.gen, old.due_ms, old.schedule, old.payload = gen, due_ms, schedule, payload
        else:
            self.timers[key] = Timer(gen, due_ms, "pending", schedule, payload)
        self._stored(key)
        return gen, due_ms, replaced

    def cancel(self, key: str) -> bool:
        timer = self.timers.get(key)
        if timer is None or (timer.status == "firing" and timer.due_ms is None):
            return False
        if timer.status == "firing":
            timer.gen = self._next_gen()
            timer.due_ms, timer.schedule, timer.payload = None, "", ""
        else:
            del self.timers[key]
        self._stored(key)
        return True

    @staticmethod
    def _what_is_left(timer: Timer) -> Timer | None:
        if timer.gen != timer.fire_gen and timer.due_ms is not None:
            return Timer(timer.gen, timer.due_ms, "pending", timer.schedule, timer.payload)
        return None

    def _group_allows(self, key: str, timer: Timer, now: int, lease_ms: int) -> bool:
        """Whether the key's group has a permit free for it (then taken); else the key
        is parked, at its score in the due index."""
        if not self.group_max:
            return True
        group = self.group_of(key)
        permits = self.group_permits.setdefault(group, {})
        if self._free(permits, key, now, self.group_max) <= 0:
            self._park(key, group, timer.attention_ms(), now)
            return False
        permits[key] = now + lease_ms
        return True

    def _win(self, key: str, timer: Timer, now: int, attempt: int, trigger: str,
             lease_ms: int, runner: str, token_base: str) -> Win:  # fmt: skip
        self.fence = max(self.fence + 1, now * 1000)
        timer.status, timer.attempt, timer.fence = "firing", attempt, self.fence
        timer.trigger, timer.runner = trigger, runner
        timer.token, timer.until_ms = f"{token_base}:{self.fence}", now + lease_ms
        self.claimed.setdefault(token_base, set()).add(key)
        if self.fleet_max:
            self.permits[key] = timer.until_ms
        if self.rate_max:
            self.starts[timer.token] = now
        return Win(key, timer.fire_gen, timer.fire_due_ms, attempt, self.fence, timer.token,
                   trigger, timer.schedule, timer.payload, lease_ms)  # fmt: skip

    def claim(self, now: int, limit: int, lease_ms: int, runner: str, token_base: str,
              max_attempts: int) -> tuple[list[Win], int | None, bool, list[str]]:  # fmt: skip
        wins: list[Win] = []
        spent: list[str] = []
        prefix = token_base + ":"
        for key in sorted(self.claimed.get(token_base, ())):
            t = self.timers.get(key)
            if t and t.status == "firing" and t.until_ms > now and t.token.startswith(prefix):
                wins.append(Win(key, t.fire_gen, t.fire_due_ms, t.attempt, t.fence, t.token,
                                t.trigger, t.schedule, t.payload, t.until_ms - now))  # fmt: skip
        take, frees_at = limit, None
        if self.fleet_max:
            self.permits = {k: until for k, until in self.permits.items() if until > now}
            free = self.fleet_max - len(self.permits)
            if free < take:
                take = max(free, 0)
                if free <= 0:
                    frees_at = min(self.permits.values())
        if self.rate_max:
            self.starts = {t: at for t, at in self.starts.items() if at > now - self.period_ms}
            left = self.rate_max - len(self.starts)
            if left < take:
                take = max(left, 0)
                if left <= 0:
                    frees_at = max(frees_at or 0, min(self.starts.values()) + self.period_ms)
        if self.group_max:
            self._recheck_groups(now)
        taken = sorted(
            (t.attention_ms(), key)
            for key, t in self.timers.items()
            if t.attention_ms() <= now and key not in self.out_of_due
        )[:take]
        won = dict(lease_ms=lease_ms, runner=runner, token_base=token_base)
        for _, key in taken:
            timer: Timer | None = self.timers[key]
            assert timer is not None
            if timer.status == "firing":
                if timer.gen != timer.fire_gen:
                    timer = self._what_is_left(timer)
                elif timer.attempt < max_attempts:
                    if self._group_allows(key, timer, now, lease_ms):
                        wins.append(
                            self._win(key, timer, now, timer.attempt + 1, "takeover", **won)
                        )
                    continue
                elif timer.schedule:
                    if self._group_allows(key, timer, now, lease_ms):
                        wins.append(self._win(key, timer, now, timer.attempt, "lapsed", **won))
                    continue
                else:
                    timer = None
                    spent.append(key)
                if timer is None:
                    del self.timers[key]
                    continue
                self.timers[key] = timer
            if timer.status == "retry":
                if timer.gen == timer.fire_gen:
                    if self._group_allows(key, timer, now, lease_ms):
                        wins.append(self._win(key, timer, now, timer.attempt + 1, "retry", **won))
                else:
                    left = self._what_is_left(timer)
                    if left is None:
                        del self.timers[key]
                    else:
                        self.timers[key] = left
            elif (
                timer.status == "pending"
                and timer.attention_ms() <= now
                and self._group_allows(key, timer, now, lease_ms)
            ):
                timer.fire_gen, timer.fire_due_ms = timer.gen, timer.attention_ms()
                wins.append(self._win(key, timer, now, 1, "due", **won))
        next_ms = min(
            (t.attention_ms() for key, t in self.timers.items() if key not in self.out_of_due),
            default=None,
        )
        if next_ms is not None and frees_at is not None:
            next_ms = max(next_ms, frees_at)
        if self.group_max and self.groups:
            first_group = min(self.groups.values())
            if next_ms is None or first_group < next_ms:
                next_ms = first_group
        return wins, next_ms, take > 0 and len(taken) == take, spent

    def heartbeat(self, key: str, token: str, now: int, lease_ms: int) -> bool:
        timer = self.timers.get(key)
        if timer is None or timer.status != "firing" or timer.token != token:
            return False
        if self.fleet_max and self._free(self.permits, key, now, self.fleet_max) <= 0:
            return False
        group = self.group_permits.setdefault(self.group_of(key), {}) if self.group_max else {}
        if self.group_max and self._free(group, key, now, self.group_max) <= 0:
            return False
        if self.fleet_max:
            self.permits[key] = now + lease_ms
        if self.group_max:
            group[key] = now + lease_ms
        timer.until_ms = now + lease_ms
        self._stored(key)
        return True

    def finish(self, key: str, token: str, outcome: str, now: int, max_attempts: int,
               retry_delay_ms: int, next_at_ms: int | None,
               next_delay_ms: int | None) -> tuple[bool, str, int]:  # fmt: skip
        """``(held, status after, ms)``: status retry, pending or done."""
        timer = self.timers.get(key)
        if timer is None or timer.token != token:
            return False, "", 0
        if timer.status != "firing":
            return True, timer.status, max(timer.until_ms - now, 0)
        self.permits.pop(key, None)
        self._stored(key)
        if self.group_max:
            group = self.group_of(key)
            self.group_permits.get(group, {}).pop(key, None)
            if group in self.groups:
                self.groups[group] = now
        current = timer.gen == timer.fire_gen
        if current and outcome == "cancelled":
            # Given back: not counted; the same attempt fires again, at once.
            timer.status, timer.until_ms, timer.attempt = "retry", now, timer.attempt - 1
            return True, "retry", 0
        if current and outcome == "failed" and timer.attempt < max_attempts:
            timer.status, timer.until_ms = "retry", now + retry_delay_ms
            return True, "retry", retry_delay_ms
        left: Timer | None
        if not current:
            left = self._what_is_left(timer)
        elif next_at_ms is not None or next_delay_ms is not None:
            due = next_at_ms if next_at_ms is not None else now + (next_delay_ms or 0)
            left = Timer(self._next_gen(), due, "pending", timer.schedule, timer.payload)
        else:
            left = None
        if left is None:
            del self.timers[key]
            return True, "done", 0
        self.timers[key] = left
        assert left.due_ms is not None
        return True, "pending", max(left.due_ms - now, 0)

    def snapshot(self) -> dict[str, Timer]:
        return {key: replace(timer) for key, timer in self.timers.items()}
