"""The lease scripts against a reference model, step by step, on a real server.

Several simulated instances claim slots of one job, heartbeat, finish (ok,
failed, cancelled), crash (stop heartbeating and forget their tokens), and time
advances. Every reply of the real scripts must equal the model's
(property_tests/model.py), and after every step the invariants hold:

1. Exclusive: each slot's state holds one token; a live lease belongs to the
   model's current attempt.
2. No overlap: without overlap, at most one slot holds a live lease.
3. Attempts: attempts are numbered 1..max_attempts, never more.
4. Fencing: a stale token's heartbeat or finish changes nothing and reports loss.
6. Settled: a run without live lease or pending retry is settled.
7. Bounded: the state holds the model's slots and the fence counter, nothing else.
"""

from __future__ import annotations

import secrets
import uuid

import redis
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from property_tests.lease_scripts import timed_script
from property_tests.model import JobModel, Reply
from tests.servers import MATRIX_FIRST, ServerSpec, matrix, running_server

LEASE_MS = 1000
RETRY_DELAY_MS = 300
INSTANCES = ["a", "b", "c"]


class LeaseMachine(RuleBasedStateMachine):
    held = Bundle("held")  # (instance, slot, token) of attempts an instance believes it holds

    server: ServerSpec = MATRIX_FIRST

    def __init__(self) -> None:
        super().__init__()
        self.client = redis.Redis.from_url(
            running_server(self.server), protocol=2, decode_responses=True
        )
        self.scripts = {
            name: self.client.script_load(timed_script(name))
            for name in ("claim", "heartbeat", "finish")
        }
        self.now = 1_800_000_000_000
        tag = "{" + f"pm{uuid.uuid4().hex[:8]}:job" + "}"
        self.keys = [
            f"{tag}:state",
            f"{tag}:active",
            f"{tag}:slots",
            f"{tag}:runs",
            f"{tag}:results",
        ]
        self.model: JobModel | None = None

    @initialize(max_attempts=st.integers(1, 3), allow_overlap=st.booleans())
    def configure(self, max_attempts: int, allow_overlap: bool) -> None:
        self.model = JobModel(LEASE_MS, max_attempts, allow_overlap)

    def teardown(self) -> None:
        self.client.delete(*self.keys)
        self.client.close()

    # -- calling the real scripts, clock last

    def _claim(self, instance: str, slot: str, token: str) -> Reply:
        assert self.model is not None
        raw = self.client.evalsha(
            self.scripts["claim"], 5, *self.keys,
            slot, slot.lstrip("m").split("-")[0], token, instance, LEASE_MS,
            self.model.max_attempts, 1 if self.model.allow_overlap else 0, "schedule",
            10**9, 10**6, 0, 0, self.now,
        )  # fmt: skip
        kind = raw[0]
        if kind == "won":
            return Reply(
                "won", int(raw[1]), int(raw[2]), int(raw[3]), raw[4], orphans=frozenset(raw[5])
            )
        if kind == "overlap":
            return Reply("overlap", wait_ms=int(raw[1]), orphans=frozenset(raw[2]))
        if kind == "running":
            return Reply("running", wait_ms=int(raw[1]))
        return Reply("done", status=raw[1])

    # -- rules

    @rule(target=held, instance=st.sampled_from(INSTANCES), slot=st.integers(0, 5))
    def claim(self, instance: str, slot: int):  # type: ignore[no-untyped-def]
        assert self.model is not None
        slot_id = str(1_800_000_000_000 + slot * 1000)
        token = secrets.token_hex(4)
        expected = self.model.claim(slot_id, token, "schedule", self.now)
        got = self._claim(instance, slot_id, token)
        if expected.kind == "overlap" or (expected.kind == "running" and got.kind == "running"):
            # The time left is the first live lease the script meets: compare presence.
            assert (got.kind, got.wait_ms > 0) == (expected.kind, expected.wait_ms > 0)
            assert got.orphans == expected.orphans
        else:
            assert got == expected, (got, expected)
        if got.kind == "won":
            return (instance, slot_id, token)
        return multiple()

    @rule(attempt=held)
    def heartbeat(self, attempt: tuple[str, str, str]) -> None:
        assert self.model is not None
        _, slot_id, token = attempt
        before = self.client.hget(self.keys[0], slot_id)
        expected = self.model.heartbeat(slot_id, token, self.now)
        overlap = 1 if self.model.allow_overlap else 0
        got = self.client.evalsha(
            self.scripts["heartbeat"], 2, self.keys[0], self.keys[1], slot_id, token, LEASE_MS,
            overlap, self.now,
        )  # fmt: skip
        assert (int(got[0]) == 1) == expected
        if not expected:  # invariant 4: a stale token changes nothing
            assert self.client.hget(self.keys[0], slot_id) == before

    @rule(attempt=consumes(held), outcome=st.sampled_from(["ok", "failed", "cancelled"]))
    def finish(self, attempt: tuple[str, str, str], outcome: str) -> None:
        assert self.model is not None
        _, slot_id, token = attempt
        before = self.client.hgetall(self.keys[0])
        expected = self.model.finish(slot_id, token, outcome, RETRY_DELAY_MS, self.now)
        got = self.client.evalsha(
            self.scripts["finish"], 3, self.keys[0], self.keys[1], self.keys[4],
            slot_id, slot_id, token, outcome, self.model.max_attempts, RETRY_DELAY_MS, "",
            10**6, 0, self.now,
        )  # fmt: skip
        if expected == "lost":
            assert got[0] == "lost"
            assert self.client.hgetall(self.keys[0]) == before  # invariant 4
        else:
            assert (got[0], got[1]) == ("settled", expected)

    @rule(attempt=consumes(held))
    def crash(self, attempt: tuple[str, str, str]) -> None:
        """The runner dies: it never heartbeats or finishes this attempt again."""

    @rule(ms=st.sampled_from([1, 100, 299, 300, 500, 999, 1000, 1001, 2500]))
    def advance_time(self, ms: int) -> None:
        self.now += ms

    # -- invariants

    @invariant()
    def state_matches_the_model(self) -> None:
        if self.model is None:
            return
        state = self.client.hgetall(self.keys[0])
        fence = state.pop("fence", "0")
        assert int(fence) == self.model.fence  # invariant 7: nothing but slots and the fence
        assert set(state) == set(self.model.runs)
        for slot_id, raw in state.items():
            status, attempt, token, until_ms, run_fence, trigger, _, _ = raw.split("|", 7)
            run = self.model.runs[slot_id]
            assert (status, int(attempt), token, int(until_ms), int(run_fence), trigger) == (
                run.status, run.attempt, run.token, run.until_ms, run.fence, run.trigger,
            )  # fmt: skip
            assert 1 <= int(attempt) <= self.model.max_attempts  # invariant 3
        assert set(self.client.smembers(self.keys[1])) == set(self.model.active())

    @invariant()
    def at_most_one_live_lease_without_overlap(self) -> None:
        if self.model is None or self.model.allow_overlap:
            return
        live = [
            s for s, r in self.model.runs.items() if r.status == "running" and r.until_ms > self.now
        ]
        assert len(live) <= 1  # invariant 2

    @invariant()
    def results_match_the_model(self) -> None:
        if self.model is None:
            return
        members = self.client.zrange(self.keys[4], 0, -1)
        recorded = {(m.split("|")[0], int(m.split("|")[1])): m.split("|")[2] for m in members}
        assert recorded == self.model.results


# One test case per server of the matrix (all of them in CI).
for _spec in matrix():
    _machine = type(f"LeaseMachine_{_spec.id}", (LeaseMachine,), {"server": _spec})
    globals()[f"TestLeaseMachine_{_spec.id.replace('-', '_').replace('.', '_')}"] = (
        _machine.TestCase
    )


def test_the_timed_scripts_differ_from_the_shipped_ones_only_in_the_clock_read() -> None:
    import difflib

    from anarchon._scripts import lease_script
    from property_tests.lease_scripts import CLOCK_ARGUMENT, CLOCK_READ

    for name in ("claim", "heartbeat", "finish"):
        shipped = lease_script(name).body.splitlines()
        timed = timed_script(name).splitlines()
        changed = [line for line in difflib.unified_diff(shipped, timed, lineterm="", n=0)
                   if line[:1] in "+-" and not line.startswith(("+++", "---"))]  # fmt: skip
        removed = [line[1:] for line in changed if line.startswith("-")]
        added = [line[1:] for line in changed if line.startswith("+")]
        assert removed == CLOCK_READ.splitlines()[1:3]
        assert added == CLOCK_ARGUMENT.splitlines()[1:2]
