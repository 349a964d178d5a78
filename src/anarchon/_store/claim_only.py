"""The claim-only strategies (stream-id, idmp, script): who runs each slot, nothing more.

No leases, heartbeats, retries, overlap protection or catch-up: the winner of a
slot runs it once and records its result. Each command touches one key, so a
cluster client routes every one of them by key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .._model.values import RunResult
from ..clients import Command, Connection, ServerReplyError
from .coalesce import pipeline
from .contract import (
    AttemptEnd,
    ClaimReply,
    ClaimRequest,
    FinishReply,
    slot_ms_of,
)
from .keys import ClaimOnlyKeys
from .records import read_history, read_result, result_member
from .scripts import Script, ScriptCall, lua_source, run_scripts

__all__ = ["ClaimOnlyStore", "IdmpSettings", "ScriptSettings"]

StrategyName = Literal["stream-id", "idmp", "script"]


@dataclass(frozen=True, slots=True)
class IdmpSettings:
    duration_sec: int = 300
    max_size: int = 1000


@dataclass(frozen=True, slots=True)
class ScriptSettings:
    window_ms: int = 300_000


def _entry_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def _script(name: str) -> Script:
    return Script.from_body(name, lua_source(name))


class ClaimOnlyStore:
    """Claims slots with one of the claim-only strategies and records results."""

    leases = False

    def __init__(
        self,
        conn: Connection,
        *,
        strategy: StrategyName,
        prefix: str,
        runner: str,
        history_size: int,
        history_ttl_ms: int | None = None,
        trim_runs_by_id: bool = False,
        idmp: IdmpSettings | None = None,
        script: ScriptSettings | None = None,
    ) -> None:
        self.conn = conn
        self.strategy = strategy
        self.prefix = prefix
        self.runner = runner
        self.history_size = history_size
        self.history_ttl_ms = history_ttl_ms or 0
        #: History older than history_ttl_ms also leaves the streams (XTRIM MINID,
        #: Redis 6.2+ and Valkey); older servers bound them by history_size alone.
        self.trim_runs_by_id = trim_runs_by_id
        self.idmp = idmp or IdmpSettings()
        self.script = script or ScriptSettings()
        self._configured: set[str] = set()

    def keys(self, job: str) -> ClaimOnlyKeys:
        return ClaimOnlyKeys.for_job(self.prefix, job)

    async def prepare_jobs(self, jobs: Sequence[str]) -> None:
        """idmp: give every job's stream the configured memory (once per stream)."""
        if self.strategy != "idmp":
            return
        todo = [job for job in jobs if job not in self._configured]
        if not todo:
            return
        configure = _script("idmp_configure")
        calls = [
            ScriptCall(
                configure, (self.keys(job).runs,), (self.idmp.duration_sec, self.idmp.max_size)
            )
            for job in todo
        ]
        for job, reply in zip(todo, await run_scripts(self.conn, calls), strict=True):
            if isinstance(reply, ServerReplyError):
                raise reply
            self._configured.add(job)

    async def claim_many(
        self, requests: Sequence[ClaimRequest]
    ) -> list[ClaimReply | ServerReplyError]:
        if self.strategy == "stream-id":
            return await self._claim_by_stream_id(requests)
        if self.strategy == "idmp":
            return await self._claim_by_idmp(requests)
        return await self._claim_by_script(requests)

    def _fields(self, request: ClaimRequest) -> tuple[str, ...]:
        return ("slot", request.slot_id, "token", request.token, "runner", self.runner)

    async def _claim_by_stream_id(
        self, requests: Sequence[ClaimRequest]
    ) -> list[ClaimReply | ServerReplyError]:
        # The slot is the entry id: the server refuses an id not above the last
        # one, so only the first XADD of a slot succeeds.
        commands: list[Command] = [
            (
                "XADD",
                self.keys(r.job).runs,
                "MAXLEN",
                "~",
                self.history_size,
                f"{r.slot_ms}-0",
                *self._fields(r),
            )
            for r in requests
        ]
        replies: list[ClaimReply | ServerReplyError] = []
        for request, reply in zip(requests, await pipeline(self.conn, commands), strict=True):
            if isinstance(reply, ServerReplyError):
                if "equal or smaller" in str(reply):
                    replies.append(ClaimReply("done", status="claimed"))
                else:
                    replies.append(reply)
            else:
                replies.append(self._won(request, _entry_ms(str(reply))))
        return replies

    async def _claim_by_idmp(
        self, requests: Sequence[ClaimRequest]
    ) -> list[ClaimReply | ServerReplyError]:
        # The server keeps the first entry for (job, slot) and answers repeats with
        # its id; the script reads that entry to tell whose it is (one call each).
        await self.prepare_jobs(sorted({r.job for r in requests}))
        claim = _script("idmp_claim")
        calls = [
            ScriptCall(
                claim,
                (self.keys(r.job).runs,),
                (r.job, r.slot_ms, self.history_size, r.slot_id, r.token, self.runner),
            )
            for r in requests
        ]
        replies: list[ClaimReply | ServerReplyError] = []
        for request, reply in zip(requests, await run_scripts(self.conn, calls), strict=True):
            if isinstance(reply, ServerReplyError):
                replies.append(reply)
            elif reply[0] == "won":
                replies.append(self._won(request, _entry_ms(str(reply[1]))))
            else:
                replies.append(ClaimReply("done", status="claimed"))
        return replies

    async def _claim_by_script(
        self, requests: Sequence[ClaimRequest]
    ) -> list[ClaimReply | ServerReplyError]:
        claim = _script("script_claim")
        calls = [
            ScriptCall(
                claim,
                (self.keys(r.job).runs,),
                (r.slot_id, r.token, self.runner, self.script.window_ms),
            )
            for r in requests
        ]
        replies: list[ClaimReply | ServerReplyError] = []
        for request, reply in zip(requests, await run_scripts(self.conn, calls), strict=True):
            if isinstance(reply, ServerReplyError):
                replies.append(reply)
            elif reply[0] == "won":
                replies.append(self._won(request, int(reply[1])))
            else:
                replies.append(ClaimReply("done", status="claimed"))
        return replies

    @staticmethod
    def _won(request: ClaimRequest, entry_ms: int) -> ClaimReply:
        # The entry's id orders the wins of a job: it serves as the fencing token.
        return ClaimReply("won", attempt=1, fence=entry_ms, trigger=request.trigger)

    async def begin_manual(self, job: str, slot_id: str, token: str) -> int:
        """A ``run_now`` run: one entry in the job's manual stream. Its fence is the
        entry id's time, the server's clock (as a scheduled win's is)."""
        entry_id = await self.conn.execute(
            (
                "XADD",
                self.keys(job).manual,
                "MAXLEN",
                "~",
                self.history_size,
                "*",
                "slot",
                slot_id,
                "token",
                token,
                "runner",
                self.runner,
            )
        )
        return int(str(entry_id).split("-", 1)[0])

    async def finish(self, end: AttemptEnd) -> FinishReply:
        """Record the run's result: one member of the results sorted set (trimmed to
        history_size), then, with history_ttl_ms, drop the history older than it."""
        call = ScriptCall(
            _script("record_result"),
            (self.keys(end.job).results,),
            (
                slot_ms_of(end.slot_id),
                result_member(end, end.outcome, self.runner),
                self.history_size,
            ),
        )
        (reply,) = await run_scripts(self.conn, [call])
        if isinstance(reply, ServerReplyError):
            raise reply
        if self.history_ttl_ms:
            await self._trim_by_age(end.job, end.finished_ms - self.history_ttl_ms)
        return FinishReply(held=True, status=end.outcome)

    async def _trim_by_age(self, job: str, oldest_ms: int) -> None:
        """Drop the job's history from before ``oldest_ms`` (on this instance's clock, like
        every time a claim-only store records): results are scored by their slot's
        instant, and stream entry ids are milliseconds. The script strategy's runs
        stream is its memory of claims, which its script keeps for window_ms: trimming
        it sooner would let a late claim run a slot again. (A stream-id stream keeps its
        last id when trimmed, and idmp remembers ids apart from entries.)"""
        keys = self.keys(job)
        commands: list[Command] = []
        if self.trim_runs_by_id:
            commands.append(("XTRIM", keys.manual, "MINID", oldest_ms))
            if self.strategy != "script":
                commands.append(("XTRIM", keys.runs, "MINID", oldest_ms))
        # The results last: once old results are gone, so are the old entries.
        commands.append(("ZREMRANGEBYSCORE", keys.results, "-inf", f"({oldest_ms}"))
        for reply in await pipeline(self.conn, commands):
            if isinstance(reply, ServerReplyError):
                raise reply

    async def result_of(self, job: str, slot_id: str, attempt: int) -> RunResult:
        return await read_result(self.conn, self.keys(job).results, job, slot_id, attempt)

    async def history(self, job: str, limit: int) -> list[RunResult]:
        return await read_history(self.conn, self.keys(job).results, job, limit, self.prefix)
