"""The application's scheduled code, tested on virtual time with ``anarchon.testing``:
``pytest`` in this folder (with anyio's pytest plugin; no server to run)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from app import make_scheduler, outbox, report, signup

from anarchon.testing import TestFleet, make_run

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_daily_report_runs_once_a_day_through_dst() -> None:
    async with TestFleet(make_scheduler(), start="2027-03-27T00:00:00+02:00", instances=2) as fleet:
        await fleet.advance(days=3)  # seconds of real time
        assert [run.slot.isoformat() for run in fleet.runs("report")] == [
            "2027-03-27T01:00:00+00:00",  # 03:00 in Athens (EET)
            "2027-03-28T01:00:00+00:00",  # 03:00 is skipped: the instant the clocks jump
            "2027-03-29T00:00:00+00:00",  # 03:00 in Athens (EEST)
        ]
        await fleet.kill_instance()  # faults are part of the kit
        await fleet.advance(days=1)
        assert len(fleet.runs("report")) == 4


async def test_reminder_after_signup() -> None:
    scheduler = make_scheduler()
    async with TestFleet(scheduler) as fleet:
        await signup(scheduler, user=42)  # the application sets the timer
        await fleet.advance(minutes=29)
        assert fleet.fired("remind") == []
        await fleet.advance(minutes=2)
        assert fleet.fired("remind") == ["user:42"]


async def test_the_report_handler_alone() -> None:
    outbox.clear()
    await report(make_run("report", datetime(2027, 3, 28, 1, tzinfo=UTC)))
    assert outbox == ["the report of 2027-03-28"]
