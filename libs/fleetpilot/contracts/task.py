"""Task family: what users submit and how a submission moves through its life."""

from __future__ import annotations

from typing import Literal

import msgspec

from .base import Event, Record

TaskKind = Literal["train", "finetune", "infer", "encode", "batch"]
SlaTier = Literal["vip", "standard", "best_effort"]
RejectCode = Literal["unauthenticated", "invalid", "infeasible", "offer_declined", "offer_expired"]
LifecycleState = Literal["started", "finished", "oom_killed", "failed", "evicted", "migrated", "resized"]


class SlaRequest(Record, frozen=True, kw_only=True):
    """What the submitter asks for; every bound is optional (``None`` = no bound)."""

    tier: SlaTier = "standard"
    max_queue_s: float | None = None
    warmup_ms: float | None = None
    p95_latency_ms: float | None = None
    deadline: float | None = None
    cost_ceiling_per_hour: float | None = None


class TaskSubmitted(Event, frozen=True, kw_only=True, tag="task.submitted.v1"):
    """A user's request to run a task. ``task_id`` is client-chosen and the idempotency key.

    ``gpus`` is the GPU count (0 for CPU-only); a task with ``gpus == 1`` and
    ``gpu_milli < 1000`` shares one GPU; ``gpu_models`` lists acceptable models (empty: any).
    ``resumable``: the task saves its state on the executor's checkpoint signal and goes on
    from it when started again. One that does not (``False``) loses its run when it is
    stopped, so the policy never moves it to serve others (making way, moving down, clearing a
    node), never starts it on GPUs smaller than its predicted peak (a bridge), and moves it
    only off GPUs going away, where it would lose its run anyway. The executor stops it
    without the checkpoint signal and starts it over on the target, without
    ``FLEETPILOT_RESTORE``.
    """

    task_id: str
    tenant: str = ""
    kind: TaskKind = "batch"
    gpus: int = 1
    gpu_milli: int = 1000
    gpu_memory_mb: int = 0
    gpu_models: list[str] = msgspec.field(default_factory=list)
    cpu_milli: int = 0
    memory_mb: int = 0
    size_gb: float = 0.0
    qos: str = ""
    sla: SlaRequest = msgspec.field(default_factory=SlaRequest)
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    command: list[str] | None = None
    image: str | None = None
    expected_duration_s: float | None = None
    submitted_at: float = 0.0
    resumable: bool = True


class Contract(Record, frozen=True, kw_only=True):
    """The terms Fleetpilot agreed to for one task (the negotiated ``SlaRequest``)."""

    tier: SlaTier = "standard"
    max_queue_s: float | None = None
    warmup_ms: float | None = None
    p95_latency_ms: float | None = None
    deadline: float | None = None
    cost_ceiling_per_hour: float | None = None
    gpu_models: list[str] = msgspec.field(default_factory=list)
    site: str | None = None
    not_before: float | None = None
    offer_id: str | None = None
    notes: str = ""
    sites: list[str] = msgspec.field(default_factory=list)
    """The sites that keep the terms a site decides (a warm-up bound, a deadline the warm-up
    counts towards), ``site`` first: the task runs at one of them. Empty: any site keeps the
    contract (no term depends on the site), or a contract of an earlier version, which bound
    an accepted offer to ``site`` alone (``fleetpilot.sla.bound_sites``)."""


class TaskAdmitted(Event, frozen=True, kw_only=True, tag="task.admitted.v1"):
    """The SLA negotiator accepted a task under ``contract``; the tenant comes from its token."""

    task: TaskSubmitted
    contract: Contract
    tenant: str
    admitted_at: float


class TaskRejected(Event, frozen=True, kw_only=True, tag="task.rejected.v1"):
    """A submission that will not run, with a machine-readable ``code`` and a human reason."""

    task_id: str
    tenant: str = ""
    code: RejectCode
    reason: str
    rejected_at: float


class TaskLifecycle(Event, frozen=True, kw_only=True, tag="task.lifecycle.v1"):
    """A change in a running task's life as the executor saw it.

    ``decision_id`` (with its policy, the policy's version, the decision's action, shard and
    confidence) names the decision whose placement the task runs under after the change; on
    ``migrated``, ``replaces_decision_id`` names the placement decision the task left (empty
    when the executor no longer knows it), so the feedback service can judge that placement
    as ended. ``policy_version`` and ``decision_action`` are empty from executors that do not
    say them.
    """

    task_id: str
    state: LifecycleState
    node: str = ""
    gpus: list[int] = msgspec.field(default_factory=list)
    exit_code: int | None = None
    detail: str = ""
    decision_id: str = ""
    policy: str = ""
    policy_version: str = ""
    decision_action: str = ""
    shard_id: str = "primary"
    confidence: float = 0.0
    gpu_model: str = ""
    task_kind: str = ""
    replaces_decision_id: str = ""
    at: float
