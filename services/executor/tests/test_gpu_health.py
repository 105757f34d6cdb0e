"""GPU health in the executor service over a real nats-server: pre-decommission under two
competing replicas, predictive-maintenance labels, labels surviving a topology rewrite."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
from fleetpilot.contracts import (
    ActionExecuted,
    ActionFailed,
    Allocation,
    DecisionMade,
    NodeLedger,
    Placement,
    PolicyRef,
    TaskLifecycle,
    TaskSubmitted,
    encode,
    now,
)
from fleetpilot.executor.decommission import lock_key
from fleetpilot.maintenance.windows import HealthWindows
from fleetpilot.runtime.testing import eventually as wait_for
from fleetpilot_services.executor.service import ExecutorSettings, build

from .conftest import gpu_sample, node_topology, publish_telemetry


def settings(nats_url: str, tmp_path: Path, replica: str, **overrides) -> ExecutorSettings:
    return ExecutorSettings(
        nats_url=nats_url, metrics_port=-1, replica=replica, state_dir=str(tmp_path), **overrides
    )


async def gpu_labels(observer, node: str, gpu: int) -> dict[str, str]:
    topo = await observer.topology(node)
    return dict(topo.gpus[gpu].labels) if topo else {}


async def wait_labels(observer, node: str, gpu: int, *names: str) -> dict[str, str]:
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        labels = await gpu_labels(observer, node, gpu)
        if all(n in labels for n in names):
            return labels
        assert asyncio.get_running_loop().time() < deadline, f"labels {names} never appeared: {labels}"
        await asyncio.sleep(0.05)


async def test_overheating_gpu_is_cordoned_and_decommissioned_once_by_two_competing_executors(
    observer, sim_fleet, nats_url, tmp_path
):
    await observer.kv_put("topology", "n1", encode(node_topology("n1")))
    await observer.kv_put(
        "ledger",
        "n1",
        encode(
            NodeLedger(
                node="n1",
                allocations=[
                    Allocation(task_id="busy", decision_id="d0", gpu=0, milli=1000, state="confirmed"),
                    Allocation(task_id="elsewhere", decision_id="d9", gpu=1, milli=1000, state="confirmed"),
                ],
            )
        ),
    )
    hosts = [build(settings(nats_url, tmp_path, replica)) for replica in ("a", "b")]
    for host in hosts:
        await host.start()
    try:
        # Sample times drive the state machine: hot at t0, cordoned 5 minutes later,
        # decommissioned when the 30-minute drain is over with the task still there.
        t0 = 1_000_000.0
        for at in (t0, t0 + 100):
            await publish_telemetry(
                observer, "n1", [gpu_sample("n1", 0, at, 95.0), gpu_sample("n1", 1, at, 60.0)]
            )
        await asyncio.sleep(0.3)
        assert await gpu_labels(observer, "n1", 0) == {}  # hot, not yet for long enough

        await publish_telemetry(observer, "n1", [gpu_sample("n1", 0, t0 + 300, 95.0)])
        labels = await wait_labels(observer, "n1", 0, "cordoned")
        assert "decommissioned" not in labels

        # New work for the cordoned GPU is refused by whichever replica takes it.
        refused = DecisionMade(
            decision_id="d1",
            task_id="new",
            action="assign",
            placement=[Placement(node="n1", gpu=0, milli=500)],
            confidence=0.9,
            policy=PolicyRef(name="best-fit"),
            decided_at=now(),
            task=TaskSubmitted(task_id="new"),
        )
        await observer.js.publish("decision.made", encode(refused))
        failed = await observer.wait_stored("action.failed", ActionFailed, 1)
        assert "cordoned" in failed[0].error and not failed[0].retryable

        await publish_telemetry(observer, "n1", [gpu_sample("n1", 0, t0 + 300 + 1800, 95.0)])
        labels = await wait_labels(observer, "n1", 0, "decommissioned")
        evicted = await observer.wait_stored("task.lifecycle.*", TaskLifecycle, 1)
        # Late samples change nothing: the GPU is out of service.
        await publish_telemetry(observer, "n1", [gpu_sample("n1", 0, t0 + 4000, 95.0)])
        await asyncio.sleep(0.5)
        evicted = await observer.stored("task.lifecycle.*", TaskLifecycle)
        done_marker = await observer.kv_get("hook_locks", lock_key("n1", 0, "GPU-n1-0") + ".done")
        ledger = await observer.ledger("n1")
    finally:
        for host in hosts:
            await host.stop()
    assert labels["cordoned"] == labels["decommissioned"] == "true"
    assert await gpu_labels(observer, "n1", 1) == {}
    assert [(e.task_id, e.state, e.gpus) for e in evicted] == [("busy", "evicted", [0])]
    assert "decommissioned" in evicted[0].detail
    assert [c.task_id for c in sim_fleet.verbs("remove")] == ["busy"]
    assert done_marker is not None and done_marker.startswith(b'{"owner":')
    assert [a.task_id for a in ledger.allocations] == ["elsewhere"]


async def test_a_decommission_leaves_a_task_that_only_holds_a_reservation_on_the_gpu_and_runs_elsewhere(
    observer, sim_fleet, nats_url, tmp_path
):
    """``mover`` runs on GPU 1 and holds a reservation on GPU 0, a move's target. Evicted with
    GPU 0, it was stopped where it runs (the simulator removed it) and told evicted: the
    policy placed it again while its first run, on another node's executor, went on."""
    await observer.kv_put("topology", "n1", encode(node_topology("n1")))
    await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1", allocations=[
        Allocation(task_id="busy", decision_id="d0", gpu=0, milli=1000, state="confirmed"),
        Allocation(task_id="mover", decision_id="d1", gpu=1, milli=1000, state="confirmed"),
        Allocation(task_id="mover", decision_id="d2", gpu=0, milli=500, state="reserved"),
    ])))
    host = build(settings(nats_url, tmp_path, "a"))
    await host.start()
    try:
        t0 = 1_000_000.0
        for at in (t0, t0 + 300, t0 + 300 + 1800):  # hot, cordoned, decommissioned
            await publish_telemetry(observer, "n1", [gpu_sample("n1", 0, at, 95.0)])
            await asyncio.sleep(0.1)
        await wait_labels(observer, "n1", 0, "decommissioned")
        evicted = await observer.wait_stored("task.lifecycle.*", TaskLifecycle, 1)
        await asyncio.sleep(0.3)
        evicted = await observer.stored("task.lifecycle.*", TaskLifecycle)
        ledger = await observer.ledger("n1")
    finally:
        await host.stop()
    assert [(e.task_id, e.state) for e in evicted] == [("busy", "evicted")]
    assert [c.task_id for c in sim_fleet.verbs("remove")] == ["busy"]
    assert sorted((a.task_id, a.gpu, a.state) for a in ledger.allocations) == [
        ("mover", 0, "reserved"), ("mover", 1, "confirmed")]


async def test_gpu_with_decaying_hardware_is_labelled_maintenance_pending(observer, nats_url, tmp_path):
    await observer.kv_put("topology", "n1", encode(node_topology("n1")))
    host = build(settings(nats_url, tmp_path, "a", health_interval_s=0.1))
    await host.start()
    try:
        t0 = 1_000_000.0
        await publish_telemetry(observer, "n1", [gpu_sample("n1", 0, t0), gpu_sample("n1", 1, t0)])
        # GPU 0: two double-bit ECC errors (XID 48) in a minute; GPU 1 stays quiet.
        await publish_telemetry(
            observer,
            "n1",
            [
                gpu_sample("n1", 0, t0 + 60, ecc_uncorrected=2, xid_count=2, xid_last=48),
                gpu_sample("n1", 1, t0 + 60),
            ],
        )
        labels = await wait_labels(observer, "n1", 0, "maintenance_pending")
        await asyncio.sleep(0.3)  # a few more assessments: the quiet GPU must stay unlabelled
        quiet = await gpu_labels(observer, "n1", 1)
    finally:
        await host.stop()
    assert labels["maintenance_pending"] == "true"
    assert float(labels["maintenance_risk"]) >= 0.85
    assert "cordoned" not in labels
    assert quiet == {}
    # /metrics shows each GPU's failure probability: the flagged one at its label's risk.
    risk = {gpu: host.metrics.registry.get_sample_value("fleetpilot_executor_gpu_failure_probability",
                                                        {"node": "n1", "gpu": gpu}) for gpu in ("0", "1")}
    assert risk["0"] == float(labels["maintenance_risk"]) and risk["1"] < 0.85


async def flag_gpu_0_for_maintenance(observer, t0: float) -> dict[str, str]:
    """Two double-bit ECC errors (XID 48) in a minute on n1's GPU 0: its labels once flagged."""
    await publish_telemetry(observer, "n1", [gpu_sample("n1", 0, t0)])
    await publish_telemetry(observer, "n1", [gpu_sample("n1", 0, t0 + 60, ecc_uncorrected=2, xid_count=2,
                                                        xid_last=48)])
    return await wait_labels(observer, "n1", 0, "maintenance_pending")


async def set_gpu_0_labels(observer, **labels: str) -> None:
    """What an operator does by hand: set labels on n1's GPU 0 in the topology bucket."""
    topo = await observer.topology("n1")
    gpus = list(topo.gpus)
    gpus[0] = msgspec.structs.replace(gpus[0], labels={**gpus[0].labels, **labels})
    await observer.kv_put("topology", "n1", encode(msgspec.structs.replace(topo, gpus=gpus)))


async def test_an_operator_s_clearing_of_maintenance_pending_stands(observer, nats_url, tmp_path):
    # The executor put back every label of its own that an entry no longer held as it had
    # set it: an operator's "false" came back as "true" within a second, and no label could be
    # cleared while the replica that set it ran. Nor may the spent evidence flag it again.
    await observer.kv_put("topology", "n1", encode(node_topology("n1")))
    host = build(settings(nats_url, tmp_path, "a", health_interval_s=0.1))
    await host.start()
    try:
        flagged = await flag_gpu_0_for_maintenance(observer, 1_000_000.0)
        await set_gpu_0_labels(observer, maintenance_pending="false")
        await publish_telemetry(observer, "n1", [gpu_sample("n1", 0, 1_000_120.0, ecc_uncorrected=2, xid_count=2,
                                                            xid_last=48)])  # the same board, nothing new
        await asyncio.sleep(1.0)  # ten assessments
        after = await gpu_labels(observer, "n1", 0)
    finally:
        await host.stop()
    assert after["maintenance_pending"] == "false"
    assert flagged["maintenance_pending"] == "true" and flagged["maintenance_board"] == "GPU-n1-0"


async def test_a_gpu_flagged_for_maintenance_is_back_in_service_once_its_board_is_replaced(
        observer, nats_url, tmp_path):
    # The label stayed on the slot for good: the board swapped in was kept out of service
    # until someone remembered to clear it by hand.
    await observer.kv_put("topology", "n1", encode(node_topology("n1")))
    host = build(settings(nats_url, tmp_path, "a", health_interval_s=0.1))
    await host.start()
    try:
        await flag_gpu_0_for_maintenance(observer, 1_000_000.0)
        new = [gpu_sample("n1", 0, 1_000_600.0 + 30 * i, uuid="GPU-new-board") for i in range(2)]
        for sample in new:
            await publish_telemetry(observer, "n1", [sample])

        async def back() -> dict[str, str] | None:
            labels = await gpu_labels(observer, "n1", 0)
            return labels if labels.get("maintenance_pending") == "false" else None

        labels = await wait_for(back, timeout_s=10, what="the label lifted for the new board")
    finally:
        await host.stop()
    assert labels["maintenance_board"] == "GPU-new-board"


async def test_labels_are_put_back_when_the_topology_service_rewrites_the_node(observer, nats_url, tmp_path):
    await observer.kv_put("topology", "n1", encode(node_topology("n1")))
    host = build(settings(nats_url, tmp_path, "a", decommission_hot_for_s=0))
    await host.start()
    try:
        await publish_telemetry(observer, "n1", [gpu_sample("n1", 1, 1_000_000.0, 95.0)])
        await wait_labels(observer, "n1", 1, "cordoned")
        # A collector reported a changed node; the topology service writes it without labels.
        await observer.kv_put("topology", "n1", encode(node_topology("n1", gpus=3)))
        labels = await wait_labels(observer, "n1", 1, "cordoned")
        topo = await observer.topology("n1")
    finally:
        await host.stop()
    assert labels["cordoned"] == "true"
    assert len(topo.gpus) == 3  # the rewrite itself is kept


async def test_a_replica_started_after_the_cordon_refuses_work_for_the_labelled_gpu(
    observer, sim_fleet, nats_url, tmp_path
):
    topo = node_topology("n1")
    labelled = msgspec.structs.replace(topo.gpus[0], labels={"cordoned": "true"})
    await observer.kv_put(
        "topology", "n1", encode(msgspec.structs.replace(topo, gpus=[labelled, topo.gpus[1]]))
    )
    host = build(settings(nats_url, tmp_path, "fresh"))
    await host.start()
    try:
        for decision_id, gpu in (("d1", 0), ("d2", 1)):
            await observer.js.publish("decision.made", encode(assign_to(decision_id, gpu)))
        failed = await observer.wait_stored("action.failed", ActionFailed, 1)
        executed = await observer.wait_stored("action.executed", ActionExecuted, 1)
    finally:
        await host.stop()
    assert [(f.decision_id, f.retryable) for f in failed] == [("d1", False)]
    assert "cordoned" in failed[0].error
    assert [e.decision_id for e in executed] == ["d2"]
    assert [c.gpus for c in sim_fleet.verbs("place")] == [[1]]


def assign_to(decision_id: str, gpu: int) -> DecisionMade:
    return DecisionMade(
        decision_id=decision_id,
        task_id=f"t-{decision_id}",
        action="assign",
        placement=[Placement(node="n1", gpu=gpu, milli=500)],
        confidence=0.9,
        policy=PolicyRef(name="best-fit"),
        decided_at=now(),
        task=TaskSubmitted(task_id=f"t-{decision_id}"),
    )


def test_health_windows_keep_one_sample_per_interval_within_the_window():
    windows = HealthWindows(window_s=300, every_s=30)
    for at in range(0, 601, 10):
        windows.add(gpu_sample("n1", 0, float(at)))
    kept = [s.at for s in windows.of("n1", 0)]
    assert kept == [float(t) for t in range(300, 601, 30)]


async def test_business_labels_on_the_topology_are_enforced(observer, sim_fleet, nats_url, tmp_path):
    topo = node_topology("n1")
    pinned = msgspec.structs.replace(topo.gpus[0], labels={"driver_pin": "535", "driver_version": "535.104.05"})
    reserved = msgspec.structs.replace(topo.gpus[1], labels={"business_role": "reserved"})
    await observer.kv_put("topology", "n1", encode(msgspec.structs.replace(topo, gpus=[pinned, reserved])))
    host = build(settings(nats_url, tmp_path, "a"))
    await host.start()
    try:
        for decision_id, gpu, driver in (("d1", 0, "550"), ("d2", 1, None), ("d3", 0, "535")):
            d = assign_to(decision_id, gpu)
            labels = {"driver": driver} if driver else {}
            d = msgspec.structs.replace(d, task=msgspec.structs.replace(d.task, labels=labels))
            await observer.js.publish("decision.made", encode(d))
        failed = await observer.wait_stored("action.failed", ActionFailed, 2)
        executed = await observer.wait_stored("action.executed", ActionExecuted, 1)
    finally:
        await host.stop()
    reasons = {f.decision_id: f.error for f in failed}
    assert sorted(reasons) == ["d1", "d2"] and not any(f.retryable for f in failed)
    assert "535" in reasons["d1"] and "550" in reasons["d1"] and "reserved" in reasons["d2"]
    assert [e.decision_id for e in executed] == ["d3"]
    assert [c.gpus for c in sim_fleet.verbs("place")] == [[0]]


async def test_a_forgotten_node_that_reports_again_is_a_new_node(observer, sim_fleet, nats_url, tmp_path):
    # A running replica kept what it had labelled on a node, what its hook made of the node's
    # GPUs and their samples: forgotten (its key deleted, `fleetpilot fleet forget`) and back,
    # the node came back cordoned, decommissioned and flagged for maintenance, and its GPU
    # refused every assign.
    await observer.kv_put("topology", "n1", encode(node_topology("n1")))
    host = build(settings(nats_url, tmp_path, "a", decommission_hot_for_s=0, health_interval_s=0.1))
    await host.start()
    try:
        flagged = await flag_gpu_0_for_maintenance(observer, 1_000_000.0)
        await publish_telemetry(observer, "n1", [gpu_sample("n1", 1, 1_000_000.0, 95.0)])
        pulled = await wait_labels(observer, "n1", 1, "cordoned", "decommissioned")
        topology = await observer.js.key_value("topology")
        await topology.delete("n1")
        await observer.kv_put("topology", "n1", encode(node_topology("n1")))
        await asyncio.sleep(1.0)  # the delete, the new node, and ten assessments
        after = [await gpu_labels(observer, "n1", gpu) for gpu in (0, 1)]
        await observer.js.publish("decision.made", encode(assign_to("d-back", 1)))
        executed = await observer.wait_stored("action.executed", ActionExecuted, 1, timeout_s=5.0)
        failed = await observer.stored("action.failed", ActionFailed)
    finally:
        await host.stop()
    assert flagged["maintenance_pending"] == "true"
    assert pulled["cordoned"] == pulled["decommissioned"] == "true"
    assert after == [{}, {}]
    assert [f.error for f in failed] == []
    assert [e.decision_id for e in executed] == ["d-back"]
