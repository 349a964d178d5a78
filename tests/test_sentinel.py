"""Redis Sentinel without writing a client: a ``redis+sentinel://`` URL or a ``sentinel``
options mapping, against a real primary, replica and Sentinels, including a promotion
while jobs run."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

from anarchon import Inspector, InvalidOptionError, RedisBackend, Run, Scheduler
from tests.helpers import OneShot, wait_until
from tests.sentinels import MASTER, SentinelGroup
from tests.servers import ServerSpec

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.server_tier]


def group_of(server: ServerSpec, tmp_path: Path) -> SentinelGroup:
    if server.binary is None:
        pytest.skip(f"{server.id} is a running server (a URL): no binary to start Sentinels")
    return SentinelGroup(server.binary, tmp_path)


async def test_jobs_run_through_sentinels_and_go_on_after_a_promotion(
    server: ServerSpec, prefix: str, tmp_path: Path
) -> None:
    ran: Counter[int] = Counter()
    with group_of(server, tmp_path) as group:
        scheduler = Scheduler(RedisBackend(redis=group.url, prefix=prefix), lease_ms=3000)

        @scheduler.job("* * * * * *", name="tick")
        async def tick(run: Run) -> None:
            ran[run.slot_ms] += 1

        async with scheduler:
            await wait_until(lambda: len(ran) >= 2, 20, "runs before the promotion")
            # Hints come through the Sentinels too: a subscription on the primary.
            channel = f"{prefix}timer-hints"
            await wait_until(lambda: group.subscribers(channel) == 1, 10, "the subscription")
            began_ms = time.time() * 1000
            old = group.primary_port()
            new = await anyio.to_thread.run_sync(group.failover)
            promoted_ms = time.time() * 1000
            assert new != old
            await wait_until(
                lambda: len([s for s in ran if s > promoted_ms + 2000]) >= 2,
                30,
                "runs on the new primary",
            )
    # Each slot once, except around the promotion itself (a claim the old primary
    # acknowledged and never passed on can be won again on the new one).
    twice = [s for s, n in ran.items() if n > 1 and not began_ms - 2000 <= s <= promoted_ms + 2000]
    assert twice == [], ran


async def test_the_sentinel_options_form_connects(
    server: ServerSpec, prefix: str, tmp_path: Path
) -> None:
    runs: list[Run] = []
    with group_of(server, tmp_path) as group:
        options: dict[str, Any] = {
            "sentinel": {
                "master": MASTER,
                "sentinels": [f"127.0.0.1:{port}" for port in group.sentinel_ports],
            },
            "db": 0,
        }
        scheduler = Scheduler(RedisBackend(redis=options, prefix=prefix))

        @scheduler.job(OneShot.in_ms(200), name="once")
        async def once(run: Run) -> None:
            runs.append(run)

        async with scheduler:
            await wait_until(lambda: bool(runs), 20, "the run")
            assert "sentinel" in scheduler.backend.where()


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("redis+sentinel://127.0.0.1:26379", "cannot read the Sentinel URL"),
        ("redis+sentinel://127.0.0.1:x/m", "host or host:port"),
        ("redis+sentinel://127.0.0.1/m?ssl=1", "unknown Sentinel URL parameter"),
        ({"sentinel": {"master": "m"}}, "needs 'master' and 'sentinels'"),
        ({"sentinel": "m"}, "the sentinel option is a mapping"),
    ],
)
def test_a_bad_sentinel_spec_is_refused_at_construction(spec: object, says: str) -> None:
    with pytest.raises(InvalidOptionError, match=says):
        RedisBackend(redis=spec)


@pytest.mark.engine_tier  # the harness's own cleanup
def test_a_group_that_fails_to_start_leaves_no_server_running(
    server: ServerSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness itself: a replica that never syncs fails the start, and the servers
    started before it are stopped, not left running for the rest of the suite."""
    group = group_of(server, tmp_path)
    monkeypatch.setattr(group, "_linked", lambda: False)
    monkeypatch.setattr(SentinelGroup, "_wait", staticmethod(_fail_at_once))
    with pytest.raises(AssertionError, match="the replica to sync"), group:
        pass
    assert len(group.processes) == 2
    assert all(process.poll() is not None for process in group.processes)


def _fail_at_once(condition: Any, what: str, timeout_sec: float = 30) -> None:
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.engine_tier
async def test_max_runs_holds_across_a_promotion(
    server: ServerSpec, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job with max_runs=6, a slot every half second; after two runs the primary is
    replaced by its replica. The count goes on on the new primary: the job ends with
    the new primary counting 6 runs, finished. A run beyond 6 can only be one counted
    on the old primary between the promotion and its demotion (written there, and lost
    with it: what any write then is); an instance that heard "finished" from the old
    primary asks again, and hears the new one's count."""
    # A finished job asks the store again a second later, not a minute.
    monkeypatch.setattr("anarchon._engine.context.FINISHED_RECHECK_SEC", 1.0)
    ran: Counter[int] = Counter()
    with group_of(server, tmp_path) as group:
        scheduler = Scheduler(RedisBackend(redis=group.url, prefix=prefix), lease_ms=3000)

        @scheduler.job(every_ms=500, name="campaign", max_runs=6)
        async def campaign(run: Run) -> None:
            ran[run.slot_ms] += 1

        async with scheduler:
            await wait_until(lambda: len(ran) >= 2, 20, "runs before the promotion")
            began_ms = time.time() * 1000
            old = group.primary_port()
            new = await anyio.to_thread.run_sync(group.failover)
            await wait_until(lambda: group.role(old) == "slave", 30, "the old primary's demotion")
            demoted_ms = time.time() * 1000
            # Read from the new primary itself (a Sentinel may name the old one a while).
            store = RedisBackend(redis=f"redis://127.0.0.1:{new}/0", prefix=prefix)
            async with Inspector(store) as inspector:
                for _ in range(300):
                    (job,) = await inspector.jobs(["campaign"])
                    if job.finished:
                        break
                    await anyio.sleep(0.1)
            ended = sum(ran.values())
            await anyio.sleep(1.5)  # three more slots: none may run
    around = [s for s in ran if began_ms - 2000 <= s <= demoted_ms + 2000]
    assert sum(ran.values()) == ended, "a run after the job finished"
    assert 6 <= ended <= 6 + len(around), (ran, began_ms, demoted_ms)
    assert all(n == 1 for s, n in ran.items() if s not in around), ran
    assert job.runs == 6 and job.finished is not None and "max_runs 6" in job.finished, job
