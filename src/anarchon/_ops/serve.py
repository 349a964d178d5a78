"""Running a scheduler as a service: ``serve`` starts it (waiting for the server while it
does not answer), stops it gracefully on SIGINT or SIGTERM (at once on a second one),
and keeps a health file or a health port up to date for an orchestrator's probes.
``anarchon run`` is this, for a scheduler named on the command line."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import signal
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack, suppress
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import SocketStream, TaskGroup

from .._engine.instance import Instance
from .._errors import ConnectionFailedError, InvalidOptionError
from .._scheduler import Scheduler
from ..clients import refused_certificate

__all__ = ["health_of", "serve"]

log = logging.getLogger("anarchon")

#: The signals that stop a served scheduler, unless told otherwise.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: How long ``serve`` waits for the server at start, unless told otherwise.
WAIT_FOR_SERVER_SEC = 60.0
#: The longest pause between two tries to reach the server at start.
_MOST_BETWEEN_TRIES_SEC = 5.0


def health_of(scheduler: Scheduler[Any]) -> dict[str, Any]:
    """What a health probe reports: ``live`` while the scheduler runs, ``ready`` while it
    runs and its server answers, and what it runs."""
    instance = Instance.of(scheduler)
    down_since = instance.server_down_since
    live = scheduler.state == "running"
    return {
        "live": live,
        "ready": live and down_since is None,
        "state": scheduler.state,
        "instance": scheduler.instance_id,
        "pid": os.getpid(),
        "server": "answers" if down_since is None else "does not answer",
        "server_silent_sec": None
        if down_since is None
        else round(time.monotonic() - down_since, 1),
        "jobs": scheduler.jobs,
        "disabled_jobs": sorted(instance.disabled),
        "timer_kinds": scheduler.timer_kinds,
        "running": scheduler.running,
        "at_ms": int(time.time() * 1000),
    }


async def serve(
    scheduler: Scheduler[Any],
    *,
    wait_for_server_sec: float = WAIT_FOR_SERVER_SEC,
    stop_signals: Sequence[signal.Signals] = STOP_SIGNALS,
    health_file: str | os.PathLike[str] | None = None,
    health_port: int | None = None,
    health_host: str = "127.0.0.1",
) -> None:
    """Run ``scheduler`` until it is stopped: by one of ``stop_signals`` (SIGINT and
    SIGTERM), by its own ``stop()``, or by cancelling this call.

    - The first signal stops it gracefully (running handlers get the scheduler's
      ``stop_grace_ms``, then are cancelled and their leases given back, so that a
      backup takes over at once); a second one stops it at once (handlers are
      cancelled and their leases given back now). Handlers that are plain functions
      run in worker threads, which cannot be interrupted: they see ``run.lease_lost``
      set, and are waited for.
    - At start, while the server does not answer (``ConnectionFailedError``), it tries
      again with a backoff (up to 5 s between tries) for ``wait_for_server_sec``, then
      raises. 0 fails at once. Any other error at start (a store of another format, an
      unsupported server) raises at once.
    - The health file, if asked for, is rewritten every few seconds while it runs and
      removed when it stops; ``anarchon health FILE`` checks it.
    - The health port, if asked for, answers ``GET /live`` with 200 while the scheduler
      runs (and while it waits for its server at start), ``GET /ready`` with 200 while
      it runs and its server answers, 503 otherwise, each with a JSON body of
      ``live``, ``ready``, ``state`` and ``server`` (what the fleet runs is in the
      health file, not on the port).

    Call it from the main thread when it handles signals (``stop_signals=()`` handles
    none)::

        anyio.run(anarchon.serve, scheduler)

    Args:
        scheduler: The scheduler to run (``serve`` starts it).
        wait_for_server_sec: How long to keep trying to reach the server at start, in
            seconds (0 or more; default 60; 0: fail at once).
        stop_signals: The signals that stop it: the first gracefully, a second at once
            (default SIGINT and SIGTERM; ``()``: none, for a call outside the main
            thread).
        health_file: A path to keep a JSON file of the scheduler's health at: ``live``,
            ``ready``, its state, its instance id, pid, jobs, timer kinds and running
            handlers. None: no file.
        health_port: A TCP port to answer health probes on (``/live``, ``/ready``).
            None: no port.
        health_host: The address the health port listens on (default ``"127.0.0.1"``:
            this machine only; an orchestrator that probes the pod's address, as
            Kubernetes' ``httpGet`` does, needs ``"0.0.0.0"``).

    Raises:
        ConnectionFailedError: The server did not answer within
            ``wait_for_server_sec``.
        InvalidOptionError: ``scheduler`` is not a ``Scheduler``,
            ``wait_for_server_sec`` is negative, or the health port cannot be bound.
    """
    if not isinstance(scheduler, Scheduler):
        raise InvalidOptionError(f"serve() runs a Scheduler, got {type(scheduler).__name__}")
    if not isinstance(wait_for_server_sec, int | float) or not wait_for_server_sec >= 0:
        raise InvalidOptionError(
            f"wait_for_server_sec must be 0 or more seconds, got {wait_for_server_sec!r}"
        )
    stop = _StopRequests(scheduler)
    failure: BaseException | None = None
    async with anyio.create_task_group() as outer:
        if stop_signals:
            await outer.start(stop.watch_signals, tuple(stop_signals))
        try:
            await _serve_started(
                scheduler,
                stop,
                outer,
                wait_for_server_sec,
                health_file,
                health_port,
                health_host,
            )
        except Exception as exc:
            # Raised as itself below, not inside this task group's exception group.
            failure = exc
        outer.cancel_scope.cancel()
    while isinstance(failure, ExceptionGroup) and len(failure.exceptions) == 1:
        failure = failure.exceptions[0]
    if failure is not None:
        raise failure


async def _serve_started(
    scheduler: Scheduler[Any],
    stop: _StopRequests,
    outer: TaskGroup,
    wait_for_server_sec: float,
    health_file: str | os.PathLike[str] | None,
    health_port: int | None,
    health_host: str,
) -> None:
    listener = None
    if health_port is not None:
        # Bound before the start: a port that is taken fails before anything runs.
        try:
            listener = await anyio.create_tcp_listener(
                local_host=health_host, local_port=health_port
            )
        except OSError as exc:
            raise InvalidOptionError(
                f"cannot answer health probes on {health_host}:{health_port} ({exc}): choose "
                "a free port"
            ) from exc
    async with AsyncExitStack() as stack, anyio.create_task_group() as port:
        if listener is not None:
            # Answered from now on: while it waits for the server, too.
            await stack.enter_async_context(listener)
            where = f"{health_host}:{health_port}"
            port.start_soon(_serve_health_port, scheduler, listener, where)
        started = await _start_waiting_for_server(scheduler, wait_for_server_sec, stop.asked)
        if started is not None:  # else a signal came while it waited
            # Leaving it stops the scheduler (shielded: the stop completes, whatever ended
            # this call) and exits its task group.
            async with started:
                await _serve_running(scheduler, stop, outer, health_file)
        port.cancel_scope.cancel()


async def _serve_running(
    scheduler: Scheduler[Any],
    stop: _StopRequests,
    outer: TaskGroup,
    health_file: str | os.PathLike[str] | None,
) -> None:
    stop.group = outer
    if stop.asked.is_set():  # a signal came while it started
        outer.start_soon(scheduler.stop, 0 if stop.at_once else None)
    async with anyio.create_task_group() as probes:
        if health_file is not None:
            probes.start_soon(_keep_health_file, scheduler, Path(health_file))
        await scheduler.wait_stopped()
        probes.cancel_scope.cancel()


class _StopRequests:
    """The signals a served scheduler heard, and what each one does."""

    def __init__(self, scheduler: Scheduler[Any]) -> None:
        self.scheduler = scheduler
        #: Set by the first signal (it ends a wait for the server at start).
        self.asked = anyio.Event()
        #: A second signal came: the stop has no grace period.
        self.at_once = False
        #: Where stops are started, once the scheduler runs.
        self.group: TaskGroup | None = None

    async def watch_signals(
        self,
        signals: tuple[signal.Signals, ...],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        with anyio.open_signal_receiver(*signals) as received:
            task_status.started()
            heard = 0
            async for signum in received:
                heard += 1
                self.heard(signal.Signals(signum).name, heard)

    def heard(self, name: str, heard: int) -> None:
        scheduler = self.scheduler
        if heard == 1:
            self.asked.set()
            if self.group is None:
                log.info("%s: stopping as soon as the scheduler has started or given up", name)
                return
            log.info(
                "%s: stopping; running handlers have %.1f s to finish (send it again to stop "
                "at once)",
                name,
                scheduler.stop_grace_ms / 1000,
            )
            self.group.start_soon(scheduler.stop)
        elif heard == 2:
            self.at_once = True
            log.warning(
                "%s again: stopping at once (running handlers are cancelled and their "
                "leases given back)",
                name,
            )
            if self.group is not None:
                self.group.start_soon(scheduler.stop, 0)
        else:
            log.warning(
                "%s: still stopping, waiting for %d handler(s); a handler that is a plain "
                "function cannot be interrupted (it sees run.lease_lost set)",
                name,
                scheduler.running,
            )


async def _start_waiting_for_server(
    scheduler: Scheduler[Any], wait_sec: float, stop: anyio.Event
) -> AsyncExitStack | None:
    """Start ``scheduler``; while the server does not answer, try again with a backoff
    for ``wait_sec`` seconds, saying once what it waits for. Started, it returns an exit
    stack that holds the scheduler's exit; ``stop`` ends the wait (the scheduler stays
    new, and it returns None). Each try is bounded by the scheduler's round-trip
    deadlines; no cancel scope may wrap one, since a start enters the scheduler's task
    group."""
    began = time.monotonic()
    pause_sec = 0.5
    tries = 0
    while True:
        tries += 1
        # The scheduler is entered in an exit stack that hands its exit on to the caller
        # only at the end: should anything fail before, the scheduler is left here.
        async with AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(scheduler)
            except ConnectionFailedError as exc:
                waited = time.monotonic() - began
                if refused_certificate(exc):
                    raise  # waiting cannot make the server's certificate one to trust
                if waited >= wait_sec:
                    if tries > 1:
                        raise ConnectionFailedError(
                            f"{_without_code(exc)}; waited {waited:.0f} s for it"
                        ) from exc
                    raise
                if tries == 1:
                    log.warning(
                        "waiting for the server: %s; trying again for up to %s s",
                        _without_code(exc),
                        f"{wait_sec:g}",
                    )
                else:
                    log.debug("the server still does not answer: %s", exc)
                with anyio.move_on_after(min(pause_sec, wait_sec - waited)):
                    await stop.wait()
                if stop.is_set():
                    return None
                pause_sec = min(pause_sec * 2, _MOST_BETWEEN_TRIES_SEC)
            else:
                if tries > 1:
                    log.info("the server answers, after %.1f s", time.monotonic() - began)
                return stack.pop_all()  # the scheduler's exit, handed on


def _without_code(exc: ConnectionFailedError) -> str:
    return str(exc.args[0]) if exc.args else str(exc)


def _health_interval_sec(scheduler: Scheduler[Any]) -> float:
    """How often the health file is rewritten: a heartbeat, between 1 s and 5 s."""
    return min(max(scheduler.heartbeat_ms / 1000, 1.0), 5.0)


async def _keep_health_file(scheduler: Scheduler[Any], path: Path) -> None:
    try:
        while True:
            body = json.dumps(health_of(scheduler))
            await anyio.to_thread.run_sync(_replace_file, path, body)
            await anyio.sleep(_health_interval_sec(scheduler))
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.Path(path).unlink(missing_ok=True)


#: How a health file's temporary file is opened: created anew (never a file that is
#: there already, whose mode and owner would stay), never through a symbolic link.
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _replace_file(path: Path, body: str) -> None:
    """Write ``body`` to ``path`` so that a reader sees the old file or the new one; the
    file is the running user's alone (mode 0600: it names the jobs and the instance).

    The body goes to a temporary file of a name no one can guess, beside ``path``, and
    is renamed over it: a rename replaces whatever is at ``path`` (a symbolic link
    planted there too), never a file a link points to. Not synced to disk: a health
    file outlives no crash of the machine that would need it."""
    spare = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    descriptor = os.open(spare, _NEW_FILE, 0o600)
    try:
        with os.fdopen(descriptor, "w") as out:
            out.write(body + "\n")
        os.replace(spare, path)
    except BaseException:
        spare.unlink(missing_ok=True)
        raise


def check_health_file(path: Path, *, max_age_sec: float, ready: bool) -> str | None:
    """None if ``path`` says a scheduler is live (and ``ready``) and was written within
    ``max_age_sec``; otherwise what is wrong, in a line."""
    try:
        health = json.loads(path.read_text())
        written_ms = float(health["at_ms"])
    except FileNotFoundError:
        return f"{path} does not exist: the scheduler is not running (or has not started)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path} is not a health file anarchon wrote ({exc})"
    age_sec = time.time() - written_ms / 1000
    if not math.isfinite(age_sec) or age_sec > max_age_sec:
        return (
            f"{path} was last written {age_sec:.0f} s ago (more than {max_age_sec:g} s): the "
            "process is gone or its event loop is stuck"
        )
    if not health.get("live"):
        return f"the scheduler is {health.get('state')}"
    if ready and not health.get("ready"):
        return f"the server does not answer (for {health.get('server_silent_sec')} s)"
    return None


#: What a probe's answer says: whoever reaches the port learns the state, not what the
#: fleet runs.
_PROBE_FIELDS = ("live", "ready", "state", "server")
#: What the probes say while the process waits for its server at start.
_WAITING = {
    "live": True,
    "ready": False,
    "state": "waiting for the server",
    "server": "does not answer",
}


async def _serve_health_port(
    scheduler: Scheduler[Any],
    listener: anyio.abc.Listener[SocketStream],
    where: str,
) -> None:
    """Answer ``GET /live`` and ``GET /ready``; a failure to accept a connection (out of
    file descriptors) is logged and the port goes on. While the scheduler is new (``serve``
    waits for its server) the process is live and not ready."""
    log.info("health probes on http://%s/live and /ready", where)

    async def answer(stream: SocketStream) -> None:
        async with stream:
            with anyio.move_on_after(5), suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                request = b""
                while b"\r\n\r\n" not in request and len(request) < 8192:
                    request += await stream.receive()
                parts = request.split(b" ", 2)
                path = parts[1].decode("latin-1") if len(parts) > 1 else ""
                new = scheduler.state == "new"
                health = _WAITING if new else health_of(scheduler)
                if path in ("/live", "/ready"):
                    ok = bool(health[path[1:]])
                    status = "200 OK" if ok else "503 Service Unavailable"
                    shown = {key: health[key] for key in _PROBE_FIELDS}
                    body = json.dumps(shown).encode()
                else:
                    status, body = "404 Not Found", b'{"paths": ["/live", "/ready"]}'
                head = (
                    f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                )
                await stream.send(head.encode() + body)

    while True:
        try:
            await listener.serve(answer)
        except OSError as exc:
            log.warning("the health port could not take a connection: %s", exc)
            await anyio.sleep(1)
