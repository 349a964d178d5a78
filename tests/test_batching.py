"""Slots of different jobs due at the same instant are claimed in one round trip."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from anarchon import RedisBackend, Run, Scheduler
from anarchon.clients import Command, Connection
from tests.helpers import wait_until

pytestmark = pytest.mark.anyio


class CountingConnection(Connection):
    """Passes everything to the real connection and records each batch's commands."""

    def __init__(self, inner: Connection) -> None:
        self.inner = inner
        self.owned = inner.owned
        self.batches: list[list[str]] = []

    async def execute(self, command: Command) -> Any:
        self.batches.append([str(command[0])])
        return await self.inner.execute(command)

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        self.batches.append([str(c[0]) for c in commands])
        return await self.inner.pipeline(commands)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_twenty_jobs_due_together_are_claimed_in_one_pipelined_batch(
    server_url: str, prefix: str
) -> None:
    runs: list[Run] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    for index in range(20):

        async def handler(run: Run) -> None:
            runs.append(run)

        scheduler.add_job(handler, "* * * * * *", name=f"job{index}")

    async with scheduler:
        assert scheduler._store is not None
        counting = CountingConnection(scheduler._store.conn)
        scheduler._store.conn = counting
        await wait_until(lambda: len({r.slot_ms for r in runs}) >= 3, 10, "three slots")
        await anyio.lowlevel.checkpoint()

    slots_run = {r.slot_ms for r in runs}
    # A fresh server does not know the scripts yet: the first batch of each script
    # is answered NOSCRIPT and sent again as EVAL (once), which loads it.
    # That happens for the first instant only.
    loading = [i for i, b in enumerate(counting.batches) if b and set(b) == {"EVAL"}]
    claim_batches = [i for i, b in enumerate(counting.batches) if len(b) > 1 and b[0] == "EVALSHA"]
    assert not loading or loading[-1] < claim_batches[1]
    sent = [b for i, b in enumerate(counting.batches) if i not in loading]
    claims = [b for b in sent if len(b) > 1]
    singles = [b for b in sent if len(b) == 1]
    # Every claim batch holds the 20 jobs' claims of one instant ...
    assert claims and all(b == ["EVALSHA"] * 20 for b in claims), claims
    assert len(claims) in (len(slots_run), len(slots_run) + 1)
    # ... and the only other round trips are one finish per run (no heartbeat is
    # due with the default heartbeat_ms).
    assert singles == [["EVALSHA"]] * len(singles)
    assert len(singles) == len(runs)
