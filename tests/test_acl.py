"""anarchon as an ACL user that has exactly what ``anarchon acl`` prints: enough (every
strategy the server offers, timers, the registry, the inspector, the dashboard's actions
and each client library's connect work, and the server logs no refusal) and least (no
``CONFIG``, no client control, no ``@dangerous`` command, no key or channel of another
prefix). On every server of the matrix that has ACLs (channel rules: Redis 6.2+, Valkey)."""

from __future__ import annotations

import ast
import logging
import re
import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio

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


def acl_user(
    server: ServerSpec, direct: redis.Redis, prefix: str, *, without: str = "", **options: Any
) -> str:
    """A user with exactly ``acl_rules(prefix)`` (less the rule ``without``); its URL."""
    if server.family == "redis" and server.version < (6, 2):
        pytest.skip("channel ACLs need Redis 6.2+")
    user = f"acl{secrets.token_hex(4)}"
    # Redis 7.0 knows no CLIENT SETINFO, and refuses a rule that names it.
    redis_7_0 = server.family == "redis" and (7, 0) <= server.version[:2] < (7, 2)
    options.setdefault("setinfo", not redis_7_0)
    rules = [rule for rule in acl_rules(prefix, **options) if rule != without]
    direct.execute_command("ACL", "SETUSER", user, "on", ">pw", *rules)
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
    # test is not about). The fleet limits', max_runs' and exclusions' commands are the
    # user's too (every other slot is excluded).
    @scheduler.job(
        IntervalSchedule(500), name="tick", overlap="allow", max_concurrent_fleet=10,
        max_runs=1000, exclude="*/2 * * * * *",
    )  # fmt: skip
    async def tick() -> None:
        ran.append("tick")

    @scheduler.timer("remind", max_concurrent_fleet=4, rate_limit=(100, 60_000))
    async def remind(fire: TimerRun) -> None:
        await fire.save_progress({"step": 1})  # a firing's progress: the user's too
        fired.append(fire.key)

    # A kind with key groups: their permits and waiting sets are the user's keys too.
    @scheduler.timer("notify", group_by=":", max_concurrent_per_group=1)
    async def notify(fire: TimerRun) -> None:
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
            await timers.set("notify", "t1:a", delay_ms=50)
            await timers.set("notify", "t1:b", delay_ms=50)
            await timers.set("remind", "later:1", delay_ms=600_000)
            await timers.set("remind", "later:2", delay_ms=600_000)
            assert await timers.cancel_prefix("remind", "later:") == 2
        await wait_until(
            lambda: sorted(fired) == ["k1", "k2", "t1:a", "t1:b"], 15, "the timers to fire"
        )
        async with Inspector(RedisBackend(redis=url, prefix=prefix)) as inspector:
            assert [job.name for job in await inspector.jobs()] == ["tick"]
            await inspector.leases()
            assert await inspector.instances()
            notify_kind, kind = await inspector.timers()
            assert (kind.kind, kind.fleet_running, kind.rate_started) == ("remind", 0, 2)
            assert notify_kind.kind == "notify"
            page = await inspector.timer_page("remind")
            assert not any(t.key.startswith("later:") for t in page.timers)  # cancelled
            await inspector.failures()
            # The dashboard's actions are these three.
            assert await inspector.pause("tick") and await inspector.resume("tick")
            await inspector.run_now("tick", note="a check")
            assert [e.action for e in await inspector.audit("tick", 3)] == [
                "run-now", "resume", "pause",
            ]  # fmt: skip
            # A backfill, driven by the instance, and its cancel (a second one, running).
            now_s = int(direct.time()[0])
            start = datetime.fromtimestamp(now_s - 10, UTC)
            await inspector.backfill("tick", start, start + timedelta(seconds=1))
            await wait_until_ended(inspector, "tick")
            await inspector.backfill("tick", start - timedelta(seconds=600), start)
            await inspector.cancel_backfill("tick")
    assert refusals(direct, user) == []


async def wait_until_ended(inspector: Inspector, job: str) -> None:
    for _ in range(150):
        (info,) = await inspector.jobs([job])
        if info.backfill is not None and info.backfill.status != "running":
            return
        await anyio.sleep(0.1)
    raise AssertionError(f"the backfill of {job} did not end: {info.backfill}")


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


async def start_a_timer_scheduler(url: str, prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A scheduler that fires timers starts, reads the eviction policy, and stops."""
    scheduler = Scheduler(RedisBackend(redis=url, prefix=prefix))

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        pass

    with caplog.at_level(logging.INFO, logger="anarchon"):
        async with scheduler:
            await wait_until(
                lambda: "maxmemory-policy" in caplog.text, 15, "the eviction policy's check"
            )


async def test_the_least_acl_user_is_warned_of_a_policy_that_may_evict_timers(
    server: ServerSpec, direct: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The eviction policy is read without CONFIG (which the least ACL does not grant):
    its user is warned as an admin would be, and the server refuses nothing."""
    url = acl_user(server, direct, prefix)
    user = url.split("//", 1)[1].split(":", 1)[0]
    policy = direct.config_get("maxmemory-policy")["maxmemory-policy"]
    direct.config_set("maxmemory-policy", "allkeys-lru")  # no maxmemory: evicts nothing
    try:
        await start_a_timer_scheduler(url, prefix, caplog)
    finally:
        direct.config_set("maxmemory-policy", policy)
    assert "the server's maxmemory-policy is 'allkeys-lru'" in caplog.text
    assert refusals(direct, user) == []


async def test_a_user_that_may_not_read_the_eviction_policy_is_told_how_to_check_it(
    server: ServerSpec, direct: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A user refused INFO memory starts all the same, and the log says the policy could
    not be read and how an operator reads it."""
    url = acl_user(server, direct, prefix, without="+info|memory")
    await start_a_timer_scheduler(url, prefix, caplog)
    said = [r for r in caplog.records if "could not read maxmemory-policy" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert "NOPERM" in said[0].getMessage() or "permission" in said[0].getMessage()
    assert "INFO memory" in said[0].getMessage() and "CONFIG GET" in said[0].getMessage()


async def test_each_client_library_connects_as_the_least_acl_user(
    server: ServerSpec, direct: redis.Redis, prefix: str, anyio_backend: str
) -> None:
    """What redis-py, valkey-py and Valkey GLIDE send on connect, with their defaults (RESP3
    where the server has it: HELLO; their library's name: CLIENT SETINFO) and a client
    name and a database (CLIENT SETNAME, SELECT), is granted: a timer is set through each,
    and the server refuses nothing."""
    import glide
    import valkey

    url = acl_user(server, direct, prefix)
    user = url.split("//", 1)[1].split(":", 1)[0]
    host, port = url.rsplit("@", 1)[1].split("/", 1)[0].split(":")
    in_db_1 = url.rsplit("/", 1)[0] + "/1"
    redis_py: dict[str, Any] = {"client_name": "app"}
    if server.family == "redis" and server.version[:2] == (6, 2):
        # redis-py 8 over RESP3 also sends CLIENT MAINT_NOTIFICATIONS, which every server
        # but Redis 6.2 answers as unknown before its ACL looks, and which no other takes
        # as a rule: Redis 6.2 refuses it (redis-py goes on without), as the docs say.
        from redis.maint_notifications import MaintNotificationsConfig

        redis_py["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    clients: list[Any] = [
        redis.Redis.from_url(in_db_1, health_check_interval=1, **redis_py),
        valkey.Valkey.from_url(in_db_1, client_name="app", protocol=3),
    ]
    if anyio_backend == "asyncio":
        clients.append(redis.asyncio.Redis.from_url(in_db_1, **redis_py))
    configuration = glide.GlideClientConfiguration(
        [glide.NodeAddress(host, int(port))],
        credentials=glide.ServerCredentials("pw", user),
        database_id=1,
        client_name="app",
    )
    clients.append(await glide.GlideClient.create(configuration))
    try:
        for client in clients:
            async with Timers(RedisBackend(redis=client, prefix=prefix)) as timers:
                await timers.set("remind", f"k{len(client.__class__.__name__)}", delay_ms=60_000)
    finally:
        for client in clients:
            closing = client.aclose() if hasattr(client, "aclose") else client.close()
            if closing is not None:
                await closing
    assert refusals(direct, user) == []


def as_user(url: str) -> redis.Redis:
    """A plain connection of the ACL user, for the test's own commands."""
    return redis.Redis.from_url(url, protocol=2, decode_responses=True)


def acl_refuses(server: ServerSpec, direct: redis.Redis, url: str, *command: str) -> bool:
    """Whether the ACL refuses ``command`` to the user of ``url``: sent as the user, with
    arguments that would make it do nothing if it were allowed. A command the server
    refuses to everyone (DEBUG, unless enable-debug-command says otherwise) says nothing
    of the ACL: the ACL's own verdict is asked for then (ACL DRYRUN, Redis 7+ and
    Valkey)."""
    user = url.split("//", 1)[1].split(":", 1)[0]
    client = as_user(url)
    try:
        client.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    except redis.exceptions.ResponseError:
        if server.family == "redis" and server.version < (7, 0):
            return False
        return direct.execute_command("ACL", "DRYRUN", user, *command) != "OK"
    finally:
        client.close()
    return False


@pytest.mark.parametrize(
    "command",
    [
        ("CONFIG", "GET", "requirepass"),
        ("CONFIG", "GET", "masterauth"),
        ("CONFIG", "SET", "maxmemory-policy", "not-a-policy"),
        ("CLIENT", "PAUSE", "not-a-timeout"),
        ("CLIENT", "KILL", "ID", "not-an-id"),
        ("CLIENT", "LIST"),
        ("CLIENT", "NO-EVICT", "not-a-switch"),
        ("FLUSHALL", "not-an-option"),
        ("FLUSHDB", "not-an-option"),
        ("KEYS", "*"),
        ("SCAN", "0"),
        ("DEBUG", "SLEEP", "0"),
        ("SCRIPT", "FLUSH", "not-a-mode"),
        ("INFO",),
        ("INFO", "keyspace"),
        ("ACL", "LIST"),
        ("MONITOR",),
        ("SHUTDOWN", "not-an-option"),
    ],
    ids=lambda command: " ".join(command[:2]),
)
def test_the_least_acl_refuses_config_client_control_and_dangerous_commands(
    server: ServerSpec, direct: redis.Redis, prefix: str, command: tuple[str, ...]
) -> None:
    """CONFIG GET would hand out the admin's password (requirepass, masterauth); CLIENT
    PAUSE and KILL reach every client of the server."""
    url = acl_user(server, direct, prefix)
    assert acl_refuses(server, direct, url, *command)


def test_the_least_acl_grants_no_dangerous_or_admin_command_whole(
    server: ServerSpec, direct: redis.Redis, prefix: str
) -> None:
    """No rule names a command (or subcommand) of ``@dangerous`` or ``@admin`` as the
    server counts them; INFO is granted three of its sections only (the bare INFO is
    refused above)."""
    acl_user(server, direct, prefix)
    forbidden = set(direct.execute_command("ACL", "CAT", "dangerous"))
    forbidden |= set(direct.execute_command("ACL", "CAT", "admin"))
    granted = [rule[1:] for rule in acl_rules(prefix, idmp=True) if rule.startswith("+")]
    assert [name for name in granted if name in forbidden] == []


def other_prefixes_keys(prefix: str) -> list[str]:
    """Keys the user of ``prefix`` must be refused: another prefix's, a prefix nested in
    it's that a pattern can tell apart (its format key and registry), and the
    application's own beside anarchon's under the same prefix."""
    other, nested = "o" + prefix, prefix + "eu:"
    return [
        f"{other}format",
        f"{{{other}tick}}:state",
        f"{{{other}remind}}:timers",
        f"{other}tick:runs",
        f"{{{other}}}:jobs",
        f"{nested}format",
        f"{{{nested}}}:instances",
        f"{{{nested}}}:jobs",
        f"{{{nested}}}:timer-kinds",
        f"{{{nested}}}:quarantine",
        f"{{{nested}}}:instance:host:1:abc",
        f"{prefix}session:1",
        f"{{{prefix}session}}:1",
        f"{{{prefix}}}:sessions",
    ]


def test_the_least_acl_refuses_the_keys_and_the_channel_of_another_prefix(
    server: ServerSpec, direct: redis.Redis, prefix: str
) -> None:
    """Read, written, or reached from a script: each of ``other_prefixes_keys`` is
    refused, and so is the hint channel of another prefix and of a nested one."""
    url = acl_user(server, direct, prefix)
    client = as_user(url)
    try:
        for key in other_prefixes_keys(prefix):
            for command in (
                ("GET", key),
                ("SET", key, "x"),
                ("EVAL", "return redis.call('GET', KEYS[1])", "1", key),
            ):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.execute_command(*command)
            # A key a script names without declaring it is refused inside the script.
            with pytest.raises(
                redis.exceptions.ResponseError, match=r"(?i)no permission|can't access"
            ):
                client.execute_command("EVAL", f"return redis.call('GET', '{key}')", "0")
        for channel in ("o" + prefix + "timer-hints", prefix + "eu:timer-hints"):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command("PUBLISH", channel, "run 1 tick")
            pubsub = client.pubsub()
            pubsub.subscribe(channel)
            with pytest.raises(redis.exceptions.NoPermissionError):
                pubsub.get_message(timeout=5)
            pubsub.close()
        # The user's own: allowed, the same ways.
        client.execute_command("SET", f"{prefix}format", "x")
        client.execute_command("EVAL", "return redis.call('GET', KEYS[1])", "1", f"{prefix}format")
        client.execute_command("PUBLISH", prefix + "timer-hints", "nothing")
    finally:
        client.close()
    assert all(direct.get(key) is None for key in other_prefixes_keys(prefix))


_SOURCE = Path(__file__).parent.parent / "src" / "anarchon"


def commands_anarchon_sends() -> set[tuple[str, str]]:
    """Every command of anarchon's source, as (name, first argument if it is a word):
    each ``redis.call`` / ``redis.pcall`` of its scripts, and each tuple or list of its
    Python code that starts with a command's name (one redis-py has a method for:
    ``GET``, ``XINFO STREAM``, ``CONFIG GET``). Not ``anarchon.testing``'s: the kit
    sends them to a server of its own (its faults set its memory limit), never as a
    user the ACL names."""
    found = set()
    for script in (_SOURCE / "_store" / "lua").glob("*.lua"):
        calls = re.findall(r"redis\.p?call\(\s*'(\w+)'(?:\s*,\s*'(\w+)')?", script.read_text())
        found |= {(name.lower(), sub.lower()) for name, sub in calls}
    for module in _SOURCE.rglob("*.py"):
        if module.is_relative_to(_SOURCE / "testing"):
            continue
        for node in ast.walk(ast.parse(module.read_text())):
            if not isinstance(node, ast.Tuple | ast.List) or len(node.elts) < 2:
                continue
            first, second = node.elts[:2]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            name = first.value.lower()
            word = second.value if isinstance(second, ast.Constant) else None
            sub = word.lower() if isinstance(word, str) and word.isalpha() else ""
            known = hasattr(redis.Redis, name) or hasattr(redis.Redis, f"{name}_{sub}")
            if first.value.isupper() and known:
                found.add((name, sub))
    return found


def test_the_acl_grants_every_command_anarchon_sends() -> None:
    """A command added to a script or to the store's Python without its rule would be
    refused to every ACL user at run time: the rules name each, whole or with the
    argument anarchon sends (INFO's sections, XINFO STREAM)."""
    granted = {rule[1:] for rule in acl_rules("cron:", idmp=True) if rule.startswith("+")}
    missing = {
        f"{name} {sub}".strip()
        for name, sub in commands_anarchon_sends()
        if name not in granted and f"{name}|{sub}" not in granted
    }
    assert missing == set()
