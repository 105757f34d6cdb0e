"""Making room for a share of a GPU in the policy service over a real nats-server: a task
asking for half a GPU for ten minutes waits behind a run with hours left on a share of the
only GPU; the rebalance round checkpoints that run and queues it again with its progress,
and once the executor has stopped it, the waiter takes its share of the GPU. Where no
tenant's going would leave the waiter room on the GPU, nobody is stopped; where several
would, only the one with the most run left is, once."""

from __future__ import annotations

import asyncio

import pytest
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for
from .test_bridge import started_ago
from .test_make_way import long_stopped_for_the_waiter


def share(task_id: str, milli: int, declared_s: float):
    """A task of ``milli`` thousandths of one GPU and 20 GB declaring ``declared_s`` of run."""
    return admitted(task_id, gpu_milli=milli, gpu_memory_mb=20_000, expected_duration_s=declared_s, resumable=True)


async def test_a_run_with_hours_left_on_a_share_is_checkpointed_to_make_room_for_a_short_share(
        observer, nats_url, tmp_path):
    async def place_both() -> None:
        await observer.admit(share("long", 600, 36_000.0))
        await wait_for(lambda: "long" in observer.by_task(), timeout_s=3.0, what="long placed")
        await started_ago(observer, "big", 3600.0)
        await observer.admit(share("waiter", 500, 600.0))

    under_way, requeue, _ = await long_stopped_for_the_waiter(observer, nats_url, tmp_path, place_both)
    by_task = observer.by_task()
    placed, evict = by_task["long"]
    assert under_way == ["assign", "evict"]
    assert (evict.action, evict.decision_id, evict.policy.name) == ("evict", "long.evict.1", "make-room")
    assert "make room for waiter" in evict.reason and "500/1000 of a GPU" in evict.reason, evict.reason
    assert requeue is not None and requeue.decision_id == "long.assign.2"
    assert 3600.0 <= requeue.progress_s < 3610.0
    queued, assign = by_task["waiter"]
    assert queued.action == "queue"
    assert assign.action == "assign" and [(p.node, p.milli) for p in assign.placement] == [("big", 500)]


@pytest.mark.parametrize(("asks", "stopped"), [(700, []), (500, ["longer"])])
async def test_room_is_made_only_by_a_tenant_whose_going_leaves_enough(observer, nats_url, tmp_path, asks, stopped):
    # Two runs of 500 thousandths share the GPU, one with two hours declared, one with ten.
    # With either gone, a waiter of 700 would still not fit: neither is stopped. One of 500
    # would: the one with more left is stopped, and no other for it.
    await observer.put_fleet([node("big", gpus=1)])
    policy = build(settings(nats_url, tmp_path, rebalance_s=0.2, pending_retry_s=0.2))
    await policy.start()
    try:
        for task_id, declared_s in (("long", 7200.0), ("longer", 36_000.0)):
            await observer.admit(share(task_id, 500, declared_s))
            await wait_for(lambda t=task_id: t in observer.by_task(), timeout_s=3.0, what=f"{task_id} placed")
        await started_ago(observer, "big", 600.0)
        await observer.admit(share("waiter", asks, 600.0))
        await wait_for(lambda: "waiter" in observer.by_task(), timeout_s=3.0, what="waiter queued")
        await asyncio.sleep(1.2)  # several rebalance rounds
    finally:
        await policy.stop()
    evicts = [d for d in observer.decisions if d.action == "evict"]
    assert [(d.task_id, d.policy.name) for d in evicts] == [(t, "make-room") for t in stopped]
