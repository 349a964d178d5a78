"""``anarchon web`` as a user runs it (a subprocess, against a fleet of ``anarchon run``
processes on a real server), looked at in a real headless browser: Debian's chromium,
driven by selenium through Debian's chromedriver (nothing is downloaded).

With ``ANARCHON_SCREENSHOTS=DIR`` the browser test saves its screenshots of the pages
there (``docs/img`` holds the ones the docs show); otherwise in the test's directory."""

from __future__ import annotations

import html
import http.client
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import anyio
import pytest
import redis
from starlette.middleware.trustedhost import TrustedHostMiddleware

from anarchon import Inspector, JobInfo, LeaseInfo, RedisBackend, Scheduler, TimerRun
from anarchon._ops.embedded import free_port
from anarchon._store.keys import RegistryKeys
from anarchon.web import PAGE_SEC
from tests.faults import FaultProxy
from tests.helpers import CommandLog, write_history
from tests.restartable_server import RestartableServer
from tests.servers import ServerSpec
from tests.test_run_command import ROOT, RunCommand, app_env, command_env, commands, wait_for

__all__ = ["commands"]  # a fixture

pytestmark = [pytest.mark.slow, pytest.mark.engine_tier]

TOKEN = "open-sesame-42"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
T = TypeVar("T")


class WebCommand:
    """One ``anarchon web`` process (or uvicorn serving an application of the tests')
    on a free port of 127.0.0.1, its output in a file."""

    def __init__(
        self,
        tmp_path: Path,
        url: str,
        prefix: str,
        *args: str,
        sigint_ignored: bool = False,
        app: str | None = None,
        open_files: int | None = None,
    ) -> None:
        """``anarchon web`` with ``args``; or, with ``app``, uvicorn serving that
        application of the tests' (configured by ``APP_URL``, ``APP_PREFIX`` and
        ``APP_TOKEN``). ``open_files``: the process's limit of open files."""
        self.port = free_port()
        self.output = tmp_path / f"web-{self.port}.log"
        command = [
            sys.executable, "-m", "anarchon", "web", "--redis", url, "--prefix", prefix,
            "--port", str(self.port), *args,
        ]  # fmt: skip
        if app is not None:
            command = [
                sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1",
                "--port", str(self.port), "--log-level", "warning", *args,
            ]  # fmt: skip
        env = command_env({"APP_URL": url, "APP_PREFIX": prefix, "APP_TOKEN": TOKEN})
        env.pop("ANARCHON_WEB_TOKEN", None)

        def in_the_child() -> None:
            if sigint_ignored:
                _ignore_sigint()
            if open_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

        with open(self.output, "w") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                preexec_fn=in_the_child,
            )  # fmt: skip

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_serving(self) -> None:
        def serving() -> bool:
            assert self.process.poll() is None, self.log()
            try:
                self.get("/")
            except OSError:
                return False
            return True

        wait_for(serving, 30, "the dashboard to answer")

    def get(self, path: str) -> tuple[int, str]:
        return self.request(path, None)

    def post(self, path: str, form: str = "", headers: dict[str, str] | None = None) -> int:
        return self.request(path, form.encode(), headers)[0]

    def request(
        self, path: str, data: bytes | None, headers: dict[str, str] | None = None
    ) -> tuple[int, str]:
        request = urllib.request.Request(self.url(path), data=data, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=PAGE_SEC + 10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as refused:
            return refused.code, refused.read().decode()

    def log(self) -> str:
        return self.output.read_text()

    def end(self, signum: int = signal.SIGTERM) -> int:
        """Its exit code after ``signum``: 0 after SIGTERM, 130 after SIGINT (Ctrl-C)."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(
                    f"anarchon web still ran 15 s after signal {signum}:\n{self.log()}"
                ) from None
        return self.process.returncode


def _ignore_sigint() -> None:
    """In the child, before it runs Python: SIGINT ignored, as a shell leaves it for a
    job it starts in the background."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture
def webs() -> Iterator[list[WebCommand]]:
    started: list[WebCommand] = []
    yield started
    for web in started:
        if web.process.poll() is None:
            web.process.kill()
            web.process.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Debian chromium (selenium, chromedriver), or a skip where it is not
    installed; under CI its absence is a failure (``.ci/run`` installs it)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        message = (
            "Debian's chromium and chromium-driver are needed: apt-get install chromium "
            "chromium-driver"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    os.environ["SE_OFFLINE"] = "true"  # selenium never looks for a browser elsewhere
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size=1400,1500", "--disable-gpu"):  # fmt: skip
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def read_store(url: str, prefix: str) -> tuple[dict[str, JobInfo], list[LeaseInfo]]:
    async def read() -> tuple[dict[str, JobInfo], list[LeaseInfo]]:
        async with Inspector(RedisBackend(redis=url, prefix=prefix)) as inspector:
            jobs = {job.name: job for job in await inspector.jobs()}
            return jobs, await inspector.leases()

    return anyio.run(read)


def set_timers(url: str, prefix: str, keys: list[str]) -> None:
    async def set_them() -> None:
        scheduler = Scheduler(RedisBackend(redis=url, prefix=prefix), instance_id="setter")

        @scheduler.timer("remind", max_concurrent_fleet=5, rate_limit=(100, 60_000))
        async def remind(fire: TimerRun) -> None:
            pass

        async with scheduler:
            for key in keys:
                await scheduler.set_timer("remind", key, delay_ms=3_600_000)

    anyio.run(set_them)


def fleet_has_shown_itself(url: str, prefix: str) -> bool:
    """A slow run in progress, a failure of flaky and an ok of report, recorded."""
    jobs, leases = read_store(url, prefix)
    last = {name: job.last.status if job.last else None for name, job in jobs.items()}
    running = any(lease.job == "slow" and lease.status == "running" for lease in leases)
    return running and last.get("flaky") == "failed" and last.get("report") == "ok"


def on_each(browser: Any, xpath: str, do: Callable[[Any], T], *, first: bool = False) -> list[T]:
    """``do`` on each element at ``xpath`` (on the first one only if ``first``). The
    page refreshes itself in place: an element found may be replaced before ``do``
    reaches it, and then all are found again (a loaded machine reads slower than a
    refresh every second)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for _ in range(20):
        try:
            found = browser.find_elements(By.XPATH, xpath)
            return [do(element) for element in (found[:1] if first else found)]
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"{xpath}: replaced by each refresh before it could be read")


#: The rendered text of each element an XPath finds, read inside the page.
_TEXTS_SCRIPT = """
const found = document.evaluate(
  arguments[0], document, null, XPathResult.ORDERED_NODE_SNAPSHOT_TYPE, null);
const out = [];
for (let i = 0; i < found.snapshotLength; i++) {
  // As WebDriver reads an element's text: a table row's cells joined by spaces.
  out.push(found.snapshotItem(i).innerText.replace(/\t/g, " "));
}
return out;
"""


def texts(browser: Any, xpath: str) -> list[str]:
    """The text of each element at ``xpath``, read in one script inside the page: the
    page's refresh (which replaces the elements in place) cannot come between two of
    the reads, however slowly a loaded machine reads them one by one."""
    return [str(text).strip() for text in browser.execute_script(_TEXTS_SCRIPT, xpath)]


def section(title: str) -> str:
    return f"//section[h2={title!r}]"


def screenshot(browser: Any, tmp_path: Path, name: str) -> None:
    where = Path(os.environ.get("ANARCHON_SCREENSHOTS") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    path = where / name
    assert browser.save_screenshot(str(path)), path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_the_dashboard_shows_a_running_fleet_and_pauses_a_job_only_with_its_token(
    server_url: str,
    prefix: str,
    tmp_path: Path,
    commands: list[RunCommand],
    webs: list[WebCommand],
    browser: Any,
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    for name in ("east", "west"):
        commands.append(
            RunCommand(tmp_path, name, app_env(server_url, prefix), target="tests.web_app:make")
        )
    for command in commands:
        command.wait_live()
    set_timers(server_url, prefix, ["user:1", "user:2", "user:3"])
    wait_for(lambda: fleet_has_shown_itself(server_url, prefix), 30, "the fleet's first runs")
    web = WebCommand(
        tmp_path, server_url, prefix, "--allow-actions", "--token", TOKEN, "--refresh", "1"
    )
    webs.append(web)
    web.wait_serving()
    wait = WebDriverWait(browser, 30)

    # The overview: the jobs, the run in progress, the instances, the timers, the
    # failures and the lateness chart, as the store has them.
    _, before = read_store(server_url, prefix)
    browser.get(web.url("/"))
    _, after = read_store(server_url, prefix)
    assert sorted(texts(browser, section("Jobs") + "//tbody/tr/td[1]")) == [
        "flaky", "report", "slow",
    ]  # fmt: skip
    report_cells = on_each(
        browser,
        section("Jobs") + "//tr[td[1]='report']//span[contains(@class, 'cell')]",
        lambda cell: str(cell.get_attribute("class")),
    )
    assert report_cells and "ok" in report_cells[-1]
    shown = [
        row.split(" ")
        for row in texts(browser, section("Runs in progress") + "//tbody/tr")
        if row.startswith("slow ")
    ]
    stored = {(lease.runner, str(lease.fence)) for lease in before + after if lease.job == "slow"}
    # job, slot (date and time), status, attempt, runner, time left (n s), fence, trigger
    assert shown and all((row[5], row[8]) in stored for row in shown), (shown, stored)
    assert sorted(texts(browser, section("Instances alive") + "//tbody/tr/td[1]")) == [
        "east", "west",
    ]  # fmt: skip
    # Each one's handlers at its last renewal, of its bound (the default).
    running = texts(browser, section("Instances alive") + "//tbody/tr/td[last()]")
    assert running and all(re.fullmatch(r"\d+ of 100", cell) for cell in running), running
    assert texts(browser, section("Timers") + "//tbody/tr/td[position() <= 2]") == [
        "remind", "3",
    ]  # fmt: skip
    # Its fleet limits, and what is held of them now.
    assert texts(browser, section("Timers") + "//tbody/tr/td[last()]") == [
        "0 of 5 at once; 0 of 100 started in 60000 ms"
    ]
    failures = texts(browser, section("Recent failures") + "//tbody/tr")
    assert failures and all(
        row.startswith("flaky") and "the payment provider said no" in row for row in failures
    ), failures
    dots = browser.find_elements(
        By.XPATH, section("Fire lateness (slot to start)") + "//*[local-name()='circle']"
    )
    assert dots, "no point in the lateness chart"
    screenshot(browser, tmp_path, "web-overview.png")

    # It refreshes itself in place: the page is not loaded again.
    browser.execute_script("window.stayed = 42")
    read_at = browser.find_element(By.ID, "updated").text
    wait.until(lambda b: b.find_element(By.ID, "updated").text != read_at)
    assert browser.execute_script("return window.stayed") == 42
    assert texts(browser, section("Jobs") + "//tbody/tr/td[1]")

    # A job's page: its definition and its history.
    assert on_each(browser, "//a[text()='slow']", lambda link: link.click(), first=True)
    wait.until(lambda b: texts(b, "//h2") and texts(b, "//h2")[0] == "Job slow")
    assert "*/2 * * * * *" in texts(browser, "//table[@class='details']")[0]
    # Its first run lasts 30 s; the slots that come meanwhile are skipped (every 2 s),
    # and the page, refreshing itself, shows them as they are recorded.
    history = section("History") + "//tbody/tr/td[5]"
    wait.until(lambda b: "skipped" in texts(b, history))
    assert set(texts(browser, history)) <= {"ok", "skipped", "cancelled"}
    screenshot(browser, tmp_path, "web-job.png")

    # Pause without the token, then with a wrong one: refused, nothing paused.
    def pause_report(token: str) -> str:
        browser.get(web.url("/"))
        field = browser.find_element(By.ID, "token")
        field.clear()
        field.send_keys(token)
        pause = "//button[@data-job='report'][@data-action='pause']"
        assert on_each(browser, pause, lambda button: button.click()), "no pause button"
        message = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "p.message"))
        return str(message[0].text)

    assert "needs the dashboard's token" in pause_report("")
    assert "not the dashboard's" in pause_report("guess")
    jobs, _ = read_store(server_url, prefix)
    assert not jobs["report"].paused
    # With the token: paused for the fleet, and the page says so.
    assert pause_report(TOKEN) == "Done: report paused."
    jobs, _ = read_store(server_url, prefix)
    assert jobs["report"].paused and jobs["report"].paused_by
    assert "paused" in texts(browser, section("Jobs") + "//tr[td[1]='report']")[0]
    assert browser.find_elements(By.CSS_SELECTOR, "button[data-job='report'][data-action='resume']")
    assert web.end() == 0, web.log()


def test_actions_are_refused_unless_allowed_and_then_without_the_token(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    """Over plain HTTP: with actions off every POST is 403; with them on, 401 without
    the token or with another, also as a bearer token; a token made up at the start is
    printed once; nothing is paused by a refused POST."""
    read_only = WebCommand(tmp_path, server_url, prefix)
    allowed = WebCommand(tmp_path, server_url, prefix, "--allow-actions", "--token", TOKEN)
    made_up = WebCommand(tmp_path, server_url, prefix, "--allow-actions")
    webs.extend([read_only, allowed, made_up])
    for web in webs:
        web.wait_serving()
    status, page = read_only.get("/")
    assert status == 200 and "No job registered yet." in page and 'id="token"' not in page
    assert read_only.post("/actions/pause/report", f"token={TOKEN}") == 403
    assert allowed.post("/actions/pause/report") == 401
    assert allowed.post("/actions/pause/report", "token=guess") == 401
    assert allowed.post("/actions/pause/report", headers={"Authorization": "Bearer guess"}) == 401
    # The token is right; the job is unknown: refused, in one message.
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    status, page = allowed.request("/actions/pause/report", b"", bearer)
    assert status == 409 and "report" in page, page
    lines = [line for line in made_up.log().splitlines() if "the actions' token is" in line]
    assert len(lines) == 1, made_up.log()
    token = lines[0].rsplit(" ", 1)[1]
    assert made_up.post("/actions/pause/report", f"token={TOKEN}") == 401
    assert made_up.post("/actions/pause/report", f"token={token}") == 409
    # Bound to 127.0.0.1: it answers only to the loopback names.
    assert allowed.request("/", None, {"Host": "dashboard.example"})[0] == 400
    assert read_only.end(signal.SIGINT) == 130, read_only.log()
    for web in (allowed, made_up):
        assert web.end() == 0, web.log()


def test_sigint_ends_it_with_130_also_when_it_started_with_sigint_ignored(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    """A shell starts a job in the background with SIGINT ignored; ``anarchon web``
    still stops on SIGINT, as ``anarchon run`` does, and says so with 130 (Ctrl-C)."""
    web = WebCommand(tmp_path, server_url, prefix, sigint_ignored=True)
    webs.append(web)
    web.wait_serving()
    assert web.end(signal.SIGINT) == 130, web.log()


def test_a_job_whose_name_has_slashes_has_its_page_and_its_actions(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    register_jobs(server_url, prefix, ["reports/daily"])
    web = WebCommand(tmp_path, server_url, prefix, "--allow-actions", "--token", TOKEN)
    webs.append(web)
    web.wait_serving()
    status, page = web.get("/jobs/reports/daily")
    assert status == 200 and "Job reports/daily" in page, page
    assert 'action="/actions/pause/reports%2Fdaily"' in page
    status, page = web.request(
        "/actions/pause/reports%2Fdaily", f"token={TOKEN}&next=/jobs/reports%2Fdaily".encode()
    )
    assert status == 200 and "Done: reports/daily paused." in page, page
    jobs, _ = read_store(server_url, prefix)
    assert jobs["reports/daily"].paused
    assert web.get("/jobs/reports/weekly")[0] == 404
    assert web.end() == 0, web.log()


def test_a_job_that_no_instance_alive_runs_is_marked_so(
    server_url: str,
    prefix: str,
    tmp_path: Path,
    commands: list[RunCommand],
    webs: list[WebCommand],
) -> None:
    """ "retired" was registered by an instance that stopped; "report" runs on a live
    one: the overview and retired's page mark retired (its slots are not run), and
    report's page names the instance that runs it."""
    register_jobs(server_url, prefix, ["retired"])
    commands.append(
        RunCommand(tmp_path, "east", app_env(server_url, prefix), target="tests.web_app:make")
    )
    commands[0].wait_live()
    web = WebCommand(tmp_path, server_url, prefix)
    webs.append(web)
    web.wait_serving()
    status, page = web.get("/")
    assert status == 200, page
    rows = {
        re.sub(r"<[^>]+>", "", row.split("</td>")[0]): row
        for row in re.findall(
            r"<tr><td>(.*?)</tr>", page.split("<h2>Jobs</h2>")[1].split("</table>")[0]
        )
    }
    assert sorted(rows) == ["flaky", "report", "retired", "slow"], rows
    assert "no live instance" in rows["retired"]
    assert all("no live instance" not in rows[name] for name in ("flaky", "report", "slow"))
    status, page = web.get("/jobs/retired")
    assert status == 200 and '<th>run by</th><td><span class="badge unrun"' in page, page
    status, page = web.get("/jobs/report")
    assert status == 200 and "<th>run by</th><td>east</td>" in page, page
    assert web.end() == 0, web.log()


def links(page: str) -> list[str]:
    """Where the page's links and forms lead."""
    return re.findall(r'\s(?:href|action)="([^"]*)"', page)


def test_mounted_under_a_path_its_links_and_actions_stay_under_it(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    """Mounted in an application of the user's (Starlette's ``Mount`` at /ops/anarchon):
    each link and form of its pages leads under the mount, each link there is a page,
    and an action lands back on the page it was asked from, under the mount."""
    register_jobs(server_url, prefix, ["reports/daily", "cleanup"])
    web = WebCommand(tmp_path, server_url, prefix, app="tests.web_mounted:app")
    webs.append(web)
    web.wait_serving()
    status, page = web.get("/ops/anarchon/")
    assert status == 200 and "cleanup" in page, page
    found = links(page)
    assert "/ops/anarchon/jobs/reports%2Fdaily" in found, found
    assert "/ops/anarchon/actions/pause/cleanup" in found, found
    assert all(link.startswith("/ops/anarchon/") for link in found), found
    for link in set(re.findall(r'\shref="([^"]*)"', page)):
        assert web.get(link)[0] == 200, link
    status, page = web.get("/ops/anarchon/jobs/reports/daily")
    assert status == 200 and "Job reports/daily" in page, page
    assert all(link.startswith("/ops/anarchon/") for link in links(page)), links(page)
    status, page = web.request(
        "/ops/anarchon/actions/pause/reports/daily",
        f"token={TOKEN}&next=/jobs/reports/daily".encode(),
    )
    assert status == 200 and "Done: reports/daily paused." in page, page
    assert "Job reports/daily" in page, page
    jobs, _ = read_store(server_url, prefix)
    assert jobs["reports/daily"].paused and not jobs["cleanup"].paused
    assert web.get("/") == (200, "the application's own page")
    # Mounted at a path that holds a part of the request: its links quote that part, so
    # that no request can make them lead to another host ("/\\host" is "//host" to a
    # browser) or end them early.
    status, page = web.get("/teams/%5Celsewhere.example%20x%22/anarchon/")
    assert status == 200, page
    found = links(page)
    assert "/teams/%5Celsewhere.example%20x%22/anarchon/jobs/cleanup" in found, found
    assert all(link.startswith("/teams/%5Celsewhere.example%20x%22/anarchon/") for link in found)
    # uvicorn stops on SIGTERM (its lifespan, and the dashboard's in it, end), then
    # raises the signal again and dies of it.
    assert web.end() == -signal.SIGTERM, web.log()
    assert "Traceback" not in web.log() and "error" not in web.log().lower(), web.log()


def test_behind_a_proxy_that_serves_it_under_a_path_its_links_carry_the_root_path(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    """``--root-path /anarchon``: a proxy passes /anarchon/... on without the path, and
    the pages' links, forms and an action's redirect carry it. ``--allowed-host``: the
    proxy's name, which it passes on in the Host header, is answered too."""
    register_jobs(server_url, prefix, ["cleanup"])
    web = WebCommand(
        tmp_path, server_url, prefix, "--allow-actions", "--token", TOKEN,
        "--root-path", "/anarchon/", "--allowed-host", "ops.example",
    )  # fmt: skip
    webs.append(web)
    web.wait_serving()
    # As the proxy passes /anarchon/ on, with its own name (and no other name is served).
    status, page = web.request("/", None, {"Host": "ops.example"})
    assert status == 200 and "cleanup" in page, page
    assert web.request("/", None, {"Host": "elsewhere.example"})[0] == 400
    found = links(page)
    assert "/anarchon/jobs/cleanup" in found and "/anarchon/" in found, found
    assert all(link.startswith("/anarchon/") for link in found), found
    connection = http.client.HTTPConnection("127.0.0.1", web.port, timeout=PAGE_SEC + 10)
    try:
        connection.request(
            "POST", "/actions/pause/cleanup", f"token={TOKEN}&next=/jobs/cleanup",
            {"Content-Type": "application/x-www-form-urlencoded"},
        )  # fmt: skip
        reply = connection.getresponse()
        assert reply.status == 303, reply.read()
        assert reply.getheader("Location", "").startswith("/anarchon/jobs/cleanup?done=")
    finally:
        connection.close()
    jobs, _ = read_store(server_url, prefix)
    assert jobs["cleanup"].paused
    assert web.end() == 0, web.log()


def test_the_overview_of_many_jobs_over_a_slow_link_is_made_within_its_deadline(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    """150 jobs, and 100 ms each way between the dashboard and the server (a link
    across an ocean): the overview reads the jobs' histories in a few round trips, not
    one a job, so the page is made within its deadline (PAGE_SEC), not a 503."""
    names = [f"job{index:03d}" for index in range(150)]
    register_jobs(server_url, prefix, names)
    with FaultProxy(server_url) as proxy:
        web = WebCommand(tmp_path, proxy.url, prefix)
        webs.append(web)
        web.wait_serving()
        proxy.delay(100)
        status, page = web.get("/")
        assert status == 200, page
        assert all(f">{name}</a>" in page for name in names[:50]), page
        assert "jobs 1 to 50 of 150" in page, page
        status, page = web.get("/?page=3")
        assert status == 200 and all(f">{name}</a>" in page for name in names[100:]), page
    assert web.end() == 0, web.log()


def test_the_overview_reads_and_draws_one_page_of_jobs_whatever_their_number(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    """400 jobs of 40 recorded attempts each: the overview shows 50 of them, with links
    to the other pages; what it reads and draws is bounded by the page, not by the
    jobs (bench/dashboard.py measures it at 10,000 jobs)."""
    names = [f"job{index:03d}" for index in range(400)]
    register_jobs(server_url, prefix, names)
    write_history(server_url, prefix, names, 40)
    web = WebCommand(tmp_path, server_url, prefix)
    webs.append(web)
    web.wait_serving()
    status, page = web.get("/")
    assert status == 200, page
    assert sum(f">{name}</a>" in page for name in names) == 50
    assert "jobs 1 to 50 of 400" in page and '?page=2">next</a>' in page, page
    assert len(page.encode()) < 250_000, len(page.encode())
    status, last = web.get("/?page=999")  # past the end: the last page
    assert status == 200 and ">job399</a>" in last and "jobs 351 to 400 of 400" in last
    assert web.end() == 0, web.log()


BAD_OPTIONS = [
    # Not a path, another host's (//), or characters a link would carry badly.
    *(("--root-path", value, "--root-path must be a path that starts with /")
      for value in ("anarchon", "//elsewhere.example", "/a b", "/ä", "/..")),
    # Not a name as the Host header holds it (a port is not compared there, a scheme is
    # not there), or every name ("*", which would lift the loopback names' guard).
    *(("--allowed-host", value, "--allowed-host takes a host name")
      for value in ("*", "*bad.example", "ops.example:443", "https://ops.example", "a b")),
]  # fmt: skip


@pytest.mark.parametrize(("option", "value", "said"), BAD_OPTIONS)
def test_a_root_path_or_allowed_host_that_cannot_work_is_refused_in_one_line(
    option: str, value: str, said: str
) -> None:
    """Refused before any server is asked (none answers at this address)."""
    result = subprocess.run(
        [sys.executable, "-m", "anarchon", "web", "--redis", "redis://127.0.0.1:1",
         "--port", str(free_port()), option, value],
        cwd=ROOT, env=command_env({}), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], lines


def register_jobs(url: str, prefix: str, names: list[str]) -> None:
    """Register ``names`` in the store (an instance that starts and stops)."""

    async def register() -> None:
        scheduler = Scheduler(RedisBackend(redis=url, prefix=prefix), instance_id="once")
        for name in names:
            scheduler.add_job(lambda: None, "0 0 1 1 *", name=name)
        async with scheduler:
            pass

    anyio.run(register)


def test_a_server_that_stops_answering_is_a_503_page_until_it_answers_again(
    server: ServerSpec, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    store = RestartableServer(server.binary, tmp_path, appendonly=False)
    store.start()
    try:
        web = WebCommand(tmp_path, store.url, prefix)
        webs.append(web)
        web.wait_serving()
        assert web.get("/")[0] == 200
        store.kill()
        status, page = web.get("/")
        assert status == 503 and "did not answer" in page, page
        store.start()
        wait_for(lambda: web.get("/")[0] == 200, 30, "the dashboard to read the store again")
        assert web.end() == 0, web.log()
    finally:
        store.kill()


def test_a_dashboard_port_that_is_taken_fails_before_the_start_in_one_line(
    server_url: str, prefix: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "anarchon", "web", "--redis", server_url, "--prefix", prefix,
             "--port", str(port)],
            cwd=ROOT, env=command_env({}), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "choose a free port" in lines[0]


def test_the_web_extra_is_needed_and_said_in_one_line(tmp_path: Path) -> None:
    """Without Starlette (hidden from the import here), ``anarchon web`` says what to
    install, in one line, exit 1 (as every command does for a missing extra)."""
    hide = tmp_path / "hide"
    (hide / "starlette").mkdir(parents=True)
    (hide / "starlette" / "__init__.py").write_text("raise ModuleNotFoundError('starlette')\n")
    env = command_env({})
    env["PYTHONPATH"] = os.pathsep.join([str(hide), env["PYTHONPATH"]])
    done = subprocess.run(
        [sys.executable, "-m", "anarchon", "web"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done
    assert done.stderr.strip().splitlines() == [
        "anarchon web: the dashboard needs Starlette and uvicorn: pip install 'anarchon[web]'"
    ]


def raw_post_headers(port: int, path: str, headers: dict[str, str]) -> tuple[int, float]:
    """Send a POST's request line and headers, and none of the body they announce: the
    status the server answers with (without waiting for the body), and how long it took."""
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        reply = sock.recv(4096).decode("latin-1")
    return int(reply.split(" ", 2)[1]), time.monotonic() - began


def test_an_action_checks_the_token_in_its_header_before_reading_a_body_and_caps_the_body(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    """A wrong bearer token is refused before the body is read (a 300 MB body is never
    waited for); a body without one is read only up to a few KB (413 past that)."""
    web = WebCommand(tmp_path, server_url, prefix, "--allow-actions", "--token", TOKEN)
    webs.append(web)
    web.wait_serving()
    huge = {"Content-Type": "application/x-www-form-urlencoded", "Content-Length": "300000000"}
    status, took = raw_post_headers(
        web.port, "/actions/pause/report", {**huge, "Authorization": "Bearer guess"}
    )
    assert (status, took < 5) == (401, True), (status, took)
    status, took = raw_post_headers(web.port, "/actions/pause/report", huge)
    assert (status, took < 5) == (413, True), (status, took)
    assert web.post("/actions/pause/report", "token=" + "x" * 20_000) == 413
    assert web.post("/actions/pause/report", "token=guess") == 401


def test_pages_refuse_framing_and_sniffing_and_say_done_only_for_an_action_that_was(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    """Every page forbids being framed (clickjacking) and content sniffing; the "Done"
    notice comes from a fixed list and a job the store knows, never from any text in the
    link (content spoofing)."""
    register_jobs(server_url, prefix, ["report"])
    web = WebCommand(tmp_path, server_url, prefix)
    webs.append(web)
    web.wait_serving()
    request = urllib.request.Request(web.url("/"))
    with urllib.request.urlopen(request, timeout=PAGE_SEC + 10) as reply:
        assert reply.headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in reply.headers["Content-Security-Policy"]
        assert reply.headers["X-Content-Type-Options"] == "nosniff"
        assert reply.headers["Referrer-Policy"] == "no-referrer"
    spoof = quote("Your account is locked: call +1 555 0100")
    assert "Your account is locked" not in web.get(f"/?done={spoof}")[1]
    assert "Done:" not in web.get(f"/?done=pause&job={quote('not-a-job')}")[1]
    assert "Done: report paused." in web.get("/?done=pause&job=report")[1]
    assert "Done: report paused." in web.get("/jobs/report?done=pause&job=report")[1]


def test_off_loopback_the_dashboard_needs_its_allowed_hosts(
    server_url: str, prefix: str, tmp_path: Path
) -> None:
    """Bound off loopback, any Host would be answered (a name an attacker points at the
    machine reads the pages: DNS rebinding): ``anarchon web`` refuses to start without
    --allowed-host, and ``dashboard()`` answers only the loopback names unless told."""
    env = command_env({})
    done = subprocess.run(
        [sys.executable, "-m", "anarchon", "web", "--redis", server_url, "--prefix", prefix,
         "--host", "0.0.0.0", "--port", str(free_port())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done
    (line,) = done.stderr.strip().splitlines()
    assert "--allowed-host" in line, line
    from anarchon.web import dashboard

    app = dashboard(RedisBackend(redis=server_url, prefix=prefix))
    hosts = [m for m in app.user_middleware if m.cls is TrustedHostMiddleware]
    assert len(hosts) == 1 and "dashboard.example" not in hosts[0].kwargs["allowed_hosts"]


# ------------------------------------------- what the store holds, and the network


def test_an_action_url_keeps_a_job_name_that_holds_dot_dot_and_slashes_in_its_segment(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand], browser: Any
) -> None:
    """A job named ``../run-now/billing``: its name is one segment of its links and of
    its buttons' URLs (``/`` escaped too), so that a browser, which resolves ``..`` in a
    path, pauses that job when its pause button is clicked, not runs 'billing' now."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    tricky = "../run-now/billing"
    register_jobs(server_url, prefix, [tricky, "billing"])
    web = WebCommand(tmp_path, server_url, prefix, "--allow-actions", "--token", TOKEN)
    webs.append(web)
    web.wait_serving()
    _, page = web.get("/")
    escaped = quote(tricky, safe="")
    assert f'action="/actions/pause/{escaped}"' in page and f'href="/jobs/{escaped}"' in page
    browser.get(web.url("/"))
    field = browser.find_element(By.ID, "token")
    field.send_keys(TOKEN)
    pause = f"//button[@data-job={tricky!r}][@data-action='pause']"
    assert on_each(browser, pause, lambda button: button.click(), first=True)
    message = WebDriverWait(browser, 30).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, "p.message")
    )
    assert message[0].text == f"Done: {tricky} paused.", message[0].text
    jobs, _ = read_store(server_url, prefix)
    assert jobs[tricky].paused and not jobs["billing"].paused
    # Its own page, and the way back to it after an action, keep the name whole.
    status, page = web.get(f"/jobs/{escaped}")
    assert status == 200 and f"Job {tricky}" in page, page
    assert f'name="next" value="/jobs/{escaped}"' in page, page
    assert web.end() == 0, web.log()


def test_a_job_page_reads_its_own_job_by_name_and_an_unknown_one_is_a_small_404(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    """2,000 jobs of long names: a job's page reads that job's definition, history and
    runs in progress by name (no command reads every job's definition or name), and
    the page of a job the store does not know is a small 404 that lists none of them."""
    names = [f"job-{index:04d}-{'x' * 150}" for index in range(2000)]
    register_jobs(server_url, prefix, names)
    web = WebCommand(tmp_path, server_url, prefix)
    webs.append(web)
    web.wait_serving()
    monitor = CommandLog(server_url)
    try:
        status, page = web.get(f"/jobs/{names[7]}")
        assert status == 200 and f"Job {names[7]}" in page, page
        status, missing = web.get("/jobs/no-such-job")
    finally:
        sent = {name for _, name in monitor.close()}
    assert status == 404 and "no job named 'no-such-job'" in html.unescape(missing), missing
    assert len(missing.encode()) < 20_000 and names[0] not in missing, len(missing)
    assert not sent & {"HGETALL", "HKEYS", "HVALS", "KEYS", "SCAN"}, sent
    assert web.end() == 0, web.log()


def test_what_the_store_holds_malformed_costs_the_dashboard_that_entry_alone(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand], direct: redis.Redis
) -> None:
    """A job definition that is not JSON (its name a terminal escape), a timer kind of a
    million buckets, an instance registered with 20,000 jobs and one whose record is
    not JSON: the overview is made (each malformed entry marked as such, and listed,
    escaped, among the malformed entries), the good job has its page, and an instance's
    job list is read and drawn only in part."""
    register_jobs(server_url, prefix, ["good"])
    set_timers(server_url, prefix, ["user:1"])
    keys = RegistryKeys.for_prefix(prefix)
    direct.hset(keys.jobs, "bad\x1b[2Jjob", "{not json")
    direct.hset(keys.timer_kinds, "huge", '{"buckets": 1000000}')
    alive_until = int(time.time() * 1000) + 120_000
    many = [f"registered-job-{index:05d}" for index in range(20_000)]
    big = {"id": "big", "host": "h", "pid": 1, "version": "v", "started_ms": 1,
           "strategy": "lease", "jobs": many, "timer_kinds": [], "running": 0}  # fmt: skip
    direct.set(keys.instance("big"), json.dumps(big))
    direct.set(keys.instance("broken"), "not json")
    direct.zadd(keys.instances, {"big": alive_until, "broken": alive_until})
    web = WebCommand(tmp_path, server_url, prefix)
    webs.append(web)
    web.wait_serving()
    status, page = web.get("/")
    assert status == 200, page
    assert ">good</a>" in page and ">remind</a>" in page, page
    assert r"bad\x1b[2Jjob" in page and "\x1b" not in page, page
    assert "malformed" in page and "huge" in page, page
    assert "Malformed store entries" in page and "not JSON" in page, page
    assert len(page.encode()) < 250_000 and many[-1] not in page, len(page.encode())
    assert web.get("/jobs/good")[0] == 200
    status, page = web.get("/jobs/bad%1B%5B2Jjob")
    assert status == 404 and "malformed" in page and "\x1b" not in page, page
    assert web.end() == 0, web.log()


def test_a_page_number_that_is_no_ascii_number_is_the_first_page_and_pages_are_not_stored(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    """``?page=²`` (a digit to ``str.isdigit``, not to ``int``) is the first page, not a
    500; every page says it is not to be stored by a cache (it shows the store now)."""
    register_jobs(server_url, prefix, ["report"])
    web = WebCommand(tmp_path, server_url, prefix)
    webs.append(web)
    web.wait_serving()
    for query in ("²", "٣", "-1", "1e3", "9" * 40):
        status, page = web.get(f"/?page={quote(query)}")
        assert status == 200 and ">report</a>" in page, (query, page)
    for path in ("/", "/jobs/report", "/jobs/unknown"):
        request = urllib.request.Request(web.url(path))
        try:
            with urllib.request.urlopen(request, timeout=PAGE_SEC + 10) as reply:
                headers = reply.headers
        except urllib.error.HTTPError as refused:
            headers = refused.headers
        assert headers["Cache-Control"] == "no-store", (path, dict(headers))
    assert web.end() == 0, web.log()


def test_the_page_refreshing_itself_stays_on_its_page_of_jobs(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand], browser: Any
) -> None:
    """On the second page of jobs, each refresh reads the second page again (the
    refresh keeps ``?page``)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    names = [f"job{index:03d}" for index in range(60)]
    register_jobs(server_url, prefix, names)
    web = WebCommand(tmp_path, server_url, prefix, "--refresh", "0.5")
    webs.append(web)
    web.wait_serving()
    browser.get(web.url("/?page=2"))
    read_at = browser.find_element(By.ID, "updated").text
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "updated").text != read_at)
    shown = texts(browser, section("Jobs") + "//tbody/tr/td[1]")
    assert shown == names[50:], shown
    assert web.end() == 0, web.log()


def open_unfinished_requests(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that each send the start of a request and never its end."""
    opened = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        opened.append(sock)
    return opened


def closed_by_the_server(sock: socket.socket, within_sec: float) -> bool:
    """Whether the server closes ``sock`` (an end of file, or a reset) within the time."""
    sock.settimeout(within_sec)
    try:
        while sock.recv(4096):
            pass  # a 408 or 503 it may say before it closes
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def test_connections_that_never_finish_their_headers_neither_block_the_dashboard_nor_stay(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand]
) -> None:
    """400 connections that send the start of a request and stop (slowloris), against a
    dashboard allowed 150 open files: it goes on answering, each of those connections
    is closed within the header timeout, and nothing floods its output (the refused
    connections are said once, not once each)."""
    register_jobs(server_url, prefix, ["report"])
    web = WebCommand(tmp_path, server_url, prefix, "--header-timeout", "3", open_files=150)
    webs.append(web)
    web.wait_serving()
    idle = open_unfinished_requests(web.port, 400)
    try:
        began = time.monotonic()
        status, page = web.get("/")
        assert status == 200 and ">report</a>" in page, page
        assert time.monotonic() - began < 5
        late = [sock for sock in idle if not closed_by_the_server(sock, 8)]
        assert late == [], f"{len(late)} unfinished requests still open"
        assert time.monotonic() - began < 12
    finally:
        for sock in idle:
            sock.close()
    assert web.get("/")[0] == 200
    assert web.end() == 0, web.log()
    log = web.log()
    assert len(log) < 4_000 and log.count("Too many open files") <= 1, log


def test_a_kind_s_timers_are_listed_a_page_at_a_time_as_text(
    server_url: str, prefix: str, tmp_path: Path, webs: list[WebCommand], browser: Any
) -> None:
    """From the overview, a kind's name leads to its timers: each key with its next due
    time, status, recurrence and payload, stored text shown as text (a key that is markup
    is not made an element); 'next page' goes on until every timer was shown once."""
    from selenium.webdriver.common.by import By

    keys = [f"user:{n:03d}" for n in range(149)] + ["<b id='bold'>x</b>"]
    set_timers(server_url, prefix, keys)
    web = WebCommand(tmp_path, server_url, prefix)
    webs.append(web)
    web.wait_serving()
    browser.get(web.url("/"))
    browser.find_element(By.LINK_TEXT, "remind").click()
    assert "Timers of remind" in browser.find_element(By.TAG_NAME, "h2").text
    seen: list[str] = []
    for _ in range(10):
        rows = texts(browser, "//table[thead/tr/th[1]='key']/tbody/tr/td[1]")
        seen += rows
        links = browser.find_elements(By.LINK_TEXT, "next page")
        if not links:
            break
        links[0].click()
    assert sorted(seen) == sorted(keys), (len(seen), len(set(seen)))
    assert not browser.find_elements(By.ID, "bold")
    status, page = web.get("/timers/remind?cursor=9-x")
    assert status == 404 and "is no page&#x27;s cursor" in page, page
    status, page = web.get("/timers/nope")
    assert status == 404 and "no timer kind named" in page, page
    assert web.end() == 0, web.log()
