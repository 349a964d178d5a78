"""A Flask app that sets durable timers from its views; examples/reminders.py fires them.
Run both, then set a reminder:

    REDIS_URL=redis://localhost:6379 flask --app examples.flask_app run
    REDIS_URL=redis://localhost:6379 anarchon run examples.reminders:scheduler

    curl -X POST 'localhost:5000/remind/ada?in_seconds=5'
"""

import atexit
import os
import threading
from contextlib import ExitStack
from functools import partial
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal
from flask import Flask, request

from anarchon import RedisBackend, Timers


class BlockingTimers:
    """anarchon's ``Timers`` for synchronous code: each process opens one connection on
    first use, held by an event loop in a thread of its own; any thread may call it."""

    def __init__(self, backend: RedisBackend[Any]) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._opened: tuple[int, BlockingPortal, Timers, ExitStack] | None = None
        atexit.register(self.close)

    def set(self, kind: str, key: str, **options: Any) -> int:
        portal, timers = self._open()
        return portal.call(partial(timers.set, kind, key, **options))

    def cancel(self, kind: str, key: str) -> bool:
        portal, timers = self._open()
        return portal.call(timers.cancel, kind, key)

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, None
            if opened is not None and opened[0] == os.getpid():
                opened[3].close()

    def _open(self) -> tuple[BlockingPortal, Timers]:
        with self._lock:
            # Each process opens its own: gunicorn --preload imports the app in its master
            # process, which sets no timer, and each worker it forks opens one here.
            if self._opened is None or self._opened[0] != os.getpid():
                with ExitStack() as stack:  # closes what was opened if the rest fails
                    portal = stack.enter_context(start_blocking_portal())
                    timers = Timers(self._backend)
                    stack.enter_context(portal.wrap_async_context_manager(timers))
                    self._opened = (os.getpid(), portal, timers, stack.pop_all())
            _, portal, timers, _ = self._opened
            return portal, timers


timers = BlockingTimers(
    RedisBackend(
        redis=os.environ.get("REDIS_URL", "redis://localhost:6379"),
        prefix=os.environ.get("ANARCHON_PREFIX", "reminders:"),  # the prefix of reminders.py
    )
)
app = Flask(__name__)


@app.post("/remind/<user>")
def remind(user: str) -> dict[str, object]:
    delay = request.args.get("in_seconds", 30 * 60, type=int)
    generation = timers.set(
        "remind", f"user:{user}", delay_ms=delay * 1000, payload={"text": "your cart misses you"}
    )
    return {"user": user, "generation": generation}


@app.delete("/remind/<user>")
def forget(user: str) -> dict[str, object]:
    return {"user": user, "cancelled": timers.cancel("remind", f"user:{user}")}
