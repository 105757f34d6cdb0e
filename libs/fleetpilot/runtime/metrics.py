"""Prometheus metrics of a service's handlers: messages, errors, latency, redeliveries."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class HandlerMetrics:
    """Per-handler counters and a latency histogram in the service's own registry."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.service = service
        labels = ["service", "handler"]
        self.messages = Counter("fleetpilot_messages_total", "Messages received", labels, registry=self.registry)
        self.handled_ok = Counter("fleetpilot_messages_handled_total", "Messages handled successfully", labels,
                                  registry=self.registry)
        self.errors = Counter("fleetpilot_handler_errors_total", "Handler failures (retried)", labels,
                              registry=self.registry)
        self.redeliveries = Counter("fleetpilot_redeliveries_total", "Messages received more than once", labels,
                                    registry=self.registry)
        self.dead_letters = Counter("fleetpilot_dead_letters_total", "Messages dead-lettered",
                                    labels + ["reason"], registry=self.registry)
        self.latency = Histogram("fleetpilot_handler_seconds", "Handler latency", labels, registry=self.registry,
                                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.connected = Gauge("fleetpilot_bus_connected", "1 when the bus is connected", ["service"],
                               registry=self.registry)
        # Each handler's series, looked up once: ``labels`` takes a lock and builds a key at
        # every call, a tenth of a sample's handling in the executor.
        self._per_handler: dict[str, tuple[Counter, Counter, Histogram]] = {}

    def _series(self, handler: str) -> tuple[Counter, Counter, Histogram]:
        """``handler``'s received and handled counters and its latency histogram."""
        series = self._per_handler.get(handler)
        if series is None:
            labels = (self.service, handler)
            series = self._per_handler[handler] = (self.messages.labels(*labels), self.handled_ok.labels(*labels),
                                                   self.latency.labels(*labels))
        return series

    def received(self, handler: str, deliveries: int) -> None:
        """Count a received message (and a redelivery when it is not the first)."""
        self._series(handler)[0].inc()
        if deliveries > 1:
            self.redeliveries.labels(self.service, handler).inc()

    def handled(self, handler: str, seconds: float) -> None:
        """Count a success and its latency."""
        _, handled, latency = self._series(handler)
        handled.inc()
        latency.observe(seconds)

    def failed(self, handler: str) -> None:
        """Count a handler failure."""
        self.errors.labels(self.service, handler).inc()

    def dead_lettered(self, handler: str, reason: str) -> None:
        """Count a dead letter by reason."""
        self.dead_letters.labels(self.service, handler, reason).inc()
