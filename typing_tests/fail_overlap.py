"""overlap= takes a policy name (or True/False), nothing else."""

from anarchon import RedisBackend, Scheduler

leased = Scheduler(RedisBackend())
leased.job("* * * * *", overlap="sometimes")  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]
