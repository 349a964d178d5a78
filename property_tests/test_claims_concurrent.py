"""Concurrent instances claiming the same slots at once: one winner per slot.

Invariant (design section 3, invariant 1, and the claim-only strategies'
promise): whatever the number of instances and however their claims interleave
on the server, each slot has exactly one ``won`` reply. With leases every other
claim is told ``running`` (a backup); with the claim-only strategies ``done``.
Each instance claims the slots in time order, as the scheduler does.
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anarchon import RedisBackend
from anarchon._store import ClaimReply, ClaimRequest, Store
from property_tests.profiles import examples
from tests.servers import ServerSpec, running_server

STRATEGIES = ["lease", "stream-id", "idmp", "script"]


async def claim_all_at_once(
    url: str, strategy: str, instances: int, slots: list[int]
) -> dict[int, list[str]]:
    prefix = f"p{uuid.uuid4().hex[:8]}:"
    stores: list[Store] = []
    for index in range(instances):
        backend: Any = RedisBackend(redis=url, prefix=prefix, strategy=strategy)  # type: ignore[call-overload]
        store = await backend.open(
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


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(
    max_examples=examples(20),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    instances=st.integers(min_value=2, max_value=8),
    slots=st.lists(
        st.integers(min_value=0, max_value=10_000), min_size=1, max_size=30, unique=True
    ),
    event_loop=st.sampled_from(["asyncio", "trio"]),
)
def test_concurrent_claims_of_a_slot_have_exactly_one_winner(
    server: ServerSpec, strategy: str, instances: int, slots: list[int], event_loop: str
) -> None:
    if strategy == "idmp" and not (server.family == "redis" and server.version >= (8, 6)):
        pytest.skip(f"{server.id} has no idempotent XADD (Redis 8.6+): idmp is refused there")
    base_ms = 1_800_000_000_000
    slot_ids = sorted(base_ms + 1000 * s for s in slots)
    url = running_server(server)
    replies = anyio.run(claim_all_at_once, url, strategy, instances, slot_ids, backend=event_loop)
    loser = "running" if strategy == "lease" else "done"
    for slot, kinds in replies.items():
        assert sorted(kinds) == sorted(["won"] + [loser] * (instances - 1)), (slot, kinds)
