"""The fault tools of tests/faults.py do what they are named for, on real servers."""

from __future__ import annotations

import gc
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import anyio
import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from anarchon._ops.embedded import EmbeddedServer
from tests.faults import FaultProxy, busy, oom, read_only, server_error, server_version
from tests.servers import ServerSpec

pytestmark = pytest.mark.engine_tier

PING = b"*1\r\n$4\r\nPING\r\n"
WRITE_SCRIPT = "return redis.call('SET', KEYS[1], ARGV[1])"


def echo(word: str) -> bytes:
    return f"*2\r\n$4\r\nECHO\r\n${len(word)}\r\n{word}\r\n".encode()


def bulk(word: str) -> bytes:
    return f"${len(word)}\r\n{word}\r\n".encode()


def set_command(key: str, value: str) -> bytes:
    parts = [b"SET", key.encode(), value.encode()]
    return f"*{len(parts)}\r\n".encode() + b"".join(
        b"$%d\r\n%s\r\n" % (len(part), part) for part in parts
    )


def client(url: str, timeout_sec: float = 2.0) -> redis.Redis:
    """A client that does not retry, so that each fault shows as it is."""
    return redis.Redis.from_url(
        url,
        protocol=2,
        decode_responses=True,
        socket_timeout=timeout_sec,
        socket_connect_timeout=timeout_sec,
        retry=Retry(NoBackoff(), 0),
    )


def raw(proxy: FaultProxy, timeout_sec: float = 2.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout_sec)


def wait_for(condition: Callable[[], bool], what: str, timeout_sec: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_sec
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def proxy(server_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(server_url) as proxy:
        yield proxy


# -- FaultProxy -----------------------------------------------------------------


def test_the_proxy_forwards_and_counts(proxy: FaultProxy, prefix: str) -> None:
    assert proxy.url == f"redis://127.0.0.1:{proxy.port}"
    big = "x" * (5 << 20)  # more than the proxy buffers: both directions apply backpressure
    c = client(proxy.url)
    try:
        assert c.set(f"{prefix}big", big)
        assert c.get(f"{prefix}big") == big
    finally:
        c.close()
    assert proxy.connections_accepted == 1
    assert proxy.bytes_to_server > len(big) and proxy.bytes_to_client > len(big)
    assert proxy.bytes_dropped == 0


def test_pause_freezes_the_server_and_holds_the_data(proxy: FaultProxy) -> None:
    with raw(proxy, timeout_sec=0.3) as sock:
        sock.sendall(PING)
        assert sock.recv(64) == b"+PONG\r\n"
        proxy.pause()
        sent = proxy.bytes_to_server
        sock.sendall(echo("held"))
        with pytest.raises(TimeoutError):
            sock.recv(64)
        frozen = client(proxy.url, timeout_sec=0.3)
        with pytest.raises(RedisTimeoutError):
            frozen.ping()
        frozen.close()
        assert proxy.bytes_to_server == sent
        proxy.resume()
        sock.settimeout(2)
        assert sock.recv(64) == bulk("held")  # sent while paused, delivered on resume
    after = client(proxy.url)
    try:
        assert after.ping()
    finally:
        after.close()


def test_pause_on_freezes_the_server_when_a_command_holds_the_marker(
    proxy: FaultProxy, direct: redis.Redis, prefix: str
) -> None:
    c = client(proxy.url, timeout_sec=0.3)
    try:
        proxy.pause_on(b"frozen-here")
        c.set(f"{prefix}a", "before")  # passes: no marker
        with pytest.raises(RedisTimeoutError):
            c.set(f"{prefix}b", "frozen-here")
        assert direct.get(f"{prefix}b") is None  # held before the server
        with pytest.raises(RedisTimeoutError):
            c.ping()  # everything waits now, as after pause()
        proxy.resume()
        wait_for(lambda: direct.get(f"{prefix}b") == "frozen-here", "the held command")
        proxy.reset()  # the client is out of step after its timeouts
        c.set(f"{prefix}c", "frozen-here")  # once: the marker no longer pauses
        assert direct.get(f"{prefix}c") == "frozen-here"
    finally:
        c.close()


def test_drop_replies_applies_commands_without_answering(
    proxy: FaultProxy, direct: redis.Redis, prefix: str
) -> None:
    c = client(proxy.url, timeout_sec=0.3)
    try:
        assert c.ping()
        proxy.drop_replies(True)
        with pytest.raises(RedisTimeoutError):
            c.set(f"{prefix}k", "applied")
        assert direct.get(f"{prefix}k") == "applied"
        with raw(proxy) as sock:
            dropped = proxy.bytes_dropped
            sock.sendall(PING)
            wait_for(lambda: proxy.bytes_dropped >= dropped + len(b"+PONG\r\n"), "a dropped PONG")
            proxy.drop_replies(False)
            sock.sendall(echo("later"))
            assert sock.recv(64) == bulk("later")  # later replies flow, the PONG is gone
        proxy.reset()
        assert c.get(f"{prefix}k") == "applied"
    finally:
        c.close()


def test_reset_cuts_every_connection_with_rst(proxy: FaultProxy) -> None:
    c = client(proxy.url)
    with raw(proxy) as idle:
        idle.sendall(PING)
        assert idle.recv(64) == b"+PONG\r\n"
        assert c.ping()
        errors: list[BaseException] = []

        def in_flight() -> None:
            try:
                c.get("anything")
            except BaseException as exc:
                errors.append(exc)

        sent = proxy.bytes_to_server
        proxy.drop_replies(True)  # the GET reaches the server and waits for its reply
        thread = threading.Thread(target=in_flight)
        thread.start()
        wait_for(lambda: proxy.bytes_to_server > sent, "the GET reaching the server")
        proxy.reset()
        proxy.drop_replies(False)
        thread.join(2)
        assert len(errors) == 1 and isinstance(errors[0], RedisConnectionError), errors
        assert proxy.connections_open == 0
        with pytest.raises(ConnectionResetError):
            idle.recv(64)
    accepted = proxy.connections_accepted
    try:
        assert c.ping()  # new connections are accepted
    finally:
        c.close()
    assert proxy.connections_accepted == accepted + 1


def test_refuse_resets_current_and_new_connections(proxy: FaultProxy) -> None:
    with raw(proxy) as current:
        current.sendall(PING)
        assert current.recv(64) == b"+PONG\r\n"
        proxy.refuse(True)
        with pytest.raises(ConnectionResetError):
            current.recv(64)
    c = client(proxy.url)
    try:
        accepted = proxy.connections_accepted
        with pytest.raises(RedisConnectionError):
            c.ping()
        assert proxy.connections_accepted == accepted + 1  # accepted, then reset at once
        assert proxy.connections_open == 0
        proxy.refuse(False)
        assert c.ping()
    finally:
        c.close()


def test_drop_after_request_loses_the_reply_of_an_applied_command(
    proxy: FaultProxy, direct: redis.Redis, prefix: str
) -> None:
    c = client(proxy.url)
    try:
        assert c.ping()  # the connection handshake is done: the next chunk is the SET
        proxy.drop_after_request()
        with pytest.raises(RedisConnectionError):
            c.set(f"{prefix}k", "applied")
        assert direct.get(f"{prefix}k") == "applied"
        assert c.set(f"{prefix}next", "answered")  # only one chunk was cut
        assert direct.get(f"{prefix}next") == "answered"
    finally:
        c.close()


def test_drop_after_request_counts_chunks(
    proxy: FaultProxy, direct: redis.Redis, prefix: str
) -> None:
    proxy.drop_after_request(2)
    for index in range(3):
        with raw(proxy) as sock:
            sock.sendall(set_command(f"{prefix}{index}", "v"))
            if index < 2:
                with pytest.raises(ConnectionResetError):
                    sock.recv(64)
            else:
                assert sock.recv(64) == b"+OK\r\n"
    assert direct.mget([f"{prefix}{i}" for i in range(3)]) == ["v", "v", "v"]


def test_a_half_close_is_passed_on(proxy: FaultProxy) -> None:
    with raw(proxy) as sock:
        sock.sendall(PING)
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(64) == b"+PONG\r\n"
        assert sock.recv(64) == b""  # the server closed in turn, and so did the proxy
    wait_for(lambda: proxy.connections_open == 0, "the connection to close")


def round_trip_sec(sock: socket.socket) -> float:
    started = time.monotonic()
    sock.sendall(PING)
    assert sock.recv(64) == b"+PONG\r\n"
    return time.monotonic() - started


def test_delay_holds_each_direction(proxy: FaultProxy) -> None:
    with raw(proxy, timeout_sec=5) as sock:
        assert round_trip_sec(sock) < 5
        proxy.delay(400)
        sent = proxy.bytes_to_server
        started = time.monotonic()
        sock.sendall(PING)
        wait_for(lambda: proxy.bytes_to_server > sent, "the PING reaching the server", 5)
        assert time.monotonic() - started >= 0.4  # held on its way to the server
        assert sock.recv(64) == b"+PONG\r\n"
        assert time.monotonic() - started >= 0.8  # and the reply on its way back
        proxy.delay(0)
        assert round_trip_sec(sock) < 0.8


def test_delay_keeps_the_order_when_it_changes(proxy: FaultProxy) -> None:
    with raw(proxy, timeout_sec=5) as sock:
        proxy.delay(400)
        started = time.monotonic()
        sock.sendall(echo("first"))
        wait_for(lambda: proxy.bytes_held >= len(echo("first")), "the first ECHO held", 5)
        proxy.delay(0)
        sock.sendall(echo("second"))  # not held by itself, but behind the first
        expected = bulk("first") + bulk("second")
        received = b""
        while len(received) < len(expected):
            received += sock.recv(64)
        assert received == expected
        assert time.monotonic() - started >= 0.4
    assert proxy.bytes_held == 0


def test_a_delayed_proxy_moves_more_than_it_holds(proxy: FaultProxy, prefix: str) -> None:
    big = "x" * (5 << 20)  # more than the proxy holds: backpressure counts what it holds
    proxy.delay(20)
    c = client(proxy.url, timeout_sec=10)
    try:
        assert c.set(f"{prefix}big", big)
        assert c.get(f"{prefix}big") == big
    finally:
        c.close()


def test_redirect_sends_new_connections_to_the_new_server(
    server: ServerSpec, proxy: FaultProxy, direct: redis.Redis, prefix: str
) -> None:
    if server.binary is None:
        pytest.skip("a server run elsewhere (ANARCHON_TEST_SERVERS): no binary for a second one")
    with EmbeddedServer(server.binary) as other:
        direct.set(f"{prefix}where", "first")
        second = client(other.url)
        second.set(f"{prefix}where", "second")
        before = client(proxy.url)
        try:
            with raw(proxy) as current:
                current.sendall(PING)
                assert current.recv(64) == b"+PONG\r\n"
                assert before.get(f"{prefix}where") == "first"
                proxy.redirect(other.url)
                with pytest.raises(ConnectionResetError):
                    current.recv(64)  # the connection to the old server is cut
            wait_for(lambda: proxy.connections_open == 0, "the old connections to close")
            after = client(proxy.url)
            try:
                assert after.get(f"{prefix}where") == "second"
            finally:
                after.close()
        finally:
            before.close()
            second.close()
    assert proxy.upstream == ("127.0.0.1", other.port)


def test_close_is_clean(server_url: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        proxy = FaultProxy(server_url)
        port = proxy.port
        sock = raw(proxy)
        sock.sendall(PING)
        assert sock.recv(64) == b"+PONG\r\n"
        proxy.pause()
        sock.sendall(PING)  # held when the proxy closes
        proxy.close()
        proxy.close()
        proxy.pause()  # controls after close do nothing
        proxy.reset()
        with pytest.raises(ConnectionResetError):
            sock.recv(64)
        sock.close()
        del proxy
        gc.collect()
    assert not [t for t in threading.enumerate() if t.name == f"FaultProxy:{port}"]
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


@pytest.mark.anyio
async def test_the_proxy_runs_under_either_event_loop(anyio_backend: str, server_url: str) -> None:
    with FaultProxy(server_url) as proxy:
        async with await anyio.connect_tcp("127.0.0.1", proxy.port) as stream:
            proxy.pause()
            await stream.send(PING)
            with anyio.move_on_after(0.2) as scope:
                await stream.receive()
            assert scope.cancelled_caught
            proxy.resume()
            with anyio.fail_after(2):
                assert await stream.receive() == b"+PONG\r\n"


# -- error replies from the real server -----------------------------------------------


@pytest.mark.server_tier  # the server's own error replies
def test_oom_refuses_writes_and_writing_scripts(direct: redis.Redis, prefix: str) -> None:
    newer = server_version(direct) >= (7, 0)
    direct.set(f"{prefix}kept", "1")
    sha = direct.script_load(WRITE_SCRIPT)
    old_limit = direct.config_get("maxmemory")
    with oom(direct):
        with pytest.raises(OutOfMemoryError) as oom_error:
            direct.set(f"{prefix}k", "v")
        assert (
            server_error(oom_error.value)
            == "OOM command not allowed when used memory > 'maxmemory'."
        )
        scripts: list[Callable[[], object]] = [
            lambda: direct.eval(WRITE_SCRIPT, 1, f"{prefix}k", "v"),
            lambda: direct.evalsha(sha, 1, f"{prefix}k", "v"),
        ]
        for run in scripts:
            with pytest.raises(ResponseError) as refused:
                run()
            text = server_error(refused.value)
            if newer:  # Redis 7.0+ and Valkey: the write's own error, from the script
                assert isinstance(refused.value, OutOfMemoryError)
                assert text.startswith("OOM command not allowed when used memory")
                assert "script:" in text
            else:  # Redis 5.0 and 6.2: wrapped in the script's error
                assert text.startswith("ERR Error running script")
                assert "-OOM command not allowed when used memory" in text
        assert direct.eval("return redis.call('GET', KEYS[1])", 1, f"{prefix}kept") == "1"
        assert direct.get(f"{prefix}kept") == "1"
    assert direct.config_get("maxmemory") == old_limit
    assert direct.get(f"{prefix}k") is None
    assert direct.set(f"{prefix}k", "v")


@pytest.mark.server_tier  # the server's own error replies
def test_read_only_refuses_writes_and_keeps_the_data(direct: redis.Redis, prefix: str) -> None:
    newer = server_version(direct) >= (7, 0)
    direct.set(f"{prefix}kept", "1")
    sha = direct.script_load(WRITE_SCRIPT)
    with read_only(direct):
        with pytest.raises(ReadOnlyError) as read_only_error:
            direct.set(f"{prefix}k", "v")
        assert (
            server_error(read_only_error.value)
            == "READONLY You can't write against a read only replica."
        )
        with pytest.raises(ResponseError) as refused:
            direct.evalsha(sha, 1, f"{prefix}k", "v")
        text = server_error(refused.value)
        if newer:
            assert isinstance(refused.value, ReadOnlyError)
            assert text.startswith("READONLY You can't write against a read only replica.")
        else:
            assert text.startswith("ERR Error running script")
            assert "-READONLY You can't write against a read only replica." in text
        assert direct.get(f"{prefix}kept") == "1"
        assert direct.info("replication")["role"] == "slave"
        # Past a replication cron tick (1 s): the replica has tried to connect and failed.
        time.sleep(1.1)
    assert direct.info("replication")["role"] == "master"
    assert direct.get(f"{prefix}kept") == "1"
    assert direct.set(f"{prefix}k", "v")


@pytest.mark.server_tier  # the server's own error replies
def test_busy_answers_busy_until_the_script_is_killed(server_url: str, direct: redis.Redis) -> None:
    old_limit = direct.config_get("lua-time-limit")
    other = client(server_url)
    try:
        assert other.ping()
        started = time.monotonic()
        with busy(server_url):
            commands: list[Callable[[], object]] = [other.ping, lambda: other.set("any", "v")]
            for command in commands:
                with pytest.raises(ResponseError) as refused:
                    command()
                text = server_error(refused.value)
                assert text.startswith("BUSY "), text
                assert "busy running a script" in text and "SCRIPT KILL" in text
        assert time.monotonic() - started < 2.5
        assert other.ping()
    finally:
        other.close()
    assert direct.config_get("lua-time-limit") == old_limit
