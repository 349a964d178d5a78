"""The one way anarchon shows a connection URL: with its password, and whatever could
be one, replaced by ``***``. Every message, log line, page and header that names a
URL shows it through ``redact_url``, and a URL is redacted before anything about it is
checked (so an error about a malformed URL never quotes its secret)."""

from __future__ import annotations

import re

__all__ = ["redact_url"]

#: Query parameters that carry a secret (``password``, ``sentinel_password``, ...).
_SECRET_PARAMETER = re.compile(r"(?i)([?&;][^=&;#]*(?:pass|secret|token|auth)[^=&;#]*=)[^&;#]*")


def redact_url(url: object) -> str:
    """``url`` as text that can be shown anywhere.

    The user info is everything between the scheme and the last ``@`` before the
    path's query: its user name (up to the first ``:``) stays, the rest becomes
    ``***``. That holds whatever the URL's shape: one slash after the scheme
    (``redis:/user:pw@host``), no scheme at all, a password holding ``@`` or ``/``.
    Query parameters named for a secret (``password=``, ``sentinel_password=``) are
    masked too.
    """
    text = str(url)
    scheme, separator, rest = text.partition("://")
    if not separator:
        scheme, separator, rest = text.partition(":")
        if not separator or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
            scheme, separator, rest = "", "", text
    body, question, query = rest.partition("?")
    if "@" in body:
        user_info, _, place = body.rpartition("@")
        user, colon, _ = user_info.partition(":")
        # No colon: the whole user info may be a password (redis://SECRET@host).
        body = (f"{user}:***" if colon else "***") + "@" + place
    shown = f"{scheme}{separator}{body}{question}{query}"
    return _SECRET_PARAMETER.sub(r"\1***", shown)
