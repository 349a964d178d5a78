"""Runtime schedules kept in sync, on a real server: ``Timers.apply`` makes a kind's
recurring timers exactly a given set (and changes nothing when applied again);
``cancel_prefix`` cancels a user's or a tenant's timers, bounded per call, the prefix
taken literally; ``Inspector.timer_page`` and ``anarchon timers`` read a kind a page at a
time."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from anarchon import (
    Inspector,
    InvalidJobError,
    InvalidOptionError,
    RedisBackend,
    Scheduler,
    TimerRun,
    Timers,
    TimerSetting,
)
from tests.helpers import anarchon_command

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]

ROOT = Path(__file__).resolve().parents[1]


def digest(tenant: int, cron: str = "0 9 * * *", zone: str = "Europe/Berlin") -> TimerSetting:
    return TimerSetting(f"tenant:{tenant}", cron=cron, timezone=zone, payload={"t": tenant})


async def register(url: str, prefix: str, kind: str, buckets: int = 1) -> None:
    """A kind as its instances register it (the views read only registered kinds)."""
    scheduler = Scheduler(RedisBackend(redis=url, prefix=prefix), instance_id="setter")

    async def handler(fire: TimerRun) -> None:
        pass

    scheduler.add_timer(handler, kind, buckets=buckets)
    async with scheduler:
        pass


async def test_apply_makes_a_kinds_recurring_timers_exactly_the_set_and_is_idempotent(
    server_url: str, prefix: str
) -> None:
    """Three tenants applied: three created. The same again: nothing written (the
    generations stay). One tenant's schedule changed, one dropped, one added: one
    changed (a new generation), one removed, one created, one unchanged; a one-shot
    timer of the kind is left alone. A setting that does not recur, or a key twice, is
    refused before anything is written."""
    async with Timers(RedisBackend(redis=server_url, prefix=prefix)) as timers:
        first = await timers.apply("digest", [digest(1), digest(2), digest(3)])
        assert (sorted(first.created), first.changed, first.removed, first.unchanged) == (
            ["tenant:1", "tenant:2", "tenant:3"], (), (), 0,
        )  # fmt: skip
        generations = {k: (await timers.get("digest", k)) for k in ("tenant:1", "tenant:2")}
        again = await timers.apply("digest", [digest(1), digest(2), digest(3)])
        assert (again.created, again.changed, again.removed, again.unchanged) == ((), (), (), 3)
        for key, before in generations.items():
            after = await timers.get("digest", key)
            assert before is not None and after is not None
            assert after.generation == before.generation, key
        await timers.set("digest", "one-shot", delay_ms=3_600_000)
        moved = await timers.apply("digest", [digest(1), digest(2, cron="0 10 * * *"), digest(4)])
        assert (moved.created, moved.changed, moved.removed, moved.unchanged) == (
            ("tenant:4",), ("tenant:2",), ("tenant:3",), 1,
        )  # fmt: skip
        changed = await timers.get("digest", "tenant:2")
        assert changed is not None and "0 10 * * *" in (changed.recurs or "")
        assert await timers.get("digest", "tenant:3") is None
        assert await timers.get("digest", "one-shot") is not None
        kept = await timers.apply("digest", [digest(5)], remove_others=False)
        assert (kept.created, kept.removed) == (("tenant:5",), ())
        with pytest.raises(InvalidOptionError, match="apply keeps recurring timers"):
            await timers.apply("digest", [TimerSetting("tenant:9", delay_ms=10)])
        with pytest.raises(InvalidOptionError, match="given twice"):
            await timers.apply("digest", [digest(6), digest(6)])
        assert await timers.get("digest", "tenant:6") is None


async def test_cancel_prefix_cancels_a_users_timers_bounded_per_call_and_literally(
    server_url: str, prefix: str
) -> None:
    """25 timers of user 1, and others whose keys only look alike (user 10, a key with
    glob characters): cancel_prefix('user:1:', limit=10) cancels 10, 10, then 5, then
    none, and leaves the others; a prefix with '*' and '[' is taken literally."""
    mine = [TimerSetting(f"user:1:{n}", delay_ms=3_600_000) for n in range(25)]
    others = [
        TimerSetting(key, delay_ms=3_600_000)
        for key in ("user:10:a", "user:2:a", "user:1*x", "user:[1]:a", "user:1")
    ]
    async with Timers(RedisBackend(redis=server_url, prefix=prefix)) as timers:
        await timers.set_many("remind", [*mine, *others])
        counts = [await timers.cancel_prefix("remind", "user:1:", limit=10) for _ in range(4)]
        assert counts == [10, 10, 5, 0], counts
        for setting in others:
            assert await timers.get("remind", setting.key) is not None, setting.key
        assert await timers.cancel_prefix("remind", "user:[1]") == 1
        assert await timers.cancel_prefix("remind", "user:1*") == 1
        assert await timers.get("remind", "user:10:a") is not None
        with pytest.raises(InvalidOptionError, match="limit must be"):
            await timers.cancel_prefix("remind", "user:", limit=0)
        with pytest.raises(InvalidOptionError):
            await timers.cancel_prefix("remind", "")


async def test_a_kinds_timers_are_read_a_page_at_a_time_each_once(
    server_url: str, prefix: str
) -> None:
    """250 timers in three buckets, read 100 at a time: the pages end with a cursor until
    the last, and hold every timer once; a cursor no page gave and an unknown kind are
    refused with errors that say so."""
    await register(server_url, prefix, "remind", buckets=3)
    backend = RedisBackend(redis=server_url, prefix=prefix)
    keys = [f"k{n}" for n in range(250)]
    async with Timers(backend) as timers:
        await timers.set_many(
            "remind",
            [TimerSetting(key, delay_ms=60_000, payload=b"\xff\x00") for key in keys],
        )
    async with Inspector(backend) as inspector:
        seen: list[str] = []
        cursor: str | None = None
        pages = 0
        while True:
            page = await inspector.timer_page("remind", cursor=cursor, limit=100)
            pages += 1
            seen += [timer.key for timer in page.timers]
            assert all(t.payload == b"\xff\x00" and t.status == "pending" for t in page.timers)
            if page.cursor is None:
                break
            cursor = page.cursor
        assert sorted(seen) == sorted(keys) and pages >= 2, (pages, len(seen))
        with pytest.raises(InvalidOptionError, match="no page's cursor"):
            await inspector.timer_page("remind", cursor="7-1")
        with pytest.raises(InvalidJobError, match="no timer kind named 'nope'"):
            await inspector.timer_page("nope")


async def test_anarchon_timers_lists_a_kind_as_a_table_and_as_json(
    server_url: str, prefix: str
) -> None:
    await register(server_url, prefix, "remind")
    async with Timers(RedisBackend(redis=server_url, prefix=prefix)) as timers:
        await timers.set("remind", "user:\x1b[2J42", every_ms=60_000, payload={"x": 1})

    def anarchon(*args: str) -> subprocess.CompletedProcess[str]:
        return anarchon_command(server_url, prefix, "timers", "remind", *args)

    table = anarchon()
    assert table.returncode == 0, table
    assert r"user:\x1b[2J42" in table.stdout and "\x1b" not in table.stdout, table.stdout
    assert "every_ms=60000" in table.stdout and '{"x": 1}' in table.stdout, table.stdout
    listed = json.loads(anarchon("--json").stdout)
    assert [t["key"] for t in listed["timers"]] == ["user:\x1b[2J42"]
    assert listed["cursor"] is None and listed["timers"][0]["payload"] == {"x": 1}
