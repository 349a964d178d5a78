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
import redis.exceptions
from anyio import fail_after as anyio_fail_after

from anarchon import InvalidOptionError, RedisBackend, Timers
from anarchon.clients.redact import redact_url, scrub
from anarchon.clients.sentinel import SentinelSpec
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
        # A password holding '?' or '#', which a URL reads as its query or fragment.
        (f"redis://user:pa?{SECRET}@host:6379/0", "redis://user:***@host:6379/0"),
        (f"redis://user:?{SECRET}?@host", "redis://user:***@host"),
        (f"redis://user:{SECRET}#x@host/0", "redis://user:***@host/0"),
        (f"redis://{SECRET}?@host", "redis://***@host"),
        (f"redis+sentinel://u:p?{SECRET}@s1:26379/mymaster",
         "redis+sentinel://u:***@s1:26379/mymaster"),
        # An '@' in a query parameter's secret: masked whole, the host stays.
        (f"rediss://host:6380/0?password=SEC@{SECRET}&ssl_cert_reqs=none",
         "rediss://host:6380/0?password=***&ssl_cert_reqs=none"),
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
    for url in (
        f"redis://u:p@{SECRET}@host",
        f"redis://u:p/{SECRET}@host/0",
        f"redis://u:p?{SECRET}@host/0",
        f"redis+sentinel://u:p@{SECRET}@s1:26379,s2/mymaster",
        f"redis+sentinel://u:p?{SECRET}@s1:26379/mymaster",
        f"redis+sentinel://u:p/{SECRET}@s1:26379/mymaster",
    ):
        try:
            shown = RedisBackend(redis=url).where()
        except InvalidOptionError as refused:  # a password the client would misread
            shown = str(refused)
        assert SECRET not in shown, url


def test_a_sentinel_password_holding_an_at_sign_is_the_password() -> None:
    """The hosts begin after the last '@' before them: the password holds the others."""
    spec = SentinelSpec.from_url(f"redis+sentinel://u:p@{SECRET}@s1:26379,s2/mymaster")
    assert (spec.username, spec.password) == ("u", f"p@{SECRET}")
    assert spec.sentinels == (("s1", 26379), ("s2", 26379))


@pytest.mark.anyio
@pytest.mark.parametrize(
    "url",
    [
        f"redis://u:pa?{SECRET}@127.0.0.1:6379/0",
        f"redis://u:12?{SECRET}@127.0.0.1:6379/0",
        f"redis://u:{SECRET}#1@127.0.0.1/0",
        f"redis://u:a/{SECRET}@127.0.0.1:6379/0",
    ],
)
async def test_a_password_that_a_url_cannot_hold_raw_is_refused_with_how_to_write_it(
    url: str,
) -> None:
    """'?', '#' and '/' end the user info of a URL: such a password must be
    percent-encoded. Refused with the URL redacted, never read as another host or port."""
    with pytest.raises(InvalidOptionError) as refused:
        async with Timers(RedisBackend(redis=url)):
            pass
    said = str(refused.value)
    assert SECRET not in said and "u:***@127.0.0.1" in said, said
    assert "percent-encode" in said, said


@pytest.mark.parametrize("command", ["inspect", "history job", "pause job"])
@pytest.mark.parametrize(
    "url",
    [
        f"redis:/user:{SECRET}@host",
        f"http://user:{SECRET}@host",
        f"redis://user:pa?{SECRET}@127.0.0.1:1/0",
        f"redis+sentinel://user:p@{SECRET}@127.0.0.1:1/mymaster",
    ],
)
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


#: What client libraries have put in their errors' text: redis-py before 7.4 a
#: connection pool's keyword arguments (a Sentinel's too), a mapping's repr, GLIDE a
#: Rust structure, and any library the URL it was made with.
LEAKY_TEXTS = [
    f"No master found for 'mymaster' : <redis.asyncio.client.Redis(<ConnectionPool("
    f"<Connection(db=0,username=u,password={SECRET},socket_timeout=5,host=h,port=1)>)>)>",
    f"Connection(host=h,port=1,ssl_password={SECRET},sentinel_password={SECRET})",
    f"kwargs {{'password': '{SECRET}', 'host': 'h'}}",
    f'ConnectionRequest {{ credentials: Some(Creds {{ password: Some("{SECRET}") }}) }}',
    f"Error connecting to redis://u:{SECRET}@h:1/0: refused",
    f"Error connecting to redis://u:pa?{SECRET}@h:1/0: refused",
    f"auth_token={SECRET}; token={SECRET}",
]


@pytest.mark.parametrize("text", LEAKY_TEXTS)
def test_the_secrets_of_a_client_errors_text_are_scrubbed(text: str) -> None:
    shown = scrub(text)
    assert SECRET not in shown and "***" in shown, shown


def test_scrubbing_keeps_an_error_without_secrets_as_it_is() -> None:
    for text in (
        "WRONGPASS invalid username-password pair or user is disabled.",
        "NOAUTH Authentication required.",
        "Error 111 connecting to 127.0.0.1:6379. Connection refused.",
        "NOPERM User u has no permissions to run the 'xadd' command",
    ):
        assert scrub(text) == text


def _leaky_errors() -> list[BaseException]:
    import redis.exceptions
    import valkey.exceptions
    from glide_shared.exceptions import ClosingError, RequestError

    return [
        redis.exceptions.ConnectionError(LEAKY_TEXTS[0]),
        redis.exceptions.ResponseError(LEAKY_TEXTS[4]),
        redis.exceptions.AuthenticationError(LEAKY_TEXTS[1]),
        valkey.exceptions.ConnectionError(LEAKY_TEXTS[2]),
        ClosingError(LEAKY_TEXTS[3]),
        RequestError(LEAKY_TEXTS[3]),
        OSError(LEAKY_TEXTS[5]),
    ]


@pytest.mark.parametrize("error", _leaky_errors(), ids=lambda e: type(e).__name__)
def test_every_adapter_scrubs_a_client_error_where_it_maps_it(error: BaseException) -> None:
    """The one seam each adapter maps a library's errors at: the error anarchon raises,
    and the library's own kept as its cause (a traceback prints it), show no secret."""
    import redis.exceptions
    import valkey.exceptions

    from anarchon.clients import glide, send
    from anarchon.clients.redis_py import ClientErrors

    mappers = [
        ClientErrors.of(redis.exceptions).convert,
        ClientErrors.of(valkey.exceptions).convert,
        glide.convert_error,
        send.convert_error,
    ]
    for convert in mappers:
        mapped = convert(error)
        assert SECRET not in str(mapped), (convert, str(mapped))
        assert SECRET not in str(error), convert


class UrlClient:
    """A user's own client (``send``) whose errors name the URL it was made with."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url, protocol=2, socket_connect_timeout=2)

    def send(self, command: str, args: list[str]) -> object:
        try:
            return self.client.execute_command(command, *args)
        except redis.exceptions.ConnectionError as exc:
            raise ConnectionError(f"{self.url}: {exc}") from exc


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.anyio
async def test_a_real_connection_error_that_names_the_url_shows_no_password() -> None:
    client = UrlClient(f"redis://u:{SECRET}@127.0.0.1:{_closed_port()}/0")
    with pytest.raises(Exception) as failed:
        async with Timers(RedisBackend(redis=client)):
            pass
    assert_no_secret_in_chain(failed.value)


@pytest.mark.engine_tier
@pytest.mark.anyio
async def test_a_real_sentinel_connection_error_shows_no_password(server_url: str) -> None:
    """The installed redis-py's own error of a Sentinel connection (a server that is no
    Sentinel; a closed port), as anarchon raises it, and each of its causes."""
    real = server_url.removeprefix("redis://").split("/", 1)[0]
    for hosts in (real, f"127.0.0.1:{_closed_port()}"):
        url = f"redis+sentinel://u:p@{SECRET}@{hosts}/mymaster?sentinel_password={SECRET}"
        with pytest.raises(Exception) as failed:
            with anyio_fail_after(20):
                async with Timers(RedisBackend(redis=url)):
                    pass
        assert_no_secret_in_chain(failed.value)


def assert_no_secret_in_chain(error: BaseException) -> None:
    """No error of ``error``'s chain (its causes and contexts) says the secret."""
    chain: list[str] = []
    seen: BaseException | None = error
    while seen is not None:
        chain.append(str(seen))
        seen = seen.__cause__ or seen.__context__
    assert all(SECRET not in text for text in chain), chain
