"""What a user installs: the wheel carries the Lua scripts and the type marker; the CLI runs."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_ships_the_lua_scripts_and_py_typed(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("anarchon-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for script in sorted((ROOT / "lua").glob("*.lua")):
        assert f"anarchon/lua/{script.name}" in names
        shipped = zipfile.ZipFile(wheel).read(f"anarchon/lua/{script.name}")
        assert shipped == script.read_bytes()
    assert "anarchon/py.typed" in names
    assert "anarchon/clients/__init__.py" in names


@pytest.mark.slow
def test_the_demo_runs_every_slot_once_on_an_embedded_valkey() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "anarchon", "demo", "--seconds", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    assert summary.startswith("summary: slots=")
    assert "duplicates=0 misses=0" in summary
    assert "ran on instance-" in done.stdout
