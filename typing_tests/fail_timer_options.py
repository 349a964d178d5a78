"""Timer kinds: a misspelt option, and timers on a claim-only scheduler."""

from anarchon import RedisBackend, Scheduler

leased = Scheduler(RedisBackend())
claim_only = Scheduler(RedisBackend(strategy="stream-id"))


def remind() -> None: ...


leased.add_timer(remind, "remind", max_attempt=5)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
leased.add_timer(remind, "remind", buckets="3")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
claim_only.add_timer(remind, "remind")  # type: ignore[misc]  # pyright: ignore[reportAttributeAccessIssue]
