"""The claimer: claims what the agenda says is due, and acts on the store's replies.

The claim loop takes each batch the agenda pops and claims it in round trips of at most
200 claims. A round trip that fails or times out is sent again later with the same
tokens (the claim script recognises a repeat). Replies: a won claim starts an attempt
in the runner; a run in progress elsewhere makes this instance its backup; an older run
still holding the lease makes the claim wait behind it (or skips a scheduled slot);
orphans the store reports are taken over. The batch's due timers go to the timers'
claimer (``timer_claims.py``); ``run_now``'s manual claim is made in ``manual.py``.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import replace

import anyio

from .._errors import reason
from .._model.clock import monotonic, wall_ms
from .._model.job import Job
from .._model.schedule import iso_ms
from .._model.text import visible
from .._observe.events import ClaimAnswer, SkipReason, claim_answered, instant
from .._store.contract import ClaimReply, ClaimRequest, Store, describe_slot
from ..clients import ServerReplyError, is_transient
from .agenda import Agenda, DueSlot
from .context import EngineContext
from .runner import Runner
from .settle import Settler
from .timer_claims import TimerClaimer
from .work import attempts_for

__all__ = ["Claimer"]

log = logging.getLogger("anarchon")

#: The most claims sent in one round trip.
_CLAIM_BATCH_MAX = 200


#: The claim replies of a slot this claim recorded skipped: why (for the log), and the
#: ``SlotSkipped`` reason.
_RECORDED_SKIPS: dict[str, tuple[str, SkipReason]] = {
    "paused": ("the job is paused", "paused"),
    "excluded": ("the job's exclude= leaves it out", "excluded"),
    "superseded": ("a newer slot waits in its place (overlap='buffer_one')", "overlap"),
}


class Claimer:
    """Claims due slots from the agenda in batches; won ones go to the runner."""

    def __init__(
        self,
        context: EngineContext,
        store: Store,
        agenda: Agenda,
        runner: Runner,
        settler: Settler,
        timers: TimerClaimer,
    ) -> None:
        self._context = context
        self._store = store
        self._agenda = agenda
        self._runner = runner
        self._settler = settler
        self._timers = timers
        #: Set once the claim loop has ended (the scheduler is stopping).
        self.loop_done = anyio.Event()

    async def claim_loop(self) -> None:
        try:
            while self._context.state == "running":
                batch = await self._agenda.next_batch()
                slots, timers = batch.slots, batch.timers
                await self._claim_in_parts(slots)
                if timers and self._context.state == "running":
                    # Each kind (bucket) is a claim of its own; sent together, they share
                    # a round trip.
                    async with anyio.create_task_group() as group:
                        for due in timers:
                            group.start_soon(self._timers.claim, due)
        finally:
            self.loop_done.set()

    async def _claim_in_parts(self, slots: list[DueSlot]) -> None:
        """Claim the slots due together in parts: a large instant goes in round trips of
        at most 200 (the first runs start while the rest are claimed, and no round trip
        outgrows a client's request timeout), and never more than this instance has
        room for (``Capacity``). At its bound it claims nothing and waits for a run to
        end: the slots stay in the store for the other instances, and a first claim
        that has become too late meanwhile is skipped, as any late one is. A slot of a
        job at its own bound (``max_concurrent``) waits on the agenda instead, so that
        the other jobs go on."""
        context, capacity = self._context, self._context.capacity
        rest = slots
        while rest and context.state == "running":
            if capacity.free() <= 0:
                await capacity.wait()
                if context.state != "running":
                    break  # stopping: the parts not sent were never claimed
                rest = self._agenda.still_in_time(rest, wall_ms())
            part, rest = self._part(rest, min(_CLAIM_BATCH_MAX, capacity.free()))
            if not part:
                continue
            capacity.reserve(len(part))
            try:
                await self._claim(part)
            finally:
                capacity.unreserve(len(part))

    def _part(self, slots: list[DueSlot], room: int) -> tuple[list[DueSlot], list[DueSlot]]:
        """The next part to claim (at most ``room``) and the rest; a slot of a job at its
        own bound is held on the agenda (``Agenda.hold_for_room``)."""
        capacity = self._context.capacity
        part: list[DueSlot] = []
        taken: dict[str, int] = {}
        for index, due in enumerate(slots):
            if len(part) >= room:
                return part, slots[index:]
            job = self._context.jobs.get(due.job)
            bound = None if job is None else job.max_concurrent
            if bound is not None:
                count = taken.get(due.job, 0)
                if capacity.free(("job", due.job), bound) <= count:
                    self._agenda.hold_for_room(due)
                    continue
                taken[due.job] = count + 1
            part.append(due)
        return part, []

    async def _claim(self, batch: list[DueSlot]) -> None:
        """Claim every slot of the batch in one round trip and act on the answers.

        The round trip has a deadline (a third of the lease, whatever the client's own
        timeout). If it fails, every claim of the batch is sent again later with its
        token; a claim answered with a transient error reply alone is sent again too;
        one answered with a permanent error disables its job."""
        context = self._context
        store = self._store
        requests = [self._claim_request(due) for due in batch]
        replies: list[ClaimReply | ServerReplyError] | None = None
        sent = monotonic()
        failure: BaseException | str = "no reply in time"
        tracing = context.tracing
        with tracing.claim_batch(len(requests)) if tracing else nullcontext() as trace:
            with anyio.CancelScope(shield=True) as scope:
                scope.deadline = anyio.current_time() + context.round_trip_sec
                try:
                    replies = await store.claim_many(requests)
                except Exception as exc:
                    failure = exc
            if replies is None and trace is not None:
                trace.failed(failure)
        if replies is None:
            context.health.failed(f"claiming {len(batch)} slot(s)", failure)
            self._agenda.retry(batch)
            return
        context.health.answered()
        now_ms = wall_ms()
        again = []
        events = context.events
        for due, request, reply in zip(batch, requests, replies, strict=True):
            if events.on:
                answer: ClaimAnswer = (
                    "refused" if isinstance(reply, ServerReplyError) else reply.kind
                )
                events.emit(  # stamped each: a skip may be emitted between two answers
                    claim_answered(
                        context.instance_id, instant(wall_ms()), due.job, due.slot_ms, answer
                    )
                )
            if isinstance(reply, ServerReplyError):
                if is_transient(reply):
                    log.warning(
                        "%s: the claim of %s was refused for now, retrying: %s",
                        due.job,
                        describe_slot(due.slot_id),
                        reply,
                    )
                    again.append(due)
                else:
                    context.disable(
                        due.job,
                        f"the server answered its claim of slot {due.slot_id} with "
                        f"{reason(reply)}; "
                        "check that nothing else writes to its keys (prefix) and that the "
                        "connection's user may run scripts",
                    )
                continue
            try:
                self._on_claim_reply(due, reply, now_ms, sent, skipped=request.skip_if_blocked)
            except Exception:
                # What the store answered is input: an answer that cannot be acted on
                # costs its slot, never the claim loop (and with it every job here).
                log.exception(
                    "%s: the answer to the claim of slot %s could not be acted on; that "
                    "slot alone is passed over",
                    due.job,
                    visible(due.slot_id, 120),
                )
        if again:
            self._agenda.retry(again)

    async def release_unanswered(self) -> None:
        """On stop: claims whose reply was lost may have won on the server, leaving a
        lease nobody runs that would block the job's next slots on every instance until
        it expired. Ask once more (a probe: it changes nothing) and release what is
        held."""
        taken = self._agenda.take_unanswered()
        store = self._store
        unanswered, timer_claims = taken.slots, taken.timers
        if timer_claims:
            async with anyio.create_task_group() as group:
                for timer_claim in timer_claims:
                    group.start_soon(self._timers.release_unanswered, timer_claim)
        for start in range(0, len(unanswered), _CLAIM_BATCH_MAX):
            part = unanswered[start : start + _CLAIM_BATCH_MAX]
            requests = [replace(self._claim_request(due), probe=True) for due in part]
            replies: list[ClaimReply | ServerReplyError] | None = None
            with anyio.move_on_after(self._context.round_trip_sec):
                try:
                    replies = await store.claim_many(requests)
                except Exception as exc:
                    self._context.health.failed("resolving claims on stop", exc)
            # Released together, so their finishes share one round trip.
            async with anyio.create_task_group() as group:
                for due, reply in zip(part, replies or [], strict=False):
                    job = self._context.jobs.get(due.job)
                    if isinstance(reply, ClaimReply) and reply.kind == "won" and job is not None:
                        group.start_soon(self._settler.release, job, due.slot_id, due.token, reply)

    def _claim_request(self, due: DueSlot) -> ClaimRequest:
        job = self._context.jobs[due.job]
        lease_ms = self._context.lease_ms
        return ClaimRequest(
            job=job.name,
            slot_id=due.slot_id,
            slot_ms=due.slot_ms,
            token=due.token,
            trigger=due.trigger,
            lease_ms=lease_ms,
            max_attempts=attempts_for(job, due.slot_id),
            allow_overlap=job.overlap,
            keep_ms=job.keep_ms(lease_ms),
            may_start=due.may_start,
            # A scheduled slot blocked by an older run is skipped, unless it may wait
            # (overlap="wait", and no other slot of the job waits here yet; or
            # "buffer_one", where the newest waits), or ends the older run ("replace").
            skip_if_blocked=due.first
            and due.trigger == "schedule"
            and (
                job.overlap_policy == "skip"
                or (job.overlap_policy == "wait" and self._agenda.has_waiter(job))
            ),
            superseded=due.superseded,
            replace=due.first and due.trigger == "schedule" and job.overlap_policy == "replace",
            fleet_max=job.max_concurrent_fleet,
            max_runs=job.max_runs,
            # Every claim of an excluded slot says so: the fleet's first records it skipped.
            excluded=job.excluded(due.slot_ms)
            if job.exclude is not None and due.trigger in ("schedule", "catch-up")
            else None,
            fingerprint=self._context.fingerprints.get(job.name, ""),
        )

    def _on_claim_reply(
        self, due: DueSlot, reply: ClaimReply, now_ms: float, sent: float, skipped: bool = False
    ) -> None:
        job = self._context.jobs.get(due.job)
        if job is None:
            return
        for orphan in reply.orphans:
            self.take_over(job, orphan, now_ms)
        if job.overlap_policy == "buffer_one" and due.first and reply.kind in ("won", "overlap"):
            # A newer slot runs or waits: the older ones waiting here give it their place.
            self._agenda.supersede_waiters(job, due.slot_ms)
        if reply.kind == "won":
            if job.name in self._context.finished:
                self._context.unfinish(job.name)
            if (job.name, due.slot_id) in self._context.attempts:
                return  # a repeated claim of an attempt that runs here already
            if monotonic() >= self._store.held_until(reply.wait_ms, sent):
                # The reply came back after the lease it granted ran out (a starved
                # machine): a backup may run this attempt already, so it is not started.
                log.warning(
                    "%s %s attempt %d: won, but the reply came after its lease ran out; not "
                    "started (a backup takes it over)",
                    job.name,
                    describe_slot(due.slot_id),
                    reply.attempt,
                )
                return
            self._runner.start_attempt(job, due.slot_id, due.token, reply, sent)
        elif reply.kind == "running":
            self._back_up(job, due, reply.wait_ms, now_ms)
        elif reply.kind == "overlap" and reply.status == "fleet":
            # The job's runs in the fleet hold every permit: the slot waits for one (asked
            # again when a run here ends, or at the poll interval: runs end elsewhere too).
            wait_ms = min(reply.wait_ms, self._context.timer_poll_ms)
            self._context.fleet_waited(("job", job.name), "concurrent")
            self._wait_behind_overlap(job, due, wait_ms, now_ms)
        elif reply.kind == "overlap":
            if skipped:
                self._log_skipped(job, due)
            else:
                # Catch-up slots, retries and overlap="wait" wait their turn.
                self._wait_behind_overlap(job, due, reply.wait_ms, now_ms)
        elif reply.kind == "done" and reply.status == "finished":
            self._context.finish(job.name, f"its runs reached its max_runs ({job.max_runs})")
        elif reply.kind == "done" and reply.status == "outdated":
            # Another definition of the job is in force: no new slot of it is claimed here
            # until the registry says this one is (its next renewal says which, loudly).
            self._context.outdated_by_store(job.name)
        elif reply.kind == "done" and reply.status in _RECORDED_SKIPS:
            why, reason = _RECORDED_SKIPS[reply.status]
            log.info(
                "%s: slot %s skipped (recorded in history): %s",
                job.name,
                iso_ms(due.slot_ms),
                why,
                extra={"job": job.name, "slot_ms": due.slot_ms},
            )
            self._context.skipped(job.name, due.slot_ms, reason)
        elif reply.kind == "done" and reply.status == "forgotten" and due.gave_way:
            # Its first claim got no answer while it could start the slot: it did not.
            log.warning(
                "%s: slot %s skipped: its claim got no answer until it was too late or a "
                "newer slot was due (max_late_ms=%d, catch_up_ms=%d)",
                job.name,
                iso_ms(due.slot_ms),
                job.max_late_ms,
                job.catch_up_ms,
            )
            self._context.skipped(job.name, due.slot_ms, "late")
        elif reply.kind == "done" and reply.status == "skipped" and due.failures > 0:
            # This instance's own skip whose reply was lost (or another's, which its
            # failed first claim missed): the warning is not lost with the reply.
            self._log_skipped(job, due)

    def _log_skipped(self, job: Job, due: DueSlot) -> None:
        log.warning(
            "%s: slot %s skipped (recorded in history): an older run of the job is "
            "not settled yet, and overlap=%r",
            job.name,
            iso_ms(due.slot_ms),
            job.overlap_policy,
        )
        self._context.skipped(job.name, due.slot_ms, "overlap")

    def _back_up(self, job: Job, due: DueSlot, wait_ms: int, now_ms: float) -> None:
        """Become a backup of a run in progress: ask again when its lease (or retry delay)
        runs out. When this instance claims the job's next slot before then, that claim
        reports the run if it is orphaned, so no extra claim is needed."""
        ask_at_ms = now_ms + max(wait_ms, 1)
        next_slot_ms = self._agenda.next_slot_ms.get(job.name)
        if next_slot_ms is not None and next_slot_ms + job.jitter_ms < ask_at_ms:
            return
        self._agenda.push_follow_up(job, due.slot_id, due.trigger, ask_at_ms)

    def take_over(self, job: Job, slot_id: str, now_ms: float) -> None:
        """Claim a slot that nobody holds any more (its runner died, or its retry is due)."""
        key = (job.name, slot_id)
        if key in self._agenda.pending or key in self._context.attempts:
            return
        self._agenda.push_follow_up(job, slot_id, "retry", now_ms)

    def _wait_behind_overlap(self, job: Job, due: DueSlot, wait_ms: int, now_ms: float) -> None:
        """Ask again when the live run's lease runs out, or as soon as a run of the job on
        this instance ends, whichever is first."""
        waiting = self._agenda.push_follow_up(
            job, due.slot_id, due.trigger, now_ms + max(wait_ms, 1), may_start=due.may_start
        )
        self._agenda.wake_when_run_ends(job, waiting)
