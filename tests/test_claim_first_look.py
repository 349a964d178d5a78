"""claim's first look (``lua/claim_first_look.lua``) answers a losing claim before the
rest of the script's definitions are made. Its answers must be the whole script's: each
state a slot can hold (and some it must not), claimed by the shipped script and by the
same script without its first look, leaves the same reply and the same store."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from anarchon._store.keys import JobKeys
from anarchon._store.scripts import FIRST_LOOK, Script, lease_script, lua_source

pytestmark = pytest.mark.server_tier  # the scripts, as each server runs them

SLOT_MS = 1_700_000_000_000
ORPHAN_MS = SLOT_MS - 60_000
MINE, OTHER = "tok-mine", "tok-other"


def _states(now_ms: int) -> dict[str, str | None]:
    live, gone = now_ms + 600_000, now_ms - 5_000

    def state(status: str, token: str, until_ms: int, trigger: str = "schedule") -> str:
        return f"{status}|1|{token}|{until_ms}|{now_ms * 1000}|{trigger}|{gone}|r1"

    return {
        "no state": None,
        "another's live lease": state("running", OTHER, live),
        "my own live lease": state("running", MINE, live),
        "another's expired lease": state("running", OTHER, gone),
        "ok": state("ok", "", gone),
        "failed": state("failed", "", gone),
        "interrupted": state("interrupted", "", gone, "takeover"),
        "cancelled": state("cancelled", "", gone),
        "skipped": state("skipped", "", gone),
        "a retry due later": state("retry", "", live, "retry"),
        "a retry due now": state("retry", OTHER, gone, "retry"),
        "not a state": "running|x|" + OTHER,
        "an unknown status": state("paused", OTHER, live),
        "an unknown trigger": state("running", OTHER, live, "whenever"),
        "a lease beyond year 9999": state("running", OTHER, 10**15),
    }


def _claim(
    direct: redis.Redis, script: Script, keys: JobKeys, token: str, probe: bool
) -> list[Any]:
    reply: list[Any] = direct.eval(
        script.body, 5, keys.state, keys.active, keys.slots, keys.runs, keys.results,
        SLOT_MS, SLOT_MS, token, "r2", 30_000, 3, 0, "schedule", 600_000, 100, 0, 1,
        1, 0, 1 if probe else 0, 0,
    )  # fmt: skip
    return reply


def _store(direct: redis.Redis, keys: JobKeys) -> dict[str, Any]:
    """What the claim may have changed (the runs stream's ids and times aside)."""
    state = {k: v for k, v in direct.hgetall(keys.state).items() if k != "fence"}
    runs = [fields for _, fields in direct.xrange(keys.runs)]
    for fields in runs:
        fields.pop("fence", None)
    return {
        "state": {k: v.split("|")[0] for k, v in state.items()},
        "active": direct.smembers(keys.active),
        "slots": direct.zrange(keys.slots, 0, -1),
        "runs": runs,
        "results": direct.zcard(keys.results),
    }


def _comparable(reply: list[Any]) -> tuple[list[Any], int | None]:
    """A reply without what differs from one call to the next (a win's fence, and the
    milliseconds left, which the server's clock moves between the two calls), and those
    milliseconds apart."""
    out, left = list(reply), None
    if out[0] in ("running", "won") and isinstance(out[3], int):
        out[3], left = "ms left", out[3]
    if out[0] == "won":
        out[2] = "fence"
    return out, left


@pytest.mark.parametrize("probe", [False, True], ids=["claim", "probe"])
def test_the_first_look_answers_as_the_whole_claim_script_does(
    server_url: str, prefix: str, probe: bool
) -> None:
    direct = redis.Redis.from_url(server_url, protocol=2, decode_responses=True)
    shipped = lease_script("claim")
    assert lua_source("claim_first_look") in shipped.body
    whole = Script.from_body(
        "claim", lua_source("lease_state").replace(FIRST_LOOK, "") + "\n" + lua_source("claim")
    )
    keys = JobKeys.for_job(prefix, "job")
    try:
        now_ms = int(time.time() * 1000)
        orphan = f"running|1|{OTHER}|{now_ms - 1000}|{now_ms * 1000}|schedule|{now_ms - 9000}|r0"
        for name, raw in _states(now_ms).items():
            for token in (MINE, OTHER):
                seen, lefts = [], []
                for script in (shipped, whole):
                    direct.delete(keys.state, keys.active, keys.slots, keys.runs, keys.results)
                    # An older slot whose runner vanished: first claims hear of it.
                    direct.hset(keys.state, str(ORPHAN_MS), orphan)
                    direct.sadd(keys.active, str(ORPHAN_MS))
                    if raw is not None:
                        direct.hset(keys.state, str(SLOT_MS), raw)
                    reply, left = _comparable(_claim(direct, script, keys, token, probe))
                    seen.append((reply, _store(direct, keys)))
                    lefts.append(left)
                assert seen[0] == seen[1], f"{name}, token {token}: {seen[0]} != {seen[1]}"
                # The same deadline, read a moment apart (a loaded machine's moment).
                if lefts[0] is None or lefts[1] is None:
                    assert lefts[0] == lefts[1], (name, token, lefts)
                else:
                    assert 0 <= lefts[0] - lefts[1] <= 5_000, (name, token, lefts)
    finally:
        direct.delete(keys.state, keys.active, keys.slots, keys.runs, keys.results)
        direct.close()
