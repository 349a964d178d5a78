"""Deploy-safe definitions (issue 44, part 7): each instance registers a fingerprint of
each job's definition; while the live instances disagree, the newest definition (by its
first registration) is in force, and instances of an older one claim no new slot of the
job (their runs under way go on), say so once, and ``inspect`` shows the disagreement.
A rolling deploy that changes a schedule runs no slot of the old schedule once the first
new instance is up, and misses none of the new."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from anarchon import DefinitionOutdated, Event, Inspector, RedisBackend, Run, Scheduler
from anarchon._engine.instance import Instance
from anarchon._store.registry import fingerprint, job_definition
from tests.helpers import anarchon_command, server_ms, wait_until
from tests.test_run_command import RunCommand, app_env, commands, entries  # noqa: F401

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]

OLD, NEW = "* * * * * *", "*/2 * * * * *"


def env(server_url: str, prefix: str, cron: str) -> dict[str, str]:
    return app_env(server_url, prefix, cron=cron, work_sec=0.05, lease_ms=3000)


@pytest.mark.slow("a rolling deploy of three anarchon run processes, one at a time")
async def test_a_rolling_deploy_runs_no_slot_of_the_old_schedule_and_misses_none_of_the_new(
    server_url: str,
    prefix: str,
    direct: redis.Redis,
    tmp_path: Path,
    commands: list[RunCommand],  # noqa: F811
) -> None:
    """Three processes run ``work`` every second; each is replaced in turn by one that
    runs it every other second. From the first new process's start on, every slot that
    starts is an even second (the old schedule's odd ones are claimed by nobody), each
    even second's slot starts once, the old processes said once that their definition
    is not in force, and the views showed the two definitions while both were live."""
    old = [RunCommand(tmp_path, f"old{n}", env(server_url, prefix, OLD)) for n in range(3)]
    commands.extend(old)
    for process in old:
        await anyio.to_thread.run_sync(process.wait_live)
    first_new_ms = 0
    seen_disagreeing = False
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        for n, process in enumerate(old):
            new = RunCommand(tmp_path, f"new{n}", env(server_url, prefix, NEW))
            commands.append(new)
            await anyio.to_thread.run_sync(new.wait_live)
            first_new_ms = first_new_ms or server_ms(direct)
            (job,) = await inspector.jobs(["work"])
            seen_disagreeing = seen_disagreeing or len(job.definitions) == 2
            if n == 0:
                shown = await anyio.to_thread.run_sync(
                    lambda: anarchon_command(server_url, prefix, "inspect")
                )
                assert "disagree on its definition" in shown.stdout, shown.stdout
            await anyio.sleep(1.5)  # the old one and the new side by side
            process.signal()
            assert await anyio.to_thread.run_sync(process.wait, 15) == 0
        await anyio.sleep(3)
        last_ms = server_ms(direct)
    assert seen_disagreeing
    started = [int(e[5]) for e in entries(direct, prefix) if e[0] == "start"]
    after = [slot for slot in started if slot > first_new_ms]
    odd = [slot for slot in after if slot % 2000]
    assert odd == [], f"slots of the old schedule started after the first new instance: {odd}"
    wanted = list(range((first_new_ms // 2000 + 1) * 2000, last_ms - 1500, 2000))
    assert sorted(slot for slot in after if slot <= wanted[-1]) == wanted
    said = [p.log().count("disagree on the job's definition") for p in old[1:]]
    assert all(count == 1 for count in said), said


def test_a_fingerprint_is_the_same_for_the_same_definition_and_differs_for_another() -> None:
    """What decides a job's behaviour makes its fingerprint; what its instances saw last
    (the next slot) and a custom schedule's address in memory do not."""

    class Weekly:
        def next_after(self, moment: Any, /) -> Any:
            return None

    def definition_of(schedule: Any, **options: Any) -> dict[str, Any]:
        scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis="redis://unused", prefix="p:"))

        @scheduler.job(schedule, name="report", **options)
        async def report(run: Run) -> None:
            return None

        return job_definition(Instance.of(scheduler).job("report"), "lease", None)

    base = fingerprint(definition_of("0 3 * * *"))
    assert fingerprint(definition_of("0 3 * * *")) == base
    assert fingerprint({**definition_of("0 3 * * *"), "next_slot_ms": 5}) == base
    assert fingerprint(definition_of("0 4 * * *")) != base
    assert fingerprint(definition_of("0 3 * * *", max_attempts=5)) != base
    assert fingerprint(definition_of(Weekly())) == fingerprint(definition_of(Weekly()))


async def test_an_instance_whose_definition_is_not_in_force_claims_no_new_slot_and_says_so(
    server_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``tick`` every 300 ms runs; an instance with ``tick`` every 600 ms starts: from
    then on the first one claims nothing new of ``tick`` (its other job runs on), says
    so once (a WARNING and a ``DefinitionOutdated`` event), and ``Inspector.jobs`` lists
    both fingerprints, the new one first."""
    older: Scheduler[Any] = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    newer: Scheduler[Any] = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    ran: dict[str, list[int]] = {"older": [], "newer": [], "other": []}
    events: list[Event] = []
    older.on_event(events.append)

    @older.job(every_ms=300, name="tick")
    async def tick_older(run: Run) -> None:
        ran["older"].append(run.slot_ms)

    @older.job(every_ms=300, name="other")
    async def other(run: Run) -> None:
        ran["other"].append(run.slot_ms)

    @newer.job(every_ms=600, name="tick")
    async def tick_newer(run: Run) -> None:
        ran["newer"].append(run.slot_ms)

    with caplog.at_level(logging.WARNING, logger="anarchon"):
        async with older:
            await wait_until(lambda: len(ran["older"]) >= 2, 10, "the older definition's runs")
            async with newer:
                await wait_until(lambda: len(ran["newer"]) >= 1, 10, "the newer one's first run")
                up_ms = ran["newer"][0]
                others = len(ran["other"])
                await wait_until(lambda: len(ran["newer"]) >= 4, 10, "the newer one's runs")
                async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
                    (job,) = await inspector.jobs(["tick"])
                assert len(ran["other"]) >= others + 3  # the other job runs on
    assert [slot for slot in ran["older"] if slot > up_ms] == []
    outdated = [e for e in events if isinstance(e, DefinitionOutdated)]
    assert len(outdated) == 1 and outdated[0].job == "tick", outdated
    warned = [r for r in caplog.records if "disagree on the job's definition" in r.message]
    assert len(warned) == 1, warned
    assert len(job.definitions) == 2 and job.definitions[0] != outdated[0].own
    assert job.every_ms == 600  # the views show the definition in force
