"""Every client, standalone and cluster, under every event loop it supports."""

from __future__ import annotations

import itertools
import math
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
import redis
from redis.crc import key_slot

from anarchon import (
    ConnectionFailedError,
    Inspector,
    RedisBackend,
    Run,
    Scheduler,
    TimerRun,
    UnsupportedClientError,
    serve,
)
from anarchon._ops.embedded import CLUSTER_BUS_OFFSET, EmbeddedServer, free_port
from anarchon._store.keys import TimerKeys
from anarchon.clients import TransportError, open_connection
from tests.clients import CLIENT_KINDS, Target, make_client
from tests.faults import FaultProxy
from tests.helpers import Ledger, OneShotAtFirstAsk, PinnedConnection, wait_until
from tests.servers import (
    MATRIX_FIRST,
    ServerSpec,
    cluster_matrix,
    running_cluster,
    running_proxied_cluster,
    running_server,
)

pytestmark = [pytest.mark.anyio, pytest.mark.server_tier]

STANDALONE_CASES = [(loop, kind) for kind, (loops, _) in CLIENT_KINDS.items() for loop in loops]
CLUSTER_CASES = [
    (loop, kind)
    for kind, (loops, on_cluster) in CLIENT_KINDS.items()
    if on_cluster
    for loop in loops
]
CLUSTERS = cluster_matrix()


def case_id(case: tuple[str, str]) -> str:
    return f"{case[1]}-{case[0]}"


@pytest.fixture
def standalone() -> Target:
    return Target(url=running_server(MATRIX_FIRST))


@pytest.fixture
def cluster() -> Target:
    """The cluster of the first cluster binary (every binary: see the last cluster test)."""
    return Target(cluster_ports=running_cluster(CLUSTERS[0]))


def ledger_client(target: Target) -> redis.Redis | redis.RedisCluster:
    if target.cluster_ports:
        return redis.RedisCluster(host="127.0.0.1", port=target.port, decode_responses=True)
    assert target.url is not None
    return redis.Redis.from_url(target.url, decode_responses=True, protocol=2)


def spread_job_names(prefix: str, count: int) -> list[str]:
    """Job names whose hash tags land on all three primaries (slot ranges of the fixture)."""
    names: list[str] = []
    per_node = [0, 0, 0]
    index = 0
    while len(names) < count:
        name = f"job{index:03d}"
        node = min(key_slot(f"{prefix}{name}".encode()) // 5462, 2)
        if per_node[node] < math.ceil(count / 3):
            per_node[node] += 1
            names.append(name)
        index += 1
    return names


async def run_exactly_once(
    target: Target,
    kinds: list[str],
    strategy: str,
    prefix: str,
    seconds: float = 6,
    resp3: bool = True,
) -> None:
    """Five instances (clients of ``kinds``, in turn) x 20 jobs every second: each slot
    once. 6 s (about 100 slots, spread over a cluster's three primaries) per client and
    server: what a client's replies can get wrong shows in the first slots, and
    tests/test_exactly_once.py holds a fleet for longer."""
    direct = ledger_client(target)
    ledger = Ledger(direct, prefix)
    names = spread_job_names(prefix, 20)
    async with AsyncExitStack() as stack:
        schedulers = []
        for index in range(5):
            client, close = await make_client(kinds[index % len(kinds)], target, resp3=resp3)
            stack.push_async_callback(close)
            backend: Any = RedisBackend(redis=client, prefix=prefix, strategy=strategy)  # type: ignore[call-overload]
            scheduler: Scheduler[Any] = Scheduler(backend, instance_id=f"i{index}")
            for name in names:

                async def handler(run: Run) -> None:
                    await ledger.record(run)

                scheduler.add_job(handler, "* * * * * *", name=name)
            ledger.watch(scheduler)
            schedulers.append(scheduler)
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        started_ms = time.time() * 1000
        await anyio.sleep(seconds)
        stopping_ms = time.time() * 1000
    try:
        expected = ledger.assert_each_slot_ran_once(names, started_ms, stopping_ms)
    finally:
        direct.close()
    assert expected >= 20 * (seconds - 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("anyio_backend", "kind"), STANDALONE_CASES, ids=map(case_id, STANDALONE_CASES)
)
async def test_exactly_once_with_each_client_on_each_standalone_server(
    server: ServerSpec, server_url: str, prefix: str, kind: str
) -> None:
    """Every client on every server of the run's matrix (all of them in CI), with the
    default strategy. GLIDE speaks RESP2 to a server without HELLO (Redis 5), as its
    users must configure it there."""
    resp3 = server.family != "redis" or server.version >= (6,)
    await run_exactly_once(Target(url=server_url), [kind], "lease", prefix, resp3=resp3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("anyio_backend", "kind"), STANDALONE_CASES, ids=map(case_id, STANDALONE_CASES)
)
async def test_exactly_once_with_each_client_and_the_script_strategy_on_the_first_server(
    standalone: Target, prefix: str, kind: str
) -> None:
    """The script strategy's replies through every client, on the matrix's first server
    (tests/test_exactly_once.py runs each strategy through the URL client)."""
    await run_exactly_once(standalone, [kind], "script", prefix)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["lease", "script"])
@pytest.mark.parametrize(("anyio_backend", "kind"), CLUSTER_CASES, ids=map(case_id, CLUSTER_CASES))
async def test_exactly_once_with_each_client_on_a_cluster(
    cluster: Target, prefix: str, kind: str, strategy: str
) -> None:
    await run_exactly_once(cluster, [kind], strategy, prefix)


PY_CLUSTER_CASES = [case for case in CLUSTER_CASES if case[1].endswith(("py-async", "py-sync"))]


@pytest.mark.parametrize(
    ("anyio_backend", "kind"), PY_CLUSTER_CASES, ids=map(case_id, PY_CLUSTER_CASES)
)
async def test_a_cluster_client_of_redis_py_or_valkey_py_turns_hints_off_once_with_why(
    cluster: Target, prefix: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A cluster client cannot hold a subscription of its own: the instance says once, at
    INFO, that hints are off and why, and polls; it does not warn of an outage and retry
    it for good (the asyncio cluster client has no connection pool to copy)."""
    client, close = await make_client(kind, cluster)
    try:
        scheduler: Scheduler[Any] = Scheduler(
            RedisBackend(redis=client, prefix=prefix), instance_id="one"
        )
        scheduler.add_job(lambda: None, "0 0 1 1 *", name="rare")
        with caplog.at_level("INFO", logger="anarchon"):
            async with scheduler:
                await wait_until(
                    lambda: any("hints" in r.getMessage() for r in caplog.records),
                    10,
                    "the instance to say whether it has hints",
                )
                await anyio.sleep(0.5)  # a retry would come within this
        said = [r.getMessage() for r in caplog.records if "hints" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("hints are off"), said
        assert "subscribing on a cluster" in said[0], said
    finally:
        await close()


@pytest.mark.slow
@pytest.mark.parametrize(("anyio_backend", "kind"), CLUSTER_CASES, ids=map(case_id, CLUSTER_CASES))
async def test_the_inspector_reads_jobs_leases_and_histories_spread_over_a_cluster(
    cluster: Target, prefix: str, kind: str
) -> None:
    """The Inspector reads many jobs a few round trips at a time, each round trip with
    keys of every primary: through each client, it reads every job, the run in
    progress of one job on each primary, and each other job's history, each result
    with its own job's error."""
    names = spread_job_names(prefix, 12)
    on_node = {min(key_slot(f"{prefix}{name}".encode()) // 5462, 2): name for name in names}
    held = set(on_node.values())
    assert len(held) == 3
    release = anyio.Event()
    client, close = await make_client(kind, cluster)
    try:
        backend: Any = RedisBackend(redis=client, prefix=prefix)
        scheduler: Scheduler[Any] = Scheduler(backend, instance_id="one", stop_grace_ms=200)
        for name in names:

            async def handler(run: Run) -> None:
                if run.job in held:
                    await release.wait()
                else:
                    raise RuntimeError(f"{run.job} failed")

            scheduler.add_job(handler, "* * * * * *", name=name, max_attempts=1)
        async with scheduler, Inspector(backend) as inspector:
            with anyio.fail_after(30):
                while True:
                    jobs = [job.name for job in await inspector.jobs()]
                    running = {lease.job for lease in await inspector.leases()}
                    recent = await inspector.recent(5)
                    failed = {name for name, results in recent.items() if results}
                    if running >= held and failed >= set(names) - held:
                        break
                    await anyio.sleep(0.2)
            assert jobs == sorted(names)
            assert sorted(recent) == sorted(names)
            for name in set(names) - held:
                assert {r.error for r in recent[name]} == {f"RuntimeError: {name} failed"}, recent[
                    name
                ]
            release.set()
    finally:
        release.set()
        await close()


@pytest.fixture
def proxied_cluster() -> tuple[Target, FaultProxy]:
    """A cluster of the first cluster binary whose third primary (slots 10923 to 16383)
    clients reach through a fault proxy."""
    ports, proxy = running_proxied_cluster(CLUSTERS[0])
    return Target(cluster_ports=ports), proxy


def names_on_the_proxied_node(prefix: str, count: int) -> list[str]:
    names = (f"job{index:03d}" for index in itertools.count())
    on_it = (name for name in names if key_slot(f"{prefix}{name}".encode()) >= 10923)
    return list(itertools.islice(on_it, count))


@pytest.mark.parametrize(("anyio_backend", "kind"), CLUSTER_CASES, ids=map(case_id, CLUSTER_CASES))
async def test_replies_a_cluster_node_lost_make_the_round_trip_fail_not_answers(
    proxied_cluster: tuple[Target, FaultProxy], prefix: str, kind: str
) -> None:
    """A round trip over the three primaries, the third one's connection cut after it
    took its commands: the round trip fails with a transport error, as a standalone
    server's does, and its caller tries it again. No lost reply comes back as if it were
    the command's answer: redis-py's cluster pipeline hands each one back as a
    connection error in the command's place, and GLIDE as an error reply
    ("BrokenPipe: ..."), which the engine took for the server's answers (a claim's reply
    read as a TypeError, a finish refused by the server). A client that got every reply
    on a new connection may return them."""
    target, proxy = proxied_cluster
    client, close = await make_client(kind, target)
    try:
        conn = await RedisBackend(redis=client, prefix=prefix).open_connection()
        keys = [f"{prefix}{name}" for name in spread_job_names(prefix, 9)]
        await conn.pipeline([("SET", key, key) for key in keys])
        dropped = proxy.bytes_dropped
        proxy.drop_after_request(1)
        try:
            replies = await conn.pipeline([("GET", key) for key in keys])
        except TransportError:
            pass
        else:
            assert replies == keys, [type(reply).__name__ for reply in replies]
        assert proxy.bytes_dropped > dropped, "no reply was lost: the test did not cut"
        # Whole again, once the client has its new connection (a client may make it in
        # the background: a round trip before that fails as the one above, and is tried
        # again, as the engine does).
        with anyio.fail_after(10):
            while True:
                try:
                    replies = await conn.pipeline([("GET", key) for key in keys])
                    break
                except TransportError:
                    await anyio.sleep(0.1)
        assert replies == keys
    finally:
        proxy.drop_after_request(0)
        await close()


def cut_later(proxy: FaultProxy, after_sec: float) -> None:
    """Hold what goes through ``proxy`` from now on, and cut it all ``after_sec`` later
    (the held commands never reach the server); then let new connections through."""
    proxy.pause()

    def cut() -> None:
        proxy.reset()
        proxy.resume()

    threading.Timer(after_sec, cut).start()


@pytest.mark.parametrize("fault", ["cut before the node took it", "reply lost"])
@pytest.mark.parametrize("kind", ["redis-py-async", "glide-async"])
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_finish_a_cluster_node_did_not_answer_is_sent_again_and_recorded_once(
    proxied_cluster: tuple[Target, FaultProxy], prefix: str, kind: str, fault: str
) -> None:
    """A run on the proxied primary ends as that node's connection fails: its finish is
    cut before the node took it, or taken and its reply lost. It is sent again and the
    run is recorded once, ok; its lease does not expire unsettled for the next slots'
    claims to take it over and run it a second time."""
    target, proxy = proxied_cluster
    (name,) = names_on_the_proxied_node(prefix, 1)
    client, close = await make_client(kind, target)
    runs: list[int] = []
    try:
        # A lease of 3 s: a client's reconnection and the finish's retries fit in it
        # on a loaded machine.
        scheduler = Scheduler(
            RedisBackend(redis=client, prefix=prefix), lease_ms=3000, heartbeat_ms=1000
        )
        dropped = proxy.bytes_dropped

        @scheduler.job(every_ms=1000, name=name)
        async def tick(run: Run) -> None:
            runs.append(run.slot_ms)
            if len(runs) > 1:
                return
            if fault == "reply lost":
                proxy.drop_after_request(1)  # the next request to that node is the finish
            else:
                cut_later(proxy, 0.3)

        async with scheduler:
            await wait_until(lambda: bool(runs), 5, "a first run")
            await anyio.sleep(3.0 + 2.0)  # the lease, and the next slots' claims
            history = await scheduler.history(name, limit=100)
    finally:
        proxy.drop_after_request(0)
        await close()
    if fault == "reply lost":
        assert proxy.bytes_dropped > dropped, "no reply was lost: the test did not cut"
    slot = runs[0]
    assert runs.count(slot) == 1, f"slot {slot} ran {runs.count(slot)} times"
    assert [(r.attempt, r.status) for r in history if r.slot_ms == slot] == [(1, "ok")]


@pytest.mark.slow
@pytest.mark.parametrize("spec", CLUSTERS, ids=[s.id for s in CLUSTERS])
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_exactly_once_on_the_cluster_of_each_server(spec: ServerSpec, prefix: str) -> None:
    await run_exactly_once(
        Target(cluster_ports=running_cluster(spec)), ["glide-async"], "lease", prefix
    )


def test_a_cluster_node_gets_a_port_with_room_for_its_bus_port() -> None:
    """A cluster node refuses a port above 55535 (its peers reach it on the port + 10000),
    so the harness's cluster nodes take a port whose bus port exists and is free."""
    for _ in range(300):
        port = free_port(with_bus_port=True)
        assert port <= 65535 - CLUSTER_BUS_OFFSET
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))  # free, or this raises


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_instances_with_different_clients_run_each_slot_once(
    standalone: Target, prefix: str
) -> None:
    await run_exactly_once(
        standalone, ["redis-py-async", "glide-async", "valkey-py-sync"], "lease", prefix
    )


async def flush_scripts(target: Target) -> None:
    ports = target.cluster_ports or [target.port]
    for port in ports:
        client = redis.Redis(port=port, protocol=2)
        client.script_flush()
        client.close()


FLUSH_CASES = [(loop, kind, "standalone") for loop, kind in STANDALONE_CASES] + [
    (loop, kind, "cluster") for loop, kind in CLUSTER_CASES
]


@pytest.mark.parametrize(
    ("anyio_backend", "kind", "topology"), FLUSH_CASES, ids=["-".join(c) for c in FLUSH_CASES]
)
async def test_nothing_is_missed_after_script_flush(
    request: pytest.FixtureRequest, prefix: str, kind: str, topology: str
) -> None:
    target: Target = request.getfixturevalue(topology)
    slots: list[int] = []
    client, close = await make_client(kind, target)
    try:
        scheduler = Scheduler(RedisBackend(redis=client, prefix=prefix))

        @scheduler.job("* * * * * *", name="tick")
        async def tick(run: Run) -> None:
            slots.append(run.slot_ms)

        async with scheduler:
            await wait_until(lambda: len(slots) >= 1, 5, "a first run")
            await flush_scripts(target)
            count = len(slots)
            await wait_until(lambda: len(slots) >= count + 2, 5, "runs after SCRIPT FLUSH")
    finally:
        await close()
    assert slots == list(range(slots[0], slots[0] + 1000 * len(slots), 1000))


@pytest.mark.parametrize("kind", ["redis-py-async", "valkey-py-async"])
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_an_asyncio_client_under_trio_fails_at_start_naming_what_works(
    standalone: Target, prefix: str, kind: str
) -> None:
    client, _ = await make_client(kind, standalone)  # never connects: nothing to close
    with pytest.raises(UnsupportedClientError, match="under trio pass") as info:
        async with Scheduler(RedisBackend(redis=client, prefix=prefix)):
            pass
    assert "GLIDE" in str(info.value)


# ------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, Path]]:
    """Debian's redis-server (built with TLS) with a throwaway CA; also a CA it does not know."""
    trustme = pytest.importorskip("trustme")
    binary = Path("/usr/bin/redis-server")
    if not binary.exists():
        pytest.skip("needs Debian's redis-server (TLS-enabled): .ci/install-servers installs it")
    folder = tmp_path_factory.mktemp("tls")
    ca, stranger = trustme.CA(), trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    # A certificate of the same CA for another name: host name checking must refuse it.
    elsewhere = ca.issue_cert("cache.elsewhere.example")
    elsewhere.cert_chain_pems[0].write_to_path(str(folder / "elsewhere.pem"))
    elsewhere.private_key_pem.write_to_path(str(folder / "elsewhere.key"))
    stranger.cert_pem.write_to_path(str(folder / "other-ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(folder / "server.pem"))
    cert.private_key_pem.write_to_path(str(folder / "server.key"))
    tls_port = free_port()
    server = EmbeddedServer(
        binary,
        ["--tls-port", str(tls_port), "--tls-cert-file", str(folder / "server.pem"),
         "--tls-key-file", str(folder / "server.key"), "--tls-ca-cert-file", str(folder / "ca.pem"),
         "--tls-auth-clients", "no"],
    ).start()  # fmt: skip
    misnamed_port = free_port()
    misnamed = EmbeddedServer(
        binary,
        ["--tls-port", str(misnamed_port), "--tls-cert-file", str(folder / "elsewhere.pem"),
         "--tls-key-file", str(folder / "elsewhere.key"),
         "--tls-ca-cert-file", str(folder / "ca.pem"), "--tls-auth-clients", "no"],
    ).start()  # fmt: skip
    global MISNAMED_TLS_PORT
    MISNAMED_TLS_PORT = misnamed_port
    yield tls_port, folder / "ca.pem", folder / "other-ca.pem"
    misnamed.stop()
    server.stop()


#: The TLS port of a server whose certificate (from the same CA) names another host.
MISNAMED_TLS_PORT = 0


async def test_tls_checks_the_servers_host_name_whatever_the_client_librarys_default(
    tls_server: tuple[int, Path, Path], prefix: str
) -> None:
    """A certificate from a trusted CA for another name is refused (redis-py 5.0 does not
    check names by default; anarchon asks for it on every connection it opens), with
    an error that says TLS; a user who must turn the check off says so."""
    _, ca, _ = tls_server
    url = f"rediss://127.0.0.1:{MISNAMED_TLS_PORT}/0?ssl_ca_certs={ca}"
    options = {"host": "127.0.0.1", "port": MISNAMED_TLS_PORT, "tls": True, "tls_ca_certs": str(ca)}
    for spec in (url, options):
        conn = open_connection(spec)
        try:
            pool = conn.client.connection_pool  # type: ignore[attr-defined]
            assert pool.connection_kwargs.get("ssl_check_hostname") is True, spec
        finally:
            await conn.aclose()
        with pytest.raises(ConnectionFailedError, match=r"(?i)certificate|tls"):
            await run_one(RedisBackend(redis=spec, prefix=prefix))
    unchecked_url = url + "&ssl_check_hostname=false"
    unchecked = {**options, "tls_check_hostname": False}
    for spec in (unchecked_url, unchecked):
        assert [r.job for r in await run_one(RedisBackend(redis=spec, prefix=prefix))] == ["once"]


async def test_a_certificate_refused_at_start_is_not_waited_for_as_a_server_that_is_down(
    tls_server: tuple[int, Path, Path], prefix: str
) -> None:
    """A certificate of an unknown CA, or for another host, cannot come right by waiting:
    ``serve`` raises at once, with what TLS said, instead of trying for its whole
    ``wait_for_server_sec``."""
    port, ca, other_ca = tls_server
    refused = (
        f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={other_ca}",
        f"rediss://127.0.0.1:{MISNAMED_TLS_PORT}/0?ssl_ca_certs={ca}",
    )
    for url in refused:
        scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis=url, prefix=prefix))
        scheduler.add_job(lambda: None, "0 0 1 1 *", name="rare")
        with anyio.fail_after(20), pytest.raises(ConnectionFailedError, match=r"(?i)certif"):
            await serve(scheduler, wait_for_server_sec=600, stop_signals=())


async def run_one(backend: RedisBackend[Any]) -> list[Run]:
    runs: list[Run] = []
    scheduler: Scheduler[Any] = Scheduler(backend)

    async def once(run: Run) -> None:
        runs.append(run)

    scheduler.add_job(once, OneShotAtFirstAsk(100), name="once")
    async with scheduler:
        await wait_until(lambda: bool(runs), 10, "the slot to run")
    return runs


async def test_rediss_with_the_servers_ca_runs_jobs(
    tls_server: tuple[int, Path, Path], prefix: str
) -> None:
    port, ca, _ = tls_server
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    assert [r.job for r in await run_one(RedisBackend(redis=url, prefix=prefix))] == ["once"]
    options = {"host": "127.0.0.1", "port": port, "tls": True, "tls_ca_certs": str(ca)}
    assert [r.job for r in await run_one(RedisBackend(redis=options, prefix=prefix))] == ["once"]


async def test_rediss_with_a_wrong_ca_fails_with_a_clear_error(
    tls_server: tuple[int, Path, Path], prefix: str
) -> None:
    port, _, wrong_ca = tls_server
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={wrong_ca}"
    with pytest.raises(ConnectionFailedError, match="TLS handshake failed") as info:
        await run_one(RedisBackend(redis=url, prefix=prefix))
    assert info.value.code == "ANARCHON_CONNECTION"


# ------------------------------------------------- connections anarchon opens


def client_ids(port: int) -> set[str]:
    """The ids of the server's clients, not counting the probe that asks."""
    probe = redis.Redis(port=port, protocol=2, decode_responses=True)
    try:
        own = str(probe.client_id())
        return {str(client["id"]) for client in probe.client_list()} - {own}
    finally:
        probe.close()


def sockets_to(port: int) -> set[tuple[int, Any]]:
    """This process's open sockets (file descriptor, local address) to loopback ``port``."""
    return {
        (c.fd, c.laddr)
        for c in psutil.Process().net_connections("tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    }


async def server_sees_no_new_client(port: int, before: set[str]) -> None:
    await wait_until(lambda: not client_ids(port) - before, 5, "the server to see the close")


async def test_a_unix_socket_url_works_and_is_closed_on_stop(tmp_path: Path, prefix: str) -> None:
    binary = MATRIX_FIRST.binary
    assert binary is not None
    socket_path = tmp_path / "server.sock"
    server = EmbeddedServer(binary, ["--unixsocket", str(socket_path), "--unixsocketperm", "700"])
    with server:
        before = client_ids(server.port)
        backend = RedisBackend(redis=f"unix://{socket_path}?db=0", prefix=prefix)
        assert [r.job for r in await run_one(backend)] == ["once"]
        await server_sees_no_new_client(server.port, before)


async def test_user_password_and_db_in_the_url_are_used(standalone: Target, prefix: str) -> None:
    if MATRIX_FIRST.family == "redis" and MATRIX_FIRST.version < (6, 0):
        pytest.skip("ACL users need Redis 6+ (the first server of this matrix is older)")
    admin = redis.Redis(port=standalone.port, protocol=2, decode_responses=True)
    user = f"u{prefix.strip(':')}"
    admin.execute_command("ACL", "SETUSER", user, "on", ">s3cret", "~*", "&*", "+@all")
    try:
        url = f"redis://{user}:s3cret@127.0.0.1:{standalone.port}/3"
        assert [r.job for r in await run_one(RedisBackend(redis=url, prefix=prefix))] == ["once"]
        in_db3 = redis.Redis(port=standalone.port, db=3, protocol=2, decode_responses=True)
        assert in_db3.get(f"{prefix}format") == "1"
        assert admin.get(f"{prefix}format") is None  # nothing in db 0
        in_db3.close()
        wrong = f"redis://{user}:wrong@127.0.0.1:{standalone.port}/3"
        with pytest.raises(ConnectionFailedError):
            await run_one(RedisBackend(redis=wrong, prefix=prefix))
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()


async def test_a_connection_anarchon_opened_is_closed_on_stop_and_a_passed_one_is_not(
    standalone: Target, prefix: str
) -> None:
    clients_before, sockets_before = client_ids(standalone.port), sockets_to(standalone.port)
    await run_one(RedisBackend(redis=standalone.url or "", prefix=prefix))
    # Closed before the stop returned (a socket of this process), then seen closed by
    # the server once it has read the close.
    left = sockets_to(standalone.port) - sockets_before
    assert not left, f"a connection anarchon opened outlived its stop: {left}"
    await server_sees_no_new_client(standalone.port, clients_before)
    passed = redis.Redis(port=standalone.port, protocol=2)
    pinned = PinnedConnection.of(passed)
    await run_one(RedisBackend(redis=passed, prefix=prefix))
    assert pinned.still_open(), "the passed client's connection was closed"
    passed.close()


async def fire_timers_through(target: Target, kind: str, prefix: str, buckets: int) -> None:
    """Timers set and fired through one client kind: 60 keys with binary payloads, two
    instances, each key once with its payload."""
    keys = [f"user:{n}" for n in range(60)]
    fired: list[tuple[str, object]] = []

    async def remind(fire: TimerRun) -> None:
        fired.append((fire.key, fire.payload))

    async with AsyncExitStack() as stack:
        schedulers = []
        for index in range(2):
            client, close = await make_client(kind, target)
            stack.push_async_callback(close)
            scheduler: Scheduler[Any] = Scheduler(
                RedisBackend(redis=client, prefix=prefix), instance_id=f"i{index}"
            )
            scheduler.add_timer(remind, "remind", buckets=buckets)
            schedulers.append(scheduler)
        for key in keys:
            payload = key.encode() + b"\xff"  # not UTF-8
            await schedulers[0].set_timer("remind", key, delay_ms=300, payload=payload)
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await wait_until(lambda: len(fired) >= len(keys), 15, "every timer to fire")
        await anyio.sleep(0.3)  # and none twice
    assert sorted(fired) == sorted((key, key.encode() + b"\xff") for key in keys)


@pytest.mark.parametrize(
    ("anyio_backend", "kind"), STANDALONE_CASES, ids=map(case_id, STANDALONE_CASES)
)
async def test_timers_fire_once_through_each_client(
    standalone: Target, prefix: str, kind: str
) -> None:
    await fire_timers_through(standalone, kind, prefix, buckets=1)


@pytest.mark.parametrize(("anyio_backend", "kind"), CLUSTER_CASES, ids=map(case_id, CLUSTER_CASES))
async def test_timers_in_three_buckets_fire_once_through_each_client_on_a_cluster(
    cluster: Target, prefix: str, kind: str
) -> None:
    await fire_timers_through(cluster, kind, prefix, buckets=3)


@pytest.mark.parametrize("buckets", [3, 6, 12])
@pytest.mark.parametrize("kind", ["remind", "digest", "cart-expiry"])
def test_a_kinds_buckets_spread_evenly_over_the_primaries_of_an_evenly_split_cluster(
    cluster: Target, prefix: str, kind: str, buckets: int
) -> None:
    """Each bucket's hash tag lies in the middle of its own equal part of the slot space,
    so a cluster whose primaries hold equal slot ranges (as `--cluster create` makes
    them) gets as many of a kind's buckets on each primary: 3 buckets on 3 primaries,
    one each. Where each key lies is the server's answer (CLUSTER KEYSLOT, CLUSTER
    SLOTS)."""
    node = redis.Redis(port=cluster.port, protocol=2, decode_responses=False)
    try:
        ranges = [
            (int(entry[0]), int(entry[1]), int(entry[2][1]))
            for entry in node.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
        ]
        owners = []
        for bucket in range(buckets):
            keys = TimerKeys.for_kind(prefix, kind, bucket, buckets)
            slots = {
                int(node.execute_command("CLUSTER", "KEYSLOT", key))  # type: ignore[no-untyped-call]
                for key in (keys.timers, keys.due, keys.meta, keys.claimed("token"))
            }
            (slot,) = slots  # one hash tag: one slot
            part = 16384 / buckets  # the middle half of the bucket's part
            assert bucket * part + part / 4 <= slot < (bucket + 1) * part - part / 4
            owners.append(next(port for low, high, port in ranges if low <= slot <= high))
    finally:
        node.close()
    per_primary = sorted(owners.count(port) for _, _, port in ranges)
    assert per_primary == [buckets // 3] * 3, (owners, ranges)


# ------------------------------------------------------------------ URL schemes


@pytest.mark.engine_tier
async def test_a_valkey_url_connects_as_a_redis_url(server_url: str, prefix: str) -> None:
    """redis-py knows no valkey:// (it raised ValueError at the first connection): a
    URL anarchon opens reads it as redis://, for Valkey and Redis alike."""
    url = "valkey://" + server_url.removeprefix("redis://")
    assert [r.job for r in await run_one(RedisBackend(redis=url, prefix=prefix))] == ["once"]


async def test_a_valkeys_url_connects_over_tls_as_a_rediss_url(
    tls_server: tuple[int, Path, Path], prefix: str
) -> None:
    port, ca, _ = tls_server
    url = f"valkeys://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    conn = open_connection(url)
    try:
        pool = conn.client.connection_pool  # type: ignore[attr-defined]
        assert pool.connection_kwargs.get("ssl_check_hostname") is True
    finally:
        await conn.aclose()
    assert [r.job for r in await run_one(RedisBackend(redis=url, prefix=prefix))] == ["once"]
