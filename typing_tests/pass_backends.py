"""What the types accept: every strategy where it is offered, with its settings."""

from typing import assert_type

from anarchon import ClaimOnly, Leases, RedisBackend, Scheduler, ValkeyBackend

assert_type(RedisBackend(), RedisBackend[Leases])
assert_type(RedisBackend(redis="redis://localhost:6379", prefix="billing:"), RedisBackend[Leases])
assert_type(RedisBackend(strategy={"name": "lease"}), RedisBackend[Leases])
assert_type(RedisBackend(strategy="stream-id"), RedisBackend[ClaimOnly])
assert_type(RedisBackend(strategy="idmp"), RedisBackend[ClaimOnly])
assert_type(
    RedisBackend(strategy={"name": "idmp", "duration_sec": 900, "max_size": 5_000}),
    RedisBackend[ClaimOnly],
)
assert_type(
    RedisBackend(strategy={"name": "script", "window_ms": 600_000}), RedisBackend[ClaimOnly]
)
assert_type(ValkeyBackend(valkey={"host": "localhost", "port": 6390}), ValkeyBackend[Leases])
assert_type(ValkeyBackend(strategy={"name": "script"}), ValkeyBackend[ClaimOnly])
assert_type(ValkeyBackend(strategy="stream-id"), ValkeyBackend[ClaimOnly])

assert_type(Scheduler(), Scheduler[Leases])
assert_type(Scheduler(RedisBackend(), lease_ms=20_000, heartbeat_ms=5_000), Scheduler[Leases])
assert_type(Scheduler(ValkeyBackend(strategy="script")), Scheduler[ClaimOnly])
assert_type(Scheduler(RedisBackend(strategy="idmp"), history_size=100), Scheduler[ClaimOnly])
