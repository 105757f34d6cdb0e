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


def test_each_snapshot_is_measured_on_its_own_fleets_models_and_width() -> None:
    # The fragmentation table was kept while the next snapshot had as many models, so a fleet
    # of other models (or wider nodes) was measured with the first one's: an effect that
    # depended on which snapshot came before.
    from fleetpilot.policy import FragTable

    typical = [TaskShape(cpu_milli=0, gpu_milli=1000, gpus=1, models=("B",), weight=1.0)]

    def snap(model: str, gpus: int) -> Snapshot:
        state = ClusterState.build(names=["a"], cpu_milli=[8000], memory_mb=[8000], gpus=[gpus],
                                   models=[model])
        return record(state, TaskRequest(task_id=f"{model}{gpus}", gpus=1, gpu_milli=500))

    later = [snap("C", 2), snap("B", 4)]
    policy = build_policy("bestfit")
    alone = [replay([s], policy, policy, typical=typical).items[0].frag_a for s in later]
    after = replay([snap("B", 2), *later], policy, policy, typical=typical).items[1:]
    assert [i.frag_a for i in after] == alone
    # Both by what FGD itself measures: model C's half-used GPU is all fragment for a B task.
    c = ClusterState.from_record(later[0].state)
    c.allocate(0, [0], 500)
    assert alone[0] == float(FragTable(typical, c.models, c.max_gpus).node_frag(c).sum()) == 1500.0
