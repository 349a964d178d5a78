"""A primary, a replica and Sentinels that watch them, on loopback, from one server
binary (``redis-server`` and ``valkey-server`` run as a Sentinel with ``--sentinel``);
``failover()`` promotes the replica the way an outage would, through the Sentinels."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from anarchon._ops.embedded import free_port, launch, ping

__all__ = ["SentinelGroup"]

MASTER = "anarchon-test"


def _client(port: int) -> redis.Redis:
    """A probe of one server or Sentinel: RESP2, which Redis 5 (and its Sentinels) speak."""
    return redis.Redis(port=port, decode_responses=True, protocol=2)


class SentinelGroup:
    def __init__(self, binary: Path, directory: Path, sentinels: int = 2) -> None:
        self.binary = binary
        self.directory = directory
        self.sentinel_count = sentinels
        self.processes: list[subprocess.Popen[bytes]] = []
        self.server_ports: list[int] = []
        self.sentinel_ports: list[int] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER}/0"

    def start(self) -> SentinelGroup:
        log = self.directory / "servers.log"
        primary = self._server([], log)
        self._server(["--replicaof", "127.0.0.1", str(primary)], log)
        self._wait(lambda: self._linked(), "the replica to sync")
        for index in range(self.sentinel_count):
            port = free_port()
            config = self.directory / f"sentinel-{index}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\n"
                f"dir {self.directory}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {primary} 1\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 5000\n"
            )
            with open(log, "ab") as out:
                process = subprocess.Popen(
                    [str(self.binary), str(config), "--sentinel"],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                )  # fmt: skip
            self.processes.append(process)
            self.sentinel_ports.append(port)
            self._wait(lambda p=port: ping(p), f"Sentinel {index} to answer")  # type: ignore[misc]
        self._wait(self._replica_known, "the Sentinels to know the replica")
        return self

    def _server(self, args: list[str], log: Path) -> int:
        # Each server its own directory: a replica writes the RDB it syncs from.
        directory = self.directory / f"server-{len(self.server_ports)}"
        directory.mkdir(exist_ok=True)
        for _ in range(5):
            port = free_port()
            options = ["--save", "", "--appendonly", "no", "--dir", str(directory), *args]
            process = launch(self.binary, port, options, log, 20)
            if process is not None:
                self.processes.append(process)
                self.server_ports.append(port)
                return port
        raise RuntimeError(f"{self.binary} did not start: {log.read_text()[-2000:]}")

    def primary_port(self) -> int:
        with _client(self.sentinel_ports[0]) as sentinel:
            _, port = sentinel.sentinel_get_master_addr_by_name(MASTER)
        return int(port)

    def role(self, port: int) -> str:
        """What the server on ``port`` says it is: ``master`` or ``slave``."""
        with _client(port) as server:
            return str(server.info("replication")["role"])

    def subscribers(self, channel: str) -> int:
        """How many clients of the primary subscribe to ``channel``."""
        with _client(self.primary_port()) as primary:
            return int(dict(primary.pubsub_numsub(channel)).get(channel, 0))

    def failover(self) -> int:
        """Promote the replica; return the new primary's port once the Sentinels say so
        and it takes writes."""
        before = self.primary_port()
        with _client(self.sentinel_ports[0]) as sentinel:
            sentinel.execute_command("SENTINEL", "FAILOVER", MASTER)
        self._wait(lambda: self.primary_port() != before, "the Sentinels to name a new primary")
        after = self.primary_port()

        def takes_writes() -> bool:
            with _client(after) as new:
                return bool(new.info("replication")["role"] == "master")

        self._wait(takes_writes, "the new primary to take writes")
        return after

    def _linked(self) -> bool:
        with _client(self.server_ports[1]) as replica:
            return bool(replica.info("replication").get("master_link_status") == "up")

    def _replica_known(self) -> bool:
        for port in self.sentinel_ports:
            with _client(port) as sentinel:
                replicas = sentinel.execute_command("SENTINEL", "REPLICAS", MASTER)
                if not replicas:
                    return False
        return True

    @staticmethod
    def _wait(condition, what: str, timeout_sec: float = 30) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_sec
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError, OSError):
                if condition():
                    return
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_sec} s waiting for {what}")

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()

    def __enter__(self) -> SentinelGroup:
        try:
            return self.start()
        except BaseException:
            self.stop()  # the servers started before the failure
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
