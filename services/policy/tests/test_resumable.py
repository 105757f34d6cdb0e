"""A task that cannot resume from a checkpoint (``TaskSubmitted.resumable`` false) in the
policy service over a real nats-server: stopped, it would start over, so it is not bridged
onto GPUs smaller than its predicted peak and not moved away from a predicted OOM; it is
moved off a GPU going away, where it would lose its run anyway, and its target holds say its
run begins again there. That it makes way for no one is tested in ``test_make_way``."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from fleetpilot.contracts import Allocation, NodeLedger, TaskFingerprinted, encode, now
from fleetpilot_services.policy.service import build

from .conftest import admitted, fingerprinted, node, settings, wait_for
from .test_bridge import A100, blocker, fingerprint, started_ago
from .test_bridge import task as bridge_task
from .test_rebalance_and_record import fingerprint as linear_fingerprint


@pytest.mark.parametrize("resumable", [True, False])
async def test_only_a_grower_that_resumes_is_bridged(observer, nats_url, tmp_path, resumable):
    # A leak predicted to 60 GB asks 20 GB; the H100 is held, an A100 is free.
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100)])
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[blocker("held")])))
    policy = build(settings(nats_url, tmp_path, pending_retry_s=0.2))
    await policy.start()
    try:
        await fingerprinted(observer, {"grow": fingerprint("leak")})
        await observer.admit(msgspec.structs.replace(
            bridge_task("grow"), task=msgspec.structs.replace(bridge_task("grow").task, resumable=resumable)))
        await wait_for(lambda: "grow" in observer.by_task(), timeout_s=3.0, what="grow decided")
        await asyncio.sleep(0.6)  # retry rounds
    finally:
        await policy.stop()
    actions = [(d.action, [p.node for p in d.placement]) for d in observer.by_task()["grow"]]
    assert actions == ([("assign", ["small0"])] if resumable else [("queue", [])])


async def place_then_hold(observer, task_id: str, node_name: str, gpu: int, neighbours: list[Allocation],
                          resumable: bool, **fields) -> None:
    """Admit ``task_id``, wait for its placement, then make the ledgers say it runs on
    ``gpu`` of ``node_name`` under that decision (confirmed ten minutes ago) beside
    ``neighbours``, and nowhere else."""
    await observer.admit(admitted(task_id, resumable=resumable, **fields))
    await wait_for(lambda: task_id in observer.by_task(), timeout_s=3.0, what=f"{task_id} placed")
    [placed] = observer.by_task()[task_id]
    for name in await observer.ledgers():
        await observer.kv_put("ledger", name, encode(NodeLedger(node=name, allocations=[])))
    held = Allocation(task_id=task_id, decision_id=placed.decision_id, gpu=gpu, milli=placed.placement[0].milli,
                      memory_mb=placed.placement[0].memory_mb, state="confirmed", at=now() - 600.0)
    await observer.kv_put("ledger", node_name, encode(NodeLedger(node=node_name, allocations=[held, *neighbours])))


@pytest.mark.parametrize("resumable", [True, False])
async def test_only_a_run_that_resumes_moves_away_from_a_predicted_oom(observer, nats_url, tmp_path, resumable):
    # As in ``test_rebalance_and_record``: beside a 30 GB neighbour on an A100, it will peak at 20 GB.
    await observer.put_fleet([node("a0", model="A100-40GB", memory_mb=40960)])
    policy = build(settings(nats_url, tmp_path, profile="bestfit", rebalance_s=0.3))
    await policy.start()
    try:
        neighbour = Allocation(task_id="big", decision_id="big.assign", gpu=0, milli=500, memory_mb=30000,
                               state="confirmed", at=now())
        await place_then_hold(observer, "o1", "a0", 0, [neighbour], resumable, gpu_milli=300, gpu_memory_mb=5000)
        await observer.js.publish("task.fingerprinted", encode(TaskFingerprinted(
            task_id="o1", fingerprint=linear_fingerprint(20000), source="observed", at=now())))
        await asyncio.sleep(1.5)  # several rebalance rounds
    finally:
        await policy.stop()
    moves = [(p.node, p.gpu) for d in observer.by_task()["o1"] if d.action == "migrate" for p in d.placement]
    assert moves == ([("a0", 1)] if resumable else [])


@pytest.mark.parametrize("restarted", [False, True])
@pytest.mark.parametrize("resumable", [True, False])
async def test_a_run_is_moved_off_a_gpu_going_away_and_one_that_cannot_resume_begins_again(
    observer, nats_url, tmp_path, resumable, restarted
):
    await observer.put_fleet([node("h0", gpus=1), node("h1", gpus=1)])
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3))
    await policy.start()
    try:
        await place_then_hold(observer, "m1", "h0", 0, [], resumable, gpu_milli=1000, expected_duration_s=7200.0)
        await started_ago(observer, "h0", 600.0)
        if restarted:
            # Moved by a replica that did not place it (a restart, another replica): it knows
            # the task from the contract the sla service stored.
            contract = admitted("m1", resumable=resumable, gpu_milli=1000, expected_duration_s=7200.0)
            await observer.kv_put("contracts", "contract.m1", encode(contract))
            await policy.stop()
            policy = build(settings(nats_url, tmp_path, rebalance_s=0.3))
            await policy.start()
        asked = now()
        await observer.put_fleet([node("h0", gpus=1, labels={0: {"maintenance_pending": "true"}}), node("h1", gpus=1)])
        await wait_for(lambda: any(d.action == "migrate" for d in observer.decisions), timeout_s=4.0, what="the move")
        ledgers = await observer.ledgers()
    finally:
        await policy.stop()
    [move] = [d for d in observer.decisions if d.action == "migrate"]
    assert [(p.node, p.gpu) for p in move.placement] == [("h1", 0)]
    # The executor reads from the decision's task whether to send the checkpoint signal.
    assert move.task is not None and move.task.resumable is resumable
    [target] = [a for a in ledgers["h1"].allocations if a.decision_id == move.decision_id]
    if resumable:
        assert asked - 620.0 < target.run_at < asked - 590.0  # its run goes on from where it was
    else:
        assert target.run_at >= asked  # its run begins again on the target
