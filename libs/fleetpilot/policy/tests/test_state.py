"""ClusterState: construction, incremental updates, serialisation, topology conversion."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from fleetpilot.contracts import Allocation, GpuInfo, Link, NodeTopology, TaskSubmitted
from fleetpilot.contracts.fingerprint import Fingerprint
from fleetpilot.policy import ClusterState, ClusterStateRecord, TaskRequest, build_policy


def small() -> ClusterState:
    return ClusterState.build(names=["a", "b"], cpu_milli=[8000, 4000], memory_mb=[1000, 1000],
                              gpus=[2, 1], models=["T4", "A100"])


def test_build_pads_gpu_slots():
    s = small()
    assert s.max_gpus == 2
    assert s.gpu_exists.tolist() == [[True, True], [True, False]]
    assert s.gpu_free.tolist() == [[1000, 1000], [1000, 0]]
    assert s.models == ["A100", "T4"] and s.node_model.tolist() == [1, 0]


@pytest.mark.parametrize(
    ("node", "gpus", "milli", "cpu", "free_after", "cpu_after"),
    [(0, [1], 300, 1000, [[1000, 700], [1000, 0]], [7000, 4000]),
     (1, [0], 1000, 4000, [[1000, 1000], [0, 0]], [8000, 0]),
     (0, [], 0, 500, [[1000, 1000], [1000, 0]], [7500, 4000])],
)
def test_allocate_then_release_restores(node, gpus, milli, cpu, free_after, cpu_after):
    s = small()
    s.allocate(node, gpus, milli, cpu_milli=cpu)
    assert s.gpu_free.tolist() == free_after and s.cpu_free.tolist() == cpu_after
    assert s.version[node] == 1
    s.release(node, gpus, milli, cpu_milli=cpu)
    assert s.gpu_free.tolist() == small().gpu_free.tolist() and s.cpu_free.tolist() == [8000, 4000]


@pytest.mark.parametrize(("node", "gpus", "milli", "cpu"), [(1, [1], 100, 0), (0, [0], 1200, 0), (1, [0], 10, 5000)])
def test_allocate_rejects_what_does_not_fit(node, gpus, milli, cpu):
    s = small()
    with pytest.raises(ValueError):
        s.allocate(node, gpus, milli, cpu_milli=cpu)
    assert s.gpu_free.tolist() == small().gpu_free.tolist()


def test_round_trips_json_and_npz():
    s = small()
    s.allocate(0, [0], 250, cpu_milli=10)
    rec = msgspec.json.decode(msgspec.json.encode(s.to_record()), type=ClusterStateRecord)
    for back in (ClusterState.from_record(rec), ClusterState.from_npz_bytes(s.to_npz_bytes())):
        assert back.node_names == s.node_names
        np.testing.assert_array_equal(back.gpu_free, s.gpu_free)
        np.testing.assert_array_equal(back.gpu_link, s.gpu_link)
        assert back.gpu_free.dtype == s.gpu_free.dtype


def test_from_topology_applies_ledger_roles_links_and_health():
    nodes = [NodeTopology(node="n1", site="eu", cpu_milli=16000, memory_mb=64000,
                          gpus=[GpuInfo(index=0, model="A100", memory_mb=40000, labels={"role": "serving"}),
                                GpuInfo(index=1, model="A100", memory_mb=40000)],
                          links=[Link(a="GPU0", b="GPU1", kind="SYS")])]
    holds = {"n1": [Allocation(task_id="t", decision_id="d", gpu=1, milli=400, memory_mb=1000, cpu_milli=2000)]}
    s = ClusterState.from_topology(nodes, holds, temperatures={("n1", 0): 80.0}, unhealthy=[("n1", 0)])
    assert s.gpu_free.tolist() == [[1000, 600]] and s.cpu_free.tolist() == [14000]
    assert s.gpu_mem_free.tolist() == [[40000, 39000]]
    assert s.roles == ["", "serving"] and s.gpu_role.tolist() == [[1, 0]]
    assert s.gpu_link[0, 0, 1] == 6 and s.gpu_temp_c[0, 0] == 80.0
    assert s.usable_free().tolist() == [[0, 600]]


def test_from_topology_gives_each_node_its_own_links_and_rules_when_nodes_share_them():
    # Nodes of one make share their links and labels, and a build works each set out once:
    # a node whose links or labels differ must still get its own.
    def node(name: str, links: list[Link], **labels: str) -> NodeTopology:
        return NodeTopology(node=name, cpu_milli=8000, memory_mb=8000, links=links,
                            gpus=[GpuInfo(index=i, model="A100", memory_mb=40000, labels=dict(labels)) for i in range(3)])
    nvlinked = [Link(a="GPU0", b="GPU1", kind="NV"), Link(a="GPU1", b="GPU2", kind="NV"), Link(a="GPU0", b="GPU2", kind="NV")]
    apart = [Link(a="GPU0", b="GPU1", kind="SYS"), Link(a="GPU0", b="NIC0", kind="PIX"), Link(a="GPU2", b="GPU1", kind="PHB")]
    s = ClusterState.from_topology([node("a", nvlinked), node("b", apart, role="serving"), node("c", nvlinked),
                                    node("d", apart, task_kinds="infer")])
    nv = [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
    far = [[0, 6, 4], [6, 0, 4], [4, 4, 0]]  # GPU0-GPU2: no link named, unknown
    assert [s.gpu_link[i].tolist() for i in range(4)] == [nv, far, nv, far]
    assert [[s.rule_sets[r].role for r in row] for row in s.gpu_rule.tolist()] == [["general"] * 3, ["serving"] * 3,
                                                                                 ["general"] * 3, ["general"] * 3]
    assert [s.rule_sets[r].task_kinds for r in s.gpu_rule[3]] == [("infer",)] * 3
    assert s.gpu_role.tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]


def test_task_request_from_submitted_uses_fingerprint_spread():
    task = TaskSubmitted(task_id="t", kind="finetune", gpus=1, gpu_milli=500, gpu_models=["A100"],
                         labels={"role": "training"})
    fp = Fingerprint(signature="s", pattern="linear", pattern_confidence=0.9, growth_rate_mb_per_s=1.0,
                     predicted_peak_mb=10000, peak_low_mb=8000, peak_high_mb=12000)  # ±2 sd
    r = TaskRequest.from_submitted(task, fp)
    assert r.shares_gpu and r.gpu_models == ("A100",) and r.role == "training"
    assert r.predicted_peak_mb == 10000 and r.peak_sigma_mb == pytest.approx(1000.0)


def test_set_condition_flags_gpus_and_bumps_only_that_nodes_version() -> None:
    state = ClusterState.build(names=["a", "b"], cpu_milli=[8000, 8000], memory_mb=[1000, 1000], gpus=[4, 4],
                               models=["T4", "T4"])
    state.set_condition(1, [0, 2], healthy=False)
    state.set_condition(1, [3], maintenance=True)
    assert state.gpu_healthy[1].tolist() == [False, True, False, True] and state.gpu_healthy[0].all()
    assert state.gpu_maintenance[1].tolist() == [False, False, False, True] and not state.gpu_maintenance[0].any()
    assert state.version.tolist() == [0, 2]
    assert state.usable_free()[1].tolist() == [0, 1000, 0, 0]
    state.set_condition(1, [0, 3], healthy=np.array([True, True]), maintenance=np.array([False, False]))
    assert state.usable_free()[1].tolist() == [1000, 1000, 0, 1000]


def ruled_fleet() -> ClusterState:
    """n1: GPU 0 reserved, GPU 1 reports driver 550.54.15; n2: GPU 0 pinned to 535 and for
    inference only, GPU 1 nothing said."""
    gpu = lambda i, **labels: GpuInfo(index=i, model="A100", memory_mb=40000, labels=labels)  # noqa: E731
    nodes = [NodeTopology(node="n1", cpu_milli=16000, memory_mb=64000,
                          gpus=[gpu(0, business_role="train", role="reserved"), gpu(1, driver_version="550.54.15")]),
             NodeTopology(node="n2", cpu_milli=16000, memory_mb=64000,
                          gpus=[gpu(0, driver_pin="535", driver_version="550.54.15", task_kinds="infer, encode"),
                                gpu(1)])]
    return ClusterState.from_topology(nodes)


@pytest.mark.parametrize(("kind", "labels", "allowed"), [
    ("train", {}, [[False, True], [False, True]]),
    ("infer", {}, [[False, True], [True, True]]),
    ("infer", {"driver": "535"}, [[False, False], [True, True]]),  # the pin beats the reported version
    ("train", {"driver": "550"}, [[False, True], [False, True]]),  # a prefix of 550.54.15
    ("train", {"driver": "550.54.14"}, [[False, False], [False, True]]),
])
def test_business_rules_from_labels_decide_which_gpus_a_task_may_use(kind, labels, allowed) -> None:
    s = ruled_fleet()
    assert s.allowed(TaskRequest(task_id="t", kind=kind, labels=labels)).tolist() == allowed


def test_business_rules_survive_every_round_trip_and_old_records_read_as_none() -> None:
    s = ruled_fleet()
    rec = msgspec.json.decode(msgspec.json.encode(s.to_record()), type=ClusterStateRecord)
    task = TaskRequest(task_id="t", kind="infer", labels={"driver": "535"})
    for back in (ClusterState.from_record(rec), ClusterState.from_npz_bytes(s.to_npz_bytes()), s.copy()):
        assert back.rule_sets == s.rule_sets and back.allowed(task).tolist() == s.allowed(task).tolist()
    old = msgspec.structs.replace(rec, arrays={k: v for k, v in rec.arrays.items() if k != "gpu_rule"})
    old_json = msgspec.json.encode(old).replace(b',"rule_sets"', b',"ignored"')
    back = ClusterState.from_record(msgspec.json.decode(old_json, type=ClusterStateRecord))
    assert back.allowed(task).all()


def test_an_empty_fleet_round_trips_and_replays() -> None:
    # A snapshot taken before any node reported: JSON keeps no shape for empty lists, so the
    # per-GPU arrays read back one-dimensional and every policy (and ``replay``) failed on
    # ``max_gpus`` with an IndexError instead of queueing the task.
    from fleetpilot.policy import build_policy, record, replay
    from fleetpilot.policy.replay import Snapshot

    empty = ClusterState.build(names=[], cpu_milli=[], memory_mb=[], gpus=[], models=[])
    task = TaskRequest(task_id="t", gpus=1)
    snap = msgspec.json.decode(msgspec.json.encode(record(empty, task)), type=Snapshot)
    for back in (ClusterState.from_record(snap.state), ClusterState.from_npz_bytes(empty.to_npz_bytes())):
        for name in ("gpu_free", "gpu_exists", "gpu_rule", "gpu_link", "cpu_free"):
            assert getattr(back, name).shape == getattr(empty, name).shape, name
        assert back.n_nodes == 0 and back.max_gpus == empty.max_gpus
    report = replay([snap], build_policy("fgd"), build_policy("k8s-default"))
    assert (report.total, report.differing) == (1, 0) and report.items[0].a.action == "queue"
    assert (report.items[0].frag_a, report.mean_frag_delta) == (0.0, 0.0)  # nothing free: nothing fragmented


def test_a_node_whose_first_gpu_is_lost_keeps_its_model():
    """The collector reports a GPU fallen off the bus with no model. As its node's first GPU,
    it took the node's model away: tasks naming the model never used the healthy GPUs."""
    from fleetpilot.contracts import GpuInfo, NodeTopology

    gpus = [GpuInfo(index=0, model="", memory_mb=0), GpuInfo(index=1, model="A100", memory_mb=40_000)]
    state = ClusterState.from_topology([NodeTopology(node="n", cpu_milli=8_000, memory_mb=64_000, gpus=gpus)])
    assert state.models[state.node_model[0]] == "A100"


def test_a_nodes_gpu_slots_are_the_indices_it_reports():
    """A node reporting GPUs 0 and 2 (GPU 1 gone from the report) had slots 0 and 1: a
    placement on "GPU 1" named a device that is not there, GPU 2 was never offered, and a
    condition on GPU 2 crashed the build. A negative or repeated index took another slot."""
    from fleetpilot.contracts import GpuInfo, NodeTopology

    gpus = [GpuInfo(index=0, model="A100", memory_mb=100), GpuInfo(index=2, model="A100", memory_mb=300),
            GpuInfo(index=-1, model="A100", memory_mb=7), GpuInfo(index=0, model="A100", memory_mb=9)]
    links = [Link(a="GPU0", b="GPU2", kind="SYS"), Link(a="GPUx", b="GPU0", kind="NV"),
             Link(a="GPU-1", b="GPU2", kind="NV")]  # malformed ends: ignored, not a crash
    nodes = [NodeTopology(node="n", cpu_milli=8000, memory_mb=8000, gpus=gpus, links=links),
             NodeTopology(node="m", cpu_milli=8000, memory_mb=8000, gpus=gpus[:1])]
    state = ClusterState.from_topology(nodes, unhealthy=[("n", 2), ("n", 9), ("m", 2)],
                                       temperatures={("n", 9): 99.0})
    assert state.gpu_exists.tolist() == [[True, False, True], [True, False, False]]
    assert state.gpu_free.tolist() == [[1000, 0, 1000], [1000, 0, 0]]
    assert state.gpu_mem_total.tolist() == [[100, 0, 300], [100, 0, 0]]
    assert state.gpu_healthy.tolist() == [[True, False, False], [True, False, False]]
    assert state.gpu_link[0, 0, 2] == state.gpu_link[0, 2, 0] == 6 and state.gpu_link[0, 1, 2] == 4
    d = build_policy("bestfit").decide(state, TaskRequest(task_id="t", gpus=2))
    assert d.action == "queue"  # node n has one usable GPU now, not two


def test_a_hold_on_a_gpu_the_node_lacks_keeps_its_cpu_and_crashes_nothing():
    """A ledger hold on a GPU index past the fleet's slots (a stale or corrupt row) made the
    whole snapshot fail with an IndexError: no decision for any task."""
    from fleetpilot.contracts import GpuInfo, NodeTopology

    topo = NodeTopology(node="n", cpu_milli=8000, memory_mb=8000, gpus=[GpuInfo(index=0, model="A100")])
    state = ClusterState.from_topology([topo], {"n": [Allocation(task_id="t", decision_id="t.assign", gpu=5,
                                                                 milli=1000, cpu_milli=2000)]})
    assert state.cpu_free.tolist() == [6000] and state.gpu_free.tolist() == [[1000]]


def test_node_names_must_be_unique():
    """Two rows of one name: decisions name the node, the ledger's holds went to the last row
    only, and the first showed its whole capacity free (double booking)."""
    from fleetpilot.contracts import NodeTopology

    with pytest.raises(ValueError, match="node 'n' appears twice"):
        ClusterState.from_topology([NodeTopology(node="n", cpu_milli=8000),
                                    NodeTopology(node="n", cpu_milli=4000)])
    with pytest.raises(ValueError, match="node 'a' appears twice"):
        ClusterState.build(names=["a", "b", "a"], cpu_milli=[1, 1, 1], memory_mb=[1, 1, 1], gpus=[1, 1, 1],
                           models=["X"] * 3)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda a: a.pop("gpu_temp_c"), "lacks the array 'gpu_temp_c'"),
    (lambda a: a.__setitem__("cpu_free", [1, 2, 3]), "'cpu_free' has shape"),
    (lambda a: a.__setitem__("gpu_free", [[1000]]), "'gpu_free' has shape"),
    (lambda a: a.__setitem__("gpu_link", [[[0]]]), "'gpu_link' has shape"),
])
def test_a_state_record_with_a_missing_or_misshapen_array_says_which(edit, message):
    """A replay file with an array left out was a bare ``KeyError``; one of the wrong length
    loaded, and the policies then read past it or broadcast it."""
    rec = small().to_record()
    edit(rec.arrays)
    back = msgspec.json.decode(msgspec.json.encode(rec), type=ClusterStateRecord)
    with pytest.raises(ValueError, match=message):
        ClusterState.from_record(back)
