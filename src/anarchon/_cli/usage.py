"""The errors the command line reports itself: a command line that cannot work as
given, and an optional dependency that is not installed."""

from __future__ import annotations


class UsageError(Exception):
    """A command line that cannot work as given: exit code 2."""


class MissingExtra(Exception):
    """An optional dependency the command needs is not installed: exit code 1, as for
    any failure at run time (it is no mistake in the command line)."""
