"""GPU indices renumber (a GPU fell off the bus, a reboot with a board swapped): what the
executor made of a board (its cordon, its maintenance flag, the labels it keeps on the
topology) follows the board by its NVML uuid, not the index it used to read at."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
from fleetpilot.contracts import (
    ActionExecuted,
    ActionFailed,
    Allocation,
    DecisionMade,
    GpuInfo,
    NodeLedger,
    NodeTopology,
    Placement,
    PolicyRef,
    TaskLifecycle,
    TaskSubmitted,
    encode,
    now,
)
from fleetpilot.runtime.memory import InMemoryBus
from fleetpilot_services.executor.fleet_labels import FleetLabels
from fleetpilot_services.executor.health import GpuHealth
from fleetpilot_services.executor.service import ExecutorSettings, build

from .conftest import gpu_sample, publish_telemetry

A, B, HOT, NEW = "GPU-a", "GPU-b", "GPU-hot", "GPU-new"


def topology(*boards: str, labels: dict[str, dict[str, str]] | None = None) -> NodeTopology:
    """n1 with ``boards`` at indices 0.. in order, and ``labels`` by board, as the topology
    service stores it (it carries operational labels over by uuid)."""
    labels = labels or {}
    return NodeTopology(node="n1", gpus=[GpuInfo(index=i, model="H100", uuid=u, memory_mb=81920,
                                                 labels=labels.get(u, {})) for i, u in enumerate(boards)])


def settings(nats_url: str, tmp_path: Path, **overrides) -> ExecutorSettings:
    return ExecutorSettings(nats_url=nats_url, metrics_port=-1, replica="a", state_dir=str(tmp_path), **overrides)


def assign_to(decision_id: str, gpu: int) -> DecisionMade:
    return DecisionMade(decision_id=decision_id, task_id=f"t-{decision_id}", action="assign",
                        placement=[Placement(node="n1", gpu=gpu, milli=500)], confidence=0.9,
                        policy=PolicyRef(name="best-fit"), decided_at=now(),
                        task=TaskSubmitted(task_id=f"t-{decision_id}"))


async def labels_by_board(observer) -> dict[str, dict[str, str]]:
    topo = await observer.topology("n1")
    return {g.uuid: dict(g.labels) for g in topo.gpus} if topo else {}


async def started_with_a_busy_board_at_2(observer, nats_url, tmp_path):
    """An executor started on boards A, B and HOT (at 0, 1, 2), a task ``busy`` held on HOT
    (at 2) and the hook's hot time 0: HOT is cordoned at its first hot sample."""
    await observer.kv_put("topology", "n1", encode(topology(A, B, HOT)))
    await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1", allocations=[
        Allocation(task_id="busy", decision_id="d0", gpu=2, milli=1000, state="confirmed", gpu_uuid=HOT)])))
    host = build(settings(nats_url, tmp_path, decommission_hot_for_s=0))
    await host.start()
    return host


async def test_a_cordoned_board_renumbered_from_index_2_to_1_stays_cordoned_and_the_board_now_at_2_takes_work(
    observer, sim_fleet, nats_url, tmp_path
):
    # Keyed by index, the executor put its cordon back on index 2 after the topology service
    # had carried it over to the hot board at 1, and its hook refused the healthy board at 2.
    host = await started_with_a_busy_board_at_2(observer, nats_url, tmp_path)
    try:
        t0 = 1_000_000.0
        await publish_telemetry(observer, "n1", [gpu_sample("n1", 0, t0, uuid=A), gpu_sample("n1", 1, t0, uuid=B),
                                                 gpu_sample("n1", 2, t0, 95.0, uuid=HOT)])

        async def cordoned() -> bool:
            return (await labels_by_board(observer)).get(HOT, {}).get("cordoned") == "true"

        deadline = asyncio.get_running_loop().time() + 10
        while not await cordoned():
            assert asyncio.get_running_loop().time() < deadline, await labels_by_board(observer)
            await asyncio.sleep(0.05)
        # Board B fell off the bus; enumerated again, the hot board reads as 1 and a new one as 2.
        # The topology service stores the node anew, the cordon carried over with its board.
        await observer.kv_put("topology", "n1", encode(topology(A, HOT, NEW, labels={HOT: {"cordoned": "true"}})))
        await publish_telemetry(observer, "n1", [gpu_sample("n1", 0, t0 + 60, uuid=A),
                                                 gpu_sample("n1", 1, t0 + 60, 95.0, uuid=HOT),
                                                 gpu_sample("n1", 2, t0 + 60, uuid=NEW)])
        await asyncio.sleep(0.5)  # the rewrite seen, the samples taken
        for decision_id, gpu in (("d-new", 2), ("d-hot", 1)):
            await observer.js.publish("decision.made", encode(assign_to(decision_id, gpu)))
        executed = await observer.wait_stored("action.executed", ActionExecuted, 1)
        failed = await observer.wait_stored("action.failed", ActionFailed, 1)
        stored = await observer.topology("n1")
    finally:
        await host.stop()
    assert [(g.index, g.uuid, g.labels.get("cordoned")) for g in stored.gpus] == [
        (0, A, None), (1, HOT, "true"), (2, NEW, None)]
    assert [e.decision_id for e in executed] == ["d-new"]
    # The hot board is refused by its new index, still draining: its task's hold names it.
    assert [f.decision_id for f in failed] == ["d-hot"] and "n1/1 (board GPU-hot) is cordoned" in failed[0].error
    assert [c.gpus for c in sim_fleet.verbs("place")] == [[2]]


async def test_the_pull_after_a_renumbering_labels_the_hot_board_at_its_new_index(observer, nats_url, tmp_path):
    host = await started_with_a_busy_board_at_2(observer, nats_url, tmp_path)
    try:
        t0 = 1_000_000.0
        await publish_telemetry(observer, "n1", [gpu_sample("n1", 2, t0, 95.0, uuid=HOT)])
        await asyncio.sleep(0.5)
        await observer.kv_put("topology", "n1", encode(topology(A, HOT, NEW, labels={HOT: {"cordoned": "true"}})))
        await asyncio.sleep(0.3)
        # The drain is over: the hot board, at 1 now, is pulled; the new board at 2 is not.
        await publish_telemetry(observer, "n1", [gpu_sample("n1", 1, t0 + 1800, 95.0, uuid=HOT),
                                                 gpu_sample("n1", 2, t0 + 1800, uuid=NEW)])
        deadline = asyncio.get_running_loop().time() + 10
        while (await labels_by_board(observer)).get(HOT, {}).get("decommissioned") != "true":
            assert asyncio.get_running_loop().time() < deadline, await labels_by_board(observer)
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        stored = await observer.topology("n1")
    finally:
        await host.stop()
    assert [(g.index, g.uuid, sorted(g.labels)) for g in stored.gpus] == [
        (0, A, []), (1, HOT, ["cordoned", "decommissioned"]), (2, NEW, [])]


async def test_a_renumbering_seen_in_the_samples_before_the_topology_lifts_no_maintenance_flag(tmp_path: Path):
    # The samples say NEW reads at 2 while the topology entry still has HOT, flagged, there:
    # by index, HOT's flag was taken for a replaced board's and lifted ("back in service").
    kv = await InMemoryBus().kv("topology")
    flagged = {"maintenance_pending": "true", "maintenance_risk": "0.97", "maintenance_board": HOT}
    await kv.put("n1", encode(topology(A, B, HOT, labels={HOT: flagged})))
    replica = GpuHealth(ExecutorSettings(nats_url="nats://unused:4222", metrics_port=-1, replica="a",
                                         state_dir=str(tmp_path)))
    replica.labels = FleetLabels(kv)
    await replica.labels.load()
    for at in (1_000_000.0, 1_000_060.0):
        replica.windows.add(gpu_sample("n1", 1, at, uuid=HOT))
        replica.windows.add(gpu_sample("n1", 2, at, uuid=NEW))
    await replica.assess_health()
    stored = msgspec.json.decode((await kv.get("n1")).value, type=NodeTopology)
    by_board = {g.uuid: g.labels for g in stored.gpus}
    assert by_board[HOT] == flagged


async def test_labels_set_for_a_board_go_to_it_wherever_it_reads(tmp_path: Path):
    kv = await InMemoryBus().kv("topology")
    await kv.put("n1", encode(topology(A, B, HOT)))
    labels = FleetLabels(kv)
    await labels.load()
    # the samples already read HOT at 1; the topology entry still has it at 2
    assert await labels.set("n1", 1, {"cordoned": "true"}, uuid=HOT)
    stored = msgspec.json.decode((await kv.get("n1")).value, type=NodeTopology)
    assert [(g.uuid, g.labels) for g in stored.gpus] == [(A, {}), (B, {}), (HOT, {"cordoned": "true"})]
    assert labels.labels_of("n1", 1, uuid=HOT) == {"cordoned": "true"}
    assert labels.labels_of("n1", 2, uuid=NEW) == {}  # another board than the one read there now
    assert labels.labels_of("n1", 2) == {"cordoned": "true"}  # by index alone: the entry's GPU 2


async def cordoned_hot_board(observer, nats_url, tmp_path, t0: float):
    """``started_with_a_busy_board_at_2``, with HOT's first hot sample (at 2) taken and its
    cordon labelled."""
    host = await started_with_a_busy_board_at_2(observer, nats_url, tmp_path)
    await publish_telemetry(observer, "n1", [gpu_sample("n1", 2, t0, 95.0, uuid=HOT)])
    deadline = asyncio.get_running_loop().time() + 10
    while (await labels_by_board(observer)).get(HOT, {}).get("cordoned") != "true":
        assert asyncio.get_running_loop().time() < deadline, await labels_by_board(observer)
        await asyncio.sleep(0.05)
    return host


async def test_after_a_renumbering_the_hot_board_s_drain_counts_its_own_task_at_its_new_index(
    observer, sim_fleet, nats_url, tmp_path
):
    # By index, the hot board at 1 held nothing (its task's hold said 2): the drain ended at
    # once, the board was pulled with nothing evicted and its task ran on on it.
    t0 = 1_000_000.0
    host = await cordoned_hot_board(observer, nats_url, tmp_path, t0)
    try:
        await observer.kv_put("topology", "n1", encode(topology(A, HOT, NEW, labels={HOT: {"cordoned": "true"}})))
        await publish_telemetry(observer, "n1", [gpu_sample("n1", 1, t0 + 60, 95.0, uuid=HOT),
                                                 gpu_sample("n1", 2, t0 + 60, uuid=NEW)])
        await asyncio.sleep(0.5)
        draining = await labels_by_board(observer)
        evicted = await observer.stored("task.lifecycle.*", TaskLifecycle, settle_s=0.1)
    finally:
        await host.stop()
    assert draining[HOT] == {"cordoned": "true"} and draining[NEW] == {}
    assert evicted == [] and sim_fleet.verbs("remove") == []


async def test_after_a_renumbering_the_hot_board_s_pull_evicts_its_own_task_not_the_one_at_its_new_index(
    observer, sim_fleet, nats_url, tmp_path
):
    # Board A fell off the bus: B reads at 0 and the hot board at 1, where B's task is held by
    # the index of its time. By index, the pull evicted B's task and left the hot board's own.
    t0 = 1_000_000.0
    host = await cordoned_hot_board(observer, nats_url, tmp_path, t0)
    try:
        await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1", allocations=[
            Allocation(task_id="busy", decision_id="d0", gpu=2, milli=1000, state="confirmed", gpu_uuid=HOT),
            Allocation(task_id="neighbour", decision_id="d1", gpu=1, milli=1000, state="confirmed", gpu_uuid=B)])))
        await observer.kv_put("topology", "n1", encode(topology(B, HOT, labels={HOT: {"cordoned": "true"}})))
        await asyncio.sleep(0.3)  # the ledger and the rewrite seen
        await publish_telemetry(observer, "n1", [gpu_sample("n1", 0, t0 + 1800, uuid=B),
                                                 gpu_sample("n1", 1, t0 + 1800, 95.0, uuid=HOT)])
        evicted = await observer.wait_stored("task.lifecycle.*", TaskLifecycle, 1)
        ledger = await observer.ledger("n1")
        labels = await labels_by_board(observer)
    finally:
        await host.stop()
    assert [(e.task_id, e.state, e.gpus) for e in evicted] == [("busy", "evicted", [1])]
    assert [c.task_id for c in sim_fleet.verbs("remove")] == ["busy"]
    assert ledger is not None and [a.task_id for a in ledger.allocations] == ["neighbour"]
    assert labels[HOT] == {"cordoned": "true", "decommissioned": "true"} and labels[B] == {}


async def test_an_assign_whose_hold_names_the_cordoned_board_is_refused_at_the_index_it_left(
    observer, sim_fleet, nats_url, tmp_path
):
    # The policy placed by a topology behind the renumbering: at 2, its hold naming the hot
    # board. Index 2 reads the new board now, which by index took the task, and the ledger said
    # it ran on the hot board (whose drain waited for it, whose pull evicted it).
    t0 = 1_000_000.0
    host = await cordoned_hot_board(observer, nats_url, tmp_path, t0)
    try:
        await observer.kv_put("topology", "n1", encode(topology(A, HOT, NEW, labels={HOT: {"cordoned": "true"}})))
        await publish_telemetry(observer, "n1", [gpu_sample("n1", 0, t0 + 60, uuid=A),
                                                 gpu_sample("n1", 1, t0 + 60, 95.0, uuid=HOT),
                                                 gpu_sample("n1", 2, t0 + 60, uuid=NEW)])
        await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1", allocations=[
            Allocation(task_id="busy", decision_id="d0", gpu=2, milli=1000, state="confirmed", gpu_uuid=HOT),
            Allocation(task_id="t-d-stale", decision_id="d-stale", gpu=2, milli=500, gpu_uuid=HOT),
            Allocation(task_id="t-d-fresh", decision_id="d-fresh", gpu=2, milli=500, gpu_uuid=NEW)])))
        await asyncio.sleep(0.5)  # the samples, the rewrite and the holds seen
        for decision_id in ("d-stale", "d-fresh"):
            await observer.js.publish("decision.made", encode(assign_to(decision_id, 2)))
        executed = await observer.wait_stored("action.executed", ActionExecuted, 1)
        failed = await observer.wait_stored("action.failed", ActionFailed, 1)
        ledger = await observer.ledger("n1")
    finally:
        await host.stop()
    assert [e.decision_id for e in executed] == ["d-fresh"]
    assert [f.decision_id for f in failed] == ["d-stale"] and not failed[0].retryable
    assert "n1/2" in failed[0].error and HOT in failed[0].error and "cordoned" in failed[0].error
    assert [c.gpus for c in sim_fleet.verbs("place")] == [[2]]
    assert ledger is not None and sorted(a.task_id for a in ledger.allocations) == ["busy", "t-d-fresh"]
