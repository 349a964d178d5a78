"""Bounds (issue 44, part 2): ``start_at`` and ``end_at`` bound a job's slots, and
``max_runs`` the runs that may end in the fleet, counted once in the store: past a bound
the job is finished (shown so, its state kept), claims nothing more, and a raised bound
deployed takes effect. The count holds when a finish's reply is lost."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest
import redis

from anarchon import (
    Inspector,
    IntervalSchedule,
    InvalidOptionError,
    RedisBackend,
    Run,
    RunOverlapError,
    Scheduler,
)
from anarchon._store.keys import JobKeys
from tests.faults import FaultProxy
from tests.helpers import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


def fleet(url: str, prefix: str, ran: Counter[int], **options: Any) -> list[Scheduler[Any]]:
    schedulers: list[Scheduler[Any]] = []
    for name in ("a", "b"):
        scheduler = Scheduler(RedisBackend(redis=url, prefix=prefix), instance_id=name)

        async def campaign(run: Run) -> None:
            ran[run.slot_ms] += 1

        scheduler.add_job(campaign, IntervalSchedule(250), **options)
        schedulers.append(scheduler)
    return schedulers


async def test_max_runs_ends_the_job_after_that_many_runs_in_the_fleet_until_raised(
    server_url: str, prefix: str
) -> None:
    """Two instances, a slot every 250 ms, max_runs=3: three runs in the fleet, then
    none for the next eight slots; the job shows 3 runs and finished, run_now is
    refused. Redeployed with max_runs=5: two more runs, then finished again."""
    ran: Counter[int] = Counter()
    async with AsyncExitStack() as stack:
        schedulers = fleet(server_url, prefix, ran, max_runs=3)
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await wait_until(lambda: len(ran) >= 3, 20, "three runs")
        await anyio.sleep(2.0)  # eight more slots
        assert sum(ran.values()) == 3 and set(ran.values()) == {1}, ran
        with pytest.raises(RunOverlapError, match="is finished"):
            await schedulers[0].run_now("campaign")
        async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
            (job,) = await inspector.jobs(["campaign"])
            # Asked of the fleet (anarchon run-now, the dashboard): refused the same.
            with pytest.raises(RunOverlapError, match="is finished"):
                await inspector.run_now("campaign")
        assert job.runs == 3 and job.finished == "max_runs 3 reached: 3 runs ended", job
        assert job.next_fire is None  # finished: it fires no more
        assert job.options["max_runs"] == 3
    async with AsyncExitStack() as stack:
        for scheduler in fleet(server_url, prefix, ran, max_runs=5):
            await stack.enter_async_context(scheduler)
        await wait_until(lambda: len(ran) >= 5, 20, "two more runs")
        await anyio.sleep(1.5)
        async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
            (job,) = await inspector.jobs(["campaign"])
    assert sum(ran.values()) == 5 and set(ran.values()) == {1}, ran
    assert job.runs == 5 and job.finished == "max_runs 5 reached: 5 runs ended", job


async def test_a_job_runs_only_its_slots_between_start_at_and_end_at_and_then_is_finished(
    server_url: str, prefix: str
) -> None:
    """Slots every 250 ms; start_at a second from now, end_at a second after it: the
    slots in [start_at, end_at) run, once each, and none outside; past end_at the job
    shows finished, with no next fire, and its history stays."""
    ran: Counter[int] = Counter()
    start = datetime.fromtimestamp(int(time.time()) + 2, UTC)
    end = start + timedelta(seconds=1)
    start_ms, end_ms = int(start.timestamp() * 1000), int(end.timestamp() * 1000)
    async with AsyncExitStack() as stack:
        # overlap="allow": a loop stalled on a loaded machine claims every slot due, not
        # only the newest of a backlog (which is skipped, loudly, without overlap).
        bounds = {"start_at": start, "end_at": end, "overlap": "allow"}
        for scheduler in fleet(server_url, prefix, ran, **bounds):
            await stack.enter_async_context(scheduler)
        await wait_until(lambda: time.time() * 1000 > end_ms + 1000, 10, "end_at to pass")
        async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
            (job,) = await inspector.jobs(["campaign"])
            history = await inspector.history("campaign")
    assert dict(ran) == {slot: 1 for slot in range(start_ms, end_ms, 250)}
    assert job.finished == f"end_at {end.strftime('%Y-%m-%dT%H:%M:%S')}Z passed", job
    assert job.next_fire is None and job.options["end_at"] == end_ms
    assert sorted(r.slot_ms for r in history) == list(range(start_ms, end_ms, 250))


async def test_a_finish_whose_reply_is_lost_counts_its_run_once(
    server_url: str, proxy: FaultProxy, prefix: str, direct: redis.Redis
) -> None:
    """max_runs=3, and every finish's reply is lost (the server applied it): each is
    sent again, and the store counts three runs, not six; no fourth run starts."""
    ran: Counter[int] = Counter()
    scheduler = Scheduler(RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=1500)

    @scheduler.job(every_ms=400, name="campaign", max_runs=3)
    async def campaign(run: Run) -> None:
        ran[run.slot_ms] += 1
        proxy.drop_after_request(1)  # the next request is the finish

    async with scheduler:
        await wait_until(lambda: len(ran) >= 3, 20, "three runs")
        await anyio.sleep(2.0)
    assert sum(ran.values()) == 3 and set(ran.values()) == {1}, ran
    runs = direct.hget(JobKeys.for_job(prefix, "campaign").state, "runs")
    assert runs == "3"


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"start_at": datetime(2027, 1, 1)}, "start_at must be an aware datetime"),
        ({"end_at": "2027-01-01"}, "end_at must be an aware datetime"),
        (
            {
                "start_at": datetime(2027, 1, 2, tzinfo=UTC),
                "end_at": datetime(2027, 1, 1, tzinfo=UTC),
            },
            "must be after start_at",
        ),
        ({"max_runs": 0}, "max_runs must be a whole number from 1"),
        ({"max_runs": True}, "max_runs must be a whole number from 1"),
    ],
)
def test_a_bound_that_cannot_be_used_is_refused_with_what_to_give(
    options: dict[str, Any], said: str
) -> None:
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis="redis://localhost:1"))
    with pytest.raises(InvalidOptionError, match=said):
        scheduler.add_job(lambda: None, "* * * * *", name="bad", **options)


def test_max_runs_is_refused_by_a_claim_only_strategy_and_bounds_shape_the_preview() -> None:
    claim_only: Scheduler[Any] = Scheduler(
        RedisBackend(redis="redis://localhost:1", strategy="stream-id")
    )
    with pytest.raises(InvalidOptionError, match="max_runs"):
        claim_only.add_job(lambda: None, "* * * * *", name="x", max_runs=3)  # type: ignore[call-arg]
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis="redis://localhost:1"))
    soon = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    scheduler.add_job(
        lambda: None, "*/10 * * * *", name="window", start_at=soon, end_at=soon + timedelta(hours=1)
    )
    fires = scheduler.next_fire_times("window", n=20)
    assert len(fires) == 6 and fires[0] >= soon and fires[-1] < soon + timedelta(hours=1)


def test_the_dashboards_job_page_shows_a_finished_job_its_runs_and_exclusions_as_text() -> None:
    """The job page's rows for a job past its max_runs: finished and why, its runs
    against the bound, and its exclude= among the options, each escaped."""
    from anarchon import JobInfo
    from anarchon.web import _Fleet, _job_details

    job = JobInfo(
        name="campaign", schedule="IntervalSchedule(every_ms=250)", cron=None, every_ms=250,
        timezone="UTC", strategy="lease", next_fire=None, paused=False, paused_by=None,
        last=None, first_seen=None,
        options={"max_runs": 3, "exclude": "cron '<b>* * 25 12 *</b>'"},
        runs=3, finished="max_runs 3 reached: 3 runs ended <script>",
    )  # fmt: skip
    page = _job_details(job, [], _Fleet([], every_read=True))
    assert "<th>finished</th><td>max_runs 3 reached: 3 runs ended &lt;script&gt;" in page
    assert "<th>runs ended</th><td>3 of 3</td>" in page, page
    assert "&lt;b&gt;* * 25 12 *&lt;/b&gt;" in page and "<b>" not in page, page
