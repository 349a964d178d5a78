"""The claim-only strategies as a state machine, on real servers.

Three instances (each its own store and connection, as separate processes
would have) claim slots of one job, several of them at the same moment, in any
order; winners record results; instances run manual runs and restart. The
history is kept short (``history_size`` 5), so the streams are trimmed all the
time. Checked after every step:

- At most one winner per slot, ever, whatever the interleaving.
- The model's answer: ``stream-id`` wins a slot only if it is later than every
  slot claimed before (it cannot catch up); ``idmp`` and ``script`` win any
  slot not claimed before (within their memory: minutes here).
- Manual runs and restarts change no claim's answer.
- Results hold the newest finished runs, each with the winner's runner.
"""

from __future__ import annotations

import secrets
import time
import uuid
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from anarchon import RedisBackend
from anarchon._store.contract import AttemptEnd, ClaimReply, ClaimRequest, Store
from property_tests.profiles import examples
from tests.servers import MATRIX_FIRST, ServerSpec, has_idmp, matrix, running_server

pytestmark = pytest.mark.server_tier

INSTANCES = ("a", "b", "c")
HISTORY_SIZE = 5


def supports(spec: ServerSpec, strategy: str) -> bool:
    return strategy != "idmp" or has_idmp(spec)


class ClaimOnlyMachine(RuleBasedStateMachine):
    server: ServerSpec = MATRIX_FIRST
    strategy = "script"

    def __init__(self) -> None:
        super().__init__()
        self.url = running_server(self.server)
        self.prefix = f"pc{uuid.uuid4().hex[:8]}:"
        self.base_ms = int(time.time()) * 1000
        self._portal_cm = start_blocking_portal()
        self.portal: BlockingPortal = self._portal_cm.__enter__()
        self.stores: dict[str, Store] = {}
        for name in INSTANCES:
            self.stores[name] = self.portal.call(self.open, name)
        self.winners: dict[int, str] = {}  # slot -> runner
        self.newest_claimed = 0
        self.finished: dict[int, str] = {}  # slot -> runner, of recorded results
        self.unfinished: list[tuple[int, str, str]] = []  # (slot, instance, token)

    async def open(self, name: str) -> Store:
        backend: Any = RedisBackend(redis=self.url, prefix=self.prefix, strategy=self.strategy)  # type: ignore[call-overload]
        store: Store = await backend.open(
            {"runner": name, "history_size": HISTORY_SIZE, "history_ttl_ms": None}
        )
        return store

    def teardown(self) -> None:
        for store in self.stores.values():
            self.portal.call(store.conn.aclose)
        self._portal_cm.__exit__(None, None, None)

    def expected_win(self, slot: int) -> bool:
        if self.strategy == "stream-id":
            return slot > self.newest_claimed
        return slot not in self.winners

    @rule(
        slot=st.integers(0, 15),
        claimers=st.lists(st.sampled_from(INSTANCES), min_size=1, max_size=3, unique=True),
    )
    def claim_at_once(self, slot: int, claimers: list[str]) -> None:
        """Some instances claim the same slot at the same moment."""
        slot_ms = self.base_ms + slot * 1000
        tokens = {name: secrets.token_hex(4) for name in claimers}
        replies: dict[str, ClaimReply] = {}

        async def claim(name: str) -> None:
            request = ClaimRequest("job", str(slot_ms), slot_ms, tokens[name], "schedule")
            (reply,) = await self.stores[name].claim_many([request])
            assert isinstance(reply, ClaimReply), reply
            replies[name] = reply

        async def all_at_once() -> None:
            async with anyio.create_task_group() as group:
                for name in claimers:
                    group.start_soon(claim, name)

        should_win = self.expected_win(slot_ms)
        self.portal.call(all_at_once)
        won = sorted(name for name, reply in replies.items() if reply.kind == "won")
        assert len(won) == (1 if should_win else 0), (slot, replies)
        assert all(r.kind == "done" for n, r in replies.items() if n not in won), replies
        if won:
            assert slot_ms not in self.winners, f"slot {slot} won twice"
            self.winners[slot_ms] = won[0]
            self.unfinished.append((slot_ms, won[0], tokens[won[0]]))
        self.newest_claimed = max(self.newest_claimed, slot_ms)

    @precondition(lambda self: self.unfinished)
    @rule(data=st.data(), outcome=st.sampled_from(["ok", "failed"]))
    def finish(self, data: st.DataObject, outcome: str) -> None:
        slot_ms, name, token = data.draw(st.sampled_from(self.unfinished))
        self.unfinished.remove((slot_ms, name, token))
        end = AttemptEnd(
            "job", str(slot_ms), token, 1, "schedule", slot_ms, slot_ms, slot_ms + 1,
            outcome, None, 1, 0,
        )  # fmt: skip
        self.portal.call(self.stores[name].finish, end)
        self.finished[slot_ms] = name

    @rule(name=st.sampled_from(INSTANCES))
    def run_now(self, name: str) -> None:
        store = self.stores[name]
        now_ms = int(time.time() * 1000)
        slot_id = f"m{now_ms}-{secrets.token_hex(2)}"
        request = ClaimRequest("job", slot_id, now_ms, secrets.token_hex(4), "manual")
        self.portal.call(store.claim_manual, request)

    @rule(name=st.sampled_from(INSTANCES))
    def restart(self, name: str) -> None:
        self.portal.call(self.stores[name].conn.aclose)
        self.stores[name] = self.portal.call(self.open, name)

    @invariant()
    def results_are_the_newest_finished_runs(self) -> None:
        history = self.portal.call(self.stores["a"].history, "job", 100)
        recorded = {result.slot_ms: result.runner for result in history}
        newest = dict(sorted(self.finished.items())[-HISTORY_SIZE:])
        assert recorded == newest


for _spec in matrix():
    for _strategy in ("stream-id", "idmp", "script"):
        if not supports(_spec, _strategy):
            continue
        _name = f"{_spec.id}_{_strategy}".replace("-", "_").replace(".", "_")
        _machine = type(
            f"ClaimOnlyMachine_{_name}",
            (ClaimOnlyMachine,),
            {"server": _spec, "strategy": _strategy},
        )
        _case = _machine.TestCase
        _case.settings = settings(_case.settings, max_examples=examples(60, _spec))
        globals()[f"TestClaimOnlyMachine_{_name}"] = _case
        del _case

IDMP_SERVERS = [_spec for _spec in matrix() if has_idmp(_spec)]


# Reported as SKIPPED with its reason where no server of the matrix can run idmp,
# rather than an idmp machine silently never generated.
@pytest.mark.skipif(
    not IDMP_SERVERS, reason="idmp needs Redis 8.6+: python -m tests.build_servers redis-8.6"
)
def test_the_idmp_machine_runs_on_every_server_with_idempotent_xadd() -> None:
    generated = {
        name for name in globals() if name.startswith("TestClaimOnlyMachine_") and "idmp" in name
    }
    expected = {
        f"TestClaimOnlyMachine_{spec.id}_idmp".replace("-", "_").replace(".", "_")
        for spec in IDMP_SERVERS
    }
    assert generated == expected
