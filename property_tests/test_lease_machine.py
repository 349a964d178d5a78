"""The lease scripts against a reference model, step by step, on a real server.

Three simulated instances, each with its own clock offset (up to the lateness
window either way), run one job the way the scheduler does: a first claim of a
slot only while the instance's own clock says the slot is at most the lateness
window old; a backup asks again when the answer's time runs out; orphans
reported by a claim are taken over at once; ``run_now`` claims a manual slot
with one attempt. Handlers heartbeat, finish ok / failed / cancelled, or hang
(stop heartbeating); instances stop (cancelling and releasing what they hold),
crash (forgetting everything) and start again with another clock; time
advances; every instance claims the slots the others claimed too. Every reply of
the real scripts must equal the model's (property_tests/model.py), a backup's
"running" wait included (to the millisecond: a backup told to wait longer takes
over late), and after every step the invariants hold:

1. Exclusive: each slot's state holds one token; a live lease belongs to the
   model's current attempt.
2. No overlap: without overlap, at most one slot holds a live lease.
3. Attempts: attempts are numbered 1..max_attempts, never more.
4. Fencing: a stale token's heartbeat or finish changes nothing and reports loss.
5. Remembered: no slot is won as attempt 1 twice, and the store still holds
   every run a late, catch-up or backup claim could ask about.
6. Settled: a run without live lease or pending retry is settled.
7. Bounded: the state holds the model's runs and the fence counter, nothing
   else, and after a first claim nothing the store may forget.
8. Skew-proof: the instances' clock offsets change none of the above.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from property_tests.lease_scripts import timed_script
from property_tests.model import JobModel, Reply
from property_tests.profiles import examples
from tests.servers import MATRIX_FIRST, ServerSpec, matrix, running_server

pytestmark = pytest.mark.server_tier

LEASE_MS = 1000
RETRY_DELAY_MS = 300
# A failed attempt's retry delay: shorter than the lease, or longer (the scheduler's
# default starts at 1 s and doubles), so that a backup asking at the end of the lease
# often finds the retry still waiting.
RETRY_DELAYS = st.sampled_from([RETRY_DELAY_MS, 2500])
LATE_MS = 1500  # the lateness window: a first claim only of slots this young
KEEP_MS = 2 * LATE_MS + LEASE_MS + 500  # what the scheduler sends, without its minute
TRIM_PER_CLAIM = 32  # the claim script forgets at most this many runs per first claim
BASE_MS = 1_800_000_000_000
INSTANCES = ("a", "b", "c")
OFFSETS = st.integers(-LATE_MS, LATE_MS)
# How old (by the instance's clock) a slot may be when a claim that waited behind an
# older run still may start it (the scheduler's start_limit_ms: the lateness window plus
# a lease plus a margin, well inside KEEP_MS whatever the clock offsets).
START_LIMIT_MS = LATE_MS + LEASE_MS + 250


@dataclass
class Held:
    """An attempt an instance believes it runs."""

    token: str
    max_attempts: int
    first: bool  # won by the instance's first claim of the slot
    won_at: int


@dataclass
class Instance:
    name: str
    offset_ms: int
    up: bool = True
    held: dict[str, Held] = field(default_factory=dict)  # slot -> attempt
    # slot -> (when, trigger, may_start) of the instance's next claim of it
    asks: dict[str, tuple[int, str, bool]] = field(default_factory=dict)
    first_claims: set[str] = field(default_factory=set)


def slot_ms_of(slot: str) -> int:
    return int(slot.lstrip("m").split("-")[0])


class LeaseMachine(RuleBasedStateMachine):
    server: ServerSpec = MATRIX_FIRST

    def __init__(self) -> None:
        super().__init__()
        self.client = self.connect(self.primary_url())
        self.now = BASE_MS
        self.manual_runs = 0
        tag = "{" + f"pm{uuid.uuid4().hex[:8]}:job" + "}"
        self.keys = [
            f"{tag}:{name}" for name in ("state", "active", "slots", "runs", "results", "permits")
        ]
        self.model = JobModel(LEASE_MS, allow_overlap=False)
        self.max_attempts = 1
        self.instances: dict[str, Instance] = {}
        # Invariants 3 and 5: the fence of each attempt won, by (slot, attempt).
        self.wins: dict[tuple[str, int], int] = {}
        self.lost_wins: set[tuple[str, int]] = set()  # wins a failover lost

    def primary_url(self) -> str:
        return running_server(self.server)

    @staticmethod
    def connect(url: str) -> redis.Redis:
        return redis.Redis.from_url(url, protocol=2, decode_responses=True)

    def configured(self) -> None:
        """Called once the job is configured, before the first write."""

    @initialize(
        max_attempts=st.integers(1, 3),
        allow_overlap=st.booleans(),
        offsets=st.tuples(OFFSETS, OFFSETS, OFFSETS),
    )
    def configure(self, max_attempts: int, allow_overlap: bool, offsets: tuple[int, ...]) -> None:
        self.max_attempts = max_attempts
        self.model = JobModel(LEASE_MS, allow_overlap)
        self.instances = {
            name: Instance(name, offset) for name, offset in zip(INSTANCES, offsets, strict=True)
        }
        self.configured()

    def teardown(self) -> None:
        self.client.delete(*self.keys)
        self.client.close()

    # -- the real scripts, clock last

    def call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        # EVAL (not EVALSHA) so that a promoted replica, whose script cache is
        # empty, runs them too.
        return self.client.eval(timed_script(name), len(keys), *keys, *args, self.now)

    def write_happened(self) -> None:
        """Called after every script call (a subclass records the model's states)."""

    def _claim(
        self,
        instance: Instance,
        slot: str,
        token: str,
        trigger: str,
        max_attempts: int,
        may_start: bool,
    ) -> Reply:
        # A scheduled slot's first claim skips the slot when it is blocked (the default
        # overlap policy); catch-up, retries and manual runs do not.
        skip = trigger == "schedule" and may_start
        self.forget_what_the_store_forgot()
        had_state = slot in self.model.runs
        fence_before = self.model.fence  # the store's too (checked after every step)
        must_forget = self._trimmable() if not had_state else set()
        expected = self.model.claim(
            slot, slot_ms_of(slot), token, trigger, self.now, max_attempts, may_start, skip
        )
        raw = self.call(
            "claim", self.keys,
            [slot, slot_ms_of(slot), token, instance.name, LEASE_MS, max_attempts,
             1 if self.model.allow_overlap else 0, trigger, KEEP_MS, 10**6, 0, 0,
             1 if may_start else 0, 1 if skip else 0, 0, 0, 0, 0, ""],
        )  # fmt: skip
        self.write_happened()
        got = self._reply(raw)
        event(f"claim: {got.kind} {got.status or got.attempt}, may_start={may_start}")
        if got.kind == "running":
            waits_for = self.model.runs[slot].status  # "running": a lease, "retry": a delay
            event(f"claim: running, waits for a {'lease' if waits_for == 'running' else waits_for}")
        # Exact, the wait of a "running" reply too: the model knows to the millisecond
        # when the lease or retry delay the backup waits for runs out (``until_ms`` on
        # the machine's clock, which is the server's: the instances' offsets move only
        # which slots they claim), and a backup that waited longer would take over late.
        assert got == expected, (got, expected)
        if got.kind == "running":
            assert got.wait_ms > 0
        if got.kind == "won" and got.fence > fence_before:
            # Invariants 3 and 5: each attempt of a slot is won once (attempt 1 too:
            # a slot is never started twice).
            assert (slot, got.attempt) not in self.wins, f"{slot} won attempt {got.attempt} twice"
            self.wins[(slot, got.attempt)] = got.fence
            if (slot, got.attempt) in self.lost_wins:
                event("a win lost in a failover was won again")
        if not had_state and may_start and len(must_forget) <= TRIM_PER_CLAIM:
            # Invariant 7: a first claim forgot every run the store may forget.
            assert not set(self.client.hkeys(self.keys[0])) & must_forget
        return got

    def forget_what_the_store_forgot(self) -> None:
        """The model forgets the runs the store forgot (the invariants check that the
        store forgot only what it may)."""
        forgotten = set(self.model.runs) - set(self.client.hkeys(self.keys[0]))
        if forgotten:
            event("the store forgot settled runs")
        self.model.forget(forgotten)

    @staticmethod
    def _reply(raw: list[Any]) -> Reply:
        """A claim's reply: ``{kind, attempt, fence, ms, text, orphans, malformed}``, and a
        win's progress after them (the store here holds nothing malformed: that list is
        empty; and no attempt here keeps progress)."""
        kind, attempt, fence, ms, text, orphans, malformed, *progress = raw
        assert malformed == [], malformed
        assert progress in ([], [""], [b""]), progress
        if kind == "won":
            return Reply("won", int(attempt), int(fence), int(ms), text, orphans=frozenset(orphans))
        if kind == "overlap":
            return Reply("overlap", wait_ms=int(ms), orphans=frozenset(orphans))
        if kind == "running":
            return Reply("running", wait_ms=int(ms))
        return Reply("done", status=text, orphans=frozenset(orphans))

    def attempts(self, slot: str) -> int:
        """What the scheduler sends: one attempt for a manual run, the job's otherwise."""
        return 1 if slot.startswith("m") else self.max_attempts

    def _trimmable(self) -> set[str]:
        return set(self.model.runs) - self.model.must_remember(self.now, KEEP_MS)

    def claim_as(
        self, instance: Instance, slot: str, trigger: str, max_attempts: int, may_start: bool
    ) -> Reply:
        """One claim as the scheduler makes it, and what the instance does with the answer:
        a backup asks again when the answer's time runs out (a claim waiting behind an
        overlapping run still may start it), orphans are taken over at once."""
        token = secrets.token_hex(4)
        instance.asks.pop(slot, None)
        got = self._claim(instance, slot, token, trigger, max_attempts, may_start)
        if got.kind == "won":
            instance.held[slot] = Held(token, max_attempts, may_start, self.now)
        elif got.kind == "running":
            instance.asks[slot] = (self.now + max(got.wait_ms, 1), trigger, False)
        elif got.kind == "overlap" and trigger not in ("schedule", "manual"):
            instance.asks[slot] = (self.now + max(got.wait_ms, 1), trigger, may_start)
        for orphan in sorted(got.orphans):
            if orphan not in instance.held and orphan not in instance.asks:
                self.claim_as(instance, orphan, "retry", self.attempts(orphan), may_start=False)
        return got

    # -- rules

    @rule(
        name=st.sampled_from(INSTANCES),
        lag=st.integers(0, LATE_MS - 1000),
        trigger=st.sampled_from(["schedule", "schedule", "catch-up"]),
    )
    def claim_a_due_slot(self, name: str, lag: int, trigger: str) -> None:
        """A first claim: the slot the instance's own clock says is ``lag`` ms or so old
        (at most the lateness window). A catch-up claim answered overlap waits behind
        the older run, as overlap="wait" does."""
        instance = self.instances[name]
        clock = self.now + instance.offset_ms
        slot_ms = (clock - lag) // 1000 * 1000
        slot = str(slot_ms)
        if not instance.up or slot_ms < BASE_MS or slot in instance.first_claims:
            return  # the instance does not claim it (again)
        instance.first_claims.add(slot)
        self.claim_as(instance, slot, trigger, self.max_attempts, may_start=True)

    def _slots_claimed_elsewhere(self, instance: Instance) -> list[str]:
        """The scheduled slots with a run in the store that ``instance`` has not claimed
        yet and would claim now: its own clock says they are due and young enough."""
        if not instance.up:
            return []
        clock = self.now + instance.offset_ms
        return sorted(
            slot
            for slot in self.model.runs
            if not slot.startswith("m")
            and slot not in instance.first_claims
            and 0 <= clock - slot_ms_of(slot) < LATE_MS
        )

    def _a_slot_is_claimed_elsewhere(self) -> bool:
        return any(self._slots_claimed_elsewhere(i) for i in self.instances.values())

    @precondition(_a_slot_is_claimed_elsewhere)
    @rule(data=st.data(), trigger=st.sampled_from(["schedule", "schedule", "catch-up"]))
    def claim_a_slot_another_instance_claimed(self, data: st.DataObject, trigger: str) -> None:
        """Every instance claims every slot: this one's first claim of a slot another
        instance already won (running, waiting for its retry, settled) or skipped. Its
        answer is a backup's "running" with the time left on that lease or retry delay,
        to the millisecond, or the slot's outcome."""
        names = [n for n, i in self.instances.items() if self._slots_claimed_elsewhere(i)]
        instance = self.instances[data.draw(st.sampled_from(names), label="instance")]
        slots = self._slots_claimed_elsewhere(instance)
        slot = data.draw(st.sampled_from(slots), label="slot")
        instance.first_claims.add(slot)
        self.claim_as(instance, slot, trigger, self.max_attempts, may_start=True)

    @rule(name=st.sampled_from(INSTANCES))
    def run_now(self, name: str) -> None:
        instance = self.instances[name]
        if not instance.up:
            return
        # A manual slot's id is unique, as the engine's is; numbered rather than random,
        # so that ids made at the same instant sort the same way in every run of an
        # example (a random suffix reordered them, the draws that follow, and the
        # server's scan of equal scores: Hypothesis saw the data generation change).
        self.manual_runs += 1
        slot = f"m{self.now + instance.offset_ms}-{self.manual_runs:04x}"
        self.claim_as(instance, slot, "manual", 1, may_start=True)

    def _held(self, data: st.DataObject) -> tuple[Instance, str, Held]:
        holders = [i for i in self.instances.values() if i.held]
        instance = data.draw(st.sampled_from(holders), label="instance")
        slot = data.draw(st.sampled_from(sorted(instance.held)), label="slot")
        return instance, slot, instance.held[slot]

    def _anyone_holds(self) -> bool:
        return any(i.held for i in self.instances.values())

    @precondition(_anyone_holds)
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        _, slot, held = self._held(data)
        self.forget_what_the_store_forgot()
        before = self.client.hget(self.keys[0], slot)
        expected = self.model.heartbeat(slot, held.token, self.now)
        overlap = 1 if self.model.allow_overlap else 0
        got = self.call(
            "heartbeat", [*self.keys[:2], self.keys[5]], [slot, held.token, LEASE_MS, overlap, 0]
        )
        self.write_happened()
        assert (int(got[0]) == 1) == expected
        if not expected:  # invariant 4: a stale token changes nothing
            assert self.client.hget(self.keys[0], slot) == before

    def _finish(
        self, instance: Instance, slot: str, outcome: str, retry_delay_ms: int = RETRY_DELAY_MS
    ) -> None:
        held = instance.held.pop(slot)
        self.forget_what_the_store_forgot()
        before = self.client.hgetall(self.keys[0])
        expected = self.model.finish(
            slot, held.token, outcome, retry_delay_ms, self.now, held.max_attempts
        )
        got = self.call(
            "finish", [self.keys[0], self.keys[1], self.keys[4], self.keys[5]],
            [slot, slot_ms_of(slot), held.token, outcome, held.max_attempts, retry_delay_ms,
             "", 10**6, 0, 0],
        )  # fmt: skip
        self.write_happened()
        if expected == "lost":
            assert got[0] == "lost"
            assert self.client.hgetall(self.keys[0]) == before  # invariant 4
        else:
            assert (got[0], got[1]) == ("settled", expected)

    @precondition(_anyone_holds)
    @rule(
        data=st.data(),
        outcome=st.sampled_from(["ok", "failed", "cancelled"]),
        retry_delay_ms=RETRY_DELAYS,
    )
    def finish(self, data: st.DataObject, outcome: str, retry_delay_ms: int) -> None:
        instance, slot, _ = self._held(data)
        self._finish(instance, slot, outcome, retry_delay_ms)

    @precondition(_anyone_holds)
    @rule(data=st.data())
    def repeat_a_claim(self, data: st.DataObject) -> None:
        """The reply to a claim was lost: the instance sends it again, same token (a first
        claim only while the slot is still young enough for the instance's clock)."""
        instance, slot, held = self._held(data)
        if held.first and self.now - held.won_at > LATE_MS:
            return
        self._claim(instance, slot, held.token, "schedule", held.max_attempts, held.first)

    @precondition(_anyone_holds)
    @rule(data=st.data())
    def hang(self, data: st.DataObject) -> None:
        """A handler hangs: its attempt is never heartbeated or finished again."""
        instance, slot, _ = self._held(data)
        del instance.held[slot]

    @rule(name=st.sampled_from(INSTANCES))
    def stop(self, name: str) -> None:
        """stop(): running handlers are cancelled and their leases released."""
        instance = self.instances[name]
        if not instance.up:
            return
        for slot in sorted(instance.held):
            self._finish(instance, slot, "cancelled")
        instance.asks.clear()
        instance.up = False

    @rule(name=st.sampled_from(INSTANCES))
    def crash(self, name: str) -> None:
        """The process dies: no heartbeat, finish or claim of it ever again."""
        instance = self.instances[name]
        instance.held.clear()
        instance.asks.clear()
        instance.up = False

    @rule(name=st.sampled_from(INSTANCES), ms=st.sampled_from([500, 2500, 6000]))
    def cut_off(self, name: str, ms: int) -> None:
        """The instance cannot reach the server for a while: its next claims (backups,
        waiting claims) are made that much later, with the same rights they had."""
        instance = self.instances[name]
        instance.asks = {
            slot: (at + ms, trigger, may_start)
            for slot, (at, trigger, may_start) in instance.asks.items()
        }

    @rule(name=st.sampled_from(INSTANCES), offset=OFFSETS)
    def start(self, name: str, offset: int) -> None:
        instance = self.instances[name]
        if instance.up:
            return
        self.instances[name] = Instance(name, offset)

    @rule(ms=st.sampled_from([1, 100, 299, 300, 500, 999, 1000, 1001, 2500, 6000]))
    def advance_time(self, ms: int) -> None:
        """Time passes; backups ask again exactly when their answers said to."""
        end = self.now + ms
        while True:
            due = [
                (at, name, slot, trigger, may_start)
                for name, instance in self.instances.items()
                for slot, (at, trigger, may_start) in instance.asks.items()
                if at <= end
            ]
            if not due:
                break
            at, name, slot, trigger, may_start = min(due)
            self.now = at
            instance = self.instances[name]
            if may_start and self.now + instance.offset_ms - slot_ms_of(slot) > START_LIMIT_MS:
                del instance.asks[slot]  # waited too long: the slot is skipped here
                continue
            self.claim_as(instance, slot, trigger, self.attempts(slot), may_start)
        self.now = end

    # -- invariants

    @invariant()
    def state_matches_the_model(self) -> None:
        state = self.client.hgetall(self.keys[0])
        fence = state.pop("fence", "0")
        assert int(fence) == self.model.fence  # invariant 7: nothing but runs, the fence,
        # the holder (the slot of the last run that took a lease) and the runs' count
        assert state.pop("holder", None) == self.model.holder
        # The runs that ended ok or finally failed, as max_runs counts them.
        assert int(state.pop("runs", "0")) == self.model.ended
        # When the last run that ended ok ended: there is one once one did.
        last_ok = state.pop("last-ok", None)
        assert (last_ok is not None) == any(r == "ok" for r in self.model.results.values())
        assert set(state) <= set(self.model.runs)
        # Invariant 5: every run a claim could still ask about is remembered.
        assert self.model.must_remember(self.now, KEEP_MS) <= set(state)
        for slot, raw in state.items():
            status, attempt, token, until_ms, run_fence, trigger, _, _ = raw.split("|", 7)
            run = self.model.runs[slot]
            assert (status, int(attempt), token, int(until_ms), int(run_fence), trigger) == (
                run.status, run.attempt, run.token, run.until_ms, run.fence, run.trigger,
            )  # fmt: skip
            if status == "skipped":
                assert int(attempt) == 0  # settled without an attempt
            else:
                assert 1 <= int(attempt) <= self.attempts(slot)  # invariant 3
        assert set(self.client.smembers(self.keys[1])) == set(self.model.active())

    @invariant()
    def at_most_one_live_lease_without_overlap(self) -> None:
        if self.model.allow_overlap:
            return
        live = [
            s for s, r in self.model.runs.items() if r.status == "running" and r.until_ms > self.now
        ]
        assert len(live) <= 1  # invariant 2

    @invariant()
    def results_match_the_model(self) -> None:
        members = self.client.zrange(self.keys[4], 0, -1)
        recorded = {(m.split("|")[0], int(m.split("|")[1])): m.split("|")[2] for m in members}
        assert recorded == self.model.results


# One test case per server of the matrix (all of them in CI).
for _spec in matrix():
    _machine = type(f"LeaseMachine_{_spec.id}", (LeaseMachine,), {"server": _spec})
    _case = _machine.TestCase
    _case.settings = settings(_case.settings, max_examples=examples(1000, _spec))
    _case.pytestmark = [
        pytest.mark.slow("1000 examples of up to 40 steps of the real scripts (the Lua mutants)")
    ]
    globals()[f"TestLeaseMachine_{_spec.id.replace('-', '_').replace('.', '_')}"] = _case
    del _case


def test_the_timed_scripts_differ_from_the_shipped_ones_only_in_the_clock_read() -> None:
    from anarchon._store.scripts import lease_script
    from property_tests.lease_scripts import CLOCK_ARGUMENT, CLOCK_READ

    for name in ("claim", "heartbeat", "finish"):
        shipped = lease_script(name).body
        assert shipped.count(CLOCK_READ) == 1
        assert timed_script(name) == shipped.replace(CLOCK_READ, CLOCK_ARGUMENT)
