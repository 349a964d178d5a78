"""No secret of a connection URL reaches a message, a log line or a command line we
print: one redaction (``anarchon.clients.redact``), used everywhere. No server needed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from anarchon import InvalidOptionError, RedisBackend
from anarchon.clients.redact import redact_url
from tests.servers import ServerSpec
from tests.test_run_command import ROOT

SECRET = "S3CRETPW"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://user:{SECRET}@host:6379/0", "redis://user:***@host:6379/0"),
        (f"redis://:{SECRET}@host", "redis://:***@host"),
        (f"redis://{SECRET}@host", "redis://***@host"),
        (f"redis://user:SEC@{SECRET}@host", "redis://user:***@host"),
        (f"redis://user:SEC/{SECRET}@host/1", "redis://user:***@host/1"),
        (f"redis:/user:{SECRET}@host", "redis:/user:***@host"),
        (f"REDIS://user:{SECRET}@host", "REDIS://user:***@host"),
        (f"http://user:{SECRET}@host", "http://user:***@host"),
        (f"user:{SECRET}@host", "user:***@host"),
        (f"rediss://host:6380?password={SECRET}&ssl_cert_reqs=none",
         "rediss://host:6380?password=***&ssl_cert_reqs=none"),
        (f"redis+sentinel://u:{SECRET}@s1:26379,s2/mymaster?sentinel_password={SECRET}",
         "redis+sentinel://u:***@s1:26379,s2/mymaster?sentinel_password=***"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("unix:///run/valkey.sock", "unix:///run/valkey.sock"),
    ],
)  # fmt: skip
def test_a_url_is_shown_without_its_password_whatever_its_shape(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert SECRET not in redact_url(url)


@pytest.mark.parametrize(
    "url",
    [
        f"redis:/user:{SECRET}@host",
        f"http://user:{SECRET}@host",
        f"REDIS://user:{SECRET}@host",
        f"redis+sentinel://user:{SECRET}@host:notaport/mymaster",
        f"redis+sentinel://user:pw@{SECRET}@host:x/mymaster",
    ],
)
def test_an_error_about_a_bad_url_does_not_quote_its_password(url: str) -> None:
    with pytest.raises(InvalidOptionError) as refused:
        RedisBackend(redis=url)
    assert SECRET not in str(refused.value)


def test_where_shows_the_server_without_its_password() -> None:
    for url in (f"redis://u:p@{SECRET}@host", f"redis://u:p/{SECRET}@host/0"):
        assert SECRET not in RedisBackend(redis=url).where()


@pytest.mark.parametrize("command", ["inspect", "history job", "pause job"])
@pytest.mark.parametrize("url", [f"redis:/user:{SECRET}@host", f"http://user:{SECRET}@host"])
def test_the_command_line_never_prints_a_password_of_a_bad_url(command: str, url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "anarchon", *command.split(), "--redis", url],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode != 0
    assert SECRET not in done.stdout + done.stderr, done.stderr
    assert "***" in done.stderr, done.stderr


def _children_command_lines(parent: int) -> list[str]:
    """The command lines of ``parent``'s child processes, as any user can read them."""
    lines = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent:
                lines.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):
            continue  # the process ended
    return lines


@pytest.mark.engine_tier
@pytest.mark.slow
def test_the_demo_never_shows_its_servers_password_nor_puts_it_on_a_command_line(
    server: ServerSpec, server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """``anarchon demo --redis URL`` with a password: the password is in no line the demo
    prints, and in no command line of its instances (other users of the machine can read
    those); the instances get the URL through their environment."""
    if server.family == "redis" and server.version < (6, 0):
        pytest.skip("ACL users need Redis 6+")
    user = f"demo{prefix.strip(':')}"
    direct.execute_command("ACL", "SETUSER", user, "on", f">{SECRET}", "~*", "&*", "+@all")
    url = f"redis://{user}:{SECRET}@{server_url.split('//', 1)[1]}"
    try:
        demo = subprocess.Popen(
            [sys.executable, "-m", "anarchon", "demo", "--redis", url, "--seconds", "3",
             "--instances", "2", "--jobs", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
        )  # fmt: skip
        instances_seen = 0
        while demo.poll() is None:
            lines = [
                line for line in _children_command_lines(demo.pid) if "anarchon._ops.demo" in line
            ]
            assert not [line for line in lines if SECRET in line], lines
            instances_seen = max(instances_seen, len(lines))
            time.sleep(0.1)
        out, err = demo.communicate(timeout=60)
    finally:
        direct.execute_command("ACL", "DELUSER", user)
    assert demo.returncode == 0, out + err
    assert instances_seen == 2  # its instances were looked at while they ran
    assert SECRET not in out + err
    assert f"redis://{user}:***@" in out
