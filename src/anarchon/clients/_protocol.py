"""The one seam between anarchon and a client library.

Everything above this module speaks ``Connection``: send one command, or a
batch of commands in one round trip. Adapters (one module per client library)
turn a library's client into a ``Connection`` and normalise its replies, so
nothing above knows which library is underneath.
"""

from __future__ import annotations

import ssl
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from .._errors import ServerReplyError, TransportError

__all__ = [
    "Arg",
    "Command",
    "Connection",
    "ServerReplyError",
    "TransportError",
    "is_transient",
    "refused_certificate",
    "normalize_reply",
    "stream_entries",
]

Arg = str | int | float | bytes
Command = Sequence[Arg]


#: Client libraries that turn an error reply into an exception class and drop the
#: code from the message (redis-py, valkey-py, and ``send()`` clients built on them):
#: the class names, subclasses before their bases (MasterDownError is a
#: ClusterDownError), and the codes anarchon acts on.
REPLY_ERROR_CLASSES = (
    ("NoScriptError", "NOSCRIPT"),
    ("ReadOnlyError", "READONLY"),
    ("OutOfMemoryError", "OOM"),
    ("BusyLoadingError", "LOADING"),
    ("TryAgainError", "TRYAGAIN"),
    ("MasterDownError", "MASTERDOWN"),
    ("ClusterDownError", "CLUSTERDOWN"),
    ("MovedError", "MOVED"),
    ("AskError", "ASK"),
    ("NoPermissionError", "NOPERM"),
    ("AuthenticationError", "NOAUTH"),
)


#: Error replies that a later try gets past: the server is loading its data, busy
#: with a script, out of memory for now, read-only after a failover, or part of a
#: cluster that is failing over or moving slots. Every other reply (WRONGTYPE,
#: NOAUTH, WRONGPASS, NOPERM, ERR: an unknown command, a script error) is
#: permanent: trying again gives the same answer.
TRANSIENT_REPLY_CODES = frozenset(
    {
        "LOADING",
        "BUSY",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "MOVED",
        "ASK",
        "READONLY",
        "OOM",
        "MASTERDOWN",
        "NOREPLICAS",
        "NOSCRIPT",
    }
)


def is_transient(exc: BaseException) -> bool:
    """Whether trying again later can succeed: the one classification of errors.

    Transport failures (a reset or refused connection, a timeout, a lost reply) and
    the error replies of ``TRANSIENT_REPLY_CODES`` are transient; other error
    replies are permanent. A group of errors (a client that sends a batch
    concurrently) is transient if any of its errors is. Anything else is an error
    of a client library that its adapter did not know: taken as transient, so that
    it is retried rather than ending the scheduler."""
    if isinstance(exc, BaseExceptionGroup):
        return any(is_transient(inner) for inner in exc.exceptions)
    if isinstance(exc, ServerReplyError):
        return exc.kind in TRANSIENT_REPLY_CODES
    return True


def refused_certificate(exc: BaseException) -> bool:
    """Whether TLS refused the server's certificate (an unknown CA, another host name)
    somewhere in the causes of ``exc``: a failure that trying again cannot mend, unlike
    the transport failures ``is_transient`` counts."""
    seen: BaseException | None = exc
    looked: set[int] = set()
    while seen is not None and id(seen) not in looked:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        looked.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    return False


class Connection(ABC):
    """A connection anarchon sends commands through.

    ``owned`` is True when anarchon opened it (from a URL or options) and so
    closes it on stop; a client the user passed is never closed.
    """

    owned: bool = False
    #: A short description for error messages and logs.
    description: str = "connection"

    @abstractmethod
    async def execute(self, command: Command) -> Any:
        """Send one command; return the normalised reply or raise ServerReplyError."""

    @abstractmethod
    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        """Send commands in one round trip; error replies come back as ServerReplyError
        items. A reply lost (a cluster node's connection cut while its replies were
        read) fails the whole round trip with TransportError, as a standalone server's
        does: it is never handed back as if it were that command's answer."""

    async def listen(self, channel: str, on_message: Callable[[str], None]) -> None:
        """Subscribe to ``channel`` on a connection of its own and call ``on_message``
        with each message's text, until cancelled; a failure of that connection raises.

        Optional: anarchon uses it for hints (a timer set elsewhere that is due sooner
        than an instance would look), never for correctness. An adapter that cannot
        subscribe raises ``NotImplementedError``, and its instances poll."""
        raise NotImplementedError(f"{self.description} cannot subscribe")

    async def aclose(self) -> None:  # noqa: B027 - closing is optional for adapters
        """Release what the adapter opened. Only called when ``owned``."""

    async def close_if_owned(self) -> None:
        """Close the connection if anarchon opened it: even when cancelled (shielded),
        and never for long (5 s)."""
        if self.owned:
            with anyio.move_on_after(5, shield=True):
                await self.aclose()


def whole_round_trip(replies: Sequence[Any], convert: Callable[[Any], Any]) -> list[Any]:
    """``replies`` of a batch, each through ``convert``; a transport failure in place of a
    reply (a cluster client hands one back for each command of a node whose connection
    was lost mid-read: applied or not, nobody knows) is raised for the whole round trip,
    which its caller tries again like any other."""
    converted = [convert(reply) for reply in replies]
    for reply in converted:
        if isinstance(reply, TransportError):
            raise reply
    return converted


_SEQUENCES = (list, tuple, set)


def normalize_reply(reply: Any) -> Any:
    """Make replies look the same whatever the client: bytes become str, nested lists are lists.

    RESP3 maps (dicts) keep their shape with normalised keys and values;
    RESP3 sets become lists.
    """
    kind = type(reply)
    if kind is int:  # the commonest answer, and the commonest item of a list
        return reply
    if kind is list or isinstance(reply, _SEQUENCES):
        return [item if type(item) is int else normalize_reply(item) for item in reply]
    if isinstance(reply, bytes):
        return reply.decode("utf-8", "replace")
    if isinstance(reply, dict):
        return {normalize_reply(k): normalize_reply(v) for k, v in reply.items()}
    return reply


def score_pairs(reply: Any) -> list[tuple[Any, Any]]:
    """A ``WITHSCORES`` reply (ZRANGE, ZREVRANGE) as ``[(member, score)]``, whether the
    client gave it flat (RESP2), as pairs (RESP3) or as a map."""
    if isinstance(reply, dict):
        return list(reply.items())
    items = list(reply or [])
    if items and isinstance(items[0], list | tuple):
        return [(item[0], item[1]) for item in items]
    return list(zip(items[::2], items[1::2], strict=True))


def stream_entries(reply: Any) -> list[tuple[str, dict[str, str]]]:
    """XRANGE's reply as ``[(id, {field: value})]``, whether the client gave the RESP2
    shape ``[[id, [f, v, ...]], ...]`` or a map ``{id: [[f, v], ...]}`` (GLIDE)."""
    if isinstance(reply, dict):
        items = list(reply.items())
    else:
        items = [(entry[0], entry[1]) for entry in reply or []]
    entries: list[tuple[str, dict[str, str]]] = []
    for entry_id, raw in items:
        fields: dict[str, str] = {}
        if isinstance(raw, dict):
            fields = {str(k): str(v) for k, v in raw.items()}
        elif raw and isinstance(raw[0], list):
            fields = {str(pair[0]): str(pair[1]) for pair in raw}
        else:
            fields = {str(raw[i]): str(raw[i + 1]) for i in range(0, len(raw) - 1, 2)}
        entries.append((str(entry_id), fields))
    return entries
