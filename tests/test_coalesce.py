"""Commands that tasks send at the same moment share a round trip (src/anarchon/_store/coalesce.py):
calls made in one scheduling turn go out together in one pipeline; error replies come
back as items, to their own caller only; a sender that asyncio itself cancels leaves
nobody waiting. On a real server, through anarchon's own connection; a spy counts the
calls the coalescer makes on it (tests/test_batching.py counts the engine's round
trips)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from anarchon import TransportError
from anarchon._store.coalesce import pipeline
from anarchon.clients import Command, Connection, ServerReplyError, open_connection
from tests.faults import FaultProxy

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


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


async def test_a_lone_call_goes_alone_and_an_error_reply_is_its_item(
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
        assert spy.calls == [("pipeline", 1), ("pipeline", 2), ("pipeline", 1)]
    finally:
        await spy.aclose()


async def test_calls_made_in_one_turn_share_one_pipeline_each_with_its_own_replies(
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
            for n in range(20):
                group.start_soon(call, n)
    finally:
        await spy.aclose()
    assert spy.calls == [("pipeline", 1), ("pipeline", 19 * 2 + 1)]
    (refused,) = replies.pop(7)
    assert isinstance(refused, ServerReplyError) and refused.kind == "WRONGTYPE"
    counts = sorted(int(reply[0]) for reply in replies.values())
    assert counts == list(range(1, 20))  # each INCR once, each caller its own reply
    assert all(int(reply[1]) >= int(reply[0]) for reply in replies.values())


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_batch_whose_sender_is_cancelled_by_asyncio_itself_is_sent_by_another(
    server_url: str, prefix: str, anyio_backend: str
) -> None:
    """anyio's shield keeps anyio's cancellations off the sender's one-turn wait, not
    asyncio's own (a caller's asyncio.timeout or wait_for): the others' commands go out
    all the same, sent by the first of them, and each of them gets its reply."""
    import asyncio

    spy = Spy(open_connection(server_url))
    sender: list[asyncio.Task[Any]] = []
    replies: dict[int, list[Any]] = {}

    async def first() -> None:
        sender.append(asyncio.current_task())  # type: ignore[arg-type]
        with pytest.raises(asyncio.CancelledError):
            await pipeline(spy, [("INCR", f"{prefix}n")])

    async def other(n: int) -> None:
        if n == 0:
            sender[0].cancel()  # while it waits its one turn, shielded by anyio only
        replies[n] = await pipeline(spy, [("INCR", f"{prefix}n")])

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(first)
                for n in range(5):
                    group.start_soon(other, n)
    finally:
        await spy.aclose()
    # The cancelled caller's own command is not sent: nobody waits for its reply.
    assert sorted(int(reply[0]) for reply in replies.values()) == [1, 2, 3, 4, 5]
    assert spy.calls == [("pipeline", 5)]


# asyncio runs new tasks in the order they were started, so the first is the one that
# sends the shared round trip; trio runs them in a random order, and which task sends
# it would be chance (the same code serves both loops).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_those_sharing_a_round_trip_whose_sender_ran_out_of_time_hear_no_answer_came(
    proxy: FaultProxy, prefix: str
) -> None:
    """The server stands still; the task that sends a shared round trip gives up at its
    own deadline: the others sharing it get a TransportError that says the server did
    not answer (not that nothing was sent, and no repr of a cancellation), at once."""
    conn = open_connection(proxy.url)
    errors: list[TransportError] = []

    async def sender() -> None:
        with anyio.move_on_after(0.3):
            await pipeline(conn, [("INCR", f"{prefix}n")])

    async def sharer() -> None:
        try:
            await pipeline(conn, [("INCR", f"{prefix}n")])
        except TransportError as exc:
            errors.append(exc)

    try:
        await conn.execute(("PING",))
        proxy.pause()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(sender)
                group.start_soon(sharer)
    finally:
        proxy.resume()
        await conn.aclose()
    (error,) = errors
    assert "did not answer" in str(error) and "Cancelled" not in str(error), error
