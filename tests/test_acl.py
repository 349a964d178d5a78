"""anarchon as an ACL user that has exactly what ``anarchon acl`` prints (the least a user of
a prefix needs): every strategy the server offers, timers, the registry, the inspector
and the dashboard's actions work, and the server logs no refusal. On every server of
the matrix that has ACLs (channel rules: Redis 6.2+, Valkey)."""

from __future__ import annotations

import secrets
from typing import Any

import anyio
import pytest
import redis

from anarchon import (
    Inspector,
    IntervalSchedule,
    RedisBackend,
    Scheduler,
    ServerReplyError,
    StoreFormatError,
    TimerRun,
    Timers,
)
from anarchon._store.acl import acl_rules
from tests.helpers import wait_until
from tests.servers import ServerSpec, has_idmp

pytestmark = [pytest.mark.anyio, pytest.mark.server_tier]


def acl_user(server: ServerSpec, direct: redis.Redis, prefix: str, **options: Any) -> str:
    """A user with exactly ``acl_rules(prefix)``; its URL."""
    if server.family == "redis" and server.version < (6, 2):
        pytest.skip("channel ACLs need Redis 6.2+")
    user = f"acl{secrets.token_hex(4)}"
    direct.execute_command("ACL", "SETUSER", user, "on", ">pw", *acl_rules(prefix, **options))
    host_port = direct.connection_pool.connection_kwargs
    return f"redis://{user}:pw@{host_port['host']}:{host_port['port']}/0"


def refusals(direct: redis.Redis, user: str) -> list[str]:
    """What the server refused ``user``, from its ACL log."""
    found = []
    for entry in direct.execute_command("ACL", "LOG"):
        fields = (
            dict(zip(entry[::2], entry[1::2], strict=True)) if isinstance(entry, list) else entry
        )
        if str(fields.get("username")) == user:
            found.append(f"{fields.get('reason')} {fields.get('object')}")
    return found


async def test_the_least_acl_runs_jobs_timers_the_registry_and_the_inspector(
    server: ServerSpec, direct: redis.Redis, prefix: str
) -> None:
    url = acl_user(server, direct, prefix)
    user = url.split("//", 1)[1].split(":", 1)[0]
    ran: list[str] = []
    fired: list[str] = []
    scheduler = Scheduler(RedisBackend(redis=url, prefix=prefix), lease_ms=3000)

    # Overlap allowed: run_now must not meet a scheduled run of the job (a race this
    # test is not about).
    @scheduler.job(IntervalSchedule(500), name="tick", overlap="allow")
    async def tick() -> None:
        ran.append("tick")

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        fired.append(fire.key)

    async with scheduler:
        await wait_until(lambda: len(ran) >= 2, 15, "two slots to run")
        assert (await scheduler.run_now("tick")).status == "ok"
        assert await scheduler.history("tick")
        assert await scheduler.pause("tick") and await scheduler.resume("tick")
        await scheduler.set_timer("remind", "k1", delay_ms=50)
        async with Timers(RedisBackend(redis=url, prefix=prefix)) as timers:
            await timers.set("remind", "k2", delay_ms=50)
            assert await timers.get("remind", "k3") is None
        await wait_until(lambda: sorted(fired) == ["k1", "k2"], 15, "both timers to fire")
        async with Inspector(RedisBackend(redis=url, prefix=prefix)) as inspector:
            assert [job.name for job in await inspector.jobs()] == ["tick"]
            await inspector.leases()
            assert await inspector.instances()
            assert [kind.kind for kind in await inspector.timers()] == ["remind"]
            await inspector.failures()
            # The dashboard's actions are these three.
            assert await inspector.pause("tick") and await inspector.resume("tick")
            await inspector.run_now("tick")
    assert refusals(direct, user) == []


@pytest.mark.parametrize("strategy", ["stream-id", "script", "idmp"])
async def test_the_least_acl_runs_each_claim_only_strategy(
    server: ServerSpec, direct: redis.Redis, prefix: str, strategy: str
) -> None:
    if strategy == "idmp" and not has_idmp(server):
        pytest.skip(f"{server.id} has no idempotent XADD")
    url = acl_user(server, direct, prefix, idmp=strategy == "idmp")
    user = url.split("//", 1)[1].split(":", 1)[0]
    ran: list[int] = []
    scheduler = Scheduler(RedisBackend(redis=url, prefix=prefix, strategy=strategy))

    @scheduler.job(IntervalSchedule(500), name="tick")
    async def tick() -> None:
        ran.append(1)

    async with scheduler:
        await wait_until(lambda: len(ran) >= 2, 15, "two slots to run")
        assert (await scheduler.run_now("tick")).status == "ok"
        assert await scheduler.history("tick")
    assert refusals(direct, user) == []


async def test_a_missing_permission_is_one_error_that_names_the_command(
    server: ServerSpec, direct: redis.Redis, prefix: str
) -> None:
    """Without XADD (a rule too few), the claim-only strategy's claim is refused with
    an error that names the command."""
    url = acl_user(server, direct, prefix)
    user = url.split("//", 1)[1].split(":", 1)[0]
    direct.execute_command("ACL", "SETUSER", user, "-xadd")
    scheduler = Scheduler(RedisBackend(redis=url, prefix=prefix, strategy="stream-id"))
    scheduler.add_job(lambda: None, IntervalSchedule(500), name="tick")
    async with scheduler:
        with anyio.fail_after(15), pytest.raises(ServerReplyError, match=r"'xadd'") as refused:
            await scheduler.run_now("tick")
    assert refused.value.kind == "NOPERM"


async def test_a_user_that_may_not_touch_the_prefix_is_told_of_the_acl_not_of_another_program(
    server: ServerSpec, direct: redis.Redis, prefix: str
) -> None:
    """A user whose keys are another prefix's is refused the store format key: the error
    says the ACL refused it and how to see the least ACL, not that another program may
    use the prefix."""
    url = acl_user(server, direct, "other" + prefix)
    scheduler = Scheduler(RedisBackend(redis=url, prefix=prefix))
    scheduler.add_job(lambda: None, IntervalSchedule(500), name="tick")
    with anyio.fail_after(15), pytest.raises(StoreFormatError) as refused:
        async with scheduler:
            pass
    said = refused.value.message
    assert "NOPERM" in said and f"anarchon acl --prefix {prefix}" in said, said
    assert "another program" not in said, said
