"""The holds the policy reserves name the board (NVML uuid) they are on, as the topology it
placed by names the GPU at their index: an assign's, a move's target, a resize's extra. GPU
indices renumber under running tasks; the executor follows a hold by its board where it has
one (``Allocation.gpu_uuid``), and by index only the holds of earlier versions."""

from __future__ import annotations

import asyncio

import msgspec
from fleetpilot.contracts import (
    Allocation,
    Fingerprint,
    NodeLedger,
    NodeTopology,
    Placement,
    TaskFingerprinted,
    encode,
    now,
)
from fleetpilot_services.policy.replica import allocations_for
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


def with_boards(topo: NodeTopology) -> NodeTopology:
    """``topo`` with each GPU's board named ``GPU-<node>-<index>``."""
    return msgspec.structs.replace(topo, gpus=[msgspec.structs.replace(g, uuid=f"GPU-{topo.node}-{g.index}")
                                               for g in topo.gpus])


def running(task_id: str, gpu: int, milli: int, memory_mb: int, uuid: str = "") -> Allocation:
    return Allocation(task_id=task_id, decision_id=f"{task_id}.assign", gpu=gpu, milli=milli,
                      memory_mb=memory_mb, state="confirmed", at=now() - 5.0, gpu_uuid=uuid)


def growing(peak_mb: float) -> Fingerprint:
    return Fingerprint(signature="s", pattern="linear", pattern_confidence=0.9, growth_rate_mb_per_s=10.0,
                       predicted_peak_mb=peak_mb, peak_low_mb=peak_mb - 500, peak_high_mb=peak_mb + 500)


def placements(node_name: str, gpus: tuple[int, ...]) -> list[Placement]:
    return [Placement(node=node_name, gpu=g, milli=500, memory_mb=1000) for g in gpus]


def test_a_placement_s_holds_name_the_boards_the_topology_has_at_their_indices() -> None:
    topo = with_boards(node("n1", gpus=4))
    holds = allocations_for(admitted("t1", gpus=2).task, "t1.assign",
                            placements("n1", (3, 1)), topo=topo)
    assert [(a.gpu, a.gpu_uuid) for a in holds] == [(3, "GPU-n1-3"), (1, "GPU-n1-1")]
    # A topology that names no board (a collector that could not read it) leaves it unknown.
    unnamed = allocations_for(admitted("t2").task, "t2.assign", placements("n1", (0,)), topo=node("n1"))
    assert [(a.gpu, a.gpu_uuid) for a in unnamed] == [(0, "")]


async def test_an_assign_and_a_move_reserve_holds_naming_their_boards(observer, nats_url, tmp_path):
    await observer.put_fleet([with_boards(node("h0", labels={0: {"maintenance_pending": "true",
                                                                 "maintenance_risk": "0.80"}})),
                              with_boards(node("h1", gpus=1))])
    await observer.kv_put("ledger", "h0", encode(NodeLedger(node="h0", allocations=[
        running("m1", 0, 1000, 1000, uuid="GPU-h0-0")])))
    host = build(settings(nats_url, tmp_path, profile="bestfit", rebalance_s=0.3))
    await host.start()
    try:
        await observer.admit(admitted("new", gpu_milli=1000))
        await wait_for(lambda: {d.action for d in observer.decisions} >= {"assign", "migrate"}, what="decisions")
        ledgers = await observer.ledgers()
    finally:
        await host.stop()
    [move] = [d for d in observer.decisions if d.action == "migrate"]
    [assign] = [d for d in observer.decisions if d.action == "assign"]
    placed = {(d.placement[0].node, d.placement[0].gpu) for d in (move, assign)}
    assert placed == {("h0", 1), ("h1", 0)}  # h0/0 is pending maintenance
    held = {(name, a.task_id, a.decision_id): (a.gpu, a.gpu_uuid)
            for name, ledger in ledgers.items() for a in ledger.allocations}
    for d in (move, assign):
        p = d.placement[0]
        assert held[(p.node, d.task_id, d.decision_id)] == (p.gpu, f"GPU-{p.node}-{p.gpu}")


async def test_a_resize_s_extra_memory_names_the_board_of_the_task_s_hold(observer, nats_url, tmp_path):
    a100 = dict(model="A100-40GB", memory_mb=40960)
    await observer.put_fleet([with_boards(node("a0", gpus=1, **a100))])
    await observer.kv_put("ledger", "a0", encode(NodeLedger(node="a0", allocations=[
        running("r1", 0, 300, 5000, uuid="GPU-a0-0"), running("small", 0, 700, 10000, uuid="GPU-a0-0")])))
    await observer.js.publish("task.fingerprinted", encode(TaskFingerprinted(
        task_id="r1", fingerprint=growing(20000), source="observed", at=now())))
    host = build(settings(nats_url, tmp_path, profile="bestfit", rebalance_s=0.3))
    await host.start()
    try:
        await wait_for(lambda: any(d.action == "resize" for d in observer.decisions), what="resize")
        await asyncio.sleep(0.1)
        ledgers = await observer.ledgers()
    finally:
        await host.stop()
    [resize] = [d for d in observer.decisions if d.action == "resize"]
    extra = [a for a in ledgers["a0"].allocations if a.decision_id == resize.decision_id]
    assert [(a.gpu, a.gpu_uuid) for a in extra] == [(0, "GPU-a0-0")]
