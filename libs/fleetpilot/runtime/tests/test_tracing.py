"""Spans go to the OTLP collector's traces path, from the base URL the variable names."""

from __future__ import annotations

import pytest
from fleetpilot.runtime import tracing


@pytest.mark.parametrize(("base", "url"), [
    ("http://collector:4318", "http://collector:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://otel.example/prefix", "https://otel.example/prefix/v1/traces"),
    ("http://collector:4318/v1/traces", "http://collector:4318/v1/traces"),
])
def test_the_traces_url_is_the_base_and_the_signal_path(base, url):
    assert tracing.otlp_traces_url(base) == url


def test_the_exporter_posts_to_the_traces_path(monkeypatch):
    from opentelemetry.exporter.otlp.proto.http import trace_exporter
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    made: list[str] = []

    def exporter(**kwargs):
        made.append(kwargs["endpoint"])
        return InMemorySpanExporter()  # nothing leaves this test, nor outlives it

    monkeypatch.setattr(trace_exporter, "OTLPSpanExporter", exporter)
    monkeypatch.setattr(tracing, "_tracer", tracing._tracer)  # the other tests' tracer, put back after
    tracing.configure("test", "http://collector:4318")
    assert made == ["http://collector:4318/v1/traces"]


async def test_a_stopped_service_has_exported_its_last_spans(monkeypatch):
    # The batch goes out every 5 s: a service stopped before its next export lost the spans of
    # its last seconds (its shutdown's among them), the ones an operator looks for after a stop.
    from fleetpilot.runtime import ServiceHost, ServiceSettings
    from fleetpilot.runtime.memory import InMemoryBus
    from opentelemetry.exporter.otlp.proto.http import trace_exporter
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    monkeypatch.setattr(trace_exporter, "OTLPSpanExporter", lambda **kwargs: exported)
    monkeypatch.setattr(tracing, "_tracer", tracing._tracer)
    monkeypatch.setattr(tracing, "_provider", tracing._provider)
    host = ServiceHost("traced", ServiceSettings(nats_url="nats://unused:4222", metrics_port=-1,
                                                 otlp_endpoint="http://collector:4318"))
    await host.start(InMemoryBus())
    with tracing.producer_span("last words"):
        pass
    await host.stop()
    assert [span.name for span in exported.get_finished_spans()] == ["last words"]
