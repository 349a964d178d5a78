"""What a decided slot costs the server: its CPU, sampled while a load runs, and each
lease script's own cost (a winning claim, a losing claim, a heartbeat, a finish)
measured apart through the lease store, as the scheduler sends them.

Two views of the same server. ``INFO cpu`` (``used_cpu_user`` + ``used_cpu_sys``)
counts everything the server process spends: reading and parsing requests, running the
scripts, writing replies. ``INFO commandstats`` (``cmdstat_evalsha``'s ``usec``)
counts only the time inside the scripts. The first is what an operator pays; the
second says which script to make leaner.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import anyio

from anarchon._store.contract import AttemptEnd, ClaimRequest, HeartbeatRequest
from anarchon._store.lease import LeaseStore
from anarchon.clients import open_connection
from bench.common import KEEP_MS, in_child, new_prefix, redis_client

Result = dict[str, Any]

#: The scripts a decided slot runs, measured apart.
PARTS = ("claim won", "claim lost", "heartbeat", "finish")


def server_cpu_sec(client: Any) -> float:
    """The server process's CPU time so far (user + system), in seconds."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _evalsha(client: Any) -> tuple[int, float]:
    """EVALSHA calls so far and the microseconds spent inside them."""
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), float(stats.get("usec", 0))


@contextmanager
def sampled_server_cpu(url: str, every_sec: float = 0.1) -> Iterator[list[tuple[float, float]]]:
    """``(wall time, server CPU seconds)`` samples taken every ``every_sec`` while the
    block runs (in a thread, on a connection of its own), for ``cpu_at``."""
    samples: list[tuple[float, float]] = []
    done = threading.Event()
    client = redis_client(url)

    def sample() -> None:
        while True:
            samples.append((time.time(), server_cpu_sec(client)))
            if done.wait(every_sec):
                samples.append((time.time(), server_cpu_sec(client)))
                return

    thread = threading.Thread(target=sample, name="server-cpu", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join()
        client.close()


@contextmanager
def sampled_nodes_cpu(urls: Sequence[str]) -> Iterator[list[list[tuple[float, float]]]]:
    """``sampled_server_cpu`` for each of several servers (a cluster's primaries) at
    once: one list of samples per server, in the order of ``urls``."""
    with ExitStack() as stack:
        yield [stack.enter_context(sampled_server_cpu(url)) for url in urls]


def script_costs(url: str, jobs: int) -> Result:
    """Each lease script's server cost per call, from ``jobs`` calls of each kind.

    In a process of its own, so that it measures the scripts of the code chosen by
    ``code_from``. The store is warmed first (scripts loaded, keys of another prefix
    written), then: ``jobs`` first claims of fresh jobs (all won), the same slots
    claimed by a second runner (all lost: the run is held), one heartbeat of each run,
    and each run's finish, in batches of 100 as the scheduler sends them."""
    parts: Result = in_child("bench.servercost", "the scripts", url, jobs, timeout=600)
    return parts


async def _script_costs(url: str, jobs: int) -> Result:
    client = redis_client(url)
    conns = [open_connection(url), open_connection(url)]
    try:
        await _drive(conns, new_prefix("warm"), min(jobs, 500), client, None)
        parts: Result = {}
        await _drive(conns, new_prefix("cost"), jobs, client, parts)
        return parts
    finally:
        for conn in conns:
            await conn.aclose()
        client.close()


async def _drive(
    conns: Sequence[Any], prefix: str, jobs: int, client: Any, parts: Result | None
) -> None:
    def store(conn: Any, runner: str) -> LeaseStore:
        return LeaseStore(
            conn, prefix=prefix, runner=runner, history_size=1000, history_ttl_ms=None,
            trim_runs_by_id=True,
        )  # fmt: skip

    winner, loser = store(conns[0], "winner"), store(conns[1], "loser")
    slot_ms = int(time.time() * 1000)
    names = [f"job{i:06d}" for i in range(jobs)]

    def claims() -> list[ClaimRequest]:
        return [
            ClaimRequest(name, str(slot_ms), slot_ms, secrets.token_hex(8), "schedule",
                         lease_ms=30_000, max_attempts=3, keep_ms=KEEP_MS)
            for name in names
        ]  # fmt: skip

    won: list[tuple[ClaimRequest, Any]] = []

    async def claim_won() -> None:
        for batch in _batches(claims()):
            replies = await winner.claim_many(batch)
            for request, reply in zip(batch, replies, strict=True):
                assert not isinstance(reply, Exception) and reply.kind == "won", reply
                won.append((request, reply))

    async def claim_lost() -> None:
        for batch in _batches(claims()):
            for reply in await loser.claim_many(batch):
                assert not isinstance(reply, Exception) and reply.kind != "won", reply

    async def heartbeat() -> None:
        for batch in _batches(won):
            beats = [HeartbeatRequest(r.job, r.slot_id, r.token, 30_000, False) for r, _ in batch]
            assert all(held is True for held in await winner.heartbeat_many(beats))

    async def finish() -> None:
        for batch in _batches(won):
            async with anyio.create_task_group() as group:
                for request, reply in batch:
                    end = AttemptEnd(
                        request.job, request.slot_id, request.token, reply.attempt,
                        "schedule", reply.fence, slot_ms, slot_ms + 1, "ok", None, 3, 1000,
                    )  # fmt: skip
                    group.start_soon(winner.finish, end)

    for name, step in zip(PARTS, (claim_won, claim_lost, heartbeat, finish), strict=True):
        cpu_before, (calls_before, usec_before) = server_cpu_sec(client), _evalsha(client)
        await step()
        cpu_after, (calls_after, usec_after) = server_cpu_sec(client), _evalsha(client)
        if parts is not None:
            calls = calls_after - calls_before
            parts[name] = {
                "calls": calls,
                "server_us": (cpu_after - cpu_before) / calls * 1e6 if calls else None,
                "script_us": (usec_after - usec_before) / calls if calls else None,
            }


def _batches(items: Sequence[Any], size: int = 100) -> Iterator[Sequence[Any]]:
    for offset in range(0, len(items), size):
        yield items[offset : offset + size]


def per_decided_slot(parts: Result, instances: int, key: str) -> float | None:
    """What one decided slot costs by ``key`` (``server_us`` or ``script_us``) with
    ``instances`` instances: one winning claim, a losing claim from each other
    instance, and the winner's finish (a run shorter than a heartbeat beats none)."""
    values = [parts[name][key] for name in ("claim won", "claim lost", "finish")]
    if any(value is None for value in values):
        return None
    won, lost, finish = values
    return float(won + (instances - 1) * lost + finish)


if __name__ == "__main__":
    print(json.dumps(anyio.run(_script_costs, sys.argv[1], int(sys.argv[2]))))
