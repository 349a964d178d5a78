"""Slots of different jobs due at the same instant are claimed in one round trip."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from anarchon import RedisBackend, Run, Scheduler
from anarchon._engine.instance import Instance
from anarchon._store.keys import RegistryKeys
from anarchon._store.scripts import lease_script
from anarchon.clients import Command, Connection
from tests.helpers import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


class CountingConnection(Connection):
    """Passes everything to the real connection and records each round trip's commands."""

    def __init__(self, inner: Connection) -> None:
        self.inner = inner
        self.owned = inner.owned
        self.batches: list[list[tuple[str, ...]]] = []

    async def execute(self, command: Command) -> Any:
        self.batches.append([tuple(str(a) for a in command)])
        return await self.inner.execute(command)

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        self.batches.append([tuple(str(a) for a in c) for c in commands])
        return await self.inner.pipeline(commands)

    async def aclose(self) -> None:
        await self.inner.aclose()


def arg(command: tuple[str, ...], number: int) -> str:
    """A script call's ``ARGV[number]`` (after ``EVALSHA sha numkeys`` and the keys)."""
    return command[3 + int(command[2]) + number - 1]


def script_of(command: tuple[str, ...]) -> str:
    """Which lease script a call runs: EVALSHA names it, EVAL carries its text."""
    for name in ("claim", "heartbeat", "finish"):
        script = lease_script(name)
        if command[1] in (script.sha, script.body):
            return name
    return command[0]


async def three_instants(
    server_url: str, prefix: str, jobs: int
) -> tuple[list[Run], CountingConnection]:
    """Runs ``jobs`` jobs firing every second until three instants have run, counting
    the round trips after start. Unbounded (``max_concurrent=None``): the parts are
    the claim batches', not the room an instance has."""
    runs: list[Run] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), max_concurrent=None)
    for index in range(jobs):

        async def handler(run: Run) -> None:
            runs.append(run)

        scheduler.add_job(handler, "* * * * * *", name=f"job{index}")

    async with scheduler:
        store = Instance.of(scheduler).running_store()
        assert store is not None
        counting = CountingConnection(store.conn)
        store.conn = counting
        await wait_until(lambda: len({r.slot_ms for r in runs}) >= 3, 15, "three slots")
        await anyio.lowlevel.checkpoint()
    return runs, counting


async def test_twenty_jobs_due_together_are_claimed_in_one_pipelined_batch(
    server_url: str, prefix: str
) -> None:
    runs, counting = await three_instants(server_url, prefix, jobs=20)

    # The claims of each instant (ARGV[1] is the slot) went out
    # in one round trip: the 20 jobs' claims of a slot are all in one batch. A fresh
    # server does not know the scripts yet, so the first instant's batch is answered
    # NOSCRIPT and sent once more (the script's text first, the rest by SHA).
    batches_of_slot: dict[str, list[int]] = {}
    for index, batch in enumerate(counting.batches):
        claims = [c for c in batch if script_of(c) == "claim"]
        for slot in {arg(c, 1) for c in claims}:
            assert [arg(c, 1) for c in claims].count(slot) == 20, (slot, batch)
            batches_of_slot.setdefault(slot, []).append(index)
    slots = sorted(batches_of_slot)
    assert len(slots) >= 3
    assert all(len(batches_of_slot[slot]) == 1 for slot in slots[1:]), batches_of_slot
    assert len(batches_of_slot[slots[0]]) <= 2
    # The only other commands are one finish per run (no heartbeat is due with the
    # default heartbeat_ms), resent only after NOSCRIPT.
    sent = [c for b in counting.batches for c in b if script_of(c) != "claim"]
    # And the stop's withdrawal from the registry (its renewals come every 10 s).
    registry = RegistryKeys.for_prefix(prefix)
    withdrawal = [c for c in sent if c[1].startswith(registry.tag + ":instance")]
    assert [c[0] for c in withdrawal] == ["ZREM", "DEL"], withdrawal
    sent = [c for c in sent if c not in withdrawal]
    assert {script_of(c) for c in sent} == {"finish"}
    finished = {(arg(c, 1), arg(c, 3)) for c in sent}  # (slot, token)
    assert len(finished) == len(runs)


async def test_runs_that_end_together_send_their_finishes_in_one_round_trip(
    server_url: str, prefix: str
) -> None:
    runs, counting = await three_instants(server_url, prefix, jobs=20)

    # Twenty handlers that return at once end in the same scheduling turn: the
    # finishes of an instant's runs (ARGV[1] is the slot; ARGV[3] the token) go out
    # together in one round trip, not one (and a connection) each.
    # A fresh server does not know the finish script yet, so the first instant's
    # batch may be answered NOSCRIPT and sent again (the script's text with the
    # first finish, the rest by SHA).
    batches_of_slot: dict[str, list[set[str]]] = {}
    for batch in counting.batches:
        finishes = [c for c in batch if script_of(c) == "finish"]
        for slot in {arg(c, 1) for c in finishes}:
            tokens = {arg(c, 3) for c in finishes if arg(c, 1) == slot}
            batches_of_slot.setdefault(slot, []).append(tokens)
    slots = sorted({str(run.slot_ms) for run in runs})
    assert len(slots) >= 3
    assert sorted(batches_of_slot) == slots, batches_of_slot
    runs_of_slot = {slot: sum(1 for r in runs if str(r.slot_ms) == slot) for slot in slots}
    assert set(runs_of_slot.values()) == {20}, runs_of_slot
    for slot in slots:
        first, *resent = batches_of_slot[slot]
        assert len(first) == 20, (slot, batches_of_slot[slot])
        assert all(tokens <= first for tokens in resent), (slot, batches_of_slot[slot])
    assert all(len(batches_of_slot[slot]) == 1 for slot in slots[1:]), batches_of_slot
    assert sum(len(tokens) for tokens in batches_of_slot[slots[0]][1:]) in (0, 20)


async def test_a_large_instant_is_claimed_in_parts_of_at_most_two_hundred(
    server_url: str, prefix: str
) -> None:
    _, counting = await three_instants(server_url, prefix, jobs=450)

    # A claim (ARGV[1] is the slot; ARGV[3] the token) is sent
    # again with its token when its round trip failed (a loaded machine can miss the
    # deadline): the parts are the round trips of claims sent for the first time.
    parts_of_slot: dict[str, list[int]] = {}
    sent_before: set[str] = set()
    for batch in counting.batches:
        claims = [c for c in batch if script_of(c) == "claim" and c[0] == "EVALSHA"]
        assert len(claims) <= 200, len(claims)
        first_time = [c for c in claims if arg(c, 3) not in sent_before]
        sent_before.update(arg(c, 3) for c in claims)
        for slot in {arg(c, 1) for c in first_time}:
            parts_of_slot.setdefault(slot, []).append(
                sum(1 for c in first_time if arg(c, 1) == slot)
            )
    complete = [sizes for sizes in parts_of_slot.values() if sum(sizes) == 450]
    assert len(complete) >= 2, parts_of_slot
    assert all(sorted(sizes) == [50, 200, 200] for sizes in complete), complete
