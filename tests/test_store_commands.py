"""``anarchon inspect``, ``history``, ``leases``, ``pause``, ``resume`` and ``run-now`` as a
user runs them from another shell, against a fleet of two ``anarchon run`` processes on
a real server: tables for a person, JSON for a program, one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import redis

from anarchon import RedisBackend, Run, Scheduler
from tests.helpers import NEVER, wait_until
from tests.test_run_command import ROOT, RunCommand, app_env, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.engine_tier]


def anarchon(url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return subprocess.run(
        [sys.executable, "-m", "anarchon", *args, "--redis", url, "--prefix", prefix],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def as_json(done: subprocess.CompletedProcess[str]) -> object:
    assert done.returncode == 0, done
    return json.loads(done.stdout)


@pytest.mark.slow("two instances, and twenty anarchon commands: each a Python process")
def test_a_running_fleet_is_seen_paused_resumed_and_asked_to_run_from_another_shell(
    server_url: str, prefix: str, tmp_path: Path
) -> None:
    env = app_env(server_url, prefix, work_sec=0.2)
    fleet = [RunCommand(tmp_path, name, env) for name in ("one", "two")]
    try:
        for command in fleet:
            command.wait_live()
        wait_for(
            lambda: as_json(anarchon(server_url, prefix, "history", "work", "--json")),
            20,
            "a first run",
        )

        table = anarchon(server_url, prefix, "inspect")
        assert table.returncode == 0, table
        for seen in ("Jobs", "work", "* * * * * *", "2 instances", "Instances alive", "one",
                     "two"):  # fmt: skip
            assert seen in table.stdout, (seen, table.stdout)
        assert "no live instance" not in table.stdout, table.stdout
        state = as_json(anarchon(server_url, prefix, "inspect", "--json"))
        assert isinstance(state, dict)
        assert [job["name"] for job in state["jobs"]] == ["work"]
        assert [i["id"] for i in state["instances"]] == ["one", "two"]
        assert state["jobs"][0]["paused"] is False

        paused = anarchon(server_url, prefix, "pause", "work")
        assert (paused.returncode, paused.stdout.strip()) == (0, "work: paused"), paused
        paused_ms = time.time() * 1000
        again = as_json(anarchon(server_url, prefix, "pause", "work", "--json"))
        assert again == {"job": "work", "paused": True, "changed": False}
        assert "yes, by" in anarchon(server_url, prefix, "inspect").stdout
        time.sleep(2.2)
        asked = as_json(anarchon(server_url, prefix, "run-now", "work", "--json"))
        assert isinstance(asked, dict) and str(asked["slot_id"]).startswith("m")

        def history() -> list[dict[str, object]]:
            found = as_json(anarchon(server_url, prefix, "history", "work", "--limit", "50",
                                     "--json"))  # fmt: skip
            assert isinstance(found, list)
            return found

        wait_for(
            lambda: [r for r in history() if r["trigger"] == "manual" and r["status"] == "ok"],
            20,
            "the fleet's manual run",
        )
        # The pause holds until the resume command writes, some time after it is asked
        # for (a process's start) and before it returns (a process's end, which a loaded
        # machine can make last seconds): a slot before the ask was paused for certain.
        resume_asked_ms = time.time() * 1000
        resumed = anarchon(server_url, prefix, "resume", "work")
        assert (resumed.returncode, resumed.stdout.strip()) == (0, "work: resumed"), resumed
        resumed_ms = time.time() * 1000
        wait_for(lambda: [r for r in history() if int(str(r["slot_ms"])) > resumed_ms], 20, "a run")
        results = history()
        during = [
            r for r in results
            if paused_ms < int(str(r["slot_ms"])) < resume_asked_ms and r["trigger"] != "manual"
        ]  # fmt: skip
        assert during and all(r["status"] == "skipped" for r in during), during
        assert len([r for r in results if r["trigger"] == "manual"]) == 1

        leases = anarchon(server_url, prefix, "leases")
        assert leases.returncode == 0 and "Runs in progress" in leases.stdout, leases

        for command in fleet:
            command.signal(signal.SIGTERM)
        for command in fleet:
            assert command.wait(20) == 0, command.log()
        gone = as_json(anarchon(server_url, prefix, "inspect", "--json"))
        assert isinstance(gone, dict) and gone["instances"] == []
        # The job stays registered, and the table says no instance alive runs it.
        table = anarchon(server_url, prefix, "inspect")
        assert "work" in table.stdout and "no live instance" in table.stdout, table.stdout
    finally:
        for command in fleet:
            command.end()


@pytest.mark.parametrize("command", ["history", "pause", "resume", "run-now", "leases"])
def test_an_unknown_job_is_a_one_line_error_not_an_empty_answer(
    server_url: str, prefix: str, command: str
) -> None:
    done = anarchon(server_url, prefix, command, "typo")
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no job named 'typo'" in lines[0], lines
    assert done.stdout == ""


def test_a_store_command_against_a_server_it_cannot_reach_says_so_in_one_line() -> None:
    done = anarchon("redis://127.0.0.1:1", "cron:", "inspect")
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the server" in lines[0] and "--redis" in lines[0]
    assert ".;" not in lines[0] and ";;" not in lines[0], lines[0]


def test_an_error_reply_from_the_server_is_a_one_line_error(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """A key under the prefix that anarchon did not write (here, the registry's jobs hash
    as a string): the server answers WRONGTYPE, and the command says so in one line,
    with exit 1 and no traceback; the key is left as it was."""
    jobs_key = "{" + prefix + "}:jobs"
    direct.set(jobs_key, "not a hash")
    done = anarchon(server_url, prefix, "inspect")
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "WRONGTYPE" in lines[0], lines
    assert "the server refused a command" in lines[0] and "--prefix" in lines[0], lines
    assert direct.get(jobs_key) == "not a hash"


@pytest.mark.anyio
async def test_leases_shows_a_run_in_progress_and_marks_a_manual_one(
    server_url: str, prefix: str
) -> None:
    """``anarchon leases`` while a manual run goes on: one row with its job, its slot
    marked manual, its status, attempt, runner and fence."""
    scheduler = Scheduler(
        RedisBackend(redis=server_url, prefix=prefix), instance_id="holder", stop_grace_ms=100
    )
    started: list[Run] = []

    @scheduler.job(NEVER, name="long")
    async def long(run: Run) -> None:
        started.append(run)
        await anyio.sleep(60)

    async with scheduler, anyio.create_task_group() as group:
        group.start_soon(scheduler.run_now, "long")
        await wait_until(lambda: bool(started), 20, "the manual run to start")
        shown = await anyio.to_thread.run_sync(anarchon, server_url, prefix, "leases")
        group.cancel_scope.cancel()
    assert shown.returncode == 0, shown
    (row,) = [line for line in shown.stdout.splitlines() if "long" in line]
    for seen in ("manual", "running", "holder", str(started[0].fence)):
        assert seen in row, (seen, shown.stdout)


HOSTILE_JOB = "j[link=evil.example]click[/link]"
HOSTILE_ERROR = "boom [/bad] [bold]x\x1b]0;pwned\x07\x1b[2J\x9b31m"


@pytest.mark.anyio
async def test_stored_text_is_shown_as_text_never_as_markup_or_terminal_control(
    server_url: str, prefix: str
) -> None:
    """A job name and a handler's error are whatever the application wrote: the tables
    show them as plain text (rich's markup read as text, not as links or styles) with
    control characters escaped, so nothing stored can retitle or clear a terminal."""
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), instance_id="shown")

    @scheduler.job(NEVER, name=HOSTILE_JOB)
    async def hostile() -> None:
        raise RuntimeError(HOSTILE_ERROR)

    async with scheduler:
        result = await scheduler.run_now(HOSTILE_JOB)
    assert result.status == "failed"
    for command in (("inspect",), ("history", HOSTILE_JOB)):
        shown = await anyio.to_thread.run_sync(anarchon, server_url, prefix, *command)
        assert shown.returncode == 0, shown
        # Read as markup, the name would show as "jclick", and [/bad] would be an error.
        assert "j[link=evil.example]" in shown.stdout, shown.stdout
        assert "boom [/bad]" in shown.stdout, shown.stdout
        assert r"\x1b]0;pwned\x07" in shown.stdout, shown.stdout
        assert not any(char in shown.stdout for char in "\x1b\x07\x9b"), shown.stdout


def register(url: str, prefix: str, names: list[str]) -> None:
    """Register ``names`` (an instance that starts, runs the first once, and stops)."""

    async def run() -> None:
        scheduler = Scheduler(RedisBackend(redis=url, prefix=prefix), instance_id="once")
        for name in names:
            scheduler.add_job(lambda: None, NEVER, name=name)
        async with scheduler:
            await scheduler.run_now(names[0])

    anyio.run(run)


#: Registry entries no anarchon wrote, by what is wrong with them.
MALFORMED = {
    "not-json": "{not json",
    "a-list": "[1, 2]",
    "no-zone": '{"schedule": "x", "cron": "0 0 * * *", "timezone": "Nope/Zone"}',
}


def test_malformed_registry_entries_cost_only_themselves_in_every_store_command(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """A definition that is not JSON, one that is a JSON list, one whose zone does not
    exist, and a results member that is no result: ``inspect``, ``history``, ``leases``
    and ``pause`` of the other jobs work as usual, ``inspect`` lists the malformed
    entries in a section of their own (as JSON too), and asking for a malformed job
    by name is an error that says it is malformed."""
    register(server_url, prefix, ["good", "other"])
    direct.hset("{" + prefix + "}:jobs", mapping=MALFORMED)
    direct.zadd("{" + prefix + "good}:results", {"garbage": 1})
    table = anarchon(server_url, prefix, "inspect")
    assert table.returncode == 0, table
    assert "good" in table.stdout and "other" in table.stdout, table.stdout
    assert "Malformed store entries" in table.stdout, table.stdout
    for name in [*MALFORMED, "garbage"]:
        assert name in table.stdout, (name, table.stdout)
    shown = as_json(anarchon(server_url, prefix, "inspect", "--json"))
    assert isinstance(shown, dict)
    assert {entry["field"] for entry in shown["malformed"]} >= {*MALFORMED, "garbage"}
    assert [job["name"] for job in shown["jobs"]] == ["good", "other"]
    history = as_json(anarchon(server_url, prefix, "history", "good", "--json"))
    assert isinstance(history, list) and [r["status"] for r in history] == ["ok"]
    assert as_json(anarchon(server_url, prefix, "leases", "--json")) == []
    assert as_json(anarchon(server_url, prefix, "leases", "other", "--json")) == []
    assert anarchon(server_url, prefix, "pause", "other").returncode == 0
    # The entry is logged once as it is met (a warning), then the command's error.
    done = anarchon(server_url, prefix, "history", "not-json")
    assert done.returncode == 1 and done.stdout == "", done
    warning, error = done.stderr.strip().splitlines()
    assert "malformed store entry" in warning and "not-json" in warning, warning
    assert "job 'not-json': its definition in the store is malformed" in error, error


def test_an_unknown_job_error_shows_the_name_escaped_and_no_stored_name(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """The names the store holds are not listed in the error (any number of them, any
    text: one is a terminal escape here), and the name asked for is shown escaped."""
    register(server_url, prefix, ["good"])
    direct.hset("{" + prefix + "}:jobs", "evil\x1b]0;pwned\x07", "{}")
    done = anarchon(server_url, prefix, "history", "typo\x1b[2J")
    assert done.returncode == 1, done
    assert "\x1b" not in done.stderr and r"typo\x1b[2J" in done.stderr, done.stderr
    assert "good" not in done.stderr and "evil" not in done.stderr, done.stderr


def test_names_that_differ_by_an_invisible_character_look_different(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """Two jobs, 'payroll' and 'pay\\u200broll' (a zero-width space), and one with a
    right-to-left override, in a store written before such names were refused: the
    tables show the invisible characters escaped."""
    register(server_url, prefix, ["payroll"])
    jobs = "{" + prefix + "}:jobs"
    definition = direct.hget(jobs, "payroll")
    assert definition is not None
    direct.hset(jobs, mapping={"pay\u200broll": definition, "report\u202egpj.exe": definition})
    table = anarchon(server_url, prefix, "inspect")
    assert table.returncode == 0, table
    assert r"pay\u200broll" in table.stdout and r"report\u202egpj.exe" in table.stdout
    assert "\u200b" not in table.stdout and "\u202e" not in table.stdout, table.stdout
