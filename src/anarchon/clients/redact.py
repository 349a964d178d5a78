"""The one way anarchon shows a connection URL, or a client library's error text: with
its password, and whatever could be one, replaced by ``***``. Every message, log line,
page and header that names a URL shows it through ``redact_url``, and a URL is redacted
before anything about it is checked (so an error about a malformed URL never quotes its
secret). Every error a client library raises is shown through ``scrub`` (the adapters
map each at one place, ``scrub_error``)."""

from __future__ import annotations

import contextlib
import re

__all__ = ["redact_url", "scrub", "scrub_error", "user_info_end"]

#: Query parameters that carry a secret (``password``, ``sentinel_password``, ...): the
#: name, then the value.
_SECRET_PARAMETER = re.compile(r"(?i)[?&;][^=&;#]*(?:pass|secret|token|auth)[^=&;#]*=([^&;#]*)")

#: What follows the ``@`` that ends a URL's user info: a host (or a Sentinel URL's hosts),
#: then the path, the query, the fragment or the end; never a query parameter's ``=``.
_HOST_THEN_REST = re.compile(r"[^/?#=&;@]*(?:[/?#]|$)")

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def _split_scheme(text: str) -> tuple[str, str]:
    """``(scheme and its separator, the rest)``; no scheme: ``("", text)``."""
    scheme, separator, rest = text.partition("://")
    if separator and _SCHEME.fullmatch(scheme):
        return scheme + separator, rest
    scheme, separator, rest = text.partition(":")
    if separator and _SCHEME.fullmatch(scheme) and rest.startswith("/"):
        return scheme + separator, rest  # one slash: redis:/user:pw@host
    return "", text  # no scheme: user:pw@host


def user_info_end(rest: str) -> int | None:
    """Where the user info of ``rest`` (a URL after its scheme) ends: the last ``@`` that
    a host follows. A password may hold any character, ``?``, ``#``, ``/`` and ``@`` too;
    a host holds none of them."""
    at = len(rest)
    while (at := rest.rfind("@", 0, at)) >= 0:
        if _HOST_THEN_REST.match(rest, at + 1):
            return at
    return None


def _password_span(rest: str, at: int) -> tuple[int, int]:
    """The secret part of the user info that ends at ``at``: after the user name's ``:``,
    or all of it (``redis://SECRET@host``)."""
    colon = rest.find(":", 0, at)
    return (colon + 1 if colon >= 0 else 0, at)


def _secret_spans(rest: str) -> list[tuple[int, int]]:
    """Everything in ``rest`` that could be a secret, read each way it could be read."""
    spans = []
    # The user info as a URL library reads it: before the query.
    query = rest.find("?")
    at = rest.rfind("@", 0, query if query >= 0 else len(rest))
    if at >= 0:
        spans.append(_password_span(rest, at))
    # ... and as a password holding '?', '#' or '/' makes it.
    end = user_info_end(rest)
    if end is not None:
        spans.append(_password_span(rest, end))
    spans += [match.span(1) for match in _SECRET_PARAMETER.finditer(rest)]
    return spans


def redact_url(url: object) -> str:
    """``url`` as text that can be shown anywhere.

    The user info is everything between the scheme and the last ``@`` that a host
    follows: its user name (up to the first ``:``) stays, the rest becomes ``***``. That
    holds whatever the URL's shape: one slash after the scheme (``redis:/user:pw@host``),
    no scheme at all, a password holding ``@``, ``/``, ``?`` or ``#``. Query parameters
    named for a secret (``password=``, ``sentinel_password=``) are masked too. Where a
    URL can be read two ways, what either way takes for a secret is masked.
    """
    text = str(url)
    head, rest = _split_scheme(text)
    hidden = [False] * len(rest)
    for start, end in _secret_spans(rest):
        hidden[start:end] = [True] * (end - start)
    shown: list[str] = []
    for index, char in enumerate(rest):
        if not hidden[index]:
            shown.append(char)
        elif index == 0 or not hidden[index - 1]:
            shown.append("***")
    return head + "".join(shown)


#: URLs inside an error's text.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\]{},]+")

#: ``password=...``, ``'password': '...'``, ``password: Some("...")``: a field named for
#: a secret (``ssl_password``, ``auth_token`` too) in a repr, a mapping or a structure.
_SECRET_FIELD = re.compile(
    r"""(?ix)
    (\b(?:\w+_)?(?:password|passwd|pwd|secret|token|auth|credentials?)(?:_\w+)?
     ['"]?\s*[=:]\s*)
    ( '[^']*' | "[^"]*" | <[^<>]*> | Some\("[^"]*"\) | [^\s,;&)>}\]]+ )
    """
)


def scrub(text: str) -> str:
    """``text`` (a client library's error) with every URL redacted and every field named
    for a secret masked: what a library puts in its errors (its connection's repr, the
    URL it was made with) is never shown or logged as it was."""
    text = _URL_IN_TEXT.sub(lambda url: redact_url(url.group(0)), text)
    return _SECRET_FIELD.sub(r"\1***", text)


def scrub_error(exc: BaseException) -> str:
    """The scrubbed text of ``exc``; ``exc`` itself and the errors it was raised from
    are scrubbed in place, so that a traceback (which prints the library's error kept as
    the cause of anarchon's) shows no secret either."""
    seen: BaseException | None = exc
    looked: set[int] = set()
    while seen is not None and id(seen) not in looked:
        looked.add(id(seen))
        text = str(seen)
        if scrub(text) != text:
            with contextlib.suppress(AttributeError, TypeError):  # args it cannot take
                seen.args = (scrub(text),)
        seen = seen.__cause__ or seen.__context__
    return scrub(str(exc))
