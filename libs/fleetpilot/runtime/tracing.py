"""W3C trace context across the bus with OpenTelemetry.

A span is created for every message handled (so ``traceparent`` flows from
``task.submitted`` to ``feedback.recorded``), except a sample of a stream that starts no
trace (``Route.traced``: telemetry) and carries none. Spans are exported over OTLP/HTTP only
when an endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT`` or the service's
``otlp_endpoint``). Either is the collector's base URL, as the OpenTelemetry specification
has it: spans go to ``<base>/v1/traces``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

Span = trace.Span
NO_SPAN: Span = trace.INVALID_SPAN
"""A span that records nothing: what a message that starts no trace is handled in."""
TRACEPARENT = "traceparent"
"""The W3C header that carries a message's trace context."""

_tracer = trace.get_tracer("fleetpilot")
_provider: TracerProvider | None = None  # the one ``configure`` installed: ``flush`` empties it


def otlp_traces_url(base: str) -> str:
    """Where spans are posted, from the collector's base URL (``http://collector:4318``):
    ``<base>/v1/traces``. The exporter given an endpoint posts to exactly that URL, so the
    base that the variable names, passed as is, lost every span to the collector's 404."""
    base = base.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def configure(service: str, otlp_endpoint: str | None) -> None:
    """Install a tracer provider for ``service``; export only when an endpoint is set."""
    global _tracer, _provider
    provider = TracerProvider(resource=Resource.create({"service.name": f"fleetpilot-{service}"}))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_traces_url(otlp_endpoint))))
    trace.set_tracer_provider(provider)
    _tracer, _provider = provider.get_tracer("fleetpilot"), provider


def flush(timeout_s: float) -> bool:
    """Export the spans still batched (a blocking call: run it off the event loop); whether
    all went within ``timeout_s``. The batch goes out every 5 s: a service stopped without this
    lost the spans of its last seconds, its shutdown's among them."""
    return _provider.force_flush(int(timeout_s * 1000)) if _provider is not None else True


@contextlib.contextmanager
def span_from_headers(name: str, headers: dict[str, str], subject: str) -> Iterator[trace.Span]:
    """A consumer span whose parent is the ``traceparent`` carried in ``headers``."""
    parent = propagate.extract(headers)
    token = context.attach(parent)
    try:
        with _tracer.start_as_current_span(name, kind=trace.SpanKind.CONSUMER,
                                           attributes={"messaging.system": "nats",
                                                       "messaging.destination.name": subject}) as span:
            yield span
    finally:
        context.detach(token)


def inject_headers() -> dict[str, str]:
    """The current trace context as message headers (``traceparent``/``tracestate``)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


@contextlib.contextmanager
def producer_span(name: str) -> Iterator[dict[str, str]]:
    """Start a root producer span (e.g. a CLI submission) and yield headers carrying it."""
    with _tracer.start_as_current_span(name, kind=trace.SpanKind.PRODUCER):
        yield inject_headers()
