"""Concurrent instances claiming the same slots: one winner per slot, the first claimant.

Invariant (design section 3, invariant 1, and the claim-only strategies'
promise): whatever the number of instances and however their claims interleave
on the server, each slot has exactly one ``won`` reply. With leases every other
claim is told ``running`` (a backup); with the claim-only strategies ``done``.

Hypothesis chooses the interleaving instead of leaving it to the OS. Each
instance claims the slots in time order, as the scheduler does, in round trips
(batches of consecutive slots, one ``claim_many`` each) whose sizes are drawn.
The round trips go in drawn **waves**: the instances of a wave send their next
batch together (the server's arrival order decides between them), and a wave
starts only once every reply of the previous one is in, so the server ran those
claims first. So each slot is won by one of the instances that claimed it in
the first wave that claimed it (by that instance alone if it was alone there):
the first claim the server ran wins, not a later one. Waves of one instance
each with batches of one slot make a serial order of single claims; one wave
of every instance with all its slots is everyone at once.
"""

from __future__ import annotations

import secrets
import uuid
from itertools import pairwise
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anarchon import RedisBackend
from anarchon._store.contract import ClaimReply, ClaimRequest, Store
from property_tests.profiles import examples
from tests.servers import ServerSpec, running_server

pytestmark = pytest.mark.server_tier

STRATEGIES = ["lease", "stream-id", "idmp", "script"]

#: A wave: the instances that send their next batch together, each with that batch.
Wave = list[tuple[int, list[int]]]


@st.composite
def claim_plans(draw: st.DrawFn, instances: int, slots: list[int]) -> list[Wave]:
    """Each instance's slots cut into batches (in time order), and the waves that send
    them: every wave a non-empty set of the instances with batches left."""
    batches: list[list[list[int]]] = []
    for _ in range(instances):
        cuts = draw(st.sets(st.integers(1, len(slots) - 1))) if len(slots) > 1 else set()
        bounds = [0, *sorted(cuts), len(slots)]
        batches.append([slots[a:b] for a, b in pairwise(bounds)])
    sent = [0] * instances
    waves: list[Wave] = []
    while True:
        ready = [i for i in range(instances) if sent[i] < len(batches[i])]
        if not ready:
            return waves
        wave: Wave = []
        for i in sorted(draw(st.sets(st.sampled_from(ready), min_size=1))):
            wave.append((i, batches[i][sent[i]]))
            sent[i] += 1
        waves.append(wave)


async def claim_in_waves(
    url: str, strategy: str, instances: int, waves: list[Wave]
) -> dict[int, dict[int, str]]:
    """Every instance's reply to its claim of each slot: ``{slot: {instance: kind}}``."""
    prefix = f"p{uuid.uuid4().hex[:8]}:"
    stores: list[Store] = []
    replies: dict[int, dict[int, str]] = {}
    try:
        for index in range(instances):
            backend: Any = RedisBackend(redis=url, prefix=prefix, strategy=strategy)  # type: ignore[call-overload]
            store = await backend.open(
                {"runner": f"i{index}", "history_size": 100, "history_ttl_ms": None}
            )
            stores.append(store)

        async def send(index: int, batch: list[int]) -> None:
            requests = [
                ClaimRequest(
                    "job", str(slot), slot, secrets.token_hex(8), "schedule", 30_000, 3, True,
                    600_000,
                )
                for slot in batch
            ]  # fmt: skip
            answers = await stores[index].claim_many(requests)
            for slot, reply in zip(batch, answers, strict=True):
                assert isinstance(reply, ClaimReply), reply
                replies.setdefault(slot, {})[index] = reply.kind

        for wave in waves:
            # The wave's batches go out together; the next wave waits for all replies.
            async with anyio.create_task_group() as group:
                for index, batch in wave:
                    group.start_soon(send, index, batch)
    finally:
        for store in stores:
            await store.conn.aclose()
    return replies


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(
    max_examples=examples(40),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    instances=st.integers(min_value=2, max_value=8),
    slots=st.lists(
        st.integers(min_value=0, max_value=10_000), min_size=1, max_size=30, unique=True
    ),
    event_loop=st.sampled_from(["asyncio", "trio"]),
    data=st.data(),
)
def test_concurrent_claims_of_a_slot_have_exactly_one_winner_the_first_claimant(
    server: ServerSpec,
    strategy: str,
    instances: int,
    slots: list[int],
    event_loop: str,
    data: st.DataObject,
) -> None:
    if strategy == "idmp" and not (server.family == "redis" and server.version >= (8, 6)):
        pytest.skip(f"{server.id} has no idempotent XADD (Redis 8.6+): idmp is refused there")
    base_ms = 1_800_000_000_000
    slot_ids = sorted(base_ms + 1000 * s for s in slots)
    waves = data.draw(claim_plans(instances, slot_ids), label="waves")
    url = running_server(server)
    replies = anyio.run(claim_in_waves, url, strategy, instances, waves, backend=event_loop)
    loser = "running" if strategy == "lease" else "done"
    for slot in slot_ids:
        kinds = replies[slot]
        assert sorted(kinds) == list(range(instances)), (slot, kinds)  # every instance claimed
        winners = [index for index, kind in kinds.items() if kind == "won"]
        assert len(winners) == 1, (slot, kinds)
        assert all(kind == loser for index, kind in kinds.items() if index != winners[0])
        first = next(wave for wave in waves if any(slot in batch for _, batch in wave))
        claimants = [index for index, batch in first if slot in batch]
        assert winners[0] in claimants, (slot, winners[0], "won; the first to claim:", claimants)
