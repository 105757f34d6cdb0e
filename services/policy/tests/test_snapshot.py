"""The policy's kept snapshot: brought up to date row by row from the ledger and topology
keys that changed, built afresh when a node is new or gone, always equal to a build from the
records."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from fleetpilot.contracts import Allocation, NodeLedger, encode
from fleetpilot.policy import ClusterState

from .conftest import node, policy_state


def hold(task: str, gpu: int, milli: int, cpu: int = 0) -> Allocation:
    return Allocation(task_id=task, decision_id=f"{task}.assign", gpu=gpu, milli=milli, memory_mb=1000, cpu_milli=cpu)


def same(a: ClusterState, b: ClusterState) -> bool:
    arrays = ("cpu_free", "mem_free", "gpu_free", "gpu_mem_free", "gpu_healthy", "gpu_maintenance", "gpu_exists")
    return a.node_names == b.node_names and all(np.array_equal(getattr(a, n), getattr(b, n)) for n in arrays)


def test_the_kept_snapshot_follows_ledger_and_topology_changes(tmp_path) -> None:
    ps = policy_state(tmp_path)
    for name in ("n0", "n1", "n2"):
        ps.fleet._apply(name, encode(node(name)))
    ps.ledger._apply("n0", encode(NodeLedger(node="n0", allocations=[hold("a", 0, 500, cpu=4000)])))
    first = ps.snapshot()
    assert same(first, ps.build_snapshot()) and first.gpu_free[0].tolist() == [500, 1000]
    first.allocate(1, [0], 1000)  # a caller's copy: the kept view is not touched
    steps = [
        ("n1", NodeLedger(node="n1", allocations=[hold("b", 1, 1000), hold("c", 0, 250)])),
        ("n0", None),  # a node's ledger key deleted: all free again
        ("ghost", NodeLedger(node="ghost", allocations=[hold("d", 0, 1000)])),  # not in the topology
        ("n2", NodeLedger(node="n2", allocations=[hold("e", 0, 100), hold("f", 0, 100)])),
    ]
    for key, ledger in steps:
        ps.ledger._apply(key, encode(ledger) if ledger is not None else None)
        assert same(ps.snapshot(), ps.build_snapshot())
    assert ps.snapshot().gpu_free.tolist() == [[1000, 1000], [750, 0], [800, 1000]]
    # A topology change (a label, a new node): the view follows it.
    labelled = node("n2", labels={1: {"cordoned": "true"}})
    ps.fleet._apply("n2", encode(labelled))
    ps.fleet._apply("n3", encode(node("n3")))
    view = ps.snapshot()
    assert same(view, ps.build_snapshot())
    assert view.node_names == ["n0", "n1", "n2", "n3"] and not view.gpu_healthy[2, 1]
    assert same(ps.snapshot(without=frozenset({"b"})), ps.build_snapshot(frozenset({"b"})))
    assert ps.snapshot(without=frozenset({"b"})).gpu_free[1].tolist() == [750, 1000]


@pytest.mark.parametrize("condition", ["not_ready", "unreachable"])
def test_no_new_work_goes_to_a_gpu_of_a_silent_node(tmp_path, condition) -> None:
    # The topology service labels every GPU of a node whose collector went silent.
    ps = policy_state(tmp_path)
    ps.fleet._apply("n0", encode(node("n0")))
    ps.fleet._apply("n1", encode(node("n1", labels={0: {condition: "true"}, 1: {condition: "true"}})))
    ps.fleet._apply("n2", encode(node("n2", labels={0: {"cordoned": "true"}, 1: {"cordoned": "true"}})))
    view = ps.snapshot()
    assert view.gpu_healthy.tolist() == [[True, True], [False, False], [False, False]]
    assert same(view, ps.build_snapshot())
    # Nor a task that asks no GPU: nobody there would start it. A node whose GPUs are only
    # cordoned (running hot) still takes one.
    assert view.node_ready.tolist() == [True, False, True]
    # A node without GPUs carries its condition on itself.
    ps.fleet._apply("c0", encode(msgspec.structs.replace(node("c0"), gpus=[], labels={condition: "true"})))
    assert ps.snapshot().node_ready.tolist() == [True, False, True, False]


def test_the_fleet_without_some_tasks_redoes_only_their_rows_and_equals_a_build(tmp_path) -> None:
    ps = policy_state(tmp_path)
    for name in ("n0", "n1", "n2"):
        ps.fleet._apply(name, encode(node(name)))
    ps.ledger._apply("n0", encode(NodeLedger(node="n0", allocations=[hold("a", 0, 500), hold("b", 0, 300)])))
    ps.ledger._apply("n1", encode(NodeLedger(node="n1", allocations=[hold("c", 1, 1000)])))
    kept = ps.snapshot()
    for without in ({"a"}, {"a", "c"}, {"nobody"}, {"a", "b", "c"}):
        view = ps.snapshot(without=frozenset(without))
        assert same(view, ps.build_snapshot(frozenset(without))), without
    # The kept view is not touched by a caller's ``without``.
    assert same(ps.snapshot(), kept) and ps.snapshot().gpu_free[0].tolist() == [200, 1000]
    assert ps.snapshot(without=frozenset({"a", "b"})).gpu_free[0].tolist() == [1000, 1000]


def test_the_running_tasks_are_worked_out_again_only_when_the_ledger_changed(tmp_path) -> None:
    ps = policy_state(tmp_path)
    confirmed = [msgspec.structs.replace(hold("a", 0, 500), state="confirmed")]
    ps.ledger._apply("n0", encode(NodeLedger(node="n0", allocations=confirmed)))
    first = ps.running()
    assert [r.task_id for r in first] == ["a"] and ps.running() is first  # asked again: the same list
    ps.ledger._apply("n1", encode(NodeLedger(node="n1", allocations=[
        msgspec.structs.replace(hold("b", 1, 1000), state="confirmed")])))
    assert [r.task_id for r in ps.running()] == ["a", "b"]
    ps.ledger._apply("n0", None)
    assert [r.task_id for r in ps.running()] == ["b"]


def as_named(state: ClusterState) -> dict:
    """Every field of ``state``, its table indices turned into what they name (models, sites,
    roles and rules are numbered in the order they were met, which a kept view and a build
    need not share), its GPU columns cut to the widest node's (a kept view keeps the width a
    node gone had; its columns past every node's GPUs hold none)."""
    width = int(np.flatnonzero(state.gpu_exists.any(axis=0)).max(initial=-1)) + 1
    assert not state.gpu_exists[:, width:].any()
    out: dict = {"nodes": state.node_names}
    for name in ("cpu_total", "cpu_free", "mem_total", "mem_free", "node_ready"):
        out[name] = getattr(state, name).tolist()
    for name in ("gpu_exists", "gpu_free", "gpu_mem_total", "gpu_mem_free", "gpu_healthy", "gpu_maintenance",
                 "gpu_temp_c", "gpu_numa", "gpu_nvlink_util"):
        out[name] = getattr(state, name)[:, :width].tolist()
    out["gpu_link"] = state.gpu_link[:, :width, :width].tolist()
    out["model"] = [state.models[m] if m >= 0 else "" for m in state.node_model]
    out["site"] = [state.sites[s] for s in state.node_site]
    out["role"] = [[state.roles[r] for r in row[:width]] for row in state.gpu_role]
    out["rule"] = [[state.rule_sets[r] for r in row[:width]] for row in state.gpu_rule]  # type: ignore[union-attr]
    return out


def test_topology_changes_redo_the_rows_they_touch_and_the_view_equals_a_build(tmp_path, monkeypatch) -> None:
    # A label changing on one node made the next decision build the whole view again (~30 ms
    # on the openb fleet); now only that row is redone, unless the change cannot be (a node
    # new or gone, more GPU slots, a model or site the fleet had not).
    import random

    ps = policy_state(tmp_path)
    rng = random.Random(7)
    names = [f"n{i}" for i in range(6)]
    shapes = {name: {"gpus": 2 + i % 3, "model": ("H100", "A100")[i % 2], "site": ("eu", "us")[i % 2], "labels": {}}
              for i, name in enumerate(names)}

    def write(name: str) -> None:
        ps.fleet._apply(name, encode(node(name, **shapes[name])))

    for name in names:
        write(name)
    built: list[int] = []
    build = ps.build_snapshot
    monkeypatch.setattr(ps, "build_snapshot", lambda without=frozenset(): built.append(1) or build(without))
    ps.snapshot()
    label_values = [{"cordoned": "true"}, {"maintenance_pending": "true"}, {"role": "serving"},
                    {"task_kinds": "infer"}, {"not_ready": "true"}, {}]
    builds = 1
    width = max(shape["gpus"] for shape in shapes.values())  # the kept view's GPU columns

    def built_again() -> None:
        nonlocal builds, width
        builds += 1
        width = max(shapes[key]["gpus"] for key in ps.fleet.nodes)

    for step in range(150):
        name = rng.choice(names)
        change = rng.random()
        if change < 0.7:  # the node's record written again
            if change < 0.45:  # a GPU's labels
                gpu = rng.randrange(shapes[name]["gpus"])
                shapes[name]["labels"] = {**shapes[name]["labels"], gpu: rng.choice(label_values)}
            elif change < 0.6:  # a GPU gone or back
                shapes[name]["gpus"] = rng.randint(1, 4)
            else:  # every GPU of the node not ready (its collector silent)
                shapes[name]["labels"] = {g: {"not_ready": "true"} for g in range(shapes[name]["gpus"])}
            known = name in ps.fleet.nodes
            write(name)
            if not known or shapes[name]["gpus"] > width:  # a node back, or past the view's columns
                built_again()
        elif change < 0.75:  # a node new, or gone: the view is built again
            if name in ps.fleet.nodes and len(ps.fleet.nodes) > 2:
                ps.fleet._apply(name, None)
            else:
                write(name)
            built_again()
        else:  # its holds
            holds = [hold(f"t{step}", g, rng.choice([250, 500, 1000]), cpu=1000)
                     for g in range(shapes[name]["gpus"]) if rng.random() < 0.5]
            ps.ledger._apply(name, encode(NodeLedger(node=name, allocations=holds)))
        assert as_named(ps.snapshot()) == as_named(build()), step
        assert len(built) == builds, step  # a row redone, not the view built again
    # A GPU model the fleet had not: its tables stay sorted as a build makes them, so it is built.
    shapes["n0"]["model"] = "B200"
    write("n0")
    assert as_named(ps.snapshot()) == as_named(build())
    assert len(built) == builds + 1
