"""Concurrent instances claiming the same slots at once: one winner per slot.

Invariant (design section 3, invariant 1): whatever the number of instances
and however their claims interleave on the server, each slot has exactly one
``won`` reply, and every other claim is told ``running`` with the time left
on the winner's lease.
"""

from __future__ import annotations

import secrets
import uuid

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anarchon import RedisBackend
from anarchon._store import ClaimReply, ClaimRequest, Store
from tests.servers import ServerSpec, running_server


async def claim_all_at_once(url: str, instances: int, slots: list[int]) -> dict[int, list[str]]:
    prefix = f"p{uuid.uuid4().hex[:8]}:"
    stores: list[Store] = []
    for index in range(instances):
        store = await RedisBackend(redis=url, prefix=prefix).open(
            {"runner": f"i{index}", "history_size": 100, "history_ttl_ms": None}
        )
        stores.append(store)
    replies: dict[int, list[str]] = {slot: [] for slot in slots}

    async def one_instance(store: Store) -> None:
        requests = [
            ClaimRequest(
                "job", str(slot), slot, secrets.token_hex(8), "schedule", 30_000, 3, True, 600_000
            )
            for slot in slots
        ]
        for slot, reply in zip(slots, await store.claim_many(requests), strict=True):
            assert isinstance(reply, ClaimReply), reply
            replies[slot].append(reply.kind)

    try:
        async with anyio.create_task_group() as group:
            for store in stores:
                group.start_soon(one_instance, store)
    finally:
        for store in stores:
            await store.conn.aclose()
    return replies


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    instances=st.integers(min_value=2, max_value=8),
    slots=st.lists(
        st.integers(min_value=0, max_value=10_000), min_size=1, max_size=30, unique=True
    ),
    event_loop=st.sampled_from(["asyncio", "trio"]),
)
def test_concurrent_claims_of_a_slot_have_exactly_one_winner(
    server: ServerSpec, instances: int, slots: list[int], event_loop: str
) -> None:
    base_ms = 1_800_000_000_000
    slot_ids = [base_ms + 1000 * s for s in slots]
    url = running_server(server)
    replies = anyio.run(claim_all_at_once, url, instances, slot_ids, backend=event_loop)
    for slot, kinds in replies.items():
        assert sorted(kinds) == ["running"] * (instances - 1) + ["won"], (slot, kinds)
