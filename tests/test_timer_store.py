"""The timers' store (anarchon._store.timers) on real servers, under asyncio and trio: what
the scripts answer reaches Python intact (payloads of any bytes, generations, fences,
triggers), on the connection anarchon opens from a URL. The scripts' rules themselves
are proved against a model by property_tests/test_timer_machine.py."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import redis

from anarchon import RedisBackend
from anarchon._store.keys import TimerKeys, bucket_of, bucket_tag
from anarchon._store.timers import (
    NO_FLEET_LIMITS,
    TimerEnd,
    TimerPeek,
    TimerStore,
    decode_payload,
    encode_payload,
)

pytestmark = [pytest.mark.anyio, pytest.mark.server_tier]

LEASE_MS = 2000


@pytest.fixture
async def timers(server_url: str, prefix: str) -> AsyncIterator[TimerStore]:
    backend = RedisBackend(redis=server_url, prefix=prefix)
    opened = await backend.open({"runner": "r", "history_size": 10, "history_ttl_ms": None})
    try:
        yield TimerStore(opened.conn, prefix=prefix, runner="r1")
    finally:
        await opened.conn.aclose()


@pytest.mark.parametrize(
    "payload",
    [None, b"", b"plain text", "caf\u00e9|\n".encode(), bytes(range(256)), {"user": 42},
     ["a", 1, None], "text", 3.5, True],
)  # fmt: skip
def test_a_payload_comes_back_as_it_went_in(payload: Any) -> None:
    assert decode_payload(encode_payload(payload)) == payload


def test_a_payload_that_is_neither_bytes_nor_json_is_refused_with_what_to_pass() -> None:
    with pytest.raises(TypeError, match="bytes or a JSON-able value"):
        encode_payload(object())


def test_a_keys_bucket_is_the_same_everywhere_and_within_the_buckets() -> None:
    assert bucket_of("user:42", 1) == 0
    buckets = {bucket_of(f"user:{n}", 4) for n in range(100)}
    assert buckets == {0, 1, 2, 3}
    assert bucket_of("user:42", 4) == bucket_of("user:42", 4)
    # Pinned: a change here would strand the timers stored under the old tags.
    assert TimerKeys.for_kind("p:", "k", 2, 4).tag == "{p:k#2.20}"
    assert TimerKeys.for_kind("p:", "k", 70, 100).tag == "{p:k#70}"  # over 64: hashed
    with pytest.raises(ValueError, match="bucket 4 of 4"):
        bucket_tag("p:", "k", 4, 4)
    assert TimerKeys.for_kind("p:", "k").tag == "{p:k}"


async def test_a_timer_set_claimed_and_rearmed_keeps_its_payload_and_grows_its_generation(
    timers: TimerStore, server_url: str
) -> None:
    payload = encode_payload(bytes(range(256)))  # not UTF-8: stored as base64
    [(gen, due_ms, _)] = await timers.set_many("remind", [("user:42", None, 0, "", payload)])
    state = await timers.get("remind", "user:42")
    assert state is not None and state.status == "pending" and state.gen == gen
    assert state.due_ms == due_ms and decode_payload(state.payload) == bytes(range(256))

    keys = timers.keys("remind", "user:42")
    claim = await timers.claim(
        keys, limit=10, lease_ms=LEASE_MS, token_base=secrets.token_hex(4), max_attempts=3
    )
    [win] = claim.wins
    assert (win.key, win.gen, win.due_ms, win.attempt, win.trigger) == (
        "user:42", gen, due_ms, 1, "due",
    )  # fmt: skip
    assert decode_payload(win.payload) == bytes(range(256))
    assert claim.next_ms is not None and claim.next_ms >= due_ms + LEASE_MS - 5
    beat = (keys, "user:42", win.token, NO_FLEET_LIMITS)
    stale = (keys, "user:42", "stale", NO_FLEET_LIMITS)
    assert await timers.heartbeat_many([beat], LEASE_MS) == [True]
    assert await timers.heartbeat_many([stale], LEASE_MS) == [False]

    end = TimerEnd("remind", "user:42", win.token, "ok", 3, 100, next_delay_ms=60_000)
    reply = await timers.finish(end, keys)
    assert reply.held and reply.status == "pending" and 59_000 <= reply.in_ms <= 60_000
    state = await timers.get("remind", "user:42")
    assert state is not None and state.gen > gen and state.status == "pending"
    assert decode_payload(state.payload) == bytes(range(256))
    assert (await timers.finish(end, keys)).held is False  # the firing is over

    assert await timers.cancel("remind", "user:42") is True
    assert await timers.get("remind", "user:42") is None
    assert await timers.cancel("remind", "user:42") is False
    direct = redis.Redis.from_url(server_url, decode_responses=True, protocol=2)
    try:
        assert direct.exists(keys.timers, keys.due) == 0  # nothing lingers
    finally:
        direct.close()


async def test_a_claim_sent_again_after_a_lost_reply_hears_of_its_wins(
    timers: TimerStore,
) -> None:
    await timers.set_many("remind", [(f"k{n}", None, 0, "", "") for n in range(5)])
    keys = timers.keys("remind", "k0")
    token_base = secrets.token_hex(4)
    first = await timers.claim(
        keys, limit=3, lease_ms=LEASE_MS, token_base=token_base, max_attempts=1
    )
    assert len(first.wins) == 3 and first.more
    again = await timers.claim(
        keys, limit=3, lease_ms=LEASE_MS, token_base=token_base, max_attempts=1
    )
    assert {w.token for w in first.wins} <= {w.token for w in again.wins}
    assert len(again.wins) == 5  # and the two left, won now


async def test_a_firing_whose_runner_died_is_taken_over_with_a_higher_fence(
    timers: TimerStore,
) -> None:
    await timers.set_many("remind", [("k", None, 0, "", "")])
    keys = timers.keys("remind", "k")
    first = await timers.claim(keys, limit=1, lease_ms=100, token_base="a", max_attempts=3)
    await anyio.sleep(0.15)
    second = await timers.claim(keys, limit=1, lease_ms=100, token_base="b", max_attempts=3)
    [dead], [taken] = first.wins, second.wins
    assert (taken.attempt, taken.trigger) == (2, "takeover")
    assert taken.fence > dead.fence
    lost = TimerEnd("remind", "k", dead.token, "ok", 3, 0)
    assert (await timers.finish(lost, keys)).held is False


async def test_a_peek_counts_a_kinds_timers_and_shows_the_first_to_need_attention(
    server_url: str, prefix: str
) -> None:
    """The read side's seam: across three buckets, how many keys have a timer, and the
    first ones by next attention (a firing by its lease's expiry, with its runner)."""
    backend = RedisBackend(redis=server_url, prefix=prefix)
    opened = await backend.open({"runner": "r", "history_size": 10, "history_ttl_ms": None})
    timers = TimerStore(opened.conn, prefix=prefix, runner="r1")
    try:
        assert await timers.peek("remind", 3) == TimerPeek("remind", 0, ())
        settings = [(f"k{n}", None, 3_600_000 + n * 1000, "", "") for n in range(30)]
        settings.append(("now", None, 0, "", ""))
        await timers.set_many("remind", settings, 3)
        now_keys = timers.keys("remind", "now", 3)
        claim = await timers.claim(
            now_keys, limit=10, lease_ms=60_000, token_base="t", max_attempts=3
        )
        assert [w.key for w in claim.wins] == ["now"]
        peek = await timers.peek("remind", 3, limit=4)
    finally:
        await opened.conn.aclose()
    assert peek.count == 31
    assert [state.key for state, _ in peek.first] == ["now", "k0", "k1", "k2"]
    firing, lease_until = peek.first[0]
    assert (firing.status, firing.attempt, firing.runner) == ("firing", 1, "r1")
    assert lease_until == firing.until_ms
    pending = [(state.status, at_ms == state.due_ms) for state, at_ms in peek.first[1:]]
    assert pending == [("pending", True)] * 3


async def test_a_timer_is_set_by_a_user_who_may_not_publish_hints(
    server: Any, server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """The set script publishes a hint when a key becomes its kind's first due. Hints are
    never relied on: a user whose ACL has no channel still sets the timer, and is told
    so by the set's reply, not by an error after the timer was stored anyway."""
    if server.family == "redis" and server.version < (6, 2):
        pytest.skip("channel ACLs need Redis 6.2+")
    user = f"nohints{secrets.token_hex(3)}"
    direct.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "resetchannels", "+@all")
    host_port = server_url.split("//", 1)[1]
    url = f"redis://{user}:pw@{host_port}"
    backend = RedisBackend(redis=url, prefix=prefix)
    opened = await backend.open({"runner": "r", "history_size": 10, "history_ttl_ms": None})
    try:
        store = TimerStore(opened.conn, prefix=prefix, runner="r1")
        ((generation, due_ms, replaced),) = await store.set_many(  # type: ignore[misc]
            "remind", [("user:42", None, 60_000, "", encode_payload("hi"))]
        )
        assert generation >= 1 and due_ms > 0 and replaced is False
        state = await store.get("remind", "user:42")
        assert state is not None and state.gen == generation
    finally:
        await opened.conn.aclose()
        direct.execute_command("ACL", "DELUSER", user)
