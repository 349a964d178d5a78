"""The project's scheduler and its jobs (``python manage.py runscheduler`` runs them)."""

import logging

from django.conf import settings
from django.contrib.sessions.models import Session
from django.db import close_old_connections
from django.utils import timezone

from anarchon import RedisBackend, Run, Scheduler

log = logging.getLogger(__name__)

scheduler = Scheduler(
    RedisBackend(redis=settings.ANARCHON_REDIS_URL, prefix=settings.ANARCHON_PREFIX),
    stop_grace_ms=20_000,
)


@scheduler.job("* * * * * *")  # every second, to watch it work; hourly is "0 * * * *"
def clear_sessions(run: Run) -> None:
    # A plain function: it runs in a worker thread, where Django's ORM may be used.
    close_old_connections()  # what Django does around each request, for the same reason
    try:
        deleted, _ = Session.objects.filter(expire_date__lt=timezone.now()).delete()
        log.info(
            "clear_sessions %s: %d expired session(s) deleted", f"{run.slot:%H:%M:%S}", deleted
        )
    finally:
        close_old_connections()
