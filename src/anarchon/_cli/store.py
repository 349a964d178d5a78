"""The commands that read and operate a store from a shell: ``anarchon inspect``,
``history``, ``leases``, ``timers``, ``next``, ``pause``, ``resume``, ``run-now``,
``forget``, ``audit`` and ``check``.
Tables (``rich``) where a person reads, JSON (``--json``) where a program does."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, TypeVar

import anyio
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .._errors import InvalidScheduleError, RunOverlapError
from .._model.schedule import load_timezone
from .._model.text import visible
from .._model.values import (
    InstanceInfo,
    JobInfo,
    LeaseInfo,
    RunResult,
    TimerKindInfo,
)
from .._ops.inspector import (
    Inspector,
    backfill_text,
    definitions_text,
    fleet_text,
    jobs_cut,
    kind_limits_text,
    may_run,
    runners,
    running_text,
)
from .._store.backend import RedisBackend
from .._store.quarantine import Quarantined
from .usage import UsageError, parse_instant

__all__ = ["add_store_commands", "run_store_command"]

#: The commands this module runs.
COMMANDS = (
    "inspect", "history", "leases", "timers", "next", "pause", "resume", "run-now", "audit",
    "check", "forget", "backfill",
)  # fmt: skip
#: Malformed store entries ``inspect`` lists at most (the newest).
MALFORMED_SHOWN = 50

T = TypeVar("T")


def store_options() -> argparse.ArgumentParser:
    """The options that name a store: ``--redis`` and ``--prefix``."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--redis",
        metavar="URL",
        default=os.environ.get("ANARCHON_REDIS_URL"),
        help="the store's server (default: $ANARCHON_REDIS_URL, else redis://localhost:6379)",
    )
    add_prefix_option(options)
    return options


def add_prefix_option(parser: argparse.ArgumentParser) -> None:
    """``--prefix``, from ``$ANARCHON_PREFIX`` unless given."""
    parser.add_argument(
        "--prefix",
        default=os.environ.get("ANARCHON_PREFIX", "cron:"),
        help="the store's key prefix (default: $ANARCHON_PREFIX, else cron:)",
    )


def store_backend(args: argparse.Namespace) -> RedisBackend[Any]:
    """The store that ``--redis`` and ``--prefix`` name."""
    return RedisBackend(redis=args.redis or "redis://localhost:6379", prefix=args.prefix)


def add_store_commands(commands: Any) -> None:
    """Add the store commands to the ``anarchon`` parser."""
    common = argparse.ArgumentParser(add_help=False, parents=[store_options()])
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inspect = commands.add_parser(
        "inspect",
        parents=[common],
        help="show the jobs, runs in progress, instances and timers",
        description="Reads the store (no scheduler needs to run here): each job with its "
        "schedule, next fire time (UTC and the job's zone), pause flag and last result; the "
        "runs in progress with their runner, attempt, fence and time left; the instances "
        "alive; the timer kinds; the recent failures; the store's malformed entries (met "
        "here, and reported by the instances), which are left out of the rest.",
    )
    inspect.add_argument(
        "--failures",
        type=int,
        default=10,
        metavar="N",
        help="list this many recent failures (default: 10; 0: none)",
    )
    history = commands.add_parser(
        "history",
        parents=[common],
        help="show a job's recorded attempts, newest first",
        description="Reads a job's history from the store (no scheduler needs to run "
        "here): each attempt, newest first, with its slot, attempt number, trigger "
        "(schedule, retry, takeover, catch-up, manual), status, runner, duration and "
        "error; a slot skipped by the overlap policy or a pause is there too (status "
        "skipped, attempt 0).",
    )
    history.add_argument("job", metavar="JOB")
    history.add_argument(
        "--limit", type=int, default=20, metavar="N", help="show at most N (default: 20)"
    )
    leases = commands.add_parser(
        "leases",
        parents=[common],
        help="show the runs in progress (of one job, or all)",
        description="Reads the runs in progress from the store (no scheduler needs to run "
        "here): of JOB, or of every job without it, each with its slot, status, attempt, "
        "runner, fence and the time left on its lease.",
    )
    leases.add_argument("job", metavar="JOB", nargs="?", help="one job (default: every job)")
    upcoming = commands.add_parser(
        "next",
        parents=[common],
        help="show a job's next fire times (UTC and its zone)",
        description="Reckons a job's next fire times from the definition its instances "
        "registered (no scheduler needs to run here): each in UTC and in the job's time "
        "zone. Of a job with a combined or bounded schedule, or with exclude=, the next "
        "ten its instances last reported (excluded slots left out); of a custom schedule, "
        "only the next slot they last reported.",
    )
    upcoming.add_argument("job", metavar="JOB")
    upcoming.add_argument(
        "-n", type=int, default=10, metavar="N", help="how many (1 to 1000; default: 10)"
    )
    timers = commands.add_parser(
        "timers",
        parents=[common],
        help="list a timer kind's timers, a page at a time",
        description="Reads a kind's timers from the store (no scheduler needs to run "
        "here), a page at a time, in no particular order: each key with its next due "
        "time, status, attempt, recurrence and payload. A page ends with the cursor of the "
        "next one (--cursor), until the last.",
    )
    timers.add_argument("kind", metavar="KIND")
    timers.add_argument(
        "--limit",
        type=int,
        default=100,
        metavar="N",
        help="about N timers a page (1 to 1000; default: 100)",
    )
    timers.add_argument(
        "--cursor",
        metavar="CURSOR",
        help="the page that starts here, as a page's last line says (default: the first page)",
    )
    for name, text in (
        ("pause", "pause a job across the fleet (its slots are recorded as skipped)"),
        ("resume", "resume a paused job"),
        ("run-now", "ask the fleet to run a job now (any instance that runs it takes it)"),
        (
            "forget",
            "remove a job no live instance runs from the store: its state, history and "
            "registry entry",
        ),
    ):
        command = commands.add_parser(name, parents=[common], help=text, description=text)
        command.add_argument("job", metavar="JOB")
        command.add_argument(
            "--note",
            metavar="TEXT",
            help="why (up to 500 characters), for the audit log (default: none)",
        )
        command.add_argument(
            "--by", metavar="WHO", help="who acts (default: user@host of this shell)"
        )
    check = commands.add_parser(
        "check",
        parents=[common],
        help="exit non-zero, one line per problem, for a monitoring system's periodic check",
        description="Checks every registered job: that a live instance runs it, that "
        "anarchon did not pause it after failures (pause_after_failures), and that none "
        "of its slots older than --max-late was left undecided (not run, not recorded "
        "skipped, not under way). Prints one line per problem and exits 1, or says all is "
        "well and exits 0.",
    )
    check.add_argument(
        "--max-late",
        type=duration_ms,
        default="10m",
        metavar="DURATION",
        help="how old an undecided slot may be: 90s, 10m, 2h or milliseconds (default: 10m)",
    )
    backfill = commands.add_parser(
        "backfill",
        parents=[common],
        help="run a job's past slots in a range once across the fleet, or show or cancel that",
        description="With --from and --to: asks the fleet to run every slot of JOB's own "
        "schedule in [FROM, TO) once, oldest first, with trigger backfill (an instance that "
        "runs the job drives it; slots settled already are not run again; at most 10,000 "
        "slots). With --cancel: cancels its running backfill. Alone: shows its backfill.",
    )
    backfill.add_argument("job", metavar="JOB")
    backfill.add_argument(
        "--from", dest="start", metavar="ISO",
        help="the range's first instant, ISO 8601 with an offset (default: none)",
    )  # fmt: skip
    backfill.add_argument(
        "--to", dest="end", metavar="ISO",
        help="the range's end (excluded), ISO 8601 with an offset (default: none)",
    )  # fmt: skip
    backfill.add_argument("--cancel", action="store_true", help="cancel the job's running backfill")
    backfill.add_argument(
        "--note", metavar="TEXT", help="why (up to 500 characters), kept with it (default: none)"
    )
    backfill.add_argument("--by", metavar="WHO", help="who acts (default: user@host of this shell)")
    audit = commands.add_parser(
        "audit",
        parents=[common],
        help="show who paused, resumed or ran jobs now, when and why",
        description="Lists the prefix's audit log, newest first: each pause, resume and "
        "run-now, when (the server's clock), who and the note given (the log keeps the "
        "newest 1000).",
    )
    audit.add_argument("job", metavar="JOB", nargs="?", help="only this job's entries")
    audit.add_argument(
        "-n", type=int, default=20, metavar="N", help="how many (1 to 1000; default: 20)"
    )


def run_store_command(args: argparse.Namespace) -> int:
    backend = store_backend(args)
    out = Console(highlight=False, markup=False, emoji=False, soft_wrap=False, width=term_width())
    handlers: dict[str, Callable[[Inspector], Awaitable[int]]] = {
        "inspect": lambda i: _inspect(i, args, out),
        "history": lambda i: _history(i, args, out),
        "leases": lambda i: _leases(i, args, out),
        "timers": lambda i: _timers(i, args, out),
        "next": lambda i: _next(i, args, out),
        "pause": lambda i: _operate(i, args, out),
        "resume": lambda i: _operate(i, args, out),
        "run-now": lambda i: _operate(i, args, out),
        "forget": lambda i: _operate(i, args, out),
        "audit": lambda i: _audit(i, args, out),
        "check": lambda i: _check(i, args, out),
        "backfill": lambda i: _backfill(i, args, out),
    }

    async def run() -> int:
        async with Inspector(backend) as inspector:
            return await handlers[args.command](inspector)

    return anyio.run(run)


def term_width() -> int | None:
    """Tables as wide as the terminal; 160 columns when the output is not one."""
    return None if sys.stdout.isatty() else 160


async def _inspect(inspector: Inspector, args: argparse.Namespace, out: Console) -> int:
    jobs = await inspector.jobs()
    leases = await inspector.leases()
    instances = await inspector.instances()
    every_read = await inspector.instance_count() <= len(instances)
    timers = await inspector.timers()
    failures = await inspector.failures(args.failures) if args.failures > 0 else []
    malformed = await inspector.quarantined(MALFORMED_SHOWN)
    if args.json:
        print_json(
            {
                "jobs": jobs,
                "leases": leases,
                "instances": instances,
                "timers": timers,
                "failures": failures,
                "malformed": malformed,
            }
        )
        return 0
    out.print(cell(f"store {inspector.backend.where()} prefix {args.prefix!r}"))
    out.print(_jobs_table(jobs, instances, every_read))
    for job in jobs:
        if job.backfill is not None:
            out.print(cell(f"{job.name}: {backfill_text(job.backfill)}"))
        if (disagreement := definitions_text(job)) is not None:
            out.print(cell(f"{job.name}: {disagreement}"), style="bold yellow")
    out.print(_leases_table(leases))
    out.print(_instances_table(instances))
    if timers:
        out.print(_timers_table(timers))
    if failures:
        out.print(_results_table(failures, "Recent failures", with_job=True))
    if malformed:
        out.print(_malformed_table(malformed, inspector.quarantine.count))
    return 0


async def _history(inspector: Inspector, args: argparse.Namespace, out: Console) -> int:
    results = await inspector.history(args.job, args.limit)
    if args.json:
        print_json(results)
    else:
        out.print(_results_table(results, f"History of {args.job}", with_job=False))
    return 0


async def _leases(inspector: Inspector, args: argparse.Namespace, out: Console) -> int:
    leases = await inspector.leases(args.job)
    if args.json:
        print_json(leases)
    else:
        out.print(_leases_table(leases))
    return 0


async def _next(inspector: Inspector, args: argparse.Namespace, out: Console) -> int:
    fires = await inspector.next_fire_times(args.job, args.n)
    (job,) = await inspector.jobs([args.job])
    if args.json:
        print_json({"job": job.name, "timezone": job.timezone, "next": fires})
        return 0
    table = new_table(f"Next fire times of {args.job}")
    for column in ("UTC", f"in {job.timezone}"):
        table.add_column(column)
    for fire in fires:
        add_row(table, when_text(fire), in_zone(fire, job.timezone))
    if not fires:
        add_row(table, "(none known)")
    out.print(table)
    return 0


async def _timers(inspector: Inspector, args: argparse.Namespace, out: Console) -> int:
    page = await inspector.timer_page(args.kind, cursor=args.cursor, limit=args.limit)
    if args.json:
        print_json(page)
        return 0
    table = new_table(f"Timers of {args.kind}")
    for column in ("key", "next due", "status", "attempt", "recurs", "payload"):
        table.add_column(column)
    for timer in sorted(page.timers, key=lambda t: (t.due_ms is None, t.due_ms or 0, t.key)):
        add_row(
            table,
            timer.key,
            when_text(timer.due),
            timer.status,
            str(timer.attempt),
            timer.recurs or "-",
            _excerpt(timer.payload),
        )
    if not page.timers:
        add_row(table, "(none on this page)")
    out.print(table)
    if page.cursor is not None:
        out.print(cell(f"more: anarchon timers {args.kind} --cursor {page.cursor}"))
    return 0


def _excerpt(payload: object) -> str:
    """A payload as a table shows it: its JSON (bytes as ``bytes(N)``), cut at 60."""
    if payload is None:
        return "-"
    if isinstance(payload, bytes):
        return f"bytes({len(payload)})"
    text = json.dumps(payload, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def duration_ms(text: str) -> int:
    """A duration as a shell gives it: ``90s``, ``10m``, ``2h``, ``1d``, or milliseconds."""
    units = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
    number, unit = text.rstrip("smhd"), text[len(text.rstrip("smhd")) :] or "ms"
    if not number.isdigit() or unit not in units or int(number) == 0 or len(number) > 9:
        raise argparse.ArgumentTypeError(
            f"must be a duration such as 90s, 10m, 2h or 1d (or milliseconds), got {text!r}"
        )
    return int(number) * units[unit]


async def _check(inspector: Inspector, args: argparse.Namespace, out: Console) -> int:
    problems = await inspector.check(args.max_late)
    if args.json:
        print_json({"ok": not problems, "problems": problems})
    elif problems:
        for problem in problems:
            out.print(cell(problem), soft_wrap=True)
    else:
        out.print(f"ok: no problem among {len(await inspector.job_names())} job(s)")
    return 1 if problems else 0


async def _audit(inspector: Inspector, args: argparse.Namespace, out: Console) -> int:
    entries = await inspector.audit(args.job, args.n)
    if args.json:
        print_json({"job": args.job, "entries": entries})
        return 0
    title = f"Audit log of {args.job}" if args.job else "Audit log"
    table = new_table(title)
    for column in ("when (UTC)", "action", "job", "by", "note"):
        table.add_column(column)
    for entry in entries:
        add_row(table, when_text(entry.at), entry.action, cell(entry.job), cell(entry.by),
                 cell(entry.note or "-"))  # fmt: skip
    if not entries:
        add_row(table, "(nothing yet)")
    out.print(table)
    return 0


async def _operate(inspector: Inspector, args: argparse.Namespace, out: Console) -> int:
    job = args.job
    said_why = {"note": args.note, "by": args.by}
    if args.command == "pause":
        changed = await inspector.pause(job, **said_why)
        said = f"{job}: paused" if changed else f"{job}: was paused already"
        answer: dict[str, Any] = {"job": job, "paused": True, "changed": changed}
    elif args.command == "resume":
        changed = await inspector.resume(job, **said_why)
        said = f"{job}: resumed" if changed else f"{job}: was not paused"
        answer = {"job": job, "paused": False, "changed": changed}
    elif args.command == "forget":
        removed = await inspector.forget(job, **said_why)
        said = f"{job}: forgotten ({removed} key(s) removed, and its registry entry)"
        answer = {"job": job, "forgotten": True, "keys_removed": removed}
    else:
        slot_id = await inspector.run_now(job, **said_why)
        said = f"{job}: the fleet was asked to run it now (slot {slot_id})"
        answer = {"job": job, "slot_id": slot_id}
    if args.json:
        print_json(answer)
    else:
        out.print(cell(said))
    return 0


async def _backfill(inspector: Inspector, args: argparse.Namespace, out: Console) -> int:
    job, said_why = args.job, {"note": args.note, "by": args.by}
    if args.cancel:
        if args.start or args.end:
            raise UsageError("--cancel takes no --from or --to")
        if not await inspector.cancel_backfill(job, **said_why):
            raise RunOverlapError(f"no backfill of '{visible(job, 200)}' is running")
    elif args.start or args.end:
        if not (args.start and args.end):
            raise UsageError("a backfill needs both --from and --to")
        start, end = parse_instant("--from", args.start), parse_instant("--to", args.end)
        await inspector.backfill(job, start, end, **said_why)
    found = await inspector.jobs([job])
    backfill = found[0].backfill if found else None
    if args.json:
        print_json({"job": job, "backfill": backfill})
        return 0
    out.print(cell(f"{job}: {backfill_text(backfill)}"))
    return 0


# ------------------------------------------------------------------ tables


def cell(value: object) -> Text:
    """Stored text (a job's name, a handler's error, a timer's key) as the terminal shows
    it: plain text, never markup, with control characters and the invisible ones that
    make two names look alike (zero-width, bidi) escaped (``\\x1b``, ``\\u200b``)."""
    return Text(visible(value))


def new_table(title: str) -> Table:
    return Table(title=cell(title), title_justify="left")


def add_row(table: Table, *values: str | Text | None) -> None:
    """A row of plain cells (``cell``); a ``Text`` is one of ours, styled on purpose."""
    table.add_row(*(value if isinstance(value, Text) else cell(value) for value in values))


def _jobs_table(jobs: list[JobInfo], instances: list[InstanceInfo], every_read: bool) -> Table:
    table = new_table("Jobs")
    columns = (
        "job",
        "schedule",
        "next fire (UTC)",
        "in the job's zone",
        "paused",
        "run by",
        "last",
    )
    # Runs holding a fleet permit, against the limit: shown when a job has a limit.
    fleet_column = any(job.fleet_running is not None for job in jobs)
    for column in (*columns, *(["in the fleet"] if fleet_column else [])):
        table.add_column(column)
    for job in jobs:
        count = len(runners(job.name, instances))
        run_by = f"{count} instance{'s' if count > 1 else ''}" if count else None
        if not run_by and (not every_read or may_run(job.name, instances)):
            run_by = "unknown (a registration was read in part)"
        schedule = job.cron or (f"every {job.every_ms} ms" if job.every_ms else job.schedule)
        zone = ""
        if job.next_fire is not None and job.timezone != "UTC":
            zone = in_zone(job.next_fire, job.timezone)
        last = "-"
        if job.last is not None:
            last = f"{job.last.status} ({when_text(job.last.slot)}, attempt {job.last.attempt})"
        add_row(
            table,
            job.name,
            f"{schedule} ({job.strategy})" if job.strategy != "lease" else schedule,
            when_text(job.next_fire),
            zone,
            _paused_text(job),
            run_by or Text("no live instance", style="bold red"),
            last,
            *([fleet_text(job.fleet_running, job.options.get("max_concurrent_fleet")) or "-"]
              if fleet_column else []),
        )  # fmt: skip
    if not jobs:
        add_row(table, "(none: no instance has registered a job under this prefix)")
    return table


def _paused_text(job: JobInfo) -> str:
    """Whether a job claims its slots: paused (by whom), finished (why), or not."""
    paused = f"yes, by {job.paused_by}" if job.paused else "no"
    return f"{paused}; finished: {job.finished}" if job.finished else paused


def in_zone(moment: datetime, timezone: str) -> str:
    """``moment`` in ``timezone`` (a stored zone this machine may not know: said so)."""
    try:
        local = moment.astimezone(load_timezone(timezone))
    except InvalidScheduleError:
        return f"(zone {timezone} unknown here)"
    return f"{local:%Y-%m-%d %H:%M:%S} {timezone}"


def _leases_table(leases: list[LeaseInfo]) -> Table:
    table = new_table("Runs in progress")
    for column in ("job", "slot", "status", "attempt", "runner", "fence", "left"):
        table.add_column(column)
    for lease in leases:
        add_row(
            table,
            lease.job,
            _slot(lease.slot_id, lease.slot),
            lease.status,
            str(lease.attempt),
            lease.runner,
            str(lease.fence),
            f"{lease.left_ms / 1000:.1f} s",
        )
    if not leases:
        add_row(table, "(none)")
    return table


def _instances_table(instances: list[InstanceInfo]) -> Table:
    table = new_table("Instances alive")
    for column in ("instance", "host", "pid", "version", "started", "jobs", "running"):
        table.add_column(column)
    for instance in instances:
        add_row(
            table,
            instance.id,
            instance.host,
            str(instance.pid),
            instance.version,
            when_text(instance.started),
            ", ".join(instance.jobs) + (" and more (read in part)" if jobs_cut(instance) else "")
            or "-",
            running_text(instance),
        )
    if not instances:
        add_row(table, "(none)")
    return table


def _timers_table(timers: list[TimerKindInfo]) -> Table:
    table = new_table("Timers")
    for column in ("kind", "buckets", "pending", "next due", "next key", "fleet limits"):
        table.add_column(column)
    for kind in timers:
        add_row(
            table,
            kind.kind,
            str(kind.buckets),
            str(kind.pending),
            when_text(kind.next_due),
            kind.next_key or "-",
            kind_limits_text(kind),
        )
    return table


def _malformed_table(entries: list[Quarantined], met_here: int) -> Table:
    """The store's malformed entries: each left as it is and skipped (it costs itself
    alone); met here (this command's reads) or reported by an instance."""
    title = "Malformed store entries (left as they are, and skipped"
    title += f"; {met_here} met by this command)" if met_here else ")"
    table = new_table(title)
    for column in ("key", "field", "what is wrong", "it held", "last met"):
        table.add_column(column)
    for entry in entries:
        add_row(
            table,
            entry.key,
            entry.field or "(the whole value)",
            entry.problem,
            entry.excerpt,
            "here" if entry.seen_at is None else when_text(entry.seen_at),
        )
    return table


def _results_table(results: list[RunResult], title: str, *, with_job: bool) -> Table:
    table = new_table(title)
    columns = ["slot", "attempt", "trigger", "status", "runner", "took", "error"]
    for column in ["job", *columns] if with_job else columns:
        table.add_column(column)
    for result in results:
        took = (result.finished_at - result.started_at).total_seconds()
        row = [
            when_text(result.slot),
            str(result.attempt),
            result.trigger,
            result.status,
            result.runner,
            f"{took:.3f} s",
            result.error or "",
        ]
        add_row(table, *([result.job, *row] if with_job else row))
    if not results:
        add_row(table, "(none)")
    return table


def when_text(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    text = f"{moment:%Y-%m-%d %H:%M:%S}"
    if moment.microsecond:
        text += f".{moment.microsecond // 1000:03d}"
    seconds = moment.timestamp() - time.time()
    ago = f"in {_span(seconds)}" if seconds >= 0 else f"{_span(-seconds)} ago"
    return f"{text}Z ({ago})"


def _slot(slot_id: str, slot: datetime) -> str:
    return when_text(slot) + (" manual" if slot_id.startswith("m") else "")


def _span(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
    if seconds < 86400:
        return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:.0f} min"
    return f"{seconds // 86400:.0f} d {seconds % 86400 // 3600:.0f} h"


# -------------------------------------------------------------------- JSON


def print_json(value: object) -> None:
    print(json.dumps(_plain(value), indent=2))


def _plain(value: object) -> object:
    """Dataclasses, datetimes and containers as JSON values (times in ISO 8601)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, datetime):
        return value.isoformat().replace("+00:00", "Z")
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
