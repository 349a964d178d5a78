"""Strategy settings that the types refuse (and the backends refuse at run time)."""

from anarchon import RedisBackend, ValkeyBackend

RedisBackend(strategy={"name": "lease", "window_ms": 1})  # type: ignore[call-overload]  # pyright: ignore[reportCallIssue, reportArgumentType]
RedisBackend(strategy={"name": "stream-id", "duration_sec": 5})  # type: ignore[call-overload]  # pyright: ignore[reportCallIssue, reportArgumentType]
RedisBackend(strategy={"name": "idmp", "window_ms": 1})  # type: ignore[call-overload]  # pyright: ignore[reportCallIssue, reportArgumentType]
RedisBackend(strategy={"name": "idmp", "duration_sec": "300"})  # type: ignore[call-overload]  # pyright: ignore[reportCallIssue, reportArgumentType]
RedisBackend(strategy="round-robin")  # type: ignore[call-overload]  # pyright: ignore[reportCallIssue, reportArgumentType]
ValkeyBackend(strategy="idmp")  # type: ignore[call-overload]  # pyright: ignore[reportCallIssue, reportArgumentType]
ValkeyBackend(strategy={"name": "idmp"})  # type: ignore[call-overload]  # pyright: ignore[reportCallIssue, reportArgumentType]
