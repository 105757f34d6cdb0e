"""Bridging in the policy service over a real nats-server: a task whose fingerprint predicts
smooth growth (``leak``) past every free GPU starts on a GPU that holds its ask, where a
``flat`` task of the same peak waits; a queued grower is bridged by the retry round even
behind a flat task that found no node; once a GPU that holds its peak has room, the
rebalance round migrates the bridged task up to it; one whose measured growth would overflow
its GPU while none holds its peak is checkpointed (evicted) and queued again, and placed
again once one does."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from fleetpilot.contracts import (
    Allocation,
    Fingerprint,
    NodeLedger,
    TaskTelemetry,
    encode,
    now,
    subject_for,
)
from fleetpilot.fingerprint import SignatureStats, task_signature
from fleetpilot.ledger.store import node_key
from fleetpilot.policy.preempt import NoRoom, claim_of, decode_pending, no_room_of
from fleetpilot_services.policy.service import build

from .conftest import admitted, fingerprinted, node, settings, wait_for

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


async def started_ago(observer, node_name: str, seconds: float) -> None:
    """Confirm every hold on ``node_name`` as if the executor had started it ``seconds`` ago."""
    ledgers = await observer.ledgers()
    held = [msgspec.structs.replace(a, state="confirmed", at=now() - seconds) for a in ledgers[node_name].allocations]
    await observer.kv_put("ledger", node_name, encode(NodeLedger(node=node_name, allocations=held)))


def task(task_id: str):
    return admitted(task_id, gpu_milli=1000, gpu_memory_mb=ASK_MB)


async def started_on_one_held_gpu(observer, nats_url, tmp_path, **overrides):
    """A policy replica retrying its queue every 0.2 s, on a fleet of one node whose one GPU
    is held; started."""
    await observer.put_fleet([node("big", gpus=1)])
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[blocker("held")])))
    policy = build(settings(nats_url, tmp_path, pending_retry_s=0.2, **overrides))
    await policy.start()
    return policy


async def told_no_room(pending, task_id: str) -> NoRoom | None:
    """What ``task_id``'s pending entry says kept it off every node."""
    value = (await pending.get(node_key(task_id))).value
    claimed = claim_of(value)  # a retry round may hold it as it was read
    return no_room_of(claimed[1] if claimed is not None else value)


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
        waiting = await (await observer.js.key_value("pending")).get(node_key("flat"))
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
    [flat] = by_task["flat"]
    # The queue decision says what keeps the task off each node, as the policy counted it.
    assert (flat.action, flat.reason) == ("queue", "no node has room now (0 of 3 nodes: 2 lack free GPUs, "
                                          "1 lack free GPU memory); queued until capacity frees")
    # Its queue entry keeps it for `fleetpilot queue`, through the retry rounds' refusals.
    claimed = claim_of(waiting.value)  # a retry round may hold it as it was read
    no_room = no_room_of(claimed[1] if claimed is not None else waiting.value)
    assert no_room is not None and no_room.shortfall == "0 of 3 nodes: 2 lack free GPUs, 1 lack free GPU memory"


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


async def sample(observer, task_id: str, node_name: str, at: float, used_mb: float) -> None:
    """A memory sample of a task, as the collector publishes it."""
    event = TaskTelemetry(task_id=task_id, node=node_name, gpus=[0], at=at, memory_used_mb=used_mb)
    await observer.nc.publish(subject_for(event), encode(event))


async def test_a_bridged_task_about_to_overflow_with_nowhere_to_go_is_checkpointed_and_queued_again(
    observer, nats_url, tmp_path
):
    await observer.put_fleet([node("big", gpus=2), node("small0", gpus=1, **A100), node("small1", gpus=1, **A100)])
    both = [blocker("held"), msgspec.structs.replace(blocker("held"), gpu=1)]
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=both)))
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        await fingerprinted(observer, {"fast": fingerprint("leak"), "slow": fingerprint("leak")})
        await observer.admit(task("fast"))
        await observer.admit(task("slow"))
        await wait_for(lambda: len(observer.decisions) == 2, timeout_s=3.0, what="both bridged")
        ledgers = await observer.ledgers()
        for name in ("small0", "small1"):  # the executor starts both
            held = [msgspec.structs.replace(a, state="confirmed") for a in ledgers[name].allocations]
            await observer.kv_put("ledger", name, encode(NodeLedger(node=name, allocations=held)))
        where = {d.task_id: d.placement[0].node for d in observer.decisions}
        # fast grows 8 GB a minute from 30 GB: its 40 GB A100 overflows within the lookahead.
        # slow grows 100 MB a minute: in four minutes it is still far from its GPU's end.
        t = now()
        for at, fast_mb, slow_mb in ((t - 60, 22_000, 22_000), (t - 30, 26_000, 22_050), (t, 30_000, 22_100)):
            await sample(observer, "fast", where["fast"], at, fast_mb)
            await sample(observer, "slow", where["slow"], at, slow_mb)
        await wait_for(lambda: len(observer.by_task()["fast"]) == 2, timeout_s=3.0, what="fast checkpointed")
        await asyncio.sleep(0.7)  # more rounds: one eviction, and slow stays
        entry = await (await observer.js.key_value("pending")).get("fast")
        slow_meanwhile = [d.action for d in observer.by_task()["slow"]]
        # The H100s free, then the executor stops fast and releases its hold: fast is placed
        # again (and slow, bridged, moves up to the other). In this order: fast waits for its
        # release, so a round between the two writes cannot place it before the H100s free.
        await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[])))
        await observer.kv_put("ledger", where["fast"], encode(NodeLedger(node=where["fast"], allocations=[])))
        await wait_for(lambda: len(observer.by_task()["fast"]) == 3, timeout_s=3.0, what="fast placed again")
    finally:
        await policy.stop()
    by_task = observer.by_task()
    assert slow_meanwhile == ["assign"]
    _, evict, again = by_task["fast"]
    assert (evict.action, evict.decision_id, evict.policy.name) == ("evict", "fast.evict.1", "checkpoint")
    assert [(p.node, p.gpu) for p in evict.source] == [(where["fast"], 0)]
    assert "within 240 s it would pass" in evict.reason, evict.reason
    assert 0.5 < evict.confidence < 1.0
    _, requeue = decode_pending(entry.value)
    assert requeue is not None and (requeue.decision_id, requeue.evict_id) == ("fast.assign.2", "fast.evict.1")
    assert requeue.bridge_floor_mb == A100["memory_mb"] + 1  # the room it outgrew
    assert (again.action, again.decision_id) == ("assign", "fast.assign.2")
    assert [p.node for p in again.placement] == ["big"]  # a GPU that holds its peak


async def bridge_and_checkpoint(observer, task_id: str, stayed_s: float = 0.0) -> tuple[str, float]:
    """Admit a linear grower, let it be bridged onto an A100 (the H100 held) and confirmed
    there as if started ``stayed_s`` ago, then grow it 12 GB a minute from 18 GB to 30 GB until
    it is checkpointed; its node and the time of its last sample."""
    before = len(observer.decisions)
    await fingerprinted(observer, {task_id: fingerprint("linear")})
    await observer.admit(task(task_id))
    await wait_for(lambda: len(observer.decisions) == before + 1, timeout_s=3.0, what=f"{task_id} bridged")
    where = observer.decisions[-1].placement[0].node
    await started_ago(observer, where, stayed_s)
    t = now()
    for at, used_mb in ((t - 60, 18_000), (t - 30, 24_000), (t, 30_000)):
        await sample(observer, task_id, where, at, used_mb)
    await wait_for(lambda: len(observer.by_task()[task_id]) == 2, timeout_s=3.0, what=f"{task_id} checkpointed")
    return where, t


async def test_a_checkpointed_grower_is_not_bridged_again_onto_a_gpu_no_larger_than_it_outgrew(
    observer, nats_url, tmp_path
):
    # Restored from its checkpoint, a step schedule comes back with what it had reached:
    # started again on a 40 GB A100 it would die of OOM at its next step.
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100), node("small1", gpus=1, **A100)])
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[blocker("held")])))
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        first, _ = await bridge_and_checkpoint(observer, "fast")
        # The executor stops it and releases its hold: both A100s are free, the H100 is not.
        await observer.kv_put("ledger", first, encode(NodeLedger(node=first, allocations=[])))
        await asyncio.sleep(1.0)  # several retry rounds
        meanwhile = [d.action for d in observer.by_task()["fast"]]
        await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[])))
        await wait_for(lambda: len(observer.by_task()["fast"]) == 3, timeout_s=3.0, what="fast placed again")
    finally:
        await policy.stop()
    assert meanwhile == ["assign", "evict"]
    again = observer.by_task()["fast"][2]
    assert (again.action, [p.node for p in again.placement]) == ("assign", ["big"])


async def checkpoint_a_leak_that_stayed(observer, nats_url, tmp_path, stayed_s: float):
    """Bridge a run of a program whose restores the fingerprinter counted as started over
    (a leak, a cache) onto an A100, started ``stayed_s`` ago, and let it be checkpointed there
    for outgrowing it; then free both A100s, and after a few retry rounds the H100: its
    requeue note and its placements."""
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100), node("small1", gpus=1, **A100)])
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[blocker("held")])))
    leak = task_signature(task("leak").task)
    await observer.kv_put("fingerprints", leak, encode(SignatureStats(signature=leak, restores_kept=1,
                                                                      restores_reset=2)))
    pending = await observer.js.key_value("pending")
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        await bridge_and_checkpoint(observer, "leak", stayed_s)
        _, note = decode_pending((await pending.get("leak")).value)
        await observer.kv_put("ledger", "small0", encode(NodeLedger(node="small0", allocations=[])))
        await observer.kv_put("ledger", "small1", encode(NodeLedger(node="small1", allocations=[])))
        await asyncio.sleep(1.0)  # several retry rounds
        await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[])))
        await wait_for(lambda: len(observer.by_task()["leak"]) == 3, timeout_s=3.0, what="leak placed again")
    finally:
        await policy.stop()
    return note, observer.by_task()["leak"]


async def test_a_signature_whose_restores_started_over_may_be_bridged_again_onto_the_same_room(
    observer, nats_url, tmp_path
):
    # A run of it that stayed 20 minutes on an A100 before it outgrew it may start again on an
    # A100, where starting over buys it about as long again (a program whose restores are not
    # known to start over may not: the test above).
    note, placements = await checkpoint_a_leak_that_stayed(observer, nats_url, tmp_path, stayed_s=1200.0)
    assert note is not None and note.bridge_floor_mb == 0
    again = placements[2]
    assert again.action == "assign" and again.placement[0].node in ("small0", "small1")  # the room it outgrew


async def test_a_run_that_outgrew_its_room_within_minutes_is_not_bridged_again_onto_it_though_it_starts_over(
    observer, nats_url, tmp_path
):
    # Started over on the same A100 it would be stopped again as soon, a pause each time,
    # until it outgrew it between two samples: it waits for more room instead.
    note, placements = await checkpoint_a_leak_that_stayed(observer, nats_url, tmp_path, stayed_s=60.0)
    assert note is not None and note.bridge_floor_mb == A100["memory_mb"] + 1
    again = placements[2]
    assert (again.action, [p.node for p in again.placement]) == ("assign", ["big"])


async def test_a_step_schedule_is_bridged_by_its_envelope_and_checkpointed_before_the_step_that_outgrows_it(
    observer, nats_url, tmp_path
):
    # Its program's earlier runs held 30 GB for the first half of their 40 minutes, then
    # 60 GB: a run may spend that half on an A100, and must leave it before the step. The
    # same program with no envelope known waits for the H100.
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100)])
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[blocker("held")])))
    envelope = (30_000.0,) * 10 + (PEAK_MB,) * 10
    stepped = msgspec.structs.replace(fingerprint("steps"), envelope_mb=envelope)
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        await fingerprinted(observer, {"blind": fingerprint("steps"), "steps": stepped})
        await observer.admit(admitted("blind", gpu_milli=1000, gpu_memory_mb=ASK_MB, expected_duration_s=2400.0))
        await wait_for(lambda: "blind" in observer.by_task(), timeout_s=3.0, what="blind decided")
        await observer.admit(admitted("steps", gpu_milli=1000, gpu_memory_mb=ASK_MB, expected_duration_s=2400.0))
        await wait_for(lambda: "steps" in observer.by_task(), timeout_s=3.0, what="steps decided")
        await asyncio.sleep(0.7)  # rounds: 30 GB by the envelope over the next 19 minutes: it stays
        stayed = [d.action for d in observer.by_task()["steps"]]
        # The executor started it 1,000 s ago: within the lookahead the envelope steps to 60 GB.
        await started_ago(observer, "small0", 1000.0)
        await wait_for(lambda: len(observer.by_task()["steps"]) == 2, timeout_s=3.0, what="steps checkpointed")
    finally:
        await policy.stop()
    by_task = observer.by_task()
    assert [d.action for d in by_task["blind"]] == ["queue"]
    bridged, evict = by_task["steps"]
    assert bridged.action == "assign" and [p.node for p in bridged.placement] == ["small0"]
    assert bridged.reason.startswith("bridge: starts on 30613 MB"), bridged.reason
    assert stayed == ["assign"]
    assert (evict.action, evict.policy.name) == ("evict", "checkpoint")
    assert "60000 MB per GPU by 21 min" in evict.reason and "envelope" in evict.reason, evict.reason


async def started_and_checkpointed(observer, task_id: str, fp: Fingerprint) -> None:
    """Admit a 40-minute task of ``fp`` that the policy bridges onto the A100 ``small0`` (the
    H100 held), have the executor start it 1,000 s ago, and wait for its checkpoint: within the
    lookahead its envelope steps past the A100."""
    await fingerprinted(observer, {task_id: fp})
    await observer.admit(admitted(task_id, gpu_milli=1000, gpu_memory_mb=ASK_MB, expected_duration_s=2400.0))
    await wait_for(lambda: task_id in observer.by_task(), timeout_s=3.0, what=f"{task_id} decided")
    await started_ago(observer, "small0", 1000.0)
    await wait_for(lambda: len(observer.by_task()[task_id]) == 2, timeout_s=3.0, what=f"{task_id} checkpointed")


async def test_a_step_schedule_voted_a_line_is_watched_by_its_envelope_too(observer, nats_url, tmp_path):
    # The fingerprinter's vote named a line for a program whose runs held 30 GB for half their
    # 40 minutes, then 60 GB. Bridged by its rate onto an A100, it sits flat between its steps:
    # no rate announces the step, its envelope does, and it is checkpointed before it.
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100)])
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[blocker("held")])))
    voted = msgspec.structs.replace(fingerprint("linear"), envelope_mb=(30_000.0,) * 10 + (PEAK_MB,) * 10)
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        await started_and_checkpointed(observer, "line", voted)
    finally:
        await policy.stop()
    bridged, evict = observer.by_task()["line"]
    assert bridged.action == "assign" and bridged.reason.startswith("bridge: starts on its ask of 20000 MB")
    assert (evict.action, evict.policy.name) == ("evict", "checkpoint")
    assert "60000 MB per GPU by 21 min" in evict.reason and "envelope" in evict.reason, evict.reason


async def test_a_checkpointed_step_schedule_is_restored_with_its_progress_on_its_new_hold(
    observer, nats_url, tmp_path
):
    # Checkpointed 1,000 s into its run before the step that outgrows its A100, the schedule
    # comes back from its checkpoint where it stood: its restored hold says its run began
    # 1,000 s before the restore, so its declared run is counted from there, not from anew.
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100)])
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[blocker("held")])))
    stepped = msgspec.structs.replace(fingerprint("steps"), envelope_mb=(30_000.0,) * 10 + (PEAK_MB,) * 10)
    pending = await observer.js.key_value("pending")
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        await started_and_checkpointed(observer, "steps", stepped)
        _, requeue = decode_pending((await pending.get("steps")).value)
        # The executor stops it and the H100 frees: it is placed again there.
        await observer.kv_put("ledger", "small0", encode(NodeLedger(node="small0", allocations=[])))
        await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[])))
        await wait_for(lambda: len(observer.by_task()["steps"]) == 3, timeout_s=3.0, what="steps placed again")
        restored = (await observer.ledgers())["big"].allocations
    finally:
        await policy.stop()
    assert requeue is not None and 1000.0 <= requeue.progress_s < 1010.0
    assert [(a.task_id, a.decision_id) for a in restored] == [("steps", "steps.assign.2")]
    assert restored[0].run_at == pytest.approx(restored[0].at - requeue.progress_s, abs=0.5)


async def test_a_steady_climb_moves_up_when_its_measured_rate_nears_the_edge_not_on_its_fitted_line(
    observer, nats_url, tmp_path
):
    """A line fitted to a run's first minutes (its predicted 60 GB peak) cannot tell a warm-up
    ramp from a climb: while its measured rate, carried ``growth_lookahead_s`` ahead, fits its
    A100, it stays, though a GPU that holds the peak is free; once the rate says it passes the
    A100 within the lookahead, it moves up."""
    await observer.put_fleet([node("big", gpus=1), node("small0", gpus=1, **A100)])
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[blocker("held")])))
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3))
    await policy.start()
    try:
        await fingerprinted(observer, {"climb": fingerprint("linear")})
        await observer.admit(task("climb"))
        await wait_for(lambda: "climb" in observer.by_task(), timeout_s=3.0, what="climb decided")
        await started_ago(observer, "small0", 120.0)
        await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[])))
        t0 = now() - 120.0
        for at, used_mb in ((t0, 10_000.0), (t0 + 60.0, 10_500.0), (t0 + 120.0, 11_000.0)):
            await sample(observer, "climb", "small0", at, used_mb)  # +500 MB a minute
        await asyncio.sleep(1.2)  # four rounds: 13 GB in four minutes fits the A100
        assert [d.action for d in observer.by_task()["climb"]] == ["assign"]
        await sample(observer, "climb", "small0", t0 + 180.0, 25_000.0)  # +5 GB a minute since the first
        await wait_for(lambda: len(observer.by_task()["climb"]) == 2, timeout_s=3.0, what="climb moved up")
    finally:
        await policy.stop()
    assign, move = observer.by_task()["climb"]
    assert assign.placement[0].node == "small0"
    assert move.action == "migrate" and move.placement[0].node == "big"
    assert "predicted OOM in place" in move.reason


@pytest.mark.parametrize("bigger_gpu_in_fleet", [True, False])
async def test_a_run_outgrowing_the_largest_gpu_it_accepts_is_not_checkpointed_to_come_back_to_no_more_room(
    observer, nats_url, tmp_path, bigger_gpu_in_fleet
):
    # "grow" runs alone on the whole 80 GB H100 and will pass it (fingerprint: 90 GB; measured:
    # 8 GB a minute from 60 GB). With a 141 GB H200 in the fleet (busy now), it is checkpointed
    # to wait for one. Without, queued again it could only come back to an 80 GB GPU: before,
    # on the fallback scheduler, it was placed there, checkpointed and placed again every round.
    fleet = [node("big", gpus=1), node("small", gpus=1, **A100)]
    if bigger_gpu_in_fleet:
        fleet.append(node("huge", gpus=1, model="H200", memory_mb=143_771))
        huge = msgspec.structs.replace(blocker("held"), memory_mb=143_771)
        await observer.kv_put("ledger", "huge", encode(NodeLedger(node="huge", allocations=[huge])))
    await observer.put_fleet(fleet)
    adm = admitted("grow", gpu_milli=1000, gpu_memory_mb=ASK_MB, gpu_models=["H100", "H200"])
    await observer.kv_put("contracts", "contract.grow", encode(adm))
    hold = Allocation(task_id="grow", decision_id="grow.assign", gpu=0, milli=1000, memory_mb=81920,
                      state="confirmed", at=now() - 600)
    await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[hold])))
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        grower = msgspec.structs.replace(fingerprint("leak"), predicted_peak_mb=90_000, peak_low_mb=89_500,
                                         peak_high_mb=90_500)
        await fingerprinted(observer, {"grow": grower})
        t = now()
        for at, used_mb in ((t - 60, 60_000), (t - 30, 64_000), (t, 68_000)):
            await sample(observer, "grow", "big", at, used_mb)
        if bigger_gpu_in_fleet:
            await wait_for(lambda: "grow" in observer.by_task(), timeout_s=3.0, what="grow checkpointed")
        else:
            await asyncio.sleep(1.5)  # five rebalance rounds
    finally:
        await policy.stop()
    decisions = [(d.action, d.policy.name) for d in observer.by_task().get("grow", [])]
    assert decisions == ([("evict", "checkpoint")] if bigger_gpu_in_fleet else [])


async def test_the_retry_round_keeps_what_kept_a_waiting_task_off_every_node_in_its_queue_entry(
    observer, nats_url, tmp_path
):
    policy = await started_on_one_held_gpu(observer, nats_url, tmp_path)
    pending = await observer.js.key_value("pending")

    async def no_room() -> NoRoom | None:
        return await told_no_room(pending, "wait")

    try:
        await observer.admit(task("wait"))
        await wait_for(lambda: "wait" in observer.by_task(), timeout_s=3.0, what="wait queued")
        first = await no_room()
        # The GPU's share is given back but its memory stays held: refused for another reason.
        memory_only = msgspec.structs.replace(blocker("held"), milli=0)
        await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[memory_only])))
        deadline = asyncio.get_running_loop().time() + 3.0
        while (later := await no_room()) == first and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
    finally:
        await policy.stop()
    assert first is not None and first.shortfall == "0 of 1 nodes: 1 lack free GPUs"
    assert later is not None and later.shortfall == "0 of 1 nodes: 1 lack free GPU memory" and later.at > first.at
    [queued] = observer.by_task()["wait"]  # one decision: the entry, not a new queue decision, says it
    assert queued.reason == "no node has room now (0 of 1 nodes: 1 lack free GPUs); queued until capacity frees"


@pytest.mark.parametrize("refresh_s", [0.5, 3600.0])
async def test_a_waiting_task_the_retry_round_skips_is_told_why_the_task_asking_no_more_found_no_node(
    observer, nats_url, tmp_path, refresh_s
):
    # One GPU, held. "small" (one GPU) waits first in the queue's order, "wide" (two) behind
    # it: once "small" finds no node in a round, "wide" needs no less and is not tried. Its
    # entry kept the reason of its admission; now it is told "small"'s, at most every
    # `no_room_refresh_s`.
    policy = await started_on_one_held_gpu(observer, nats_url, tmp_path, no_room_refresh_s=refresh_s)
    pending = await observer.js.key_value("pending")

    async def no_room() -> NoRoom | None:
        return await told_no_room(pending, "wide")

    try:
        await observer.admit(task("small"))
        await wait_for(lambda: "small" in observer.by_task(), timeout_s=3.0, what="small queued")
        await observer.admit(admitted("wide", gpus=2, gpu_milli=1000, gpu_memory_mb=ASK_MB))
        await wait_for(lambda: "wide" in observer.by_task(), timeout_s=3.0, what="wide queued")
        first = await no_room()
        deadline = asyncio.get_running_loop().time() + (3.0 if refresh_s < 1 else 1.2)
        while ((later := await no_room()) is None or not later.like) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
    finally:
        await policy.stop()
    assert first is not None and first.like == "" and first.shortfall == "0 of 1 nodes: 1 lack free GPUs"
    if refresh_s < 1:
        assert later is not None and later.like == "small" and later.at > first.at
        assert later.shortfall == "0 of 1 nodes: 1 lack free GPUs"  # small's, as the policy counted it
    else:
        assert later == first  # told at admission, under the refresh period: left as it was


async def test_the_retry_round_reports_how_many_tasks_wait_by_tier_and_the_longest_wait(observer, nats_url, tmp_path):
    # One GPU, held: "small" (standard, one GPU) and "wide" (vip, two) wait. Once the GPU is
    # given back, "small" is placed; "wide" still waits (the node has one GPU).
    policy = await started_on_one_held_gpu(observer, nats_url, tmp_path)
    registry = policy.metrics.registry

    def waiting() -> tuple[float | None, ...]:
        return (*(registry.get_sample_value("fleetpilot_policy_waiting_tasks", {"tier": t})
                  for t in ("vip", "standard", "best_effort")),)

    try:
        await observer.admit(task("small"))
        wide = admitted("wide", gpus=2, gpu_milli=1000, gpu_memory_mb=ASK_MB)
        await observer.admit(msgspec.structs.replace(wide, contract=msgspec.structs.replace(wide.contract, tier="vip")))
        await wait_for(lambda: waiting() == (1.0, 1.0, 0.0), timeout_s=3.0, what="both counted")
        await asyncio.sleep(0.5)
        oldest = registry.get_sample_value("fleetpilot_policy_oldest_wait_seconds")
        await observer.kv_put("ledger", "big", encode(NodeLedger(node="big", allocations=[])))
        await wait_for(lambda: waiting() == (1.0, 0.0, 0.0), timeout_s=3.0, what="small placed")
    finally:
        await policy.stop()
    assert oldest is not None and 0.5 <= oldest < 10.0
    assert "small" in {d.task_id for d in observer.by_task()["small"] if d.action == "assign"}
