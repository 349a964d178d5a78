"""The lease strategy's store: one round trip per claim batch, heartbeat, finish."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import datetime
from typing import Any, cast

from .._model.clock import wall_ms
from .._model.progress import PROGRESS_BYTES_MAX
from .._model.values import RunResult, Trigger
from ..clients import Command, Connection, ServerReplyError
from .coalesce import pipeline
from .contract import (
    AttemptEnd,
    ClaimKind,
    ClaimReply,
    ClaimRequest,
    FinishReply,
    HeartbeatRequest,
    Store,
    fleet_slot_id,
    is_slot_id,
    slot_ms_of,
)
from .keys import JobKeys
from .quarantine import MalformedEntry, quarantine_malformed, quarantine_of, whole
from .records import read_history, read_result
from .scripts import ScriptCall, lease_script, run_scripts

__all__ = [
    "FAILED_IN_ROW_FIELD",
    "FINISHED_FIELD",
    "IN_FORCE_FIELD",
    "LAST_OK_FIELD",
    "PAUSED_FIELD",
    "RUNS_FIELD",
    "LeaseStore",
    "paused_text",
    "request_run",
    "set_paused",
]


#: The state hash's field that pauses a job (see lua/lease_state.lua).
PAUSED_FIELD = "paused"
#: lease_state.lua's fields of a job's state hash: its runs that ended ok or finally
#: failed, and why it is finished (its max_runs reached).
RUNS_FIELD = "runs"
#: The fingerprint of the job's definition in force (lua/lease_state.lua's IN_FORCE_FIELD).
IN_FORCE_FIELD = "in-force"
FINISHED_FIELD = "finished"
#: lease_state.lua's fields: the job's slots in a row that finally failed, and when its
#: last run that ended ok ended (server ms).
FAILED_IN_ROW_FIELD = "failed-in-row"
LAST_OK_FIELD = "last-ok"


def paused_text(by: str, note: str | None) -> str:
    """What a pause keeps in the job's state (``JobInfo.paused_by``): who, when (this
    machine's clock, with its offset), and why."""
    when = datetime.fromtimestamp(wall_ms() / 1000).astimezone().isoformat(timespec="seconds")
    return f"{by} at {when}" + (f": {note}" if note else "")


async def set_paused(conn: Connection, state: str, paused_by: str | None) -> bool:
    """Pause a job (``paused_by``: who, and when, as text) or resume it (None): the flag
    in its ``state`` hash that the claim script reads (``PAUSED_FIELD``). Whether it
    changed anything."""
    if paused_by is None:
        resumed = int(await conn.execute(("HDEL", state, PAUSED_FIELD))) == 1
        if resumed:  # pause_after_failures counts again from a resume
            await conn.execute(("HDEL", state, FAILED_IN_ROW_FIELD))
        return resumed
    return int(await conn.execute(("HSETNX", state, PAUSED_FIELD, paused_by))) == 1


async def request_run(conn: Connection, prefix: str, job: str, who: str) -> tuple[str, bool]:
    """Ask the fleet to run ``job`` now (lua/request_run.lua): the slot id of the run that
    waits for its first attempt, and whether this call stored it (False: a request made
    before still waits, and it is the one request)."""
    keys = JobKeys.for_job(prefix, job)
    slot_id = fleet_slot_id(int(wall_ms()), secrets.token_hex(4))
    call = ScriptCall(
        lease_script("request_run"),
        (keys.state, keys.active, keys.slots),
        (slot_id, slot_ms_of(slot_id), who),
    )
    (reply,) = await run_scripts(conn, [call])
    if isinstance(reply, ServerReplyError):
        raise reply
    return _text(reply[0]), int(reply[1]) == 1


def _list(raw: object) -> list[Any]:
    return raw if isinstance(raw, list) else []


def _claim_reply(raw: list[Any], keys: JobKeys, prefix: str) -> ClaimReply:
    """Read a reply of lua/claim.lua: ``{kind, attempt, fence, ms, text, orphans,
    malformed}``. The malformed entries the script met are quarantined here, and so is
    an orphan that is not a slot id or a won fence that is not a whole number (what the
    store holds is input, the script's reply included): a handler is never handed a
    fence that is not one."""
    quarantine_malformed(raw[6], prefix, "itself")
    orphans = []
    for orphan in map(_text, _list(raw[5])):
        if is_slot_id(orphan):
            orphans.append(orphan)
        else:
            malformed = MalformedEntry(keys.active, orphan, "not a slot id")
            quarantine_of(prefix).add(malformed, "itself")
    kind = cast(ClaimKind, _text(raw[0]))
    wait_ms = int(raw[3])
    if kind == "won":
        fence = whole(_text(raw[2]))
        if not fence:
            quarantine_of(prefix).add(
                MalformedEntry(keys.state, "fence", "a won fence that is not a whole number"),
                "this claim",
            )
            return ClaimReply("done", status="malformed", orphans=tuple(orphans))
        return ClaimReply(
            "won",
            attempt=int(raw[1]),
            fence=fence,
            wait_ms=wait_ms,
            trigger=cast(Trigger, _text(raw[4])),
            orphans=tuple(orphans),
            progress=_text(raw[7]) if len(raw) > 7 else "",
        )
    if kind == "done":
        return ClaimReply("done", status=_text(raw[4]), orphans=tuple(orphans))
    return ClaimReply(kind, wait_ms=wait_ms, status=_text(raw[4]), orphans=tuple(orphans))


def _text(raw: object) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


class LeaseStore(Store):
    """Runs the lease scripts for one scheduler instance."""

    hints_for_jobs = True
    backfills = True

    def keys(self, job: str) -> JobKeys:
        return JobKeys.for_job(self.prefix, job)

    def remembered_slots_key(self, job: str) -> str:
        return self.keys(job).slots

    async def set_in_force(self, fingerprints: dict[str, str]) -> None:
        commands: list[Command] = [
            ("HSET", self.keys(job).state, IN_FORCE_FIELD, fp) for job, fp in fingerprints.items()
        ]
        for reply in await pipeline(self.conn, commands):
            if isinstance(reply, ServerReplyError):
                raise reply

    async def claim_many(
        self, requests: Sequence[ClaimRequest]
    ) -> list[ClaimReply | ServerReplyError]:
        """Claim slots in one round trip; a script error comes back in place of its reply."""
        claim = lease_script("claim")
        calls = []
        for r in requests:
            keys = self.keys(r.job)
            script_keys = [keys.state, keys.active, keys.slots, keys.runs, keys.results]
            args: list[str | int] = [
                r.slot_id,
                r.slot_ms,
                r.token,
                self.runner,
                r.lease_ms,
                r.max_attempts,
                1 if r.allow_overlap else 0,
                r.trigger,
                r.keep_ms,
                self.history_size,
                self.history_ttl_ms,
                1 if self.trim_runs_by_id else 0,
                1 if r.may_start else 0,
                r.excluded or (2 if r.superseded else 1 if r.skip_if_blocked else 0),
                1 if r.probe else 0,
                1 if r.replace else 0,
            ]
            if r.fleet_max or r.max_runs:
                # Only a job with a fleet limit or a max_runs sends its permits key.
                script_keys.append(keys.permits)
            if r.fleet_max or r.max_runs or r.fingerprint:
                args += [r.fleet_max or 0, r.max_runs or 0, r.fingerprint]
            calls.append(ScriptCall(claim, script_keys, args))
        replies = await run_scripts(self.conn, calls)
        return [
            reply
            if isinstance(reply, ServerReplyError)
            else _claim_reply(reply, self.keys(request.job), self.prefix)
            for request, reply in zip(requests, replies, strict=True)
        ]

    async def claim_manual(self, request: ClaimRequest) -> ClaimReply:
        """Claimed as any slot is: a backup takes it over if this instance dies."""
        (reply,) = await self.claim_many([request])
        if isinstance(reply, ServerReplyError):
            raise reply
        return reply

    def held_until(self, lease_left_ms: int, sent: float) -> float:
        return sent + lease_left_ms / 1000

    async def save_progress(self, job: str, slot_id: str, token: str, text: str) -> str | None:
        call = ScriptCall(
            lease_script("save_progress"),
            (self.keys(job).state,),
            (slot_id, token, text, PROGRESS_BYTES_MAX),
        )
        (reply,) = await run_scripts(self.conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        return None if int(reply[0]) == 1 else _text(reply[1])

    async def heartbeat_many(
        self, beats: Sequence[HeartbeatRequest]
    ) -> list[bool | ServerReplyError]:
        """Extend leases in one round trip; False means that lease is lost."""
        calls = []
        for beat in beats:
            keys = self.keys(beat.job)
            script_keys = [keys.state, keys.active]
            args: list[str | int] = [
                beat.slot_id,
                beat.token,
                beat.lease_ms,
                1 if beat.allow_overlap else 0,
            ]
            if beat.fleet_max:
                script_keys.append(keys.permits)
                args.append(beat.fleet_max)
            calls.append(ScriptCall(lease_script("heartbeat"), script_keys, args))
        replies = await run_scripts(self.conn, calls)
        return [
            reply if isinstance(reply, ServerReplyError) else int(reply[0]) == 1
            for reply in replies
        ]

    async def finish(self, end: AttemptEnd) -> FinishReply:
        keys = self.keys(end.job)
        call = ScriptCall(
            lease_script("finish"),
            (keys.state, keys.active, keys.results, *((keys.permits,) if end.fleet else ())),
            (
                end.slot_id,
                slot_ms_of(end.slot_id),
                end.token,
                end.outcome,
                end.max_attempts,
                end.retry_delay_ms,
                end.error or "",
                self.history_size,
                self.history_ttl_ms,
                *((end.pause_after,) if end.pause_after else ()),
            ),
        )
        (reply,) = await run_scripts(self.conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        if reply[0] == "lost":
            return FinishReply(held=False, status=str(reply[1]))
        quarantine_malformed(reply[3] if len(reply) > 3 else [], self.prefix, "its result")
        return FinishReply(
            held=True,
            status=str(reply[1]),
            retry_in_ms=int(reply[2]),
            paused=len(reply) > 4 and int(reply[4]) == 1,
        )

    async def result_of(self, job: str, slot_id: str, attempt: int) -> RunResult:
        return await read_result(self.conn, self.keys(job).results, job, slot_id, attempt)

    async def set_paused(self, job: str, paused_by: str | None) -> bool:
        """Pause the job or resume it (see ``set_paused``)."""
        return await set_paused(self.conn, self.keys(job).state, paused_by)

    async def history(self, job: str, limit: int) -> list[RunResult]:
        return await read_history(self.conn, self.keys(job).results, job, limit, self.prefix)
