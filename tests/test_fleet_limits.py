"""Fleet-wide limits (``max_concurrent_fleet``) on a real server: at most N of a job's
runs at once across every instance, each holding a permit in the store while its lease
lives; the slots beyond the limit wait for a permit rather than being skipped; a dead
runner's permit comes back when its lease runs out; a stale run's heartbeat cannot take
one back once others hold them all; ``run_now`` says why it is refused."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest

from anarchon import (
    Inspector,
    IntervalSchedule,
    InvalidOptionError,
    RedisBackend,
    Run,
    RunOverlapError,
    Scheduler,
    TimerRun,
    TimerSetting,
)
from anarchon._store.contract import AttemptEnd, ClaimRequest, HeartbeatRequest
from anarchon._store.keys import JobKeys
from tests.helpers import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]

LEASE_MS = 3000
HEARTBEAT_MS = 300


def fleet(url: str, prefix: str, names: tuple[str, ...] = ("a", "b")) -> list[Scheduler[Any]]:
    return [
        Scheduler(
            RedisBackend(redis=url, prefix=prefix),
            instance_id=name,
            lease_ms=LEASE_MS,
            heartbeat_ms=HEARTBEAT_MS,
            timer_poll_ms=200,
        )
        for name in names
    ]


class Gauge:
    """Runs going on at once, across every instance of the test's fleet."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.started: list[int] = []
        #: How late each run started after its slot (ms, by this machine's clock).
        self.late_ms: list[float] = []

    async def run(self, slot_ms: int, seconds: float) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        self.started.append(slot_ms)
        self.late_ms.append(time.time() * 1000 - slot_ms)
        try:
            await anyio.sleep(seconds)
        finally:
            self.now -= 1


async def test_no_more_runs_of_a_job_go_on_in_the_fleet_than_its_limit(
    server_url: str, prefix: str
) -> None:
    """A job every 100 ms whose runs take 600 ms, overlap allowed, on two instances with
    room for many: with max_concurrent_fleet=2 never more than two run at once, both
    permits are used, and the slots beyond wait for a permit (none is skipped: some
    start long after their slot)."""
    gauge = Gauge()
    schedulers = fleet(server_url, prefix)
    for scheduler in schedulers:

        async def busy(run: Run) -> None:
            await gauge.run(run.slot_ms, 0.6)

        scheduler.add_job(
            busy, IntervalSchedule(100), name="busy", overlap="allow", max_concurrent_fleet=2
        )
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await wait_until(lambda: len(gauge.started) >= 8, 30, "eight runs")
        async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
            history = await inspector.history("busy")
    assert gauge.peak == 2, gauge.peak
    assert len(gauge.started) == len(set(gauge.started)), "a slot ran twice"
    assert not [r for r in history if r.status == "skipped"], history
    # Slots due while both permits were held waited for one, and then ran.
    assert max(gauge.late_ms) >= 300, gauge.late_ms


async def test_a_dead_runners_permit_comes_back_when_its_lease_runs_out(
    server_url: str, prefix: str
) -> None:
    """A runner that won the job's only permit and vanished (never heartbeats, never
    finishes) holds it for its lease, and no longer: the next slot waits for it, then
    runs, within a poll of the lease's end."""
    backend = RedisBackend(redis=server_url, prefix=prefix)
    store = await backend.open({"runner": "dead", "history_size": 100, "history_ttl_ms": None})
    slot_ms = int(time.time() * 1000)
    request = ClaimRequest(
        "solo", str(slot_ms), slot_ms, "dead-token", "schedule", LEASE_MS, 1, True, 600_000,
        fleet_max=1,
    )  # fmt: skip
    try:
        (won,) = await store.claim_many([request])
        assert not isinstance(won, Exception) and won.kind == "won", won
        lease_ends = time.time() + LEASE_MS / 1000
    finally:
        await store.conn.aclose()
    starts: list[float] = []
    (scheduler,) = fleet(server_url, prefix, ("a",))

    async def solo() -> None:
        starts.append(time.time())

    scheduler.add_job(
        solo, IntervalSchedule(500), name="solo", overlap="allow", max_concurrent_fleet=1
    )
    async with scheduler:
        await wait_until(lambda: bool(starts), 15, "a run after the dead runner's lease")
    assert starts[0] >= lease_ends - 0.05, ("ran while the dead runner held the permit",)
    assert starts[0] < lease_ends + 2.0, ("the permit came back late", starts[0] - lease_ends)


def request(slot_ms: int, token: str, **fields: Any) -> ClaimRequest:
    return ClaimRequest(
        "limited", str(slot_ms), slot_ms, token, "schedule", LEASE_MS, 3, True, 600_000,
        fleet_max=1, **fields,
    )  # fmt: skip


@pytest.mark.server_tier
async def test_the_scripts_hand_out_one_permit_per_run_and_take_it_back(
    server_url: str, prefix: str
) -> None:
    """On every server, with max_concurrent_fleet=1: a first claim wins the permit; the
    next slot's first claim is told to wait for it ('overlap' with text 'fleet': never
    skipped), as the run's heartbeats keep it; the run's finish gives it back and the
    waiting slot wins. An attempt whose lease ran out cannot take its permit back with a
    heartbeat once another run holds it, and a permit another client wrote for ever is
    dropped and reported."""
    backend = RedisBackend(redis=server_url, prefix=prefix)
    store = await backend.open({"runner": "a", "history_size": 100, "history_ttl_ms": None})
    keys = JobKeys.for_job(prefix, "limited")
    base = (int(time.time() * 1000) // 1000) * 1000
    try:
        (first,) = await store.claim_many([request(base, "t1")])
        (second,) = await store.claim_many([request(base + 1000, "t2", skip_if_blocked=True)])
        assert not isinstance(first, Exception) and first.kind == "won", first
        assert not isinstance(second, Exception), second
        assert (second.kind, second.status) == ("overlap", "fleet"), second
        assert 0 < second.wait_ms <= LEASE_MS
        beat = HeartbeatRequest("limited", str(base), "t1", LEASE_MS, True, fleet_max=1)
        assert await store.heartbeat_many([beat]) == [True]
        assert await store.conn.execute(("ZRANGE", keys.permits, 0, -1)) in (
            [str(base)],
            [str(base).encode()],
        )
        end = AttemptEnd(
            "limited", str(base), "t1", 1, "schedule", first.fence, base, base, "ok", None, 3, 0,
            fleet=True,
        )  # fmt: skip
        assert (await store.finish(end)).held
        (again,) = await store.claim_many([request(base + 1000, "t2")])
        assert not isinstance(again, Exception) and again.kind == "won", again
        history = await store.history("limited", 10)
        assert not [r for r in history if r.status == "skipped"], history

        # The run of base + 1000 vanishes: its lease (and permit) runs out, and a third
        # slot takes the permit. The vanished run's heartbeat is then refused.
        await store.conn.execute(("ZADD", keys.permits, "XX", base, str(base + 1000)))
        (third,) = await store.claim_many([request(base + 2000, "t3")])
        assert not isinstance(third, Exception) and third.kind == "won", third
        stale = HeartbeatRequest("limited", str(base + 1000), "t2", LEASE_MS, True, fleet_max=1)
        beats = await store.heartbeat_many([stale])
        # The run's own lease is live in its state; the permit is what refuses it.
        assert beats == [False], beats

        # A permit held for ever by another client's member is dropped, and reported.
        await store.conn.execute(("ZADD", keys.permits, "+inf", "foreign"))
        await store.conn.execute(("ZREM", keys.permits, str(base + 2000)))
        (fourth,) = await store.claim_many([request(base + 3000, "t4")])
        assert not isinstance(fourth, Exception) and fourth.kind == "won", fourth
        members = await store.conn.execute(("ZRANGE", keys.permits, 0, -1))
        assert [m.decode() if isinstance(m, bytes) else m for m in members] == [str(base + 3000)]
        async with Inspector(backend) as inspector:
            report = await inspector.quarantined()
        assert any("beyond the longest lease" in entry.problem for entry in report), report
    finally:
        await store.conn.aclose()


async def test_run_now_says_the_fleet_holds_every_permit(server_url: str, prefix: str) -> None:
    gate = anyio.Event()
    (scheduler,) = fleet(server_url, prefix, ("a",))

    async def held(run: Run) -> None:
        await gate.wait()

    scheduler.add_job(
        held, IntervalSchedule(3_600_000), name="held", overlap="allow", max_concurrent_fleet=1
    )
    async with scheduler, anyio.create_task_group() as group:
        group.start_soon(scheduler.run_now, "held")
        await wait_until(lambda: scheduler.running == 1, 10, "the first manual run")
        with pytest.raises(RunOverlapError, match=r"max_concurrent_fleet \(1\)"):
            await scheduler.run_now("held")
        gate.set()


def test_max_concurrent_fleet_is_checked() -> None:
    scheduler = Scheduler(RedisBackend())

    async def job() -> None:
        pass

    for wrong in (0, -1, True, 1.5, 100_001):
        with pytest.raises(InvalidOptionError, match="max_concurrent_fleet must be"):
            scheduler.add_job(job, "* * * * *", name="j", max_concurrent_fleet=wrong)  # type: ignore[arg-type]


async def test_no_more_firings_of_a_kind_go_on_in_the_fleet_than_its_limit(
    server_url: str, prefix: str
) -> None:
    """30 timers due at once, firings of 300 ms, two instances with room for many: with
    max_concurrent_fleet=3 never more than three fire at once, three do, and every timer
    fires once; the rest waited in the store."""
    gauge = Gauge()
    fired: list[str] = []
    schedulers = fleet(server_url, prefix)
    for scheduler in schedulers:

        async def remind(fire: TimerRun) -> None:
            fired.append(fire.key)
            await gauge.run(fire.due_ms, 0.3)

        scheduler.add_timer(remind, "remind", max_concurrent_fleet=3)
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await schedulers[0].set_timers(
            "remind", [TimerSetting(f"user:{n}", delay_ms=0) for n in range(30)]
        )
        await wait_until(lambda: len(fired) == 30 and gauge.now == 0, 30, "every firing")
    assert gauge.peak == 3, gauge.peak
    assert sorted(fired) == sorted(f"user:{n}" for n in range(30)), fired


async def test_a_rate_limited_kind_starts_no_more_firings_in_any_period_than_its_limit(
    server_url: str, prefix: str
) -> None:
    """12 timers due one ms apart, rate_limit=(4, 1000), two instances: in any second (of
    the server's clock, which the fences follow in microseconds) at most four start; all
    twelve fire, in due order, as the window allows."""
    started: list[tuple[int, int]] = []
    schedulers = fleet(server_url, prefix)
    for scheduler in schedulers:

        async def call_api(fire: TimerRun) -> None:
            started.append((fire.fence, fire.due_ms))

        scheduler.add_timer(call_api, "api", rate_limit=(4, 1000))
    due = datetime.now(UTC) - timedelta(seconds=1)
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await schedulers[0].set_timers(
            "api", [TimerSetting(f"k{n}", at=due + timedelta(milliseconds=n)) for n in range(12)]
        )
        await wait_until(lambda: len(started) == 12, 30, "every firing")
    won_ms = sorted(fence // 1000 for fence, _ in started)
    for first, fifth in zip(won_ms, won_ms[4:], strict=False):
        assert fifth - first >= 999, ("five starts within a second", won_ms)
    in_order = [due_ms for _, due_ms in sorted(started)]
    assert in_order == sorted(in_order), "not in due order"


async def test_one_key_groups_many_timers_do_not_hold_the_other_groups_back(
    server_url: str, prefix: str
) -> None:
    """Tenant 'a' has 40 timers due, tenant 'b' 5 due just after them; firings take 200
    ms; two instances; max_concurrent_per_group=2 by the text before ':'. Never more
    than two of one tenant fire at once, and 'b's timers all fire while most of 'a's
    still wait (they waited apart, not in front of 'b's); every timer fires once."""
    going: dict[str, int] = {"a": 0, "b": 0}
    peak: dict[str, int] = {"a": 0, "b": 0}
    fired: list[tuple[str, float]] = []
    schedulers = fleet(server_url, prefix)
    for scheduler in schedulers:

        async def send(fire: TimerRun) -> None:
            tenant = fire.key.split(":", 1)[0]
            going[tenant] += 1
            peak[tenant] = max(peak[tenant], going[tenant])
            fired.append((fire.key, time.monotonic()))
            try:
                await anyio.sleep(0.2)
            finally:
                going[tenant] -= 1

        scheduler.add_timer(send, "send", group_by=":", max_concurrent_per_group=2)
    due = datetime.now(UTC) - timedelta(seconds=1)
    settings = [TimerSetting(f"a:{n}", at=due) for n in range(40)]
    settings += [TimerSetting(f"b:{n}", at=due + timedelta(milliseconds=1)) for n in range(5)]
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await schedulers[0].set_timers("send", settings)
        await wait_until(lambda: len(fired) == 45 and not any(going.values()), 60, "all")
    assert peak == {"a": 2, "b": 2}, peak
    assert sorted(key for key, _ in fired) == sorted(s.key for s in settings), fired
    b_done = max(at for key, at in fired if key.startswith("b:"))
    a_after = [key for key, at in fired if key.startswith("a:") and at > b_done]
    assert len(a_after) >= 20, ("tenant b waited behind tenant a", len(a_after))


def test_a_kinds_fleet_limits_are_checked() -> None:
    scheduler = Scheduler(RedisBackend())

    async def handler() -> None:
        pass

    with pytest.raises(InvalidOptionError, match=r"multiple of buckets \(2\).*use 2 or 4"):
        scheduler.add_timer(handler, "a", max_concurrent_fleet=3, buckets=2)
    with pytest.raises(InvalidOptionError, match="rate_limit must be \\(count, period_ms\\)"):
        scheduler.add_timer(handler, "b", rate_limit=100)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="rate_limit's period_ms must be"):
        scheduler.add_timer(handler, "c", rate_limit=(5, 0))
    with pytest.raises(InvalidOptionError, match=r"rate_limit.s count .* multiple of buckets"):
        scheduler.add_timer(handler, "d", rate_limit=(5, 1000), buckets=2)
    scheduler.add_timer(handler, "e", max_concurrent_fleet=4, rate_limit=(6, 1000), buckets=2)
    with pytest.raises(InvalidOptionError, match="give group_by and max_concurrent_per_group"):
        scheduler.add_timer(handler, "f", group_by=":")
    with pytest.raises(InvalidOptionError, match="group_by must be a separator"):
        scheduler.add_timer(handler, "g", group_by="", max_concurrent_per_group=2)
    with pytest.raises(InvalidOptionError, match="group_by needs buckets=1"):
        scheduler.add_timer(handler, "h", group_by=":", max_concurrent_per_group=2, buckets=2)
