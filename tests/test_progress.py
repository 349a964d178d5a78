"""Resumable attempts (``Run.save_progress``, ``Run.progress``) on real servers: a retry
and a takeover after ``kill -9`` resume from the last progress kept; a stale attempt's
progress is refused (the fence); what the store keeps is bounded, goes when the run
settles for good, and a malformed one costs only itself."""

from __future__ import annotations

import secrets
import signal
import time
from typing import Any

import anyio
import pytest
import redis

from anarchon import (
    InvalidOptionError,
    LeaseLostError,
    RedisBackend,
    Run,
    Scheduler,
    TimerRun,
)
from anarchon._store.contract import AttemptEnd, ClaimRequest
from anarchon._store.keys import JobKeys, TimerKeys
from anarchon._store.quarantine import quarantine_of
from anarchon._store.timers import TimerEnd, TimerStore
from tests.helpers import NEVER, OneShotAtFirstAsk, wait_for, wait_until
from tests.test_takeover import LEASE_MS, start_at_one_slot, start_worker, stop_worker

pytestmark = pytest.mark.engine_tier


@pytest.mark.anyio
async def test_a_retry_resumes_from_the_progress_its_failed_attempt_kept(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """Attempt 1 keeps offset 5 and fails; attempt 2 starts from 5, keeps 7 and ends ok:
    the slot's progress is gone from the store once it settled."""
    seen: list[tuple[int, Any]] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), retry_delay_ms=50)

    @scheduler.job(OneShotAtFirstAsk(100), name="export", max_attempts=3)
    async def export(run: Run) -> None:
        seen.append((run.attempt, run.progress))
        if run.attempt == 1:
            await run.save_progress({"offset": 5})
            raise RuntimeError("the warehouse went away")
        await run.save_progress({"offset": 7})

    async with scheduler:
        await wait_until(lambda: len(seen) == 2, 20, "the retry")
        await wait_until(lambda: scheduler.running == 0, 10, "the retry to settle")
    assert seen == [(1, None), (2, {"offset": 5})]
    state = JobKeys.for_job(prefix, "export").state
    assert not [f for f in direct.hkeys(state) if f.startswith("p:")], direct.hgetall(state)


@pytest.mark.slow
def test_a_takeover_after_kill_9_resumes_from_the_last_offset_kept(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """Two workers run a 30-step job that keeps its offset after each step; the runner is
    SIGKILLed mid-way: the backup's attempt 2 starts at the last offset the dead one kept
    (or the one it kept as it died), not at 0, and finishes the rest."""
    names = ("worker-0", "worker-1")
    workers = {name: start_worker(server_url, prefix, name, "asyncio", "resume") for name in names}
    log_key = f"{prefix}log"

    def entries() -> list[list[str]]:
        return [str(e).split("|") for e in direct.lrange(log_key, 0, -1)]

    try:
        start_at_one_slot(list(workers.values()))
        wait_for(lambda: len([e for e in entries() if e[0] == "kept"]) >= 8, 20, "8 steps")
        victim = next(e[1] for e in entries() if e[0] == "start")
        workers[victim].send_signal(signal.SIGKILL)
        workers[victim].wait()
        kept_before = max(int(e[2]) for e in entries() if e[0] == "kept")
        second = wait_for(
            lambda: [e for e in entries() if e[0] == "start" and e[2] == "2"],
            LEASE_MS / 1000 + 10,
            "attempt 2 to start",
        )[0]
        wait_for(lambda: [e for e in entries() if e[0] == "finish"], 10, "attempt 2 to finish")
        survivor = second[1]
        stop_worker(workers[survivor])
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    resumed_at = int(second[5])
    assert survivor != victim
    assert resumed_at in (kept_before, kept_before + 1), (resumed_at, kept_before)
    steps_after = [int(e[2]) for e in entries() if e[0] == "kept" and e[1] == survivor]
    assert steps_after == list(range(resumed_at + 1, 31)), steps_after


@pytest.mark.anyio
@pytest.mark.server_tier
async def test_a_stale_attempt_s_progress_is_refused_and_the_newer_one_s_is_kept(
    server_url: str, prefix: str
) -> None:
    """Attempt 1 keeps 1, then its lease runs out and attempt 2 takes over (it is handed
    1); attempt 1's late write of 99 is refused, attempt 2's 2 is kept, and once attempt 2
    ends ok nothing of it is left."""
    backend = RedisBackend(redis=server_url, prefix=prefix)
    first = await backend.open({"runner": "a", "history_size": 100, "history_ttl_ms": None})
    second = await backend.open({"runner": "b", "history_size": 100, "history_ttl_ms": None})
    slot_ms = int(time.time() * 1000)
    slot = str(slot_ms)

    def claim(token: str) -> ClaimRequest:
        return ClaimRequest(
            "export", slot, slot_ms, token, "schedule", 300, 3, False, 600_000
        )  # fmt: skip

    try:
        old, new = secrets.token_hex(8), secrets.token_hex(8)
        (won,) = await first.claim_many([claim(old)])
        assert not isinstance(won, Exception) and won.kind == "won" and won.progress == ""
        assert await first.save_progress("export", slot, old, "1") is None
        await anyio.sleep(0.4)  # its lease (300 ms) runs out
        (taken,) = await second.claim_many([claim(new)])
        assert not isinstance(taken, Exception) and taken.kind == "won", taken
        assert (taken.attempt, taken.trigger, taken.progress) == (2, "takeover", "1")
        refused = await first.save_progress("export", slot, old, "99")
        assert refused == "running"  # another attempt holds the run: the fence
        assert await second.save_progress("export", slot, new, "2") is None
        (again,) = await second.claim_many([claim(new)])  # a repeat hears what it kept
        assert not isinstance(again, Exception) and again.progress == "2"
        now_ms = int(time.time() * 1000)
        end = AttemptEnd(
            "export", slot, new, 2, "takeover", taken.fence, now_ms, now_ms, "ok", None, 3, 0
        )
        await second.finish(end)
        state = JobKeys.for_job(prefix, "export").state
        assert await second.conn.execute(("HEXISTS", state, f"p:{slot}")) == 0
        assert await second.save_progress("export", slot, new, "3") == "ok"
    finally:
        await first.conn.aclose()
        await second.conn.aclose()


@pytest.mark.anyio
async def test_progress_is_json_of_a_bounded_size_and_a_lost_lease_keeps_nothing(
    server_url: str, prefix: str
) -> None:
    """A value JSON cannot hold, or one over 64 KiB, is refused before anything is sent;
    after the lease is lost, save_progress raises LeaseLostError and keeps nothing; a
    Run made by hand keeps no progress."""
    outcomes: dict[str, str] = {}
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(NEVER, name="export")
    async def export(run: Run) -> None:
        for name, value in (("set", {1, 2}), ("big", "x" * 70_000)):
            try:
                await run.save_progress(value)
            except InvalidOptionError as exc:
                outcomes[name] = str(exc)
        run.lease_lost.set()
        try:
            await run.save_progress(1)
        except LeaseLostError:
            outcomes["lost"] = "refused"

    async with scheduler:
        await scheduler.run_now("export")
    assert "what JSON holds" in outcomes["set"] and "65,536" in outcomes["big"]
    assert outcomes["lost"] == "refused"
    made = Run("export", NEVER.at, 0, 1, "manual", "me", 1)
    with pytest.raises(InvalidOptionError, match="keeps no progress"):
        await made.save_progress(1)
    fire = TimerRun("remind", "k", None, NEVER.at, 0, 1, 1, "due", "me", 1)
    with pytest.raises(InvalidOptionError, match="keeps no progress"):
        await fire.save_progress(1)


@pytest.mark.anyio
async def test_a_malformed_progress_costs_only_its_attempt_s_resumption(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """A progress field that is not JSON (another client's write) is quarantined and
    logged; the attempt starts without it (from the beginning) and runs."""
    seen: list[Any] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), retry_delay_ms=50)
    state = JobKeys.for_job(prefix, "export").state

    @scheduler.job(OneShotAtFirstAsk(100), name="export", max_attempts=2)
    async def export(run: Run) -> None:
        seen.append(run.progress)
        if run.attempt == 1:
            await run.save_progress(5)
            direct.hset(state, f"p:{run.slot_ms}", "{not json")
            raise RuntimeError("again")

    async with scheduler:
        await wait_until(lambda: len(seen) == 2, 20, "the retry")
    assert seen == [None, None]
    met = [(e.key, e.field) for e in quarantine_of(prefix).entries()]
    assert any(key == state and field.startswith("p:") for key, field in met), met


# ------------------------------------------------------------------ timer firings


@pytest.mark.anyio
async def test_a_timer_firing_s_retry_resumes_and_the_next_generation_starts_clean(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """A recurring timer's firing keeps ["account"] and fails; its retry starts from it,
    keeps more and ends ok; the next generation (its recurrence) starts with nothing,
    and nothing is left in the kind's progress once the firings are over."""
    seen: list[tuple[int, int, Any]] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), retry_delay_ms=50)

    @scheduler.timer("onboard", max_attempts=3)
    async def onboard(fire: TimerRun) -> None:
        seen.append((fire.generation, fire.attempt, fire.progress))
        if fire.attempt == 1 and len(seen) == 1:
            await fire.save_progress(["account"])
            raise RuntimeError("the mail server went away")
        await fire.save_progress(["account", "mailbox"])

    async with scheduler:
        await scheduler.set_timer("onboard", "user:42", delay_ms=0, every_ms=600)
        await wait_until(lambda: len(seen) >= 3, 20, "the retry and the next generation")
        await scheduler.cancel_timer("onboard", "user:42")
        await wait_until(lambda: scheduler.running == 0, 10, "the firings to settle")
    (gen, attempt, first), (gen2, attempt2, resumed), (gen3, attempt3, fresh) = seen[:3]
    assert (attempt, first) == (1, None)
    assert (gen2, attempt2, resumed) == (gen, 2, ["account"])
    assert gen3 > gen and (attempt3, fresh) == (1, None)
    progress = TimerKeys.for_kind(prefix, "onboard").progress
    await wait_until(lambda: direct.hlen(progress) == 0, 5, "the progress to go")


@pytest.mark.anyio
@pytest.mark.server_tier
async def test_a_stale_firing_s_progress_is_refused_and_a_set_drops_an_older_one(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """On every server: a firing keeps 1, its lease runs out and a takeover is handed 1;
    the stale attempt's write is refused, the takeover's kept; a new set of the key while
    no firing is in flight drops what an older generation kept; a progress that does not
    read (another client's) is reported and not handed to the attempt."""
    backend = RedisBackend(redis=server_url, prefix=prefix)
    timers = TimerStore(await backend.open_connection(), prefix=prefix, runner="a")
    keys = TimerKeys.for_kind(prefix, "onboard")
    try:
        await timers.set_many("onboard", [("user:1", None, 0, "", "")], 1)
        (first,) = (await timers.claim(keys, limit=5, lease_ms=300, token_base="a",
                                       max_attempts=3)).wins  # fmt: skip
        assert (first.attempt, first.progress) == (1, "")
        assert await timers.save_progress(keys, "user:1", first.token, "1") is None
        await anyio.sleep(0.4)  # its lease (300 ms) runs out
        (taken,) = (await timers.claim(keys, limit=5, lease_ms=3000, token_base="b",
                                       max_attempts=3)).wins  # fmt: skip
        assert (taken.attempt, taken.trigger, taken.progress) == (2, "takeover", "1")
        assert await timers.save_progress(keys, "user:1", first.token, "99") == "firing"
        assert await timers.save_progress(keys, "user:1", taken.token, "2") is None
        end = TimerEnd("onboard", "user:1", taken.token, "failed", 3, 0)
        assert (await timers.finish(end, keys)).status == "retry"
        await timers.set_many("onboard", [("user:1", None, 60_000, "", "")], 1)
        assert direct.hlen(keys.progress) == 0
        # Another client's progress (not '<generation>|<json>'): reported, not handed on.
        await timers.set_many("onboard", [("user:2", None, 0, "", "")], 1)
        claim = await timers.claim(keys, limit=5, lease_ms=300, token_base="c", max_attempts=3)
        assert [(w.key, w.attempt) for w in claim.wins] == [("user:2", 1)]
        direct.hset(keys.progress, "user:2", "garbage")
        await anyio.sleep(0.4)  # its lease (300 ms) runs out
        claim = await timers.claim(keys, limit=5, lease_ms=300, token_base="d", max_attempts=3)
        assert [(w.key, w.attempt, w.progress) for w in claim.wins] == [("user:2", 2, "")]
        met = [(e.key, e.field) for e in quarantine_of(prefix).entries()]
        assert (keys.progress, "user:2") in met, met
    finally:
        await timers.conn.aclose()
