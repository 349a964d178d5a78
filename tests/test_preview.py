"""Preview (issue 44, part 4, in progress): a job's next fire times, from its schedule
on the scheduler and from its stored definition (``Inspector.next_fire_times``,
``anarchon next JOB``), in UTC and in the job's zone."""

from __future__ import annotations

import json
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from anarchon import Inspector, InvalidJobError, InvalidOptionError, RedisBackend, Scheduler
from tests.helpers import anarchon_command

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]

ROOT = Path(__file__).resolve().parents[1]


def report_scheduler(url: str, prefix: str) -> Scheduler[object]:
    scheduler: Scheduler[object] = Scheduler(RedisBackend(redis=url, prefix=prefix))

    @scheduler.job("0 3 * * *", name="report", timezone="Europe/Athens")
    async def report() -> None:
        pass

    return scheduler


async def test_the_next_fire_times_of_a_job_here_and_from_its_stored_definition(
    server_url: str, prefix: str
) -> None:
    """03:00 Athens each day, the next ten after now: the same from the scheduler (no
    store needed) and from the store (another process), each at 03:00 local."""
    scheduler = report_scheduler(server_url, prefix)
    here = scheduler.next_fire_times("report", n=10)
    athens = ZoneInfo("Europe/Athens")
    assert len(here) == 10 and here == sorted(here) and here[0].timestamp() > time.time()
    assert all(f.astimezone(athens).strftime("%H:%M") == "03:00" for f in here), here
    with pytest.raises(InvalidJobError):
        scheduler.next_fire_times("nope")
    with pytest.raises(InvalidOptionError):
        scheduler.next_fire_times("report", n=0)
    async with scheduler, Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        stored = await inspector.next_fire_times("report", n=10)
    assert stored == here or stored == scheduler.next_fire_times("report", n=10)
    assert all(f.tzinfo is UTC for f in stored)


async def test_anarchon_next_prints_a_jobs_fire_times_in_utc_and_its_zone(
    server_url: str, prefix: str
) -> None:
    scheduler = report_scheduler(server_url, prefix)

    def anarchon(*args: str) -> subprocess.CompletedProcess[str]:
        return anarchon_command(server_url, prefix, "next", "report", *args)

    async with scheduler:
        table = anarchon("-n", "3")
        listed = json.loads(anarchon("-n", "3", "--json").stdout)
    assert table.returncode == 0, table
    assert "Europe/Athens" in table.stdout and "03:00:00" in table.stdout, table.stdout
    fires = [datetime.fromisoformat(f.replace("Z", "+00:00")) for f in listed["next"]]
    assert len(fires) == 3 and listed["timezone"] == "Europe/Athens"
    assert all(f.astimezone(ZoneInfo("Europe/Athens")).hour == 3 for f in fires)
