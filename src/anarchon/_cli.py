"""The ``anarchon`` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _positive(kind: type[int] | type[float]):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="anarchon", description="Distributed cron and durable timers on Redis and Valkey."
    )
    parser.add_argument("--version", action="version", version=f"anarchon {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run several scheduler instances against one store and show each slot run once",
        description="Starts an embedded Valkey (unless --redis is given), runs scheduler "
        "instances in this process with jobs firing every second, prints which instance ran "
        "each slot, and ends with a summary: slots, runs, duplicates, misses.",
    )
    demo.add_argument("--redis", metavar="URL", help="use this server instead of an embedded one")
    demo.add_argument("--seconds", type=_positive(float), default=10.0, help="default: 10")
    demo.add_argument("--instances", type=_positive(int), default=3, help="default: 3")
    demo.add_argument("--jobs", type=_positive(int), default=3, help="default: 3")
    demo.add_argument("--event-loop", choices=("asyncio", "trio"), default="asyncio")
    demo.add_argument("-v", "--verbose", action="store_true", help="log what the scheduler does")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 done, 1 a failure at run time (said in one line), 2 a usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from ._errors import AnarchonError, ConnectionFailedError

    try:
        if args.command == "demo":
            from ._demo import run_demo

            summary = run_demo(
                redis_url=args.redis,
                seconds=args.seconds,
                instances=args.instances,
                jobs=args.jobs,
                event_loop=args.event_loop,
            )
            return 0 if summary.duplicates == 0 and summary.misses == 0 else 1
    except ConnectionFailedError as exc:
        print(f"anarchon: {exc} (start the server, or give its URL with --redis)", file=sys.stderr)
        return 1
    except AnarchonError as exc:
        print(f"anarchon: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
