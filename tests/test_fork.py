"""A scheduler made before the process forks (``gunicorn --preload`` imports the app once,
in the master, and forks its workers): each child that starts it is an instance of its
own, with its own id, unless the application named the instance itself."""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.queues import Queue
from typing import Any

import anyio
import pytest

from anarchon import RedisBackend, Scheduler

pytestmark = [pytest.mark.engine_tier]


def _start_and_tell(scheduler: Scheduler[Any], told: Queue[tuple[int, str]]) -> None:
    async def main() -> None:
        async with scheduler:
            told.put((os.getpid(), scheduler.instance_id))

    anyio.run(main)


def _ids_in_children(scheduler: Scheduler[Any]) -> dict[int, str]:
    context = multiprocessing.get_context("fork")
    told: Queue[tuple[int, str]] = context.Queue()
    children = [context.Process(target=_start_and_tell, args=(scheduler, told)) for _ in "ab"]
    for child in children:
        child.start()
    try:
        return dict(told.get(timeout=60) for _ in children)
    finally:
        for child in children:
            child.join(30)
            assert child.exitcode == 0


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_each_child_of_a_fork_starts_with_a_default_id_of_its_own(
    server_url: str, prefix: str
) -> None:
    scheduler: Scheduler[Any] = Scheduler(RedisBackend(redis=server_url, prefix=prefix))
    scheduler.add_job(lambda: None, "0 0 1 1 *", name="rare")
    made_here = scheduler.instance_id
    ids = _ids_in_children(scheduler)
    assert len(set(ids.values())) == 2, ids
    for pid, instance_id in ids.items():
        assert instance_id != made_here and f":{pid}:" in instance_id, (made_here, ids)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_an_id_the_application_gave_is_kept_in_every_child(server_url: str, prefix: str) -> None:
    scheduler: Scheduler[Any] = Scheduler(
        RedisBackend(redis=server_url, prefix=prefix), instance_id="worker"
    )
    scheduler.add_job(lambda: None, "0 0 1 1 *", name="rare")
    assert set(_ids_in_children(scheduler).values()) == {"worker"}
