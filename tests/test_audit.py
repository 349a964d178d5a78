"""Operator notes and the audit log (issue 44, part 5): pause, resume and run-now take a
note and who acts; each is kept in a bounded audit log per prefix (the server's clock),
read by ``Inspector.audit``, ``anarchon audit`` and the dashboard's job page; a paused
job shows who paused it and why; an entry that does not read costs only itself."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from anarchon import Inspector, InvalidOptionError, RedisBackend, Scheduler
from anarchon._store.audit import AUDIT_MAX, record_audit
from anarchon._store.keys import RegistryKeys
from tests.helpers import anarchon_command

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]

ROOT = Path(__file__).resolve().parents[1]


def report_scheduler(url: str, prefix: str) -> Scheduler[Any]:
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis=url, prefix=prefix))

    @scheduler.job("0 3 * * *", name="report")
    async def report() -> None:
        pass

    return scheduler


async def test_pause_resume_and_run_now_are_in_the_audit_log_with_who_and_why(
    server_url: str, prefix: str
) -> None:
    """From a scheduler and from an inspector: each action that changed something is an
    entry (newest first, the server's time), with the note and who acted; a pause that
    changed nothing is none; a paused job shows who paused it and why."""
    scheduler = report_scheduler(server_url, prefix)
    before = time.time()
    async with scheduler, Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        assert await scheduler.pause("report", note="the upstream is down")
        assert not await inspector.pause("report", note="again", by="bob")  # no change
        (job,) = await inspector.jobs(["report"])
        assert job.paused and job.paused_by is not None
        assert job.paused_by.endswith(": the upstream is down") and "@" in job.paused_by
        assert await inspector.resume("report", note="it is back", by="alice@ops")
        await scheduler.run_now("report", by="ci")
        entries = await inspector.audit()
        only = await inspector.audit("report", limit=2)
        none = await inspector.audit("other")
    assert [(e.action, e.by, e.note) for e in entries] == [
        ("run-now", "ci", None),
        ("resume", "alice@ops", "it is back"),
        ("pause", entries[2].by, "the upstream is down"),
    ]
    assert "@" in entries[2].by and all(e.job == "report" for e in entries)
    assert all(before - 1 <= e.at.timestamp() <= time.time() + 1 for e in entries)
    assert only == entries[:2] and none == []


async def test_anarchon_pause_takes_a_note_and_anarchon_audit_lists_it(
    server_url: str, prefix: str
) -> None:
    scheduler = report_scheduler(server_url, prefix)

    def anarchon(*args: str) -> subprocess.CompletedProcess[str]:
        return anarchon_command(server_url, prefix, *args)

    async with scheduler:
        paused = anarchon("pause", "report", "--note", "a \x1b[2J freeze", "--by", "carol")
        listed = json.loads(anarchon("audit", "report", "--json").stdout)
        table = anarchon("audit")
        inspected = anarchon("inspect")
        too_long = anarchon("pause", "report", "--note", "x" * 501)
    assert paused.returncode == 0, paused
    (entry,) = listed["entries"]
    assert (entry["action"], entry["by"], entry["note"]) == ("pause", "carol", "a \x1b[2J freeze")
    assert table.returncode == 0 and "carol" in table.stdout, table
    assert r"a \x1b[2J freeze" in table.stdout and "\x1b" not in table.stdout, table.stdout
    assert "yes, by carol at" in inspected.stdout, inspected.stdout
    assert too_long.returncode == 1 and "at most 500 characters" in too_long.stderr, too_long


@pytest.mark.server_tier
async def test_the_audit_log_is_bounded_and_a_malformed_entry_costs_only_itself(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """On every server (the stream commands and their forms): the log keeps the newest
    1000; a job's entries are found page by page to the oldest; entries that do not
    read are quarantined and left out, the others read."""
    key = RegistryKeys.for_prefix(prefix).audit
    async with Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        conn = inspector._require()
        for n in range(AUDIT_MAX + 5):
            await record_audit(conn, prefix, "pause", f"job{n}", "me", None, within_sec=5)
        assert direct.xlen(key) == AUDIT_MAX
        direct.xadd(key, {"action": "explode", "job": "x", "by": "y"})
        direct.xadd(key, {"nothing": "here"})
        await record_audit(conn, prefix, "resume", "job1", "me", "fine", within_sec=5)
        entries = await inspector.audit(limit=3)
        oldest = await inspector.audit("job8")  # three more entries trimmed three more
        trimmed = await inspector.audit("job7")
        malformed = {entry.problem for entry in await inspector.quarantined()}
    assert [(e.action, e.job) for e in entries] == [
        ("resume", "job1"), ("pause", f"job{AUDIT_MAX + 4}"), ("pause", f"job{AUDIT_MAX + 3}"),
    ]  # fmt: skip
    assert [e.job for e in oldest] == ["job8"] and trimmed == []
    assert any("unknown action 'explode'" in p for p in malformed), malformed
    assert any("unknown action None" in p for p in malformed), malformed


async def test_a_note_or_a_who_that_cannot_be_kept_is_refused_before_anything_changes(
    server_url: str, prefix: str
) -> None:
    scheduler = report_scheduler(server_url, prefix)
    async with scheduler, Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        with pytest.raises(InvalidOptionError, match="note must be text"):
            await inspector.pause("report", note="x" * 501)
        with pytest.raises(InvalidOptionError, match="by must be text"):
            await scheduler.pause("report", by="")
        (job,) = await inspector.jobs(["report"])
        assert not job.paused and await inspector.audit() == []


def test_the_dashboards_audit_section_shows_stored_text_as_text() -> None:
    from datetime import UTC, datetime

    from anarchon import AuditEntry
    from anarchon.web import _audit_table

    entry = AuditEntry(
        at=datetime(2027, 1, 1, tzinfo=UTC), action="pause", job="report",
        by="<img src=x onerror=alert(1)>", note="<script>alert(2)</script>",
    )  # fmt: skip
    page = _audit_table([entry])
    assert "<script>" not in page and "<img" not in page, page
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in page and "pause" in page
    assert "Nothing yet" in _audit_table([])


async def test_an_audit_log_key_of_another_type_costs_the_log_alone(
    server_url: str, prefix: str, direct: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Someone wrote a string where the audit log's stream goes: a pause still pauses
    (the entry it could not write is logged), and the log reads as empty, quarantined."""
    key = RegistryKeys.for_prefix(prefix).audit
    direct.set(key, "not a stream")
    scheduler = report_scheduler(server_url, prefix)
    async with scheduler, Inspector(RedisBackend(redis=server_url, prefix=prefix)) as inspector:
        assert await inspector.pause("report", note="still pauses")
        (job,) = await inspector.jobs(["report"])
        assert job.paused and await inspector.audit() == []
        met = {(entry.key, entry.problem) for entry in await inspector.quarantined()}
    assert any(k == key and "another type" in p for k, p in met), met
    assert any("the audit log did not take it" in r.getMessage() for r in caplog.records)
