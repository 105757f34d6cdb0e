"""What a replica finds in ``pending`` that another left behind, over a real nats-server: an
entry claimed by a replica that died while placing it is taken over once the claim is
``claim_timeout_s`` old (not before), an unreadable entry stops nobody else's placement, and a
round the bus cuts short still publishes what it decided. A round reads the queue from the
replica's memory, not entry by entry from the bus."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from fleetpilot.contracts import now
from fleetpilot.policy.preempt import claim_of, claim_pending, encode_pending
from fleetpilot_services.policy.service import build
from fleetpilot_services.policy.settings import PolicySettings

from .conftest import admitted, node, settings, wait_for


async def test_an_entry_claimed_by_a_replica_that_died_is_taken_over_and_a_fresh_claim_is_left_alone(
    observer, nats_url, tmp_path
):
    await observer.put_fleet([node("n0")])
    pending = await observer.js.key_value("pending")
    # Both claimed while their replica placed them; the one of a minute ago never finished.
    await pending.put("left", claim_pending(encode_pending(admitted("left", gpu_milli=500)), now() - 60))
    await pending.put("busy", claim_pending(encode_pending(admitted("busy", gpu_milli=500)), now() + 600))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2, claim_timeout_s=30))
    await policy.start()
    try:
        await wait_for(lambda: any(d.decision_id == "left.assign" for d in observer.decisions), what="left placed")
        await asyncio.sleep(0.6)  # more rounds
        busy = await pending.get("busy")
        left = await observer.live_keys("pending")
    finally:
        await policy.stop()
    assert [d.decision_id for d in observer.decisions] == ["left.assign"]
    assert claim_of(busy.value) is not None and left == ["busy"]
    ledger = (await observer.ledgers())["n0"]
    assert [a.task_id for a in ledger.allocations] == ["left"]


async def test_an_unreadable_entry_does_not_hold_the_others_up(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0")])
    pending = await observer.js.key_value("pending")
    await pending.put("a-garbled", b"{not an admission")
    await pending.put("t", encode_pending(admitted("t", gpu_milli=500)))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        await wait_for(lambda: any(d.decision_id == "t.assign" for d in observer.decisions), what="t placed")
    finally:
        await policy.stop()
    assert await observer.live_keys("pending") == ["a-garbled"]


async def test_a_round_cut_short_still_publishes_what_it_decided(observer, nats_url, tmp_path, monkeypatch):
    """The bus fails while a round places its second task: the first task's decision (its
    hold reserved, its entry gone) still goes out, and the second's claim is taken over."""
    from fleetpilot_services.policy.service import PolicyState

    place = PolicyState.place

    async def bus_lost_on_late(self, adm, requeue=None):
        if adm.task.task_id == "late":
            raise RuntimeError("nats: timeout")
        return await place(self, adm, requeue)

    monkeypatch.setattr(PolicyState, "place", bus_lost_on_late)
    await observer.put_fleet([node("n0")])
    pending = await observer.js.key_value("pending")
    await pending.put("early", encode_pending(admitted("early", gpu_milli=500, expected_duration_s=60)))
    await pending.put("late", encode_pending(admitted("late", gpu_milli=500, expected_duration_s=3600)))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        await wait_for(lambda: any(d.decision_id == "early.assign" for d in observer.decisions),
                       what="early's decision published")
        late = await pending.get("late")
    finally:
        await policy.stop()
    assert claim_of(late.value) is not None  # taken over by a round after claim_timeout_s


async def test_a_round_reads_the_queue_from_memory_and_still_places_it_in_order(
    observer, nats_url, tmp_path, monkeypatch
):
    """Before, every round read each waiting entry from the bus (about 0.2 ms each: a round
    longer than its period past 3,000 waiting tasks). Now a replica keeps the bucket in
    memory; what it reads of ``pending`` no longer grows with the backlog."""
    from fleetpilot.runtime.nats_bus import NatsKeyValue

    reads = {"n": 0}
    get, keys = NatsKeyValue.get, NatsKeyValue.keys

    async def counted_get(self, key):
        reads["n"] += self._bucket == "pending"
        return await get(self, key)

    async def counted_keys(self):
        reads["n"] += self._bucket == "pending"
        return await keys(self)

    monkeypatch.setattr(NatsKeyValue, "get", counted_get)
    monkeypatch.setattr(NatsKeyValue, "keys", counted_keys)
    await observer.put_fleet([node("n0", gpus=1)])
    pending = await observer.js.key_value("pending")
    # 100 whole-GPU tasks, the earliest to complete first in the queue; one GPU, taken.
    await pending.put("blocker", encode_pending(admitted("blocker", gpu_milli=1000, expected_duration_s=1)))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        await wait_for(lambda: any(d.task_id == "blocker" for d in observer.decisions), what="blocker placed")
        for i in range(100):
            await pending.put(f"w{i:03d}", encode_pending(admitted(f"w{i:03d}", gpu_milli=1000,
                                                                   expected_duration_s=1000 - i)))
        await asyncio.sleep(0.5)
        reads["n"] = 0
        await asyncio.sleep(1.2)  # about six rounds over the 100 waiting tasks
        during_rounds = reads["n"]
        # Room for two: the two nearest to completion go first.
        await observer.put_fleet([node("n0", gpus=1), node("n1", gpus=2)])
        await wait_for(lambda: sum(d.action == "assign" for d in observer.decisions) >= 3, what="two placed")
    finally:
        await policy.stop()
    assert during_rounds < 10  # before: a listing and 100 reads a round
    assert [d.task_id for d in observer.decisions if d.action == "assign"] == ["blocker", "w099", "w098"]


@pytest.mark.parametrize(("aging", "first"), [(1.0, "long-early"), (0.25, "short-later")])
async def test_the_queue_aging_setting_orders_the_waiting_tasks(observer, nats_url, tmp_path, aging, first):
    """``FLEETPILOT_POLICY_QUEUE_AGING``: a run 10 minutes shorter, admitted 20 minutes later,
    goes first only when a wait ages at most half as fast as a run's length counts."""
    await observer.put_fleet([node("n0", gpus=1)])
    pending = await observer.js.key_value("pending")
    await pending.put("blocker", encode_pending(admitted("blocker", gpu_milli=1000, expected_duration_s=1)))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2, queue_aging=aging))
    await policy.start()
    try:
        await wait_for(lambda: any(d.task_id == "blocker" for d in observer.decisions), what="blocker placed")
        at = now()
        for task_id, admitted_at, run_s in (("long-early", at - 1200.0, 3600.0), ("short-later", at, 3000.0)):
            adm = msgspec.structs.replace(admitted(task_id, gpu_milli=1000, expected_duration_s=run_s),
                                          admitted_at=admitted_at)
            await pending.put(task_id, encode_pending(adm))
        await asyncio.sleep(0.6)  # a few rounds find no room
        await observer.put_fleet([node("n0", gpus=1), node("n1", gpus=1)])  # room for one
        await wait_for(lambda: sum(d.action == "assign" for d in observer.decisions) >= 2, what="one placed")
        await asyncio.sleep(0.5)
    finally:
        await policy.stop()
    assert [d.task_id for d in observer.decisions if d.action == "assign"] == ["blocker", first]


def test_a_queue_aging_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="greater than 0"):
        PolicySettings(queue_aging=0.0)


async def test_an_entry_taken_over_whose_task_already_holds_capacity_is_not_placed_twice(
    observer, nats_url, tmp_path
):
    """The dead replica had reserved the task (on n0, now full) before it died: the replica
    that takes the entry over re-issues that hold, not a second one on the free n1. Before,
    it placed the task afresh on n1, and one of the two holds was held by nobody for good."""
    from fleetpilot.contracts import Allocation, NodeLedger, Placement, encode

    await observer.put_fleet([node("n0", gpus=1), node("n1", gpus=1)])
    hold = Allocation(task_id="left", decision_id="left.assign", gpu=0, milli=1000, memory_mb=0, at=now())
    await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[hold])))
    pending = await observer.js.key_value("pending")
    await pending.put("left", claim_pending(encode_pending(admitted("left", gpu_milli=1000)), now() - 60))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2, claim_timeout_s=30))
    await policy.start()
    try:
        await wait_for(lambda: any(d.decision_id == "left.assign" for d in observer.decisions), what="left decided")
        await asyncio.sleep(0.6)  # more rounds
        left = await observer.live_keys("pending")
    finally:
        await policy.stop()
    assert left == []
    assert [d.placement for d in observer.decisions] == [[Placement(node="n0", gpu=0, milli=1000, memory_mb=0)]]
    holds = {n: [a.task_id for a in ledger.allocations] for n, ledger in (await observer.ledgers()).items()}
    assert holds.get("n1", []) == [] and holds["n0"] == ["left"]


async def test_a_re_placement_reserved_by_a_replica_that_died_is_published_not_dropped(
    observer, nats_url, tmp_path
):
    """A task queued again (``left.assign.2``) a while ago: the replica that placed it reserved
    its new hold and died before publishing. The replica taking the entry over publishes that
    placement. Before, it took the new hold for the old placement not released yet, and once
    ``evict_timeout_s`` had passed since the task was queued dropped the entry as a task that
    "keeps running": no ``assign`` ever went out and the hold was held by nobody for good."""
    from fleetpilot.contracts import Allocation, NodeLedger, Placement, encode
    from fleetpilot.policy.preempt import Requeue

    await observer.put_fleet([node("n0", gpus=1), node("n1", gpus=1)])
    hold = Allocation(task_id="left", decision_id="left.assign.2", gpu=0, milli=1000, memory_mb=0, at=now() - 40)
    await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[hold])))
    note = Requeue(decision_id="left.assign.2", at=now() - 300, reason="assign failed: backend timeout")
    pending = await observer.js.key_value("pending")
    await pending.put("left", claim_pending(encode_pending(admitted("left", gpu_milli=1000), note), now() - 40))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2, claim_timeout_s=30))
    await policy.start()
    try:
        await wait_for(lambda: any(d.decision_id == "left.assign.2" for d in observer.decisions),
                       what="left.assign.2 published")
        await asyncio.sleep(0.6)  # more rounds
        left = await observer.live_keys("pending")
    finally:
        await policy.stop()
    assert left == []
    assert [(d.decision_id, d.placement) for d in observer.decisions] == [
        ("left.assign.2", [Placement(node="n0", gpu=0, milli=1000, memory_mb=0)])]
    holds = {n: [a.decision_id for a in ledger.allocations] for n, ledger in (await observer.ledgers()).items()}
    assert holds.get("n1", []) == [] and holds["n0"] == ["left.assign.2"]


async def test_a_task_admitted_before_any_node_reported_is_queued_then_placed(observer, nats_url, tmp_path):
    # A fresh fleet: the policy starts, and a task is admitted, before the topology service
    # has stored any node.
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        await observer.admit(admitted("early", gpu_milli=500))
        await wait_for(lambda: observer.decisions, what="a decision for the early task")
        queued = observer.decisions[0]
        assert (queued.action, queued.reason) == ("queue", "no fleet topology known yet; queued until the nodes report")
        await observer.put_fleet([node("n0")])
        await wait_for(lambda: any(d.action == "assign" for d in observer.decisions), what="the early task placed")
        left = await observer.live_keys("pending")
    finally:
        await policy.stop()
    assert [d.action for d in observer.decisions] == ["queue", "assign"]
    assert left == []


