"""The lease machine with failover to a real replica.

Everything the lease machine does (test_lease_machine.py), on a primary with a
replica of the same server, plus two steps:

- ``cut_replication``: the replica loses its primary (a partition: it is told
  to follow a port nobody listens on), so the writes after a cut are the ones
  a failover loses.
- ``fail_over``: the replica is promoted (``REPLICAOF NO ONE``), sometimes
  after ``WAIT`` confirmed it holds every write (a cut replica reconnects
  first), sometimes at once; the old
  primary becomes the new one's replica, and the instances carry on against
  the new primary without knowing.

After every script call the machine records the primary's whole state and the
model's. At a failover the promoted replica must hold exactly one of those
recorded states (a prefix of the history: script effects replicate whole and
in order), the newest one when ``WAIT`` confirmed it. The model goes back to
that point, and the checked property is exact: a slot's attempt is won twice
only when the earlier win was not replicated.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from anarchon._ops.embedded import free_port
from property_tests.model import JobModel
from property_tests.profiles import examples
from property_tests.test_lease_machine import LeaseMachine
from tests.servers import MATRIX_FIRST, ServerSpec, matrix, running_pair

pytestmark = pytest.mark.server_tier

Snapshot = tuple[dict[str, str], frozenset[str], tuple[str, ...]]

FAILOVERS_PER_EXAMPLE = 3


class FailoverMachine(LeaseMachine):
    server: ServerSpec = MATRIX_FIRST

    def __init__(self) -> None:
        self.pair = running_pair(self.server)
        super().__init__()
        self.replica = self.connect(self.pair[1].url)
        # The pair as the last example left it, even one that failed mid-failover.
        self.client.execute_command("REPLICAOF", "NO", "ONE")
        self.replica.execute_command("REPLICAOF", "127.0.0.1", self.pair[0].port)
        self.sync_replica()
        self.cut = False
        self.failovers = 0
        # The primary's state and the model's, before the first write and after each
        # write since the replica was last known to hold everything.
        self.history: list[tuple[Snapshot, JobModel]] = []

    def primary_url(self) -> str:
        return self.pair[0].url

    def sync_replica(self) -> None:
        self.client.incr("anarchon-test:pair")
        assert self.client.execute_command("WAIT", 1, 30_000) >= 1, "the replica is not syncing"

    def configured(self) -> None:
        self.history = [(self.snapshot(self.client), copy.deepcopy(self.model))]

    def teardown(self) -> None:
        super().teardown()
        self.replica.close()

    def snapshot(self, client: Any) -> Snapshot:
        return (
            client.hgetall(self.keys[0]),
            frozenset(client.smembers(self.keys[1])),
            tuple(client.zrange(self.keys[4], 0, -1)),
        )

    def write_happened(self) -> None:
        self.history.append((self.snapshot(self.client), copy.deepcopy(self.model)))

    @rule()
    def cut_replication(self) -> None:
        self.replica.execute_command("REPLICAOF", "127.0.0.1", free_port())
        self.cut = True

    @precondition(lambda self: self.failovers < FAILOVERS_PER_EXAMPLE)
    @rule(wait=st.booleans())
    def fail_over(self, wait: bool) -> None:
        if wait and self.cut:
            self.replica.execute_command("REPLICAOF", "127.0.0.1", self.pair[0].port)
        synced = wait and self.client.execute_command("WAIT", 1, 10_000) >= 1
        how = "after WAIT" if synced else "at once"
        event(f"fail over {how} {'after' if self.cut else 'without'} a cut")
        self.replica.execute_command("REPLICAOF", "NO", "ONE")
        held = self.snapshot(self.replica)
        # The promoted replica holds one of the primary's states: the newest one that
        # matches (equal states have equal fences, so the same wins).
        matches = [i for i, (state, _) in enumerate(self.history) if state == held]
        assert matches, "the promoted replica holds a state the primary never had"
        index = matches[-1]
        if synced:
            assert index == len(self.history) - 1, "WAIT confirmed writes the replica lacks"
        self.model = copy.deepcopy(self.history[index][1])
        lost = {key: fence for key, fence in self.wins.items() if fence > self.model.fence}
        event(f"fail over: {'some' if lost else 'no'} wins lost")
        for key in lost:
            # Not replicated: the new primary never saw this win, so it may happen again.
            del self.wins[key]
            self.lost_wins.add(key)
        # The old primary follows the new one; the instances talk to the new one.
        old_primary = self.client
        old_primary.execute_command("REPLICAOF", "127.0.0.1", self.pair[1].port)
        self.pair.reverse()
        self.client, self.replica = self.replica, old_primary
        self.sync_replica()
        self.cut = False
        self.history = [(self.snapshot(self.client), copy.deepcopy(self.model))]
        self.failovers += 1


for _spec in matrix():
    if _spec.binary is None:
        continue
    _machine = type(f"FailoverMachine_{_spec.id}", (FailoverMachine,), {"server": _spec})
    _case = _machine.TestCase
    # Redis 5 replicas reconnect only once a second, so each failover there costs
    # about a second: fewer examples keep it within the suite's time.
    _examples = examples(200 if _spec.version >= (6,) else 40, _spec)
    _case.pytestmark = [
        pytest.mark.slow("every failover waits for a real replica to be in sync (Redis 5: 1 s)")
    ]
    _case.settings = settings(_case.settings, max_examples=_examples)
    globals()[f"TestFailoverMachine_{_spec.id.replace('-', '_').replace('.', '_')}"] = _case
    del _case
