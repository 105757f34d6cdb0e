"""Action family: what the executor did with a decision."""

from __future__ import annotations

import msgspec

from .base import Event
from .decision import ActionKind, Placement, PolicyRef


class ActionExecuted(Event, frozen=True, kw_only=True, tag="action.executed.v1"):
    """A decision carried out; ``action_id`` is derived from the decision (idempotent)."""

    action_id: str
    decision_id: str
    task_id: str
    action: ActionKind
    placement: list[Placement] = msgspec.field(default_factory=list)
    backend: str
    latency_ms: float
    policy: PolicyRef
    shard_id: str = "primary"
    confidence: float = 0.0
    task_kind: str = ""
    gpu_model: str = ""
    executed_at: float


class ActionFailed(Event, frozen=True, kw_only=True, tag="action.failed.v1"):
    """A decision that could not be carried out, with the error. ``placement`` is where it
    was to run (empty when not known): a task queued again is placed elsewhere if it can be."""

    action_id: str
    decision_id: str
    task_id: str
    action: ActionKind
    placement: list[Placement] = msgspec.field(default_factory=list)
    backend: str
    error: str
    retryable: bool = False
    latency_ms: float = 0.0
    policy: PolicyRef
    shard_id: str = "primary"
    confidence: float = 0.0
    task_kind: str = ""
    gpu_model: str = ""
    failed_at: float
