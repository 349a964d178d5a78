"""``python manage.py runscheduler``: run the project's anarchon jobs until SIGINT or
SIGTERM (a graceful stop), as ``anarchon run`` does."""

from functools import partial
from typing import Any

import anyio
from django.core.management.base import BaseCommand, CommandParser

import anarchon
from jobs.scheduler import scheduler


class Command(BaseCommand):
    help = "Run the anarchon scheduler of this project until SIGINT or SIGTERM."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--health-port", type=int, help="answer GET /live and /ready here")
        parser.add_argument(
            "--health-host",
            default="127.0.0.1",
            help="the address of the health port (Kubernetes' httpGet probes: 0.0.0.0)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        serve = partial(
            anarchon.serve,
            scheduler,
            health_port=options["health_port"],
            health_host=options["health_host"],
        )
        anyio.run(serve)
