"""Feedback family: the recorded outcome of every action."""

from __future__ import annotations

from typing import Literal

import msgspec

from .base import Event, Record
from .decision import PolicyRef

Outcome = Literal["success", "failure", "oom", "sla_missed", "timeout", "partial"]


class Measured(Record, frozen=True, kw_only=True):
    """A measured value and how much to trust it (0 = exact, 1 = no information)."""

    value: float
    uncertainty_score: float


class FeedbackRecorded(Event, frozen=True, kw_only=True, tag="feedback.recorded.v1"):
    """One action's outcome as stored in the feedback store."""

    action_id: str
    decision_id: str = ""
    task_id: str = ""
    outcome: Outcome
    latency_ms: Measured
    resource_saving_mb: float = 0.0
    unexpected_side_effect: list[str]
    policy: PolicyRef
    shard_id: str = "primary"
    confidence: float = 0.0
    task_kind: str = ""
    gpu_model: str = ""
    action: str = ""
    """The decision's action (``assign``, ``migrate``...): each has its own goal, so its own
    calibration; empty when the record was judged without the action's result."""
    recorded_at: float


class StatsQuery(Event, frozen=True, kw_only=True, tag="feedback.stats_query.v1"):
    """A request for feedback statistics grouped by some of policy, shard_id, task_kind,
    gpu_model and action."""

    by: list[str] = msgspec.field(default_factory=lambda: ["policy", "shard_id", "task_kind", "gpu_model"])


class StatsGroup(Record, frozen=True, kw_only=True):
    """Uncertainty-weighted statistics of one group of feedback records."""

    key: dict[str, str]
    count: int
    successes: int
    success_rate: float
    weighted_success_rate: float | None = None
    measured: int = 0
    """How many of the records had their latency measured (the latency figures' sample)."""
    p95_latency_ms: float | None = None
    """Uncertainty-weighted p95 of the measured latencies; ``None`` when none was measured."""
    mean_resource_saving_mb: float = 0.0
    expected_successes: float = 0.0
    calibration_gap: float = 0.0
    brier_score: float = 0.0


class FeedbackStats(Event, frozen=True, kw_only=True, tag="feedback.stats.v1"):
    """The reply to a ``StatsQuery``."""

    groups: list[StatsGroup]
    at: float
