"""What the scheduler asks of a store, whatever the strategy behind it."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from .._errors import InvalidOptionError
from .._model.schedule import iso_ms
from .._model.values import RunResult, Trigger
from ..clients import Connection, ServerReplyError
from .quarantine import instant_ms

__all__ = [
    "AttemptEnd",
    "HeartbeatRequest",
    "ClaimReply",
    "ClaimRequest",
    "FinishReply",
    "Outcome",
    "Store",
    "is_slot_id",
    "manual_slot_id",
    "slot_ms_of",
]

Outcome = Literal["ok", "failed", "cancelled"]
ClaimKind = Literal["won", "running", "overlap", "done"]


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    job: str
    slot_id: str
    slot_ms: int
    token: str
    trigger: Trigger
    # Lease settings; claim-only strategies ignore them.
    lease_ms: int = 0
    max_attempts: int = 1
    allow_overlap: bool = False
    keep_ms: int = 0
    #: The caller's first claim of the slot (made in time): only it may start a run.
    #: A backup's or a retry's later claim of a forgotten slot is told it is done.
    may_start: bool = True
    #: A scheduled slot's first claim that skips the slot if an older run blocks it:
    #: the store records it as skipped, once, for every instance.
    skip_if_blocked: bool = False
    #: A slot waiting behind an older run that a newer slot replaces in the wait
    #: (overlap "buffer_one"): recorded as skipped unless it has started.
    superseded: bool = False
    #: A scheduled slot's first claim that ends the job's older unsettled runs (recorded
    #: cancelled) and wins (overlap "replace").
    replace: bool = False
    #: The job's ``max_concurrent_fleet``: a run starts only with one of its permits in
    #: the store (None: no limit).
    fleet_max: int | None = None
    #: Only ask whether this claim's token holds a live lease (a stopping instance
    #: resolving a claim whose reply was lost); the store changes nothing.
    probe: bool = False
    #: The job's ``max_runs``: a run starts only while fewer of its runs have ended (ok
    #: or finally failed) in the store (None: no bound).
    max_runs: int | None = None
    #: A scheduled slot that the job's ``exclude=`` leaves out: why (``"excluded: ..."``).
    #: Its first claim in the fleet records it skipped with this reason.
    excluded: str | None = None
    #: The fingerprint of this instance's definition of the job: a first claim starts
    #: nothing while the store names another in force ("" for none: not asked).
    fingerprint: str = ""


@dataclass(frozen=True, slots=True)
class ClaimReply:
    """What the store decided. ``wait_ms`` is the lease time left (won), the time until
    it is worth asking again (running), or the other run's lease time left (overlap;
    with ``status`` ``"fleet"``, the time until the soonest of the job's fleet permits
    runs out: the job's runs in the fleet hold them all)."""

    kind: ClaimKind
    attempt: int = 0
    fence: int = 0
    wait_ms: int = 0
    trigger: Trigger = "schedule"
    status: str = ""
    #: Other unsettled slots of the job that nobody holds (a dead runner's, or a
    #: retry that is due): reported on a slot's first claim, for backups to claim.
    orphans: tuple[str, ...] = ()
    #: What the slot's last attempt kept (``Run.save_progress``), as the store holds it
    #: (JSON text, read with ``records.decode_progress``); "" for none.
    progress: str = ""


@dataclass(frozen=True, slots=True)
class HeartbeatRequest:
    """Extend the lease of an attempt this instance runs."""

    job: str
    slot_id: str
    token: str
    lease_ms: int
    allow_overlap: bool
    #: The job's ``max_concurrent_fleet`` (None: no limit): the run keeps its permit.
    fleet_max: int | None = None


@dataclass(frozen=True, slots=True)
class AttemptEnd:
    """How an attempt ended, as the runner reports it."""

    job: str
    slot_id: str
    token: str
    attempt: int
    trigger: Trigger
    fence: int
    started_ms: int
    finished_ms: int
    outcome: Outcome
    error: str | None
    max_attempts: int
    retry_delay_ms: int
    #: The job has a fleet limit: the attempt gives its permit back.
    fleet: bool = False
    #: The job's ``pause_after_failures`` (0: none): a slot that finally fails counts.
    pause_after: int = 0


@dataclass(frozen=True, slots=True)
class FinishReply:
    """``held`` is False when the attempt had lost its lease (nothing was written).
    ``status`` is the run's state afterwards; ``retry`` comes with ``retry_in_ms``."""

    held: bool
    status: str
    retry_in_ms: int = 0
    #: This finish paused the job: its ``pause_after_failures`` slots in a row failed.
    paused: bool = False


class Store(ABC):
    """What the engine asks of a store, whatever the strategy behind it: one subclass per
    strategy (``lease.LeaseStore``, and ``claim_only``'s three), chosen by the backend
    (``strategy.py``). What only leasing has (heartbeats, pauses, runs given back) has a
    meaning here for every store, so the engine never asks which one it holds."""

    #: Whether runs are given back and asked for over the prefix's hint channel (the
    #: instances running jobs then listen to it).
    hints_for_jobs: ClassVar[bool] = False
    #: Whether its jobs can be backfilled (``backfill.py``: the lease strategy's slots).
    backfills: ClassVar[bool] = False

    def __init__(
        self,
        conn: Connection,
        *,
        prefix: str,
        runner: str,
        history_size: int,
        history_ttl_ms: int | None = None,
        trim_runs_by_id: bool = False,
    ) -> None:
        self.conn = conn
        self.prefix = prefix
        #: The instance whose runs this store records.
        self.runner = runner
        self.history_size = history_size
        self.history_ttl_ms = history_ttl_ms or 0
        #: History older than history_ttl_ms also leaves the streams (XTRIM MINID,
        #: Redis 6.2+ and Valkey); older servers bound them by history_size alone.
        self.trim_runs_by_id = trim_runs_by_id

    async def prepare_jobs(self, jobs: Sequence[str]) -> None:  # noqa: B027 - optional
        """Ready the store for these jobs before their first claim (nothing by default)."""

    @abstractmethod
    async def claim_many(
        self, requests: Sequence[ClaimRequest]
    ) -> list[ClaimReply | ServerReplyError]:
        """Claim slots in one round trip: a reply (or an error reply) for each, in order."""

    @abstractmethod
    async def claim_manual(self, request: ClaimRequest) -> ClaimReply:
        """Claim a ``run_now`` slot (raises the server's error reply)."""

    @abstractmethod
    def held_until(self, lease_left_ms: int, sent: float) -> float:
        """Until when (monotonic) a won claim sent at ``sent``, answered with
        ``lease_left_ms`` left, holds its run: ``inf`` for a strategy whose wins hold no
        lease to lose."""

    async def heartbeat_many(
        self, beats: Sequence[HeartbeatRequest]
    ) -> list[bool | ServerReplyError]:
        """Extend leases in one round trip; False means that lease is lost. A store whose
        runs hold no lease has none to extend."""
        return [True for _ in beats]

    async def save_progress(self, job: str, slot_id: str, token: str, text: str) -> str | None:
        """Keep an attempt's progress (JSON text) for the slot's next attempt, while the
        attempt (``token``) holds its lease: None when kept, else why not (the run's
        status, ``"expired"``). A store whose runs hold no lease keeps none."""
        raise InvalidOptionError(
            "save_progress needs the lease strategy: a claim-only strategy's runs have no "
            "next attempt to resume"
        )

    @abstractmethod
    async def finish(self, end: AttemptEnd) -> FinishReply:
        """Record how an attempt ended."""

    @abstractmethod
    async def result_of(self, job: str, slot_id: str, attempt: int) -> RunResult:
        """One attempt's result (``LookupError`` if none is recorded)."""

    @abstractmethod
    async def history(self, job: str, limit: int) -> list[RunResult]:
        """The newest ``limit`` results of ``job``, newest first."""

    @abstractmethod
    async def set_paused(self, job: str, paused_by: str | None) -> bool:
        """Pause (``paused_by``: who and when) or resume (None) a job across the fleet;
        whether it changed anything."""

    async def set_in_force(self, fingerprints: dict[str, str]) -> None:  # noqa: B027 - optional
        """Write each job's fingerprint in force where its claims read it (the lease
        strategy's state hash); a strategy whose claims do not ask has nothing to write."""

    @abstractmethod
    def remembered_slots_key(self, job: str) -> str:
        """The key a job's remembered slots are scored in, by their instants."""


def manual_slot_id(requested_ms: int, nonce: str) -> str:
    """A manual run's slot id: never all digits, so never equal to a scheduled slot."""
    return f"m{requested_ms}-{nonce}"


#: The nonce of a run the fleet was asked for (``Inspector.run_now``) starts so.
_FLEET_NONCE = "fleet"


def fleet_slot_id(requested_ms: int, nonce: str) -> str:
    """The slot id of a run the fleet was asked for: a manual one that keeps the job's
    attempts (a stop that gives it back, a runner that dies, hands it to another
    instance), since nobody waits on it to try again."""
    return manual_slot_id(requested_ms, _FLEET_NONCE + nonce)


def is_fleet_request(slot_id: str) -> bool:
    return slot_id.startswith("m") and slot_id.partition("-")[2].startswith(_FLEET_NONCE)


def is_manual(slot_id: str) -> bool:
    """Whether a slot id is a manual run's (``run_now``: one attempt, even when a backup
    takes it over)."""
    return not slot_id.isdigit()


_SLOT_ID = re.compile(r"([0-9]{1,16})|m([0-9]{1,16})-[A-Za-z0-9-]{0,100}")


def is_slot_id(text: object) -> bool:
    """Whether ``text`` is a slot id as anarchon writes them, by the rule the scripts'
    ``is_slot_id`` keeps (lua/lease_state.lua): an instant (epoch ms, at most the end of
    the year 9999), or ``m<instant>-<nonce>`` with a nonce of at most 100 letters, digits
    and '-'. What the store holds is input, and a member that is none is malformed."""
    if not isinstance(text, str) or len(text) > 120:
        return False
    matched = _SLOT_ID.fullmatch(text)
    return matched is not None and instant_ms(matched.group(1) or matched.group(2)) is not None


def slot_ms_of(slot_id: str) -> int:
    """The instant of a slot id: scheduled ids are epoch ms, manual ids carry theirs."""
    if not is_manual(slot_id):
        return int(slot_id)
    return int(slot_id[1:].split("-", 1)[0])


def describe_slot(slot_id: str) -> str:
    """A slot as logs name it: ``slot 2026-12-02T13:40:00Z``, or ``manual run
    2026-12-02T13:40:01.250Z`` (when it was asked for)."""
    when = iso_ms(slot_ms_of(slot_id))
    return f"manual run {when}" if is_manual(slot_id) else f"slot {when}"
