"""The claimer: claims what the agenda says is due, and acts on the store's replies.

The claim loop takes each batch the agenda pops and claims it in round trips of at most
200 claims. A round trip that fails or times out is sent again later with the same
tokens (the claim script recognises a repeat). Replies: a won claim starts an attempt
in the runner; a run in progress elsewhere makes this instance its backup; an older run
still holding the lease makes the claim wait behind it (or skips a scheduled slot);
orphans the store reports are taken over. ``run_now``'s manual claim is made here too.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace

import anyio

from .._errors import AnarchonError, ConnectionFailedError, RunOverlapError, reason
from .._model.job import Job
from .._model.schedule import iso_ms
from .._model.text import visible
from .._observe.events import ClaimAnswer, claim_answered, instant
from .._store.contract import ClaimReply, ClaimRequest, Store, describe_slot
from .._store.timers import TimerClaim
from ..clients import ServerReplyError, is_transient
from ._context import EngineContext, _attempts_for, _now_ms, firing_key
from .agenda import Agenda, _Claim, _Due, _TimerDue
from .runner import Runner
from .settle import Settler

__all__ = ["Claimer"]

log = logging.getLogger("anarchon")

#: The most claims sent in one round trip.
_CLAIM_BATCH_MAX = 200
#: Delays before a failed claim is sent again: the first soon (a lost reply is learned
#: while the slot is young), then backing off; each with a random part of +-20 %.
_CLAIM_RETRY_MS = (50, 250, 500, 1000, 2000, 5000)
#: The most due timers of one kind (bucket) one claim takes.
_TIMER_CLAIM_MAX = 200
#: run_now's manual claim pauses as a failed claim does, for its first three tries only:
#: the caller waits for an answer.
_MANUAL_RETRY_MS = _CLAIM_RETRY_MS[:3]


class Claimer:
    """Claims due slots from the agenda in batches; won ones go to the runner."""

    def __init__(
        self, context: EngineContext, agenda: Agenda, runner: Runner, settler: Settler
    ) -> None:
        self._context = context
        self._agenda = agenda
        self._runner = runner
        self._settler = settler
        #: Set once the claim loop has ended (the scheduler is stopping).
        self.loop_done = anyio.Event()
        #: The timer buckets (due keys) whose last claim the server refused.
        self._refused: set[str] = set()

    async def claim_loop(self) -> None:
        try:
            while self._context.state == "running":
                batch = await self._agenda.next_batch()
                slots, timers = batch.slots, batch.timers
                # A large instant goes in parts: the first runs start while the rest
                # are claimed, and no round trip outgrows a client's request timeout.
                for start in range(0, len(slots), _CLAIM_BATCH_MAX):
                    if self._context.state != "running":
                        break  # stopping: the parts not sent were never claimed
                    await self._claim(slots[start : start + _CLAIM_BATCH_MAX])
                if timers and self._context.state == "running":
                    # Each kind (bucket) is a claim of its own; sent together, they share
                    # a round trip.
                    async with anyio.create_task_group() as group:
                        for due in timers:
                            group.start_soon(self._claim_timers, due)
        finally:
            self.loop_done.set()

    async def _claim_timers(self, due: _TimerDue) -> None:
        """Claim a kind's (bucket's) due timers, up to a batch; run what was won, and put
        the next claim on the agenda: at once if the batch was full, else when the
        earliest timer needs attention, but no later than the poll interval (a timer
        set elsewhere to fire sooner is seen by then). A claim whose round trip failed
        is sent again with its token base: its reply hears of the firings it won."""
        context = self._context
        kind = context.timer_kinds.get(due.kind)
        keys = due.keys
        timer_store = context.timer_store
        if kind is None or timer_store is None:
            return
        sent = time.monotonic()
        claim: TimerClaim | None = None
        failure: BaseException | str = "no reply in time"
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + context.round_trip_sec
            try:
                claim = await timer_store.claim(
                    keys,
                    limit=_TIMER_CLAIM_MAX,
                    lease_ms=context.lease_ms,
                    token_base=due.token,
                    max_attempts=kind.max_attempts,
                )
            except Exception as exc:
                failure = exc
        if claim is None and isinstance(failure, ServerReplyError) and not is_transient(failure):
            # The server answered, with an error (a script error, a key of another
            # type): not an outage. The bucket's claims are tried again, backing off,
            # and said once until one succeeds.
            context.health.answered()
            if keys.due not in self._refused:
                self._refused.add(keys.due)
                log.error(
                    "timers of %s: the server refused the claim of %s (%s); retrying, "
                    "backing off: check what else writes to its keys",
                    kind.name,
                    visible(keys.due),
                    reason(failure),
                )
            self._retry_claims([due])
            return
        if claim is None:
            context.health.failed(f"claiming timers of {kind.name}", failure)
            self._retry_claims([due])
            return
        context.health.answered()
        if keys.due in self._refused:
            self._refused.discard(keys.due)
            log.info("timers of %s: the claim of %s succeeds again", kind.name, visible(keys.due))
        received_ms = _now_ms()
        context.server_offset_ms = claim.server_now_ms - received_ms
        for key in claim.spent:
            log.error(
                "timer %s %r: its runners vanished %d time(s) while it fired, as many as "
                "max_attempts; it is spent, with no attempt that finished",
                kind.name,
                key,
                kind.max_attempts,
            )
        group = context.group
        assert group is not None
        for win in claim.wins:
            if firing_key(kind.name, win.key, win.token) in context.attempts:
                continue  # a claim sent again: this firing runs here already
            if time.monotonic() >= sent + win.lease_left_ms / 1000:
                log.warning(
                    "timer %s %r attempt %d: won, but the reply came after its lease ran "
                    "out; not started (a backup takes it over)",
                    kind.name,
                    win.key,
                    win.attempt,
                )
                continue
            if win.trigger == "lapsed":
                group.start_soon(self._settler.settle_lapsed, kind, keys, win)
                continue
            try:
                self._runner.start_firing(kind, keys, win, sent)
            except Exception as exc:
                # Its payload or recurrence cannot be read here (a time zone this host
                # lacks): the attempt fails, loudly, and nothing else stops.
                log.error(
                    "timer %s %r attempt %d cannot be fired here (%s: %s); the attempt "
                    "counts as failed",
                    kind.name,
                    win.key,
                    win.attempt,
                    type(exc).__name__,
                    exc,
                )
                group.start_soon(self._settler.fail_firing, kind, keys, win)
        at_ms = received_ms + context.timer_poll_ms
        if claim.more:
            at_ms = received_ms
        elif claim.next_ms is not None:
            # next_ms is on the server's clock: so many ms from now on this one.
            at_ms = min(at_ms, received_ms + max(claim.next_ms - claim.server_now_ms, 0))
        self._agenda.timer_due(kind.name, keys, at_ms)

    async def _claim(self, batch: list[_Due]) -> None:
        """Claim every slot of the batch in one round trip and act on the answers.

        The round trip has a deadline (a third of the lease, whatever the client's own
        timeout). If it fails, every claim of the batch is sent again later with its
        token; a claim answered with a transient error reply alone is sent again too;
        one answered with a permanent error disables its job."""
        context = self._context
        store = context.store
        assert store is not None
        requests = [self._claim_request(due) for due in batch]
        replies: list[ClaimReply | ServerReplyError] | None = None
        sent = time.monotonic()
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
            self._retry_claims(batch)
            return
        context.health.answered()
        now_ms = _now_ms()
        again = []
        events = context.events
        for due, request, reply in zip(batch, requests, replies, strict=True):
            if events.on:
                answer: ClaimAnswer = (
                    "refused" if isinstance(reply, ServerReplyError) else reply.kind
                )
                events.emit(  # stamped each: a skip may be emitted between two answers
                    claim_answered(
                        context.instance_id, instant(_now_ms()), due.job, due.slot_ms, answer
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
            self._retry_claims(again)

    async def release_unanswered(self) -> None:
        """On stop: claims whose reply was lost may have won on the server, leaving a
        lease nobody runs that would block the job's next slots on every instance until
        it expired. Ask once more (a probe: it changes nothing) and release what is
        held."""
        taken = self._agenda.take_unanswered()
        store = self._context.store
        if store is None:
            return
        unanswered, timer_claims = taken.slots, taken.timers
        if timer_claims:
            async with anyio.create_task_group() as group:
                for timer_claim in timer_claims:
                    group.start_soon(self._release_unanswered_timers, timer_claim)
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

    async def _release_unanswered_timers(self, due: _TimerDue) -> None:
        """On stop: a claim of due timers whose reply was lost may have won firings that
        nobody runs. Sent again with no room for more (limit 0), it hears of them; each
        is given back (not counted as an attempt), so another instance fires it at once
        instead of a lease later."""
        context = self._context
        kind = context.timer_kinds.get(due.kind)
        timer_store = context.timer_store
        if kind is None or timer_store is None:
            return
        claim: TimerClaim | None = None
        with anyio.move_on_after(context.round_trip_sec):
            try:
                claim = await timer_store.claim(
                    due.keys,
                    limit=0,
                    lease_ms=context.lease_ms,
                    token_base=due.token,
                    max_attempts=kind.max_attempts,
                )
            except Exception as exc:
                context.health.failed(f"resolving timer claims of {kind.name} on stop", exc)
        keys = due.keys
        async with anyio.create_task_group() as group:  # together: one round trip
            for win in claim.wins if claim is not None else ():
                if win.trigger != "lapsed":  # a lapsed recurrence lapses again, a lease later
                    group.start_soon(self._settler.release_firing, kind, keys, win)

    def _claim_request(self, due: _Due) -> ClaimRequest:
        job = self._context.jobs[due.job]
        lease_ms = self._context.lease_ms
        return ClaimRequest(
            job=job.name,
            slot_id=due.slot_id,
            slot_ms=due.slot_ms,
            token=due.token,
            trigger=due.trigger,
            lease_ms=lease_ms,
            max_attempts=_attempts_for(job, due.slot_id),
            allow_overlap=job.overlap,
            keep_ms=job.keep_ms(lease_ms),
            may_start=due.may_start,
            # A scheduled slot blocked by an older run is skipped, unless it may wait
            # (overlap="wait", and no other slot of the job waits here yet).
            skip_if_blocked=due.first
            and due.trigger == "schedule"
            and (
                job.overlap_policy == "skip"
                or (job.overlap_policy == "wait" and self._agenda.has_waiter(job))
            ),
        )

    def _retry_claims(self, batch: Sequence[_Claim]) -> None:
        """Claims whose round trip failed are sent again with the same token (the claim
        script recognises a repeat), after a growing delay.

        A slot's first claim whose job has a newer slot due by then is sent again only
        to learn whether it had won (its reply may have been lost after the server
        applied it): it may no longer start the run, so a backlog of old slots never
        runs late in place of the on-time one (``_Due.before_retry``)."""
        now_ms = _now_ms()
        for due in batch:
            wait_ms = _CLAIM_RETRY_MS[min(due.failures, len(_CLAIM_RETRY_MS) - 1)]
            self._agenda.push_again(due, now_ms + wait_ms * random.uniform(0.8, 1.2))

    def _on_claim_reply(
        self, due: _Due, reply: ClaimReply, now_ms: float, sent: float, skipped: bool = False
    ) -> None:
        job = self._context.jobs.get(due.job)
        if job is None:
            return
        for orphan in reply.orphans:
            self._take_over(job, orphan, now_ms)
        if reply.kind == "won":
            if (job.name, due.slot_id) in self._context.attempts:
                return  # a repeated claim of an attempt that runs here already
            store = self._context.store
            leased = store is not None and store.leases  # claim-only wins hold no lease
            if leased and time.monotonic() >= sent + reply.wait_ms / 1000:
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
        elif reply.kind == "overlap":
            if skipped:
                self._log_skipped(job, due)
            else:
                # Catch-up slots, retries and overlap="wait" wait their turn.
                self._wait_behind_overlap(job, due, reply.wait_ms, now_ms)
        elif reply.kind == "done" and reply.status == "paused":
            log.info(
                "%s: slot %s skipped (recorded in history): the job is paused",
                job.name,
                iso_ms(due.slot_ms),
                extra={"job": job.name, "slot_ms": due.slot_ms},
            )
            self._context.skipped(job.name, due.slot_ms, "paused")
        elif reply.kind == "done" and reply.status == "skipped" and due.failures > 0:
            # This instance's own skip whose reply was lost (or another's, which its
            # failed first claim missed): the warning is not lost with the reply.
            self._log_skipped(job, due)

    def _log_skipped(self, job: Job, due: _Due) -> None:
        log.warning(
            "%s: slot %s skipped (recorded in history): an older run of the job is "
            "not settled yet, and overlap=%r",
            job.name,
            iso_ms(due.slot_ms),
            job.overlap_policy,
        )
        self._context.skipped(job.name, due.slot_ms, "overlap")

    def _back_up(self, job: Job, due: _Due, wait_ms: int, now_ms: float) -> None:
        """Become a backup of a run in progress: ask again when its lease (or retry delay)
        runs out. When this instance claims the job's next slot before then, that claim
        reports the run if it is orphaned, so no extra claim is needed."""
        ask_at_ms = now_ms + max(wait_ms, 1)
        next_slot_ms = self._agenda.next_slot_ms.get(job.name)
        if next_slot_ms is not None and next_slot_ms + job.jitter_ms < ask_at_ms:
            return
        self._agenda.push_follow_up(job, due.slot_id, due.trigger, ask_at_ms)

    def _take_over(self, job: Job, slot_id: str, now_ms: float) -> None:
        """Claim a slot that nobody holds any more (its runner died, or its retry is due)."""
        key = (job.name, slot_id)
        if key in self._agenda.pending or key in self._context.attempts:
            return
        self._agenda.push_follow_up(job, slot_id, "retry", now_ms)

    def _wait_behind_overlap(self, job: Job, due: _Due, wait_ms: int, now_ms: float) -> None:
        """Ask again when the live run's lease runs out, or as soon as a run of the job on
        this instance ends, whichever is first."""
        waiting = self._agenda.push_follow_up(
            job, due.slot_id, due.trigger, now_ms + max(wait_ms, 1), may_start=due.may_start
        )
        self._agenda.wake_when_run_ends(job, waiting)

    async def claim_manual(
        self, job: Job, slot_id: str, requested_ms: int, token: str
    ) -> tuple[ClaimReply, float]:
        """Claim a ``run_now`` slot: won, with when the winning try was sent (monotonic;
        its reply's lease is counted from then), or refused with ``RunOverlapError``."""
        store = self._context.store
        assert store is not None
        lease_ms = self._context.lease_ms
        request = ClaimRequest(
            job=job.name,
            slot_id=slot_id,
            slot_ms=requested_ms,
            token=token,
            trigger="manual",
            lease_ms=lease_ms,
            max_attempts=_attempts_for(job, slot_id),
            allow_overlap=job.overlap,
            keep_ms=job.keep_ms(lease_ms),
        )
        reply, sent = await self._claim_manual_with_retries(store, job, request)
        for orphan in reply.orphans:
            self._take_over(job, orphan, _now_ms())
        if reply.kind == "overlap":
            here = any(name == job.name for name, _ in self._context.attempts)
            where = "on this instance" if here else "elsewhere"
            raise RunOverlapError(
                f"{job.name!r} has a run that is not settled yet ({where}; "
                f"{reply.wait_ms} ms left on its lease or retry delay) and does not allow "
                "overlapping runs: wait for it to end, or define the job with overlap=True"
            )
        if reply.kind != "won":  # a fresh slot id has no state: only won or overlap
            raise AnarchonError(f"unexpected reply to a manual claim of {job.name!r}: {reply}")
        return reply, sent

    async def _claim_manual_with_retries(
        self, store: Store, job: Job, request: ClaimRequest
    ) -> tuple[ClaimReply, float]:
        """The manual claim's round trip, sent again with its token after a failure or a
        transient error reply (a lost reply's claim may have won: the repeat says so),
        a few times with short pauses; then the server counts as unreachable.

        Returns the reply and when its try was sent: a repeat's reply says how much of
        the lease is left at the server, so the lease is counted from the try that
        answered, not from the first (whose tries may have taken longer than a lease
        while the server was out of reach)."""
        failure: BaseException | str = "no reply in time"
        round_trip_sec = self._context.round_trip_sec
        for pause_ms in (*_MANUAL_RETRY_MS, None):
            replies: list[ClaimReply | ServerReplyError] | None = None
            sent = time.monotonic()
            with anyio.move_on_after(round_trip_sec):
                try:
                    replies = await store.claim_many([request])
                except Exception as exc:
                    failure = exc
            if replies is not None:
                (reply,) = replies
                if not isinstance(reply, ServerReplyError):
                    return reply, sent
                if not is_transient(reply):
                    raise AnarchonError(
                        f"the server refused the manual claim of {job.name!r}: {reason(reply)}"
                    )
                failure = reply
            if pause_ms is None:
                break
            await anyio.sleep(pause_ms / 1000 * random.uniform(0.8, 1.2))
        raise ConnectionFailedError(
            f"the manual claim of {job.name!r} got no answer in "
            f"{len(_MANUAL_RETRY_MS) + 1} tries (each within {round_trip_sec:.2f} s; last: "
            f"{reason(failure)}); is the server reachable? If a try did reach it, the run's lease "
            "expires unused and the job's next slots wait for it"
        )
