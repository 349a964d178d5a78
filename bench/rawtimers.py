"""The raw client ceiling of timer firings, in a process of its own.

    python -m bench.rawtimers CONFIG_JSON      (url, prefix, name, kind, limit, lease_ms)

What one firing needs at the least, sent by redis-py's asyncio client as anarchon's own
connections are made (RESP2, no per-reply timeout): the claim script of a bucket's due
timers (``timer_claim``, ``limit`` a call, as an instance claims them), then one
``timer_finish`` per firing won, pipelined, until a claim wins nothing (every timer
is due before it starts). Prints
``{"ready": true}``, reads ``{"start_at": t, ...}`` from stdin, runs from ``start_at``,
and prints ``{"result": ...}`` (wall-clock start and end, process CPU time, firings).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from typing import Any

import redis.asyncio

from anarchon._store.keys import TimerKeys
from anarchon._store.scripts import ScriptCall, timer_script
from anarchon._store.timers import NO_FLEET_LIMITS
from bench.common import ready_then_wait


def claim_command(keys: TimerKeys, config: dict[str, Any], token_base: str) -> list[Any]:
    """``timer_claim`` as the timer store sends it, for a kind without fleet limits."""
    call = ScriptCall(
        timer_script("timer_claim"),
        (
            keys.timers, keys.due, keys.meta, keys.claimed(token_base), keys.permits,
            keys.starts, keys.groups, keys.progress,
        ),
        (
            config["limit"], config["lease_ms"], config["name"], token_base, 3,
            NO_FLEET_LIMITS.concurrent, NO_FLEET_LIMITS.rate, NO_FLEET_LIMITS.period_ms,
            *NO_FLEET_LIMITS.group_args(keys), keys.group_waiting(""),
        ),
    )  # fmt: skip
    return list(call.command(by_sha=True))


def finish_command(keys: TimerKeys, key: str, token: str) -> list[Any]:
    """``timer_finish`` of a firing that went well, as the timer store sends it."""
    call = ScriptCall(
        timer_script("timer_finish"),
        (keys.timers, keys.due, keys.meta, keys.progress),
        (key, token, "ok", 3, 1000, "", ""),
    )
    return list(call.command(by_sha=True))


async def main() -> None:
    config = json.loads(sys.argv[1])
    keys = TimerKeys.for_kind(config["prefix"], config["kind"])
    client = redis.asyncio.Redis.from_url(config["url"], protocol=2, socket_timeout=None)
    for name in ("timer_claim", "timer_finish"):
        await client.script_load(timer_script(name).body)
    await ready_then_wait()
    cpu_before = time.process_time()
    started = time.time()
    fired = 0
    while True:
        reply = await client.execute_command(*claim_command(keys, config, secrets.token_hex(8)))
        wins = reply[0]
        if not wins:
            break  # every timer was due from the start: none left to claim
        pipe = client.pipeline(transaction=False)
        for win in wins:
            pipe.execute_command(*finish_command(keys, win[0], win[5]))
        await pipe.execute()
        fired += len(wins)
    ended = time.time()
    cpu_sec = time.process_time() - cpu_before
    await client.aclose()
    result = {"started": started, "ended": ended, "cpu_sec": cpu_sec, "fired": fired}
    print(json.dumps({"result": result}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
