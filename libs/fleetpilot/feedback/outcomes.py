"""From what the executor reported to the feedback record the store keeps (pure).

An action's outcome is judged from its result (``action.executed`` / ``action.failed``)
and, when known, how the task ended afterwards (``task.lifecycle``):

==========================  ==========================  ================
result                      task ended                  outcome
==========================  ==========================  ================
failed, error mentions      -                           ``timeout``
"timeout" / "timed out"
failed, any other error     -                           ``failure``
executed                    not yet / ``finished``      ``success``
executed                    ``oom_killed``              ``oom``
executed                    ``failed``                  ``failure``
executed                    ``evicted``                 ``partial``
==========================  ==========================  ================

``started``, ``migrated`` and ``resized`` are not endings and leave the outcome as if no
ending were known: a placement the task left alive by a migration met its goal. The
service decides when to record (at once, or when the placement ends).

The resource saving (``resource_saving_of``) is the GPU memory a successful placement left
to other work, against what the baseline, Kubernetes with the NVIDIA device plugin, holds
for the same task: whole GPUs. Each GPU the task shares (a compute share below 1000 milli,
with the memory it reserved known) saves the GPU's memory (from the catalogue, by the
action's ``gpu_model``) less that reservation; a whole GPU saves nothing, and neither does an
action that did not succeed (its share was not what it needed) or one of a model the
catalogue does not know.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetpilot.contracts import (
    ActionExecuted,
    ActionFailed,
    FeedbackRecorded,
    Measured,
    Outcome,
    TaskLifecycle,
)
from fleetpilot.fleet.catalogue import UnknownGpuModel, gpu_model

_ENDINGS: dict[str, Outcome] = {
    "finished": "success",
    "oom_killed": "oom",
    "failed": "failure",
    "evicted": "partial",
}


def ending_outcome(ending: TaskLifecycle | None) -> Outcome:
    """The outcome of an executed action whose task ended (or moved on) with ``ending``."""
    if ending is None:
        return "success"
    return _ENDINGS.get(ending.state, "success")


def outcome_of(result: ActionExecuted | ActionFailed, ending: TaskLifecycle | None = None) -> Outcome:
    """The outcome of one action (see the module table)."""
    if isinstance(result, ActionFailed):
        error = result.error.lower()
        return "timeout" if "timeout" in error or "timed out" in error else "failure"
    return ending_outcome(ending)


def side_effects_of(ending: TaskLifecycle | None) -> list[str]:
    """Unexpected side effects an ending reveals: an OOM kill the executor blames on a
    neighbour's growth is ``oom_neighbour``."""
    if ending is not None and ending.state == "oom_killed" and "neighbour" in ending.detail:
        return ["oom_neighbour"]
    return []


def resource_saving_of(result: ActionExecuted | ActionFailed, outcome: Outcome) -> float:
    """GPU memory (MB) a successful action's placement left to other work against whole GPUs
    (see the module text); 0 when it did not succeed or shares no GPU."""
    if outcome != "success" or not isinstance(result, ActionExecuted):
        return 0.0
    shared = [p for p in result.placement if p.gpu >= 0 and p.milli < 1000 and p.memory_mb > 0]
    if not shared:
        return 0.0
    try:
        total_mb = gpu_model(result.gpu_model).memory_mb
    except UnknownGpuModel:
        return 0.0
    return float(sum(max(total_mb - p.memory_mb, 0) for p in shared))


def feedback_for(
    result: ActionExecuted | ActionFailed,
    ending: TaskLifecycle | None = None,
    *,
    recorded_at: float,
    latency_uncertainty: float = 0.0,
    resource_saving_mb: float | None = None,
    side_effects: Sequence[str] | None = None,
) -> FeedbackRecorded:
    """The feedback record of one action; ``latency_uncertainty`` says how far the backend's
    latency can be trusted (0 for a measured process start, more for a simulated one); the
    resource saving defaults to ``resource_saving_of`` and the side effects to those the
    ending reveals (``side_effects_of``)."""
    outcome = outcome_of(result, ending)
    return FeedbackRecorded(
        action_id=result.action_id,
        decision_id=result.decision_id,
        task_id=result.task_id,
        outcome=outcome,
        latency_ms=Measured(value=result.latency_ms, uncertainty_score=latency_uncertainty),
        resource_saving_mb=resource_saving_of(result, outcome) if resource_saving_mb is None else resource_saving_mb,
        unexpected_side_effect=list(side_effects_of(ending) if side_effects is None else side_effects),
        policy=result.policy,
        shard_id=result.shard_id,
        confidence=result.confidence,
        task_kind=result.task_kind,
        gpu_model=result.gpu_model,
        action=result.action,
        recorded_at=recorded_at,
    )
