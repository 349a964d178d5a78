"""A scheduler that reaches its server over TLS, checking the server's certificate
against your CA (and the host name it names).

    read -rs REDIS_URL && export REDIS_URL && python tls.py

where REDIS_URL, pasted without echo (so that the password is on no command line and in
no shell history), is ``rediss://app:PASSWORD@cache.internal:6380/0?ssl_ca_certs=/etc/ssl/cache-ca.pem``.

For mutual TLS, add the client's certificate and key to the query:
``&ssl_certfile=/etc/ssl/app.pem&ssl_keyfile=/etc/ssl/app.key``.
"""

import logging
import os

import anyio

from anarchon import RedisBackend, Run, Scheduler, serve

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
log = logging.getLogger("app")

scheduler = Scheduler(
    RedisBackend(
        redis=os.environ["REDIS_URL"],  # rediss:// (or valkeys://): TLS
        prefix=os.environ.get("ANARCHON_PREFIX", "tls-example:"),
    )
)


@scheduler.job("*/5 * * * * *")  # every five seconds
async def rotate(run: Run) -> None:
    log.info("rotate %s attempt %d fence %d", f"{run.slot:%H:%M:%S}", run.attempt, run.fence)


if __name__ == "__main__":
    anyio.run(serve, scheduler)  # until SIGTERM or Ctrl-C, then a graceful stop
