"""Outcome of an action from its result and the task's ending."""

from __future__ import annotations

import msgspec
import pytest
from fleetpilot.contracts import ActionExecuted, ActionFailed, PolicyRef, TaskLifecycle
from fleetpilot.feedback.outcomes import feedback_for, outcome_of

EXECUTED = ActionExecuted(
    action_id="act-d1",
    decision_id="d1",
    task_id="t1",
    action="assign",
    backend="process",
    latency_ms=42.0,
    policy=PolicyRef(name="fgd", version="2"),
    shard_id="candidate",
    confidence=0.7,
    task_kind="train",
    gpu_model="H100",
    executed_at=1.0,
)


def failed(error: str) -> ActionFailed:
    return ActionFailed(
        action_id="act-d2",
        decision_id="d2",
        task_id="t2",
        action="migrate",
        backend="sim",
        error=error,
        policy=PolicyRef(name="fgd"),
        failed_at=1.0,
    )


def ended(state: str) -> TaskLifecycle:
    return TaskLifecycle(task_id="t1", state=state, at=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("result", "ending", "outcome"),
    [
        (failed("backend timed out after 30s"), None, "timeout"),
        (failed("Timeout waiting for node"), None, "timeout"),
        (failed("business rule: reserved"), None, "failure"),
        (EXECUTED, None, "success"),
        (EXECUTED, ended("finished"), "success"),
        (EXECUTED, ended("oom_killed"), "oom"),
        (EXECUTED, ended("failed"), "failure"),
        (EXECUTED, ended("evicted"), "partial"),
        (EXECUTED, ended("migrated"), "success"),
    ],
)
def test_outcome_table(result, ending, outcome: str) -> None:  # type: ignore[no-untyped-def]
    assert outcome_of(result, ending) == outcome


def test_feedback_carries_the_keys_and_confidence() -> None:
    record = feedback_for(
        EXECUTED, ended("oom_killed"), recorded_at=5.0, latency_uncertainty=0.2, side_effects=["x"]
    )
    assert (record.action_id, record.outcome, record.shard_id, record.gpu_model, record.task_kind) == (
        "act-d1",
        "oom",
        "candidate",
        "H100",
        "train",
    )
    assert record.policy == PolicyRef(name="fgd", version="2") and record.confidence == 0.7
    assert record.latency_ms.value == 42.0 and record.latency_ms.uncertainty_score == 0.2
    assert record.unexpected_side_effect == ["x"]


def test_the_resource_saving_is_what_shared_gpus_left_against_whole_gpus() -> None:
    # Every record carried resource_saving_mb = 0: the efficiency figure said nothing.
    from fleetpilot.contracts import Placement
    from fleetpilot.fleet.catalogue import gpu_model

    h100_mb = gpu_model("H100").memory_mb
    shared = msgspec.structs.replace(EXECUTED, placement=[Placement(node="n1", gpu=0, milli=500, memory_mb=20_000)])
    assert feedback_for(shared, recorded_at=5.0).resource_saving_mb == h100_mb - 20_000
    assert feedback_for(shared, ended("finished"), recorded_at=5.0).resource_saving_mb == h100_mb - 20_000
    whole = msgspec.structs.replace(EXECUTED, placement=[Placement(node="n1", gpu=g, milli=1000, memory_mb=70_000)
                                                         for g in (0, 1)])
    assert feedback_for(whole, recorded_at=5.0).resource_saving_mb == 0.0  # as the device plugin holds them
    # A share that was not what the task needed saved nothing; nor does a failed action.
    assert feedback_for(shared, ended("oom_killed"), recorded_at=5.0).resource_saving_mb == 0.0
    assert feedback_for(failed("boom"), recorded_at=5.0).resource_saving_mb == 0.0
    unknown = msgspec.structs.replace(shared, gpu_model="a GPU nobody catalogued")
    assert feedback_for(unknown, recorded_at=5.0).resource_saving_mb == 0.0
    assert feedback_for(shared, recorded_at=5.0, resource_saving_mb=7.0).resource_saving_mb == 7.0
