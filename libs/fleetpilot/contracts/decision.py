"""Decision family: what the policy decided for a task, and how sure it is."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .base import Event, Record
from .task import Contract, TaskSubmitted

ActionKind = Literal["assign", "migrate", "evict", "resize", "queue", "reject"]

# Checked when a decision is decoded, so that a producer in any language that sends a
# negative share or a confidence outside 0..1 is dead-lettered with the field named, instead
# of every consumer (executor, ledger, learner, users) checking it again; proto/ shows the
# bounds as ``minimum``/``maximum``. Every Fleetpilot producer already keeps within them.
Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
GpuIndex = Annotated[int, msgspec.Meta(ge=-1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


class Placement(Record, frozen=True, kw_only=True):
    """A share of one GPU (or CPU only, with ``gpu = -1``) on one node."""

    node: str
    gpu: GpuIndex
    milli: NonNegativeInt
    memory_mb: NonNegativeInt = 0


class PolicyRef(Record, frozen=True, kw_only=True):
    """Which policy (and version) made a decision."""

    name: str
    version: str = "1"


class DecisionMade(Event, frozen=True, kw_only=True, tag="decision.made.v1"):
    """A decision about one task. ``confidence`` is the estimated probability that the
    action meets its goal; ``source`` is where a migrating task comes from.
    ``prior_confidence`` is the policy's own estimate when ``confidence`` is the learned
    outcome model's (``None`` when the policy's own estimate was published)."""

    decision_id: str
    task_id: str
    action: ActionKind
    placement: list[Placement] = msgspec.field(default_factory=list)
    source: list[Placement] = msgspec.field(default_factory=list)
    confidence: Probability
    policy: PolicyRef
    shard_id: str = "primary"
    fallback: bool = False
    reason: str = ""
    decided_at: float
    task: TaskSubmitted | None = None
    contract: Contract | None = None
    prior_confidence: Probability | None = None
