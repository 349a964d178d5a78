"""The Lua scripts: loading them, and running them by SHA with recovery from NOSCRIPT."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ..clients import Arg, Command, Connection, ServerReplyError
from .coalesce import pipeline

__all__ = [
    "Script",
    "ScriptCall",
    "lease_script",
    "lua_dir",
    "lua_source",
    "run_scripts",
    "timer_script",
]


def lua_dir() -> Path:
    """Where the Lua scripts are loaded from: ``lua/`` beside this module, the
    package's data in a wheel and in a source checkout alike.

    Test hook: ``ANARCHON_LUA_DIR`` names another directory to load them from
    (``python -m tests.mutants`` points it at mutated copies). Not for production.
    """
    override = os.environ.get("ANARCHON_LUA_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().with_name("lua")


@cache
def lua_source(name: str) -> str:
    """The text of ``lua/<name>.lua`` as shipped."""
    return (lua_dir() / f"{name}.lua").read_text(encoding="utf-8")


@dataclass(frozen=True, slots=True)
class Script:
    """A script's full text and its SHA1, as the server knows it."""

    name: str
    body: str
    sha: str

    @classmethod
    def from_body(cls, name: str, body: str) -> Script:
        return cls(name, body, hashlib.sha1(body.encode("utf-8")).hexdigest())


#: The line of ``lua/lease_state.lua`` where a script's first look goes.
FIRST_LOOK = "-- FIRST LOOK: a script's first look, if it has one, goes here (scripts.py).\n"

#: Scripts with a first look (``lua/<name>_first_look.lua``): their commonest answers,
#: given as soon as the state record can be read, before the rest of the shared
#: definitions are made (each call of a script makes them all again).
_FIRST_LOOKS = frozenset({"claim"})


@cache
def lease_script(name: str) -> Script:
    """A lease script (claim, heartbeat, finish) with the shared definitions prepended,
    and its first look among them."""
    shared = lua_source("lease_state")
    if name in _FIRST_LOOKS:
        if shared.count(FIRST_LOOK) != 1:
            raise AssertionError("lease_state.lua must hold the first look's line once")
        shared = shared.replace(FIRST_LOOK, lua_source(f"{name}_first_look"))
    return Script.from_body(name, shared + "\n" + lua_source(name))


@cache
def timer_script(name: str) -> Script:
    """A timer script (timer_set, timer_claim, ...) with the shared definitions prepended:
    the lease scripts' (the server clock) and the timers' own (their state)."""
    body = "\n".join((lua_source("lease_state"), lua_source("timer_state"), lua_source(name)))
    return Script.from_body(name, body)


@dataclass(frozen=True, slots=True)
class ScriptCall:
    script: Script
    keys: Sequence[str]
    args: Sequence[Arg]

    def command(self, *, by_sha: bool) -> Command:
        head = self.script.sha if by_sha else self.script.body
        verb = "EVALSHA" if by_sha else "EVAL"
        return (verb, head, len(self.keys), *self.keys, *self.args)


async def run_scripts(conn: Connection, calls: Sequence[ScriptCall]) -> list[Any]:
    """Run script calls in one round trip; error replies come back as ServerReplyError items.

    Calls go by SHA. A server that does not know a script (after SCRIPT FLUSH,
    a restart or a failover) answers NOSCRIPT; those calls are sent again, the first
    of each script with the script's text (which caches it) and the rest by SHA
    behind it, then any still refused (a cluster node that lacks the script) with
    the text. Calls that other tasks make at the same moment share the round trip.
    """
    replies = await pipeline(conn, [call.command(by_sha=True) for call in calls])
    for by_sha in (True, False):
        missing = [
            index
            for index, reply in enumerate(replies)
            if isinstance(reply, ServerReplyError) and reply.kind == "NOSCRIPT"
        ]
        if not missing:
            break
        loading: set[str] = set()
        commands = []
        for index in missing:
            script = calls[index].script
            commands.append(calls[index].command(by_sha=by_sha and script.sha in loading))
            loading.add(script.sha)
        again = await pipeline(conn, commands)
        for index, reply in zip(missing, again, strict=True):
            replies[index] = reply
    return replies
