"""A server that a test can ``kill -9`` and start again on the same port, with its
data kept (append-only file, fsynced on every write) or lost."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from pathlib import Path

from anarchon._ops.embedded import free_port, launch

__all__ = ["RestartableServer"]


class RestartableServer:
    """``binary`` (redis-server or valkey-server) on 127.0.0.1, its files in ``directory``.

    With ``appendonly`` the AOF is fsynced on every write (``appendfsync always``),
    so a ``kill -9`` loses nothing the server acknowledged. A start without
    ``appendonly`` deletes the AOF first: the server comes back empty, and a later
    start with ``appendonly`` cannot bring back an older state."""

    def __init__(self, binary: Path, directory: Path, appendonly: bool) -> None:
        self.binary = binary
        self.directory = directory
        self.appendonly = appendonly
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = directory / "server.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(
        self, appendonly: bool | None = None, *, wipe: bool = False, timeout_sec: float = 20.0
    ) -> None:
        """Start (again, on the same port). ``wipe`` deletes the AOF first, so the
        server comes back empty even with ``appendonly``."""
        if appendonly is not None:
            self.appendonly = appendonly
        if wipe or not self.appendonly:
            for name in ("appendonlydir", "appendonly.aof"):
                path = self.directory / name
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
        for _ in range(5):  # a free port can be taken between finding and binding it
            if self.port == 0:
                self.port = free_port()
            args = [
                "--save", "",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always",
                "--dir", str(self.directory),
            ]  # fmt: skip
            self.process = launch(self.binary, self.port, args, self.log_path, timeout_sec)
            if self.process is not None:
                return
            time.sleep(0.2)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{self.binary} did not start on port {self.port}:\n{tail}")

    def kill(self) -> None:
        """``kill -9``: no shutdown, no save."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        self.process = None
