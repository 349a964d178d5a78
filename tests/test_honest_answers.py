"""The lease scripts answer honestly (design section 8): a stale attempt's finish
reports the loss, a repeated claim gets its win back only while its lease is live,
and fences keep growing after the store is wiped."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import anyio
import pytest
import redis

from anarchon import RedisBackend
from anarchon._ops.embedded import EmbeddedServer, free_port
from anarchon._store.contract import (
    AttemptEnd,
    ClaimReply,
    ClaimRequest,
    FinishReply,
    HeartbeatRequest,
    Store,
)
from anarchon._store.keys import JobKeys
from anarchon.clients import ServerReplyError
from tests.servers import REPLICATION_ARGS, ServerSpec, wait_in_sync

pytestmark = [pytest.mark.anyio, pytest.mark.server_tier]

LEASE_MS = 300


@pytest.fixture
async def store(server_url: str, prefix: str) -> AsyncIterator[Store]:
    backend = RedisBackend(redis=server_url, prefix=prefix)
    opened = await backend.open({"runner": "r", "history_size": 100, "history_ttl_ms": None})
    try:
        yield opened
    finally:
        await opened.conn.aclose()


def claim_request(
    slot_ms: int, token: str, *, max_attempts: int = 3, trigger: str = "schedule"
) -> ClaimRequest:
    return ClaimRequest(
        "job", str(slot_ms), slot_ms, token, trigger, LEASE_MS, max_attempts,  # type: ignore[arg-type]
        False, 600_000,
    )  # fmt: skip


async def claim(store: Store, request: ClaimRequest) -> ClaimReply:
    (reply,) = await store.claim_many([request])
    assert not isinstance(reply, ServerReplyError), reply
    return reply


async def finish(store: Store, slot_ms: int, token: str, attempt: int) -> FinishReply:
    now_ms = int(time.time() * 1000)
    return await store.finish(
        AttemptEnd(
            "job", str(slot_ms), token, attempt, "schedule", 1, now_ms, now_ms, "ok", None,
            3, 1000,
        )
    )  # fmt: skip


def a_slot() -> int:
    return int(time.time() * 1000) // 1000 * 1000


@pytest.mark.parametrize("max_attempts", [1, 3])
async def test_a_stale_attempts_finish_after_a_claim_ended_its_expired_lease_reports_the_loss(
    store: Store, max_attempts: int
) -> None:
    """The backup's claim turned the expired lease into a pending retry (or, with no
    attempts left, into interrupted); the old runner's finish must be told it lost."""
    slot = a_slot()
    old_token = secrets.token_hex(8)
    assert (await claim(store, claim_request(slot, old_token, max_attempts=max_attempts))).kind == (
        "won"
    )
    await anyio.sleep(LEASE_MS / 1000 + 0.05)
    # With no attempts left the claim settles the run 'interrupted'; with attempts left
    # it wins the next one. Either way the old token holds nothing any more.
    backup = await claim(
        store, claim_request(slot, secrets.token_hex(8), max_attempts=max_attempts)
    )
    assert backup.kind == ("won" if max_attempts > 1 else "done")

    reply = await finish(store, slot, old_token, attempt=1)

    assert not reply.held, f"the stale finish was answered {reply}"


async def test_a_claim_repeated_after_its_lease_expired_does_not_get_the_win_back(
    store: Store,
) -> None:
    """A claim whose reply was lost is sent again with the same token. If the lease ran
    out meanwhile, a backup may take over at any moment: the old win is not handed back
    (it is the next attempt, with a higher fence, or nothing)."""
    slot = a_slot()
    token = secrets.token_hex(8)
    first = await claim(store, claim_request(slot, token))
    assert first.kind == "won"
    await anyio.sleep(LEASE_MS / 1000 + 0.05)

    again = await claim(store, claim_request(slot, token))

    assert (again.kind, again.attempt) != ("won", first.attempt)
    if again.kind == "won":
        assert again.attempt == first.attempt + 1 and again.fence > first.fence
        assert again.wait_ms == LEASE_MS  # a fresh lease, not a negative time left


async def test_a_claim_repeated_while_its_lease_is_live_gets_the_same_win_back(
    store: Store,
) -> None:
    slot = a_slot()
    token = secrets.token_hex(8)
    first = await claim(store, claim_request(slot, token))
    again = await claim(store, claim_request(slot, token))
    assert (again.kind, again.attempt, again.fence) == ("won", first.attempt, first.fence)
    assert 0 < again.wait_ms <= LEASE_MS


async def test_fences_keep_growing_after_the_store_is_wiped(store: Store) -> None:
    """A downstream store that trusts fences must never see one go back: a server
    restarted without persistence (here: FLUSHDB) starts the job's fences again from
    the server's clock, above every fence handed out before."""
    fences = []
    for _ in range(3):
        slot = a_slot() - len(fences) * 1000
        won = await claim(store, claim_request(slot, secrets.token_hex(8)))
        assert won.kind == "won"
        fences.append(won.fence)
        keys = JobKeys.for_job(store.prefix, "job")  # type: ignore[attr-defined]
        await store.conn.execute(("DEL", keys.state, keys.active, keys.slots))
        await anyio.sleep(0.002)
    assert fences == sorted(set(fences)), fences


async def test_fences_keep_growing_after_a_failover_that_lost_the_last_wins(
    server: ServerSpec, prefix: str
) -> None:
    """Replication is asynchronous: a replica promoted after the primary acknowledged
    wins it never replicated lacks them, fence counter included. The wins after the
    failover must still get higher fences than the lost ones, or a downstream store
    that trusts fences would take a lost run and a new one for the same writer."""
    if server.binary is None:
        pytest.skip(f"{server.id}: no binary to start a primary and a replica from")

    def overlapping(slot_ms: int) -> ClaimRequest:
        # Runs of the job that may overlap: every claim here wins its own slot.
        return replace(claim_request(slot_ms, secrets.token_hex(8)), allow_overlap=True)

    pair = [EmbeddedServer(server.binary, REPLICATION_ARGS).start() for _ in range(2)]
    primary = redis.Redis(port=pair[0].port, protocol=2)
    replica = redis.Redis(port=pair[1].port, protocol=2)
    stores: list[Store] = []
    try:
        replica.execute_command("REPLICAOF", "127.0.0.1", pair[0].port)
        wait_in_sync(pair[0].port, pair[1].port)

        async def open_store(port: int) -> Store:
            backend = RedisBackend(redis=f"redis://127.0.0.1:{port}", prefix=prefix)
            opened = await backend.open(
                {"runner": "r", "history_size": 100, "history_ttl_ms": None}
            )
            stores.append(opened)
            return opened

        on_primary = await open_store(pair[0].port)
        first = await claim(on_primary, overlapping(a_slot() - 3000))
        assert primary.execute_command("WAIT", 1, 10_000) == 1, "the replica did not sync"
        # The replica is cut off (told to follow a port nobody listens on): what the
        # primary acknowledges from now on is lost at the failover.
        replica.execute_command("REPLICAOF", "127.0.0.1", free_port())
        lost = [await claim(on_primary, overlapping(a_slot() - 2000 + i)) for i in range(3)]
        replica.execute_command("REPLICAOF", "NO", "ONE")
        on_replica = await open_store(pair[1].port)
        await anyio.sleep(0.002)
        after = await claim(on_replica, overlapping(a_slot() - 1000))
        assert [r.kind for r in [first, *lost, after]] == ["won"] * 5
        assert after.fence > max(r.fence for r in lost) > first.fence, (
            first.fence, [r.fence for r in lost], after.fence,
        )  # fmt: skip
    finally:
        for store in stores:
            await store.conn.aclose()
        primary.close()
        replica.close()
        for embedded in pair:
            embedded.stop()


async def test_a_probe_finds_its_own_live_win_and_changes_nothing_otherwise(
    store: Store, direct: redis.Redis
) -> None:
    """A stopping instance asks about a claim whose reply it lost: it hears of its own
    live lease, and an expired one is neither ended nor taken over by the probe (it
    would use up an attempt that nobody runs)."""
    slot = a_slot()
    token = secrets.token_hex(8)
    won = await claim(store, claim_request(slot, token))
    probe = replace(claim_request(slot, token), probe=True)
    assert (await claim(store, probe)).kind == "won"
    await anyio.sleep(LEASE_MS / 1000 + 0.05)
    keys = JobKeys.for_job(store.prefix, "job")  # type: ignore[attr-defined]
    before = direct.hgetall(keys.state)

    after_expiry = await claim(store, probe)

    assert after_expiry.kind == "done"
    assert direct.hgetall(keys.state) == before
    assert won.kind == "won"


async def test_claims_that_disagree_on_overlap_keep_one_live_run_of_a_job_without_overlap(
    store: Store,
) -> None:
    """A rolling deploy turns overlap off while an instance of the old version still
    claims with overlap allowed, so a second run of the job holds a live lease. The
    instances without overlap still see it: the first run's due retry waits behind it
    (answered running), and the first run's expired lease is not revived by its
    heartbeat (refused, overlapped), so they never add a second live run."""
    first, second, third, fourth = (a_slot() + k * 1000 for k in range(4))
    # One job: its first run failed, and its retry is due at once.
    failed = await claim(store, claim_request(first, "t1"))
    now_ms = int(time.time() * 1000)
    await store.finish(
        AttemptEnd(
            "job", str(first), "t1", 1, "schedule", failed.fence, now_ms, now_ms, "failed",
            "boom", 3, 0,
        )
    )  # fmt: skip
    old_version = replace(claim_request(second, "t2"), allow_overlap=True)
    assert (await claim(store, old_version)).kind == "won"

    retry = await claim(store, claim_request(first, "t3"))

    assert retry.kind == "running", f"the due retry was answered {retry}"

    # Another job, whose only run's lease expires (its runner stood still).
    short = replace(claim_request(third, "t4"), job="other", lease_ms=200)
    expired = await claim(store, short)
    await anyio.sleep(0.3)
    old_version = replace(claim_request(fourth, "t5"), job="other", allow_overlap=True)
    assert (await claim(store, old_version)).kind == "won"

    (beat,) = await store.heartbeat_many(
        [HeartbeatRequest("other", str(third), "t4", LEASE_MS, allow_overlap=False)]
    )

    assert expired.kind == "won"
    assert beat is False, f"the expired lease's heartbeat was answered {beat}"
