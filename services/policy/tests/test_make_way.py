"""Making way in the policy service over a real nats-server: a task that only the large GPU
holds, declaring ten minutes, waits behind a run with hours left on it; the rebalance round
checkpoints that run and queues it again with its progress, and once the executor has
stopped it, the waiter takes the GPU while the run waits behind it. A run with too little
left to make the trade worth it is left alone, and so is one the queue's order (with its
aging setting) puts before the waiter, and one that cannot resume from its checkpoint."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec
import pytest
from fleetpilot.contracts import Contract
from fleetpilot.policy.preempt import Requeue, decode_pending
from fleetpilot_services.policy.service import build
from nats.js.kv import KeyValue

from .conftest import admitted, fingerprinted, node, settings, wait_for
from .test_bridge import started_ago
from .test_move_down import FLAT, PEAK_MB


async def long_run_and_a_short_waiter(observer, declared_s: float, started_s: float, resumable: bool = True) -> None:
    """A run declaring ``declared_s`` placed on the only GPU and started ``started_s`` ago,
    then a 60 GB task declaring ten minutes that only that GPU holds."""
    await fingerprinted(observer, {"waiter": FLAT})
    await observer.admit(admitted("long", gpu_milli=1000, gpu_memory_mb=PEAK_MB, expected_duration_s=declared_s,
                                  resumable=resumable))
    await wait_for(lambda: "long" in observer.by_task(), timeout_s=3.0, what="long placed")
    await started_ago(observer, "big", started_s)
    await observer.admit(admitted("waiter", gpu_milli=1000, gpu_memory_mb=PEAK_MB, expected_duration_s=600.0))


async def long_stopped_for_the_waiter(observer, nats_url, tmp_path, place_both: Callable[[], Awaitable[None]]
                                      ) -> tuple[list[str], Requeue | None, KeyValue.Entry]:
    """On the only GPU, of node ``big``: ``place_both`` places ``long`` and admits a waiter; a
    rebalance round checkpoints ``long``, and no more while that is under way; the executor
    stops it and releases its hold, and the waiter is placed. ``long``'s actions while its
    stop was under way, the requeue note of its ``pending`` entry, and that entry a while
    after the waiter was placed."""
    await observer.put_fleet([node("big", gpus=1)])
    pending = await observer.js.key_value("pending")
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        await place_both()
        await wait_for(lambda: len(observer.by_task()["long"]) == 2, timeout_s=4.0, what="long checkpointed")
        await asyncio.sleep(0.7)  # more rounds: one eviction while it is under way
        under_way = [d.action for d in observer.by_task()["long"]]
        _, requeue = decode_pending((await pending.get("long")).value)
        # The executor stops it and releases its hold: the waiter is placed, the run waits.
        await observer.kv_put("ledger", "big", b'{"node":"big","allocations":[]}')
        await wait_for(lambda: len(observer.by_task()["waiter"]) == 2, timeout_s=3.0, what="waiter placed")
        await asyncio.sleep(0.7)
        still_queued = await pending.get("long")
    finally:
        await policy.stop()
    return under_way, requeue, still_queued


async def test_a_run_with_hours_left_is_checkpointed_to_make_way_for_a_short_task(observer, nats_url, tmp_path):
    under_way, requeue, still_queued = await long_stopped_for_the_waiter(
        observer, nats_url, tmp_path,
        lambda: long_run_and_a_short_waiter(observer, declared_s=36_000.0, started_s=3600.0))
    by_task = observer.by_task()
    placed, evict = by_task["long"]
    assert under_way == ["assign", "evict"]
    assert (evict.action, evict.decision_id, evict.policy.name) == ("evict", "long.evict.1", "make-way")
    assert "make way for waiter" in evict.reason and "declares 600 s" in evict.reason, evict.reason
    assert requeue is not None and requeue.decision_id == "long.assign.2"
    assert 3600.0 <= requeue.progress_s < 3610.0  # restored, it goes on from there
    assert not requeue.for_task  # no vip: the queue is not held for the waiter
    queued, assign = by_task["waiter"]
    assert queued.action == "queue"
    assert assign.action == "assign" and [p.node for p in assign.placement] == ["big"]
    assert still_queued is not None and still_queued.value


async def rounds_with_a_waiter(observer, nats_url, tmp_path, declared_s: float, started_s: float,
                               resumable: bool = True) -> dict[str, list[str]]:
    """The actions decided for ``long`` and the waiter (``long_run_and_a_short_waiter``)
    after several rebalance rounds."""
    await observer.put_fleet([node("big", gpus=1)])
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        await long_run_and_a_short_waiter(observer, declared_s, started_s, resumable)
        await wait_for(lambda: "waiter" in observer.by_task(), timeout_s=3.0, what="waiter queued")
        await asyncio.sleep(1.2)  # several rebalance rounds
    finally:
        await policy.stop()
    return {task_id: [d.action for d in decisions] for task_id, decisions in observer.by_task().items()}


async def test_a_run_with_too_little_left_does_not_make_way(observer, nats_url, tmp_path):
    # 20 minutes left: under three times the waiter's ten minutes and the checkpoint pause.
    actions = await rounds_with_a_waiter(observer, nats_url, tmp_path, declared_s=3600.0, started_s=2400.0)
    assert actions == {"long": ["assign"], "waiter": ["queue"]}


@pytest.mark.parametrize("resumable", [True, False])
async def test_only_a_run_that_resumes_makes_way(observer, nats_url, tmp_path, resumable):
    # Hours left, as in the first test: one that cannot resume would start over, so it stays.
    actions = await rounds_with_a_waiter(observer, nats_url, tmp_path, declared_s=36_000.0, started_s=3600.0,
                                         resumable=resumable)
    assert actions["long"] == (["assign", "evict"] if resumable else ["assign"])


async def test_one_run_makes_way_for_a_waiter_while_its_eviction_is_under_way(observer, nats_url, tmp_path):
    # Two runs with hours left hold the two H100s: for one waiter, one of them is checkpointed
    # (the one with more left), and while the executor has not stopped it, no other.
    await observer.put_fleet([node("big", gpus=2)])
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.2, pending_retry_s=0.2))
    await policy.start()
    try:
        await fingerprinted(observer, {"waiter": FLAT})
        for task_id, declared_s in (("long", 36_000.0), ("longer", 72_000.0)):
            await observer.admit(admitted(task_id, gpu_milli=1000, gpu_memory_mb=PEAK_MB,
                                          expected_duration_s=declared_s))
            await wait_for(lambda t=task_id: t in observer.by_task(), timeout_s=3.0, what=f"{task_id} placed")
        await started_ago(observer, "big", 600.0)
        await observer.admit(admitted("waiter", gpu_milli=1000, gpu_memory_mb=PEAK_MB, expected_duration_s=600.0))
        await wait_for(lambda: any(d.action == "evict" for d in observer.decisions), timeout_s=4.0, what="an evict")
        await asyncio.sleep(1.0)  # several rounds
    finally:
        await policy.stop()
    evicts = [d for d in observer.decisions if d.action == "evict"]
    assert [(d.task_id, d.policy.name) for d in evicts] == [("longer", "make-way")]


@pytest.mark.parametrize(("aging", "makes_way"), [(1.0, False), (0.25, True)])
async def test_making_way_reads_the_queue_aging(observer, nats_url, tmp_path, aging, makes_way):
    """A run admitted 40,000 s ago with 32,400 s left ends, by the queue's key at aging 1,
    before a ten-minute waiter admitted now: it is not stopped for it. At 0.25 its early
    admission counts a quarter as much and the waiter comes first: it makes way."""
    await observer.put_fleet([node("big", gpus=1)])
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2, queue_aging=aging))
    await policy.start()
    try:
        await fingerprinted(observer, {"waiter": FLAT})
        long = admitted("long", gpu_milli=1000, gpu_memory_mb=PEAK_MB, expected_duration_s=36_000.0)
        await observer.admit(msgspec.structs.replace(long, admitted_at=long.admitted_at - 40_000.0))
        await wait_for(lambda: "long" in observer.by_task(), timeout_s=3.0, what="long placed")
        await started_ago(observer, "big", 3600.0)
        await observer.admit(admitted("waiter", gpu_milli=1000, gpu_memory_mb=PEAK_MB, expected_duration_s=600.0))
        await wait_for(lambda: "waiter" in observer.by_task(), timeout_s=3.0, what="waiter queued")
        await asyncio.sleep(1.2)  # several rebalance rounds
    finally:
        await policy.stop()
    assert [d.action for d in observer.by_task()["long"]] == (["assign", "evict"] if makes_way else ["assign"])


@pytest.mark.parametrize(("sites", "makes_way"), [(["site-a"], True), (["site-b"], False)])
async def test_only_a_run_at_a_site_the_waiter_may_use_makes_way(observer, nats_url, tmp_path, sites, makes_way):
    """The large GPU is at site-a. A waiter whose contract binds it to site-b could not take
    it: checkpointing the run there, as before, made it no room."""
    await observer.put_fleet([node("big", gpus=1, site="site-a"),
                              node("small", gpus=1, site="site-b", model="A10", memory_mb=24_576)])
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.3, pending_retry_s=0.2))
    await policy.start()
    try:
        await fingerprinted(observer, {"waiter": FLAT})
        await observer.admit(admitted("long", gpu_milli=1000, gpu_memory_mb=PEAK_MB, expected_duration_s=36_000.0))
        await wait_for(lambda: "long" in observer.by_task(), timeout_s=3.0, what="long placed")
        await started_ago(observer, "big", 3600.0)
        waiter = admitted("waiter", gpu_milli=1000, gpu_memory_mb=PEAK_MB, expected_duration_s=600.0)
        await observer.admit(msgspec.structs.replace(waiter, contract=Contract(
            offer_id="o-1", site=sites[0], sites=sites, warmup_ms=500.0)))
        await wait_for(lambda: "waiter" in observer.by_task(), timeout_s=3.0, what="waiter queued")
        await asyncio.sleep(1.2)  # several rebalance rounds
    finally:
        await policy.stop()
    assert [d.action for d in observer.by_task()["long"]] == (["assign", "evict"] if makes_way else ["assign"])
