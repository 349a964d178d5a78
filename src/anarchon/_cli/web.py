"""``anarchon web``: the dashboard (``anarchon.web``) served by uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import re
import resource
import secrets
import signal
import socket
import sys
import time
from typing import Any

from .._errors import InvalidOptionError
from .store import store_backend, store_options
from .usage import MissingExtra, UsageError

__all__ = ["add_web_command", "run_web"]

log = logging.getLogger("anarchon")

#: What --root-path takes: /a, /a/b, ... (a trailing slash is dropped; no . or .. part).
_ROOT_PATH = re.compile(r"(/(?!\.+(?:/|$))[A-Za-z0-9._~-]+)+/?")
#: What --allowed-host takes: a name (or an IPv4 address), or *. and a name.
_HOST_NAME = re.compile(
    r"(\*\.)?[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
)
#: Connections open at once at most (fewer when the process may open fewer files): past
#: it, the one that has waited longest for its request's headers is closed.
CONNECTIONS_MAX = 100
#: Files the process keeps for itself beside its connections (the server's connection,
#: Python's own, and the connections accepted before the ones past the most are closed).
_FILES_KEPT = 64
#: Connections accepted at a time (and waiting to be): the event loop accepts this many
#: before those past the most can be closed.
_ACCEPTS_AT_ONCE = 16
#: A request's headers (and an action's form) arrive within this many seconds by default.
HEADER_TIMEOUT_SEC = 10.0
#: The longest request head read (bytes): h11's default, said here.
_HEAD_BYTES_MAX = 16 * 1024
#: uvicorn closes a connection idle this long after a response.
_KEEP_ALIVE_SEC = 5


def add_web_command(commands: Any, port: Any) -> None:
    """Add ``anarchon web`` to the ``anarchon`` parser (``port`` parses a port)."""
    web = commands.add_parser(
        "web",
        parents=[store_options()],
        help="serve a dashboard of the store (needs anarchon[web])",
        description="Serves a small dashboard of the store: the jobs (schedule, next fire, "
        "paused, their last attempts), the runs in progress, the instances alive, the timers, "
        "the recent failures and fire lateness over time. It refreshes itself. Bound to "
        "127.0.0.1 unless --host says otherwise. Pause, resume and run-now are offered only "
        "with --allow-actions, to whoever gives the token (--token or $ANARCHON_WEB_TOKEN; "
        "one is made up and printed when neither is given).",
    )
    web.add_argument(
        "--host",
        default="127.0.0.1",
        help="listen on this address (default: 127.0.0.1, this machine only)",
    )
    web.add_argument("--port", type=port, default=8765, help="listen on this port (default: 8765)")
    web.add_argument(
        "--allow-actions",
        action="store_true",
        help="offer pause, resume and run-now, to whoever gives the token",
    )
    web.add_argument(
        "--token",
        default=os.environ.get("ANARCHON_WEB_TOKEN"),
        help="the actions' token (default: $ANARCHON_WEB_TOKEN, else one made up and printed)",
    )
    web.add_argument(
        "--refresh",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="the pages refresh themselves this often (default: 5; 0: never)",
    )
    web.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_SEC,
        metavar="SECONDS",
        help="a request's headers (and an action's form) must arrive within this time, or "
        f"its connection is closed (default: {HEADER_TIMEOUT_SEC:g})",
    )
    web.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="behind a proxy that serves the dashboard under PATH (say /anarchon; letters, "
        "digits and . _ ~ - between the slashes) and passes requests on without it: the "
        "pages' links carry PATH (default: none)",
    )
    web.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name the pages answer to in the Host header (a proxy's, say ops.example.com, "
        "if it passes the name on; *.example.com for its subdomains), besides the loopback "
        "names when bound to loopback; then only these names are answered. May be given more "
        "than once (default: none, the loopback names alone; bound elsewhere, one is needed)",
    )


def run_web(args: argparse.Namespace) -> int:

    try:
        import uvicorn

        from ..web import LOOPBACK_HOSTS, dashboard
    except ModuleNotFoundError:
        raise MissingExtra(
            "the dashboard needs Starlette and uvicorn: pip install 'anarchon[web]'"
        ) from None
    if args.root_path not in ("", "/") and not _ROOT_PATH.fullmatch(args.root_path):
        raise UsageError(
            "--root-path must be a path that starts with /, as in /anarchon or /ops/anarchon, "
            f"of letters, digits and . _ ~ - between the slashes; got {args.root_path!r}"
        )
    root_path = args.root_path.rstrip("/")
    for name in args.allowed_host:
        if not _HOST_NAME.fullmatch(name):
            raise UsageError(
                f"--allowed-host takes a host name as in the Host header, without a port or "
                f"scheme, as in ops.example.com or *.example.com; got {name!r}"
            )
    if not 0 < args.header_timeout <= 3600:
        raise UsageError(
            f"--header-timeout takes seconds, more than 0 and at most 3600; got "
            f"{args.header_timeout:g}"
        )
    token = args.token
    if args.allow_actions and not token:
        token = secrets.token_urlsafe(18)
        print(f"anarchon web: the actions' token is {token}", file=sys.stderr, flush=True)
    # Bound to this machine only: the pages answer only to its loopback names, so that
    # no web page elsewhere can read them through a name that points here.
    # A proxy that passes its own name on needs it named (--allowed-host).
    if not _loopback(args.host) and not args.allowed_host:
        raise UsageError(
            f"bound to {args.host}, the dashboard would answer to any name in the Host "
            "header, including one an attacker points at this machine: give the names it "
            "is reached by with --allowed-host (say --allowed-host ops.example.com)"
        )
    loopback = list(LOOPBACK_HOSTS) if _loopback(args.host) else []
    allowed_hosts = [*loopback, *args.allowed_host]
    try:
        app = dashboard(
            store_backend(args),
            allow_actions=args.allow_actions,
            token=token,
            refresh_sec=args.refresh,
            allowed_hosts=allowed_hosts,
        )
    except InvalidOptionError as exc:
        raise UsageError(str(exc)) from None
    listening = _bound(args.host, args.port)
    host, port = listening.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    behind = f", served as {root_path}/ behind a proxy" if root_path else ""
    print(f"anarchon web: http://{shown}:{port}/ (prefix {args.prefix!r}{behind})", flush=True)
    if not _loopback(args.host):
        print(
            f"anarchon web: listening on {args.host}, not only on this machine: anyone who can "
            "reach it sees the store's jobs and errors",
            file=sys.stderr,
            flush=True,
        )
    connections = _connections_max()
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="on",
        root_path=root_path,
        http=_guarded_protocol(args.header_timeout, connections),
        limit_concurrency=connections + 1,  # the connections are bounded before uvicorn
        backlog=_ACCEPTS_AT_ONCE,
        timeout_keep_alive=_KEEP_ALIVE_SEC,
        h11_max_incomplete_event_size=_HEAD_BYTES_MAX,
    )
    server = uvicorn.Server(config)

    async def serve() -> None:
        asyncio.get_running_loop().set_exception_handler(_said_once)
        await server.serve(sockets=[listening])

    # uvicorn stops on SIGINT and SIGTERM, then raises the signal again once it has
    # stopped, to the handlers here: SIGINT ends as Ctrl-C does (130); SIGTERM, the way
    # services are stopped, ends with 0. Handled here, not left to Python's default: a
    # shell starts a background job with SIGINT ignored, and it must still end with 130.
    heard: set[int] = set()
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {
        signum: signal.signal(signum, lambda signum, _: heard.add(signum)) for signum in stops
    }
    try:
        asyncio.run(serve())
    finally:
        listening.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 130 if signal.SIGINT in heard else 0


def _connections_max() -> int:
    """``CONNECTIONS_MAX``, or fewer when the process may open fewer files (so that an
    accept never fails for want of one)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return CONNECTIONS_MAX
    return max(min(CONNECTIONS_MAX, soft - _FILES_KEPT), 4)


#: What the event loop said about refused connections, and when it was said.
_said: dict[str, float] = {}
#: The same trouble is said again at most this often.
_SAY_AGAIN_SEC = 600.0


def _said_once(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's handler of errors: one that repeats for every connection (out of
    files, connections refused) is logged once in ``_SAY_AGAIN_SEC``, not once each;
    any other as asyncio logs it."""
    message = str(context.get("message", ""))
    if not message.startswith("socket.accept() out of system resource"):
        loop.default_exception_handler(context)
        return
    now = time.monotonic()
    if now - _said.get(message, -_SAY_AGAIN_SEC) >= _SAY_AGAIN_SEC:
        _said[message] = now
        log.warning(
            "anarchon web: a connection could not be accepted (%s); more are waited for "
            "as files free up, and this is said once in %g s",
            context.get("exception") or message,
            _SAY_AGAIN_SEC,
        )


def _guarded_protocol(header_timeout_sec: float, connections_max: int) -> Any:
    """uvicorn's HTTP/1.1 protocol (h11), bounded: a request's headers (and a body it
    announces) must arrive within ``header_timeout_sec`` of the connection's opening or
    of the end of the response before, or the connection is closed (uvicorn itself
    only times out a connection that says nothing after a response); and past
    ``connections_max`` open connections, the one that has waited longest for its
    request is closed (or the new one, when none waits), so that connections that never
    finish their request neither hold the dashboard nor use up the process's files."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    waiting_states = (h11.IDLE, h11.SEND_BODY)
    warned: list[bool] = []

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.waiting_since = time.monotonic()
            self.head_timer: asyncio.TimerHandle | None = None
            if len(self.connections) > connections_max:
                self._make_room()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.waiting_since = time.monotonic()
            self._arm()

        def waiting(self) -> bool:
            """Whether its request's headers (or announced body) have not all come."""
            return not self.transport.is_closing() and self.conn.their_state in waiting_states

        def _arm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            self.head_timer = self.loop.call_later(header_timeout_sec, self._timed_out)

        def _timed_out(self) -> None:
            self.head_timer = None
            if self.waiting():
                self.transport.close()

        def _make_room(self) -> None:
            waiting = [c for c in self.connections if isinstance(c, GuardedH11Protocol)]
            waiting = [c for c in waiting if c is not self and c.waiting()]
            oldest = min(waiting, key=lambda c: c.waiting_since, default=self)
            oldest.transport.close()
            if not warned:
                warned.append(True)
                log.warning(
                    "anarchon web: %d connections are open, the most it keeps; the one "
                    "that waited longest for its request is closed for each new one "
                    "(said once)",
                    connections_max,
                )

    return GuardedH11Protocol


def _bound(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (so that a taken port fails here, in one line)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host, port))
        listening.listen(128)
    except OSError as exc:
        listening.close()
        raise InvalidOptionError(
            f"cannot serve the dashboard on {host}:{port} ({exc}): choose a free port"
        ) from exc
    return listening


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
