"""The scenarios: each starts a server and instances, runs a fault script, stops
everything and checks the ledger (``chaos.checker``)."""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import anyio
import redis

from anarchon import RedisBackend, Scheduler, TimerSetting
from anarchon._model.clock import round_trip_deadline_sec
from chaos import checker, timer_checker
from chaos.checker import FOREVER, Life, Report, Result, Window
from chaos.procs import Instance, valkey_server, wall_ms
from chaos.worker import LONG_EVERY, TIMER_KIND, job_name
from tests.restartable_server import RestartableServer
from tests.servers import wait_in_sync

PREFIX = "chaos:"
#: The field of a job's state hash that holds its fence counter (lua/lease_state.lua).
FENCE_FIELD = "fence"


def admin(server: RestartableServer, timeout_sec: float = 5.0) -> redis.Redis:
    """A connection of the scenario's own to ``server`` (no proxy in between)."""
    return redis.Redis(
        port=server.port, socket_timeout=timeout_sec, decode_responses=True, protocol=2
    )


def command(server: RestartableServer, *args: str) -> object:
    """One command on a connection of its own; the reply."""
    with admin(server) as client:
        execute: Callable[..., object] = client.execute_command  # untyped in redis-py
        return execute(*args)


def replication(server: RestartableServer) -> dict[str, str]:
    """``INFO replication`` as text fields."""
    with admin(server) as client:
        return {k: str(v) for k, v in dict(client.info("replication")).items()}


@dataclass
class Config:
    instances: int = 3
    jobs: int = 8
    every_ms: int = 1000
    lease_ms: int = 2000
    heartbeat_ms: int = 500
    seconds: float = 20.0
    appendonly: bool = False
    seed: int = 0
    #: Timers (kind ``chaos-timer``) set at the start, due evenly from 1 s after it
    #: until 8 s before the end.
    timers: int = 0


@dataclass
class Run:
    """A scenario in progress: its processes, its fault timeline, the store's results."""

    name: str
    config: Config
    directory: Path
    #: The primary: the one server the instances' proxies lead to.
    server: RestartableServer
    rng: random.Random
    #: Every server the run started (the primary, replicas), killed at the end.
    servers: list[RestartableServer] = field(default_factory=list)
    instances: list[Instance] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    lives: dict[str, Life] = field(default_factory=dict)
    results: dict[str, dict[int, list[Result]]] = field(default_factory=dict)
    #: The timers set (key -> generation).
    timers: dict[str, int] = field(default_factory=dict)
    started: int = 0
    t0_ms: int = 0
    deadline: float = 0.0

    # -- processes ---------------------------------------------------------------------

    def spawn(self, count: int) -> list[Instance]:
        c = self.config
        new = []
        for _ in range(count):
            index = self.started
            self.started += 1
            loop = "asyncio" if index % 2 == 0 else "trio"
            instance = Instance(
                f"i{index:02d}-{loop}", self.server, self.directory, PREFIX, c.jobs,
                c.every_ms, c.lease_ms, c.heartbeat_ms, loop,
            )  # fmt: skip
            self.instances.append(instance)
            new.append(instance)
        for instance in new:
            instance.wait_ready()
            self.lives[instance.name] = Life(instance.ready_ms)
        return new

    def live(self) -> list[Instance]:
        return [i for i in self.instances if i.alive() and not i.stopped]

    def jobs(self) -> list[str]:
        return [job_name(i) for i in range(self.config.jobs)]

    def sleep_until(self, seconds_from_t0: float) -> None:
        target = self.t0_ms / 1000 + seconds_from_t0
        while True:
            left = min(target - time.time(), self.deadline - time.monotonic())
            if left <= 0:
                return
            time.sleep(min(left, 0.5))

    def next_instant_sec(self) -> float:
        """The next slot instant (every job's), in seconds from t0."""
        every = self.config.every_ms
        return ((wall_ms() // every + 1) * every - self.t0_ms) / 1000

    def note(self, text: str) -> None:
        self.events.append(f"{(wall_ms() - self.t0_ms) / 1000:+.1f}s {text}")

    # -- the store ---------------------------------------------------------------------

    def snapshot_results(self) -> None:
        """Adds the store's results to what was read before (a wipe loses them)."""
        try:
            with admin(self.server) as client, client.pipeline(transaction=False) as pipe:
                for job in self.jobs():
                    pipe.zrange(state_key(job, "results"), 0, -1)
                replies = pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self.note(f"results not read: {exc}")
            return
        for job, members in zip(self.jobs(), replies, strict=True):
            per_slot = self.results.setdefault(job, {})
            for member in members:
                result = checker.parse_result(member)
                if result is not None:
                    known = per_slot.setdefault(result.slot, [])
                    if result not in known:
                        known.append(result)

    def open_runs(self) -> dict[str, list[tuple[str, int]]]:
        """Runs started and not ended, per instance, from the ledgers."""
        starts, ends = checker.read_ledgers([i.ledger for i in self.instances])
        found: dict[str, list[tuple[str, int]]] = {}
        for s in starts:
            if s.key not in ends:
                found.setdefault(s.instance, []).append((s.job, s.wall_ms))
        return found

    def set_timers(self) -> None:
        """Sets ``config.timers`` timers ``t0``... on the server (not through a proxy),
        due evenly from 1 s after t0 until 8 s before the end."""
        count = self.config.timers
        first_ms = self.t0_ms + 1000
        span_ms = max(1, int(self.config.seconds * 1000) - 9000)
        settings = [
            TimerSetting(
                f"t{n}",
                at=datetime.fromtimestamp((first_ms + span_ms * n // count) / 1000, UTC),
            )
            for n in range(count)
        ]
        producer = Scheduler(RedisBackend(redis=self.server.url, prefix=PREFIX))
        generations = anyio.run(producer.set_timers, TIMER_KIND, settings)
        self.timers = {t.key: g for t, g in zip(settings, generations, strict=True)}
        self.note(f"{count} timers set, due over {span_ms / 1000:.0f}s")

    def timer_victim(self, timeout_sec: float = 3.0) -> Instance:
        """A live instance in the middle of a firing started within the last 200 ms,
        if one can be found in ``timeout_sec``; else any live one."""
        deadline = time.monotonic() + timeout_sec
        live = self.live()
        while time.monotonic() < deadline:
            starts, ends = timer_checker.read_timer_ledgers([i.ledger for i in live])
            now = wall_ms()
            for start in starts:
                open_ = (start.key, start.generation, start.instance, start.fence) not in ends
                if open_ and now - start.wall_ms < 200:
                    for instance in live:
                        if instance.name == start.instance:
                            return instance
            time.sleep(0.03)
        return self.rng.choice(live)

    def victim(self, timeout_sec: float = 5.0) -> Instance:
        """A live instance in the middle of a long run (one longer than the period),
        started within the last half period if one can be found in ``timeout_sec``."""
        deadline = time.monotonic() + timeout_sec
        live = self.live()
        while time.monotonic() < deadline:
            now = wall_ms()
            runs = self.open_runs()
            for instance in live:
                for job, started in runs.get(instance.name, []):
                    long_job = int(job[1:]) % LONG_EVERY == LONG_EVERY - 1
                    if long_job and now - started < self.config.every_ms // 2:
                        return instance
            time.sleep(0.05)
        return max(live, key=lambda i: len(self.open_runs().get(i.name, [])))

    # -- faults ------------------------------------------------------------------------

    def sigkill(self, instance: Instance, replace: bool = True) -> None:
        now = wall_ms()
        instance.sigkill()
        self.windows.append(Window("sigkill", now, FOREVER, instance.name))
        self.lives[instance.name].ended_ms = now
        self.note(f"SIGKILL {instance.name}")
        if replace:
            (new,) = self.spawn(1)
            self.note(f"started {new.name}")

    def sigstop(self, instance: Instance, seconds: float) -> None:
        start = wall_ms()
        instance.signal(signal.SIGSTOP)
        self.note(f"SIGSTOP {instance.name} for {seconds:.1f}s")
        time.sleep(seconds)
        instance.signal(signal.SIGCONT)
        self.windows.append(Window("sigstop", start, wall_ms(), instance.name))
        self.note(f"SIGCONT {instance.name}")

    def partition(self, instance: Instance, pause_sec: float, cut_sec: float) -> None:
        start = wall_ms()
        instance.proxy.pause()
        self.note(f"partition {instance.name}: paused {pause_sec:.1f}s")
        time.sleep(pause_sec)
        instance.proxy.refuse(True)
        instance.proxy.resume()
        self.note(f"partition {instance.name}: cut {cut_sec:.1f}s")
        time.sleep(cut_sec)
        instance.proxy.refuse(False)
        self.windows.append(Window("partition", start, wall_ms(), instance.name))
        self.note(f"partition {instance.name}: healed")

    def server_kill(self, down_sec: float, appendonly: bool) -> None:
        self.snapshot_results()
        start = wall_ms()
        self.server.kill()
        self.note(f"kill -9 server (appendonly={'yes' if self.server.appendonly else 'no'})")
        time.sleep(down_sec)
        wipe = not (self.server.appendonly and appendonly)
        self.server.start(appendonly=appendonly)
        self.windows.append(Window("server-down", start, wall_ms(), None, wipe=wipe))
        self.note(f"server back on port {self.server.port} ({'empty' if wipe else 'from AOF'})")

    def server_command(self, *args: str) -> None:
        reply = command(self.server, *args)
        self.note(f"{' '.join(args)} -> {reply!r}")

    def start_replica(self) -> RestartableServer:
        """A second server that replicates the primary, once in sync: its link up, and
        its offset at least the primary's as read after that."""
        directory = self.directory / f"replica-{len(self.servers)}"
        directory.mkdir()
        replica = RestartableServer(self.server.binary, directory, self.server.appendonly)
        self.servers.append(replica)
        replica.start()
        command(self.server, "CONFIG", "SET", "repl-diskless-sync-delay", "0")
        command(replica, "REPLICAOF", "127.0.0.1", str(self.server.port))
        target = wait_in_sync(self.server.port, replica.port)
        self.note(f"replica on port {replica.port} in sync (offset {target})")
        return replica

    def promote(self, replica: RestartableServer, lag_sec: float, down_sec: float) -> None:
        """``kill -9`` of the primary, and ``down_sec`` later ``REPLICAOF NO ONE`` on
        ``replica`` and every proxy redirected to it. With ``lag_sec`` the replica is
        cut off from the primary that long before the kill (a replica fallen behind):
        what the primary acknowledged meanwhile is lost with it.

        What the promoted replica kept is read from it before anyone reaches it: each
        job's fence counter. Replication applies the primary's writes in order, so
        the wins it kept are exactly those up to that fence (chaos.checker)."""
        with contextlib.ExitStack() as stack:
            if lag_sec > 0:
                nowhere = stack.enter_context(_unreachable_port())
                command(replica, "REPLICAOF", "127.0.0.1", str(nowhere))
                self.note(f"replica cut off from the primary, {lag_sec:.1f}s before its kill")
                time.sleep(lag_sec)
            self.snapshot_results()
            primary_offset = int(replication(self.server)["master_repl_offset"])
            start = wall_ms()
            self.server.kill()
            self.note(f"kill -9 primary (port {self.server.port}, offset {primary_offset})")
            time.sleep(down_sec)
            command(replica, "REPLICAOF", "NO", "ONE")
        kept = self.fence_counters(replica)
        replica_offset = int(replication(replica)["master_repl_offset"])
        for instance in self.instances:
            instance.proxy.redirect(("127.0.0.1", replica.port))
        self.server = replica
        self.windows.append(Window("promotion", start, wall_ms(), None, kept_fences=kept))
        self.note(
            f"replica on port {replica.port} promoted, proxies redirected to it (it had "
            f"{primary_offset - replica_offset} bytes of the primary's stream fewer)"
        )

    def fence_counters(self, server: RestartableServer) -> dict[str, int]:
        with admin(server) as client, client.pipeline(transaction=False) as pipe:
            for job in self.jobs():
                pipe.hget(state_key(job, "state"), FENCE_FIELD)
            replies = pipe.execute()
        return {job: int(r or 0) for job, r in zip(self.jobs(), replies, strict=True)}

    def slow_links(
        self, victims: list[Instance], seconds: float, low_ms: int, high_ms: int
    ) -> None:
        """The victims' proxies hold every chunk ``low_ms``..``high_ms`` each way (a new
        random delay every half second) for ``seconds``, then heal."""
        start = wall_ms()
        names = ", ".join(v.name for v in victims)
        self.note(f"slow links {names}: {low_ms}-{high_ms}ms each way for {seconds:.1f}s")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for victim in victims:
                victim.proxy.delay(self.rng.uniform(low_ms, high_ms))
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
        for victim in victims:
            victim.proxy.delay(0)
        # Held chunks move on within a delay of the heal.
        healed = wall_ms() + high_ms
        for victim in victims:
            self.windows.append(Window("slow", start, healed, victim.name, each_way_ms=high_ms))
        self.note(f"slow links {names}: healed")


def state_key(job: str, kind: str) -> str:
    """One of a job's keys: ``state``, ``active``, ``slots``, ``runs``, ``results``."""
    return "{" + PREFIX + job + "}:" + kind


@contextlib.contextmanager
def _unreachable_port() -> Iterator[int]:
    """A loopback port held bound but not listening: connections to it are refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as nowhere:
        nowhere.bind(("127.0.0.1", 0))
        yield nowhere.getsockname()[1]


# -- the fault scripts (seconds from t0; the run ends at config.seconds) ----------------


def f_sigkill(run: Run) -> None:
    run.sleep_until(4)
    run.sigkill(run.victim())
    run.sleep_until(12)
    run.sigkill(run.victim())


def f_sigstop(run: Run) -> None:
    run.sleep_until(4)
    run.sigstop(run.victim(), 4.5)


def f_partition(run: Run) -> None:
    run.sleep_until(4)
    run.partition(run.victim(), 3.0, 4.0)


def f_server_aof(run: Run) -> None:
    run.sleep_until(5)
    run.server_kill(3.0, appendonly=True)


def f_server_wipe(run: Run) -> None:
    run.sleep_until(5)
    run.server_kill(3.0, appendonly=False)


def f_flush_kill(run: Run) -> None:
    run.sleep_until(5)
    run.server_command("SCRIPT", "FLUSH")
    run.sleep_until(11)
    run.server_command("CLIENT", "KILL", "TYPE", "normal")


def f_promotion(run: Run) -> None:
    replica = run.start_replica()
    # Cut off just before a slot's instant and killed after it: the primary's wins of
    # that slot, and the finishes of its short runs, are lost with it.
    run.sleep_until(6)
    run.sleep_until(run.next_instant_sec() - 0.05)
    run.promote(replica, lag_sec=0.6, down_sec=1.0)


def f_slow(run: Run) -> None:
    run.sleep_until(4)
    # Every instance, round trips within the engine's deadline: it must keep up.
    run.slow_links(run.live(), 5.0, 150, 250)
    run.sleep_until(11)
    # Two instances, round trips near and past it (one of them in a long run).
    first = run.victim()
    second = run.rng.choice([i for i in run.live() if i is not first])
    run.slow_links([first, second], 5.0, 300, 400)


def f_timers(run: Run) -> None:
    """Timers firing through faults: a runner killed mid-firing, one stopped mid-firing
    longer than the lease, the server killed (AOF, fsync always) and back."""
    run.sleep_until(3)
    run.sigkill(run.timer_victim())
    run.sleep_until(8)
    run.sigstop(run.timer_victim(), 3.5)
    run.sleep_until(14)
    run.server_kill(3.0, appendonly=True)


def f_random(run: Run) -> None:
    """The soak: a random fault every 15-35 s (one at a time), killed instances replaced."""
    kinds = ["sigkill", "sigstop", "partition", "server", "flush", "client-kill", "promotion",
             "slow"]  # fmt: skip
    end = run.config.seconds - 8
    at = run.rng.uniform(8, 20)
    for _ in range(10_000):
        if at >= end:
            return
        run.sleep_until(at)
        kind = run.rng.choice(kinds)
        if kind == "sigkill":
            run.sigkill(run.victim(2))
        elif kind == "sigstop":
            run.sigstop(run.victim(2), run.rng.uniform(2.5, 6))
        elif kind == "partition":
            run.partition(run.victim(2), run.rng.uniform(1, 3), run.rng.uniform(1, 4))
        elif kind == "server":
            run.server_kill(run.rng.uniform(0.5, 4), appendonly=True)
        elif kind == "promotion":
            lag = run.rng.choice([0.0, run.rng.uniform(0.1, 1.5)])
            run.promote(run.start_replica(), lag, run.rng.uniform(0.5, 3))
        elif kind == "slow":
            victims = run.rng.sample(run.live(), min(len(run.live()), run.rng.choice([1, 2])))
            run.slow_links(victims, run.rng.uniform(3, 8), 150, 400)
        elif kind == "flush":
            run.server_command("SCRIPT", "FLUSH")
        else:
            run.server_command("CLIENT", "KILL", "TYPE", "normal")
        at = (wall_ms() - run.t0_ms) / 1000 + run.rng.uniform(15, 35)


FaultScript = Callable[[Run], None]

QUICK: list[tuple[str, FaultScript, dict[str, object]]] = [
    ("sigkill-runner", f_sigkill, {}),
    ("sigstop-instance", f_sigstop, {}),
    ("partition", f_partition, {}),
    ("server-kill-aof", f_server_aof, {"appendonly": True, "seconds": 22.0}),
    ("server-kill-wipe", f_server_wipe, {"appendonly": False, "seconds": 22.0}),
    ("script-flush-client-kill", f_flush_kill, {"seconds": 18.0}),
    ("replica-promotion", f_promotion, {"seconds": 22.0}),
    ("slow-proxy", f_slow, {}),
    ("timers", f_timers, {"timers": 400, "jobs": 4, "appendonly": True, "seconds": 26.0}),
]


@dataclass
class Outcome:
    name: str
    report: Report
    line: str
    timers: timer_checker.TimerReport | None = None

    @property
    def runs(self) -> int:
        return self.report.runs + (self.timers.firings if self.timers else 0)

    @property
    def unexplained(self) -> int:
        return len(self.report.unexplained) + (len(self.timers.unexplained) if self.timers else 0)

    @property
    def misses(self) -> int:
        return len(self.report.misses) + (len(self.timers.misses) if self.timers else 0)


def run_scenario(name: str, script: FaultScript, config: Config, keep: bool = False) -> Outcome:
    started = time.monotonic()
    tmp = tempfile.mkdtemp(prefix=f"chaos-{name}-")
    try:
        directory = Path(tmp)
        server = valkey_server(directory, config.appendonly)
        run = Run(name, config, directory, server, random.Random(f"{config.seed}:{name}"))
        run.servers.append(server)
        stop_ms = 0
        try:
            server.start()
            run.spawn(config.instances)
            run.t0_ms = wall_ms() + 500
            if config.timers:
                run.set_timers()
            # Every wait of the fault script ends by this bound (and the script's own).
            run.deadline = time.monotonic() + config.seconds + 120
            script(run)
            run.sleep_until(config.seconds)
            stop_ms = wall_ms()
            run.windows.append(Window("stopping", stop_ms))
            for instance in run.instances:
                if instance.alive():
                    instance.terminate()
            bound = time.monotonic() + 15
            for instance in run.instances:
                if instance.alive() and not instance.wait_or_kill(bound - time.monotonic()):
                    run.note(f"{instance.name} did not stop within 15 s: killed")
                    run.windows.append(Window("forced", stop_ms, FOREVER, instance.name))
            if run.server.process is None:
                run.server.start()
            run.snapshot_results()
        finally:
            for instance in run.instances:
                instance.close()
            for each in run.servers:
                each.kill()
        logs = {i.name: i.log_path.read_text(errors="replace").splitlines() for i in run.instances}
        paths = [i.ledger for i in run.instances]
        starts, ends = checker.read_ledgers(paths)
        stalls = checker.read_gaps(paths, config.heartbeat_ms)
        max_gap_ms = max((w.end_ms - w.start_ms for w in checker.read_gaps(paths, 0)), default=0)
        for life in run.lives.values():
            if life.ended_ms >= FOREVER:
                life.ended_ms = stop_ms
        report = checker.check(
            starts=starts,
            ends=ends,
            results=run.results,
            windows=run.windows + stalls,
            lives=run.lives,
            jobs=run.jobs(),
            every_ms=config.every_ms,
            check_from_ms=run.t0_ms + config.every_ms,
            check_to_ms=stop_ms - 2 * config.every_ms,
            slack_ms=config.lease_ms,
            recovery_ms=5000 + config.lease_ms + config.every_ms,
            logs=logs,
            loop_gaps=checker.read_gaps(paths, 0),
            # The engine's round-trip deadline less a fifth (the server, the event loop).
            keep_up_ms=int(round_trip_deadline_sec(config.lease_ms) * 800),
        )
        timers = None
        if config.timers:
            timer_starts, timer_ends = timer_checker.read_timer_ledgers(paths)
            timers = timer_checker.check_timers(
                timer_starts, timer_ends, run.timers, run.windows + stalls
            )
    finally:
        if keep:
            print(f"{name}: files kept in {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - started
    minutes = max(1e-9, (stop_ms - run.t0_ms) / 60000)
    lines = sum(len(v) for v in logs.values())
    tracebacks = sum(1 for v in logs.values() for line in v if line.startswith("Traceback"))
    errors = sum(1 for v in logs.values() for line in v if " ERROR " in line)
    takeovers = sorted(report.takeovers_ms)
    explained_by = ",".join(f"{k}:{v}" for k, v in sorted(report.explained_by.items())) or "-"
    recorded = ",".join(f"{k}:{v}" for k, v in sorted(report.recorded.items())) or "0"
    line = (
        f"{name}: {config.instances}x{config.jobs} {(stop_ms - run.t0_ms) / 1000:.0f}s "
        f"slots={report.slots} ran={report.ran} runs={report.runs} recorded={recorded} "
        f"explained_gaps={report.explained_gaps} duplicates={report.duplicates} "
        f"(explained={report.explained_duplicates} by {explained_by}) "
        f"unexplained={len(report.unexplained)} "
        f"misses={len(report.misses)} stalled_skips={len(report.stalled_skips)} "
        f"late_max={report.late_max_ms}ms "
        f"late_p99={report.late_p99_ms}ms late_max_in_faults={report.late_max_all_ms}ms "
        f"takeovers_ms={takeovers[:8]}{'...' if len(takeovers) > 8 else ''} "
        f"stale_starts={len(report.stale_starts)} "
        f"unsettled={report.unsettled} fence_checks={report.fence_checks} "
        f"lost_wins={report.lost_wins} fences_reused={len(report.fences_reused)} "
        f"loop_stalls={len(stalls)} max_loop_gap={max_gap_ms}ms "
        f"log_lines_per_min={lines / minutes:.0f} "
        f"errors={errors} tracebacks={tracebacks} wall={elapsed:.0f}s"
    )
    if timers is not None:
        explained = ",".join(f"{k}:{v}" for k, v in sorted(timers.explained.items())) or "-"
        line += (
            f"\n  timers: set={timers.timers} fired={timers.fired} firings={timers.firings} "
            f"again={timers.duplicates} (explained by {explained}) "
            f"unexplained={len(timers.unexplained)} misses={len(timers.misses)} "
            f"takeovers={timers.takeovers} late_p99={timers.late_p99_ms}ms "
            f"late_max={timers.late_max_ms}ms"
        )
    detail = [f"  {e}" for e in run.events]
    detail += [f"  explained by a stall: {x}" for x in report.stalls[:10]]
    if len(report.stalls) > 10:
        detail.append(f"  ... and {len(report.stalls) - 10} more explained by stalls")
    detail += [f"  explained by a lost write: {x}" for x in report.lost_write_duplicates]
    detail += [f"  fence reused: {x}" for x in report.fences_reused[:10]]
    if len(report.fences_reused) > 10:
        detail.append(f"  ... and {len(report.fences_reused) - 10} more fences reused")
    detail += [f"  SUSPICIOUS stale start: {x}" for x in report.stale_starts]
    detail += [f"  skipped in a stall: {x}" for x in report.stalled_skips[:10]]
    if len(report.stalled_skips) > 10:
        detail.append(f"  ... and {len(report.stalled_skips) - 10} more skipped in stalls")
    timer_items = timers.unexplained + timers.misses if timers else []
    for item in report.unexplained + report.misses + timer_items[:20]:
        detail.append("  " + item)
    if report.unexplained or report.misses or timer_items or tracebacks:
        for v in logs.values():
            detail += ["  | " + x for x in v if x.startswith("Traceback") or " ERROR " in x][:20]
    return Outcome(name, report, line + ("\n" + "\n".join(detail) if detail else ""), timers)
