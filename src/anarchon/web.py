"""A small dashboard of a store (extra ``anarchon[web]``: Starlette; ``anarchon web``
serves it with uvicorn).

Server-rendered pages over the ``Inspector``: the jobs with their schedule, next fire,
pause flag and last results as a strip of coloured cells; the runs in progress with
their time left; the instances alive; the timers per kind; the recent failures; fire
lateness over time as a small chart. Each job has a page of its own with its history.
The pages refresh themselves. Nothing is loaded from elsewhere: the styles, the script
and the charts (SVG) are in the page.

Pause, resume and run-now are POSTs, refused (403) unless actions are allowed, and then
refused (401) without the token, given as the form's ``token`` field or as
``Authorization: Bearer <token>``. Serve it as an ASGI application of its own::

    from anarchon.web import dashboard
    app = dashboard(RedisBackend(redis="redis://localhost:6379"))

or mount it under a path of yours (its links follow; run its lifespan in yours, so
that its connection is closed at the end)::

    board = dashboard(backend)

    @asynccontextmanager
    async def lifespan(app):
        async with board.router.lifespan_context(board):
            yield

    app = Starlette(routes=[..., Mount("/ops/anarchon", app=board)], lifespan=lifespan)
"""

from __future__ import annotations

import html
import json
import logging
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._errors import AnarchonError, ConnectionFailedError, InvalidJobError, InvalidOptionError
from ._model.text import visible
from ._model.values import (
    AuditEntry,
    InstanceInfo,
    JobInfo,
    LeaseInfo,
    RunResult,
    TimerInfo,
    TimerKindInfo,
)
from ._ops.inspector import (
    Inspector,
    backfill_text,
    definitions_text,
    fleet_text,
    jobs_cut,
    kind_limits_text,
    may_run,
    newest_failures,
    runners,
    running_text,
)
from ._store.audit import who
from ._store.backend import RedisBackend
from ._store.quarantine import Quarantined
from .clients import ServerReplyError

__all__ = ["dashboard"]

log = logging.getLogger("anarchon")

#: Attempts shown in a job's strip of cells, and read for the lateness chart.
STRIP = 30
#: Attempts a job's page lists (and the overview reads, for the recent failures).
HISTORY = 100
#: How many of a job's audit entries its page shows (the newest).
AUDIT_SHOWN = 10
#: A page is made within this many seconds, or it says the server did not answer.
PAGE_SEC = 20.0
#: Jobs on a page of the overview (``?page=N``): what one page reads and draws is
#: bounded, whatever the number of jobs.
JOBS_PER_PAGE = 50
#: Rows of the runs in progress and of the instances alive the overview shows at most.
ROWS_MAX = 100
#: Timer kinds the overview reads and shows at most (the first by name).
KINDS_MAX = 20
#: About how many timers a page of a kind's timers shows (``?cursor=`` goes on).
TIMERS_PER_PAGE = 100
#: Payload text a timer's row shows at most.
PAYLOAD_CHARS = 120
#: Malformed store entries the overview lists at most (the newest).
MALFORMED_MAX = 20
#: Job names an instance's row shows at most.
INSTANCE_JOBS_SHOWN = 10
#: How much of a stored name (a job's, a runner's) and of a stored error text a page
#: shows (the rest is cut, with its length said).
NAME_CHARS = 200
ERROR_CHARS = 2000
#: Dots of a lateness chart at most (the newest).
CHART_POINTS = 500
#: Pages made at the same time at most; more wait their turn (within PAGE_SEC).
BUILDS_MAX = 2
_ACTIONS = {"pause": "paused", "resume": "resumed", "run-now": "asked to run now"}
#: The largest action form read (its token and the page to go back to).
FORM_MAX_BYTES = 8 * 1024
#: The names a dashboard answers to in the Host header unless told others.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
#: On every response: no framing by another site, no guessing of content types, no
#: address of the dashboard's pages sent to another site.
_SECURITY_HEADERS = (
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", b"frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


def dashboard(
    backend: RedisBackend[Any],
    *,
    allow_actions: bool = False,
    token: str | None = None,
    refresh_sec: float = 5.0,
    allowed_hosts: Sequence[str] | None = None,
) -> Starlette:
    """The dashboard of ``backend``'s store as an ASGI application of its own (serve it
    with any ASGI server; its lifespan closes its connection).

    Args:
        backend: The store's backend, with the prefix its schedulers use.
        allow_actions: Offer pause, resume and run-now to whoever gives ``token``
            (default False: the pages only read).
        token: The secret the actions take; required with ``allow_actions``.
        refresh_sec: How often the pages refresh, in seconds (0 or more; default 5;
            0: never).
        allowed_hosts: The only names the pages answer to in the Host header. None:
            the loopback names, so that no other web page can read them through a name
            that points at this machine (DNS rebinding). Served under another name,
            give it (``["ops.example.com"]``); ``["*"]`` answers any name.

    Returns:
        The Starlette application.

    Raises:
        InvalidOptionError: ``backend`` is not a ``RedisBackend``, ``allow_actions``
            without a ``token``, or a ``refresh_sec`` that is negative or not a
            number.
    """
    if not isinstance(backend, RedisBackend):
        raise InvalidOptionError(
            f"the dashboard reads a RedisBackend or ValkeyBackend, got {type(backend).__name__}"
        )
    if allow_actions and not token:
        raise InvalidOptionError("allow_actions needs a token: give token='...'")
    if isinstance(refresh_sec, bool) or not isinstance(refresh_sec, int | float):
        raise InvalidOptionError(f"refresh_sec must be a number of seconds, got {refresh_sec!r}")
    if not math.isfinite(refresh_sec) or refresh_sec < 0:
        raise InvalidOptionError(f"refresh_sec must be 0 (never) or more, got {refresh_sec!r}")
    site = _Site(backend, token if allow_actions else None, refresh_sec)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await site.close()

    hosts = list(LOOPBACK_HOSTS if allowed_hosts is None else allowed_hosts)
    middleware = [
        Middleware(_SecurityHeaders),
        Middleware(TrustedHostMiddleware, allowed_hosts=hosts),
    ]
    return Starlette(
        routes=[
            Route("/", site.overview),
            # Job names may hold slashes.
            Route("/jobs/{job:path}", site.job_page),
            # Kinds' names hold no slash, but the same rule keeps one way.
            Route("/timers/{kind:path}", site.timers_page),
            Route("/actions/{action}/{job:path}", site.act, methods=["POST"]),
        ],
        middleware=middleware,
        lifespan=lifespan,
    )


class _Site:
    """The pages, over one Inspector opened at the first request (and again after the
    server stopped answering)."""

    def __init__(self, backend: RedisBackend[Any], token: str | None, refresh_sec: float):
        self.backend = backend
        self.token = token
        self.refresh_sec = refresh_sec
        self._inspector: Inspector | None = None
        self._opening = anyio.Lock()
        self._builds = anyio.Semaphore(BUILDS_MAX)

    async def close(self, inspector: Inspector | None = None) -> None:
        """Close the Inspector (``inspector``, if it is still the one in use)."""
        async with self._opening:
            if self._inspector is None or inspector not in (None, self._inspector):
                return
            closing, self._inspector = self._inspector, None
        await closing.__aexit__(None, None, None)

    async def _read(
        self, reading: Callable[[Inspector], Awaitable[str]], refused: int = 404
    ) -> tuple[str, int]:
        """A page's body and status: what ``reading`` rendered (200), or what went wrong:
        the server (503: it did not answer, within PAGE_SEC for the whole page), the
        request (``refused``: an unknown job, a refused run), or the store's contents
        (500)."""
        inspector = None
        # One deadline for the page: its wait for a turn counts.
        deadline = anyio.current_time() + PAGE_SEC
        try:
            with anyio.fail_after(PAGE_SEC):
                await self._builds.acquire()
        except TimeoutError:
            text = f"the dashboard is busy: try again in a moment ({BUILDS_MAX} pages at a time)"
            return _message("error", text), 503
        try:
            with anyio.fail_at(deadline):
                async with self._opening:
                    if self._inspector is None:
                        opened = Inspector(self.backend)
                        await opened.__aenter__()
                        self._inspector = opened
                    inspector = self._inspector
                return await reading(inspector), 200
        except (ConnectionFailedError, ServerReplyError, TimeoutError) as exc:
            await self.close(inspector)  # opened again at the next request
            why = str(exc) or f"no answer within {PAGE_SEC:g} s"
            return _message("error", f"the server did not answer as expected: {why}"), 503
        except AnarchonError as exc:
            return _message("error", str(exc)), refused
        except Exception as exc:  # what the store holds could not be read
            log.exception("anarchon web: a page could not be made")
            return _message("error", f"the page could not be made: {exc!r}"), 500
        finally:
            self._builds.release()

    # ------------------------------------------------------------------ pages

    async def overview(self, request: Request) -> Response:
        root = _root(request)

        async def read(inspector: Inspector) -> str:
            names = await inspector.job_names()
            pages = max(math.ceil(len(names) / JOBS_PER_PAGE), 1)
            page = _page_number(request, pages)
            shown = names[(page - 1) * JOBS_PER_PAGE : page * JOBS_PER_PAGE]
            jobs = await inspector.jobs(shown)
            leases = await inspector.leases(names=shown)
            instances = await inspector.instances(ROWS_MAX)
            alive = await inspector.instance_count()
            timers = await inspector.timers(limit=KINDS_MAX)
            kinds = await inspector.timer_kind_count()
            recent = await inspector.recent(STRIP, shown)
            failures = newest_failures(recent, 10)
            malformed = await inspector.quarantined(MALFORMED_MAX)
            fleet = _Fleet(instances, every_read=alive <= len(instances))
            of = f" (jobs {shown[0]} to {shown[-1]})" if pages > 1 and shown else ""
            return "".join(
                [
                    _done(request, shown),
                    _section(
                        "Jobs",
                        _jobs_table(
                            root,
                            shown,
                            jobs,
                            recent,
                            fleet,
                            inspector.malformed_in(malformed, "jobs"),
                            self.token is not None,
                        )
                        + _pager(root, page, pages, len(names)),
                    ),
                    _section(
                        f"Runs in progress{of}",
                        _leases_table(root, leases[:ROWS_MAX])
                        + _more(len(leases) - ROWS_MAX, "runs"),
                    ),
                    _section(
                        "Instances alive",
                        _instances_table(instances) + _more(alive - len(instances), "instances"),
                    ),
                    _section(
                        "Timers",
                        _timers_table(
                            timers, inspector.malformed_in(malformed, "timer kinds"), root
                        )
                        + _more(kinds - KINDS_MAX, "timer kinds"),
                    ),
                    _section(f"Recent failures{of}", _results_table(root, failures, with_job=True)),
                    _section(
                        f"Fire lateness (slot to start){of}",
                        _lateness_chart(r for results in recent.values() for r in results),
                    ),
                    _section(
                        "Malformed store entries",
                        _malformed_table(malformed, inspector.quarantine.count),
                    ),
                ]
            )

        body, status = await self._read(read)
        return self._page(request, "anarchon", body, status)

    async def job_page(self, request: Request) -> Response:
        name, root = request.path_params["job"], _root(request)

        async def read(inspector: Inspector) -> str:
            # Each read by name: the page costs the same at any number of jobs.
            history = await inspector.history(name, HISTORY)
            found = await inspector.jobs([name])
            if not found:  # gone as it was read
                raise InvalidJobError(f"no job named '{visible(name, NAME_CHARS)}' any more")
            (job,) = found
            leases = await inspector.leases(name)
            audit = await inspector.audit(name, AUDIT_SHOWN)
            instances = await inspector.instances(ROWS_MAX)
            fleet = _Fleet(instances, every_read=await inspector.instance_count() <= ROWS_MAX)
            return "".join(
                [
                    _done(request, [name]),
                    _section(f"Job {_shown(name)}", _job_details(job, history[:STRIP], fleet)),
                    _actions(root, job, self.token is not None),
                    _section("Runs in progress", _leases_table(root, leases)),
                    _section("Fire lateness (slot to start)", _lateness_chart(history)),
                    _section("History", _results_table(root, history, with_job=False)),
                    _section("Audit log", _audit_table(audit)),
                ]
            )

        body, status = await self._read(read)
        return self._page(request, f"anarchon · {_shown(name)}", body, status)

    async def timers_page(self, request: Request) -> Response:
        kind, root = request.path_params["kind"], _root(request)
        cursor = request.query_params.get("cursor") or None

        async def read(inspector: Inspector) -> str:
            page = await inspector.timer_page(kind, cursor=cursor, limit=TIMERS_PER_PAGE)
            found = await inspector.timers([kind])
            return "".join(
                [
                    _section(
                        f"Timers of {_shown(kind)}",
                        _timers_table(found, {}, root)
                        + _timer_rows(page.timers)
                        + _next_timers(root, kind, page.cursor),
                    ),
                ]
            )

        body, status = await self._read(read)
        return self._page(request, f"anarchon · timers · {_shown(kind)}", body, status)

    async def act(self, request: Request) -> Response:
        name, action = request.path_params["job"], request.path_params["action"]
        if action not in _ACTIONS:
            return self._page(request, "anarchon", _message("error", f"no action {action!r}"), 404)
        if self.token is None:
            text = (
                "Actions are off: start anarchon web with --allow-actions (and a token) to "
                "pause, resume and run jobs from here."
            )
            return self._page(request, "anarchon", _message("error", text), 403)
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if given and not self._is_token(given):
            # Refused before the body is read: a wrong token costs no upload.
            return self._page(request, "anarchon", _message("error", _WRONG_TOKEN), 401)
        sent = await _capped_body(request)
        if sent is None:
            text = f"An action's form is at most {FORM_MAX_BYTES:,} bytes: nothing was done."
            return self._page(request, "anarchon", _message("error", text), 413)
        form = parse_qs(sent.decode("utf-8", "replace"))
        given = given or form.get("token", [""])[0]
        if not given or not self._is_token(given):
            text = (
                "This action needs the dashboard's token: type it in the token field at the "
                "top of the page (anarchon web printed it at its start)."
                if not given
                else _WRONG_TOKEN
            )
            return self._page(request, "anarchon", _message("error", text), 401)

        async def operate(inspector: Inspector) -> str:
            by = f"dashboard ({who()})"  # who is behind the token, the page cannot know
            if action == "pause":
                await inspector.pause(name, by=by)
            elif action == "resume":
                await inspector.resume(name, by=by)
            else:
                await inspector.run_now(name, by=by)
            log.info("anarchon web: job %s %s", name, _ACTIONS[action])
            return ""

        body, status = await self._read(operate, refused=409)
        if status != 200:
            return self._page(request, "anarchon", body, status)
        back = form.get("next", ["/"])[0]  # a page of the dashboard: its path within it
        if not back.startswith("/") or back[1:2] in ("/", "\\"):
            back = "/"
        done = urlencode({"done": action, "job": name})
        return RedirectResponse(f"{_root(request)}{back}?{done}", 303)

    def _is_token(self, given: str) -> bool:
        assert self.token is not None
        return secrets.compare_digest(given.encode(), self.token.encode())

    def _page(self, request: Request, title: str, body: str, status: int) -> HTMLResponse:
        token = (
            '<label class="token">token <input id="token" type="password" '
            'autocomplete="off" placeholder="needed for actions"></label>'
            if self.token is not None
            else ""
        )
        where = html.escape(f"{self.backend.where()} · prefix {self.backend.prefix}")
        home = _root(request) + "/"
        return HTMLResponse(
            f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{_STYLE}</style></head>
<body data-refresh-ms="{int(self.refresh_sec * 1000)}">
<header><a class="home" href="{home}">anarchon</a><span class="where">{where}</span>
<span id="updated">read {_clock(datetime.now(UTC))}</span>{token}</header>
<main id="main">{body}</main>
<script>{_SCRIPT}</script>
</body></html>""",
            status,
            headers={"cache-control": "no-store"},  # each page is the store as it is now
        )


# ------------------------------------------------------------------------ parts


def _root(request: Request) -> str:
    """Where the dashboard is, in front of its own paths in its links: "" at the root
    of its host, else the path it is mounted at (Starlette's ``Mount``) or served under
    (a proxy's path, given as the ASGI server's root path), quoted as a URL's path (so
    that no character of it can end the path, or make it a link to another host)."""
    return quote(str(request.scope.get("root_path", "")).rstrip("/"))


def _page_number(request: Request, pages: int) -> int:
    """The overview's page asked for (``?page=N``, N in ASCII digits: ``str.isdigit``
    also takes '²', which ``int`` refuses), within 1 to ``pages``."""
    asked = request.query_params.get("page", "1")
    number = int(asked) if _PAGE.fullmatch(asked) else 1
    return min(max(number, 1), pages)


_PAGE = re.compile(r"[0-9]{1,9}")


def _pager(root: str, page: int, pages: int, count: int) -> str:
    """Where this page of jobs is among them, and links to its neighbours."""
    if pages <= 1:
        return ""
    first = (page - 1) * JOBS_PER_PAGE + 1
    last = min(page * JOBS_PER_PAGE, count)
    links = [f"jobs {first:,} to {last:,} of {count:,}"]
    if page > 1:
        links.append(f'<a href="{root}/?page={page - 1}">previous</a>')
    if page < pages:
        links.append(f'<a href="{root}/?page={page + 1}">next</a>')
    return f'<p class="pager">{" · ".join(links)}</p>'


def _more(hidden: int, what: str) -> str:
    return f'<p class="empty">and {hidden:,} more {what}</p>' if hidden > 0 else ""


def _section(title: str, content: str) -> str:
    return f"<section><h2>{html.escape(title)}</h2>{content}</section>"


def _message(kind: str, text: str) -> str:
    return f'<p class="message {kind}" role="alert">{html.escape(text)}</p>'


_WRONG_TOKEN = "The token is not the dashboard's: nothing was done."


def _done(request: Request, jobs: Iterable[str]) -> str:
    """The notice after an action: from the fixed list of actions, about a job the store
    knows; nothing for any other text a link may carry."""
    action = request.query_params.get("done", "")
    job = request.query_params.get("job", "")
    if action not in _ACTIONS or job not in set(jobs):
        return ""
    return _message("done", f"Done: {_shown(job)} {_ACTIONS[action]}.")


def _shown(text: object, limit: int | None = NAME_CHARS) -> str:
    """Stored text as a page shows it (before HTML's escaping): its control, zero-width
    and bidi characters made visible (two names that differ by one look different), cut
    to ``limit`` characters."""
    return visible(text, limit)


def _esc(text: object, limit: int | None = NAME_CHARS) -> str:
    """Stored text in a page: ``_shown``, HTML-escaped."""
    return html.escape(_shown(text, limit))


def _segment(name: str) -> str | None:
    """A job's name as one segment of a URL's path (every ``/`` escaped too, so that
    ``../run-now/billing`` stays one segment); None for ``.`` and ``..``, which a browser
    reads as a path's steps however they are escaped: such a job has no links."""
    if name in (".", ".."):
        return None
    return quote(name, safe="")


async def _capped_body(request: Request) -> bytes | None:
    """The request's body, or None when it is longer than ``FORM_MAX_BYTES`` (said by
    its Content-Length, or found while reading it)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > FORM_MAX_BYTES:
        return None
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > FORM_MAX_BYTES:
            return None
    return body


class _SecurityHeaders:
    """Adds ``_SECURITY_HEADERS`` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


def _table(head: Iterable[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f'<p class="empty">{html.escape(empty)}</p>'
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


class _Fleet:
    """The instances alive as a page read them: who runs a job, and whether that is
    known (every instance's job list read whole) or only that it may be."""

    def __init__(self, instances: list[InstanceInfo], *, every_read: bool) -> None:
        self.instances = instances
        self.every_read = every_read

    def runners(self, job: str) -> list[str]:
        return runners(job, self.instances)

    def unrun(self, job: str) -> bool:
        """No instance alive runs ``job`` (said only when every registration was read)."""
        return self.every_read and not may_run(job, self.instances)


def _jobs_table(
    root: str,
    names: list[str],
    jobs: list[JobInfo],
    recent: dict[str, list[RunResult]],
    fleet: _Fleet,
    malformed: dict[str, Quarantined],
    actions: bool,
) -> str:
    """The jobs of ``names``: those read (``jobs``), and a row that says so for each whose
    stored definition is malformed."""
    read = {job.name: job for job in jobs}
    rows = []
    for name in names:
        job = read.get(name)
        if job is None:
            entry = malformed.get(_shown(name, None))
            if entry is not None:
                why = f"its stored definition is malformed: {entry.problem}"
                rows.append([_esc(name), f'<span class="badge unrun">malformed</span> {_esc(why)}'])
            continue
        paused = '<span class="badge paused">paused</span>' if job.paused else ""
        row = [
            _job_link(root, job.name),
            _schedule(job),
            _esc(job.timezone),
            _when(job.next_fire),
            paused + (_UNRUN if fleet.unrun(job.name) else ""),
            _strip(recent.get(job.name, [])),
        ]
        if actions:
            row.append(_buttons(root, job, "/"))
        rows.append(row)
    head = ["job", "schedule", "zone", "next fire", "", "last attempts (newest right)"]
    return _table([*head, "actions"] if actions else head, rows, "No job registered yet.")


def _strip(results: list[RunResult]) -> str:
    cells = []
    for r in reversed(results[:STRIP]):
        title = f"{_clock(r.slot)} attempt {r.attempt} {r.status} on {_shown(r.runner)}"
        if r.error:
            title += f": {_shown(r.error, ERROR_CHARS)}"
        cells.append(
            f'<span class="cell {html.escape(r.status)}" title="{html.escape(title)}"></span>'
        )
    return f'<span class="strip">{"".join(cells)}</span>' if cells else "-"


def _kind_link(root: str, kind: str) -> str:
    segment = _segment(kind)
    if segment is None:
        return _esc(kind)
    return f'<a href="{root}/timers/{segment}">{_esc(kind)}</a>'


def _timer_rows(timers: Iterable[TimerInfo]) -> str:
    """A page of a kind's timers, soonest due first (within the page)."""
    rows = [
        [
            _esc(t.key),
            _when(t.due),
            html.escape(t.status),
            str(t.attempt),
            _esc(t.recurs or "-"),
            _esc(_payload_text(t.payload), PAYLOAD_CHARS),
        ]
        for t in sorted(timers, key=lambda t: (t.due_ms is None, t.due_ms or 0, t.key))
    ]
    head = ["key", "next due", "status", "attempt", "recurs", "payload"]
    return _table(head, rows, "No timer on this page.")


def _payload_text(payload: object) -> str:
    if payload is None:
        return "-"
    if isinstance(payload, bytes):
        return f"bytes({len(payload)})"
    return json.dumps(payload, ensure_ascii=False)


def _next_timers(root: str, kind: str, cursor: str | None) -> str:
    """The link to the next page of a kind's timers (none after the last)."""
    segment = _segment(kind)
    if cursor is None or segment is None:
        return ""
    href = f"{root}/timers/{segment}?cursor={quote(cursor, safe='')}"
    return f'<p class="pager"><a href="{href}">next page</a></p>'


def _job_link(root: str, name: str) -> str:
    segment = _segment(name)
    if segment is None:
        return _esc(name)
    return f'<a href="{root}/jobs/{segment}">{_esc(name)}</a>'


def _buttons(root: str, job: JobInfo, back: str) -> str:
    """Its actions' forms; ``back``: the page they lead back to, within the dashboard."""
    segment = _segment(job.name)
    if segment is None:
        return "-"
    forms = []
    where = f"{root}/actions"
    for action in ("resume" if job.paused else "pause", "run-now"):
        forms.append(
            f'<form class="action" method="post" action="{where}/{action}/{segment}">'
            f'<input type="hidden" name="token"><input type="hidden" name="next" '
            f'value="{html.escape(back)}"><button type="submit" '
            f'data-job="{html.escape(job.name)}" data-action="{action}">{action}</button></form>'
        )
    return f'<span class="actions">{"".join(forms)}</span>'


def _audit_table(entries: list[AuditEntry]) -> str:
    """A job's newest audit entries: when, what, who and why, each stored text escaped."""
    if not entries:
        return "<p>Nothing yet: pauses, resumes and runs asked for now are listed here.</p>"
    rows = "".join(
        f"<tr><td>{_when(e.at)}</td><td>{_esc(e.action)}</td><td>{_esc(e.by)}</td>"
        f"<td>{_esc(e.note or '-', ERROR_CHARS)}</td></tr>"
        for e in entries
    )
    head = "<tr><th>when</th><th>action</th><th>by</th><th>note</th></tr>"
    return f"<table>{head}{rows}</table>"


def _actions(root: str, job: JobInfo, actions: bool) -> str:
    segment = _segment(job.name)
    if not actions or segment is None:
        return ""
    return f'<div class="bar">{_buttons(root, job, f"/jobs/{segment}")}</div>'


_UNRUN = (
    '<span class="badge unrun" title="No instance alive (registered, and renewing its '
    "registration) runs this job: its slots wait until one does. A job removed from the "
    'code stays listed, with this mark.">no live instance</span>'
)


def _job_details(job: JobInfo, recent: list[RunResult], fleet: _Fleet) -> str:
    options = ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(job.options.items()))
    run_by = fleet.runners(job.name)
    if run_by:
        by = _esc(", ".join(run_by[:INSTANCE_JOBS_SHOWN]), None)
    else:
        by = _UNRUN if fleet.unrun(job.name) else "unknown (an instance's job list was cut)"
    rows = [
        ("schedule", _schedule(job)),
        ("zone", _esc(job.timezone)),
        ("strategy", _esc(job.strategy)),
        ("next fire", _when(job.next_fire)),
        (
            "paused",
            f"yes, by {_esc(job.paused_by or '?')}" if job.paused else "no",
        ),
        ("first seen", _when(job.first_seen)),
        *([("last success", _when(job.last_success))] if job.strategy == "lease" else []),
        *([("finished", _esc(job.finished))] if job.finished else []),
        *(
            [("runs ended", _esc(_runs_text(job)))]
            if job.runs is not None and (job.runs or "max_runs" in job.options)
            else []
        ),
        ("run by", by),
        *([("backfill", _esc(backfill_text(job.backfill), ERROR_CHARS))] if job.backfill else []),
        *(
            [("definitions", _esc(disagreement, ERROR_CHARS))]
            if (disagreement := definitions_text(job))
            else []
        ),
        *(
            [("in the fleet", _esc(fleet_text(job.fleet_running, limit) + " runs at once"))]
            if (limit := job.options.get("max_concurrent_fleet")) and job.fleet_running is not None
            else []
        ),
        ("options", _esc(options, ERROR_CHARS) or "-"),
        ("last attempts", _strip(recent)),
    ]
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="details">{body}</table>'


def _runs_text(job: JobInfo) -> str:
    """A job's runs that ended, against its ``max_runs``: ``3``, ``3 of 10``."""
    bound = job.options.get("max_runs")
    return f"{job.runs} of {bound}" if isinstance(bound, int) else f"{job.runs}"


def _leases_table(root: str, leases: list[LeaseInfo]) -> str:
    rows = [
        [
            _job_link(root, lease.job),
            _clock(lease.slot) + (" manual" if lease.slot_id.startswith("m") else ""),
            html.escape(lease.status),
            str(lease.attempt),
            _esc(lease.runner),
            f"{lease.left_ms / 1000:.1f} s",
            str(lease.fence),
            html.escape(lease.trigger),
        ]
        for lease in leases
    ]
    head = ["job", "slot", "status", "attempt", "runner", "time left", "fence", "trigger"]
    return _table(head, rows, "No run in progress.")


def _names(names: tuple[str, ...], cut: bool = False) -> str:
    """A registered list of names, the first ``INSTANCE_JOBS_SHOWN`` of them."""
    shown = ", ".join(_shown(name) for name in names[:INSTANCE_JOBS_SHOWN]) or "-"
    more = len(names) - INSTANCE_JOBS_SHOWN
    if cut:
        shown += f" and more ({len(names):,} read; its registration was read in part)"
    elif more > 0:
        shown += f" and {more:,} more"
    return html.escape(shown)


def _instances_table(instances: list[InstanceInfo]) -> str:
    rows = [
        [
            _esc(i.id),
            _esc(f"{i.host} pid {i.pid}"),
            _esc(i.version),
            _when(i.started),
            _names(i.jobs, jobs_cut(i)),
            _names(i.timer_kinds),
            _esc(running_text(i)),
        ]
        for i in instances
    ]
    head = [
        "instance",
        "where",
        "version",
        "started",
        "jobs",
        "timer kinds",
        "running of bound (last renewal)",
    ]
    return _table(head, rows, "No instance alive.")


def _timers_table(timers: list[TimerKindInfo], malformed: dict[str, Quarantined], root: str) -> str:
    rows = [
        [
            _kind_link(root, t.kind),
            str(t.pending),
            _when(t.next_due),
            _esc(t.next_key or "-"),
            str(t.buckets),
            _esc(kind_limits_text(t)),
        ]
        for t in timers
    ]
    for kind, entry in sorted(malformed.items()):
        why = f"its registration is malformed (not read): {entry.problem}"
        rows.append([html.escape(kind), f'<span class="badge unrun">malformed</span> {_esc(why)}'])
    head = ["kind", "pending", "next due", "next key", "buckets", "fleet limits"]
    return _table(head, rows, "No timer kind.")


def _malformed_table(entries: list[Quarantined], met_here: int) -> str:
    """The store's malformed entries (met here, and reported by the fleet), as text."""
    rows = [
        [
            html.escape(entry.key),
            html.escape(entry.field or "(the whole value)"),
            html.escape(entry.problem),
            f"<code>{html.escape(entry.excerpt)}</code>",
            "here" if entry.seen_at is None else _when(entry.seen_at),
        ]
        for entry in entries
    ]
    note = (
        f'<p class="empty">This dashboard met {met_here:,} (each logged once). An entry is '
        "left as it is and skipped: it costs itself alone. See the operations guide.</p>"
        if met_here
        else ""
    )
    head = ["key", "field", "what is wrong", "it held", "last met"]
    return _table(head, rows, "None met.") + note


def _results_table(root: str, results: list[RunResult], *, with_job: bool) -> str:
    rows = []
    for r in results:
        took = (r.finished_at - r.started_at).total_seconds()
        row = [
            _clock(r.slot),
            str(r.attempt),
            html.escape(r.trigger),
            _esc(r.runner),
            f'<span class="badge {html.escape(r.status)}">{html.escape(r.status)}</span>',
            _clock(r.started_at),
            "-" if r.status == "skipped" else f"{took:.3f} s",
            f'<span class="error">{_esc(r.error or "", ERROR_CHARS)}</span>',
        ]
        if with_job:
            row.insert(0, _job_link(root, r.job))
        rows.append(row)
    head = ["slot", "attempt", "trigger", "runner", "status", "started", "took", "error"]
    return _table(["job", *head] if with_job else head, rows, "None recorded.")


_PALETTE = ("#2f6fdf", "#d9822b", "#3a9d5d", "#b8407a", "#7a5bc7", "#c0392b", "#16a2a2")


def _lateness_chart(results: Iterable[RunResult]) -> str:
    """Each recorded first attempt of a scheduled slot: when it started, and how long
    after its slot's instant (an SVG scatter, one colour per job; the newest
    ``CHART_POINTS``)."""
    points = sorted(
        (
            (r.job, r.started_at.timestamp(), max((r.started_at - r.slot).total_seconds(), 0.0))
            for r in results
            if r.attempt == 1 and r.trigger in ("schedule", "catch-up") and r.status != "skipped"
        ),
        key=lambda point: point[1],
    )[-CHART_POINTS:]
    if not points:
        return '<p class="empty">No scheduled attempt recorded yet.</p>'
    width, height, left, bottom = 640, 180, 56, 24
    first, last = min(p[1] for p in points), max(p[1] for p in points)
    span = max(last - first, 1.0)
    top = max(max(p[2] for p in points), 0.01)
    jobs = sorted({p[0] for p in points})
    colour = {job: _PALETTE[i % len(_PALETTE)] for i, job in enumerate(jobs)}
    dots = []
    for job, at, late in points:
        x = left + (at - first) / span * (width - left - 8)
        y = height - bottom - late / top * (height - bottom - 8)
        label = html.escape(f"{_shown(job)}: {late * 1000:.0f} ms late at {_clock_epoch(at)}")
        dots.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour[job]}">'
            f"<title>{label}</title></circle>"
        )
    axis = (
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - 8}" y2="{height - bottom}" '
        f'stroke="#999"/><line x1="{left}" y1="8" x2="{left}" y2="{height - bottom}" '
        f'stroke="#999"/>'
        f'<text x="{left - 4}" y="14" text-anchor="end">{_seconds(top)}</text>'
        f'<text x="{left - 4}" y="{height - bottom}" text-anchor="end">0</text>'
        f'<text x="{left}" y="{height - 6}">{_clock_epoch(first)}</text>'
        f'<text x="{width - 8}" y="{height - 6}" text-anchor="end">{_clock_epoch(last)}</text>'
    )
    legend = " ".join(
        f'<span class="key"><span class="dot" style="background:{colour[job]}"></span>'
        f"{_esc(job)}</span>"
        for job in jobs
    )
    return (
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="fire lateness">{axis}{"".join(dots)}</svg>'
        f'<p class="legend">{legend}</p>'
    )


def _schedule(job: JobInfo) -> str:
    if job.cron is not None:
        return f"<code>{_esc(job.cron)}</code>"
    if job.every_ms is not None:
        return f"every {_seconds(job.every_ms / 1000)}"
    return _esc(job.schedule)


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"


def _clock(moment: datetime) -> str:
    return f"{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S}Z"


def _clock_epoch(seconds: float) -> str:
    return f"{datetime.fromtimestamp(seconds, UTC):%H:%M:%S}Z"


def _when(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    seconds = moment.timestamp() - time.time()
    ago = f"in {seconds:.0f} s" if seconds >= 0 else f"{-seconds:.0f} s ago"
    if abs(seconds) >= 3600:
        ago = f"in {seconds / 3600:.1f} h" if seconds >= 0 else f"{-seconds / 3600:.1f} h ago"
    return f'{_clock(moment)} <span class="ago">({ago})</span>'


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{display:flex;gap:1em;align-items:center;padding:.6em 1em;background:#1d2330;color:#eee}
header a.home{color:#fff;font-weight:bold;text-decoration:none;font-size:1.1em}
header .where{color:#aab}#updated{margin-left:auto;color:#aab}
header input{width:12em}
main{padding:0 1em 2em}section{margin-top:1.2em}h2{font-size:1.05em;margin:.4em 0}
table{border-collapse:collapse;background:#fff;box-shadow:0 1px 2px #0002}
th,td{padding:.3em .6em;border-bottom:1px solid #e3e5ea;text-align:left;vertical-align:top}
thead th{background:#eceef2;font-weight:600}table.details th{background:#eceef2}
a{color:#2f5fbf}.ago{color:#778}.empty{color:#778}.error{color:#a12}
.strip{display:inline-flex;gap:2px}.cell{width:9px;height:16px;border-radius:2px;background:#ccc}
.ok{background:#3a9d5d}.failed{background:#d0353f}.interrupted{background:#e08a1e}
.cancelled{background:#8a8f99}.skipped{background:#c5cad3}.running{background:#2f6fdf}
.badge{color:#fff;padding:0 .4em;border-radius:3px}.badge.skipped{color:#333}
.badge.paused{background:#e08a1e}.badge.unrun{background:#d0353f;margin-left:.3em}
.actions{display:inline-flex;gap:.3em}.actions form{margin:0}.bar{margin-top:.8em}
.message{padding:.5em .8em;border-radius:4px;margin-top:1em}
.message.done{background:#dff3e4}.message.error{background:#fbe3e4}
svg.chart{background:#fff;box-shadow:0 1px 2px #0002}svg.chart text{font-size:11px;fill:#556}
.legend .key{margin-right:1em}.dot{display:inline-block;width:9px;height:9px;border-radius:50%;
margin-right:.3em}
"""

# Refreshes the page's main part in place (the token field keeps what was typed), and
# puts the token into an action's form as it is sent.
_SCRIPT = """
(() => {
  const token = document.getElementById('token');
  if (token) {
    token.value = sessionStorage.getItem('anarchon-token') || '';
    token.addEventListener('input', () => sessionStorage.setItem('anarchon-token', token.value));
  }
  document.addEventListener('submit', (event) => {
    const field = event.target.querySelector('input[name=token]');
    if (field && token) field.value = token.value;
  });
  const every = Number(document.body.dataset.refreshMs);
  const updated = document.getElementById('updated');
  // One refresh at a time, each given up after 30 s; the next one is planned when it
  // ends. A page that is not the dashboard's (a proxy's error) leaves this one as it is.
  async function refresh() {
    const giveUp = new AbortController();
    const timer = setTimeout(() => giveUp.abort(), 30000);
    try {
      // The same page of jobs (?page), without an action's notice (?done).
      const page = new URLSearchParams(location.search).get('page');
      const url = location.pathname + (page ? '?page=' + encodeURIComponent(page) : '');
      const reply = await fetch(url, {cache: 'no-store', signal: giveUp.signal});
      const read = new DOMParser().parseFromString(await reply.text(), 'text/html');
      const main = read.getElementById('main');
      if (main) {
        document.getElementById('main').replaceWith(main);
        updated.textContent = read.getElementById('updated').textContent;
      } else {
        updated.textContent = 'the dashboard answered ' + reply.status + '; trying again';
      }
    } catch (error) {
      updated.textContent = 'the dashboard does not answer (' + error + ')';
    } finally {
      clearTimeout(timer);
      setTimeout(refresh, every);
    }
  }
  if (every > 0) setTimeout(refresh, every);
})();
"""
