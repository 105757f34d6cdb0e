"""Every built-in policy (and the fallback) respects the GPUs' business rules as hard
constraints: reserved GPUs, driver pins, the task kinds a GPU takes."""

from __future__ import annotations

import pytest
from fleetpilot.contracts import GpuInfo, NodeTopology
from fleetpilot.policy import BUILTIN_POLICIES, ClusterState, FallbackScheduler, TaskRequest, build_policy


def fleet() -> ClusterState:
    """Two idle 4-GPU nodes. a: GPUs 0-2 reserved, GPU 3 pinned to driver 535. b: every GPU
    reports driver 550.54.15 and takes inference only."""
    a = [GpuInfo(index=i, model="A100", memory_mb=40000, labels={"role": "reserved"}) for i in range(3)]
    a.append(GpuInfo(index=3, model="A100", memory_mb=40000, labels={"driver_pin": "535"}))
    b = [GpuInfo(index=i, model="A100", memory_mb=40000, labels={"driver_version": "550.54.15", "task_kinds": "infer"})
         for i in range(4)]
    return ClusterState.from_topology([NodeTopology(node="a", cpu_milli=64000, memory_mb=256000, gpus=a),
                                       NodeTopology(node="b", cpu_milli=64000, memory_mb=256000, gpus=b)])


CASES = [
    # (task, where it may go: {(node, gpu)}; empty = nowhere)
    (TaskRequest(task_id="t1", kind="train", gpus=1, gpu_milli=1000), {("a", 3)}),
    (TaskRequest(task_id="t2", kind="train", gpus=1, gpu_milli=500, labels={"driver": "550"}), set()),
    (TaskRequest(task_id="t3", kind="infer", gpus=1, gpu_milli=250, labels={"driver": "550"}),
     {("b", g) for g in range(4)}),
    (TaskRequest(task_id="t4", kind="infer", gpus=2, gpu_milli=1000, labels={"driver": "535"}), set()),
    (TaskRequest(task_id="t5", kind="infer", gpus=2, gpu_milli=1000), {("b", g) for g in range(4)}),
]


@pytest.mark.parametrize("name", sorted(BUILTIN_POLICIES))
@pytest.mark.parametrize(("task", "where"), CASES)
def test_policies_place_only_where_the_rules_allow(name: str, task: TaskRequest, where: set) -> None:
    state = fleet()
    decision = build_policy(name, seed=1).decide(state, task)
    if not where:
        assert decision.action != "assign", decision
        return
    assert decision.action == "assign"
    assert {(p.node, p.gpu) for p in decision.placement} <= where


@pytest.mark.parametrize(("task", "where"), CASES)
def test_the_fallback_respects_them_too(task: TaskRequest, where: set) -> None:
    decision = FallbackScheduler([]).decide(fleet(), task)
    if where:
        assert decision.action == "assign" and {(p.node, p.gpu) for p in decision.placement} <= where
    else:
        assert decision.action != "assign", decision
