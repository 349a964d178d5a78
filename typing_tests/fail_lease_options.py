"""Lease options that a claim-only scheduler does not offer."""

from anarchon import RedisBackend, Run, Scheduler

claim_only = Scheduler(RedisBackend(strategy="script"))
Scheduler(RedisBackend(strategy="stream-id"), lease_ms=10_000)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
Scheduler(RedisBackend(strategy="idmp"), heartbeat_ms=1_000)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


async def handler(run: Run) -> None: ...


claim_only.job("* * * * *", overlap=True)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
claim_only.job("* * * * *", max_attempts=2)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
claim_only.add_job(handler, "* * * * *", catch_up_ms=60_000)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
claim_only.job("* * * * *", retry_on=ValueError)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
claim_only.add_job(handler, "* * * * *", retry_delay_ms=500)  # type: ignore[call-arg]  # pyright: ignore[reportCallIssue]
