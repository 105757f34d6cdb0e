"""The business role the fleet puts on GPUs reaches the policy's state."""

from __future__ import annotations

from fleetpilot.contracts import GpuInfo, NodeTopology, TaskSubmitted
from fleetpilot.policy import ClusterState, TaskRequest


def test_business_role_labels_reach_the_state_and_the_request():
    node = NodeTopology(node="n1", cpu_milli=64000, memory_mb=262144, gpus=[
        GpuInfo(index=0, model="T4", memory_mb=16384, labels={"business_role": "infer"}),
        GpuInfo(index=1, model="T4", memory_mb=16384, labels={"business_role": "train"}),
        GpuInfo(index=2, model="T4", memory_mb=16384)])
    state = ClusterState.from_topology([node])
    roles = state.gpu_role[0, :3]
    assert roles[0] != roles[1] and roles[0] != 0 and roles[1] != 0 and roles[2] == 0
    task = TaskSubmitted(task_id="t", labels={"business_role": "infer"}, submitted_at=1.0)
    assert TaskRequest.from_submitted(task).role == "infer"
