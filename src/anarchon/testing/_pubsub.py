"""A subscription of the kit's own, on the event loop (no thread): the hints of a fleet
on virtual time arrive as they do in production, and nothing waits for a thread in
real time while the loop's deadlines are virtual."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote, urlsplit

import anyio
import anyio.abc

from .._errors import TransportError

__all__ = ["subscribe"]

#: The most one message may hold (a hint is a few dozen bytes).
_MAX_LINE = 1 << 20


def _command(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _Reader:
    """Reads RESP2 replies (what a subscription receives) from a stream."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self._stream = stream
        self._buffer = b""

    async def _fill(self) -> None:
        chunk = await self._stream.receive()
        self._buffer += chunk
        if len(self._buffer) > _MAX_LINE:
            raise TransportError("a subscription message larger than 1 MiB")

    async def _line(self) -> bytes:
        while b"\r\n" not in self._buffer:
            await self._fill()
        line, _, self._buffer = self._buffer.partition(b"\r\n")
        return line

    async def read(self) -> object:
        line = await self._line()
        kind, rest = line[:1], line[1:]
        if kind in (b"+", b":"):
            return rest
        if kind == b"-":
            raise TransportError(f"the server refused the subscription: {rest.decode()[:200]}")
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            while len(self._buffer) < size + 2:
                await self._fill()
            data, self._buffer = self._buffer[:size], self._buffer[size + 2 :]
            return data
        if kind == b"*":
            return [await self.read() for _ in range(int(rest))]
        raise TransportError(f"not a RESP reply: {line[:40]!r}")


async def subscribe(
    url: str,
    channel: str,
    on_message: Callable[[str], None],
    subscribed: Callable[[], None],
) -> None:
    """Subscribe to ``channel`` on the server of ``url`` (calling ``subscribed`` once the
    server confirmed it) and call ``on_message`` with each message's text, until
    cancelled."""
    parts = urlsplit(url)
    try:
        stream = await anyio.connect_tcp(parts.hostname or "127.0.0.1", parts.port or 6379)
    except OSError as exc:
        raise TransportError(f"cannot subscribe: {exc}") from exc
    async with stream:
        reader = _Reader(stream)
        try:
            if parts.password is not None:
                user = unquote(parts.username or "default")
                await stream.send(_command("AUTH", user, unquote(parts.password)))
                await reader.read()
            await stream.send(_command("SUBSCRIBE", channel))
            await reader.read()
            subscribed()
            while True:
                message = await reader.read()
                if isinstance(message, list) and message[:1] == [b"message"]:
                    data = message[2]
                    if isinstance(data, bytes):
                        on_message(data.decode("utf-8", "replace"))
        except (OSError, anyio.EndOfStream, anyio.BrokenResourceError) as exc:
            raise TransportError(f"the subscription ended: {exc!r}") from exc
