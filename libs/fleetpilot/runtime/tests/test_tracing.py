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


@pytest.fixture
def exported(monkeypatch):
    """The spans a service exports, kept in memory; the tracer is put back after the test."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    monkeypatch.setattr(trace_exporter, "OTLPSpanExporter", lambda **kwargs: spans)
    monkeypatch.setattr(tracing, "_tracer", tracing._tracer)
    monkeypatch.setattr(tracing, "_provider", tracing._provider)
    return spans


def traced_host(name: str):
    """A service host that exports its spans (to the ``exported`` fixture's memory)."""
    from fleetpilot.runtime import ServiceHost, ServiceSettings

    return ServiceHost(name, ServiceSettings(nats_url="nats://unused:4222", metrics_port=-1,
                                             otlp_endpoint="http://collector:4318"))


async def test_a_stopped_service_has_exported_its_last_spans(exported):
    # The batch goes out every 5 s: a service stopped before its next export lost the spans of
    # its last seconds (its shutdown's among them), the ones an operator looks for after a stop.
    from fleetpilot.runtime.memory import InMemoryBus

    host = traced_host("traced")
    await host.start(InMemoryBus())
    with tracing.producer_span("last words"):
        pass
    await host.stop()
    assert [span.name for span in exported.get_finished_spans()] == ["last words"]


async def test_a_sample_starts_no_trace_and_one_that_carries_a_context_continues_it(exported):
    # A span per sample per service was most of a consumer's cost per message, and thousands
    # of one-span traces a second for the collector. Samples start none; a submission does.
    from fleetpilot.contracts import NodeTelemetry, TaskSubmitted
    from fleetpilot.runtime.memory import InMemoryBus
    from fleetpilot.runtime.testing import eventually

    host = traced_host("executor")
    handled: list[str] = []

    @host.on_core("telemetry.gpu.*", NodeTelemetry)
    async def on_sample(sample: NodeTelemetry) -> None:
        handled.append(sample.node)

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def on_submitted(task: TaskSubmitted) -> None:
        handled.append(task.task_id)

    bus = InMemoryBus()
    await host.start(bus)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    await bus.publish(NodeTelemetry(node="untraced", at=1.0, source="sim", gpus=[]))
    await bus.publish(NodeTelemetry(node="traced", at=1.0, source="sim", gpus=[]),
                      headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    await bus.publish(TaskSubmitted(task_id="t1", tenant="t", submitted_at=1.0))
    await eventually(lambda: len(handled) == 3)
    await host.stop()
    spans = sorted(exported.get_finished_spans(), key=lambda span: span.name)
    assert [span.name for span in spans] == ["executor.sla-submitted", "executor.telemetry.gpu.*"]
    assert f"{spans[1].context.trace_id:032x}" == trace_id
