"""Faults for tests: a TCP proxy that misbehaves on command, and real error replies.

``FaultProxy`` sits between any client and a real server on loopback and can
freeze, slow down, cut, refuse or half-deliver the traffic, or send it to
another server (a failover). ``oom``, ``read_only`` and
``busy`` put a real server in a state where it answers with OOM, READONLY or
BUSY errors itself: nothing is faked, the replies are the server's own.

What the servers answer (checked on Valkey 9.1, 8.1, 8.0 and Redis 8.6, 8.2,
7.0, 6.2, 5.0; redis-py strips the first word of an error into ``status_code``
and picks the class from it, ``server_error`` puts it back):

* SET when over maxmemory: ``OOM command not allowed when used memory >
  'maxmemory'.`` everywhere (``OutOfMemoryError``).
* EVAL / EVALSHA of a script without a shebang that writes: the script starts
  (scripts that only read run as usual) and its first write fails. Redis 7.0+
  and Valkey answer ``OOM command not allowed when used memory > 'maxmemory'.
  script: <sha>, on @user_script:1.`` (Valkey 9.1 leaves out the sha), an
  ``OutOfMemoryError``; Redis 5.0 and 6.2 answer a plain ``ResponseError``,
  ``ERR Error running script (call to f_<sha>): @user_script:1: @user_script:
  1: -OOM command not allowed when used memory > 'maxmemory'.``. A script with
  a shebang (``#!lua``, Redis 7.0+ and Valkey) and without ``flags=no-writes``
  is refused before it starts, with the SET's error text.
* Writes on a replica: ``READONLY You can't write against a read only
  replica.`` (``ReadOnlyError``); from a script, the same with `` script: ...``
  on Redis 7.0+ and Valkey, and ``ERR Error running script (call to f_<sha>):
  @user_script:1: @user_script: 1: -READONLY You can't write against a read
  only replica.`` on Redis 5.0 and 6.2.
* Any command but SCRIPT KILL and SHUTDOWN NOSAVE during a long script:
  ``BUSY Redis is busy running a script. You can only call SCRIPT KILL or
  SHUTDOWN NOSAVE.`` (``Valkey is busy`` on Valkey), a plain ``ResponseError``.
  The killed script's caller gets ``Script killed by user with SCRIPT KILL...``.
"""

from __future__ import annotations

import contextlib
import queue
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError

__all__ = ["FaultProxy", "busy", "oom", "read_only", "server_error", "server_version"]

_CHUNK = 65536
# A direction stops reading once this much waits for the other side.
_HIGH_WATER = 1 << 20
# drop_after_request: how long to wait for the server's reply before cutting anyway.
_REPLY_GRACE_SEC = 1.0
_CONTROL_TIMEOUT_SEC = 5.0


def _address(upstream: str | tuple[str, int]) -> tuple[str, int]:
    """``(host, port)`` of a ``redis://`` URL, or the pair itself."""
    if isinstance(upstream, tuple):
        return upstream
    parts = urlsplit(upstream)
    if parts.port is None:
        raise ValueError(f"no port in {upstream!r}")
    return (parts.hostname or "127.0.0.1", parts.port)


def _abort(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP RST instead of a FIN (SO_LINGER on, timeout 0)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class _Held:
    """Chunks that ``delay()`` holds back in one direction, in the order they were
    read, each with the time it may move on (monotonic)."""

    def __init__(self) -> None:
        self.chunks: deque[tuple[float, bytes]] = deque()
        self.size = 0

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def add(self, due: float, data: bytes) -> float:
        """Hold ``data`` until ``due``, or until the chunk before it moves on if that is
        later; returns the time it moves on."""
        if self.chunks:
            due = max(due, self.chunks[-1][0])
        self.chunks.append((due, data))
        self.size += len(data)
        return due

    def next_due(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    def last_due(self) -> float | None:
        return self.chunks[-1][0] if self.chunks else None

    def release(self, now: float, into: bytearray) -> None:
        """Move every chunk due by ``now`` to ``into``."""
        while self.chunks and self.chunks[0][0] <= now:
            _, data = self.chunks.popleft()
            into += data
            self.size -= len(data)

    def clear(self) -> None:
        self.chunks.clear()
        self.size = 0


class _Link:
    """A client's connection to the proxy and the proxy's connection to the server."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.to_server = bytearray()
        self.to_client = bytearray()
        # delay(): chunks read but not due yet, on their way to to_server / to_client.
        self.held_to_server = _Held()
        self.held_to_client = _Held()
        self.client_eof = False  # the client sent its FIN
        self.server_eof = False
        self.client_shut = False  # the proxy sent its FIN to the client
        self.server_shut = False
        # drop_after_request: the chunk is on its way, the client is cut at the reply.
        self.doomed = False
        # The client was cut; the server's side is read and discarded until it closes.
        self.draining = False
        self.deadline = 0.0
        self.closed = False


class FaultProxy:
    """A loopback TCP proxy to ``upstream`` (a ``redis://`` URL or ``(host, port)``)
    whose traffic a test can freeze, slow down, drop or cut, or send to another
    server, from any thread.

    One daemon thread moves the bytes (non-blocking sockets and a selector), so
    the proxy works the same under any event loop, or none. Each control returns
    once that thread applied it: after ``pause()`` returns no byte moves, after
    ``reset()`` returns every connection is gone. ``close()`` (or leaving the
    ``with`` block) cuts every connection, closes every socket and joins the
    thread; controls called after it do nothing.

    >>> with FaultProxy(server_url) as proxy:  # doctest: +SKIP
    ...     client = redis.Redis.from_url(proxy.url)
    ...     proxy.pause()
    """

    def __init__(
        self, upstream: str | tuple[str, int], *, connect_timeout_sec: float = 2.0
    ) -> None:
        #: Where new connections go (``redirect()`` changes it).
        self.upstream = _address(upstream)
        self.connect_timeout_sec = connect_timeout_sec
        #: Every connection the proxy accepted, refused ones included.
        self.connections_accepted = 0
        #: Bytes written to the server, and to clients.
        self.bytes_to_server = 0
        self.bytes_to_client = 0
        #: Bytes of server replies thrown away (``drop_replies``, ``drop_after_request``).
        self.bytes_dropped = 0

        self._paused = False
        self._dropping_replies = False
        self._refusing = False
        self._drop_after = 0
        self._delay_sec = 0.0
        self._pause_marker: bytes | None = None
        self._links: set[_Link] = set()
        self._masks: dict[socket.socket, int] = {}
        self._commands: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._closed = False
        self._stopping = False
        self._error: BaseException | None = None

        self._selector = selectors.DefaultSelector()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            self._listener.bind(("127.0.0.1", 0))
            self._listener.listen(128)
            self._listener.setblocking(False)
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._selector.register(self._listener, selectors.EVENT_READ, "listener")
            self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        except BaseException:
            self._close_sockets()
            raise
        self._port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(
            target=self._run, name=f"FaultProxy:{self._port}", daemon=True
        )
        self._thread.start()

    # -- public API --------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self._port}"

    @property
    def connections_open(self) -> int:
        """Connections the proxy forwards right now."""
        return len(self._links)

    @property
    def paused(self) -> bool:
        """Whether the proxy is paused (by ``pause()``, or by the marker of ``pause_on()``)."""
        return self._paused

    @property
    def bytes_held(self) -> int:
        """Bytes that ``delay()`` holds back right now, both directions."""
        held = [0]

        def count() -> None:
            held[0] = sum(lk.held_to_server.size + lk.held_to_client.size for lk in self._links)

        self._call(count)
        return held[0]

    def pause(self) -> None:
        """Stop moving bytes both ways, like a frozen server: connections stay open
        (new ones are still accepted) and what is sent waits in the socket buffers,
        to be delivered on ``resume()``."""
        self._call(lambda: setattr(self, "_paused", True))

    def resume(self) -> None:
        self._call(lambda: setattr(self, "_paused", False))

    def pause_on(self, marker: bytes) -> None:
        """Pause (as ``pause()``) as soon as a client sends a chunk holding ``marker``,
        before that chunk reaches the server: the server freezes just when a given
        command is sent (its text, or an argument only it carries). Once; ``resume()``
        goes on."""
        if not marker:
            raise ValueError("marker must not be empty")
        self._call(lambda: setattr(self, "_pause_marker", marker))

    def drop_replies(self, on: bool) -> None:
        """While on, commands reach the server but its replies are thrown away.

        A connection that lost a reply is out of step with its client (the next
        reply it reads is the previous command's): ``reset()`` cuts such
        connections."""
        self._call(lambda: setattr(self, "_dropping_replies", on))

    def reset(self) -> None:
        """Cut every current connection, both sides, with a TCP RST. New
        connections are accepted afterwards."""
        self._call(self._reset_all)

    def refuse(self, on: bool) -> None:
        """While on, new connections are accepted and at once reset, and the
        current ones are reset when it is turned on."""

        def apply() -> None:
            self._refusing = on
            if on:
                self._reset_all()

        self._call(apply)

    def drop_after_request(self, n: int = 1) -> None:
        """The next ``n`` chunks clients write (one ``recv`` each, on any connection,
        a client's connection handshake included) reach the server, and then their
        client connection is reset without the reply.

        The cut happens when the server's reply arrives (it is thrown away), so
        when the client sees its connection error the server has already applied
        the command; a command the server never answers is cut after 1 s."""
        if n < 0:
            raise ValueError("n must be >= 0")

        def apply() -> None:
            self._drop_after = n

        self._call(apply)

    def delay(self, each_way_ms: float) -> None:
        """Hold every chunk read from now on for ``each_way_ms`` before passing it on,
        in both directions, like a slow link: a round trip takes twice that longer.
        0 ends the delay. Chunks keep their order (one never overtakes a chunk held
        before it, so a shorter delay lets nothing jump the queue), and what is held
        when the delay changes moves on at its own time. The other controls work as
        before: ``pause()`` holds the held chunks too, a reset drops them."""
        if each_way_ms < 0:
            raise ValueError("each_way_ms must be >= 0")
        self._call(lambda: setattr(self, "_delay_sec", each_way_ms / 1000))

    def redirect(self, upstream: str | tuple[str, int]) -> None:
        """Send new connections to ``upstream`` (a ``redis://`` URL or ``(host,
        port)``) from now on, as after a failover, and reset the current ones with a
        TCP RST: they lead to the old server, and a client that reconnects reaches
        the new one."""
        address = _address(upstream)

        def apply() -> None:
            self.upstream = address
            self._reset_all()

        self._call(apply)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
        self._wake()
        self._thread.join()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------

    def _call(self, command: Callable[[], None]) -> None:
        if threading.current_thread() is self._thread:
            command()
            return
        done = threading.Event()
        with self._lock:
            if self._closed:
                return
            self._commands.put((command, done))
        self._wake()
        deadline = time.monotonic() + _CONTROL_TIMEOUT_SEC
        while not done.wait(0.05):
            if not self._thread.is_alive():
                raise RuntimeError("the proxy thread has died") from self._error
            if time.monotonic() > deadline:
                raise RuntimeError("the proxy thread did not apply a control in time")

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            self._wake_w.send(b"x")

    def _run_commands(self) -> None:
        while True:
            try:
                command, done = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            finally:
                done.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._release_held()
                self._sync_interest()
                events = self._selector.select(self._timeout())
                # Wake-ups first: a control queues its command before it wakes the
                # thread, so every command whose wake-up is drained here runs next.
                if any(key.data == "wake" for key, _ in events):
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                self._run_commands()
                for key, mask in events:
                    if key.data == "listener":
                        self._accept()
                    elif key.data != "wake":
                        side, link = key.data
                        self._on_event(link, side, mask)
                self._expire()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._stopping = True
            self._run_commands()
            for link in list(self._links):
                self._kill(link)
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def _timeout(self) -> float | None:
        if self._paused:
            return None
        deadlines = [link.deadline for link in self._links if link.doomed or link.draining]
        for link in self._links:
            for held in (link.held_to_server, link.held_to_client):
                due = held.next_due()
                if due is not None:
                    deadlines.append(due)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _release_held(self) -> None:
        """Pass on the held chunks that are due (none while paused)."""
        if self._paused:
            return
        now = time.monotonic()
        for link in self._links:
            link.held_to_server.release(now, link.to_server)
            link.held_to_client.release(now, link.to_client)

    def _forward(self, data: bytes, held: _Held, buffer: bytearray) -> float:
        """Queue ``data`` to be sent (``buffer``), held back first while a delay is on
        or earlier chunks are held; returns when it moves on (monotonic)."""
        now = time.monotonic()
        if self._delay_sec > 0 or held:
            return held.add(now + self._delay_sec, data)
        buffer += data
        return now

    def _expire(self) -> None:
        if self._paused:
            return
        now = time.monotonic()
        for link in list(self._links):
            if link.draining and now >= link.deadline:
                self._kill(link)
            elif link.doomed and now >= link.deadline:
                self._cut_client(link)

    def _want(self, sock: socket.socket, mask: int, data: tuple[str, _Link]) -> None:
        current = self._masks.get(sock, 0)
        if mask == current:
            return
        if not mask:
            self._selector.unregister(sock)
            del self._masks[sock]
        elif not current:
            self._selector.register(sock, mask, data)
            self._masks[sock] = mask
        else:
            self._selector.modify(sock, mask, data)
            self._masks[sock] = mask

    def _forget(self, sock: socket.socket) -> None:
        if sock in self._masks:
            self._selector.unregister(sock)
            del self._masks[sock]

    def _sync_interest(self) -> None:
        read, write = selectors.EVENT_READ, selectors.EVENT_WRITE
        for link in self._links:
            client_mask = server_mask = 0
            if not self._paused:
                if not link.draining:
                    queued = len(link.to_server) + link.held_to_server.size
                    if not (link.client_eof or link.doomed) and queued < _HIGH_WATER:
                        client_mask |= read
                    if link.to_client:
                        client_mask |= write
                queued = len(link.to_client) + link.held_to_client.size
                if not link.server_eof and queued < _HIGH_WATER:
                    server_mask |= read
                if link.to_server:
                    server_mask |= write
            if not link.draining:
                self._want(link.client, client_mask, ("client", link))
            self._want(link.server, server_mask, ("server", link))

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        self.connections_accepted += 1
        if self._refusing:
            _abort(client)
            return
        try:
            server = socket.create_connection(self.upstream, timeout=self.connect_timeout_sec)
        except OSError:
            _abort(client)
            return
        for sock in (client, server):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._links.add(_Link(client, server))

    def _on_event(self, link: _Link, side: str, mask: int) -> None:
        # Controls applied this round, or an earlier event, may have changed things.
        if link.closed or self._paused:
            return
        if side == "client":
            if link.draining:
                return
            if mask & selectors.EVENT_WRITE:
                self._send(link, link.client, link.to_client, "client")
            if not link.closed and mask & selectors.EVENT_READ:
                self._client_readable(link)
        else:
            if mask & selectors.EVENT_WRITE:
                self._send(link, link.server, link.to_server, "server")
            if not link.closed and mask & selectors.EVENT_READ:
                self._server_readable(link)
        if not link.closed:
            self._maybe_finish(link)

    def _send(self, link: _Link, sock: socket.socket, buffer: bytearray, side: str) -> None:
        if not buffer:
            return
        try:
            sent = sock.send(buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._kill(link)
            return
        del buffer[:sent]
        if side == "client":
            self.bytes_to_client += sent
        else:
            self.bytes_to_server += sent

    def _recv(self, link: _Link, sock: socket.socket) -> bytes | None:
        """A chunk, b"" at EOF, or None when there is nothing (or the link died)."""
        try:
            return sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:  # reset by the peer: pass the reset on to the other side
            self._kill(link)
            return None

    def _client_readable(self, link: _Link) -> None:
        data = self._recv(link, link.client)
        if data is None:
            return
        if not data:
            link.client_eof = True
            return
        if self._pause_marker is not None and self._pause_marker in data:
            self._pause_marker = None
            self._paused = True  # the chunk waits with the rest, until resume()
        reaches_server = self._forward(data, link.held_to_server, link.to_server)
        if self._drop_after > 0:
            self._drop_after -= 1
            link.doomed = True
            link.deadline = reaches_server + _REPLY_GRACE_SEC

    def _server_readable(self, link: _Link) -> None:
        data = self._recv(link, link.server)
        if data is None:
            return
        if not data:
            link.server_eof = True
            return
        if link.draining:
            self.bytes_dropped += len(data)
        elif link.doomed:
            self.bytes_dropped += len(data)
            self._cut_client(link)
        elif self._dropping_replies:
            self.bytes_dropped += len(data)
        else:
            self._forward(data, link.held_to_client, link.to_client)

    def _cut_client(self, link: _Link) -> None:
        """Reset the client's side; the server's side gets the rest of what the client
        sent, then a FIN, and is read until it closes."""
        self._forget(link.client)
        _abort(link.client)
        link.doomed = False
        link.draining = True
        link.to_client.clear()
        link.held_to_client.clear()
        # What the client sent and delay() still holds reaches the server first.
        link.deadline = max(time.monotonic(), link.held_to_server.last_due() or 0.0)
        link.deadline += _REPLY_GRACE_SEC
        self._maybe_finish(link)

    def _maybe_finish(self, link: _Link) -> None:
        """Pass a FIN on once its direction is flushed; close when both are done."""
        try:
            if (
                (link.client_eof or link.draining)
                and not (link.to_server or link.held_to_server)
                and not link.server_shut
            ):
                link.server.shutdown(socket.SHUT_WR)
                link.server_shut = True
            if (
                link.server_eof
                and not (link.to_client or link.held_to_client)
                and not link.client_shut
                and not link.draining
            ):
                link.client.shutdown(socket.SHUT_WR)
                link.client_shut = True
        except OSError:
            self._kill(link)
            return
        if link.server_shut and link.server_eof and (link.client_shut or link.draining):
            self._forget(link.server)
            link.server.close()
            if not link.draining:
                self._forget(link.client)
                link.client.close()
            link.closed = True
            self._links.discard(link)

    def _kill(self, link: _Link) -> None:
        """Reset both sides of ``link`` now."""
        if link.closed:
            return
        link.closed = True
        self._links.discard(link)
        for sock in (link.client, link.server):
            self._forget(sock)
            _abort(sock)  # a second close (the client side, once cut) does nothing

    def _reset_all(self) -> None:
        for link in list(self._links):
            self._kill(link)


# -- real error replies -----------------------------------------------------------


def server_error(exc: ResponseError) -> str:
    """The error line as the server sent it (redis-py moves its first word, for the
    errors it knows, into ``status_code``)."""
    code = getattr(exc, "status_code", None)
    return f"{code} {exc}" if code else str(exc)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _config_get(admin: redis.Redis, name: str) -> str | None:
    found = {_text(k): _text(v) for k, v in dict(admin.config_get(name)).items()}
    return found.get(name)


def _config_set(admin: redis.Redis, name: str, value: str | int) -> None:
    admin.config_set(name, value)


def server_version(admin: redis.Redis) -> tuple[int, ...]:
    """The Redis version a server reports (Valkey reports 7.2.4, whose behaviour it keeps)."""
    info = admin.info("server")
    return tuple(int(part) for part in _text(info["redis_version"]).split(".")[:3])


_PROBE_KEY = "anarchon-faults:probe"


def _probe_write(admin: redis.Redis) -> ResponseError | None:
    """The error a SET gets now, or None (the probe key is then deleted again)."""
    try:
        admin.set(_PROBE_KEY, "1")
    except ResponseError as exc:
        return exc
    admin.delete(_PROBE_KEY)
    return None


@contextlib.contextmanager
def oom(admin: redis.Redis) -> Iterator[None]:
    """Writes get ``OOM command not allowed when used memory > 'maxmemory'.`` inside
    the block (see the module's docstring for scripts): maxmemory is set to 1 byte,
    below any server's used memory, with maxmemory-policy noeviction so that
    nothing is evicted. Both settings are put back on exit. Reads still work.

    ``admin``: a synchronous ``redis.Redis`` straight to the server (``protocol=2``).
    """
    try:
        old_limit = _config_get(admin, "maxmemory")
        old_policy = _config_get(admin, "maxmemory-policy")
    except ResponseError as exc:
        pytest.skip(f"oom: CONFIG GET refused: {exc}")
    if old_limit is None or old_policy is None:
        pytest.skip("oom: the server has no maxmemory settings")

    def restore() -> None:
        _config_set(admin, "maxmemory", old_limit)
        _config_set(admin, "maxmemory-policy", old_policy)

    try:
        _config_set(admin, "maxmemory-policy", "noeviction")
        _config_set(admin, "maxmemory", 1)
    except ResponseError as exc:
        with contextlib.suppress(ResponseError):
            restore()
        pytest.skip(f"oom: CONFIG SET refused: {exc}")
    try:
        error = _probe_write(admin)
        if not isinstance(error, OutOfMemoryError):
            pytest.skip(f"oom: a SET over maxmemory got {error!r} instead of OOM")
        yield
    finally:
        restore()


@contextlib.contextmanager
def read_only(admin: redis.Redis) -> Iterator[None]:
    """Writes get ``READONLY You can't write against a read only replica.`` inside
    the block: the server becomes a replica (REPLICAOF) of a loopback port held
    bound but not listening, so every attempt to sync is refused and the data is
    kept (a replica drops its data only when a sync begins; checked on every
    server of the module's docstring). Reads still work, as
    replica-serve-stale-data is on by default. On exit, REPLICAOF NO ONE.

    Becoming a replica also ends blocking commands (BLPOP, XREAD BLOCK ...) with
    an UNBLOCKED error. ``admin``: a synchronous ``redis.Redis`` straight to the
    server (``protocol=2``).
    """
    role = _text(admin.info("replication").get("role", ""))
    if role != "master":
        pytest.skip(f"read_only: the server is a {role or 'server of unknown role'} already")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as nowhere:
        nowhere.bind(("127.0.0.1", 0))  # bound, never listening: connections refused
        try:
            admin.replicaof("127.0.0.1", nowhere.getsockname()[1])
        except ResponseError as exc:
            pytest.skip(f"read_only: REPLICAOF refused: {exc}")
        try:
            error = _probe_write(admin)
            if not isinstance(error, ReadOnlyError):
                pytest.skip(f"read_only: a SET on the replica got {error!r} instead of READONLY")
            yield
        finally:
            admin.replicaof("NO", "ONE")


# Read-only, so that SCRIPT KILL may end it. TIME inside a script can be the
# server's cached clock, which Redis 8 and Valkey 8+ move on only once the
# script is past busy-reply-threshold: ``seconds`` counts from there at worst.
_BUSY_SCRIPT = """
local start = redis.call('TIME')
local limit = tonumber(ARGV[1]) * 1000000
while true do
  local now = redis.call('TIME')
  if (now[1] - start[1]) * 1000000 + (now[2] - start[2]) >= limit then
    return 1
  end
end
"""


@contextlib.contextmanager
def busy(admin_url: str, *, threshold_ms: int = 100, seconds: float = 10.0) -> Iterator[None]:
    """Every other client gets ``BUSY ... is busy running a script. You can only call
    SCRIPT KILL or SHUTDOWN NOSAVE.`` inside the block.

    A read-only Lua loop runs on a connection of its own, in a thread, for at most
    ``seconds``; lua-time-limit (alias of busy-reply-threshold on Redis 7+ and
    Valkey, 5000 ms by default) is set to ``threshold_ms`` first, so that BUSY
    replies start that soon. The block is entered once a PING got BUSY. On exit,
    SCRIPT KILL ends the loop, the thread is joined and lua-time-limit put back.
    """
    admin = redis.Redis.from_url(admin_url, protocol=2, decode_responses=True)
    try:
        old_limit = _config_get(admin, "lua-time-limit")
        if old_limit is None:
            pytest.skip("busy: the server has no lua-time-limit setting")
        _config_set(admin, "lua-time-limit", threshold_ms)
    except ResponseError as exc:
        admin.close()
        pytest.skip(f"busy: CONFIG refused: {exc}")
    except BaseException:
        admin.close()
        raise

    outcome: list[BaseException | Any] = []
    runner = redis.Redis.from_url(
        admin_url, protocol=2, decode_responses=True, socket_timeout=seconds + 30
    )

    def run() -> None:
        try:
            outcome.append(runner.eval(_BUSY_SCRIPT, 0, seconds))
        except BaseException as exc:  # the caller reads it
            outcome.append(exc)

    thread = threading.Thread(target=run, name="busy-script", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 5 + threshold_ms / 1000
        while True:
            try:
                admin.ping()
            except ResponseError as exc:
                if str(exc).startswith("BUSY"):
                    break
                raise
            if outcome:
                pytest.skip(f"busy: the script ended before BUSY: {outcome[0]!r}")
            if time.monotonic() > deadline:
                pytest.skip("busy: the server never answered BUSY")
            time.sleep(0.01)
        yield
    finally:
        give_up = time.monotonic() + seconds + 30
        while thread.is_alive() and time.monotonic() < give_up:
            try:
                admin.script_kill()
            except ResponseError as exc:
                if not str(exc).startswith("NOTBUSY"):  # not started, or ended
                    raise
            thread.join(0.2)
        runner.close()
        try:
            _config_set(admin, "lua-time-limit", old_limit)
        finally:
            admin.close()
