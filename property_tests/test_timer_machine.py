"""The timer scripts against a reference model, step by step, on a real server.

Three simulated instances fire one kind of timer the way the scheduler does: they
claim what is due in bounded batches (a claim's reply is sometimes lost, and the
claim is sent again with the same token base), heartbeat the firings they run, and
finish them ok, failed or cancelled, sometimes rearming the key (at an instant or
after a delay) from the handler; a recurring timer's finish writes its next due time,
and a lapsed recurrence (out of attempts) is finished at once as interrupted with it.
Business code sets, replaces and cancels timers at any moment, also while they fire;
instances crash (forgetting what they run, so their leases expire and are taken
over); time advances. Every reply of the real scripts must equal the model's
(property_tests/timer_model.py), and after every step, in words:

1. The store holds exactly the model's timers (every field, tokens included), and the
   due set scores each key at the moment it needs attention next (due time, lease
   expiry, retry time), and holds nothing else: no timer is lost, none lingers.
2. Exactly once: each attempt of each generation of a key is won once (unless it was
   given back, cancelled by its instance, which does not count as an attempt; a lapsed
   recurrence is won as such, once per expiry of its lease), with a fence above every
   fence before it.
3. Generations grow: every set and every rearm or recurrence takes a new, higher one.
4. Fencing: a finish or heartbeat of a token that no longer holds the firing changes
   nothing and reports the loss.
6. Fleet limits (when the kind has them): the permits held are exactly those of the
   firings whose leases live (never more than the limit, the kind's and each key
   group's), and the starts within the rate limit's window never exceed it; a key
   group's waiting timers and the groups index are exactly the model's.
5. The newest set wins: a firing of a generation that was replaced or cancelled while
   it fired leaves the newest generation pending (or nothing), never its own rearm,
   recurrence or retry.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from anarchon._store.keys import TimerKeys
from property_tests.lease_scripts import timed_timer_script
from property_tests.profiles import examples
from property_tests.timer_model import KindModel, Timer, Win
from tests.servers import MATRIX_FIRST, ServerSpec, matrix, running_server

pytestmark = pytest.mark.server_tier

LEASE_MS = 1000
BASE_MS = 1_800_000_000_000
INSTANCES = ("a", "b", "c")
#: Keys with the characters a user's keys may have (the key is a hash field).
KEYS = ("user:1", "user:2", "user:3", "cart|7", "tenant 9", "ключ")
#: Payloads as the store keeps them (encode_payload's tags), '|' and newlines included.
PAYLOADS = st.sampled_from(["", "uhello", 'j{"a":1}', "ua|b|c", "ux\ny", "xAAEC"])
SCHEDULES = st.sampled_from(["", "", "every;2000"])


@dataclass
class Firing:
    """A firing an instance believes it runs."""

    key: str
    token: str
    gen: int
    due_ms: int
    attempt: int
    trigger: str
    schedule: str


@dataclass
class Instance:
    name: str
    held: dict[str, Firing] = field(default_factory=dict)


class TimerMachine(RuleBasedStateMachine):
    server: ServerSpec = MATRIX_FIRST

    def __init__(self) -> None:
        super().__init__()
        self.client = redis.Redis.from_url(
            running_server(self.server), protocol=2, decode_responses=True
        )
        self.now = BASE_MS
        self.keys = TimerKeys.for_kind(f"tm{uuid.uuid4().hex[:8]}:", "remind")
        self.model = KindModel()
        self.instances = {name: Instance(name) for name in INSTANCES}
        self.max_attempts = 1
        self.retry_delay_ms = 300
        #: Invariant 2: each won (key, generation, attempt, trigger), and the last fence.
        self.wins: set[tuple[str, int, int, str]] = set()
        self.last_fence = 0
        self.last_gen = 0
        self.claim_records: list[str] = []

    @initialize(
        max_attempts=st.integers(1, 3),
        retry_delay_ms=st.sampled_from([0, 300, 2500]),
        fleet_max=st.sampled_from([0, 0, 1, 2]),
        rate=st.sampled_from([(0, 0), (0, 0), (2, 1500), (3, 4000)]),
        group_max=st.sampled_from([0, 1, 1, 2]),
    )
    def configure(
        self,
        max_attempts: int,
        retry_delay_ms: int,
        fleet_max: int,
        rate: tuple[int, int],
        group_max: int,
    ) -> None:
        self.max_attempts = max_attempts
        self.retry_delay_ms = retry_delay_ms
        self.model.fleet_max = fleet_max
        self.model.rate_max, self.model.period_ms = rate
        # The "user:" keys share the group "user"; the others are groups of their own.
        self.model.group_by, self.model.group_max = (":", group_max) if group_max else ("", 0)

    def teardown(self) -> None:
        keys = self.keys
        groups = {key.split(":", 1)[0] for key in KEYS}
        self.client.delete(
            keys.timers, keys.due, keys.meta, keys.permits, keys.starts, keys.groups,
            *(keys.group_permits(g) for g in groups), *(keys.group_waiting(g) for g in groups),
            *self.claim_records,
        )  # fmt: skip

    @property
    def group_args(self) -> list[Any]:
        return [self.model.group_by, self.model.group_max, self.keys.group_permits("")]
        self.client.close()

    def call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self.client.eval(timed_timer_script(name), len(keys), *keys, *args, self.now)

    @property
    def three(self) -> list[str]:
        return [self.keys.timers, self.keys.due, self.keys.meta]

    def _new_gen(self, gen: int) -> None:
        assert gen > self.last_gen, f"generation {gen} after {self.last_gen}"  # invariant 3
        self.last_gen = gen

    # ------------------------------------------------------------------ rules

    @rule(ms=st.integers(1, 2500))
    def advance_time(self, ms: int) -> None:
        self.now += ms

    @rule(
        key=st.sampled_from(KEYS),
        in_ms=st.integers(-500, 3000),
        relative=st.booleans(),
        schedule=SCHEDULES,
        payload=PAYLOADS,
    )
    def set_timer(self, key: str, in_ms: int, relative: bool, schedule: str, payload: str) -> None:
        at_ms = None if relative else self.now + in_ms
        delay_ms = in_ms if relative else None
        firing = key in self.model.timers and self.model.timers[key].status == "firing"
        event(f"set: {'while firing' if firing else 'idle key'}")
        expected = self.model.set(key, self.now, at_ms, delay_ms, schedule, payload)
        raw = self.call(
            "timer_set",
            [*self.three, self.keys.progress],
            [key, "" if at_ms is None else at_ms, "" if delay_ms is None else delay_ms,
             schedule, payload],
        )  # fmt: skip
        assert (int(raw[0]), int(raw[1]), int(raw[2]) == 1) == expected
        self._new_gen(expected[0])

    @rule(key=st.sampled_from(KEYS))
    def cancel_timer(self, key: str) -> None:
        expected = self.model.cancel(key)
        raw = self.call("timer_cancel", [*self.three, self.keys.progress], [key])
        assert (int(raw[0]) == 1) == expected
        if expected and key in self.model.timers:
            event("cancel: while firing")
            self._new_gen(self.model.timers[key].gen)

    def _claim(self, instance: Instance, limit: int, token_base: str) -> list[Win]:
        record = self.keys.claimed(token_base)
        self.claim_records.append(record)
        expected = self.model.claim(
            self.now, limit, LEASE_MS, instance.name, token_base, self.max_attempts
        )
        model = self.model
        raw = self.call(
            "timer_claim",
            [*self.three, record, self.keys.permits, self.keys.starts, self.keys.groups,
             self.keys.progress],
            [limit, LEASE_MS, instance.name, token_base, self.max_attempts, model.fleet_max,
             model.rate_max, model.period_ms, *self.group_args, self.keys.group_waiting("")],
        )  # fmt: skip
        wins = [
            Win(str(w[0]), int(w[1]), int(w[2]), int(w[3]), int(w[4]), str(w[5]), str(w[6]),
                str(w[7]), str(w[8]), int(w[9]))  # w[10]: its progress (none kept here)
            for w in raw[0]
        ]  # fmt: skip
        assert int(raw[3]) == self.now  # the server's clock, which next_ms is on
        next_ms = int(float(raw[1])) if raw[1] != "" else None
        got = (sorted(wins, key=lambda w: w.key), next_ms, int(raw[2]) == 1, list(raw[4]))
        assert got == (sorted(expected[0], key=lambda w: w.key), *expected[1:])
        if got[3]:
            event("claim: a one-shot timer out of attempts was spent")
        limited = set(raw[6])
        if "group" in limited:
            event("claim: a due timer waits for its key group")
        for name in limited - {"group"}:
            event(f"claim: held back by the fleet limit ({name})")
        if model.group_max and any(model.waiting.values()) and not model.groups:
            raise AssertionError("timers wait in a group the index does not name")
        return wins

    def _won(self, instance: Instance, wins: list[Win], repeated: set[str]) -> None:
        for win in wins:
            if win.key not in repeated:
                # Invariant 2: each attempt won once, with a fence above all before it.
                won = (win.key, win.gen, win.attempt, win.trigger)
                assert won not in self.wins or win.trigger == "lapsed", f"won twice: {won}"
                self.wins.add(won)
                assert win.fence > self.last_fence
                self.last_fence = win.fence
                event(f"claim: won ({win.trigger})")
            instance.held[win.key] = Firing(
                win.key, win.token, win.gen, win.due_ms, win.attempt, win.trigger, win.schedule
            )

    @rule(instance=st.sampled_from(INSTANCES), limit=st.integers(1, 4))
    def claim(self, instance: str, limit: int) -> None:
        inst = self.instances[instance]
        self._won(inst, self._claim(inst, limit, secrets.token_hex(4)), set())

    @rule(
        instance=st.sampled_from(INSTANCES),
        limit=st.integers(1, 4),
        later_ms=st.integers(0, 1500),
    )
    def claim_with_its_reply_lost(self, instance: str, limit: int, later_ms: int) -> None:
        """The claim is applied and its reply lost; the instance sends it again (the same
        token base) a little later and must hear of the firings it won and still holds."""
        inst = self.instances[instance]
        token_base = secrets.token_hex(4)
        lost = self._claim(inst, limit, token_base)
        for win in lost:  # for invariant 2: they were won, once
            won = (win.key, win.gen, win.attempt, win.trigger)
            assert won not in self.wins or win.trigger == "lapsed"
            self.wins.add(won)
            assert win.fence > self.last_fence
            self.last_fence = win.fence
        self.now += later_ms
        again = self._claim(inst, limit, token_base)
        heard = {w.key for w in again if w.token.startswith(token_base + ":")}
        live = {w.key for w in lost if w.key in heard}
        event(f"lost claim reply: {len(live)} of {len(lost)} wins heard again")
        self._won(inst, again, {w.key for w in lost})

    def _held(self) -> list[tuple[str, str]]:
        return sorted((i.name, key) for i in self.instances.values() for key in i.held)

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        name, key = data.draw(st.sampled_from(self._held()))
        firing = self.instances[name].held[key]
        expected = self.model.heartbeat(key, firing.token, self.now, LEASE_MS)
        raw = self.call(
            "timer_heartbeat",
            [*self.three[:2], self.keys.permits],
            [key, firing.token, LEASE_MS, self.model.fleet_max, *self.group_args],
        )
        assert (int(raw[0]) == 1) == expected
        event(f"heartbeat: {'held' if expected else 'lost'}")
        if not expected:
            del self.instances[name].held[key]

    @precondition(lambda self: bool(self._held()))
    @rule(
        data=st.data(),
        outcome=st.sampled_from(["ok", "failed", "cancelled"]),
        rearm=st.sampled_from([None, "at", "delay"]),
        rearm_ms=st.integers(0, 3000),
    )
    def finish(self, data: st.DataObject, outcome: str, rearm: str | None, rearm_ms: int) -> None:
        name, key = data.draw(st.sampled_from(self._held()))
        firing = self.instances[name].held.pop(key)
        if self.model.group_max and self.model.group_of(key) in self.model.groups:
            event("finish: its key group has timers waiting")
        next_at: int | None = None
        next_delay: int | None = None
        if firing.trigger == "lapsed":
            outcome = "interrupted"  # a lapsed recurrence runs nothing
        if firing.schedule:
            # What the engine writes for a recurring timer: its next due time.
            every_ms = int(firing.schedule.split(";")[1])
            next_at = firing.due_ms + every_ms
        elif outcome == "ok" and rearm == "at":
            next_at = self.now + rearm_ms
        elif outcome == "ok" and rearm == "delay":
            next_delay = rearm_ms
        gen_before = self.model.gen
        expected = self.model.finish(
            key, firing.token, outcome, self.now, self.max_attempts, self.retry_delay_ms,
            next_at, next_delay,
        )  # fmt: skip
        raw = self.call(
            "timer_finish",
            [*self.three, self.keys.progress, self.keys.permits, self.keys.groups],
            [key, firing.token, outcome, self.max_attempts, self.retry_delay_ms,
             "" if next_at is None else next_at, "" if next_delay is None else next_delay,
             *self.group_args],
        )  # fmt: skip
        if raw[0] == "lost":
            got = (False, "", 0)
            event("finish: lost")
        else:
            status = {"r": "retry", "p": "pending"}.get(raw[1], raw[1])
            got = (True, status, int(raw[2]))
            event(f"finish: {status}")
        assert got == expected, (got, expected)
        if got[:2] == (True, "retry") and outcome == "cancelled":
            # Given back, not counted: the same attempt may be won again.
            self.wins.discard((key, firing.gen, firing.attempt, firing.trigger))
            event("finish: given back")
        if self.model.gen > gen_before:  # a rearm or a recurrence: a new generation
            self._new_gen(self.model.timers[key].gen)

    @rule(instance=st.sampled_from(INSTANCES))
    def crash(self, instance: str) -> None:
        """The instance dies: what it runs is never finished; its leases expire."""
        self.instances[instance].held.clear()

    # ------------------------------------------------------------- invariants

    @invariant()
    def the_store_holds_the_models_timers(self) -> None:
        stored = self.client.hgetall(self.keys.timers)
        expected = {key: encode(timer) for key, timer in self.model.timers.items()}
        assert stored == expected  # invariant 1 (and 4, 5: what a finish may change)
        due = dict(self.client.zrange(self.keys.due, 0, -1, withscores=True))
        assert due == {
            key: float(t.attention_ms())
            for key, t in self.model.timers.items()
            if key not in self.model.out_of_due
        }

    @invariant()
    def the_fleet_limits_hold(self) -> None:
        model = self.model
        permits = dict(self.client.zrange(self.keys.permits, 0, -1, withscores=True))
        live = {key: float(until) for key, until in model.permits.items() if until > self.now}
        assert {k: v for k, v in permits.items() if v > self.now} == live  # invariant 6
        if model.fleet_max:
            assert len(live) <= model.fleet_max
        if model.group_max:
            stored = dict(self.client.zrange(self.keys.groups, 0, -1, withscores=True))
            assert stored == {g: float(when) for g, when in model.groups.items()}
            for group in {key.split(":", 1)[0] for key in KEYS}:
                waiting = self.client.zrange(self.keys.group_waiting(group), 0, -1, withscores=True)
                expected = model.waiting.get(group, {})
                assert dict(waiting) == {k: float(v) for k, v in expected.items()}, group
                permits = self.client.zrange(self.keys.group_permits(group), 0, -1, withscores=True)
                live = {k: v for k, v in permits if v > self.now}
                held = model.group_permits.get(group, {})
                assert live == {k: float(v) for k, v in held.items() if v > self.now}, group
                assert len(live) <= model.group_max
        if model.rate_max:
            starts = self.client.zrangebyscore(
                self.keys.starts, f"({self.now - model.period_ms}", self.now
            )
            assert len(starts) <= model.rate_max

    @invariant()
    def the_counters_are_the_models(self) -> None:
        meta = self.client.hgetall(self.keys.meta)
        assert int(meta.get("gen", 0)) == self.model.gen
        assert int(meta.get("fence", 0)) == self.model.fence


def encode(timer: Timer) -> str:
    """The model's timer as the store writes it (lua/timer_state.lua)."""
    status = {"pending": "p", "firing": "f", "retry": "r"}[timer.status]
    return "|".join(
        str(part)
        for part in (
            timer.gen, "" if timer.due_ms is None else timer.due_ms, status, timer.attempt,
            timer.token, timer.until_ms, timer.fence, timer.fire_gen, timer.fire_due_ms,
            timer.trigger, timer.runner, timer.schedule, timer.payload,
        )
    )  # fmt: skip


# One test case per server of the matrix (all of them in CI).
for _spec in matrix():
    _machine = type(f"TimerMachine_{_spec.id}", (TimerMachine,), {"server": _spec})
    _case = _machine.TestCase
    _case.settings = settings(_case.settings, max_examples=examples(300, _spec))
    globals()[f"TestTimerMachine_{_spec.id.replace('-', '_').replace('.', '_')}"] = _case
    del _case


def test_a_finish_lets_its_key_groups_waiting_timer_go_on_at_once(server: ServerSpec) -> None:
    """With one permit per key group: of two due timers of group 'user', one fires and
    the other waits apart (out of the due index; the group is looked at again when the
    firing's lease ends); the firing's finish has the group looked at at once, so the
    next claim, at the same instant, moves the waiting timer back and wins it."""
    client = redis.Redis.from_url(running_server(server), protocol=2, decode_responses=True)
    keys = TimerKeys.for_kind(f"tg{uuid.uuid4().hex[:8]}:", "remind")
    now = BASE_MS
    three = [keys.timers, keys.due, keys.meta]
    groups = [":", 1, keys.group_permits("")]

    def call(name: str, script_keys: list[str], args: list[Any]) -> Any:
        return client.eval(timed_timer_script(name), len(script_keys), *script_keys, *args, now)

    def claim(token_base: str) -> list[Any]:
        script_keys = [
            *three,
            keys.claimed(token_base),
            keys.permits,
            keys.starts,
            keys.groups,
            keys.progress,
        ]
        args = [4, LEASE_MS, "a", token_base, 3, 0, 0, 0, *groups, keys.group_waiting("")]
        return list(call("timer_claim", script_keys, args))

    try:
        for key in ("user:1", "user:2"):
            call("timer_set", [*three, keys.progress], [key, now - 10, "", "", "", ""])
        first = claim("x")
        ((won, *_, token, _trigger, _schedule, _payload, _left, _progress),) = first[0]
        waiting = "user:2" if won == "user:1" else "user:1"
        assert first[6] == ["group"]
        assert client.zrange(keys.due, 0, -1) == [won]
        assert client.zrange(keys.group_waiting("user"), 0, -1) == [waiting]
        assert client.zscore(keys.groups, "user") == now + LEASE_MS  # its lease's end
        assert int(first[1]) == now + LEASE_MS  # the claimer comes back by then
        finished = call(
            "timer_finish",
            [*three, keys.progress, keys.permits, keys.groups],
            [won, token, "ok", 3, 300, "", "", *groups],
        )
        assert finished[0] == "settled"
        assert client.zscore(keys.groups, "user") == now
        second = claim("y")
        assert [win[0] for win in second[0]] == [waiting]
        assert client.zcard(keys.groups) == 0
        assert client.zcard(keys.group_waiting("user")) == 0
    finally:
        client.delete(
            *three, keys.permits, keys.starts, keys.groups, keys.group_permits("user"),
            keys.group_waiting("user"), keys.claimed("x"), keys.claimed("y"),
        )  # fmt: skip
        client.close()


def test_the_timed_timer_scripts_differ_from_the_shipped_ones_only_in_the_clock_read() -> None:
    from anarchon._store.scripts import timer_script
    from property_tests.lease_scripts import CLOCK_ARGUMENT, CLOCK_READ

    names = ("timer_set", "timer_cancel", "timer_claim", "timer_heartbeat", "timer_finish")
    for name in (*names, "timer_save_progress"):
        shipped = timer_script(name).body
        assert timed_timer_script(name) == shipped.replace(CLOCK_READ, CLOCK_ARGUMENT)
