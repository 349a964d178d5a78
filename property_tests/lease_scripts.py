"""The shipped lease and timer scripts with the server's clock swapped for an argument.

The server's TIME cannot be set, so the state machines load the scripts with the one
clock read replaced: ``server_now_ms()`` returns the last argument (taken off ``ARGV``
before the script reads it) instead of reading TIME. It is the same text
``anarchon.testing`` runs on virtual time (``virtual_clock``), so the machines, which
check these scripts against their models on every server, check the kit's too.
Everything else is byte-identical (a test checks it).
"""

from __future__ import annotations

from anarchon._store.scripts import lease_script, timer_script
from anarchon.testing._store import CLOCK_READ, VIRTUAL_CLOCK_READ, virtual_clock

__all__ = ["CLOCK_ARGUMENT", "CLOCK_READ", "timed_script", "timed_timer_script"]

CLOCK_ARGUMENT = VIRTUAL_CLOCK_READ


def timed_script(name: str) -> str:
    """The shipped lease script ``name`` whose clock is its last argument."""
    return virtual_clock(lease_script(name).body)


def timed_timer_script(name: str) -> str:
    """The shipped timer script ``name`` whose clock is its last argument."""
    return virtual_clock(timer_script(name).body)
