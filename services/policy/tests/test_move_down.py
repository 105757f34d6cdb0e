"""Moving down in the policy service over a real nats-server: a task whose peak only the
large GPU holds waits while that GPU runs a step schedule in its low phase; the rebalance
round moves the tenant to a smaller GPU its program's envelope says it fits for a while, the
waiter takes the large GPU once the move is done, and the moved run, watched by its envelope
from when it began (its holds carry that across the move), is checkpointed before its step.
A run bridged by its envelope is not moved up merely because a GPU that holds its peak is
free: only when its envelope says it outgrows where it is. With the executor, the move is
carried out and the waiter runs where the tenant was."""

from __future__ import annotations

import asyncio

import msgspec
from fleetpilot.contracts import Fingerprint, NodeLedger, encode, now
from fleetpilot_services.policy.service import build

from .conftest import admitted, fingerprinted, node, settings, wait_for
from .test_bridge import blocker, started_ago

PEAK_MB = 60_000
A100 = dict(model="A100-40GB", memory_mb=40960)
DECLARED_S = 4800.0
# Its program's earlier runs held 20 GB for the first half of their 80 minutes, then 60 GB.
STEPS = Fingerprint(signature="sig-steps", pattern="steps", pattern_confidence=0.9, growth_rate_mb_per_s=0.0,
                    predicted_peak_mb=PEAK_MB,
                    peak_low_mb=PEAK_MB - 500, peak_high_mb=PEAK_MB + 500,
                    envelope_mb=(20_000.0,) * 10 + (float(PEAK_MB),) * 10)
FLAT = Fingerprint(signature="sig-flat", pattern="flat", pattern_confidence=0.9, growth_rate_mb_per_s=0.0,
                   predicted_peak_mb=PEAK_MB,
                   peak_low_mb=PEAK_MB - 500, peak_high_mb=PEAK_MB + 500)


async def confirm_moves(observer) -> None:
    """Play the executor: every reserved move is done (its target confirmed, its source
    released)."""
    ledgers = await observer.ledgers()
    moving = {a.task_id for ledger in ledgers.values() for a in ledger.allocations if a.state == "reserved"}
    for name, ledger in ledgers.items():
        kept = [msgspec.structs.replace(a, state="confirmed") if a.state == "reserved" else a
                for a in ledger.allocations if a.task_id not in moving or a.state == "reserved"]
        await observer.kv_put("ledger", name, encode(NodeLedger(node=name, allocations=kept)))


async def steps_on_the_h100_and_a_waiter(observer, started_s: float) -> float:
    """The step schedule placed (on the H100) and started ``started_s`` ago, then a 60 GB task
    admitted that only the H100 holds; when the step schedule's run began."""
    await fingerprinted(observer, {"steps": STEPS, "waiter": FLAT})
    await observer.admit(admitted("steps", gpu_milli=1000, gpu_memory_mb=20_000, expected_duration_s=DECLARED_S))
    await wait_for(lambda: "steps" in observer.by_task(), timeout_s=3.0, what="steps placed")
    await started_ago(observer, "big", started_s)
    began = (await observer.ledgers())["big"].allocations[0].at
    await observer.admit(admitted("waiter", gpu_milli=1000, gpu_memory_mb=PEAK_MB, expected_duration_s=3600.0))
    return began


async def test_a_tenant_in_its_low_phase_moves_down_for_a_task_only_its_gpu_holds(observer, nats_url, tmp_path):
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100)])
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        began = await steps_on_the_h100_and_a_waiter(observer, 300.0)  # 5 minutes into its run
        await wait_for(lambda: len(observer.by_task()["steps"]) == 2, timeout_s=4.0, what="steps moved down")
        await asyncio.sleep(0.7)  # more rounds: no second move while this one is in flight
        in_flight = [d.action for d in observer.by_task()["steps"]]
        await confirm_moves(observer)
        await wait_for(lambda: len(observer.by_task()["waiter"]) == 2, timeout_s=3.0, what="waiter placed")
        await asyncio.sleep(0.7)  # rounds: its envelope says 20 GB for the next 19 minutes: it stays
        stayed = [d.action for d in observer.by_task()["steps"]]
        ledgers = await observer.ledgers()
        # 37 minutes into its run, 4 minutes from the step to 60 GB: checkpointed (the large
        # GPU is taken), though the move reserved its hold a second ago.
        [hold] = ledgers["small0"].allocations
        await observer.kv_put("ledger", "small0", encode(NodeLedger(
            node="small0", allocations=[msgspec.structs.replace(hold, run_at=now() - 2200.0)])))
        await wait_for(lambda: len(observer.by_task()["steps"]) == 3, timeout_s=3.0, what="steps checkpointed")
    finally:
        await policy.stop()
    placed, down, evict = observer.by_task()["steps"]
    assert placed.action == "assign" and [p.node for p in placed.placement] == ["big"]
    assert in_flight == stayed == ["assign", "migrate"]
    assert (down.action, down.policy.name) == ("migrate", "move-down")
    assert 0.5 < down.confidence <= 1.0  # the policy's confidence in its target, not 0.0
    assert [(p.node, p.gpu) for p in down.source] == [("big", 0)]
    assert [(p.node, p.gpu, p.memory_mb) for p in down.placement] == [("small0", 0, 40960)]
    assert down.reason.startswith("moved down for waiter"), down.reason
    # The hold it moved to carries when its run began.
    assert [(a.task_id, a.run_at) for a in ledgers["small0"].allocations] == [("steps", began)]
    queued, assign = observer.by_task()["waiter"]
    assert queued.action == "queue" and assign.action == "assign"
    assert [p.node for p in assign.placement] == ["big"]
    assert (evict.action, evict.policy.name) == ("evict", "checkpoint")
    assert "60000 MB per GPU by 41 min" in evict.reason and "envelope" in evict.reason, evict.reason


async def test_a_tenant_whose_envelope_steps_within_the_quarter_hour_is_not_moved_down(
    observer, nats_url, tmp_path
):
    # 25 minutes into its run, its envelope steps to 60 GB within the next quarter hour and
    # lookahead: on the A100 it would have to leave again at once.
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100)])
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.2, pending_retry_s=0.1))
    await policy.start()
    try:
        await steps_on_the_h100_and_a_waiter(observer, 1500.0)
        await wait_for(lambda: "waiter" in observer.by_task(), timeout_s=3.0, what="waiter queued")
        await asyncio.sleep(1.0)  # rounds
    finally:
        await policy.stop()
    assert [d.action for d in observer.by_task()["steps"]] == ["assign"]
    assert [d.action for d in observer.by_task()["waiter"]] == ["queue"]


async def test_a_run_bridged_by_its_envelope_moves_up_when_its_envelope_says_not_when_a_gpu_frees(
    observer, nats_url, tmp_path
):
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100)])
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[blocker("held")])))
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        await fingerprinted(observer, {"steps": STEPS})
        await observer.admit(admitted("steps", gpu_milli=1000, gpu_memory_mb=20_000, expected_duration_s=DECLARED_S))
        await wait_for(lambda: "steps" in observer.by_task(), timeout_s=3.0, what="steps bridged")
        await started_ago(observer, "small0", 60.0)
        await observer.kv_put("ledger", "big", encode(NodeLedger(node="big")))  # the H100 frees
        await asyncio.sleep(1.0)  # rounds: 20 GB by its envelope for the next 20 minutes: it stays
        stayed = [d.action for d in observer.by_task()["steps"]]
        await started_ago(observer, "small0", 2200.0)  # 4 minutes from its step
        await wait_for(lambda: len(observer.by_task()["steps"]) == 2, timeout_s=3.0, what="steps moved up")
    finally:
        await policy.stop()
    bridged, up = observer.by_task()["steps"]
    assert bridged.reason.startswith("bridge:") and [p.node for p in bridged.placement] == ["small0"]
    assert stayed == ["assign"]
    assert up.action == "migrate" and [p.node for p in up.placement] == ["big"], up


async def test_two_waiters_each_get_room_from_a_tenant_of_their_own(observer, nats_url, tmp_path):
    await observer.put_fleet([node("big0", gpus=1), node("big1", gpus=1),
                              node("small0", gpus=1, **A100), node("small1", gpus=1, **A100)])
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        await fingerprinted(observer, {"s0": STEPS, "s1": STEPS, "w0": FLAT, "w1": FLAT})
        for name in ("s0", "s1"):
            await observer.admit(admitted(name, gpu_milli=1000, gpu_memory_mb=20_000, expected_duration_s=DECLARED_S))
        await wait_for(lambda: {"s0", "s1"} <= set(observer.by_task()), timeout_s=3.0, what="tenants placed")
        for name in ("big0", "big1"):
            await started_ago(observer, name, 300.0)
        for name in ("w0", "w1"):
            await observer.admit(admitted(name, gpu_milli=1000, gpu_memory_mb=PEAK_MB, expected_duration_s=3600.0))
        moved = lambda: [d for d in observer.decisions if d.action == "migrate"]  # noqa: E731
        await wait_for(lambda: len(moved()) == 2, timeout_s=4.0, what="both tenants moved down")
        await asyncio.sleep(0.7)  # more rounds: no third move
        await confirm_moves(observer)
        await wait_for(lambda: all(len(observer.by_task()[w]) == 2 for w in ("w0", "w1")), timeout_s=3.0,
                       what="both waiters placed")
    finally:
        await policy.stop()
    downs = [d for d in observer.decisions if d.action == "migrate"]
    assert sorted(d.task_id for d in downs) == ["s0", "s1"]
    assert {d.placement[0].node for d in downs} == {"small0", "small1"}
    assert all(d.policy.name == "move-down" for d in downs)
    assert {observer.by_task()[w][1].placement[0].node for w in ("w0", "w1")} == {"big0", "big1"}


async def test_the_executor_carries_out_a_move_down_and_the_waiter_runs_where_the_tenant_was(
    observer, nats_url, tmp_path
):
    from .test_preempt_and_resize import policy_and_executor

    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100)])
    async with policy_and_executor(observer, nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2):
        await fingerprinted(observer, {"steps": STEPS, "waiter": FLAT})
        await observer.admit(admitted("steps", gpu_milli=1000, gpu_memory_mb=20_000, expected_duration_s=DECLARED_S))

        async def holds() -> dict[str, list[tuple[str, str]]]:
            return {name: [(a.task_id, a.state) for a in ledger.allocations]
                    for name, ledger in (await observer.ledgers()).items()}

        for _ in range(100):  # the executor starts it
            if (await holds()).get("big") == [("steps", "confirmed")]:
                break
            await asyncio.sleep(0.05)
        began = (await observer.ledgers())["big"].allocations[0].at
        await observer.admit(admitted("waiter", gpu_milli=1000, gpu_memory_mb=PEAK_MB, expected_duration_s=3600.0))
        for _ in range(200):  # moved down by the executor, the waiter started where it was
            if await holds() == {"big": [("waiter", "confirmed")], "small0": [("steps", "confirmed")]}:
                break
            await asyncio.sleep(0.05)
        ledgers = await observer.ledgers()
    assert {name: [(a.task_id, a.state) for a in ledger.allocations] for name, ledger in ledgers.items()} == {
        "big": [("waiter", "confirmed")], "small0": [("steps", "confirmed")]}
    [moved] = ledgers["small0"].allocations
    assert (moved.decision_id, moved.memory_mb, moved.run_at) == ("steps.migrate.1", 40960, began)
    assert [d.action for d in observer.by_task()["steps"]] == ["assign", "migrate"]
    assert [d.action for d in observer.by_task()["waiter"]] == ["queue", "assign"]
