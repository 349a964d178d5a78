"""Backends: the store format, and the ways to give anarchon a connection."""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio

from anarchon import (
    ConnectionFailedError,
    Inspector,
    RedisBackend,
    Run,
    Scheduler,
    StoreFormatError,
    UnsupportedClientError,
    UnsupportedServerError,
    ValkeyBackend,
)
from tests.faults import read_only
from tests.helpers import OneShot, PinnedConnection, wait_until
from tests.servers import ServerSpec

pytestmark = [pytest.mark.anyio, pytest.mark.server_tier]


async def test_a_newer_store_format_refuses_to_start_and_writes_nothing(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    direct.set(f"{prefix}format", 99)
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    scheduler.add_job(lambda: None, "* * * * * *", name="job")

    with pytest.raises(StoreFormatError, match="upgrade anarchon") as info:
        async with scheduler:
            pass

    assert info.value.code == "ANARCHON_STORE_FORMAT"
    assert sorted(direct.scan_iter(match=f"*{prefix}*")) == [f"{prefix}format"]
    assert direct.get(f"{prefix}format") == "99"


async def test_starting_on_a_read_only_replica_says_so_not_that_the_prefix_is_taken(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """A new store's format key cannot be written on a replica (or a server out of
    memory): that is a server that cannot take writes now, not another program's
    prefix, and the error says what it is."""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    scheduler.add_job(lambda: None, "* * * * * *", name="job")
    with read_only(direct), pytest.raises(ConnectionFailedError) as info:
        async with scheduler:
            pass
    message = str(info.value)
    assert "READONLY" in message and "primary" in message, message
    assert "prefix" not in message, message


@pytest.mark.parametrize("stored", ["-7", "0", "1.0", "+1", "inf", "1e0", "\x1b[31mred"])
async def test_a_store_format_that_is_no_format_number_refuses_to_start(
    server_url: str, prefix: str, direct: redis.Redis, stored: str
) -> None:
    """A format of ``-7`` was taken as an older format; anything but a whole number from
    1 up is another program's data, shown escaped."""
    direct.set(f"{prefix}format", stored)
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    scheduler.add_job(lambda: None, "* * * * * *", name="job")
    with pytest.raises(StoreFormatError, match="not a format number") as info:
        async with scheduler:
            pass
    assert "\x1b" not in str(info.value)
    assert direct.get(f"{prefix}format") == stored


async def test_a_scheduler_started_on_a_replica_is_refused_at_start_even_with_a_store(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """With the format key already there, a scheduler started on a replica used to start,
    and then have every claim refused (READONLY) and retried."""
    direct.set(f"{prefix}format", 1)
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    scheduler.add_job(lambda: None, "* * * * * *", name="job")
    with read_only(direct), pytest.raises(ConnectionFailedError) as info:
        with anyio.fail_after(20):
            async with scheduler:
                pass
    message = str(info.value)
    assert "READONLY" in message and "primary" in message, message


async def test_the_inspector_writes_nothing_to_read_a_store(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """A reader needs no write: on a fresh prefix it leaves no key, and it reads a store
    on a replica (a user the ACL lets read alone sees the same)."""
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        assert await inspector.jobs() == []
    assert list(direct.scan_iter(match=f"*{prefix}*")) == []
    direct.set(f"{prefix}format", 1)
    with read_only(direct):
        async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
            assert await inspector.jobs() == []


async def test_the_store_format_is_written_when_absent(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    async with Scheduler(ValkeyBackend(valkey=server_url, prefix=prefix)):
        pass
    assert direct.get(f"{prefix}format") == "1"


async def run_one_slot(backend: RedisBackend) -> list[Run]:
    runs: list[Run] = []
    scheduler = Scheduler(backend)

    @scheduler.job(OneShot.in_ms(100), name="once")
    async def once(run: Run) -> None:
        runs.append(run)

    async with scheduler:
        await wait_until(lambda: bool(runs), 5, "the slot to run")
    return runs


@pytest.mark.engine_tier  # anarchon's own client building
async def test_an_options_mapping_connects(server_url: str, prefix: str) -> None:
    port = int(server_url.rsplit(":", 1)[1].split("/")[0])
    runs = await run_one_slot(
        RedisBackend(redis={"host": "127.0.0.1", "port": port, "db": 0}, prefix=prefix)
    )
    assert [r.job for r in runs] == ["once"]


def speaks_resp3(server: ServerSpec) -> bool:
    return server.family != "redis" or server.version >= (6,)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_passed_asyncio_client_is_used_and_left_open(
    server: ServerSpec, server_url: str, prefix: str, protocol: int
) -> None:
    client = redis.asyncio.Redis.from_url(server_url, protocol=protocol)
    if protocol == 3 and not speaks_resp3(server):
        with pytest.raises(UnsupportedServerError, match="protocol=2"):
            await run_one_slot(RedisBackend(redis=client, prefix=prefix))
        return
    pinned = await PinnedConnection.of_async(client)
    runs = await run_one_slot(RedisBackend(redis=client, prefix=prefix))
    assert [r.job for r in runs] == ["once"]
    assert await pinned.still_open_async(), "the passed client's connection was closed"
    await client.aclose()


@pytest.mark.parametrize("decode_responses", [False, True])
@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_passed_sync_client_is_used_and_left_open(
    server: ServerSpec, server_url: str, prefix: str, protocol: int, decode_responses: bool
) -> None:
    client = redis.Redis.from_url(server_url, protocol=protocol, decode_responses=decode_responses)
    if protocol == 3 and not speaks_resp3(server):
        with pytest.raises(UnsupportedServerError, match="protocol=2"):
            await run_one_slot(RedisBackend(redis=client, prefix=prefix))
        return
    pinned = PinnedConnection.of(client)
    runs = await run_one_slot(RedisBackend(redis=client, prefix=prefix))
    assert [r.job for r in runs] == ["once"]
    assert pinned.still_open(), "the passed client's connection was closed"
    client.close()


@pytest.mark.engine_tier  # anarchon's own check, before any command
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_asyncio_client_under_trio_fails_at_start_naming_what_works(
    server_url: str, prefix: str
) -> None:
    client = redis.asyncio.Redis.from_url(server_url, protocol=2)
    scheduler = Scheduler(RedisBackend(redis=client, prefix=prefix))
    with pytest.raises(UnsupportedClientError, match="under trio pass") as info:
        async with scheduler:
            pass
    assert info.value.code == "ANARCHON_UNSUPPORTED_CLIENT"


class SendClient:
    """A user's own client: anything with send(command, args)."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, protocol=2)
        self.commands: list[str] = []

    def send(self, command: str, args: list[str]) -> Any:
        self.commands.append(command)
        return self.client.execute_command(command, *args)


class AsyncSendClient(SendClient):
    async def send(self, command: str, args: list[str]) -> Any:  # type: ignore[override]
        return await anyio.to_thread.run_sync(super().send, command, args)


@pytest.mark.parametrize("client_class", [SendClient, AsyncSendClient])
async def test_any_object_with_send_works(
    server_url: str, prefix: str, client_class: type[SendClient]
) -> None:
    client = client_class(server_url)
    runs = await run_one_slot(RedisBackend(redis=client, prefix=prefix))
    assert [r.job for r in runs] == ["once"]
    assert "EVALSHA" in client.commands
    client.client.close()


async def test_scripts_are_reloaded_after_script_flush(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    runs: list[int] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job("* * * * * *", name="tick")
    async def tick(run: Run) -> None:
        runs.append(run.slot_ms)

    async with scheduler:
        await wait_until(lambda: len(runs) >= 1, 5, "a first run")
        direct.script_flush()
        count = len(runs)
        await wait_until(lambda: len(runs) >= count + 2, 5, "runs after SCRIPT FLUSH")
    assert sorted(set(runs)) == sorted(runs)
    assert all(b - a == 1000 for a, b in itertools.pairwise(runs))
