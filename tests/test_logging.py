"""What anarchon logs (design section 10): one INFO line at start, one line per run
with its duration and outcome (INFO when it went well, WARNING for a failure that is
retried, ERROR for a run that ends failed and for a lost lease), slots as ISO times with
the epoch id in ``extra``; and ``JsonLogFormatter``'s lines."""

from __future__ import annotations

import json
import logging

import anyio
import pytest

from anarchon import JsonLogFormatter, RedisBackend, Run, Scheduler
from tests.helpers import OneShot, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


def lines(caplog: pytest.LogCaptureFixture, job: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "job", None) == job]


async def test_each_run_is_one_line_at_the_level_of_its_outcome(
    server_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = Scheduler(
        RedisBackend(redis=server_url, prefix=prefix), instance_id="one", retry_delay_ms=50
    )
    slot = OneShot.in_ms(300)
    slot_ms = int(slot.at.timestamp() * 1000)

    @scheduler.job(slot, name="fine")
    async def fine(run: Run) -> None:
        pass

    @scheduler.job(slot, name="flaky", max_attempts=2)
    async def flaky(run: Run) -> None:
        raise RuntimeError(f"boom {run.attempt}")

    with caplog.at_level(logging.INFO, logger="anarchon"):
        async with scheduler:
            await wait_until(lambda: len(lines(caplog, "flaky")) == 2, 20, "two attempts")
            await wait_until(lambda: len(lines(caplog, "fine")) == 1, 20, "the good run")

    started = [r for r in caplog.records if "started: instance one" in r.getMessage()]
    assert len(started) == 1 and started[0].levelno == logging.INFO
    assert "2 job(s) (fine, flaky)" in started[0].getMessage()
    assert f"prefix {prefix!r}" in started[0].getMessage()

    iso = slot.at.strftime("%Y-%m-%dT%H:%M:%S")
    (ok,) = lines(caplog, "fine")
    assert ok.levelno == logging.INFO
    assert ok.getMessage().startswith(f"fine slot {iso}"), ok.getMessage()
    assert ": ok in " in ok.getMessage()
    assert (ok.slot_ms, ok.attempt, ok.runner, ok.outcome) == (slot_ms, 1, "one", "ok")  # type: ignore[attr-defined]
    assert ok.duration_ms >= 0  # type: ignore[attr-defined]

    first, last = lines(caplog, "flaky")
    assert first.levelno == logging.WARNING and "attempt 1 of 2, retried in" in first.getMessage()
    assert "RuntimeError: boom 1" in first.getMessage() and first.exc_info is not None
    assert last.levelno == logging.ERROR and "its last attempt (2 of 2)" in last.getMessage()
    assert "RuntimeError: boom 2" in last.getMessage()
    assert [r.attempt for r in (first, last)] == [1, 2]  # type: ignore[attr-defined]
    # The raw epoch id is in extra only: messages name slots by ISO time.
    assert not [r for r in caplog.records if str(slot_ms) in r.getMessage()]


async def test_a_stop_that_gives_a_run_back_logs_it_at_info_and_the_stop(
    server_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = Scheduler(
        RedisBackend(redis=server_url, prefix=prefix), instance_id="one", stop_grace_ms=0
    )
    started = anyio.Event()

    @scheduler.job(OneShot.in_ms(200), name="long")
    async def long() -> None:
        started.set()
        await anyio.sleep(60)

    with caplog.at_level(logging.INFO, logger="anarchon"):
        async with scheduler:
            with anyio.fail_after(20):
                await started.wait()
    (given_back,) = lines(caplog, "long")
    assert given_back.levelno == logging.INFO, given_back.getMessage()
    assert "given back for attempt 2" in given_back.getMessage()
    assert caplog.records[-1].getMessage() == "instance one stopped"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_json_formatter_writes_one_object_with_the_extra_fields() -> None:
    record = logging.LogRecord(
        "anarchon", logging.WARNING, __file__, 1, "%s went %s", ("a", "b"), None
    )
    record.job, record.slot_ms = "report", 1_796_219_184_000
    try:
        raise ValueError("bad")
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    line = JsonLogFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["message"] == "a went b"
    assert (parsed["level"], parsed["logger"]) == ("WARNING", "anarchon")
    assert (parsed["job"], parsed["slot_ms"]) == ("report", 1_796_219_184_000)
    assert parsed["time"].endswith("Z") and "T" in parsed["time"]
    assert "ValueError: bad" in parsed["exception"]
    assert not {"args", "msg", "levelno", "exc_info"} & set(parsed)
