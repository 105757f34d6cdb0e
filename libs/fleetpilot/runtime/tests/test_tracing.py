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
