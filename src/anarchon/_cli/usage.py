"""The error of a command line that cannot work as given."""

from __future__ import annotations


class UsageError(Exception):
    """A command line that cannot work as given: exit code 2."""
