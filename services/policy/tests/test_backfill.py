"""EASY backfill in the policy service over a real nats-server: a blocked 2-GPU task gets a
reservation on the node whose GPUs free first (by the running tasks' declared durations); a
task expected to outlast that release is kept off the reserved GPU, a short one uses it."""

from __future__ import annotations

import asyncio
import json

import msgspec
from fleetpilot.contracts import Allocation, Contract, NodeLedger, TaskAdmitted, TaskSubmitted, encode, now
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


def running(task_id: str, gpu: int, started_s_ago: float, declared_s: float) -> tuple[Allocation, TaskAdmitted]:
    """A confirmed whole-GPU hold and the contract of the task that holds it."""
    hold = Allocation(task_id=task_id, decision_id=f"{task_id}.assign", gpu=gpu, milli=1000, memory_mb=1000,
                      state="confirmed", at=now() - started_s_ago)
    task = TaskSubmitted(task_id=task_id, kind="train", gpu_milli=1000, expected_duration_s=declared_s)
    return hold, TaskAdmitted(task=task, contract=Contract(), tenant="t", admitted_at=now() - started_s_ago)


def whole(task_id: str, gpus: int, declared_s: float | None) -> TaskAdmitted:
    adm = admitted(task_id, gpus=gpus, gpu_milli=1000)
    return msgspec.structs.replace(adm, task=msgspec.structs.replace(adm.task, expected_duration_s=declared_s))


async def test_a_blocked_wide_task_keeps_its_gpus_from_long_tasks_but_not_from_short_ones(
    observer, nats_url, tmp_path
):
    await observer.put_fleet([node("n0"), node("n1")])
    # n0 frees in ~20 min (b); n1's GPU 0 in ~1 min (c) and its GPU 1 is idle: the 2-GPU
    # task's earliest start is on n1, in about a minute.
    holds = {"n0": [running("a", 0, 100, 400), running("b", 1, 100, 1300)], "n1": [running("c", 0, 540, 600)]}
    for name, pairs in holds.items():
        await observer.kv_put("ledger", name, encode(NodeLedger(node=name, allocations=[h for h, _ in pairs])))
        for _, adm in pairs:
            await observer.kv_put("contracts", f"contract.{adm.task.task_id}", encode(adm))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        await observer.admit(whole("wide", 2, 3600))
        await wait_for(lambda: any(d.task_id == "wide" for d in observer.decisions), what="wide queued")
        await asyncio.sleep(0.6)  # retry rounds: the reservation is made
        await observer.admit(whole("long", 1, 3600))  # would take n1's idle GPU for an hour
        await observer.admit(whole("undeclared", 1, None))  # no duration: assumed long
        await observer.admit(whole("short", 1, 30))  # done before c: may use it meanwhile
        await wait_for(lambda: len(observer.by_task()) == 4, what="a decision for every task")
        await asyncio.sleep(0.6)
    finally:
        await policy.stop()
    first = {task: ds[0] for task, ds in observer.by_task().items()}
    assert first["wide"].action == "queue"
    assert first["long"].action == "queue" and first["undeclared"].action == "queue"
    assert first["short"].action == "assign"
    assert [(p.node, p.gpu) for p in first["short"].placement] == [("n1", 1)]
    # Nothing but the short task was placed while the reservation stands.
    assert [d.task_id for d in observer.decisions if d.action == "assign"] == ["short"]


async def test_a_round_skips_waiters_that_need_no_less_than_one_that_found_no_node(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0", gpus=1)])
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.1, record_every=1))
    await policy.start()
    try:
        await observer.admit(whole("blocker", 1, 3600))
        await wait_for(lambda: len(observer.decisions) == 1, what="the blocker placed")
        waiters = [f"w{i}" for i in range(8)]
        for task_id in waiters:
            await observer.admit(whole(task_id, 1, 600))
        await wait_for(lambda: len(observer.decisions) == 1 + len(waiters), what="the waiters queued")
        await asyncio.sleep(1.0)  # several retry rounds
    finally:
        await policy.stop()
    tried = [json.loads(line)["task"]["task_id"] for line in (tmp_path / "policy-states-a.jsonl").read_text().splitlines()]
    # Each round tries the oldest waiter; the others need no less, so they are not tried
    # again after their admission.
    assert tried.count("w0") >= 3
    assert all(tried.count(t) == 1 for t in waiters[1:]), {t: tried.count(t) for t in waiters}
