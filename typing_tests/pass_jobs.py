"""Job options: the lease ones with the lease strategy, the common ones everywhere."""

from anarchon import RedisBackend, Run, Scheduler

leased = Scheduler(RedisBackend())
claim_only = Scheduler(RedisBackend(strategy="stream-id"))


@leased.job("*/5 * * * *", max_attempts=3, overlap=False, catch_up_ms=600_000, jitter_ms=500)
async def sync(run: Run) -> None: ...


@leased.job(every_ms=10_000, name="poll", max_late_ms=5_000)
def poll() -> None: ...


@claim_only.job("0 3 * * *", timezone="Europe/Athens", jitter_ms=1_000, max_late_ms=30_000)
async def report(run: Run) -> None: ...


claim_only.add_job(poll, every_ms=60_000, name="poll")
leased.add_job(report, "0 4 * * *", name="report", max_attempts=5)


@leased.job("* * * * *", name="exclusive", overlap="wait")
async def exclusive(run: Run) -> None:
    run.raise_if_lost()


leased.add_job(poll, every_ms=5_000, name="side-by-side", overlap="allow")


@leased.job("*/5 * * * *", timeout_ms=60_000, retry_delay_ms=5_000, retry_on=(ConnectionError,))
async def bounded(run: Run) -> None: ...


claim_only.add_job(poll, every_ms=60_000, name="bounded-poll", timeout_ms=10_000)
leased.add_job(poll, every_ms=60_000, name="narrow", retry_on=TimeoutError)


@leased.timer("remind", max_attempts=5, retry_delay_ms=2_000, buckets=3)
async def remind() -> None: ...


leased.add_timer(poll, "digest", buckets=1)
