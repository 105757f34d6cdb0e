"""The policy service's own Prometheus series."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import get_args

from fleetpilot.contracts import DecisionMade
from fleetpilot.contracts.task import SlaTier
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
        # Every replica reads the whole queue: across replicas, take the max, not the sum.
        self.waiting_tasks = Gauge(
            "fleetpilot_policy_waiting_tasks",
            "Tasks waiting for a place (the pending bucket, as `fleetpilot queue` lists it), by tier; every "
            "replica reports the whole queue",
            ["tier"], registry=registry,
        )
        self.oldest_wait = Gauge(
            "fleetpilot_policy_oldest_wait_seconds",
            "How long the task waiting longest has waited, since its admission or its requeue (0: none waits)",
            registry=registry,
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

    def waiting(self, tiers: Mapping[str, int], since: float | None, at: float) -> None:
        """The queue as a retry round found it: tasks per tier, and the longest wait (from
        ``since``, the earliest admission or requeue among them, to ``at``)."""
        for tier in get_args(SlaTier):
            self.waiting_tasks.labels(tier).set(tiers.get(tier, 0))
        self.oldest_wait.set(max(at - since, 0.0) if since is not None else 0.0)

    def decided(self, d: DecisionMade) -> DecisionMade:
        """Count a decision on its way out."""
        self.decisions.labels(d.action, d.policy.name, d.shard_id, str(d.fallback).lower()).inc()
        return d
