"""Two replicas acting on one task's ``pending`` entry, over a real nats-server: what one
writes between another's read and its write must survive that write. Each test injects the
other replica's write at the moment it can happen (a monkeypatched step of the replica under
test), as ``test_pending_entries.py`` does."""

from __future__ import annotations

import asyncio
import sys

import msgspec
from fleetpilot.contracts import Allocation, Contract, NodeLedger, TaskLifecycle, encode, now
from fleetpilot.policy.preempt import Requeue, claim_of, claim_pending, encode_pending
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


async def taken_over_placed_and_cleared(observer, key: str):
    """What another replica does to ``key`` while this one stalls: takes its claim over,
    places the task and clears the entry. The ``pending`` bucket."""
    pending = await observer.js.key_value("pending")
    entry = await pending.get(key)
    await pending.update(key, claim_pending(claim_of(entry.value)[1], now()), entry.revision)
    await pending.delete(key)
    return pending


async def a_replica_with_slow_queued(observer, nats_url, tmp_path):
    """One node, ``slow`` waiting in ``pending``, and a started replica placing it: the
    bucket and the replica."""
    await observer.put_fleet([node("n0")])
    pending = await observer.js.key_value("pending")
    await pending.put("slow", encode_pending(admitted("slow", gpu_milli=500)))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    return pending, policy


async def test_a_replica_that_stalled_past_its_claim_does_not_clear_the_entry_written_since(
    observer, nats_url, tmp_path, monkeypatch
):
    """A replica claims ``slow`` and places it, but stalls past ``claim_timeout_s`` before it
    clears the entry. Meanwhile another replica took the entry over and placed the task, the
    executor failed that assign, and the task was queued again as ``slow.assign.2``. Clearing
    the entry then must not drop that re-queued task: before, the stalled replica deleted
    whatever the key held, and the task was never placed again."""
    from fleetpilot_services.policy.service import PolicyState

    place = PolicyState.place
    injected = {"n": 0}
    note = Requeue(decision_id="slow.assign.2", at=now(), reason="assign failed: backend timeout")
    queued_again = encode_pending(admitted("slow", gpu_milli=500), note)

    async def placed_then_taken_over(self, adm, requeue=None):
        decided = await place(self, adm, requeue)
        if adm.task.task_id == "slow" and not injected["n"]:
            injected["n"] += 1
            pending = await taken_over_placed_and_cleared(observer, "slow")
            await pending.create("slow", queued_again)  # the failed assign, queued again
        return decided

    monkeypatch.setattr(PolicyState, "place", placed_then_taken_over)
    pending, policy = await a_replica_with_slow_queued(observer, nats_url, tmp_path)
    try:
        await wait_for(lambda: injected["n"] == 1, what="the stalled placement")
        await asyncio.sleep(0.6)  # the stalled round finishes, and more rounds run
        left = await observer.live_keys("pending")
        entry = await pending.get("slow") if left else None
    finally:
        await policy.stop()
    assert left == ["slow"]
    assert entry.value == queued_again  # the re-queued task, as written: not claimed, not gone
    # What the stalled replica reserved still goes out (one id: the stream keeps one copy).
    assert [d.decision_id for d in observer.decisions] == ["slow.assign"]


async def test_a_task_that_ended_while_a_round_held_its_entry_is_not_placed_again(
    observer, nats_url, tmp_path, monkeypatch
):
    """A task queued again after an eviction ends on its own (the eviction never went out)
    while another replica's round has its entry claimed. That round finds no room and puts
    the entry back. Before, the lifecycle event was taken and dropped because of the claim,
    and the entry waited to start a finished task again; now the event comes back once the
    claim is gone and clears the entry."""
    note = Requeue(decision_id="done.assign.2", evict_id="done.evict.1", for_task="vip", at=now(),
                   reason="preempted")
    waiting = encode_pending(admitted("done", gpu_milli=500), note)
    pending = await observer.js.key_value("pending")
    await pending.put("done", claim_pending(waiting, now()))  # another replica's round, placing it
    # No retry round of this replica: the other replica's is the one holding the entry.
    # A claim timeout of 4 s: the event comes back each second while the entry is claimed.
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=3600.0, claim_timeout_s=4.0))
    await policy.start()
    try:
        await observer.js.publish(
            "task.lifecycle.done",
            encode(TaskLifecycle(task_id="done", state="finished", node="n0", gpus=[0], exit_code=0, at=now())),
        )
        for _ in range(250):
            info = await observer.js.consumer_info("TASKS", "policy-lifecycle")
            if info.delivered.stream_seq >= 1:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # the first delivery is handled
        # The other replica's round found no room: it puts the entry back under its claim.
        claimed = await pending.get("done")
        await pending.update("done", waiting, claimed.revision)
        await asyncio.sleep(2.5)  # the event comes back (if it does) and is handled
        left = await observer.live_keys("pending")
    finally:
        await policy.stop()
    assert left == []


async def test_a_preemption_does_not_overwrite_the_entry_another_replica_queued_its_victim_under(
    observer, nats_url, tmp_path, monkeypatch
):
    """A vip waits and ``be1`` (best_effort) holds the only GPU. While this replica plans the
    preemption, another one checkpoints ``be1`` to make way (its rebalance round): it writes
    ``be1``'s entry first, with the hour of progress the checkpoint keeps. Before, the
    preemption then wrote its own note over it (``put``), and the task came back from its
    checkpoint as if it had never run; now the entry is created only if absent, and the
    preemption that lost the race is dropped (the task is leaving already)."""
    from fleetpilot_services.policy.service import PolicyState

    floor = PolicyState.restore_floor_mb
    injected = {"n": 0}
    be1 = msgspec.structs.replace(admitted("be1", gpu_milli=1000, expected_duration_s=36000),
                                  contract=Contract(tier="best_effort"))
    made_way = Requeue(decision_id="be1.assign.2", evict_id="be1.evict.1", at=now(),
                       reason="checkpointed to make way", progress_s=3600.0)
    checkpointed = encode_pending(be1, made_way)

    async def other_replica_queues_the_victim_meanwhile(self, task):
        if task.task_id == "be1" and not injected["n"]:
            injected["n"] += 1
            pending = await observer.js.key_value("pending")
            await pending.create("be1", checkpointed)
        return await floor(self, task)

    monkeypatch.setattr(PolicyState, "restore_floor_mb", other_replica_queues_the_victim_meanwhile)
    await observer.put_fleet([node("n0", gpus=1)])
    hold = Allocation(task_id="be1", decision_id="be1.assign", gpu=0, milli=1000, memory_mb=1000,
                      state="confirmed", at=now() - 3600)
    await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[hold])))
    await observer.kv_put("contracts", "contract.be1", encode(be1))
    vip = msgspec.structs.replace(admitted("vip", gpu_milli=1000), contract=Contract(tier="vip"))
    pending = await observer.js.key_value("pending")
    await pending.put("vip", encode_pending(vip))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        await wait_for(lambda: injected["n"] == 1, what="the preemption planned")
        await asyncio.sleep(0.6)  # more rounds
        entry = await pending.get("be1")
    finally:
        await policy.stop()
    assert entry.value == checkpointed  # the checkpoint's note, its progress kept


async def test_an_entry_written_again_while_a_round_forgets_it_is_kept(observer, nats_url, tmp_path, monkeypatch):
    """A round finds ``left`` claimed by a replica that died after the executor took its
    assign: nothing is left to decide, and the round forgets the entry, only as it read it.
    Just before its delete reaches the server, another replica writes the entry again (here:
    takes it over). Before, the round checked the revision with a read of its own, then
    deleted whatever the key held by the time the delete arrived."""
    from fleetpilot.runtime.nats_bus import NatsKeyValue

    delete = NatsKeyValue.delete
    armed = {"n": 0}
    taken_over = claim_pending(encode_pending(admitted("left", gpu_milli=500)), now())

    async def written_again_just_before(self, key, revision=None):
        if self._bucket == "pending" and key == "left" and sys._getframe(1).f_code.co_name == "_forget" \
                and not armed["n"]:
            armed["n"] += 1
            pending = await observer.js.key_value("pending")
            await pending.put("left", taken_over)
        return await delete(self, key, revision)

    await observer.put_fleet([node("n0")])
    await observer.kv_put("executions", "left.assign", b'{"at": 1.0}')  # the executor took it
    pending = await observer.js.key_value("pending")
    await pending.put("left", claim_pending(encode_pending(admitted("left", gpu_milli=500)), now() - 60))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2, claim_timeout_s=30))
    monkeypatch.setattr(NatsKeyValue, "delete", written_again_just_before)
    await policy.start()
    try:
        await wait_for(lambda: armed["n"] == 1, what="the round's delete")
        await asyncio.sleep(0.3)  # more rounds (the new claim is fresh: they leave it alone)
        entry = await pending.get("left")
    finally:
        await policy.stop()
    assert entry.value == taken_over


async def test_a_replica_that_stalled_past_its_claim_does_not_put_back_a_task_another_replica_placed(
    observer, nats_url, tmp_path, monkeypatch
):
    """A replica claims an entry and stalls longer than ``claim_timeout_s``; another takes the
    entry over, places the task and clears the entry. The first then finds no room (the task
    now holds it) and must not write the entry back: that would queue a placed task again,
    and place it a second time once its first run has ended."""
    from fleetpilot_services.policy.service import PolicyState

    place = PolicyState.place
    stalled = {"n": 0}

    async def stalled_then_taken_over(self, adm, requeue=None):
        if adm.task.task_id == "slow" and not stalled["n"]:
            stalled["n"] += 1
            await taken_over_placed_and_cleared(observer, "slow")
            return None, "bestfit", "primary"
        return await place(self, adm, requeue)

    monkeypatch.setattr(PolicyState, "place", stalled_then_taken_over)
    pending, policy = await a_replica_with_slow_queued(observer, nats_url, tmp_path)
    try:
        await wait_for(lambda: stalled["n"] == 1, what="the stalled placement")
        await asyncio.sleep(1.0)  # rounds that would place a written-back entry
        left = await observer.live_keys("pending")
    finally:
        await policy.stop()
    assert left == [] and [d.decision_id for d in observer.decisions] == []


async def test_an_admission_delivered_again_leaves_the_entry_it_queued_as_it_is_now(observer, nats_url, tmp_path):
    """``t`` was admitted and queued (no room); its ``task.admitted`` acknowledgement was
    lost, and by the time the message comes again the entry has moved on: another replica's
    round holds it, placing the task again after the executor's assign failed (its note
    counts the attempt). Before, the redelivery wrote the bare admission over it: the claim
    and the note were gone, so the task was placed twice, the second time under the first
    decision's id. Now an entry that exists is left to whoever holds it."""
    await observer.put_fleet([node("n0", gpus=1)])
    blocker = Allocation(task_id="big", decision_id="big.assign", gpu=0, milli=1000, memory_mb=1000,
                         state="confirmed", at=now())
    await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[blocker])))
    adm = admitted("t", gpu_milli=1000)
    note = Requeue(decision_id="t.assign.2", at=now(), reason="assign failed: backend timeout")
    held = claim_pending(encode_pending(adm, note), now())
    pending = await observer.js.key_value("pending")
    await pending.put("t", held)
    # No retry round of this replica: the other replica's is the one holding the entry.
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=3600.0))
    await policy.start()
    try:
        await observer.admit(adm)
        await wait_for(lambda: "t" in observer.by_task(), what="the admission handled")
        entry = await pending.get("t")
    finally:
        await policy.stop()
    assert [d.action for d in observer.by_task()["t"]] == ["queue"]
    assert entry.value == held


async def test_an_eviction_carried_out_as_its_entry_is_given_up_still_queues_the_task(
    observer, nats_url, tmp_path, monkeypatch
):
    """A vip's victim was evicted just as its eviction timed out: the round judged the entry
    on a view that still showed the victim's holds, and gave the entry up ("eviction not
    carried out in time"), while the executor had released the holds and told ``evicted``.
    The event, handled between the round's read and its delete, found the entry there and
    queued nothing: the task was neither queued nor running. Now the event touches the entry
    (a new revision), so the round's delete at the revision it judged fails and keeps it."""
    from fleetpilot_services.policy.retry_round import RetryRound

    await observer.put_fleet([node("n0")])
    victim = admitted("late", gpu_milli=1000)
    await observer.kv_put("contracts", "contract.late", encode(victim))
    await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[Allocation(
        task_id="late", decision_id="late.assign", gpu=0, milli=1000, state="confirmed", at=now() - 300)])))
    note = Requeue(decision_id="late.assign.2", evict_id="late.evict.1", for_task="vip", at=now() - 120,
                   reason="preempted")
    pending = await observer.js.key_value("pending")
    await pending.put("late", encode_pending(victim, note))
    forget = RetryRound._forget
    injected = {"n": 0}

    async def the_eviction_lands_meanwhile(self, entry):
        if entry.key == "late" and not injected["n"]:
            injected["n"] += 1
            # The executor carries the eviction out: holds back, then ``evicted`` told.
            await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[])))
            await observer.js.publish("task.lifecycle.late", encode(TaskLifecycle(
                task_id="late", state="evicted", node="n0", gpus=[0], decision_id="late.assign", at=now())))
            for _ in range(100):  # handled (the entry touched, with the fix) or not, in 2 s
                if (await pending.get("late")).revision != entry.revision:
                    break
                await asyncio.sleep(0.02)
        await forget(self, entry)

    monkeypatch.setattr(RetryRound, "_forget", the_eviction_lands_meanwhile)
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        await wait_for(lambda: injected["n"] == 1, what="the entry given up")
        await wait_for(lambda: any(d.decision_id == "late.assign.2" for d in observer.decisions), timeout_s=10,
                       what="the evicted task placed again")
    finally:
        await policy.stop()
