"""The lease strategy's side of the store: one round trip per claim batch, heartbeat, finish."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

from ._schedule import from_epoch_ms
from ._scripts import ScriptCall, lease_script, run_scripts
from ._structures import RunResult, RunStatus, Trigger
from .clients import Connection, ServerReplyError

__all__ = ["ClaimReply", "ClaimRequest", "FinishReply", "JobKeys", "LeaseStore"]


@dataclass(frozen=True, slots=True)
class JobKeys:
    """The five keys of a job; the hash tag keeps them on one cluster node."""

    state: str
    active: str
    slots: str
    runs: str
    results: str

    @classmethod
    def for_job(cls, prefix: str, job: str) -> JobKeys:
        tag = "{" + prefix + job + "}"
        return cls(
            state=f"{tag}:state",
            active=f"{tag}:active",
            slots=f"{tag}:slots",
            runs=f"{tag}:runs",
            results=f"{tag}:results",
        )


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    keys: JobKeys
    slot_id: str
    slot_ms: int
    token: str
    lease_ms: int
    max_attempts: int
    allow_overlap: bool
    trigger: Trigger
    keep_ms: int


ClaimKind = Literal["won", "running", "overlap", "done"]


@dataclass(frozen=True, slots=True)
class ClaimReply:
    """What the claim script decided. ``wait_ms`` is the lease time left (won),
    the time until it is worth asking again (running), or the other run's lease
    time left (overlap)."""

    kind: ClaimKind
    attempt: int = 0
    fence: int = 0
    wait_ms: int = 0
    trigger: Trigger = "schedule"
    status: str = ""
    #: Other unsettled slots of the job that nobody holds (a dead runner's, or a
    #: retry that is due): reported on a slot's first claim, for backups to claim.
    orphans: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FinishReply:
    """``held`` is False when the attempt had lost its lease (nothing was written).
    ``status`` is the run's state afterwards; ``retry`` comes with ``retry_in_ms``."""

    held: bool
    status: str
    retry_in_ms: int = 0


def _orphans(raw: object) -> tuple[str, ...]:
    return tuple(str(slot) for slot in raw) if isinstance(raw, list) else ()


def _claim_reply(raw: list[object]) -> ClaimReply:
    kind = cast(ClaimKind, raw[0])
    if kind == "won":
        return ClaimReply(
            "won",
            attempt=int(cast(int, raw[1])),
            fence=int(cast(int, raw[2])),
            wait_ms=int(cast(int, raw[3])),
            trigger=cast(Trigger, raw[4]),
            orphans=_orphans(raw[5]),
        )
    if kind == "done":
        return ClaimReply("done", status=str(raw[1]))
    if kind == "overlap":
        return ClaimReply("overlap", wait_ms=int(cast(int, raw[1])), orphans=_orphans(raw[2]))
    return ClaimReply(kind, wait_ms=int(cast(int, raw[1])))


class LeaseStore:
    """Runs the lease scripts for one scheduler instance."""

    def __init__(
        self,
        conn: Connection,
        *,
        prefix: str,
        runner: str,
        history_size: int,
        history_ttl_ms: int | None,
        trim_runs_by_id: bool = False,
    ) -> None:
        self.conn = conn
        #: History older than history_ttl_ms also leaves the runs stream (XTRIM MINID,
        #: Redis 6.2+ and Valkey); older servers bound it by history_size alone.
        self.trim_runs_by_id = trim_runs_by_id
        self.prefix = prefix
        self.runner = runner
        self.history_size = history_size
        self.history_ttl_ms = history_ttl_ms or 0

    def keys(self, job: str) -> JobKeys:
        return JobKeys.for_job(self.prefix, job)

    async def claim_many(
        self, requests: Sequence[ClaimRequest]
    ) -> list[ClaimReply | ServerReplyError]:
        """Claim slots in one round trip; a script error comes back in place of its reply."""
        claim = lease_script("claim")
        calls = [
            ScriptCall(
                claim,
                (r.keys.state, r.keys.active, r.keys.slots, r.keys.runs, r.keys.results),
                (
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
                ),
            )
            for r in requests
        ]
        replies = await run_scripts(self.conn, calls)
        return [
            reply if isinstance(reply, ServerReplyError) else _claim_reply(reply)
            for reply in replies
        ]

    async def heartbeat(self, keys: JobKeys, slot_id: str, token: str, lease_ms: int) -> bool:
        """Extend the lease; False means the lease is lost."""
        call = ScriptCall(lease_script("heartbeat"), (keys.state,), (slot_id, token, lease_ms))
        (reply,) = await run_scripts(self.conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        return int(reply[0]) == 1

    async def finish(
        self,
        keys: JobKeys,
        *,
        slot_id: str,
        slot_ms: int,
        token: str,
        outcome: Literal["ok", "failed", "cancelled"],
        max_attempts: int,
        retry_delay_ms: int,
        error: str | None,
    ) -> FinishReply:
        call = ScriptCall(
            lease_script("finish"),
            (keys.state, keys.active, keys.results),
            (
                slot_id,
                slot_ms,
                token,
                outcome,
                max_attempts,
                retry_delay_ms,
                error or "",
                self.history_size,
                self.history_ttl_ms,
            ),
        )
        (reply,) = await run_scripts(self.conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        if reply[0] == "lost":
            return FinishReply(held=False, status=str(reply[1]))
        return FinishReply(held=True, status=str(reply[1]), retry_in_ms=int(reply[2]))

    async def result_of(self, job: str, slot_id: str, attempt: int) -> RunResult:
        """The recorded result of one attempt."""
        score = slot_ms_of(slot_id)
        members = await self.conn.execute(("ZRANGEBYSCORE", self.keys(job).results, score, score))
        head = f"{slot_id}|{attempt}|"
        for member in members:
            if str(member).startswith(head):
                return parse_result(job, str(member))
        raise LookupError(f"no result recorded for {job} slot {slot_id} attempt {attempt}")

    async def history(self, job: str, limit: int) -> list[RunResult]:
        """The newest ``limit`` results of a job, newest first."""
        members = await self.conn.execute(("ZREVRANGE", self.keys(job).results, 0, limit - 1))
        results = [parse_result(job, str(member)) for member in members]
        results.sort(key=lambda r: (r.slot_ms, r.attempt), reverse=True)
        return results


def parse_result(job: str, member: str) -> RunResult:
    """Read one results member (see lua/lease_state.lua, record_result)."""
    slot, attempt, status, started_ms, finished_ms, fence, trigger, rest = member.split("|", 7)
    runner, _, error = rest.partition("|")  # runner ids never hold "|"
    slot_ms = slot_ms_of(slot)
    return RunResult(
        job=job,
        slot=from_epoch_ms(slot_ms),
        slot_ms=slot_ms,
        attempt=int(attempt),
        trigger=cast(Trigger, trigger),
        runner=runner,
        status=cast(RunStatus, status),
        started_at=from_epoch_ms(int(started_ms)),
        finished_at=from_epoch_ms(int(finished_ms)),
        error=error or None,
        fence=int(fence),
    )


def manual_slot_id(requested_ms: int, nonce: str) -> str:
    """A manual run's slot id: never all digits, so never equal to a scheduled slot."""
    return f"m{requested_ms}-{nonce}"


def slot_ms_of(slot_id: str) -> int:
    """The instant of a slot id: scheduled ids are epoch ms, manual ids carry theirs."""
    if slot_id.isdigit():
        return int(slot_id)
    return int(slot_id[1:].split("-", 1)[0])
