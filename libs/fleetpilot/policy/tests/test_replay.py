"""Replay two policies over a tiny recorded set and diff them."""

from __future__ import annotations

import msgspec
from fleetpilot.policy import ClusterState, TaskRequest, TaskShape, build_policy
from fleetpilot.policy.replay import Snapshot, classify, record, replay


def recorded() -> list[Snapshot]:
    state = ClusterState.build(names=["a", "b"], cpu_milli=[32000, 32000], memory_mb=[64000, 64000],
                               gpus=[2, 2], models=["X", "X"])
    state.allocate(0, [0], 600, cpu_milli=8000)
    tasks = [TaskRequest(task_id="share", gpus=1, gpu_milli=300),  # bestfit: a/GPU0; k8s: whole GPU on b
             TaskRequest(task_id="cpu", gpus=0, gpu_milli=0, cpu_milli=100),
             TaskRequest(task_id="huge", gpus=4, gpu_milli=1000)]  # fits nowhere: both queue
    snaps = [record(state, t) for t in tasks]
    # Snapshots survive JSON, as they would in a recording file.
    return [msgspec.json.decode(msgspec.json.encode(s), type=Snapshot) for s in snaps]


def test_replay_counts_differences_and_effects():
    shapes = [TaskShape(cpu_milli=0, gpu_milli=400, gpus=1, weight=0.5),
              TaskShape(cpu_milli=0, gpu_milli=1000, gpus=1, weight=0.5)]
    report = replay(recorded(), build_policy("bestfit", seed=0), build_policy("k8s-default", seed=0), typical=shapes)
    assert report.total == 3
    kinds = {i.task_id: i.kind for i in report.items}
    assert kinds["share"] == "node" and kinds["huge"] == "same"
    share = next(i for i in report.items if i.task_id == "share")
    # bestfit packs the share onto the used GPU of a (400 free -> 100);
    # k8s takes a whole idle GPU: strictly more fragmentation afterwards.
    assert share.frag_b > share.frag_a
    assert report.differing == sum(v for k, v in report.by_kind.items() if k != "same")
    assert report.mean_frag_delta > 0


def test_classify_kinds():
    from fleetpilot.policy import GpuShare, PolicyDecision

    a = PolicyDecision(action="assign", node_row=0, placement=[GpuShare(node="a", gpu=0, milli=100)])
    assert classify(a, a) == "same"
    assert classify(a, PolicyDecision(action="queue")) == "action"
    assert classify(a, msgspec.structs.replace(a, node_row=1)) == "node"
    assert classify(a, msgspec.structs.replace(a, placement=[GpuShare(node="a", gpu=1, milli=100)])) == "gpus"
