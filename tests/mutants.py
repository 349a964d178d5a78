"""Hand-written mutants of the Lua lease scripts (and, with ``--engine``, of the
engine's Python), each removing one decision.

``python -m tests.mutants`` applies each mutant in turn to a temporary copy of
the scripts (``src/anarchon/_store/lua/``), points anarchon at it
(``ANARCHON_LUA_DIR``) and runs the mutant's pytest selection against it; a mutant
is killed when its selection fails. It ends with one line ``mutants: killed=K of N``
and exits 0 only when every mutant was killed (the survivors are printed first, one
line each).

    python -m tests.mutants              # every mutant
    python -m tests.mutants --list       # what each one removes, and its selection
    python -m tests.mutants --only NAME  # one mutant (repeat --only for more)
    python -m tests.mutants --engine     # the engine's mutants instead
    python -m tests.mutants --machine    # each against the engine machine alone
    python -m tests.mutants --virtual    # each against the engine on virtual time alone
    python -m tests.mutants --engine --share 3   # three of them, chosen by the commit

An engine mutant is applied to a copy of ``src/`` that the selection imports first
(``PYTHONPATH``), with ``ANARCHON_LUA_DIR`` at the shipped scripts (the mutant's copy has no
scripts beside it); its selection is its direct test, then (if that test missed it)
the engine on virtual time (``property_tests/test_engine_virtual.py``: days of long
horizons in a minute or two), so that every engine mutant runs in minutes.
``--machine`` runs the listed mutants (Lua or engine) against the engine machine on
the real clock alone, and ``--virtual`` against the engine on virtual time alone:
whether the real engine in its state machine finds the defect by itself.

Each mutant is (name, file, exact old text, new text): the old text must occur
exactly once in the shipped file, so a mutant breaks loudly when the scripts
change. The property machines load the scripts with the server's clock read
swapped for an argument (``property_tests/lease_scripts.py``), so a mutant of
the clock read would only trip their "the clock read moved" assertion: the
clock mutants run ``tests/`` tests instead, on the real server clock.

The property suite runs under the ``mutants`` Hypothesis profile
(``property_tests/profiles.py``: the ``ci`` profile's example counts, so a kill
here is a kill in CI, with no shrinking and no example database) and a fixed
seed.
Always the quick server matrix (``CI`` and ``ANARCHON_FULL_MATRIX`` unset).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LUA = ROOT / "src" / "anarchon" / "_store" / "lua"
#: property_tests/profiles.py: ci's example counts, no shrinking, no example database.
PROFILE = "mutants"
SEED = "20261201"

MACHINE = "property_tests/test_lease_machine.py"
HONEST = "tests/test_honest_answers.py"
DEAD = "tests/test_dead_runs_settle.py"
RULES = "tests/test_lease_rules.py"
LEASES = "tests/test_leases.py"
TAKEOVER = "tests/test_takeover.py"
FLEET = "tests/test_fleet_limits.py"
CALENDARS = "tests/test_calendars.py"
BOUNDS = "tests/test_bounds.py"
DEAD_MAN = "tests/test_dead_mans_switch.py"
UNTRUSTED = "tests/test_untrusted_store.py"
BACKFILL = "tests/test_backfill.py"
DEPLOYS = "tests/test_deploys.py"
ENGINE_MACHINE = "property_tests/test_engine_machine.py"
ENGINE_VIRTUAL = "property_tests/test_engine_virtual.py"
ENGINE_FAULTS = "tests/test_engine_faults.py"
TIMER_MACHINE = "property_tests/test_timer_machine.py"
SRC = ROOT / "src"
#: Kills the two blocking checks that matter only when instances claim with different
#: overlap flags (a rolling deploy); the lease machine draws one flag per job.
OVERLAP_FLAGS_DISAGREE = (
    f"{HONEST}::test_claims_that_disagree_on_overlap_keep_one_live_run_of_a_job_without_overlap"
)


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # in lua/ (or, for an engine mutant, in src/anarchon/)
    old: str
    new: str
    removes: str
    tests: tuple[str, ...]  # the pytest selection (paths or node ids)
    engine: bool = False


MUTANTS: list[Mutant] = [
    Mutant(
        "overlap-scan",
        "claim.lua",
        "if blocks then blocked_ms = math.max(blocked_ms or 0, left_ms) end",
        "",
        "scan_active never blocks: no overlap protection at all",
        (MACHINE,),
    ),
    Mutant(
        "first-claim-blocking",
        "claim.lua",
        "local blocks = (first_claim or (o.status == 'running' and left_ms > 0))",
        "local blocks = ((o.status == 'running' and left_ms > 0))",
        "a first claim is blocked only by a live lease (not by a pending retry or an orphan)",
        (MACHINE,),
    ),
    Mutant(
        "retry-blocking",
        "claim.lua",
        "if blocked_ms then return {'running', 0, 0, blocked_ms, '', {}, bad} end",
        "",
        "a due retry starts even while another run of the job holds a live lease",
        (MACHINE, OVERLAP_FLAGS_DISAGREE),
    ),
    Mutant(
        "takeover-trigger",
        "claim.lua",
        "elseif s.token == '' then next_trigger = 'takeover' end",
        "end",
        "an attempt after an expired one is told retry, not takeover",
        (MACHINE,),
    ),
    Mutant(
        "heartbeat-token",
        "heartbeat.lua",
        "if s.token ~= token or s.status ~= 'running' then",
        "if s.status ~= 'running' then",
        "a heartbeat extends the run's lease whoever's token it carries",
        (MACHINE,),
    ),
    Mutant(
        "finish-token",
        "finish.lua",
        "if s.token ~= token then return {'lost', s.status} end",
        "",
        "a finish settles the run whoever's token it carries",
        (MACHINE,),
    ),
    Mutant(
        "claim-attempt-bound",
        "claim.lua",
        "if s.attempt >= max_attempts then",
        "if false then",
        "an expired last attempt is retried instead of settled interrupted",
        (MACHINE,),
    ),
    Mutant(
        "finish-attempt-bound",
        "finish.lua",
        "elseif s.attempt < max_attempts then",
        "elseif true then",
        "a failed last attempt is retried instead of settled failed",
        (MACHINE,),
    ),
    Mutant(
        "trim-keeps-active",
        "claim.lua",
        "if o and (o.status == 'running' or o.status == 'retry') then",
        "if false then",
        "trim_old_state forgets running runs and pending retries",
        (MACHINE,),
    ),
    Mutant(
        "trim-keeps-after-settle",
        "claim.lua",
        "elseif o and o.until_ms >= horizon then",
        "elseif false then",
        "trim_old_state forgets a run settled less than keep_ms ago",
        (MACHINE,),
    ),
    Mutant(
        "may-start",
        "claim.lua",
        "if not s and not may_start then return {'done', 0, 0, 0, 'forgotten', {}, bad} end",
        "",
        "a later claim (may_start=0) of a forgotten slot starts it",
        # The machine forgets a run only after a first claim's trim, and a backup
        # rarely asks that late: the direct test is the one that kills it.
        (f"{RULES}::test_a_backups_claim_of_a_forgotten_slot_is_told_done_and_starts_nothing",),
    ),
    Mutant(
        "probe",
        "claim.lua",
        "if probe then",
        "if false then",
        "a probe claims like any claim (ends an expired attempt, wins the next one)",
        (f"{HONEST}::test_a_probe_finds_its_own_live_win_and_changes_nothing_otherwise",),
    ),
    Mutant(
        "skip-if-blocked",
        "claim.lua",
        "if skip_if_blocked then",
        "if false then",
        "a blocked first claim is not recorded as skipped",
        (MACHINE,),
    ),
    Mutant(
        "expired-token-cleared",
        "claim.lua",
        "  s.token = ''\n",
        "",
        "an expired attempt's token still holds the run (its late finish or heartbeat counts)",
        (MACHINE,),
    ),
    Mutant(
        "repeated-claim-live-lease",
        "claim.lua",
        "if s.status == 'running' and s.token == token and s.until_ms > now then",
        "if s.status == 'running' and s.token == token then",
        "a claim repeated after its lease expired gets the old win back",
        (MACHINE,),
    ),
    Mutant(
        "running-wait",
        "claim.lua",
        "if s.status == 'running' then\n"
        "  if s.until_ms > now then return {'running', 0, 0, s.until_ms - now, '', {}, bad} end",
        "if s.status == 'running' then\n"
        "  if s.until_ms > now then return {'running', 0, 0, lease_ms, '', {}, bad} end",
        "a backup of a live lease is told to wait a whole lease, not the time left on it",
        (MACHINE,),
    ),
    Mutant(
        "retry-wait",
        "claim.lua",
        "if s.status == 'retry' then\n"
        "  if s.until_ms > now then return {'running', 0, 0, s.until_ms - now, '', {}, bad} end",
        "if s.status == 'retry' then\n"
        "  if s.until_ms > now then return {'running', 0, 0, lease_ms, '', {}, bad} end",
        "a claim of a run waiting for its retry is told to wait a whole lease, not the delay left",
        (MACHINE,),
    ),
    Mutant(
        "fence-seed",
        "claim.lua",
        "local fence = math.max(last + 1, now * 1000)",
        "local fence = last + 1",
        "fences count wins, not the server's clock: they go back after a wipe or a failover",
        (MACHINE,),
    ),
    Mutant(
        "heartbeat-no-revival",
        "heartbeat.lua",
        "if s.until_ms <= now and not allow_overlap then",
        "if false then",
        "an expired lease is revived while another run of the job holds a live one",
        (MACHINE, OVERLAP_FLAGS_DISAGREE),
    ),
    Mutant(
        "clock-whole-seconds",
        "lease_state.lua",
        "return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)",
        "return tonumber(time[1]) * 1000",
        "the server clock drops its milliseconds (leases end up to a second early or late)",
        (HONEST, DEAD, LEASES),
    ),
    Mutant(
        "clock-seconds",
        "lease_state.lua",
        "return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)",
        "return tonumber(time[1])",
        "the server clock in seconds, not milliseconds (a lease of 1 s lasts 1000 s)",
        (HONEST, DEAD),
    ),
    # The timer scripts, against the timer machine (lua/timer_*.lua).
    Mutant(
        "timer-finish-token",
        "timer_finish.lua",
        "if t.token ~= token then return {'lost', t.status} end",
        "",
        "a timer's finish settles the firing whoever's token it carries",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-heartbeat-token",
        "timer_heartbeat.lua",
        "if t.status ~= 'f' or t.token ~= token then",
        "if t.status ~= 'f' then",
        "a timer's heartbeat extends the firing's lease whoever's token it carries",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-old-generation-clobbers",
        "timer_finish.lua",
        "local current = t.gen == t.fire_gen",
        "local current = true",
        "the finish of a generation replaced while it fired writes its retry, rearm or end "
        "over the newest set",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-set-ends-firing",
        "timer_set.lua",
        "if t and t.status == 'f' then",
        "if false then",
        "a set while the key fires drops the firing in flight (its lease, its token)",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-set-replaced",
        "timer_set.lua",
        "if t and not (t.status == 'f' and not t.due_ms) then replaced = 1 end",
        "if t then replaced = 1 end",
        "a set while the key fires with nothing after it says it replaced a timer",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-set-no-hint",
        "timer_set.lua",
        "if first[1] == key then",
        "if false then",
        "a set that makes its key the first of its kind to fall due is not published: "
        "instances hear of it at their next poll",
        (
            "tests/test_timers.py::test_a_timer_set_by_another_process_sooner_than_the_next_"
            "poll_fires_through_a_hint",
        ),
    ),
    Mutant(
        "timer-cancel-ends-firing",
        "timer_cancel.lua",
        "if t.status == 'f' then",
        "if false then",
        "a cancel while the key fires forgets the firing in flight",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-takeover-attempt-bound",
        "timer_claim.lua",
        "elseif t.attempt < max_attempts then",
        "elseif true then",
        "a dead runner's firing is taken over past max_attempts",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-retry-attempt-bound",
        "timer_finish.lua",
        "if current and outcome == 'failed' and t.attempt < max_attempts then",
        "if current and outcome == 'failed' then",
        "a failed firing is retried past max_attempts",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-give-back-counted",
        "timer_finish.lua",
        "t.status, t.until_ms, t.attempt = 'r', now, t.attempt - 1",
        "t.status, t.until_ms = 'r', now",
        "a firing given back by a stopping instance counts as an attempt",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-lost-claim-reply",
        "timer_claim.lua",
        "for _, key in ipairs(redis.call('SMEMBERS', claimed_key)) do",
        "for _, key in ipairs({}) do",
        "a claim sent again after a lost reply does not hear of its wins (they wait a lease)",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-fence-seed",
        "timer_claim.lua",
        "local fence = math.max(last + 1, now * 1000)",
        "local fence = last + 1",
        "timer fences count wins, not the server's clock: they go back after a wipe",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-rearm-same-generation",
        "timer_finish.lua",
        "t = pending_timer(next_gen(meta_key), due_ms,",
        "t = pending_timer(t.gen, due_ms,",
        "a rearm or recurrence keeps the generation that fired",
        (TIMER_MACHINE,),
    ),
    # A job's exclude= (issue 44's calendars).
    Mutant(
        "excluded-slot-runs",
        "claim.lua",
        "  if excluded and not manual then\n",
        "  if false then\n",
        "a slot the job's exclude= leaves out starts as any other",
        (CALENDARS,),
    ),
    Mutant(
        "excluded-manual-run",
        "claim.lua",
        "  if excluded and not manual then\n",
        "  if excluded then\n",
        "a manual run of an excluded slot's instant is recorded skipped",
        (CALENDARS,),
    ),
    # A job's max_runs (issue 44's bounds).
    Mutant(
        "max-runs-not-asked",
        "claim.lua",
        "  if max_runs > 0 then\n",
        "  if false then\n",
        "a job's runs start whatever its max_runs",
        (BOUNDS,),
    ),
    Mutant(
        "runs-not-counted",
        "finish.lua",
        "  count_run(state_key, s.status, bad)\n",
        "",
        "a run that ends is not counted against its job's max_runs",
        (BOUNDS,),
    ),
    Mutant(
        "runs-counted-with-retries",
        "finish.lua",
        "if s.status ~= 'retry' then\n  -- Settled for good",
        "count_run(state_key, 'ok', bad)\nif s.status ~= 'retry' then\n  -- Settled for good",
        "every finish counts a run, repeated ones and retried attempts too",
        (BOUNDS,),
    ),
    # A job's pause_after_failures (issue 44's dead man's switch).
    Mutant(
        "failures-in-a-row-not-counted",
        "finish.lua",
        "elseif s.status == 'failed' and pause_after > 0 then",
        "elseif false then",
        "a slot that finally fails never counts towards pause_after_failures",
        (DEAD_MAN,),
    ),
    Mutant(
        "failures-in-a-row-kept-on-success",
        "finish.lua",
        "  if pause_after > 0 then redis.call('HDEL', state_key, FAILED_IN_ROW_FIELD) end\n",
        "",
        "a run that ends ok does not count pause_after_failures from zero again",
        (DEAD_MAN,),
    ),
    Mutant(
        "counts-read-loosely",
        "lease_state.lua",
        "  local n = whole(raw)\n  if n then return n end\n",
        "  local n = tonumber(raw)\n  if n then return n end\n",
        "a job's count read as any number: 'inf' finishes the job for good",
        (UNTRUSTED,),
    ),
    # Backfills (issue 44's part 1).
    Mutant(
        "backfill-turn-shared",
        "backfill.lua",
        "  if r.driver ~= instance and r.driver ~= '' and r.until_ms > now then\n",
        "  if false then\n",
        "every instance that runs the job drives its backfill at once",
        (BACKFILL,),
    ),
    Mutant(
        "backfill-cancel-ignored",
        "backfill.lua",
        "if r.status ~= 'running' then return {'over', r.status, bad} end\n",
        "",
        "a cancelled backfill goes on",
        (BACKFILL,),
    ),
    # Deploy-safe definitions (issue 44's part 7).
    Mutant(
        "outdated-definition-not-asked",
        "claim.lua",
        "  if fingerprint ~= '' and not manual then\n",
        "  if false then\n",
        "an instance of an older definition claims new slots until its registration says",
        (DEPLOYS,),
    ),
    Mutant(
        "oldest-definition-in-force",
        "registry.lua",
        "    if a[2] ~= b[2] then return a[2] > b[2] end\n",
        "    if a[2] ~= b[2] then return a[2] < b[2] end\n",
        "the oldest definition of a job stays in force through a deploy",
        (DEPLOYS,),
    ),
    # The fleet limits (lease_state.lua's permits, a kind's rate and key groups).
    Mutant(
        "fleet-permit-not-asked",
        "claim.lua",
        "  if not permitted then\n",
        "  if false then\n",
        "a job's run starts whether or not its runs in the fleet hold every permit",
        (FLEET,),
    ),
    Mutant(
        "fleet-permit-kept-on-finish",
        "finish.lua",
        "drop_permit(permits_key, slot)\n",
        "",
        "a job's finish keeps its fleet permit (held until the lease it had would end)",
        (FLEET,),
    ),
    Mutant(
        "fleet-stale-heartbeat-takes-permit",
        "heartbeat.lua",
        "if not take_permit(permits_key, slot, now + lease_ms, now, fleet_max, {}) then",
        "if not take_permit(permits_key, slot, now + lease_ms, now, 0, {}) then",
        "an attempt whose lease ran out takes its permit back with a heartbeat while "
        "others hold every one",
        (FLEET,),
    ),
    Mutant(
        "timer-fleet-take-unbounded",
        "timer_claim.lua",
        "  if free < take then\n    take = math.max(free, 0)",
        "  if false then\n    take = math.max(free, 0)",
        "a kind's claim takes due timers beyond the permits free",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-rate-window-open",
        "timer_claim.lua",
        "  if left < take then",
        "  if false then",
        "a rate-limited kind's claim starts firings beyond what the window has left",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-group-not-asked",
        "timer_claim.lua",
        "    if not take_permit(group_permits .. group, key, now + lease_ms, now, group_max, "
        "bad) then",
        "    if false then",
        "a key group's timer fires whether or not the group's firings hold every permit",
        (TIMER_MACHINE,),
    ),
    Mutant(
        "timer-group-finish-no-recheck",
        "timer_finish.lua",
        "    redis.call('ZADD', groups_key, int(now), group)\n",
        "",
        "a firing's finish leaves its key group's waiting timers waiting for the lease it "
        "had to end",
        (TIMER_MACHINE,),
    ),
]


def _engine(name: str, file: str, old: str, new: str, removes: str, test: str) -> Mutant:
    return Mutant(name, file, old, new, removes, (test, ENGINE_VIRTUAL), engine=True)


ENGINE_MUTANTS: list[Mutant] = [
    _engine(
        "orphan-takeover-deleted",
        "_engine/claimer.py",
        "        for orphan in reply.orphans:\n            self.take_over(job, orphan, now_ms)\n",
        "",
        "the claimer takes over the orphans a claim reports",
        "tests/test_dead_runs_settle.py",
    ),
    _engine(
        "no-claim-deadline",
        "_engine/claimer.py",
        "                scope.deadline = anyio.current_time() + context.round_trip_sec\n"
        "                try:\n"
        "                    replies = await store.claim_many(requests)\n",
        "                try:\n                    replies = await store.claim_many(requests)\n",
        "a claim batch's round trip has a deadline",
        f"{ENGINE_FAULTS}::test_stop_is_bounded_while_a_claim_waits_on_a_frozen_server",
    ),
    _engine(
        "claim-retry-dropped",
        "_engine/claimer.py",
        '            context.health.failed(f"claiming {len(batch)} slot(s)", failure)\n'
        "            self._agenda.retry(batch)\n",
        '            context.health.failed(f"claiming {len(batch)} slot(s)", failure)\n',
        "a claim batch whose round trip failed is sent again",
        f"{ENGINE_FAULTS}::test_after_a_lost_claim_reply_every_slot_runs_or_is_recorded_skipped",
    ),
    _engine(
        "transient-reply-dropped",
        "_engine/claimer.py",
        "                    again.append(due)\n",
        "                    pass\n",
        "a claim answered with a transient error reply is sent again",
        "tests/test_testing_kit.py::"
        "test_slots_due_while_the_server_is_out_of_memory_are_caught_up_or_reported",
    ),
    _engine(
        "backup-waits-a-whole-lease",
        "_engine/claimer.py",
        "self._back_up(job, due, reply.wait_ms, now_ms)",
        "self._back_up(job, due, self._context.lease_ms, now_ms)",
        "a backup asks again when the time left runs out, not a whole lease later",
        "tests/test_takeover.py",
    ),
    _engine(
        "no-self-fencing",
        "_engine/lease_keeper.py",
        "    def _give_up(self, attempt: Leased) -> None:\n        self.lose(\n",
        "    def _give_up(self, attempt: Leased) -> None:\n        return\n        self.lose(\n",
        "a runner cancels its handler when its lease would expire unconfirmed",
        f"{ENGINE_FAULTS}::test_a_runner_that_cannot_reach_the_server_gives_up_its_lease_by_its_expiry",
    ),
    _engine(
        "sync-lost-recorded-ok",
        "_engine/runner.py",
        'outcome = "cancelled" if leased.lease_lost.is_set() else "ok"',
        'outcome = "ok"',
        "a sync handler that returns after lease_lost is recorded cancelled",
        f"{ENGINE_FAULTS}::test_a_sync_handler_that_returns_on_lease_lost_is_recorded_cancelled",
    ),
    _engine(
        "manual-lease-from-the-first-try",
        "_engine/manual.py",
        "        sent = monotonic()\n        with anyio.move_on_after(round_trip_sec):",
        "        sent = locals().get('sent', monotonic())\n"
        "        with anyio.move_on_after(round_trip_sec):",
        "a manual claim's lease is counted from the try that won, not the first",
        f"{ENGINE_FAULTS}::test_run_now_won_after_tries_that_took_longer_than_the_lease_runs_the_job",
    ),
    _engine(
        "stop-not-shielded",
        "_engine/instance.py",
        "        conn = started.running.store.conn\n        with anyio.CancelScope(shield=True):",
        "        conn = started.running.store.conn\n        with anyio.CancelScope(shield=False):",
        "the stop runs shielded: an instance whose task is cancelled still resolves its "
        "claims in flight and closes its connection",
        f"{ENGINE_FAULTS}::test_a_scheduler_whose_task_is_cancelled_still_stops_and_closes_its_connection",
    ),
    _engine(
        "schedule-raise-unhandled",
        "_engine/agenda.py",
        "            return job.clock.next_slot_ms(after_ms)\n        except Exception as exc:",
        "            return job.clock.next_slot_ms(after_ms)\n"
        "        except ArithmeticError as exc:",
        "a schedule that raises disables its job alone",
        f"{ENGINE_FAULTS}::test_a_schedule_that_raises_disables_its_job_alone",
    ),
    _engine(
        "send-exception-group",
        "clients/send.py",
        "                failures.append(exc)\n",
        "                raise\n",
        "a send() pipeline's failures come out as one TransportError, not an exception group",
        f"{ENGINE_FAULTS}::test_a_send_clients_batch_over_a_reset_connection_raises_one_transport_error",
    ),
]


def mutated_copy(mutant: Mutant, into: Path) -> None:
    """Copy lua/ (an engine mutant: src/) into ``into`` with ``mutant`` applied; the old
    text must occur once."""
    if mutant.engine:
        shutil.copytree(SRC, into / "src", dirs_exist_ok=True)
        path, shown = into / "src" / "anarchon" / mutant.file, f"src/anarchon/{mutant.file}"
    else:
        shutil.copytree(LUA, into, dirs_exist_ok=True)
        path, shown = into / mutant.file, f"lua/{mutant.file}"
    text = path.read_text(encoding="utf-8")
    count = text.count(mutant.old)
    if count != 1:
        raise SystemExit(
            f"mutant {mutant.name}: its old text occurs {count} times in {shown}"
            " (the code changed: update tests/mutants.py)"
        )
    path.write_text(text.replace(mutant.old, mutant.new), encoding="utf-8")


def selection_command(mutant: Mutant) -> list[str]:
    return [
        sys.executable, "-m", "pytest", "-x", "-q", "-n", "2", "-p", "no:randomly",
        "--no-header", f"--hypothesis-seed={SEED}",
        *mutant.tests,
    ]  # fmt: skip


def run_mutant(mutant: Mutant, machine: str | None = None) -> tuple[bool, str, float]:
    """Run the mutant's selection (or one engine machine alone); (killed, the failing
    test or the summary, seconds). An engine mutant's selection runs a part at a time,
    its direct test first: the engine on virtual time runs only if that test missed it."""
    if machine is not None:
        mutant = replace(mutant, tests=(machine,))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "ANARCHON_FULL_MATRIX")}
    env["HYPOTHESIS_PROFILE"] = PROFILE
    start = time.monotonic()
    parts = [(test,) for test in mutant.tests] if mutant.engine else [mutant.tests]
    with tempfile.TemporaryDirectory(prefix=f"anarchon-mutant-{mutant.name}-") as tmp:
        mutated_copy(mutant, Path(tmp))
        if mutant.engine:
            env["PYTHONPATH"] = os.pathsep.join([str(Path(tmp) / "src"), str(ROOT)])
            env["ANARCHON_LUA_DIR"] = str(LUA)
        else:
            env["ANARCHON_LUA_DIR"] = tmp
        for part in parts:
            done = subprocess.run(
                selection_command(replace(mutant, tests=part)),
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
            )
            killed, detail = _verdict(mutant, done)
            if killed:
                break
    return killed, detail, time.monotonic() - start


def _verdict(mutant: Mutant, done: subprocess.CompletedProcess[str]) -> tuple[bool, str]:
    """Whether a selection's run killed the mutant, and the failing test or the summary."""
    lines = done.stdout.splitlines()
    # "FAILED tests/x.py::test - why" (not a captured log line "ERROR    anarchon:...").
    failed = [
        line.split(" - ")[0]
        for line in lines
        if line.startswith(("FAILED ", "ERROR ")) and "::" in line.split(" ")[1]
    ]
    summary = lines[-1] if lines else done.stderr.strip()[-200:]
    # 1: tests failed; 2: xdist's -x interrupted the session after a failure.
    if done.returncode in (1, 2) and failed:
        # The engine machine prints the check that failed as it fails (a replay on the
        # real clock may then fail differently, e.g. FlakyStrategyDefinition).
        said = [line for line in lines if line.startswith("engine machine: ")]
        errors = [line.removeprefix("engine machine: ") for line in said] or [
            line[1:].strip() for line in lines if line.startswith("E   ")
        ]
        why = f" ({errors[0][:160]})" if errors else ""
        return True, failed[0].removeprefix("FAILED ") + why
    if done.returncode == 0:
        return False, summary
    # Anything else (a usage error, an internal error, an interrupted run) is the
    # runner's problem, not a kill.
    raise SystemExit(
        f"mutant {mutant.name}: pytest exited {done.returncode}\n{done.stdout[-3000:]}"
        f"\n{done.stderr[-3000:]}"
    )


def in_turn(mutants: list[Mutant], count: int) -> list[Mutant]:
    """``count`` consecutive mutants of the list (wrapping), where they begin chosen by
    the commit checked out (by the day without one): a run of a commit always runs the
    same ones, and a few commits cover them all."""
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    head = done.stdout.strip()
    turn = int(head[:8], 16) if done.returncode == 0 and head else time.time() // 86_400
    first = int(turn) * count % len(mutants)
    return [mutants[(first + i) % len(mutants)] for i in range(min(count, len(mutants)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__)
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutant")
    parser.add_argument("--engine", action="store_true", help="the engine's mutants instead")
    parser.add_argument("--machine", action="store_true", help="against the engine machine alone")
    parser.add_argument(
        "--virtual", action="store_true", help="against the engine on virtual time alone"
    )
    parser.add_argument(
        "--share",
        type=int,
        metavar="K",
        help="run K of the listed mutants, chosen by the commit (a few commits cover all)",
    )
    args = parser.parse_args(argv)
    listed = ENGINE_MUTANTS if args.engine else MUTANTS
    names = [m.name for m in MUTANTS + ENGINE_MUTANTS]
    assert len(set(names)) == len(names), "mutant names must be unique"
    for mutant in listed:  # every mutant applies, even when only some run
        with tempfile.TemporaryDirectory() as tmp:
            mutated_copy(mutant, Path(tmp))
    if args.list:
        for mutant in listed:
            where = f"src/anarchon/{mutant.file}" if mutant.engine else f"lua/{mutant.file}"
            print(f"{mutant.name}: {where}: {mutant.removes}")
            print(f"    {' '.join(mutant.tests)}")
        return 0
    chosen = listed
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in listed})
        if unknown:
            parser.error(f"unknown mutant(s): {', '.join(unknown)}")
        chosen = [m for m in listed if m.name in args.only]
    if args.share:
        chosen = in_turn(chosen, args.share)
        print(f"mutants this time: {', '.join(m.name for m in chosen)}", flush=True)
    survivors = []
    for mutant in chosen:
        machine = ENGINE_MACHINE if args.machine else ENGINE_VIRTUAL if args.virtual else None
        killed, detail, seconds = run_mutant(mutant, machine)
        verdict = "killed" if killed else "SURVIVED"
        print(f"{mutant.name}: {verdict} in {seconds:.0f} s: {detail}", flush=True)
        if not killed:
            survivors.append(mutant)
    for mutant in survivors:
        print(f"survivor: {mutant.name} ({mutant.removes})")
    print(f"mutants: killed={len(chosen) - len(survivors)} of {len(chosen)}")
    return 0 if not survivors else 1


if __name__ == "__main__":
    sys.exit(main())
