"""``anarchon check-schedule "CRON" [--timezone TZ]``: what a cron expression means, its
next fire times, and what users trip over (daylight-saving changes, 6-field lookalikes).
It reads no store."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any

from rich.console import Console

from .._model.schedule_check import check_schedule
from .store import add_row, in_zone, new_table, print_json, term_width, when_text
from .usage import UsageError, parse_instant

__all__ = ["add_check_schedule_command", "run_check_schedule"]


def add_check_schedule_command(commands: Any) -> None:
    check = commands.add_parser(
        "check-schedule",
        help="explain a cron expression, list its next fire times, warn of DST and lookalikes",
        description="Reads a cron expression as a job's schedule would (5 fields, or 6 with "
        "seconds first) in a time zone, and prints what it means, its next fire times in UTC "
        "and the zone, and warnings: wall-clock times that a daylight-saving change in the "
        "next year skips or repeats (and what anarchon does there), and 6-field expressions "
        "that look like 5-field ones. An expression that never fires is refused (exit 1). "
        "Reads no store.",
    )
    check.add_argument("expression", metavar="CRON", help='such as "0 9 * * 1-5"')
    check.add_argument(
        "--timezone", default="UTC", help="the IANA zone it is read in (default: UTC)"
    )
    check.add_argument(
        "-n", type=int, default=10, help="how many fire times to list (1 to 1000, default 10)"
    )
    check.add_argument(
        "--from",
        dest="start",
        metavar="ISO",
        help="list and check from this moment (ISO 8601 with an offset; default: now)",
    )
    check.add_argument("--json", action="store_true", help="print JSON instead of text")


def run_check_schedule(args: argparse.Namespace) -> int:
    if not 1 <= args.n <= 1000:
        raise UsageError(f"-n must be from 1 to 1000, got {args.n}")
    start = datetime.now(UTC)
    if args.start is not None:
        start = parse_instant("--from", args.start)
    checked = check_schedule(args.expression, args.timezone, after=start, count=args.n)
    if args.json:
        print_json(checked)
        return 0
    out = Console(highlight=False, markup=False, emoji=False, soft_wrap=False, width=term_width())
    out.print(f"{checked.expression!r} in {checked.timezone}: {checked.meaning}")
    table = new_table("Next fire times")
    for column in ("UTC", f"in {checked.timezone}"):
        table.add_column(column)
    for fire in checked.fires:
        add_row(table, when_text(fire), in_zone(fire, checked.timezone))
    out.print(table)
    if checked.warnings:
        out.print("Warnings:")
        for warning in checked.warnings:
            out.print(f"- {warning}", soft_wrap=True)
    else:
        out.print("No warnings.")
    return 0
