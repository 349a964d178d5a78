"""What a backend's ``redis=`` / ``valkey=`` option accepts, and the checks made of it
before anything is opened: an options mapping's keys, a URL as redis-py will read it."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any

from .._errors import InvalidOptionError
from .redact import redact_url, scrub, user_info_end
from .sentinel import SentinelSpec

__all__ = ["ConnectionSpec", "url_for_redis_py", "validate_options"]

#: What a backend's ``redis=`` / ``valkey=`` option accepts.
ConnectionSpec = str | Mapping[str, Any] | object

_OPTION_KEYS = frozenset(
    {
        "host",
        "port",
        "password",
        "username",
        "db",
        "tls",
        "tls_ca_certs",
        "tls_certfile",
        "tls_keyfile",
        "tls_check_hostname",
        "sentinel",
    }
)


def validate_options(options: Mapping[str, Any]) -> None:
    """Reject unknown keys of an options mapping early, at backend construction."""
    unknown = set(options) - _OPTION_KEYS
    if unknown:
        raise InvalidOptionError(
            f"unknown connection option(s) {sorted(unknown)}; the options mapping takes "
            f"{sorted(_OPTION_KEYS)}, or pass a URL such as 'redis://user:pass@host:6379/0'"
        )
    if "sentinel" in options:
        SentinelSpec.from_options(options)  # raises on a bad one


#: The schemes redis-py does not know, and the ones it reads them as: Valkey speaks the
#: same protocol.
_REDIS_PY_SCHEMES = {"valkey": "redis", "valkeys": "rediss"}


def url_for_redis_py(url: str) -> str:
    """``url`` as redis-py reads it as meant (``valkey://`` as ``redis://``, ``valkeys://``
    as ``rediss://``), or ``InvalidOptionError``, with the URL redacted: a password that
    holds ``/``, ``?`` or ``#`` (which end a URL's user info: redis-py would take part of
    the password for the host, the port or the query), a port that is not a number."""
    shown = redact_url(url)
    scheme, separator, rest = url.partition("://")
    scheme = _REDIS_PY_SCHEMES.get(scheme.lower(), scheme)
    end = user_info_end(rest)
    if end is not None and any(char in rest[:end] for char in "/?#"):
        raise InvalidOptionError(
            f"cannot read the connection URL {shown!r}: its user info holds '/', '?' or "
            "'#', which end it in a URL; percent-encode the password "
            "(urllib.parse.quote(password, safe=''): '/' is %2F, '?' %3F, '#' %23, '@' %40)"
        )
    try:
        urllib.parse.urlsplit(url).port  # noqa: B018 - raises on a port that is no number
    except ValueError as exc:
        raise InvalidOptionError(
            f"cannot read the connection URL {shown!r}: {scrub(str(exc))}; write "
            "redis://[user:password@]host[:port][/db]"
        ) from None
    return f"{scheme}{separator}{rest}"
