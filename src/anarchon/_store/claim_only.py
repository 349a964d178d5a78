"""The claim-only strategies (stream-id, idmp, script): who runs each slot, nothing more.

No leases, heartbeats, retries, overlap protection or catch-up: the winner of a
slot runs it once and records its result. Each command touches one key, so a
cluster client routes every one of them by key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

from .._errors import InvalidOptionError
from .._model.values import RunResult
from ..clients import Command, Connection, ServerReplyError
from .coalesce import pipeline
from .contract import (
    AttemptEnd,
    ClaimReply,
    ClaimRequest,
    FinishReply,
    Store,
    slot_ms_of,
)
from .keys import ClaimOnlyKeys
from .records import read_history, read_result, result_member
from .scripts import Script, ScriptCall, lua_source, run_scripts

__all__ = ["ClaimOnlyStore", "IdmpStore", "ScriptStore", "StreamIdStore"]


def _entry_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def _script(name: str) -> Script:
    return Script.from_body(name, lua_source(name))


class ClaimOnlyStore(Store):
    """What the claim-only strategies share: a win holds no lease, a manual run is
    recorded (not claimed), and results go to one sorted set per job. Each strategy's
    class claims its own way (``claim_many``)."""

    #: The strategy's name, for messages.
    strategy: ClassVar[str]
    #: Whether history older than history_ttl_ms also leaves the runs stream.
    trims_runs: ClassVar[bool] = True

    def keys(self, job: str) -> ClaimOnlyKeys:
        return ClaimOnlyKeys.for_job(self.prefix, job)

    def remembered_slots_key(self, job: str) -> str:
        return self.keys(job).results

    def held_until(self, lease_left_ms: int, sent: float) -> float:
        """The winner runs the slot once, with no lease to lose."""
        return math.inf

    async def set_paused(self, job: str, paused_by: str | None) -> bool:
        raise InvalidOptionError(
            f"pausing and resuming a job need the 'lease' strategy: this scheduler uses "
            f"{self.strategy!r}"
        )

    def _fields(self, request: ClaimRequest) -> tuple[str, ...]:
        return ("slot", request.slot_id, "token", request.token, "runner", self.runner)

    @staticmethod
    def _won(request: ClaimRequest, entry_ms: int) -> ClaimReply:
        # The entry's id orders the wins of a job: it serves as the fencing token.
        return ClaimReply("won", attempt=1, fence=entry_ms, trigger=request.trigger)

    async def claim_manual(self, request: ClaimRequest) -> ClaimReply:
        """A ``run_now`` run is recorded, not claimed (no lease to hold): one entry in the
        job's manual stream. Its fence is the entry id's time, the server's clock (as a
        scheduled win's is)."""
        entry_id = await self.conn.execute(
            (
                "XADD",
                self.keys(request.job).manual,
                "MAXLEN",
                "~",
                self.history_size,
                "*",
                "slot",
                request.slot_id,
                "token",
                request.token,
                "runner",
                self.runner,
            )
        )
        return ClaimReply("won", attempt=1, fence=_entry_ms(str(entry_id)), trigger="manual")

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
            if self.trims_runs:
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


class StreamIdStore(ClaimOnlyStore):
    """The stream-id strategy: the slot is the runs stream's entry id."""

    strategy = "stream-id"

    async def claim_many(
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


class IdmpStore(ClaimOnlyStore):
    """The idmp strategy (Redis 8.6+): the server keeps the first entry of each slot."""

    strategy = "idmp"

    def __init__(
        self, conn: Connection, *, duration_sec: int = 300, max_size: int = 1000, **common: Any
    ) -> None:
        super().__init__(conn, **common)
        self.duration_sec = duration_sec
        self.max_size = max_size
        self._configured: set[str] = set()

    async def prepare_jobs(self, jobs: Sequence[str]) -> None:
        """Give every job's stream the configured memory (once per stream)."""
        todo = [job for job in jobs if job not in self._configured]
        if not todo:
            return
        configure = _script("idmp_configure")
        calls = [
            ScriptCall(configure, (self.keys(job).runs,), (self.duration_sec, self.max_size))
            for job in todo
        ]
        for job, reply in zip(todo, await run_scripts(self.conn, calls), strict=True):
            if isinstance(reply, ServerReplyError):
                raise reply
            self._configured.add(job)

    async def claim_many(
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


class ScriptStore(ClaimOnlyStore):
    """The script strategy: a script remembers each claimed slot for ``window_ms``. Its
    runs stream is that memory: trimming it by age sooner would let a late claim run a
    slot again."""

    strategy = "script"
    trims_runs = False

    def __init__(self, conn: Connection, *, window_ms: int = 300_000, **common: Any) -> None:
        super().__init__(conn, **common)
        self.window_ms = window_ms

    async def claim_many(
        self, requests: Sequence[ClaimRequest]
    ) -> list[ClaimReply | ServerReplyError]:
        claim = _script("script_claim")
        calls = [
            ScriptCall(
                claim,
                (self.keys(r.job).runs,),
                (r.slot_id, r.token, self.runner, self.window_ms),
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
