"""The least an ACL user needs to run anarchon under a prefix: its keys, its hint channel
and the commands the store sends (from Python and from its scripts). ``anarchon acl``
prints it; ``tests/test_acl.py`` runs every strategy, timers, the registry, the
inspector and the dashboard's actions as a user that has exactly this."""

from __future__ import annotations

import re

from .keys import hint_channel

__all__ = ["COMMANDS", "IDMP_COMMANDS", "OPTIONAL_COMMANDS", "acl_rules"]

#: Every command anarchon sends to a standalone server (its scripts' own included),
#: whatever the strategy.
COMMANDS = (
    "+@connection",
    "+info",
    "+time",
    "+evalsha",
    "+eval",
    "+get",
    "+set",
    "+del",
    "+exists",
    "+pexpire",
    "+mget",
    "+hget",
    "+hgetall",
    "+hkeys",
    "+hmget",
    "+hset",
    "+hsetnx",
    "+hdel",
    "+hexists",
    "+hincrby",
    "+sadd",
    "+srem",
    "+smembers",
    "+zadd",
    "+zrem",
    "+zcard",
    "+zrange",
    "+zrangebyscore",
    "+zrevrange",
    "+zremrangebyscore",
    "+zremrangebyrank",
    "+xadd",
    "+xrange",
    "+xtrim",
    "+xdel",
    "+xinfo|stream",
    "+publish",
    "+subscribe",
    "+unsubscribe",
)
#: The idmp strategy's too (Redis 8.6+: other servers know no such command, and refuse a
#: rule that names it).
IDMP_COMMANDS = ("+xcfgset",)
#: Asked for, but not needed: without it, the scheduler skips its warning about a
#: maxmemory-policy that may evict timers.
OPTIONAL_COMMANDS = ("+config|get",)

_GLOB = re.compile(r"([*?\[\]\\])")


def _literal(text: str) -> str:
    """``text`` as an ACL pattern matches it: glob characters escaped."""
    return _GLOB.sub(r"\\\1", text)


def acl_rules(prefix: str, *, idmp: bool = False, optional: bool = True) -> list[str]:
    """The rules of ``ACL SETUSER`` for a user of ``prefix`` (after ``on`` and its
    password): every key under the prefix (``<prefix>...`` and the hash-tagged
    ``{<prefix>...``), the prefix's hint channel, and ``COMMANDS`` (with ``idmp``, the
    idmp strategy's too)."""
    pattern = _literal(prefix)
    rules = [
        "resetkeys", f"~{pattern}*", f"~{{{pattern}*",
        "resetchannels", f"&{_literal(hint_channel(prefix))}",
        "-@all", *COMMANDS,
    ]  # fmt: skip
    if idmp:
        rules += IDMP_COMMANDS
    if optional:
        rules += OPTIONAL_COMMANDS
    return rules
