"""The policy service's own Prometheus series."""

from __future__ import annotations

import logging

from fleetpilot.contracts import DecisionMade
from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger("fleetpilot.policy")


class PolicyMetrics:
    """The service's own series, in the host's registry next to the handler metrics."""

    def __init__(self, registry) -> None:
        self.reload = Histogram(
            "fleetpilot_policy_reload_seconds",
            "Time to rebuild and swap the policies",
            ["kind"],
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )
        self.last_reload = Gauge(
            "fleetpilot_policy_last_reload_seconds", "Duration of the last swap", ["kind"], registry=registry
        )
        self.generation = Gauge(
            "fleetpilot_policy_generation", "Generation of the policies serving now", registry=registry
        )
        self.decisions = Counter(
            "fleetpilot_policy_decisions_total",
            "Decisions published",
            ["action", "policy", "shard", "fallback"],
            registry=registry,
        )
        self.config_errors = Counter(
            "fleetpilot_policy_config_errors_total", "Config documents refused", registry=registry
        )
        self.module_errors = Counter(
            "fleetpilot_policy_module_errors_total",
            "Policy modules that failed to load or could not be read (once per version of the file)",
            ["module"],
            registry=registry,
        )
        self.breaker_open = Gauge(
            "fleetpilot_policy_breaker_open",
            "1 while the policy's circuit breaker is open or probing (its decisions go to the fallback)",
            ["policy"],
            registry=registry,
        )
        self.breaker_trips = Counter(
            "fleetpilot_policy_breaker_trips_total", "Times the policy's breaker opened, by the outcome that opened it",
            ["policy", "outcome"], registry=registry,
        )

    def swapped(self, kind: str, seconds: float, generation: int) -> None:
        """Record one swap."""
        self.reload.labels(kind).observe(seconds)
        self.last_reload.labels(kind).set(seconds)
        self.generation.set(generation)

    def breaker_changed(self, policy: str, state: str, outcome: str) -> None:
        """Log and count a breaker that opened (its decisions now go to the fallback scheduler)
        or closed again."""
        self.breaker_open.labels(policy).set(0 if state == "closed" else 1)
        if state == "open":
            self.breaker_trips.labels(policy, outcome).inc()
            log.warning("policy %s: breaker open after %s; the fallback scheduler decides until a probe succeeds",
                        policy, outcome.replace("_", " "))
        else:
            log.warning("policy %s: breaker closed; it decides again", policy)

    def decided(self, d: DecisionMade) -> DecisionMade:
        """Count a decision on its way out."""
        self.decisions.labels(d.action, d.policy.name, d.shard_id, str(d.fallback).lower()).inc()
        return d
