"""The claimer: what it does when a claim gets no answer or an error reply, and what it
does with the store's answers to ``run_now``'s manual claim.

Everything runs on real servers. Faults are real too: a loopback proxy that cuts or
freezes the traffic (tests/faults.py), and a server out of memory (an ``OOM`` error
reply, which passes) or a key of the wrong type (``WRONGTYPE``, which does not). How
often the server refused a claim is read from its own error counts (``INFO
errorstats``), not from anarchon's logs."""

from __future__ import annotations

import logging
import secrets
import time

import anyio
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from anarchon import (
    AnarchonError,
    ConnectionFailedError,
    RedisBackend,
    Run,
    RunOverlapError,
    RunResult,
    Scheduler,
)
from anarchon._store.contract import AttemptEnd, ClaimRequest
from anarchon._store.keys import JobKeys
from anarchon.clients import ServerReplyError
from tests.faults import FaultProxy, oom
from tests.helpers import NEVER, OneShot, claim_as, claim_for_a_dead_runner, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


def errors_answered(direct: redis.Redis, code: str) -> int:
    """How many times the server has answered a command with an error reply ``code``
    (Redis 7+ and Valkey count an error raised inside a script by its own code; the test
    is skipped on an older server)."""
    info = direct.info("server")
    version = tuple(int(part) for part in str(info.get("redis_version", "0")).split(".")[:2])
    if "valkey_version" not in info and version < (7, 0):
        pytest.skip(
            f"Redis {info['redis_version']} does not count errors raised inside scripts by "
            "their code (INFO errorstats)"
        )
    stats = direct.info("errorstats").get(f"errorstat_{code}")
    return int(stats["count"]) if stats else 0


# ------------------------------------------------- a claim with no answer (yet)


async def test_a_slot_whose_claim_the_server_refused_for_now_is_claimed_again_and_runs_once(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """The slot's first claim is answered OOM (the server is out of memory for a
    moment). The claim is sent again, keeps its right to start the slot (no newer slot
    of the job is due), and wins once memory is back: the slot runs, once."""
    schedule = OneShot.in_ms(1000)
    slot_ms = int(schedule.at.timestamp() * 1000)
    runs: list[tuple[int, int, str]] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(schedule, name="once")
    async def once(run: Run) -> None:
        runs.append((run.slot_ms, run.attempt, run.trigger))

    async with scheduler:
        await anyio.sleep(max(0.0, slot_ms / 1000 - time.time() - 0.2))
        with oom(direct):
            refused = errors_answered(direct, "OOM")
            await wait_until(
                lambda: errors_answered(direct, "OOM") > refused, 10, "the slot's claim refused"
            )
            assert runs == []
        await wait_until(lambda: bool(runs), 10, "the slot to run once memory is back")
        await anyio.sleep(0.5)  # room for a second run

    assert runs == [(slot_ms, 1, "schedule")]


@pytest.mark.slow
async def test_claims_are_sent_again_through_a_long_outage_and_runs_resume_after_it(
    proxy: FaultProxy, prefix: str
) -> None:
    """Every connection is refused for longer than a failed claim's growing retry
    delays (from 50 ms up to 5 s) take to reach the longest one: a claim fails seven
    times and more. The failed claims go on being sent at the longest delay, nothing
    ends the scheduler, and once the server is back the job's slots run again."""
    started: list[int] = []
    scheduler = Scheduler(RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=3000)

    @scheduler.job(every_ms=1000, name="tick")
    async def tick(run: Run) -> None:
        started.append(run.slot_ms)

    async with scheduler:
        await wait_until(lambda: bool(started), 5, "a first run")
        proxy.refuse(True)
        await anyio.sleep(13)
        proxy.refuse(False)
        back_ms = time.time() * 1000
        await wait_until(
            lambda: any(slot > back_ms for slot in started), 10, "runs after the outage"
        )

    after = [slot for slot in started if slot > back_ms]
    assert after == sorted(set(after))


async def test_a_scheduled_claim_refused_for_good_disables_its_job_alone(
    server_url: str, prefix: str, direct: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Something else wrote one job's state key (a string where the store keeps a
    hash): the server answers that job's claim WRONGTYPE, which no retry can mend. The
    claim is not sent again, that job alone is disabled (said once, at ERROR, with its
    name), and the other job, claimed in the same round trips, goes on running."""
    broken_runs: list[int] = []
    steady_runs: list[int] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), lease_ms=3000)

    @scheduler.job(every_ms=1000, name="broken")
    async def broken(run: Run) -> None:
        broken_runs.append(run.slot_ms)

    @scheduler.job(every_ms=200, name="steady")
    async def steady(run: Run) -> None:
        steady_runs.append(run.slot_ms)

    with caplog.at_level(logging.ERROR, logger="anarchon"):
        async with scheduler:
            await wait_until(lambda: bool(broken_runs and steady_runs), 10, "both jobs to run")
            # Broken between its runs: the last one's finish is recorded, so the next
            # claim (a second later) is the only round trip that meets the string.
            latest: list[RunResult] = []

            async def recorded() -> bool:
                latest[:] = await scheduler.history("broken", limit=1)
                return bool(latest) and latest[0].slot_ms == broken_runs[-1]

            with anyio.fail_after(10):
                while not await recorded():  # noqa: ASYNC110 - polls the store
                    await anyio.sleep(0.01)
            assert latest[0].status == "ok", latest
            before = errors_answered(direct, "WRONGTYPE")
            direct.delete(JobKeys.for_job(prefix, "broken").state)
            direct.set(JobKeys.for_job(prefix, "broken").state, "not a hash")
            broken_at = time.time() * 1000
            await wait_until(
                lambda: errors_answered(direct, "WRONGTYPE") > before, 10, "a refused claim"
            )
            refused_ms = time.time() * 1000
            await wait_until(
                lambda: sum(slot > refused_ms for slot in steady_runs) >= 10,
                15,
                "ten more runs of the other job (and the broken job's next slot)",
            )
            tries = errors_answered(direct, "WRONGTYPE") - before

    assert tries == 1, f"the refused claim was sent {tries} times"
    assert [slot for slot in broken_runs if slot > broken_at + 200] == []
    disabled = [r.getMessage() for r in caplog.records if "disabled" in r.getMessage()]
    assert len(disabled) == 1, disabled
    assert disabled[0].startswith("broken: "), disabled
    assert "WRONGTYPE" in disabled[0], disabled


@pytest.mark.parametrize("frozen", [False, True], ids=["answering", "frozen"])
async def test_a_stop_between_a_failed_claim_and_its_retry_asks_without_claiming(
    proxy: FaultProxy,
    server_url: str,
    prefix: str,
    direct: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    frozen: bool,
) -> None:
    """A slot's claim got no answer (every connection refused, four tries) and waits
    for its next try when the scheduler stops. The stop asks about it once more, as a
    probe that changes nothing: the claim never reached the server, so the stop holds
    nothing and records nothing for the slot, and another instance's claim of it
    wins attempt 1 at once. If the server is frozen as the stop begins (and the client
    has no timeout of its own), the probe has its deadline and the stop ends; the probe
    reaches the server when it goes on, and changes nothing then."""
    every_ms, lease_ms = 2000, 3000
    # No retries of its own: a try the client repeated on its own in an abandoned thread
    # could land a real claim after the outage.
    client = redis.Redis.from_url(
        proxy.url, protocol=2, socket_timeout=None, retry=Retry(NoBackoff(), 0)
    )
    scheduler = Scheduler(RedisBackend(redis=client, prefix=prefix), lease_ms=lease_ms)

    @scheduler.job(every_ms=every_ms, name="tick")
    async def tick() -> None:
        pass

    with caplog.at_level(logging.ERROR, logger="anarchon"):
        async with scheduler:
            await scheduler.run_now("tick")  # the server has the claim script from now on
            slot = (int(time.time() * 1000) + 700) // every_ms * every_ms + every_ms
            await anyio.sleep((slot - 100) / 1000 - time.time())
            proxy.refuse(True)
            # Tries at the slot and about 50, 300 and 800 ms after it (each pause 20 %
            # either way); the fifth is due 1.4-2.2 s after it.
            await anyio.sleep((slot + 1200) / 1000 - time.time())
            proxy.refuse(False)
            if frozen:
                proxy.pause()
            try:
                with anyio.fail_after(10):
                    await scheduler.stop()
            finally:
                proxy.resume()
    await anyio.sleep(0.2)  # what the proxy held reaches the server
    client.close()
    async with Scheduler(RedisBackend(redis=server_url, prefix=prefix)) as reader:
        history = await reader.history("tick", limit=100)

    assert [r for r in history if r.slot_ms == slot] == []
    assert [r.getMessage() for r in caplog.records] == []
    reply = await claim_as("backup", server_url, prefix, "tick", slot, lease_ms)
    assert not isinstance(reply, ServerReplyError), reply
    assert (reply.kind, reply.attempt) == ("won", 1), reply


# ------------------------------------------------------------------ run_now


async def test_run_now_refused_by_an_orphaned_run_takes_that_run_over(
    server_url: str, prefix: str
) -> None:
    """An older run of the job was won by a runner that vanished; its lease has run out
    and the job has no slot due that would notice. run_now is refused (the job does not
    allow overlapping runs), and the orphan its claim heard of is taken over here: its
    next attempt runs on this instance."""
    dead_slot_ms = int(time.time() * 1000)
    await claim_for_a_dead_runner(server_url, prefix, "rare", dead_slot_ms, lease_ms=200)
    runs: list[tuple[int, int, str]] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(NEVER, name="rare")
    async def rare(run: Run) -> None:
        runs.append((run.slot_ms, run.attempt, run.trigger))

    async with scheduler:
        await anyio.sleep(0.4)  # the dead runner's lease runs out
        with pytest.raises(RunOverlapError):
            await scheduler.run_now("rare")
        await wait_until(lambda: bool(runs), 10, "the orphan taken over")
        await anyio.sleep(0.3)  # room for a second run

    assert runs == [(dead_slot_ms, 2, "takeover")]


async def test_run_now_leaves_a_slot_that_ran_a_moment_ago_known_to_a_late_claim(
    server_url: str, prefix: str
) -> None:
    """A slot ran elsewhere a moment ago. run_now's claim also forgets old settled runs
    of the job, but only those no claim can ask about any more: an instance whose first
    claim of the slot comes late (within the lateness window) is told it is done, and
    does not run it a second time."""
    slot_ms = int(time.time() * 1000) - 1000
    backend = RedisBackend(redis=server_url, prefix=prefix)
    elsewhere = await backend.open({"runner": "else", "history_size": 100, "history_ttl_ms": None})

    def first_claim(token: str) -> ClaimRequest:
        return ClaimRequest(
            "report", str(slot_ms), slot_ms, token, "schedule", 30_000, 3, False, 600_000
        )

    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(NEVER, name="report")
    async def report() -> None:
        pass

    try:
        token = secrets.token_hex(8)
        (won,) = await elsewhere.claim_many([first_claim(token)])
        assert not isinstance(won, ServerReplyError) and won.kind == "won", won
        now_ms = int(time.time() * 1000)
        await elsewhere.finish(
            AttemptEnd("report", str(slot_ms), token, 1, "schedule", won.fence, now_ms,
                       now_ms, "ok", None, 3, 1_000)
        )  # fmt: skip
        async with scheduler:
            assert (await scheduler.run_now("report")).status == "ok"
        (late,) = await elsewhere.claim_many([first_claim(secrets.token_hex(8))])
    finally:
        await elsewhere.conn.aclose()

    assert not isinstance(late, ServerReplyError), late
    assert (late.kind, late.status) == ("done", "ok"), late


@pytest.mark.parametrize("refusal", ["OOM", "WRONGTYPE"])
async def test_run_now_sends_its_claim_again_only_while_the_server_refuses_it_for_now(
    server_url: str, prefix: str, direct: redis.Redis, refusal: str
) -> None:
    """OOM (out of memory) may pass: the manual claim is sent again, a few times, then
    run_now raises ConnectionFailedError. WRONGTYPE (something else wrote the job's
    key) will not: run_now raises at once, with the server's refusal, after one try.
    (A try whose answer comes after its deadline, a third of the lease, is sent again,
    as it must be; the lease is long enough for a loaded machine to read it in time.)"""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), lease_ms=9000)

    @scheduler.job(NEVER, name="report")
    async def report() -> None:
        pass

    async with scheduler:
        if refusal == "OOM":
            with oom(direct):
                before = errors_answered(direct, refusal)
                with pytest.raises(ConnectionFailedError, match="report"):
                    await scheduler.run_now("report")
                tries = errors_answered(direct, refusal) - before
            assert tries >= 2, f"the claim was sent {tries} time(s)"
        else:
            direct.set(JobKeys.for_job(prefix, "report").state, "not a hash")
            before = errors_answered(direct, refusal)
            with pytest.raises(AnarchonError, match="refused") as info:
                await scheduler.run_now("report")
            tries = errors_answered(direct, refusal) - before
            assert not isinstance(info.value, ConnectionFailedError), info.value
            assert tries == 1, f"the claim was sent {tries} time(s)"


async def test_run_now_while_the_server_is_frozen_raises_connection_failed_in_time(
    proxy: FaultProxy, prefix: str
) -> None:
    """The server takes the manual claim and never answers (frozen, the connection
    open), and the client has no timeout of its own: each try has anarchon's deadline
    (a third of the lease), so run_now raises ConnectionFailedError after its few
    tries. The bound below is loose: without the deadlines run_now waits for good."""
    client = redis.Redis.from_url(proxy.url, protocol=2, socket_timeout=None)
    scheduler = Scheduler(RedisBackend(redis=client, prefix=prefix), lease_ms=2000)

    @scheduler.job(NEVER, name="report")
    async def report() -> None:
        pass

    try:
        async with scheduler:
            proxy.pause()
            try:
                with anyio.fail_after(30), pytest.raises(ConnectionFailedError, match="report"):
                    await scheduler.run_now("report")
            finally:
                proxy.resume()
    finally:
        client.close()
