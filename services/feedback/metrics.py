"""The feedback service's own Prometheus series: the loop's outcomes as they are recorded.

Each record is counted once, when the store says it wrote it (a redelivery, or a second
replica handed the same action, counts nothing), so summed over the replicas the series
say what the store holds since they started: how many actions met their goal, how many
ended in an OOM kill, what the policies expected of them.
"""

from __future__ import annotations

from fleetpilot.contracts import FeedbackRecorded
from prometheus_client import Counter, Histogram


class FeedbackMetrics:
    """The service's own series, in the host's registry next to the handler metrics."""

    def __init__(self, registry) -> None:
        """Register the series in ``registry``."""
        self.records = Counter(
            "fleetpilot_feedback_records_total",
            "Actions judged and stored, by the decision's action, the policy that decided and the outcome",
            ["action", "policy", "outcome"], registry=registry,
        )
        # The sum of the confidences, beside the successes: their ratio over a window is how
        # far the policy's published confidence is from what its actions met.
        self.expected = Counter(
            "fleetpilot_feedback_expected_successes_total",
            "Sum of the decisions' published confidence over the records stored (successes the policy expected)",
            ["action", "policy"], registry=registry,
        )
        self.side_effects = Counter(
            "fleetpilot_feedback_side_effects_total",
            "Unexpected side effects the records name (oom_neighbour: a task killed by a neighbour's growth)",
            ["effect"], registry=registry,
        )
        self.latency = Histogram(
            "fleetpilot_feedback_action_latency_seconds",
            "The executor's latency of each action whose latency was measured (not of records judged from "
            "the task's end alone until their result gives it)",
            ["action"], registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )

    def stored(self, record: FeedbackRecorded) -> None:
        """Count a record the store has just written."""
        action = record.action or "unknown"
        self.records.labels(action, record.policy.name, record.outcome).inc()
        self.expected.labels(action, record.policy.name).inc(record.confidence)
        for effect in record.unexpected_side_effect:
            self.side_effects.labels(effect).inc()
        self.measured(record)

    def measured(self, record: FeedbackRecorded) -> None:
        """Observe ``record``'s latency if it is a measured one (written with the record, or
        given to it later by its action's late result)."""
        if record.latency_ms.uncertainty_score < 1.0:
            self.latency.labels(record.action or "unknown").observe(record.latency_ms.value / 1000.0)
