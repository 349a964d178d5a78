"""Commands that tasks send at the same moment share a round trip (src/anarchon/_coalesce.py):
a lone call goes at once as its command alone; calls made while a round trip is on its
way go out together in one pipeline; error replies come back as items, to their own
caller only. On a real server, through anarchon's own connection; a spy counts the calls
the coalescer makes on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from anarchon._coalesce import pipeline
from anarchon.clients import Command, Connection, ServerReplyError, open_connection

pytestmark = pytest.mark.anyio


class Spy(Connection):
    """A real connection that records each call made on it: ``("execute", 1)`` or
    ``("pipeline", number of commands)``."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.owned = True
        self.description = conn.description
        self.calls: list[tuple[str, int]] = []

    async def execute(self, command: Command) -> Any:
        self.calls.append(("execute", 1))
        return await self.conn.execute(command)

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        self.calls.append(("pipeline", len(commands)))
        return await self.conn.pipeline(commands)

    async def aclose(self) -> None:
        await self.conn.aclose()


async def test_a_lone_call_goes_at_once_and_an_error_reply_is_its_item(
    server_url: str, prefix: str
) -> None:
    spy = Spy(open_connection(server_url))
    try:
        assert await pipeline(spy, [("INCR", f"{prefix}a")]) == [1]
        incr, reply = await pipeline(spy, [("INCR", f"{prefix}a"), ("HGET", f"{prefix}a", "f")])
        assert incr == 2
        assert isinstance(reply, ServerReplyError) and reply.kind == "WRONGTYPE", reply
        (alone,) = await pipeline(spy, [("HGET", f"{prefix}a", "f")])
        assert isinstance(alone, ServerReplyError) and alone.kind == "WRONGTYPE", alone
        assert spy.calls == [("execute", 1), ("pipeline", 2), ("execute", 1)]
    finally:
        await spy.aclose()


async def test_calls_made_while_a_round_trip_is_on_its_way_share_one_pipeline(
    server_url: str, prefix: str
) -> None:
    spy = Spy(open_connection(server_url))
    replies: dict[int, list[Any]] = {}

    async def call(n: int) -> None:
        if n == 7:  # one of them is refused by the server: its caller alone hears it
            replies[n] = await pipeline(spy, [("HGET", f"{prefix}string", "f")])
        else:
            replies[n] = await pipeline(spy, [("INCR", f"{prefix}n"), ("GET", f"{prefix}n")])

    try:
        await pipeline(spy, [("INCR", f"{prefix}string")])
        async with anyio.create_task_group() as group:
            # On its way for 300 ms: a blocking pop of an empty list.
            group.start_soon(pipeline, spy, [("BLPOP", f"{prefix}empty", "0.3")])
            await anyio.sleep(0.05)
            for n in range(20):
                group.start_soon(call, n)
    finally:
        await spy.aclose()
    assert spy.calls == [("execute", 1), ("execute", 1), ("pipeline", 19 * 2 + 1)]
    (refused,) = replies.pop(7)
    assert isinstance(refused, ServerReplyError) and refused.kind == "WRONGTYPE"
    counts = sorted(int(reply[0]) for reply in replies.values())
    assert counts == list(range(1, 20))  # each INCR once, each caller its own reply
    assert all(int(reply[1]) >= int(reply[0]) for reply in replies.values())
