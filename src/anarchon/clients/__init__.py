"""Client adapters: every way to talk to Redis or Valkey goes through ``open_connection``.

What a backend's ``redis=`` option accepts, and its checks, are in ``spec``; opening a
connection from it, and recognising a client object, in ``connect``; the adapters in
``redis_py``, ``valkey_py``, ``glide`` and ``send``, the interface they implement in
``_protocol``."""

from __future__ import annotations

from ._protocol import (
    Arg,
    Command,
    Connection,
    ServerReplyError,
    TransportError,
    is_transient,
    normalize_reply,
    refused_certificate,
    score_pairs,
    stream_entries,
)
from .connect import describe_client, open_connection, running_under_asyncio
from .spec import ConnectionSpec, url_for_redis_py
from .spec import validate_options as validate_options

__all__ = [
    "Arg",
    "Command",
    "Connection",
    "ConnectionSpec",
    "ServerReplyError",
    "TransportError",
    "describe_client",
    "is_transient",
    "refused_certificate",
    "normalize_reply",
    "open_connection",
    "running_under_asyncio",
    "score_pairs",
    "stream_entries",
    "url_for_redis_py",
]
