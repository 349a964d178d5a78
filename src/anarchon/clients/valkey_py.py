"""Adapter for valkey-py: the same interface as redis-py, its own exception classes."""

from __future__ import annotations

from typing import Any

from ._protocol import Connection
from .redis_py import ClientErrors, RedisAsyncConnection, RedisSyncConnection

__all__ = ["valkey_connection"]


def valkey_connection(client: Any, *, is_async: bool) -> Connection:
    import valkey.exceptions

    errors = ClientErrors.of(valkey.exceptions)
    if is_async:
        return RedisAsyncConnection(client, owned=False, errors=errors)
    return RedisSyncConnection(client, owned=False, errors=errors)
