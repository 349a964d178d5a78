"""Every client anarchon recognises, made for a test: standalone or cluster."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import redis

#: kind -> (event loops it runs under, works on a cluster)
CLIENT_KINDS: dict[str, tuple[tuple[str, ...], bool]] = {
    "redis-py-async": (("asyncio",), True),
    "redis-py-sync": (("asyncio", "trio"), True),
    "valkey-py-async": (("asyncio",), True),
    "valkey-py-sync": (("asyncio", "trio"), True),
    "glide-async": (("asyncio", "trio"), True),
    "glide-sync": (("asyncio", "trio"), True),
    "send": (("asyncio", "trio"), False),
}


@dataclass
class Target:
    """Where a client connects: a standalone URL, or the ports of a cluster's primaries."""

    url: str | None = None
    cluster_ports: list[int] | None = None

    @property
    def port(self) -> int:
        if self.cluster_ports:
            return self.cluster_ports[0]
        assert self.url is not None
        return int(self.url.rsplit(":", 1)[1].split("/")[0])


class SendClient:
    """A user's own client: anything with send(command, args)."""

    def __init__(self, port: int) -> None:
        self.client = redis.Redis(port=port, protocol=2)

    def send(self, command: str, args: list[str]) -> Any:
        return self.client.execute_command(command, *args)


async def make_client(
    kind: str, target: Target, *, resp3: bool = True
) -> tuple[Any, Callable[[], Awaitable[None]]]:
    """A client of ``kind`` for ``target`` and a coroutine function that closes it.

    redis-py and valkey-py clients speak RESP2; GLIDE speaks its default, RESP3, unless
    ``resp3`` is False (a server without HELLO: Redis 5)."""
    cluster = target.cluster_ports is not None
    port = target.port
    if kind in ("redis-py-async", "valkey-py-async"):
        if kind == "redis-py-async":
            import redis.asyncio as lib
            from redis.asyncio.cluster import RedisCluster as ClusterClass
        else:
            import valkey.asyncio as lib  # type: ignore[no-redef]
            from valkey.asyncio.cluster import ValkeyCluster as ClusterClass  # type: ignore[assignment]
        if cluster:
            client: Any = ClusterClass(host="127.0.0.1", port=port, protocol=2)
        else:
            client = (lib.Redis if kind == "redis-py-async" else lib.Valkey)(port=port, protocol=2)  # type: ignore[attr-defined]
        return client, client.aclose
    if kind in ("redis-py-sync", "valkey-py-sync"):
        if kind == "redis-py-sync":
            import redis as sync_lib

            standalone, cluster_class = sync_lib.Redis, sync_lib.RedisCluster
        else:
            import valkey as sync_lib  # type: ignore[no-redef]

            standalone, cluster_class = sync_lib.Valkey, sync_lib.ValkeyCluster  # type: ignore[attr-defined]
        if cluster:
            client = cluster_class(host="127.0.0.1", port=port, protocol=2)
        else:
            client = standalone(port=port, protocol=2)

        async def close_sync() -> None:
            client.close()

        return client, close_sync
    if kind == "glide-async":
        import glide

        address = [glide.NodeAddress("127.0.0.1", port)]
        protocol = glide.ProtocolVersion.RESP3 if resp3 else glide.ProtocolVersion.RESP2
        if cluster:
            client = await glide.GlideClusterClient.create(
                glide.GlideClusterClientConfiguration(address, protocol=protocol)
            )
        else:
            client = await glide.GlideClient.create(
                glide.GlideClientConfiguration(address, protocol=protocol)
            )
        return client, client.close
    if kind == "glide-sync":
        import glide_sync

        address = [glide_sync.NodeAddress("127.0.0.1", port)]
        sync_protocol = (
            glide_sync.ProtocolVersion.RESP3 if resp3 else glide_sync.ProtocolVersion.RESP2
        )
        if cluster:
            config: Any = glide_sync.GlideClusterClientConfiguration(
                address, protocol=sync_protocol
            )
            client = glide_sync.GlideClusterClient.create(config)
        else:
            client = glide_sync.GlideClient.create(
                glide_sync.GlideClientConfiguration(address, protocol=sync_protocol)
            )

        async def close_glide_sync() -> None:
            await anyio.to_thread.run_sync(client.close)

        return client, close_glide_sync
    if kind == "send":
        send_client = SendClient(port)

        async def close_send() -> None:
            send_client.client.close()

        return send_client, close_send
    raise ValueError(kind)
