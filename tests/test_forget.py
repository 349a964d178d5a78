"""Forgetting a job (issue 44, part 7): ``Inspector.forget`` and ``anarchon forget``
remove a job's state, history and registry entry, refused while a live instance runs it,
and say so in the audit log."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from anarchon import Inspector, InvalidJobError, RedisBackend, Run, Scheduler
from anarchon._store.keys import JobKeys, RegistryKeys
from tests.helpers import anarchon_command, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


async def test_a_job_no_live_instance_runs_is_forgotten_with_its_keys_and_registry_entry(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    ran: list[int] = []

    @scheduler.job(every_ms=300, name="old-report", max_runs=100)
    async def old_report(run: Run) -> None:
        ran.append(run.slot_ms)

    keys = JobKeys.for_job(prefix, "old-report")
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        async with scheduler:
            await wait_until(lambda: len(ran) >= 2, 10, "two runs")
            with pytest.raises(InvalidJobError, match="live instances run it"):
                await inspector.forget("old-report")
        assert direct.exists(keys.state, keys.results) == 2
        removed = await inspector.forget("old-report", note="the report moved", by="dana")
        assert removed >= 2 and direct.exists(keys.state, keys.results, keys.active) == 0
        assert "old-report" not in await inspector.job_names()
        assert not direct.hexists(RegistryKeys.for_prefix(prefix).first_seen, "old-report")
        (entry,) = await inspector.audit("old-report")
        assert (entry.action, entry.by, entry.note) == ("forget", "dana", "the report moved")
        with pytest.raises(InvalidJobError, match="no job named"):
            await inspector.forget("old-report")


async def test_anarchon_forget_clears_a_malformed_definition_and_says_what_it_removed(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    direct.hset(RegistryKeys.for_prefix(prefix).jobs, "mangled", "{not json")
    done = anarchon_command(server_url, prefix, "forget", "mangled", "--note", "cleanup")
    again = anarchon_command(server_url, prefix, "forget", "mangled")
    assert done.returncode == 0 and "mangled: forgotten (0 key(s) removed" in done.stdout, done
    assert again.returncode == 1 and "no job named 'mangled'" in again.stderr, again
    assert not direct.hexists(RegistryKeys.for_prefix(prefix).jobs, "mangled")
