"""The errors the command line reports itself: a command line that cannot work as
given, and an optional dependency that is not installed."""

from __future__ import annotations

from datetime import datetime


class UsageError(Exception):
    """A command line that cannot work as given: exit code 2."""


class MissingExtra(Exception):
    """An optional dependency the command needs is not installed: exit code 1, as for
    any failure at run time (it is no mistake in the command line)."""


def parse_instant(option: str, text: str) -> datetime:
    """An option's ISO 8601 instant, with its offset (``UsageError`` otherwise)."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"{option} must be ISO 8601 such as 2027-03-14T00:00:00-05:00, got {text!r}"
        ) from None
    if moment.tzinfo is None:
        raise UsageError(f"{option} needs an offset (such as +00:00 or Z), got {text!r}")
    return moment
