"""Text from outside (a stored name, a handler's error, a timer's key) as anarchon shows
it in a log line, a terminal or a message: control characters and the invisible
characters that can make two names look alike (zero-width, bidi controls) escaped, and
long text cut with a note of how long it was."""

from __future__ import annotations

import re

__all__ = ["INVISIBLE", "visible"]

#: C0 and C1 controls, DEL, and the characters that change or hide what is shown:
#: zero-width spaces and joiners, bidi marks, embeddings, overrides and isolates, the
#: word joiner and invisible operators, and the byte order mark.
INVISIBLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u206f\ufeff]"
)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: object, limit: int | None = None) -> str:
    """``text`` with every ``INVISIBLE`` character escaped (``\\x1b``, ``\\u200b``), and cut
    to ``limit`` characters (with ``...(N chars)`` telling the length) when it is longer."""
    shown = "" if text is None else str(text)
    if limit is not None and len(shown) > limit:
        shown = f"{shown[:limit]}...({len(shown)} chars)"
    return INVISIBLE.sub(_escape, shown)
