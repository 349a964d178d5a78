"""The least an ACL user needs to run anarchon under a prefix: its keys, its hint channel
and the commands the store sends (from Python and from its scripts), with those its
client library sends on connect. ``anarchon acl`` prints it; ``tests/test_acl.py`` runs
every strategy, timers, the registry, the inspector and the dashboard's actions as a user
that has exactly this, and checks that the user is refused the rest: ``CONFIG``, client
control, ``@dangerous`` commands, and the keys and channel of another prefix."""

from __future__ import annotations

import dataclasses

from .keys import (
    ClaimOnlyKeys,
    JobKeys,
    RegistryKeys,
    TimerKeys,
    format_key,
    glob_literal,
    hint_channel,
)

__all__ = ["COMMANDS", "CONNECT_COMMANDS", "IDMP_COMMANDS", "acl_rules", "key_patterns"]

#: What a client sends on connect, named one by one (the ``@connection`` category would
#: also grant ``CLIENT KILL``, ``CLIENT PAUSE`` and ``CLIENT LIST`` against every client
#: of the server). redis-py and valkey-py send ``AUTH`` (RESP2) or ``HELLO`` (RESP3),
#: ``CLIENT SETNAME`` (a client name), ``CLIENT SETINFO`` (their library's name and
#: version, unless told not to), ``SELECT`` (a database other than 0) and ``PING``
#: (health checks, and Sentinel's check of a primary); Valkey GLIDE the same, and
#: ``INFO REPLICATION`` (which server is the primary). Connections anarchon opens send
#: ``AUTH`` and ``SELECT`` alone.
CONNECT_COMMANDS = ("+hello", "+auth", "+client|setname", "+client|setinfo", "+select", "+ping")

#: Every command anarchon sends to a standalone server (its scripts' own included),
#: whatever the strategy. ``INFO`` is ``@dangerous`` as a whole (its sections describe
#: every client and database): the user may ask for three sections only, ``server``
#: (the version, checked at start), ``memory`` (the eviction policy, which decides
#: whether timers may be dropped) and ``replication`` (GLIDE's look for the primary).
COMMANDS = (
    *CONNECT_COMMANDS,
    "+info|server",
    "+info|memory",
    "+info|replication",
    "+time",
    "+evalsha",
    "+eval",
    "+get",
    "+getrange",
    "+strlen",
    "+set",
    "+del",
    "+exists",
    "+pexpire",
    "+mget",
    "+hget",
    "+hgetall",
    "+hkeys",
    "+hlen",
    "+hscan",
    "+hmget",
    "+hset",
    "+hsetnx",
    "+hdel",
    "+hexists",
    "+hincrby",
    "+sadd",
    "+srem",
    "+smembers",
    "+scard",
    "+srandmember",
    "+zadd",
    "+zrem",
    "+zcard",
    "+zscore",
    "+zcount",
    "+zrange",
    "+zrangebyscore",
    "+zrevrange",
    "+zremrangebyscore",
    "+zremrangebyrank",
    "+xadd",
    "+xrange",
    "+xrevrange",
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

#: A name in a key pattern: any job, timer kind (with its bucket), instance or token.
_ANY = "*"


def key_patterns(prefix: str) -> list[str]:
    """One pattern for each kind of key the store keeps under ``prefix``, made by
    ``keys.py`` itself with ``*`` for the name: the store format key and the registry's
    keys exactly, a job's and a timer kind's keys by their endings. So the user is
    refused every other key under the prefix (an application's own ``<prefix>session:1``)
    and every key of a prefix nested in it (``app:eu:`` in ``app:``) that can be told apart
    by a pattern: its format key, its registry and its hint channel. What no pattern can
    refuse is a nested prefix's job and timer keys: ``{app:eu:x}:state`` has the shape of
    a job's key of ``app:`` (a ``*`` matches ``:``, and an ACL has no rule that refuses).
    Users that must be kept apart get prefixes neither of which starts with the other."""
    pattern = glob_literal(prefix)
    registry = RegistryKeys.for_prefix(pattern)
    timers = TimerKeys.for_kind(pattern, _ANY)
    keys = [
        format_key(pattern),
        *dataclasses.astuple(JobKeys.for_job(pattern, _ANY)),
        *dataclasses.astuple(ClaimOnlyKeys.for_job(pattern, _ANY)),
        timers.timers,
        timers.due,
        timers.meta,
        timers.permits,
        timers.starts,
        timers.groups,
        timers.progress,
        timers.group_permits(_ANY),
        timers.group_waiting(_ANY),
        TimerKeys.buckets_key(pattern, _ANY),
        timers.claimed(_ANY),
        *(
            getattr(registry, field.name)
            for field in dataclasses.fields(registry)
            if field.name != "tag"
        ),
        registry.instance(_ANY),
    ]
    return [f"~{key}" for key in dict.fromkeys(keys)]


def acl_rules(prefix: str, *, idmp: bool = False, setinfo: bool = True) -> list[str]:
    """The rules of ``ACL SETUSER`` for a user of ``prefix`` (after ``on`` and its
    password): the keys of ``key_patterns``, the prefix's hint channel, and ``COMMANDS``.

    Parameters:
        prefix: the prefix the user's schedulers, timers and views use.
        idmp: add what the idmp strategy needs (Redis 8.6+).
        setinfo: keep ``CLIENT SETINFO`` (Redis 7.0 has no such command, and refuses a
            rule that names it; its clients do not send it)."""
    commands = [c for c in COMMANDS if setinfo or c != "+client|setinfo"]
    rules = [
        "resetkeys", *key_patterns(prefix),
        "resetchannels", f"&{glob_literal(hint_channel(prefix))}",
        "-@all", *commands,
    ]  # fmt: skip
    if idmp:
        rules += IDMP_COMMANDS
    return rules
