"""The lease rules: retries, overlap, catch-up, lateness, run_now, fencing, memory, cost."""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest
import redis

from anarchon import (
    Event,
    RedisBackend,
    Run,
    RunOverlapError,
    RunResult,
    RunRetried,
    Scheduler,
    SlotSkipped,
)
from anarchon._model.schedule import iso_ms
from anarchon._store.contract import AttemptEnd, ClaimRequest
from anarchon._store.keys import JobKeys
from tests.helpers import NEVER, CommandLog, Ledger, OneShot, Seconds, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


async def sleep_until_after_second(offset_sec: float) -> None:
    """Wait for a whole second boundary plus ``offset_sec``."""
    now = time.time()
    await anyio.sleep(math.ceil(now) - now + offset_sec)


# ----------------------------------------------------------------- retries


async def test_a_handler_failing_twice_then_succeeding_runs_three_attempts_with_the_delays(
    server_url: str, prefix: str
) -> None:
    calls: list[int] = []
    retries: list[RunRetried] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), retry_delay_ms=1000)
    scheduler.on_event(lambda e: retries.append(e) if isinstance(e, RunRetried) else None)

    @scheduler.job(OneShot.in_ms(100), name="flaky", max_attempts=3)
    async def flaky(run: Run) -> None:
        calls.append(run.attempt)
        if run.attempt < 3:
            raise RuntimeError(f"boom {run.attempt}")

    async with scheduler:
        await wait_until(lambda: len(calls) == 3, 15, "three attempts")
        history: list[RunResult] = []
        with anyio.fail_after(5):
            while len(history) < 3:  # the third attempt's result, once it has settled
                await anyio.sleep(0.05)
                history = sorted(await scheduler.history("flaky"), key=lambda r: r.attempt)

    assert calls == [1, 2, 3]
    assert [(r.attempt, r.status, r.trigger) for r in history] == [
        (1, "failed", "schedule"),
        (2, "failed", "retry"),
        (3, "ok", "retry"),
    ]
    assert history[0].error is not None and "boom 1" in history[0].error
    # Delays from retry_delay_ms, doubling: 1 s, then 2 s, as the store answered each
    # failure's finish, and kept on the server's clock (the failure's finish and the
    # next attempt's claim): it refuses a retry before its time. How late a retry
    # starts after that is the machine's (a starved loop claims late), so it is not
    # bounded here.
    assert [(e.attempt, e.in_ms) for e in retries] == [(1, 1000), (2, 2000)]
    gap_1 = history[1].started_at - history[0].finished_at
    gap_2 = history[2].started_at - history[1].finished_at
    assert gap_1 >= timedelta(milliseconds=1000), gap_1
    assert gap_2 >= timedelta(milliseconds=2000), gap_2


async def test_with_max_attempts_two_a_failing_run_ends_failed(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    calls: list[int] = []
    schedule = OneShot.in_ms(100)
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), retry_delay_ms=100)

    @scheduler.job(schedule, name="broken", max_attempts=2)
    async def broken(run: Run) -> None:
        calls.append(run.attempt)
        raise RuntimeError("always")

    async with scheduler:
        await wait_until(lambda: len(calls) == 2, 10, "two attempts")
        await anyio.sleep(0.5)
        history = sorted(await scheduler.history("broken"), key=lambda r: r.attempt)

    assert calls == [1, 2]
    assert [(r.attempt, r.status) for r in history] == [(1, "failed"), (2, "failed")]
    slot = str(int(schedule.at.timestamp() * 1000))
    state = str(direct.hget(JobKeys.for_job(prefix, "broken").state, slot))
    assert state.startswith("failed|2|")
    assert direct.smembers(JobKeys.for_job(prefix, "broken").active) == set()


# ----------------------------------------------------------------- overlap


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
async def test_a_slow_job_every_second_overlaps_only_when_allowed(
    server_url: str, prefix: str, overlap: bool
) -> None:
    schedulers = []
    for index in range(2):
        scheduler = Scheduler(
            RedisBackend(redis=server_url, prefix=prefix), instance_id=f"i{index}"
        )

        @scheduler.job("* * * * * *", name="slow", overlap=overlap)
        async def slow() -> None:
            await anyio.sleep(3.5)

        schedulers.append(scheduler)

    async with schedulers[0], schedulers[1]:
        await anyio.sleep(8)
        # Let the runs in progress end, so that their results are recorded.
        await schedulers[0].stop(grace_ms=5000)
        await schedulers[1].stop(grace_ms=5000)
    async with Scheduler(RedisBackend(redis=server_url, prefix=prefix)) as reader:
        history = await reader.history("slow")

    done = sorted((r for r in history if r.status == "ok"), key=lambda r: r.started_at)
    assert len(done) >= 2
    overlapping = [
        (a.slot_ms, b.slot_ms) for a, b in itertools.pairwise(done)
        if b.started_at < a.finished_at
    ]  # fmt: skip
    if overlap:
        assert overlapping, "overlap=True should let a run start while the previous one runs"
    else:
        assert overlapping == []


async def slow_job_history(
    server_url: str, prefix: str, overlap: str, caplog: pytest.LogCaptureFixture
) -> list[Any]:
    """Two instances run a job every 500 ms whose runs take 1.2 s; its history after 4 s."""
    schedulers = []
    for index in range(2):
        scheduler = Scheduler(
            RedisBackend(redis=server_url, prefix=prefix),
            instance_id=f"i{index}",
            lease_ms=3000,
        )

        @scheduler.job(every_ms=500, name="slow", overlap=overlap)  # type: ignore[arg-type]
        async def slow() -> None:
            await anyio.sleep(1.2)

        schedulers.append(scheduler)

    with caplog.at_level(logging.WARNING, logger="anarchon"):
        async with schedulers[0], schedulers[1]:
            await anyio.sleep(4)
            await schedulers[0].stop(grace_ms=3000)
            await schedulers[1].stop(grace_ms=3000)
    async with Scheduler(RedisBackend(redis=server_url, prefix=prefix)) as reader:
        return sorted(await reader.history("slow"), key=lambda r: r.slot_ms)


@pytest.mark.slow
async def test_a_skipped_slot_is_recorded_in_history_once_with_its_reason_and_a_warning(
    server_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    history = await slow_job_history(server_url, prefix, "skip", caplog)
    skipped = [r for r in history if r.status == "skipped"]
    ran = [r for r in history if r.status == "ok"]
    assert ran and skipped
    assert all(r.attempt == 0 and r.error and "overlap" in r.error for r in skipped)
    # One record per slot, whichever instances claimed it.
    assert len({r.slot_ms for r in skipped}) == len(skipped)
    assert not {r.slot_ms for r in skipped} & {r.slot_ms for r in ran}
    # A WARNING for each skipped slot (whichever instance recorded it).
    warned = {r.args[1] for r in caplog.records if "skipped (recorded in history)" in r.msg}
    assert warned == {iso_ms(r.slot_ms) for r in skipped}


@pytest.mark.slow
async def test_with_overlap_wait_one_slot_runs_right_after_the_older_run_and_the_rest_skip(
    server_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    history = await slow_job_history(server_url, prefix, "wait", caplog)
    ran = [r for r in history if r.status == "ok"]
    skipped = [r for r in history if r.status == "skipped"]
    assert len(ran) >= 2 and skipped
    waited = 0
    for older, newer in itertools.pairwise(ran):
        assert newer.started_at >= older.finished_at  # one at a time
        if newer.started_at - newer.slot > timedelta(milliseconds=300):
            # A slot that waited starts as soon as the older run ends.
            waited += 1
            assert newer.started_at - older.finished_at < timedelta(milliseconds=400)
    assert waited


# ----------------------------------------------------------------- catch-up


@pytest.mark.slow
@pytest.mark.parametrize("catch_up_slots", [5, 0])
async def test_after_ten_missed_slots_catch_up_runs_those_in_its_window_oldest_first(
    server_url: str, prefix: str, direct: redis.Redis, catch_up_slots: int
) -> None:
    ledger = Ledger(direct, prefix)
    order: list[tuple[int, str]] = []

    def instance(catch_up_ms: int) -> Scheduler:
        scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

        @scheduler.job("* * * * * *", name="tick", catch_up_ms=catch_up_ms)
        async def tick(run: Run) -> None:
            await ledger.record(run)
            order.append((run.slot_ms, run.trigger))

        return scheduler

    await sleep_until_after_second(0.3)
    async with instance(0):
        await anyio.sleep(2)
    stopped_ms = time.time() * 1000
    await anyio.sleep(10)  # ten slots pass with no instance up
    await sleep_until_after_second(0.3)
    order.clear()
    window_ms = catch_up_slots * 1000 + 200
    restarting_ms = int(time.time() * 1000)
    async with instance(window_ms):
        started_ms = int(time.time() * 1000)
        # The catch-up slots are claimed one after the other, oldest first, before the
        # first slot due after the start.
        await wait_until(
            lambda: any(t == "schedule" for _, t in order), 10, "the first scheduled run"
        )

    def window(now_ms: int) -> list[int]:
        """The slots a start at ``now_ms`` catches up: due at most window_ms before it."""
        if not catch_up_slots:
            return []
        first = math.ceil((now_ms - window_ms) / 1000) * 1000
        return list(range(first, now_ms, 1000))

    # The start took its catch-up window at some moment between these two clock reads
    # (0.3 s past a second, so exactly five slots; a loaded machine may delay it).
    windows = {tuple(window(now)) for now in range(restarting_ms, started_ms + 1)}
    caught = [slot for slot, trigger in order if trigger == "catch-up"]
    # Exactly the newest missed slots in the window (five, or none), oldest first.
    assert tuple(caught) in windows, (caught, sorted(windows))
    assert len(caught) == catch_up_slots
    missed = list(range(math.ceil(stopped_ms / 1000) * 1000, restarting_ms, 1000))
    assert len(missed) >= 10
    counts = ledger.counts()
    # Of the slots missed while no instance was up, those caught up ran, no other.
    assert [slot for slot in missed if ("tick", slot) in counts] == [
        slot for slot in caught if slot < restarting_ms
    ]
    assert all(n == 1 for n in counts.values())


# ----------------------------------------------------------------- lateness


@pytest.mark.slow
async def test_an_instance_whose_event_loop_was_blocked_does_not_run_the_late_slots(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    ledger = Ledger(direct, prefix)
    block_at = OneShot.in_ms(500)
    block_ms = int(block_at.at.timestamp() * 1000)
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job("* * * * * *", name="tick", max_late_ms=300)
    async def tick(run: Run) -> None:
        await ledger.record(run)

    @scheduler.job(block_at, name="blocker")
    async def blocker() -> None:
        time.sleep(2.5)  # noqa: ASYNC251 - blocks the event loop on purpose

    async with scheduler:
        await wait_until(lambda: ("tick", block_ms + 4000) in ledger.counts(), 10, "a later tick")

    ran = {slot for job, slot in ledger.counts() if job == "tick"}
    # The slots due while the loop was blocked were more than 300 ms late when it
    # woke up: they were not claimed. The first one after the block ran.
    assert block_ms + 1000 not in ran
    assert block_ms + 2000 not in ran
    assert block_ms + 3000 in ran


# ----------------------------------------------------------------- run_now


async def test_run_now_runs_here_as_a_manual_run_recorded_in_history(
    server_url: str, prefix: str
) -> None:
    runs: list[Run] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), instance_id="here")

    @scheduler.job(NEVER, name="yearly")
    async def yearly(run: Run) -> None:
        runs.append(run)

    async with scheduler:
        result = await scheduler.run_now("yearly")
        history = await scheduler.history("yearly")

    assert (result.status, result.trigger, result.runner, result.attempt) == (
        "ok", "manual", "here", 1,
    )  # fmt: skip
    assert [r.trigger for r in runs] == ["manual"]
    assert history == [result]
    assert abs(result.slot - datetime.now(UTC)) < timedelta(seconds=5)


async def test_a_failed_run_now_is_one_attempt_and_is_not_retried(
    server_url: str, prefix: str
) -> None:
    """run_now is one attempt, whatever the job's max_attempts: a failure is its result,
    recorded failed, and no retry follows (the job would retry a scheduled slot)."""
    calls: list[int] = []
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), retry_delay_ms=100)

    @scheduler.job(NEVER, name="yearly", max_attempts=3)
    async def yearly(run: Run) -> None:
        calls.append(run.attempt)
        raise RuntimeError("the report failed")

    async with scheduler:
        result = await scheduler.run_now("yearly")
        await anyio.sleep(1.0)  # ten retry delays
        history = await scheduler.history("yearly")

    assert (result.status, result.attempt) == ("failed", 1), result
    assert calls == [1]
    assert [(r.slot_ms, r.attempt, r.status) for r in history] == [(result.slot_ms, 1, "failed")]


@pytest.mark.parametrize("overlap", [False, True])
async def test_run_now_respects_overlap(server_url: str, prefix: str, overlap: bool) -> None:
    started = anyio.Event()
    release = anyio.Event()
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(OneShot.in_ms(100), name="busy", overlap=overlap)
    async def busy(run: Run) -> None:
        if run.trigger == "schedule":
            started.set()
            await release.wait()

    async with scheduler:
        with anyio.fail_after(5):
            await started.wait()
        if overlap:
            assert (await scheduler.run_now("busy")).status == "ok"
        else:
            with pytest.raises(RunOverlapError) as info:
                await scheduler.run_now("busy")
            assert info.value.code == "ANARCHON_OVERLAP"
        release.set()


async def test_run_now_refused_by_a_run_on_this_instance_says_so(
    server_url: str, prefix: str
) -> None:
    started = anyio.Event()
    release = anyio.Event()
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(OneShot.in_ms(100), name="busy")
    async def busy(run: Run) -> None:
        started.set()
        await release.wait()

    async with scheduler:
        with anyio.fail_after(5):
            await started.wait()
        with pytest.raises(RunOverlapError) as info:
            await scheduler.run_now("busy")
        release.set()

    assert "on this instance" in str(info.value)
    assert "elsewhere" not in str(info.value)


# ----------------------------------------------------------------- fencing


@pytest.mark.slow
async def test_fences_of_successive_wins_strictly_increase(server_url: str, prefix: str) -> None:
    seen: list[tuple[int, int]] = []
    schedulers = []
    for index in range(3):
        scheduler = Scheduler(
            RedisBackend(redis=server_url, prefix=prefix), instance_id=f"i{index}"
        )

        @scheduler.job("* * * * * *", name="fenced", jitter_ms=200)
        async def fenced(run: Run) -> None:
            seen.append((run.slot_ms, run.fence))

        schedulers.append(scheduler)
    async with schedulers[0], schedulers[1], schedulers[2]:
        await anyio.sleep(4.5)
    fences = [fence for _, fence in sorted(seen)]
    assert len(fences) >= 3
    assert fences == sorted(set(fences))


# ----------------------------------------------------------------- memory


async def test_five_thousand_slots_keep_every_key_of_the_job_within_bounds(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """History stays within history_size; the state holds the active runs and the
    runs settled within the last keep_ms (and, without a finish, nothing more)."""
    history_size = 100
    backend = RedisBackend(redis=server_url, prefix=prefix)
    store = await backend.open(
        {"runner": "r", "history_size": history_size, "history_ttl_ms": None}
    )
    keys = JobKeys.for_job(prefix, "busy")
    keep_ms = 500
    now_ms = int(time.time() * 1000)
    slots = [now_ms - (5000 - i) * 1000 for i in range(5000)]
    finished_at: list[float] = []
    try:
        for slot in slots:
            token = secrets.token_hex(8)
            last_claim = time.time()
            (reply,) = await store.claim_many(
                [
                    ClaimRequest(
                        "busy", str(slot), slot, token, "schedule", 30_000, 3, False, keep_ms
                    )
                ]
            )
            assert getattr(reply, "kind", reply) == "won"
            await store.finish(
                AttemptEnd("busy", str(slot), token, 1, "schedule", 0, 0, 0, "ok", None, 3, 0)
            )
            finished_at.append(time.time())
    finally:
        await store.conn.aclose()

    assert direct.xlen(keys.runs) <= history_size
    assert direct.zcard(keys.results) <= history_size
    # The last claim trimmed every run settled more than keep_ms before it (100 ms of
    # margin for the two clocks' reading granularity), but never the slot it claimed.
    recent = sum(1 for t in finished_at if t >= last_claim - keep_ms / 1000 - 0.1)
    assert len(slots) > recent
    assert direct.zcard(keys.slots) <= recent + 1
    assert direct.hlen(keys.state) <= recent + 2  # and the fence counter
    assert direct.scard(keys.active) == 0


async def test_a_long_run_is_remembered_after_it_settles_while_its_backup_may_still_ask(
    server_url: str, prefix: str
) -> None:
    """Invariant 5: a run that outlived the keep window (a long job, heartbeating) is
    still remembered for keep_ms after it settles, so its backup's next claim is told
    ``done`` instead of winning the slot again; a newer slot's first claim trims
    only runs that settled long enough ago."""
    backend = RedisBackend(redis=server_url, prefix=prefix)
    store = await backend.open({"runner": "r", "history_size": 100, "history_ttl_ms": None})
    keep_ms = 2_000
    now_ms = int(time.time() * 1000)
    old_slot = now_ms - 10_000  # older than the keep window when it settles

    def request(slot: int, token: str) -> ClaimRequest:
        return ClaimRequest("long", str(slot), slot, token, "schedule", 30_000, 1, True, keep_ms)

    try:
        runner, backup = secrets.token_hex(8), secrets.token_hex(8)
        (won,) = await store.claim_many([request(old_slot, runner)])
        assert getattr(won, "kind", won) == "won"
        (waiting,) = await store.claim_many([request(old_slot, backup)])
        assert getattr(waiting, "kind", waiting) == "running"
        await store.finish(
            AttemptEnd("long", str(old_slot), runner, 1, "schedule", 0, 0, 0, "ok", None, 1, 0)
        )
        # A newer slot's first claim trims old settled runs...
        (newer,) = await store.claim_many([request(now_ms, secrets.token_hex(8))])
        assert getattr(newer, "kind", newer) == "won"
        # ...but not the one that settled a moment ago: the backup hears it is done.
        (again,) = await store.claim_many([request(old_slot, backup)])
        assert (getattr(again, "kind", again), getattr(again, "status", None)) == ("done", "ok")
        # Once it has been settled for longer than keep_ms, it is forgotten.
        await anyio.sleep(keep_ms / 1000 + 0.1)
        (later,) = await store.claim_many([request(now_ms + 5_000, secrets.token_hex(8))])
        assert getattr(later, "kind", later) == "won"
        keys = JobKeys.for_job(prefix, "long")
        assert await store.conn.execute(("HEXISTS", keys.state, str(old_slot))) == 0
    finally:
        await store.conn.aclose()


async def test_a_backups_claim_of_a_forgotten_slot_is_told_done_and_starts_nothing(
    server_url: str, prefix: str
) -> None:
    """Only a first claim starts a run: a later claim (a backup's, a retry's) that finds
    no state is answered done, forgotten, and leaves no state behind."""
    backend = RedisBackend(redis=server_url, prefix=prefix)
    store = await backend.open({"runner": "r", "history_size": 100, "history_ttl_ms": None})
    slot = int(time.time() * 1000) - 600_000
    try:
        (reply,) = await store.claim_many(
            [
                ClaimRequest(
                    "gone", str(slot), slot, secrets.token_hex(8), "retry", 30_000, 3, False,
                    60_000, may_start=False,
                )
            ]
        )  # fmt: skip
        assert (getattr(reply, "kind", reply), getattr(reply, "status", None)) == (
            "done",
            "forgotten",
        )
        keys = JobKeys.for_job(prefix, "gone")
        assert await store.conn.execute(("EXISTS", keys.state, keys.active, keys.runs)) == 0
    finally:
        await store.conn.aclose()


# ----------------------------------------------------------------- cost


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["lease", "stream-id", "script"])
async def test_a_short_run_costs_one_claim_per_instance_and_one_finish(
    server_url: str, prefix: str, strategy: str
) -> None:
    """The lease strategy: claims and a finish, all EVALSHA; the claim-only ones: a
    claim per instance (XADD for stream-id, a script call for the others) and one
    result write (a script call). Nothing else, no heartbeat for a short run.

    A starved event loop (a loaded machine) can wake when a slot and the next one are
    both due: the older one is then skipped, as designed, and claimed by nobody that
    skipped it; each instance's skips are counted from its events, so the cost still
    holds to the command."""
    await a_short_run_costs_one_claim_per_instance_and_one_finish(server_url, prefix, strategy)


@pytest.mark.slow
@pytest.mark.needs_idmp
async def test_a_short_idmp_run_costs_one_claim_per_instance_and_one_finish(
    server_url: str, prefix: str
) -> None:
    await a_short_run_costs_one_claim_per_instance_and_one_finish(server_url, prefix, "idmp")


async def a_short_run_costs_one_claim_per_instance_and_one_finish(
    server_url: str, prefix: str, strategy: str
) -> None:
    instances, slots = 3, 5
    # A first slot loads the scripts (a fresh server answers NOSCRIPT); MONITOR
    # watches the five after it, from before the first claim to after the last
    # finish, so a loaded machine moves no command out of the window.
    schedule = Seconds(delay_ms=1_000, count=1 + slots)
    runs: list[int] = []
    schedulers: list[Any] = []
    skipped: list[set[int]] = [set() for _ in range(instances)]
    for index in range(instances):
        backend: Any = RedisBackend(redis=server_url, prefix=prefix, strategy=strategy)  # type: ignore[call-overload]
        scheduler: Any = Scheduler(backend, instance_id=f"i{index}")

        @scheduler.job(schedule, name="short")
        async def short(run: Run) -> None:
            runs.append(run.slot_ms)

        @scheduler.on_event
        def skip(event: Event, skips: set[int] = skipped[index]) -> None:
            # Late: skipped before its claim (an overlap skip comes after one).
            if isinstance(event, SlotSkipped) and event.reason == "late":
                skips.add(event.slot_ms)

        schedulers.append(scheduler)

    watched = [int(at.timestamp() * 1000) for at in schedule.instants[1:]]
    async with schedulers[0], schedulers[1], schedulers[2]:
        await wait_until(lambda: len(runs) == 1, 10, "the first slot to run")
        with anyio.fail_after(5):  # its finish has settled
            first: list[RunResult] = []
            while not first:
                await anyio.sleep(0.02)
                first = await schedulers[0].history("short")
        monitor = CommandLog(server_url)
        watching_ms = time.time() * 1000
        await wait_until(lambda: watched[-1] in runs, 10, "the last slot to run")
        claim = "XADD" if strategy == "stream-id" else "EVALSHA"

        def expected() -> list[str]:
            # Counted anew each time: a starved instance's late skip of the slot before
            # the last one comes with its claim of the last, possibly after that ran.
            claims = sum(slot not in skips for skips in skipped for slot in watched)
            return sorted([claim] * claims + ["EVALSHA"] * (len(runs) - 1))

        await wait_until(lambda: len(monitor.seen()) >= len(expected()), 10, "their commands")
        await anyio.sleep(0.5)  # room for a command too many
        commands = [name for _, name in await anyio.to_thread.run_sync(monitor.close)]

    second_slot_ms = schedule.instants[1].timestamp() * 1000
    assert watching_ms < second_slot_ms, "MONITOR started after the second slot was due"
    assert runs == sorted(set(runs))  # each slot once
    # A slot that did not run was skipped late by every instance.
    assert [slot for slot in watched if slot not in runs and not all(
        slot in skips for skips in skipped)] == []  # fmt: skip
    assert sorted(commands) == expected()
