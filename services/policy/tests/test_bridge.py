"""Bridging in the policy service over a real nats-server: a task whose fingerprint predicts
smooth growth (``leak``) past every free GPU starts on a GPU that holds its ask, where a
``flat`` task of the same peak waits; a queued grower is bridged by the retry round even
behind a flat task that found no node; once a GPU that holds its peak has room, the
rebalance round migrates the bridged task up to it."""

from __future__ import annotations

import asyncio

import msgspec
from fleetpilot.contracts import Allocation, Fingerprint, NodeLedger, TaskFingerprinted, encode, now
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for

PEAK_MB = 60_000
ASK_MB = 20_000
A100 = dict(model="A100-40GB", memory_mb=40960)


def fingerprint(pattern: str) -> Fingerprint:
    return Fingerprint(
        signature=f"sig-{pattern}",
        pattern=pattern,
        pattern_confidence=0.9,
        growth_rate_mb_per_s=20.0,
        predicted_peak_mb=PEAK_MB,
        peak_low_mb=PEAK_MB - 500,
        peak_high_mb=PEAK_MB + 500,
    )


def blocker(task_id: str) -> Allocation:
    """A confirmed hold of a whole GPU and all its memory."""
    return Allocation(task_id=task_id, decision_id=f"{task_id}.assign", gpu=0, milli=1000, memory_mb=81920,
                      state="confirmed", at=now())


async def fingerprinted(observer, fps: dict[str, Fingerprint]) -> None:
    """Publish the tasks' fingerprints and wait until the policy has taken them, so that an
    admission published next is decided with them."""
    last = 0
    for task_id, fp in fps.items():
        ack = await observer.js.publish(
            "task.fingerprinted",
            encode(TaskFingerprinted(task_id=task_id, fingerprint=fp, source="signature", at=now())),
        )
        last = ack.seq
    for _ in range(250):
        info = await observer.js.consumer_info("TASKS", "policy-fingerprints")
        if info.ack_floor.stream_seq >= last:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the policy did not take the fingerprints")


def task(task_id: str):
    return admitted(task_id, gpu_milli=1000, gpu_memory_mb=ASK_MB)


async def test_a_leaking_task_starts_on_its_ask_where_a_flat_one_of_the_same_peak_waits(
    observer, nats_url, tmp_path
):
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100), node("small1", gpus=1, **A100)])
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[blocker("held")])))
    policy = build(settings(nats_url, tmp_path, pending_retry_s=0.2))
    await policy.start()
    try:
        await fingerprinted(observer, {"grow": fingerprint("leak"), "flat": fingerprint("flat")})
        await observer.admit(task("grow"))
        await wait_for(lambda: "grow" in observer.by_task(), timeout_s=3.0, what="grow decided")
        await observer.admit(task("flat"))
        await wait_for(lambda: "flat" in observer.by_task(), timeout_s=3.0, what="flat decided")
        await asyncio.sleep(0.6)  # retry rounds: a free A100 holds the flat task's ask, not its peak
        ledgers = await observer.ledgers()
    finally:
        await policy.stop()
    by_task = observer.by_task()
    [grow] = by_task["grow"]
    assert grow.action == "assign" and grow.decision_id == "grow.assign"
    assert grow.reason.startswith("bridge: starts on its ask of 20000 MB"), grow.reason
    assert "leak growth to 60000 MB" in grow.reason
    [(where, gpu, held)] = [(p.node, p.gpu, p.memory_mb) for p in grow.placement]
    assert where in ("small0", "small1") and gpu == 0
    # It holds the whole A100 it will grow into, so nothing else is placed into that room.
    assert held == 40960
    assert [(a.task_id, a.memory_mb, a.state) for a in ledgers[where].allocations] == [("grow", 40960, "reserved")]
    assert [d.action for d in by_task["flat"]] == ["queue"]


async def test_a_queued_grower_is_bridged_by_the_retry_round_behind_a_flat_task_that_found_no_node(
    observer, nats_url, tmp_path
):
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100)])
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[blocker("held")])))
    await observer.kv_put("ledger", "small0", encode(NodeLedger(node="small0", allocations=[blocker("other")])))
    policy = build(settings(nats_url, tmp_path, pending_retry_s=0.2))
    await policy.start()
    try:
        await fingerprinted(observer, {"grow": fingerprint("leak"), "flat": fingerprint("flat")})
        flat, grow = task("flat"), task("grow")  # the flat task first in the queue's order
        await observer.admit(flat)
        await observer.admit(grow)
        await wait_for(lambda: len(observer.decisions) == 2, timeout_s=3.0, what="both queued")
        await observer.kv_put("ledger", "small0", encode(NodeLedger(node="small0", allocations=[])))
        await wait_for(lambda: len(observer.by_task()["grow"]) == 2, timeout_s=3.0, what="grow placed")
        await asyncio.sleep(0.4)
    finally:
        await policy.stop()
    by_task = observer.by_task()
    assert [d.action for d in by_task["flat"]] == ["queue"]
    queued, placed = by_task["grow"]
    assert queued.action == "queue"
    assert placed.action == "assign" and placed.decision_id == "grow.assign"
    assert [(p.node, p.gpu) for p in placed.placement] == [("small0", 0)]
    assert placed.reason.startswith("bridge:"), placed.reason


async def test_a_bridged_task_is_migrated_up_once_a_gpu_holds_its_peak(observer, nats_url, tmp_path):
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100)])
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[blocker("held")])))
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3))
    await policy.start()
    try:
        await fingerprinted(observer, {"grow": fingerprint("leak")})
        await observer.admit(task("grow"))
        await wait_for(lambda: "grow" in observer.by_task(), timeout_s=3.0, what="grow decided")
        # The executor starts it: with its hold confirmed it is a running task to the rebalancer.
        [hold] = (await observer.ledgers())["small0"].allocations
        confirmed = msgspec.structs.replace(hold, state="confirmed")
        await observer.kv_put("ledger", "small0", encode(NodeLedger(node="small0", allocations=[confirmed])))
        await asyncio.sleep(1.0)  # three rounds: no GPU holds its peak yet, so it stays
        assert [d.action for d in observer.by_task()["grow"]] == ["assign"]
        await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[])))
        await wait_for(lambda: len(observer.by_task()["grow"]) == 2, timeout_s=3.0, what="grow moved up")
        await asyncio.sleep(0.7)  # more rounds: the move is not repeated
        ledgers = await observer.ledgers()
    finally:
        await policy.stop()
    assign, move = observer.by_task()["grow"]
    assert assign.reason.startswith("bridge:"), assign.reason
    assert move.action == "migrate" and move.decision_id == "grow.migrate.1"
    assert [(p.node, p.gpu, p.memory_mb) for p in move.source] == [("small0", 0, 40960)]
    # The target holds the peak's 90% bound plus the resize margin: no resize or OOM follows.
    assert [(p.node, p.gpu, p.memory_mb) for p in move.placement] == [("big", 0, 61012)]
    assert "predicted OOM in place" in move.reason
    assert [(a.decision_id, a.memory_mb) for a in ledgers["big"].allocations] == [("grow.migrate.1", 61012)]
