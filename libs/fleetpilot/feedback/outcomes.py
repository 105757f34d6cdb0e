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


def feedback_for(
    result: ActionExecuted | ActionFailed,
    ending: TaskLifecycle | None = None,
    *,
    recorded_at: float,
    latency_uncertainty: float = 0.0,
    resource_saving_mb: float = 0.0,
    side_effects: Sequence[str] | None = None,
) -> FeedbackRecorded:
    """The feedback record of one action; ``latency_uncertainty`` says how far the backend's
    latency can be trusted (0 for a measured process start, more for a simulated one), and
    the side effects default to those the ending reveals (``side_effects_of``)."""
    return FeedbackRecorded(
        action_id=result.action_id,
        decision_id=result.decision_id,
        task_id=result.task_id,
        outcome=outcome_of(result, ending),
        latency_ms=Measured(value=result.latency_ms, uncertainty_score=latency_uncertainty),
        resource_saving_mb=resource_saving_mb,
        unexpected_side_effect=list(side_effects_of(ending) if side_effects is None else side_effects),
        policy=result.policy,
        shard_id=result.shard_id,
        confidence=result.confidence,
        task_kind=result.task_kind,
        gpu_model=result.gpu_model,
        action=result.action,
        recorded_at=recorded_at,
    )
