"""Redis Sentinel: a ``redis+sentinel://`` (or ``valkey+sentinel://``) URL, or an options
mapping with a ``sentinel`` entry, becomes a redis-py client that asks the Sentinels
which server is the primary, and asks again after a failover.

URL: ``redis+sentinel://[user:password@]host[:port][,host[:port]...]/<master>[/<db>]``
with ``sentinel_username`` and ``sentinel_password`` as query parameters when the
Sentinels need their own credentials (the user and password before the hosts are the
primary's). A Sentinel's port defaults to 26379.

Options: ``{"sentinel": {"master": "mymaster", "sentinels": ["host:26379", ...],
"username": ..., "password": ...}, "password": ..., "username": ..., "db": ...}``: the
``sentinel`` entry names the master and the Sentinels (with the Sentinels' own
credentials); the rest are the primary's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

from .._errors import InvalidOptionError
from .redact import redact_url

__all__ = ["SentinelSpec", "is_sentinel_url", "open_sentinel"]

# The user info runs to the last '@' before the hosts: a password may hold '@', '/', '?'.
_URL = re.compile(
    r"^(redis|valkey)\+sentinel://(?:(?P<auth>.*)@)?(?P<hosts>[^/?#@]+)"
    r"/(?P<master>[^/?]+)(?:/(?P<db>\d+))?/?(?:\?(?P<query>.*))?$"
)
_DEFAULT_PORT = 26379
_SENTINEL_KEYS = frozenset({"master", "sentinels", "username", "password"})


def is_sentinel_url(url: str) -> bool:
    return url.startswith(("redis+sentinel://", "valkey+sentinel://"))


@dataclass(frozen=True, slots=True)
class SentinelSpec:
    master: str
    sentinels: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    @classmethod
    def from_url(cls, url: str) -> SentinelSpec:
        match = _URL.match(url)
        if match is None:
            raise InvalidOptionError(
                f"cannot read the Sentinel URL {redact_url(url)!r}: write "
                "redis+sentinel://[user:password@]host:26379[,host:26379...]/<master>[/<db>]"
            )
        username = password = None
        if match["auth"]:
            user, colon, secret = match["auth"].partition(":")
            username = unquote(user) or None
            password = unquote(secret) if colon else None
        query = {key: values[-1] for key, values in parse_qs(match["query"] or "").items()}
        unknown = set(query) - {"sentinel_username", "sentinel_password"}
        if unknown:
            raise InvalidOptionError(
                f"unknown Sentinel URL parameter(s) {sorted(unknown)}: a Sentinel URL takes "
                "sentinel_username and sentinel_password"
            )
        return cls(
            master=unquote(match["master"]),
            sentinels=tuple(_address(part) for part in match["hosts"].split(",")),
            db=int(match["db"] or 0),
            username=username,
            password=password,
            sentinel_username=query.get("sentinel_username"),
            sentinel_password=query.get("sentinel_password"),
        )

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SentinelSpec:
        sentinel = options["sentinel"]
        if not isinstance(sentinel, Mapping):
            raise InvalidOptionError(
                "the sentinel option is a mapping: {'master': 'mymaster', 'sentinels': "
                "['host:26379', ...]} (with 'username' and 'password' for the Sentinels)"
            )
        unknown = set(sentinel) - _SENTINEL_KEYS
        if unknown or "master" not in sentinel or not sentinel.get("sentinels"):
            raise InvalidOptionError(
                f"the sentinel option needs 'master' and 'sentinels' (and takes 'username' "
                f"and 'password'), got {sorted(sentinel)}"
            )
        addresses = sentinel["sentinels"]
        if isinstance(addresses, str):
            addresses = [addresses]
        return cls(
            master=str(sentinel["master"]),
            sentinels=tuple(
                _address(a) if isinstance(a, str) else (str(a[0]), int(a[1])) for a in addresses
            ),
            db=int(options.get("db", 0)),
            username=options.get("username"),
            password=options.get("password"),
            sentinel_username=sentinel.get("username"),
            sentinel_password=sentinel.get("password"),
        )

    def describe(self) -> str:
        hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.master}"


def _address(text: str) -> tuple[str, int]:
    host, colon, port = text.strip().rpartition(":")
    if not colon:
        return text.strip(), _DEFAULT_PORT
    if not port.isdigit() or not host:
        raise InvalidOptionError(
            f"a Sentinel's address is host or host:port, got {redact_url(text)!r}"
        )
    return host.strip("[]"), int(port)


def open_sentinel(spec: SentinelSpec, own: dict[str, Any], asyncio: bool) -> Any:
    """A redis-py client (asyncio or sync) of the master ``spec`` names, through its
    Sentinels, and the Sentinel object (its Sentinel connections close with it)."""
    primary: dict[str, Any] = {"db": spec.db, **own}
    if spec.username is not None:
        primary["username"] = spec.username
    if spec.password is not None:
        primary["password"] = spec.password
    sentinel_kwargs: dict[str, Any] = {"protocol": 2}
    if spec.sentinel_username is not None:
        sentinel_kwargs["username"] = spec.sentinel_username
    if spec.sentinel_password is not None:
        sentinel_kwargs["password"] = spec.sentinel_password
    if asyncio:
        from redis.asyncio.sentinel import Sentinel as AsyncSentinel

        sentinel_class: Any = AsyncSentinel  # typed in some redis-py releases, not all
    else:
        from redis.sentinel import Sentinel

        sentinel_class = Sentinel
    found = sentinel_class(list(spec.sentinels), sentinel_kwargs=sentinel_kwargs, **primary)
    return found.master_for(spec.master), found
