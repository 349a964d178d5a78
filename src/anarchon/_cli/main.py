"""The ``anarchon`` command."""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import anyio

from .._errors import InvalidOptionError
from .._model.text import visible
from .._ops.serve import WAIT_FOR_SERVER_SEC
from .dev_server import add_dev_server_command, run_dev_server
from .schedule import add_check_schedule_command, run_check_schedule
from .store import COMMANDS as STORE_COMMANDS
from .store import add_prefix_option, add_store_commands, run_store_command
from .usage import MissingExtra, UsageError
from .web import add_web_command, run_web

__all__ = ["main"]


def _positive(kind: type[int] | type[float]):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
        return value

    return parse


def _at_least_zero(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0 to 65535), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="anarchon", description="Distributed cron and durable timers on Redis and Valkey."
    )
    parser.add_argument("--version", action="version", version=f"anarchon {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="several instances against one store: each slot once, a takeover, a retry, a timer",
        description="Starts an embedded Valkey (unless --redis is given) and scheduler "
        "instances as processes, with jobs firing every second, a slow job whose runner is "
        "killed mid-run (a backup takes it over: attempt 2, a higher fence), a job whose "
        "first attempt fails (retried) and a timer set, replaced and fired. Prints who ran "
        "each slot, and ends with a summary: slots, runs, duplicates, misses, takeovers, "
        "retries, timers fired.",
    )
    demo.add_argument(
        "--redis",
        metavar="URL",
        help="use this server instead of an embedded one (default: an embedded Valkey)",
    )
    demo.add_argument(
        "--seconds",
        type=_positive(float),
        default=10.0,
        metavar="SECONDS",
        help="how long the jobs fire (default: 10)",
    )
    demo.add_argument(
        "--instances",
        type=_positive(int),
        default=3,
        metavar="N",
        help="scheduler instances, each a process (default: 3)",
    )
    demo.add_argument(
        "--jobs",
        type=_positive(int),
        default=3,
        metavar="N",
        help="jobs that fire every second, besides the slow, the failing one and the timer "
        "(default: 3)",
    )
    _event_loop_option(demo)
    demo.add_argument("-v", "--verbose", action="store_true", help="log what the scheduler does")
    add_dev_server_command(commands, _port)
    _run_parser(commands)
    add_store_commands(commands)
    add_check_schedule_command(commands)
    add_web_command(commands, _port)
    return parser


def _run_parser(commands: Any) -> None:
    run = commands.add_parser(
        "run",
        help="run a scheduler of yours until SIGINT or SIGTERM",
        description="Imports MODULE and runs its Scheduler ATTRIBUTE (or calls ATTRIBUTE, a "
        "function that returns one, sync or async). The first SIGINT or SIGTERM stops it "
        "gracefully (running handlers get the scheduler's stop_grace_ms, then their leases "
        "are given back so that a backup takes over at once); a second one stops it at once. "
        "Exit codes: 0 stopped, 1 a failure at run time (the server did not answer within "
        "--wait-for-server, a store of another format, ...), 2 a usage error (a bad "
        "MODULE:ATTRIBUTE, a bad option).",
    )
    run.add_argument("target", metavar="MODULE:ATTRIBUTE", help="such as app:scheduler")
    run.add_argument("--instance-id", help="this instance's id (default: host:pid:random)")
    run.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="default: INFO",
    )
    run.add_argument(
        "--log-format",
        default="plain",
        choices=("plain", "json"),
        help="plain lines, or one JSON object per line (default: plain)",
    )
    run.add_argument(
        "--wait-for-server",
        type=_at_least_zero,
        default=WAIT_FOR_SERVER_SEC,
        metavar="SECONDS",
        help="while the server does not answer at start, try again for this long (default: "
        f"{WAIT_FOR_SERVER_SEC:g}; 0 fails at once)",
    )
    run.add_argument(
        "--health-file",
        metavar="PATH",
        help="keep a health file here (check it with: anarchon health PATH; default: none)",
    )
    run.add_argument(
        "--health-port",
        type=_port,
        metavar="PORT",
        help="answer GET /live and /ready on this port (200 or 503, with a JSON body; "
        "default: none, no probes served)",
    )
    run.add_argument(
        "--health-host",
        default="127.0.0.1",
        help="default: 127.0.0.1 (this machine only; Kubernetes' httpGet probes need 0.0.0.0)",
    )
    run.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics on this port, GET /metrics (needs "
        "anarchon[prometheus]; default: none, no metrics served)",
    )
    run.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="default: 127.0.0.1 (this machine only; a scraper of the pod's address needs 0.0.0.0)",
    )
    _event_loop_option(run)

    health = commands.add_parser(
        "health",
        help="check the health file of an `anarchon run` (exit 0 healthy, 1 not)",
        description="Exits 0 if PATH was written by a running scheduler within --max-age "
        "seconds (and, with --ready, its server answers), else prints why and exits 1.",
    )
    health.add_argument("path", metavar="PATH")
    health.add_argument(
        "--max-age",
        type=_positive(float),
        default=30.0,
        metavar="SECONDS",
        help="the file must have been written within this many seconds (default: 30)",
    )
    health.add_argument("--ready", action="store_true", help="also require a server that answers")
    completion = commands.add_parser(
        "completion",
        help='print a shell completion script: eval "$(anarchon completion bash)"',
        description="Prints a completion script for bash or zsh, made from this command "
        'line\'s own commands and options. Add eval "$(anarchon completion bash)" to '
        "~/.bashrc (zsh: to ~/.zshrc, with zsh).",
    )
    completion.add_argument("shell", choices=("bash", "zsh"))
    acl = commands.add_parser(
        "acl",
        help="print the least ACL a user of a prefix needs (ACL SETUSER ...)",
        description="Prints an ACL SETUSER line for a user of the prefix: its keys, its "
        "hint channel and the commands anarchon sends (its scripts' included), for every "
        "strategy, timers, the registry, inspect and the dashboard's actions. Give the "
        "password where it says >PASSWORD.",
    )
    add_prefix_option(acl)
    acl.add_argument("--user", default="anarchon", help="the user's name (default: anarchon)")
    acl.add_argument(
        "--idmp", action="store_true", help="also what the idmp strategy needs (Redis 8.6+)"
    )
    acl.add_argument(
        "--no-setinfo",
        action="store_true",
        help="leave out CLIENT SETINFO, which Redis 7.0 refuses in a rule (its clients "
        "send it and carry on when it is refused)",
    )


def _event_loop_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--event-loop",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="the event loop to run under (default: asyncio; trio needs trio installed)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 done, 1 a failure at run time (said in one line), 2 a usage error;
    130 after Ctrl-C."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from .._errors import AnarchonError, ConnectionFailedError, ServerReplyError
    from ..clients import refused_certificate

    try:
        if args.command == "demo":
            logging.basicConfig(
                level=logging.INFO if args.verbose else logging.WARNING,
                format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            )
            from .._ops.demo import run_demo

            summary = run_demo(
                redis_url=args.redis,
                seconds=args.seconds,
                instances=args.instances,
                jobs=args.jobs,
                event_loop=args.event_loop,
                verbose=args.verbose,
            )
            return 0 if summary.duplicates == 0 and summary.misses == 0 else 1
        if args.command == "run":
            return _run(args)
        if args.command == "health":
            return _health(args)
        if args.command in STORE_COMMANDS:
            return run_store_command(args)
        if args.command == "check-schedule":
            return run_check_schedule(args)
        if args.command == "web":
            return run_web(args)
        if args.command == "dev-server":
            return run_dev_server(args)
        if args.command == "acl":
            from .._store.acl import acl_rules
            from .._store.backend import RedisBackend

            prefix = RedisBackend(prefix=args.prefix).prefix  # refused if it cannot be one
            print(
                " ".join(
                    [
                        "ACL SETUSER",
                        args.user,
                        "on",
                        ">PASSWORD",
                        *acl_rules(prefix, idmp=args.idmp, setinfo=not args.no_setinfo),
                    ]
                )
            )
            return 0
        if args.command == "completion":
            from .completion import completion_script

            print(completion_script(args.shell, parser), end="")
            return 0
    except UsageError as exc:
        print(f"anarchon {args.command}: {visible(exc)}", file=sys.stderr)
        return 2
    except MissingExtra as exc:
        print(f"anarchon {args.command}: {visible(exc)}", file=sys.stderr)
        return 1
    except AnarchonError as exc:
        hint = ""
        if isinstance(exc, ConnectionFailedError):
            hint = " (start the server, or give its URL with --redis)"
            if refused_certificate(exc):
                hint = ""  # the message says what TLS wants: waiting would not help
            elif args.command == "run":
                hint = " (start the server, or wait longer with --wait-for-server)"
        elif isinstance(exc, ServerReplyError):
            hint = (
                " (the server refused a command: check the --prefix: its keys are anarchon's "
                "alone; check the server's state and the user's permissions)"
            )
        # An error may quote stored text (a name, a value): shown as text, escaped.
        print(f"anarchon: {visible(exc)}{hint}", file=sys.stderr)
        return 1
    except BaseException as exc:
        if _only_interrupts(exc):
            return 130
        raise
    return 2


def _only_interrupts(exc: BaseException) -> bool:
    """Ctrl-C: a KeyboardInterrupt, or (under trio) a group of nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_interrupts(inner) for inner in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt)


def _load_target(target: str) -> Any:
    """``MODULE:ATTRIBUTE`` imported from the current directory (then sys.path)."""
    module_name, colon, attribute = target.partition(":")
    if not colon or not module_name or not attribute:
        raise UsageError(
            f"{target!r} is not MODULE:ATTRIBUTE; name the module and the scheduler in it, "
            "such as app:scheduler"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise  # the module exists, and something it imports does not
        raise UsageError(
            f"no module named {exc.name!r}; run from the directory that holds it, or add "
            "that directory to PYTHONPATH"
        ) from None
    found: Any = module
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise UsageError(
                f"module {module_name!r} has no attribute {attribute!r}; name the Scheduler "
                "(or a function that returns one) after the colon"
            ) from None
    return found


def _run(args: argparse.Namespace) -> int:
    from .._observe.logs import configure_logging
    from .._ops.serve import serve
    from .._scheduler import Scheduler

    configure_logging(args.log_level, args.log_format)
    target = _load_target(args.target)

    async def run() -> None:
        scheduler = target
        if not isinstance(scheduler, Scheduler) and callable(scheduler):
            scheduler = scheduler()
            if inspect.isawaitable(scheduler):
                scheduler = await scheduler
        if not isinstance(scheduler, Scheduler):
            raise UsageError(
                f"{args.target} is an object of type {type(scheduler).__name__}, not a "
                "Scheduler or a function that returns one"
            )
        if args.instance_id is not None:
            scheduler.instance_id = args.instance_id
        async with AsyncExitStack() as stack:
            if args.metrics_port is not None:
                # Bound before the start: a port that is taken fails before anything runs.
                stack.enter_context(
                    _metrics_served(scheduler, args.metrics_host, args.metrics_port)
                )
            await serve(
                scheduler,
                wait_for_server_sec=args.wait_for_server,
                health_file=args.health_file,
                health_port=args.health_port,
                health_host=args.health_host,
            )

    try:
        anyio.run(run, backend=args.event_loop)
    except BaseExceptionGroup as group:
        # trio may hand an error out of the run in a group of one.
        if len(group.exceptions) == 1 and isinstance(group.exceptions[0], Exception):
            raise group.exceptions[0] from None
        raise
    return 0


@contextmanager
def _metrics_served(scheduler: Any, host: str, port: int) -> Iterator[None]:
    """The scheduler's Prometheus metrics on ``host:port`` (``GET /metrics``), until the
    block ends."""
    try:
        from prometheus_client import start_http_server

        from ..prometheus import instrument
    except ModuleNotFoundError:
        raise MissingExtra(
            "--metrics-port needs prometheus_client: pip install 'anarchon[prometheus]'"
        ) from None
    instrument(scheduler)
    try:
        server, thread = start_http_server(port, addr=host)
    except OSError as exc:
        raise InvalidOptionError(
            f"cannot serve metrics on {host}:{port} ({exc}): choose a free port"
        ) from exc
    logging.getLogger("anarchon").info("metrics on http://%s:%s/metrics", host, port)
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _health(args: argparse.Namespace) -> int:
    from .._ops.serve import check_health_file

    problem = check_health_file(Path(args.path), max_age_sec=args.max_age, ready=args.ready)
    if problem is not None:
        print(f"anarchon health: {visible(problem)}", file=sys.stderr)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
