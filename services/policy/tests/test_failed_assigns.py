"""An assign the executor could not carry out for a passing reason (the backend did not
answer) is placed again under the task's next assign id; a refusal that would repeat is
not. Over a real nats-server, the executor played by the test."""

from __future__ import annotations

import asyncio

from fleetpilot.contracts import ActionFailed, NodeLedger, PolicyRef, encode, now
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


def failure(task_id: str, retryable: bool) -> ActionFailed:
    return ActionFailed(action_id=f"act-{task_id}.assign", decision_id=f"{task_id}.assign", task_id=task_id,
                        action="assign", backend="sim", error="simulated fleet did not answer" if retryable
                        else "business rule: n0/0: reserved", retryable=retryable,
                        policy=PolicyRef(name="bestfit"), failed_at=now())


async def test_a_retryable_assign_failure_is_placed_again_and_a_refusal_is_not(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0")])
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        for task_id in ("t", "u"):
            await observer.admit(admitted(task_id, gpu_milli=500))
        await wait_for(lambda: len(observer.decisions) == 2, what="first placements")
        # The executor failed both and released their holds, then reported it.
        await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[])))
        for task_id, retryable in (("t", True), ("u", False)):
            await observer.js.publish("action.failed", encode(failure(task_id, retryable)))
        await wait_for(lambda: any(d.decision_id == "t.assign.2" for d in observer.decisions), what="t again")
        await asyncio.sleep(0.6)  # retry rounds: nothing else comes
        ledger = (await observer.ledgers())["n0"]
    finally:
        await policy.stop()
    ids = [d.decision_id for d in observer.decisions]
    assert sorted(ids) == ["t.assign", "t.assign.2", "u.assign"]
    again = next(d for d in observer.decisions if d.decision_id == "t.assign.2")
    assert again.action == "assign" and again.placement[0].node == "n0"
    assert [(a.task_id, a.decision_id) for a in ledger.allocations] == [("t", "t.assign.2")]
