"""The policy service over a real nats-server: GPU labels keep new work off, the rebalancer
migrates tasks off a maintenance-pending GPU and away from a predicted OOM (target reserved
with CAS first, deterministic ids, once), and sampled decision inputs are recorded."""

from __future__ import annotations

import asyncio

import msgspec
from fleetpilot.contracts import (
    ActionFailed,
    Allocation,
    Fingerprint,
    NodeLedger,
    PolicyRef,
    TaskFingerprinted,
    encode,
    now,
)
from fleetpilot.policy import Snapshot
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


def hold(task_id: str, gpu: int, milli: int = 1000, memory_mb: int = 1000, decision: str = "") -> Allocation:
    return Allocation(
        task_id=task_id,
        decision_id=decision or f"{task_id}.assign",
        gpu=gpu,
        milli=milli,
        memory_mb=memory_mb,
        state="confirmed",
        at=now(),
    )


def fingerprint(peak_mb: float) -> Fingerprint:
    return Fingerprint(
        signature="s",
        pattern="linear",
        pattern_confidence=0.9,
        growth_rate_mb_per_s=10.0,
        predicted_peak_mb=peak_mb,
        peak_low_mb=peak_mb - 500,
        peak_high_mb=peak_mb + 500,
    )


async def test_rebalancer_moves_tasks_off_maintenance_and_away_from_a_predicted_oom(
    observer, nats_url, tmp_path
):
    nodes = [
        node(
            "h0",
            labels={0: {"maintenance_pending": "true", "maintenance_risk": "0.80"}, 1: {"cordoned": "true"}},
        ),
        node("h1"),
        node("h2"),
        node("a0", model="A100-40GB", memory_mb=40960),
    ]
    await observer.put_fleet(nodes)
    await observer.kv_put("ledger", "h0", encode(NodeLedger(node="h0", allocations=[hold("m1", 0)])))
    # o1 shares a0's GPU 0 with a 30 GB neighbour; its fingerprint says it will peak at 20 GB.
    await observer.kv_put(
        "ledger",
        "a0",
        encode(
            NodeLedger(
                node="a0",
                allocations=[
                    hold("o1", 0, milli=300, memory_mb=5000),
                    hold("big", 0, milli=500, memory_mb=30000),
                ],
            )
        ),
    )
    await observer.js.publish(
        "task.fingerprinted",
        encode(TaskFingerprinted(task_id="o1", fingerprint=fingerprint(20000), source="observed", at=now())),
    )
    host = build(settings(nats_url, tmp_path, profile="bestfit", rebalance_s=0.3, record_every=2))
    await host.start()
    try:
        # New work avoids the labelled GPUs of h0 even though bestfit would pack onto h0.
        fresh = [admitted(f"new{i}", gpu_milli=500, gpu_models=["H100"]) for i in range(4)]
        for adm in fresh:
            await observer.admit(adm)
        await wait_for(
            lambda: (
                sum(d.action == "migrate" for d in observer.decisions) >= 2
                and sum(d.action == "assign" for d in observer.decisions) >= 4
            ),
            what="migrations",
        )
        await asyncio.sleep(1.0)  # three more rounds: a task mid-migration is not moved again
        ledgers = await observer.ledgers()
    finally:
        await host.stop()
    for d in observer.decisions:
        if d.action == "assign":
            assert d.placement[0].node != "h0", d
    migrations = {d.task_id: d for d in observer.decisions if d.action == "migrate"}
    assert sorted(migrations) == ["m1", "o1"]
    assert len([d for d in observer.decisions if d.action == "migrate"]) == 2
    m1 = migrations["m1"]
    assert m1.decision_id == "m1.migrate.1"
    assert [(p.node, p.gpu) for p in m1.source] == [("h0", 0)]
    assert m1.placement[0].node in ("h1", "h2")
    assert 0.7 < m1.confidence <= 0.8  # P(staying fails) = the label's 0.8 x the target's confidence
    o1 = migrations["o1"]
    assert [(p.node, p.gpu) for p in o1.source] == [("a0", 0)]
    assert [(p.node, p.gpu) for p in o1.placement] == [("a0", 1)]  # same model, room for the peak
    assert "predicted OOM" in o1.reason
    # Reserved before published; the source stays held until the executor moves the task.
    target = {a.decision_id for a in ledgers[m1.placement[0].node].allocations if a.task_id == "m1"}
    assert target == {"m1.migrate.1"}
    assert {a.decision_id for a in ledgers["a0"].allocations if a.task_id == "o1"} == {
        "o1.assign",
        "o1.migrate.1",
    }
    # Every 2nd decision input is on file, replayable.
    lines = (tmp_path / "policy-states.jsonl").read_bytes().splitlines()
    assert len(lines) == 2
    snaps = [msgspec.json.decode(line, type=Snapshot) for line in lines]
    assert {s.task.task_id for s in snaps} <= {a.task.task_id for a in fresh}


async def test_a_move_or_resize_the_executor_failed_is_not_proposed_again_under_its_id(
    observer, nats_url, tmp_path
):
    # Both tasks hold 5 GB and will peak at 20 GB. r1 has room beside it (a resize), m1 has
    # not (a move to a0's GPU 1). The executor's journal says it failed the resize r1 would
    # get and m1's first move: re-proposed under those ids, the stream would drop them as
    # duplicates and their fresh reservations would be held until the tasks end.
    a100 = dict(model="A100-40GB", memory_mb=40960)
    await observer.put_fleet([node("a0", gpus=2, **a100), node("a1", gpus=1, **a100)])
    await observer.kv_put("ledger", "a0", encode(NodeLedger(node="a0", allocations=[
        hold("r1", 0, milli=300, memory_mb=5000), hold("small", 0, milli=700, memory_mb=10000)])))
    await observer.kv_put("ledger", "a1", encode(NodeLedger(node="a1", allocations=[
        hold("m1", 0, milli=300, memory_mb=5000), hold("big", 0, milli=500, memory_mb=30000)])))
    for decision_id, action in (("r1.resize.21012", "resize"), ("m1.migrate.1", "migrate")):
        failed = ActionFailed(action_id=f"act-{decision_id}", decision_id=decision_id, task_id=decision_id[:2],
                              action=action, backend="process", error="checkpoint failed",
                              policy=PolicyRef(name="fleetpilot"), failed_at=now())
        await observer.kv_put("executions", decision_id, encode(failed))
    for task_id in ("r1", "m1"):
        await observer.js.publish("task.fingerprinted", encode(TaskFingerprinted(
            task_id=task_id, fingerprint=fingerprint(20000), source="observed", at=now())))
    host = build(settings(nats_url, tmp_path, profile="bestfit", rebalance_s=0.3))
    await host.start()
    try:
        await wait_for(lambda: any(d.action == "migrate" for d in observer.decisions), what="the move")
        await asyncio.sleep(1.0)  # three more rounds
        ledgers = await observer.ledgers()
    finally:
        await host.stop()
    by_task = observer.by_task()
    assert [d.decision_id for d in by_task["m1"]] == ["m1.migrate.2"]
    assert [(p.node, p.gpu) for p in by_task["m1"][0].placement] == [("a0", 1)]
    assert {a.decision_id for a in ledgers["a0"].allocations if a.task_id == "m1"} == {"m1.migrate.2"}
    # r1 stays where it is: the same resize already failed, and in place it does not OOM.
    assert "r1" not in by_task
