"""Errors are classified once (design section 8): what a later try can get past is
transient, the rest permanent. The replies here are the real servers' own."""

from __future__ import annotations

import pytest
import redis
import redis.exceptions

from anarchon.clients import ServerReplyError, TransportError, is_transient, open_connection
from anarchon.clients.redis_py import redis_errors
from tests.clients import CLIENT_KINDS, Target, make_client
from tests.faults import busy, oom, read_only
from tests.servers import ServerSpec

pytestmark = [pytest.mark.anyio, pytest.mark.server_tier]

WRITING_SCRIPT = "return redis.call('SET', KEYS[1], '1')"


async def reply_error(url: str, command: tuple[str | int, ...]) -> ServerReplyError:
    conn = open_connection(url)
    try:
        (reply,) = await conn.pipeline([command])
    finally:
        await conn.aclose()
    assert isinstance(reply, ServerReplyError), reply
    return reply


CLIENT_CASES = [(loop, kind) for kind, (loops, _) in CLIENT_KINDS.items() for loop in loops]


@pytest.mark.parametrize(
    ("anyio_backend", "kind"), CLIENT_CASES, ids=[f"{k}-{loop}" for loop, k in CLIENT_CASES]
)
async def test_every_client_keeps_the_code_of_an_error_reply(
    server: ServerSpec, server_url: str, direct: redis.Redis, prefix: str, kind: str
) -> None:
    """Each client library words the same reply its own way (redis-py strips the code
    and names a class, GLIDE writes "OOM: ..." or "... - ReadOnly: ..."): each adapter
    gives back the server's code, so that OOM, READONLY, BUSY and NOSCRIPT are retried
    and a wrong type, an unknown command or a permission refused are not, whichever
    client the user passed (none of them is a lost reply)."""
    # GLIDE speaks RESP2 to a server without HELLO (Redis 5), as its users must set it.
    resp3 = server.family != "redis" or server.version >= (6,)
    client, close = await make_client(kind, Target(url=server_url), resp3=resp3)
    conn = open_connection(client)
    script = ("EVAL", WRITING_SCRIPT, 1, f"{prefix}k")
    direct.set(f"{prefix}s", "a string")
    seen: dict[str, tuple[str, bool]] = {}

    async def code_of(name: str, command: tuple[str | int, ...]) -> None:
        (reply,) = await conn.pipeline([command])
        assert isinstance(reply, ServerReplyError), (name, reply)
        seen[name] = (reply.kind, is_transient(reply))

    acls = server.family != "redis" or server.version >= (6,)  # ACLs came with Redis 6
    expected = {
        "OOM": ("OOM", True),
        "READONLY": ("READONLY", True),
        "BUSY": ("BUSY", True),
        "WRONGTYPE": ("WRONGTYPE", False),
        "NOSCRIPT": ("NOSCRIPT", True),  # the script is sent again with its text
        "unknown command": ("ERR", False),
    }
    try:
        with oom(direct):
            await code_of("OOM", script)
        with read_only(direct):
            await code_of("READONLY", script)
        with busy(server_url):
            await code_of("BUSY", ("GET", f"{prefix}k"))
        await code_of("WRONGTYPE", ("HGET", f"{prefix}s", "field"))
        await code_of("NOSCRIPT", ("EVALSHA", "0" * 40, 0))
        await code_of("unknown command", ("NOSUCHCOMMAND",))
        if acls:
            # For a moment nobody may GET (this worker's tests run one at a time).
            direct.execute_command("ACL", "SETUSER", "default", "-get")  # type: ignore[no-untyped-call]
            await code_of("NOPERM", ("GET", f"{prefix}k"))
            expected["NOPERM"] = ("NOPERM", False)
    finally:
        if acls:
            direct.execute_command("ACL", "SETUSER", "default", "+get")  # type: ignore[no-untyped-call]
        await conn.aclose()
        await close()
    assert seen == expected


async def test_a_script_refused_for_lack_of_memory_is_transient(
    server_url: str, direct: redis.Redis, prefix: str
) -> None:
    with oom(direct):
        error = await reply_error(server_url, ("EVAL", WRITING_SCRIPT, 1, f"{prefix}k"))
    assert error.kind == "OOM" and is_transient(error), error


async def test_a_script_refused_on_a_read_only_replica_is_transient(
    server_url: str, direct: redis.Redis, prefix: str
) -> None:
    with read_only(direct):
        error = await reply_error(server_url, ("EVAL", WRITING_SCRIPT, 1, f"{prefix}k"))
    assert error.kind == "READONLY" and is_transient(error), error


async def test_a_server_busy_with_a_script_is_transient(server_url: str) -> None:
    with busy(server_url):
        error = await reply_error(server_url, ("GET", "k"))
    assert error.kind == "BUSY" and is_transient(error), error


async def test_a_wrong_type_is_permanent(server_url: str, direct: redis.Redis, prefix: str) -> None:
    direct.set(f"{prefix}k", "a string")
    error = await reply_error(server_url, ("HGET", f"{prefix}k", "field"))
    assert error.kind == "WRONGTYPE" and not is_transient(error), error


async def test_an_unknown_command_is_permanent(server_url: str) -> None:
    error = await reply_error(server_url, ("NOSUCHCOMMAND",))
    assert not is_transient(error), error


def test_redis_py_cluster_errors_keep_their_codes_and_are_transient() -> None:
    """redis-py turns cluster replies into classes and drops the code from the message
    (and SlotNotCoveredError is not even a RedisError): the adapter restores the code."""
    errors = redis_errors()
    for exc, kind in [
        (redis.exceptions.ClusterDownError("The cluster is down"), "CLUSTERDOWN"),
        (redis.exceptions.TryAgainError("Multiple keys request during rehashing"), "TRYAGAIN"),
        (redis.exceptions.BusyLoadingError("Redis is loading the dataset"), "LOADING"),
    ]:
        converted = errors.convert(exc)
        assert isinstance(converted, ServerReplyError) and converted.kind == kind
        assert is_transient(converted)
    uncovered = errors.convert(redis.exceptions.SlotNotCoveredError("slot 5 not covered"))
    assert isinstance(uncovered, TransportError) and is_transient(uncovered)
    # Redirections that did not settle: no answer (it was read as a permanent "TTL").
    unsettled = errors.convert(redis.exceptions.ClusterError("TTL exhausted."))
    assert isinstance(unsettled, TransportError) and is_transient(unsettled)


@pytest.mark.parametrize(
    ("text", "reads_as"),
    [
        # The server's replies, as GLIDE words them.
        ("OOM: command not allowed when used memory > 'maxmemory'.", "OOM"),
        ("An error was signalled by the server: - ReadOnly: You can't write", "READONLY"),
        ("An error was signalled by the server: - PermissionDenied: User u has no", "NOPERM"),
        ("An error was signalled by the server: - ResponseError: unknown command", "ERR"),
        # GLIDE's own failures to get a reply: no answer.
        ("BrokenPipe: Cluster: Failed to receive command response from internal sender. "
         "RecvError(())", "transport"),
        ("Connection dropped- ClientError", "transport"),
        ("Failed to send the request - FatalSendError: the pipeline writer task has "
         "terminated", "transport"),
    ],
)  # fmt: skip
def test_glide_s_wording_tells_a_server_s_error_reply_from_its_own_failure(
    text: str, reads_as: str
) -> None:
    """The texts GLIDE gives a RequestError: the replies' codes, as the real-server test
    above sees them through GLIDE, and GLIDE's own failures (the first one met when a
    cluster node's connection was cut mid-read, in tests/test_clients.py), which were
    read as permanent error replies."""
    from anarchon.clients.glide import _reply_error

    error = _reply_error(text)
    if reads_as == "transport":
        assert isinstance(error, TransportError) and is_transient(error), error
    else:
        assert isinstance(error, ServerReplyError) and error.kind == reads_as, error


def test_a_group_of_errors_is_transient_when_any_of_them_is() -> None:
    group = ExceptionGroup("batch", [ServerReplyError("WRONGTYPE x"), TransportError("reset")])
    assert is_transient(group)
    assert not is_transient(ExceptionGroup("batch", [ServerReplyError("WRONGTYPE x")]))
