"""The claim-only strategies: stream-id, idmp and script, as the seed describes them."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import redis

from anarchon import (
    ClaimOnly,
    InvalidOptionError,
    RedisBackend,
    Run,
    Scheduler,
    UnsupportedServerError,
    ValkeyBackend,
)
from tests.helpers import NEVER, OneShot, Seconds, wait_until
from tests.servers import NO_IDMP, ServerSpec, has_idmp

pytestmark = [pytest.mark.anyio, pytest.mark.server_tier]

STRATEGIES = ["stream-id", "idmp", "script"]


def supports(server: ServerSpec, strategy: str) -> bool:
    return strategy != "idmp" or has_idmp(server)


def test_stream_id_the_second_xadd_of_a_slot_is_refused(
    server: ServerSpec, server_url: str, direct: redis.Redis
) -> None:
    """The seed's transcript: the first XADD with the slot as id wins."""
    key = "cron:sync:runs"
    direct.delete(key)
    first = direct.execute_command("XADD", key, "1791633610000-0", "slot", "s", "token", "a1")
    assert first == "1791633610000-0"
    with pytest.raises(redis.ResponseError, match="equal or smaller"):
        direct.execute_command("XADD", key, "1791633610000-0", "slot", "s", "token", "b7")
    direct.delete(key)


def test_idmp_both_xadds_of_a_slot_answer_the_same_entry(
    server: ServerSpec, server_url: str, direct: redis.Redis
) -> None:
    """The seed's transcript: Redis keeps the first entry for an idempotency key."""
    if not has_idmp(server):
        pytest.skip(NO_IDMP.format(server.id))
    key = "cron:sync:runs"
    direct.delete(key)
    a = direct.execute_command("XADD", key, "IDMP", "sync", "1791633610000", "*", "token", "a1")
    b = direct.execute_command("XADD", key, "IDMP", "sync", "1791633610000", "*", "token", "b7")
    assert a == b
    assert direct.xrange(key) == [(a, {"token": "a1"})]
    direct.delete(key)


async def test_idmp_on_a_server_without_it_fails_at_start_naming_the_others(
    server: ServerSpec, server_url: str, prefix: str, direct: redis.Redis
) -> None:
    if has_idmp(server):
        pytest.skip(f"{server.id} has idempotent XADD: idmp starts there")
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix, strategy="idmp"))
    with pytest.raises(UnsupportedServerError) as info:
        async with scheduler:
            pass
    assert info.value.code == "ANARCHON_UNSUPPORTED_SERVER"
    for other in ("'lease'", "'script'", "'stream-id'"):
        assert other in str(info.value)
    assert list(direct.scan_iter(match=f"{prefix}*")) == []


@pytest.mark.needs_idmp
async def test_idmp_configures_each_stream_once_with_its_settings(
    server: ServerSpec, server_url: str, prefix: str, direct: redis.Redis
) -> None:
    strategy: Any = {"name": "idmp", "duration_sec": 900, "max_size": 5000}
    for _ in range(2):
        scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix, strategy=strategy))
        scheduler.add_job(lambda: None, "0 0 1 1 *", name="yearly")
        async with scheduler:
            pass
    info = direct.execute_command("XINFO", "STREAM", f"{prefix}yearly:runs")
    fields = dict(zip(info[::2], info[1::2], strict=True))
    assert (int(fields["idmp-duration"]), int(fields["idmp-maxsize"])) == (900, 5000)


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_run_now_writes_the_manual_stream_and_the_result(
    server: ServerSpec, server_url: str, prefix: str, direct: redis.Redis, strategy: str
) -> None:
    if not supports(server, strategy):
        pytest.skip(NO_IDMP.format(server.id))
    runs: list[Run] = []
    backend = RedisBackend(redis=server_url, prefix=prefix, strategy=strategy)  # type: ignore[call-overload]
    scheduler: Scheduler[ClaimOnly] = Scheduler(backend, instance_id="here")

    @scheduler.job(NEVER, name="yearly")
    async def yearly(run: Run) -> None:
        runs.append(run)

    async with scheduler:
        result = await scheduler.run_now("yearly")
        history = await scheduler.history("yearly")

    assert (result.status, result.trigger, result.runner) == ("ok", "manual", "here")
    assert history == [result]
    manual = direct.xrange(f"{prefix}yearly:manual")
    assert [(fields["slot"], fields["runner"]) for _, fields in manual] == [
        (f"m{result.slot_ms}-" + manual[0][1]["slot"].split("-", 1)[1], "here")
    ]
    assert direct.zcard(f"{prefix}yearly:results") == 1
    assert not direct.exists(f"{prefix}yearly:runs") or strategy == "idmp"
    # The manual run's fence is the server's time of its entry, not this instance's.
    assert runs[0].fence == result.fence == int(manual[0][0].split("-")[0])


@pytest.mark.parametrize("strategy", ["stream-id", "script"])
async def test_a_claim_only_run_records_its_result_and_keys(
    server_url: str, prefix: str, direct: redis.Redis, strategy: str
) -> None:
    schedule = OneShot.in_ms(100)
    runs: list[Run] = []
    backend = ValkeyBackend(valkey=server_url, prefix=prefix, strategy=strategy)  # type: ignore[call-overload]
    scheduler: Scheduler[ClaimOnly] = Scheduler(backend)

    @scheduler.job(schedule, name="once")
    def once(run: Run) -> None:
        runs.append(run)
        raise ValueError("recorded, not retried")

    async with scheduler:
        await wait_until(lambda: bool(runs), 5, "the run")
        await anyio.sleep(0.2)
        history = await scheduler.history("once")

    assert [(r.attempt, r.status) for r in history] == [(1, "failed")]
    assert history[0].error is not None and "recorded, not retried" in history[0].error
    assert sorted(direct.scan_iter(match=f"{prefix}once*")) == [
        f"{prefix}once:results",
        f"{prefix}once:runs",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_claim_only_history_older_than_history_ttl_ms_is_dropped(
    server: ServerSpec, server_url: str, prefix: str, direct: redis.Redis, strategy: str
) -> None:
    """Results older than history_ttl_ms leave the results set at the next result; on
    servers with XTRIM MINID (Redis 6.2+, Valkey) their entries leave the manual stream
    and the runs stream too, but for the script strategy's, which is its memory of
    claims for window_ms. Older servers bound the streams by history_size alone."""
    if not supports(server, strategy):
        pytest.skip(NO_IDMP.format(server.id))
    schedule = Seconds(delay_ms=1_000, count=3)
    first_ms, _, last_ms = (int(at.timestamp() * 1000) for at in schedule.instants)
    backend: Any = RedisBackend(redis=server_url, prefix=prefix, strategy=strategy)
    scheduler: Scheduler[ClaimOnly] = Scheduler(backend, history_ttl_ms=1_500)
    scheduler.add_job(lambda: None, schedule, name="often")
    results_key, runs_key, manual_key = (
        f"{prefix}often:{k}" for k in ("results", "runs", "manual")
    )

    def first_result_dropped() -> bool:
        # The last run ends 2 s after the first slot: its finish records its result,
        # then drops what is older than 1.5 s (the results set last), the manual run
        # and the first slot.
        return bool(direct.zcount(results_key, last_ms, last_ms)) and not direct.zcount(
            results_key, first_ms, first_ms
        )

    async with scheduler:
        manual = await scheduler.run_now("often")
        await wait_until(first_result_dropped, 10, "the first slot's result to be dropped")
        kept = {result.slot_ms for result in await scheduler.history("often")}

    assert manual.slot_ms not in kept
    assert first_ms not in kept
    assert last_ms in kept
    claimed = {fields["slot"] for _, fields in direct.xrange(runs_key)}
    assert str(last_ms) in claimed
    if server.family == "valkey" or server.version >= (6, 2):
        assert direct.xlen(manual_key) == 0
        assert (str(first_ms) in claimed) == (strategy == "script")
    else:
        assert direct.xlen(manual_key) == 1
        assert str(first_ms) in claimed


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        ({"name": "lease", "window_ms": 1}, "belongs to script"),
        ({"name": "stream-id", "duration_sec": 5}, "belongs to idmp"),
        ({"name": "script", "max_size": 5}, "belongs to idmp"),
        ({"name": "idmp", "duration_sec": 0}, "from 1 to 86400"),
        ({"name": "idmp", "duration_sec": 86_401}, "from 1 to 86400"),
        ({"name": "idmp", "max_size": 10_001}, "from 1 to 10000"),
        ({"name": "idmp", "max_size": "5"}, "whole number"),
        ({"name": "script", "window_ms": 0}, "window_ms must be"),
        ("raft", "unknown strategy"),
    ],
)
def test_a_wrong_strategy_setting_is_refused_when_the_backend_is_created(
    strategy: Any, message: str
) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        RedisBackend(strategy=strategy)


@pytest.mark.parametrize("strategy", ["idmp", {"name": "idmp", "duration_sec": 60}])
def test_valkey_backend_refuses_idmp(strategy: Any) -> None:
    with pytest.raises(InvalidOptionError, match="ValkeyBackend does not offer"):
        ValkeyBackend(strategy=strategy)


@pytest.mark.parametrize(
    "options", [{"lease_ms": 10_000}, {"heartbeat_ms": 1_000}, {"retry_delay_ms": 5}]
)
def test_scheduler_lease_options_are_refused_with_a_claim_only_strategy(
    options: dict[str, int],
) -> None:
    with pytest.raises(InvalidOptionError, match="lease option"):
        Scheduler(RedisBackend(strategy="stream-id"), **options)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "options", [{"overlap": True}, {"max_attempts": 2}, {"catch_up_ms": 60_000}]
)
def test_job_lease_options_are_refused_with_a_claim_only_strategy(options: dict[str, Any]) -> None:
    scheduler = Scheduler(RedisBackend(strategy="script"))
    with pytest.raises(InvalidOptionError, match="lease option"):
        scheduler.add_job(lambda: None, "* * * * *", name="x", **options)


def test_a_job_later_than_the_script_window_is_refused() -> None:
    scheduler = Scheduler(RedisBackend(strategy={"name": "script", "window_ms": 60_000}))
    scheduler.add_job(lambda: None, "* * * * *", name="fits", max_late_ms=50_000)
    with pytest.raises(InvalidOptionError, match="window_ms"):
        scheduler.add_job(
            lambda: None, "* * * * *", name="late", max_late_ms=55_000, jitter_ms=5_000
        )


def test_a_job_later_than_the_idmp_duration_is_refused() -> None:
    scheduler = Scheduler(RedisBackend(strategy={"name": "idmp", "duration_sec": 60}))
    scheduler.add_job(lambda: None, "* * * * *", name="fits", max_late_ms=50_000)
    with pytest.raises(InvalidOptionError) as info:
        scheduler.add_job(
            lambda: None, "* * * * *", name="late", max_late_ms=55_000, jitter_ms=5_000
        )
    assert "duration_sec (60 s)" in str(info.value)
    assert "lower max_late_ms" in str(info.value)
    assert "raise duration_sec" in str(info.value)
    assert scheduler.jobs == ["fits"]
