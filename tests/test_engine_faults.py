"""The engine under faults (design section 8): nothing but ``stop()`` ends the
scheduler, no claim is dropped for good by an error, round trips have deadlines,
``stop()`` is bounded and safe to cancel.

Faults are real: a loopback proxy between the scheduler and a real server
(tests/faults.py) that freezes or cuts the traffic, and error replies that the
real server gives when it is out of memory."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from anarchon import (
    ConnectionFailedError,
    Inspector,
    RedisBackend,
    Run,
    Scheduler,
    TimerRun,
    TransportError,
)
from anarchon._store.keys import JobKeys
from anarchon._store.scripts import Script, lua_source
from anarchon.clients import ServerReplyError, open_connection
from tests.faults import FaultProxy, oom
from tests.helpers import NEVER, Ledger, OneShot, claim_as, claim_for_a_dead_runner, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.engine_tier]


class SendClient:
    """A user's own client of the ``send(command, args)`` kind, over redis-py without
    retries (so that the faults reach anarchon)."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(
            url, protocol=2, retry=Retry(NoBackoff(), 0), socket_timeout=2
        )

    def send(self, command: str, args: list[str]) -> Any:
        return self.client.execute_command(command, *args)


_MANUAL_SLOT = re.compile(r"m[0-9]+-[0-9a-f]{8}")


class ClaimTriesClient(SendClient):
    """A send client that counts the manual claims that failed (their slot ids start
    with ``m``) and calls ``then`` as the ``fail``-th fails: a fault proxy's refusal is
    lifted between two tries, whatever the load on the machine."""

    def __init__(self, url: str, *, fail: int, then: Callable[[], None]) -> None:
        super().__init__(url)
        self.failed_claims = 0
        self._fail = fail
        self._then = then

    def send(self, command: str, args: list[str]) -> Any:
        try:
            return super().send(command, args)
        except redis.ConnectionError:
            if command in ("EVAL", "EVALSHA") and any(map(_MANUAL_SLOT.fullmatch, args)):
                self.failed_claims += 1
                if self.failed_claims == self._fail:
                    self._then()
            raise


# ------------------------------------------------- nothing ends the scheduler


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # redis-py's async client
async def test_a_send_clients_batch_over_a_reset_connection_raises_one_transport_error(
    proxy: FaultProxy,
) -> None:
    """An async ``send()`` client's commands of one batch go out side by side; when its
    connections are reset, the batch fails as one ``TransportError``, as every other
    adapter's does (never an exception group, which no caller expects)."""
    import redis.asyncio

    from anarchon.clients.send import SendConnection

    class AsyncSend:
        def __init__(self) -> None:
            self.client = redis.asyncio.Redis.from_url(
                proxy.url, protocol=2, retry=Retry(NoBackoff(), 0)
            )

        async def send(self, command: str, args: list[str]) -> Any:
            return await self.client.execute_command(command, *args)

    user = AsyncSend()
    conn = SendConnection(user)
    try:
        assert len(await conn.pipeline([("PING",), ("PING",)])) == 2
        proxy.refuse(True)
        with pytest.raises(TransportError):
            await conn.pipeline([("PING",), ("PING",), ("PING",)])
    finally:
        proxy.refuse(False)
        await user.client.aclose()


async def test_a_send_clients_dropped_connection_does_not_end_the_scheduler(
    server_url: str, proxy: FaultProxy, prefix: str, direct: redis.Redis
) -> None:
    ledger = Ledger(direct, prefix)
    client = SendClient(proxy.url)
    scheduler = Scheduler(
        RedisBackend(redis=client, prefix=prefix), lease_ms=2000, heartbeat_ms=500
    )

    @scheduler.job(every_ms=200, name="tick")
    async def tick(run: Run) -> None:
        await ledger.record(run)

    async with scheduler:
        await anyio.sleep(0.6)
        proxy.refuse(True)  # every connection reset, new ones refused, for a second
        await anyio.sleep(1.0)
        proxy.refuse(False)
        back_ms = time.time() * 1000
        await wait_until(
            lambda: any(slot > back_ms + 500 for _, slot in ledger.counts()),
            5,
            "runs after the connection came back",
        )
    client.client.close()


async def test_a_schedule_that_raises_disables_its_job_alone(
    server_url: str, prefix: str, direct: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger(direct, prefix)

    class Broken:
        """Fires once, then raises (or, the second kind, answers a naive datetime)."""

        def __init__(self, naive: bool) -> None:
            self.calls = 0
            self.naive = naive

        def next_after(self, moment: datetime, /) -> datetime:
            self.calls += 1
            if self.calls > 1:
                if self.naive:
                    return datetime.now() + timedelta(seconds=1)  # naive, on purpose
                raise RuntimeError("the schedule is broken")
            return (moment + timedelta(milliseconds=300)).replace(microsecond=0) + timedelta(
                seconds=1
            )

    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(every_ms=200, name="good")
    async def good(run: Run) -> None:
        await ledger.record(run)

    for naive in (False, True):
        scheduler.add_job(ledger.record, Broken(naive), name=f"broken-{naive}")

    with caplog.at_level(logging.ERROR, logger="anarchon"):
        async with scheduler:
            await anyio.sleep(2.5)
            before = len(ledger.counts())
            await anyio.sleep(0.5)
            after = len(ledger.counts())
    assert after > before, "the good job stopped running"
    disabled = [r for r in caplog.records if r.levelno == logging.ERROR and "disabled" in r.msg]
    assert len(disabled) == 2, [r.getMessage() for r in caplog.records]


# ---------------------------------------------------- no claim dropped for good


async def test_a_backups_claim_answered_oom_is_retried_and_takes_over(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """A rare job (it fires once): its dead runner is noticed only by the backup's own
    claim at the lease's expiry. That claim meets a server out of memory; once memory is
    back the backup must still take the run over."""
    lease_ms = 1000
    schedule = OneShot.in_ms(200)
    slot_ms = int(schedule.at.timestamp() * 1000)
    await claim_for_a_dead_runner(server_url, prefix, "rare", slot_ms, lease_ms)
    attempts: list[int] = []
    scheduler = Scheduler(
        RedisBackend(redis=server_url, prefix=prefix), lease_ms=lease_ms, heartbeat_ms=300
    )

    @scheduler.job(schedule, name="rare")
    async def rare(run: Run) -> None:
        attempts.append(run.attempt)

    async with scheduler:
        await anyio.sleep(max(0.0, slot_ms / 1000 - time.time()) + 0.3)  # backup now
        with oom(direct):
            await anyio.sleep(lease_ms / 1000 + 0.5)  # the lease expires meanwhile
        await wait_until(lambda: attempts == [2], 10, "the takeover after the OOM")


# ------------------------------------------------------------- stop() is safe


async def test_a_cancelled_stop_leaves_a_later_stop_and_the_block_able_to_finish(
    server_url: str, prefix: str
) -> None:
    started = anyio.Event()
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), stop_grace_ms=10_000)

    @scheduler.job(OneShot.in_ms(100), name="slow")
    async def slow() -> None:
        started.set()
        await anyio.sleep(30)

    with anyio.fail_after(15):
        async with scheduler:
            await started.wait()
            with anyio.move_on_after(0.2):
                await scheduler.stop()  # waits for the grace period: cancelled meanwhile
            with anyio.fail_after(3):
                await scheduler.stop(grace_ms=0)


async def test_a_scheduler_whose_task_is_cancelled_still_stops_and_closes_its_connection(
    proxy: FaultProxy, prefix: str
) -> None:
    """Ctrl-C, or a task group around ``async with`` ending, cancels the scheduler's
    task: leaving the block stops it all the same, and the connection it opened from a
    URL is closed, not leaked (the stop runs shielded, so the cancellation does not
    cut it short)."""
    started = anyio.Event()
    scheduler = Scheduler(RedisBackend(redis=proxy.url, prefix=prefix), stop_grace_ms=100)

    @scheduler.job(OneShot.in_ms(100), name="long")
    async def long() -> None:
        started.set()
        await anyio.sleep(30)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:

            async def host() -> None:
                async with scheduler:
                    await anyio.sleep_forever()

            group.start_soon(host)
            await started.wait()
            assert proxy.connections_open >= 1
            group.cancel_scope.cancel()
    await wait_until(lambda: proxy.connections_open == 0, 2, "the connection closed")


async def test_stop_called_from_a_handler_stops_the_scheduler_and_the_run_settles(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    schedule = OneShot.in_ms(100)
    returned = anyio.Event()
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix))

    @scheduler.job(schedule, name="quitter")
    async def quitter() -> None:
        await scheduler.stop()
        returned.set()

    with anyio.fail_after(10):
        async with scheduler:
            await returned.wait()
            await scheduler.stop()  # returns once stopped (the handler's run included)
    state = direct.hget(
        JobKeys.for_job(prefix, "quitter").state, str(int(schedule.at.timestamp() * 1000))
    )
    assert str(state).startswith("ok|"), state


# -------------------------------------------------------- deadlines, not hopes


async def test_stop_is_bounded_while_a_finished_run_waits_to_record_its_result(
    proxy: FaultProxy, prefix: str
) -> None:
    """A run that ended while the server was unreachable tries again to record its
    result, backing off (0.2, 0.5, 1, 2, 5 s). A stop meanwhile makes one last try and
    returns: it does not sit out the backoff."""
    ended = anyio.Event()
    scheduler = Scheduler(
        RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=900, stop_grace_ms=0
    )

    @scheduler.job(OneShot.in_ms(100), name="quick")
    async def quick() -> None:
        proxy.refuse(True)  # its finish, and everything after it, is refused
        ended.set()

    with anyio.fail_after(20):
        async with scheduler:
            await ended.wait()
            # 0.2 + 0.5 + 1 s of backoff after the first try: now in the 2 s wait.
            await anyio.sleep(1.9)
            started = time.monotonic()
            await scheduler.stop()
            took = time.monotonic() - started
    assert took < 1.2, f"stop() took {took:.2f} s while a finish backed off"


async def test_stop_is_bounded_while_the_server_is_frozen(proxy: FaultProxy, prefix: str) -> None:
    started = anyio.Event()
    scheduler = Scheduler(
        RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=2000, heartbeat_ms=500
    )

    @scheduler.job(OneShot.in_ms(100), name="frozen")
    async def frozen() -> None:
        started.set()
        await anyio.sleep(30)

    async with scheduler:
        await started.wait()
        proxy.pause()
        began = time.monotonic()
        with anyio.fail_after(10):
            await scheduler.stop(grace_ms=0)
        took = time.monotonic() - began
    proxy.resume()
    # grace 0 plus one round trip's deadline (a fraction of the lease)
    assert took < 2.0 + 1.0, took


async def test_stop_is_bounded_while_a_claim_waits_on_a_frozen_server(
    proxy: FaultProxy, prefix: str
) -> None:
    """A claim batch has a deadline of its own (a third of the lease), not the client's
    timeout (a URL's connection has none): a stop that begins while a claim waits on a
    frozen server ends within the grace and that deadline."""
    ran = anyio.Event()
    scheduler = Scheduler(
        RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=2000, heartbeat_ms=500
    )

    @scheduler.job(every_ms=100, name="frequent")
    async def frequent() -> None:
        ran.set()

    async with scheduler:
        with anyio.fail_after(15):
            await ran.wait()
        proxy.pause()
        # A claim goes out every 100 ms, and the loop waits on its reply: after three
        # periods it waits on one sent into the freeze (its deadline is 0.67 s away).
        # The frozen proxy reads nothing, so there is no event to wait on.
        await anyio.sleep(0.3)
        began = time.monotonic()
        try:
            with anyio.fail_after(10):
                await scheduler.stop(grace_ms=0)
        finally:
            # Thawed before the block's own stop: a stop that did not end in time
            # fails the test now, not at the test run's timeout.
            proxy.resume()
        took = time.monotonic() - began
    # Grace 0, the claim's deadline, then the stop's own round trips (the probe of that
    # claim, the registry's withdrawal, the close): a third of the lease each, 2.7 s.
    # Without the claim's deadline the stop waited 6 s.
    assert took < 4.5, took


async def test_a_runner_that_cannot_reach_the_server_gives_up_its_lease_by_its_expiry(
    proxy: FaultProxy, prefix: str
) -> None:
    """Self-fencing is local: the handler is cancelled when the lease would expire
    (counted from the last heartbeat that got through), without waiting for a reply."""
    lease_ms = 2000
    started = anyio.Event()
    cancelled_at: list[float] = []
    scheduler = Scheduler(
        RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=lease_ms, heartbeat_ms=500
    )

    @scheduler.job(OneShot.in_ms(100), name="cut-off")
    async def cut_off() -> None:
        started.set()
        try:
            await anyio.sleep(30)
        finally:
            cancelled_at.append(time.monotonic())

    async with scheduler:
        await started.wait()
        await anyio.sleep(0.7)  # a heartbeat or two got through
        proxy.pause()
        paused_at = time.monotonic()
        await wait_until(lambda: bool(cancelled_at), 10, "the handler to be cancelled")
        proxy.resume()
    assert cancelled_at[0] - paused_at < lease_ms / 1000 + 0.5


# --------------------------------------------------------- sync handlers


async def test_a_sync_handler_that_returns_on_lease_lost_is_recorded_cancelled(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    """The documented pattern (return when ``run.lease_lost`` is set, e.g. on stop):
    the half-done run must not be recorded ok; it is released for a retry."""
    schedule = OneShot.in_ms(100)
    started = anyio.Event()
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), stop_grace_ms=0)

    @scheduler.job(schedule, name="careful")
    def careful(run: Run) -> None:
        anyio.from_thread.run_sync(started.set)
        while not run.lease_lost.wait(0.05):
            pass  # a step of the work

    async with scheduler:
        await started.wait()
    state = str(
        direct.hget(
            JobKeys.for_job(prefix, "careful").state, str(int(schedule.at.timestamp() * 1000))
        )
    )
    assert state.split("|")[:2] == ["retry", "1"], state
    # Released as cancelled (not failed): the retry may start at once, not after a delay.
    results = direct.zrange(JobKeys.for_job(prefix, "careful").results, 0, -1)
    assert [str(m).split("|")[2] for m in results] == ["cancelled"]
    assert int(state.split("|")[3]) <= int(str(results[0]).split("|")[4])


async def test_raise_if_lost_ends_a_sync_handler_as_cancelled(
    server_url: str, prefix: str, direct: redis.Redis
) -> None:
    schedule = OneShot.in_ms(100)
    started = anyio.Event()
    scheduler = Scheduler(RedisBackend(redis=server_url, prefix=prefix), stop_grace_ms=0)

    @scheduler.job(schedule, name="careful")
    def careful(run: Run) -> None:
        anyio.from_thread.run_sync(started.set)
        while True:
            time.sleep(0.02)  # a step of the work
            run.raise_if_lost()

    async with scheduler:
        await started.wait()
    results = direct.zrange(JobKeys.for_job(prefix, "careful").results, 0, -1)
    assert [str(m).split("|")[2] for m in results] == ["cancelled"]


# ---------------------------------------------------------- outages are quiet


async def test_an_outage_is_logged_once_and_its_end_once_and_runs_resume_in_order(
    proxy: FaultProxy, prefix: str, direct: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger(direct, prefix)
    started: list[int] = []
    scheduler = Scheduler(
        RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=1500, heartbeat_ms=500
    )

    @scheduler.job(every_ms=200, name="tick", max_late_ms=1000)
    async def tick(run: Run) -> None:
        started.append(run.slot_ms)
        await ledger.record(run)

    with caplog.at_level(logging.DEBUG, logger="anarchon"):
        async with scheduler:
            await anyio.sleep(0.6)
            proxy.refuse(True)
            await anyio.sleep(2.5)
            proxy.refuse(False)
            back_ms = time.time() * 1000
            await wait_until(
                lambda: any(slot > back_ms + 400 for slot in started), 5, "runs after the outage"
            )
    down = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "does not answer" in r.msg
    ]
    up = [r for r in caplog.records if r.levelno == logging.INFO and "answers again" in r.msg]
    assert len(down) == 1, [r.getMessage() for r in down]
    assert len(up) == 1
    # No stale backlog ran late in place of on-time slots: runs started in slot order,
    # and none of the slots the outage made too late (more than max_late_ms) ran.
    assert started == sorted(started)
    assert len(started) == len(set(started))


# -------------------------------------------------- a lost claim reply


async def test_after_a_lost_claim_reply_every_slot_runs_or_is_recorded_skipped(
    server_url: str, proxy: FaultProxy, prefix: str, direct: redis.Redis
) -> None:
    """The server applies a claim batch but its reply is lost: the win is learned by a
    quick retry within a round trip's deadline, and no slot is dropped silently (each
    one runs, or is in the history as skipped, with its reason)."""
    every_ms = 250
    ledger = Ledger(direct, prefix)
    scheduler = Scheduler(
        RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=1500, heartbeat_ms=500
    )

    @scheduler.job(every_ms=every_ms, name="tick")
    async def tick(run: Run) -> None:
        await ledger.record(run)

    async with scheduler:
        await anyio.sleep(0.8)
        began_ms = time.time() * 1000
        proxy.drop_replies(True)
        await anyio.sleep(0.3)
        proxy.drop_replies(False)
        proxy.reset()  # the dropped replies left those connections out of step
        await anyio.sleep(2.0)
        ended_ms = time.time() * 1000
    async with Scheduler(RedisBackend(redis=server_url, prefix=prefix)) as reader:
        history = await reader.history("tick", limit=1000)

    ran = {slot for _, slot in ledger.counts()}
    assert all(n == 1 for n in ledger.counts().values())
    skipped = {r.slot_ms for r in history if r.status == "skipped"}
    first = (int(began_ms) // every_ms - 1) * every_ms
    due = set(range(first, int(ended_ms) - 500, every_ms))
    assert due - ran - skipped == set(), "slots neither run nor recorded skipped"
    assert len(skipped) <= 4, f"{len(skipped)} slots skipped after one lost reply"


@pytest.mark.parametrize("fault", ["refused", "reply lost"])
async def test_a_finish_that_did_not_get_through_is_sent_again_and_records_the_run_once(
    server_url: str, proxy: FaultProxy, prefix: str, direct: redis.Redis, fault: str
) -> None:
    """A run ends as its connection fails for a moment: the finish is refused (never
    applied), or applied with its reply lost. It is sent again, so the run is recorded
    once, as the handler ended; its lease does not expire unsettled for the next slots'
    claims to take the slot over and run it a second time."""
    ledger = Ledger(direct, prefix)
    scheduler = Scheduler(
        RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=1500, heartbeat_ms=500
    )
    faulted: list[int] = []

    @scheduler.job(every_ms=1000, name="tick")
    async def tick(run: Run) -> None:
        await ledger.record(run)
        if faulted:
            return
        faulted.append(run.slot_ms)
        if fault == "refused":
            proxy.refuse(True)
            await anyio.to_thread.run_sync(lambda: None)  # the reset reaches the client
            threading.Timer(0.15, proxy.refuse, (False,)).start()
        else:
            proxy.drop_after_request(1)  # the next request is the finish

    async with scheduler:
        await wait_until(lambda: bool(faulted), 5, "a first run")
        await anyio.sleep(1.5 + 2.0)  # the lease, and the next slots' claims
    async with Scheduler(RedisBackend(redis=server_url, prefix=prefix)) as reader:
        history = await reader.history("tick", limit=100)

    slot = faulted[0]
    runs = sum(n for (_, s), n in ledger.counts().items() if s == slot)
    assert runs == 1, f"slot {slot} ran {runs} times: its finish was not sent again"
    ended = [(r.attempt, r.status) for r in history if r.slot_ms == slot]
    assert ended == [(1, "ok")], ended


async def test_a_claim_whose_reply_was_lost_is_given_back_on_stop_for_a_backup_at_once(
    server_url: str, proxy: FaultProxy, prefix: str, direct: redis.Redis
) -> None:
    """The scheduler stops while the reply to a claim it won is lost. It asks once more
    (a probe), hears that it holds the lease, and gives the slot back unstarted: the
    attempt is recorded cancelled, and a backup's claim wins the slot at once instead
    of a lease later."""
    every_ms, lease_ms = 2000, 3000
    ledger = Ledger(direct, prefix)
    scheduler = Scheduler(RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=lease_ms)

    @scheduler.job(every_ms=every_ms, name="tick")
    async def tick(run: Run) -> None:
        await ledger.record(run)

    async with scheduler:
        await scheduler.run_now("tick")  # the server has the claim script from now on
        slot = (int(time.time() * 1000) + 700) // every_ms * every_ms + every_ms
        await anyio.sleep((slot - 150) / 1000 - time.time())
        # The claim of the slot reaches the server 600 ms late, and its reply comes
        # back after the claim's deadline (a third of the lease): the scheduler won
        # but does not know.
        proxy.delay(600)
        await anyio.sleep((slot + 700) / 1000 - time.time())
        proxy.delay(0)
        await scheduler.stop()  # while the claim waits for its reply
    async with Scheduler(RedisBackend(redis=server_url, prefix=prefix)) as reader:
        history = await reader.history("tick", limit=100)

    assert slot not in {s for _, s in ledger.counts()}, "the slot ran on a stopping scheduler"
    ended = [r for r in history if r.slot_ms == slot]
    assert len(ended) == 1, f"the slot's history: {ended} (the claim was not given back)"
    given_back = ended[0]
    assert (given_back.attempt, given_back.status) == (1, "cancelled"), given_back
    assert given_back.error and "released unstarted" in given_back.error, given_back
    reply = await claim_as("backup", server_url, prefix, "tick", slot, lease_ms)
    assert not isinstance(reply, ServerReplyError), reply
    assert (reply.kind, reply.attempt) == ("won", 2), reply
    assert reply.fence > given_back.fence, (reply, given_back)


async def test_a_stop_giving_back_a_claim_to_a_server_that_freezes_ends_in_time(
    proxy: FaultProxy, prefix: str
) -> None:
    """As above, the reply to a won claim is lost and the scheduler stops; the server
    freezes just as the give-back is sent (a finish recorded "released unstarted"), and
    the client has no timeout of its own. The give-back has the round trip's deadline
    (a third of the lease), so stop() returns; the slot's lease runs out for a backup.
    The bound is loose: without the deadline the stop waits for the server for good."""
    every_ms, lease_ms = 2000, 3000
    client = redis.Redis.from_url(proxy.url, protocol=2, socket_timeout=None)
    scheduler = Scheduler(RedisBackend(redis=client, prefix=prefix), lease_ms=lease_ms)

    @scheduler.job(every_ms=every_ms, name="tick")
    async def tick() -> None:
        pass

    try:
        async with scheduler:
            await scheduler.run_now("tick")  # the server has the claim script from now on
            slot = (int(time.time() * 1000) + 700) // every_ms * every_ms + every_ms
            await anyio.sleep((slot - 150) / 1000 - time.time())
            proxy.delay(600)  # the claim's reply comes back after its deadline
            await anyio.sleep((slot + 700) / 1000 - time.time())
            proxy.delay(0)
            proxy.pause_on(b"released unstarted")
            try:
                with anyio.fail_after(15):
                    await scheduler.stop()
            finally:
                gave_back_into_a_freeze = proxy.paused
                proxy.resume()
    finally:
        client.close()
    assert gave_back_into_a_freeze, "the stop sent no give-back (the claim's reply came?)"


# ------------------------------------------------------------------ run_now


async def test_run_now_whose_claim_reply_was_lost_runs_once_and_returns_its_result(
    proxy: FaultProxy, prefix: str
) -> None:
    """The manual claim reaches the server, its reply is cut: run_now claims again with
    the same token (the script recognises the repeat), runs the job once, and answers."""
    fences: list[int] = []
    scheduler = Scheduler(RedisBackend(redis=SendClient(proxy.url), prefix=prefix), lease_ms=2000)

    @scheduler.job(NEVER, name="report")
    async def report(run: Run) -> None:
        fences.append(run.fence)

    async with scheduler:
        proxy.drop_after_request(1)
        result = await scheduler.run_now("report")
        assert proxy.bytes_dropped > 0, "the fault did not hit the manual claim"
    assert result.status == "ok" and result.trigger == "manual"
    assert len(fences) == 1, fences


async def test_run_now_won_after_tries_that_took_longer_than_the_lease_runs_the_job(
    proxy: FaultProxy, prefix: str
) -> None:
    """The manual claim's first tries are refused (the server restarted, the client is
    reconnecting) and the try that wins comes more than a lease after the first. The
    lease is counted from the send of the try that won (its reply says what is left):
    the job runs, and run_now answers its result, not a run cancelled before it began."""
    lease_ms = 600
    ran: list[int] = []
    client = ClaimTriesClient(proxy.url, fail=3, then=lambda: proxy.refuse(False))
    scheduler = Scheduler(RedisBackend(redis=client, prefix=prefix), lease_ms=lease_ms)

    @scheduler.job(NEVER, name="report")
    async def report(run: Run) -> None:
        ran.append(run.attempt)

    async with scheduler:
        proxy.refuse(True)
        started = time.monotonic()
        # Three tries refused (pauses of about 50 and 250 ms between them): the client
        # lets the server be reached again as the third fails, so the fourth, about
        # 500 ms after the third, is past the lease and wins.
        result = await scheduler.run_now("report")
        took = time.monotonic() - started
    assert client.failed_claims == 3, client.failed_claims
    assert took > lease_ms / 1000, f"the winning try came {took:.3f} s after the first"
    assert result.status == "ok", result
    assert ran == [1], ran


async def test_run_now_while_the_server_is_unreachable_raises_connection_failed_in_time(
    proxy: FaultProxy, prefix: str
) -> None:
    scheduler = Scheduler(RedisBackend(redis=SendClient(proxy.url), prefix=prefix), lease_ms=2000)

    @scheduler.job(NEVER, name="report")
    async def report() -> None:
        pass

    async with scheduler:
        proxy.refuse(True)
        started = time.monotonic()
        with pytest.raises(ConnectionFailedError, match="report"):
            await scheduler.run_now("report")
        took = time.monotonic() - started
        proxy.refuse(False)
    # A few tries with short pauses, each within the round-trip deadline (lease / 3).
    assert took < 5, took


# ------------------------------------------------------------------ a slow link


async def test_a_scheduler_behind_a_slow_link_keeps_running_after_a_round_trip_timed_out(
    proxy: FaultProxy, prefix: str, direct: redis.Redis
) -> None:
    """A link whose round trip fits the deadline (a third of the lease), once slower
    than that for a moment: a request that timed out costs its connection (redis-py's
    asyncio client drops it), so a new connection must cost no round trip of its own
    (no CLIENT SETINFO), or every request after it misses its deadline while the link
    stays slow, and the scheduler runs nothing."""
    ledger = Ledger(direct, prefix)
    scheduler = Scheduler(
        RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=2000, heartbeat_ms=500
    )

    @scheduler.job(every_ms=1000, name="tick")
    async def tick(run: Run) -> None:
        await ledger.record(run)

    async with scheduler:
        proxy.delay(200)  # 400 ms a round trip, within the 667 ms deadline
        await anyio.sleep(2)
        proxy.delay(450)  # past the deadline: requests time out
        await anyio.sleep(1.5)
        proxy.delay(200)
        back_ms = time.time() * 1000
        await anyio.sleep(6)
    ran = [slot for _, slot in ledger.counts() if slot > back_ms + 1000]
    assert len(ran) >= 3, f"{len(ran)} slots ran in the 5 s after the link was back at 400 ms"


async def test_a_timer_call_that_meets_a_frozen_server_raises_a_transport_error_in_time(
    proxy: FaultProxy, prefix: str
) -> None:
    """Setting, getting or cancelling a timer is what a web app calls: a frozen server
    ends each call within its deadline (three round trips of the scheduler's lease) with
    a ``TransportError``, an ``AnarchonError`` like every other failure to reach the
    server, not Python's own ``TimeoutError``."""
    scheduler = Scheduler(RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=1500)

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        pass

    async with scheduler:
        await scheduler.set_timer("remind", "user:1", delay_ms=60_000)
        proxy.pause()
        try:
            calls = (
                scheduler.set_timer("remind", "user:2", delay_ms=60_000),
                scheduler.get_timer("remind", "user:1"),
                scheduler.cancel_timer("remind", "user:1"),
            )
            for call in calls:
                began = time.monotonic()
                with anyio.fail_after(10), pytest.raises(TransportError, match="did not answer"):
                    await call
                assert time.monotonic() - began < 3 * 0.5 + 1.0
        finally:
            proxy.resume()


async def test_history_pause_and_resume_that_meet_a_frozen_server_fail_in_time(
    proxy: FaultProxy, prefix: str
) -> None:
    """``Scheduler.history()`` is a read a web app calls, ``pause()`` and ``resume()``
    writes an operator makes: a frozen server ends each within three round trips of the
    scheduler's lease with a ``ConnectionFailedError`` that says the server did not
    answer, as the Inspector's reads end: not at the client's own socket timeout
    (redis-py 8's 5 s; none at all before it, or on a client made without one), and
    not as a bare ``TimeoutError``."""
    scheduler = Scheduler(RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=1500)

    @scheduler.job("0 0 1 1 *", name="yearly")
    async def yearly() -> None:
        pass

    calls = {
        "history": lambda: scheduler.history("yearly", 10),
        "pause": lambda: scheduler.pause("yearly"),
        "resume": lambda: scheduler.resume("yearly"),
    }
    async with scheduler:
        proxy.pause()
        try:
            for name, call in calls.items():
                began = time.monotonic()
                with (
                    anyio.fail_after(10),
                    pytest.raises(ConnectionFailedError, match="did not answer"),
                ):
                    await call()
                assert time.monotonic() - began < 3 * 0.5 + 1.0, name
        finally:
            proxy.resume()


async def test_the_inspectors_read_of_malformed_entries_fails_in_time_on_a_frozen_server(
    proxy: FaultProxy, prefix: str
) -> None:
    """``Inspector.quarantined()`` (``anarchon inspect``, the dashboard) reads within the
    Inspector's deadline, as its other reads do: a frozen server is a
    ``ConnectionFailedError`` that says so, never a wait as long as the client's."""
    async with Inspector(RedisBackend(redis=proxy.url, prefix=prefix)) as inspector:
        proxy.pause()
        try:
            with anyio.fail_after(30), pytest.raises(ConnectionFailedError):
                await inspector.quarantined()
        finally:
            proxy.resume()


@pytest.mark.parametrize("answers", [True, False], ids=["answers-in-time", "frozen"])
async def test_a_server_frozen_during_the_first_registration_is_waited_for_then_named(
    proxy: FaultProxy, prefix: str, answers: bool
) -> None:
    """The server froze just as a start sent its first registration: a start on a
    loaded machine used to fail at once with a bare TimeoutError. Now it tries again
    (three tries, each within three round trips): a server that answers in time lets it
    start; one that does not is a ConnectionFailedError that says what got no answer."""
    ran: list[int] = []
    scheduler: Scheduler[Any] = Scheduler(
        RedisBackend(redis=proxy.url, prefix=prefix), lease_ms=1500
    )

    @scheduler.job(every_ms=200, name="tick")
    async def tick(run: Run) -> None:
        ran.append(run.slot_ms)

    proxy.pause_on(b'"started_ms"')  # only the registration's script call carries it
    if answers:

        async def resume_later() -> None:
            await anyio.sleep(2.0)  # past the first try's 1.5 s
            proxy.resume()

        async with anyio.create_task_group() as group:
            group.start_soon(resume_later)
            async with scheduler:
                await wait_until(lambda: len(ran) >= 2, 10, "two runs after the late registration")
        return
    started = time.monotonic()
    with pytest.raises(ConnectionFailedError, match=r"registering instance .* got no answer in 3"):
        async with scheduler:
            pass
    assert time.monotonic() - started < 10
    proxy.resume()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("url_timeout", [None, 0.3], ids=["no-client-timeout", "url-timeout"])
async def test_own_asyncio_connections_wait_on_the_engines_deadlines_not_the_clients(
    proxy: FaultProxy, url_timeout: float | None
) -> None:
    """Every round trip anarchon makes has a deadline of its own, so the connections it
    opens under asyncio read without redis-py's per-reply ``socket_timeout`` (redis-py 8
    enters a 5 s timeout for every reply it reads, which costs CPU at every claim). A
    ``socket_timeout`` the URL gives is still the user's, and kept."""
    url = proxy.url if url_timeout is None else f"{proxy.url}?socket_timeout={url_timeout}"
    conn = open_connection(url)
    try:
        await conn.execute(("PING",))
        proxy.pause()
        try:
            began = time.monotonic()
            if url_timeout is None:
                # Past redis-py 8's default of 5 s, the read still waits for its caller's
                # deadline.
                with anyio.move_on_after(5.5) as waited:
                    await conn.execute(("PING",))
                assert waited.cancelled_caught, "the read ended before its caller's deadline"
            else:
                with anyio.fail_after(5), pytest.raises(TransportError):
                    await conn.execute(("PING",))
                assert time.monotonic() - began < 3.0
        finally:
            proxy.resume()
    finally:
        await conn.close_if_owned()


@pytest.mark.needs_idmp
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_server_frozen_while_idmp_prepares_its_streams_fails_the_start_in_time(
    proxy: FaultProxy, prefix: str
) -> None:
    """The idmp strategy configures each job's stream at start: a server that freezes
    then fails the start within three round trips of the lease, naming what it waited
    for, rather than waiting as long as the client (for ever on anarchon's own asyncio
    connections, which read without a timeout of the client's)."""
    scheduler = Scheduler(RedisBackend(redis=proxy.url, prefix=prefix, strategy="idmp"))

    @scheduler.job("0 0 1 1 *", name="yearly")
    async def yearly() -> None:
        pass

    proxy.pause_on(Script.from_body("idmp_configure", lua_source("idmp_configure")).sha.encode())
    try:
        began = time.monotonic()
        with anyio.fail_after(20), pytest.raises(ConnectionFailedError, match="did not answer"):
            async with scheduler:
                pass
        assert time.monotonic() - began < 10 + 3.0
    finally:
        proxy.resume()
