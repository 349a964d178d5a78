"""OpenTelemetry spans of a scheduler: one per attempt of a job (your handler's own spans
nest in it) and one per round trip of claims, printed by the SDK's console exporter.

    pip install 'anarchon[otel]' opentelemetry-sdk
    REDIS_URL=redis://localhost:6379 python otel_tracing.py

In production, hand the spans to your collector instead: an OTLP exporter
(``opentelemetry-exporter-otlp``) in place of ``ConsoleSpanExporter``.
"""

import logging
import os

import anyio
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from anarchon import RedisBackend, Run, Scheduler, serve
from anarchon.otel import instrument

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

provider = TracerProvider(resource=Resource.create({"service.name": "billing"}))
provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
trace.set_tracer_provider(provider)
tracer = trace.get_tracer("billing")

scheduler = Scheduler(
    RedisBackend(
        redis=os.environ.get("REDIS_URL", "redis://localhost:6379"),
        prefix=os.environ.get("ANARCHON_PREFIX", "otel-tracing:"),
    )
)
instrument(scheduler)  # before the start; the global tracer provider set above


@scheduler.job("*/5 * * * * *")  # every five seconds
async def invoice(run: Run) -> None:
    with tracer.start_as_current_span("send invoices") as span:  # a child of the attempt's
        span.set_attribute("invoices.sent", 3)


async def main() -> None:
    try:
        await serve(scheduler)  # until SIGTERM or Ctrl-C, then a graceful stop
    finally:
        provider.shutdown()  # exports the spans still waiting in the batch


if __name__ == "__main__":
    anyio.run(main)
