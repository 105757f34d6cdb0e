"""An assign the executor could not carry out for a passing reason (the backend did not
answer) is placed again under the task's next assign id; so is a refused one (a business
rule, a GPU reserved since the decision), twice, and not a third time: then the submitter gets
``task.rejected``. Over a real nats-server, the executor played by the test."""

from __future__ import annotations

import asyncio

from fleetpilot.contracts import ActionFailed, NodeLedger, PolicyRef, encode, now
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


def failure(decision_id: str, retryable: bool) -> ActionFailed:
    task_id = decision_id.split(".")[0]
    return ActionFailed(action_id=f"act-{decision_id}", decision_id=decision_id, task_id=task_id,
                        action="assign", backend="sim", error="simulated fleet did not answer" if retryable
                        else "business rule: n0/0: reserved", retryable=retryable,
                        policy=PolicyRef(name="bestfit"), failed_at=now())


async def fail(observer, decision_id: str, retryable: bool) -> None:
    """The executor fails ``decision_id``: it releases the hold, then reports it."""
    await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[
        a for a in (await observer.ledgers())["n0"].allocations if a.decision_id != decision_id])))
    await observer.js.publish("action.failed", encode(failure(decision_id, retryable)))


async def test_a_failed_assign_is_placed_again_and_a_refused_one_twice(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0")])
    rejected = await observer.follow_rejections()
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        for task_id in ("t", "u"):
            await observer.admit(admitted(task_id, gpu_milli=500))
        await wait_for(lambda: len(observer.decisions) == 2, what="first placements")

        async def placed(*ids: str) -> None:
            await wait_for(lambda: set(ids) <= {d.decision_id for d in observer.decisions}, what=f"{ids}")

        # t fails for a passing reason; u is refused by a business rule, again and again.
        await fail(observer, "t.assign", retryable=True)
        await fail(observer, "u.assign", retryable=False)
        await placed("t.assign.2", "u.assign.2")
        await fail(observer, "u.assign.2", retryable=False)
        await placed("u.assign.3")
        await fail(observer, "u.assign.3", retryable=False)
        await wait_for(lambda: rejected, what="u given up")
        await asyncio.sleep(0.6)  # retry rounds: nothing else comes
        ledger = (await observer.ledgers())["n0"]
    finally:
        await policy.stop()
    ids = [d.decision_id for d in observer.decisions]
    assert sorted(ids) == ["t.assign", "t.assign.2", "u.assign", "u.assign.2", "u.assign.3"]
    again = next(d for d in observer.decisions if d.decision_id == "t.assign.2")
    assert again.action == "assign" and again.placement[0].node == "n0"
    assert [(a.task_id, a.decision_id) for a in ledger.allocations] == [("t", "t.assign.2")]
    # The submitter is told that u will not run, and why.
    assert [(r.task_id, r.code) for r in rejected] == [("u", "infeasible")]
    assert "refused by the executor 3 times" in rejected[0].reason and "reserved" in rejected[0].reason


async def test_an_admission_delivered_again_after_its_assign_failed_reserves_nothing(observer, nats_url, tmp_path):
    """Seen with NATS killed in the middle of a burst: the policy's first handling of an
    admission reserved and published its assign, but its acknowledgement was lost; the
    executor took the assign, failed it and gave the hold back. The admission, delivered
    again, must not reserve under that same id: the stream drops the re-published assign as a
    duplicate, so nobody would carry it out, and the failure, finding the task holding
    capacity, would not place it again. The task was stuck for good."""
    await observer.put_fleet([node("n0")])
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        adm = admitted("t", gpu_milli=500)
        await observer.admit(adm)
        await wait_for(lambda: len(observer.decisions) == 1, what="t placed")
        executions = await observer.js.key_value("executions")
        await executions.put("t.assign", encode(failure("t.assign", retryable=True)))  # the executor's journal
        await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[])))  # its hold back
        await observer.js.publish("task.admitted", encode(adm), headers={"Nats-Msg-Id": "admit:t:again"})
        await asyncio.sleep(0.5)  # the admission handled again, before the failure is heard
        await observer.js.publish("action.failed", encode(failure("t.assign", retryable=True)))
        await wait_for(lambda: "t.assign.2" in {d.decision_id for d in observer.decisions}, what="t placed again")
        await asyncio.sleep(0.5)
        ledger = (await observer.ledgers())["n0"]
    finally:
        await policy.stop()
    assert [a.decision_id for a in ledger.allocations] == ["t.assign.2"]


async def test_only_refusals_count_toward_the_refusal_limit(observer, nats_url, tmp_path):
    """Two passing failures, then refusals: the limit counts the refusals alone. Counted by
    placements, as it was, the first refusal (on placement 3) gave the task up."""
    await observer.put_fleet([node("n0")])
    rejected = await observer.follow_rejections()
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        await observer.admit(admitted("t", gpu_milli=500))

        async def placed(decision_id: str) -> None:
            await wait_for(lambda: decision_id in {d.decision_id for d in observer.decisions}, what=decision_id)

        await placed("t.assign")
        await fail(observer, "t.assign", retryable=True)
        await placed("t.assign.2")
        await fail(observer, "t.assign.2", retryable=True)
        await placed("t.assign.3")
        for refused in ("t.assign.3", "t.assign.4"):
            await fail(observer, refused, retryable=False)
            await placed(f"t.assign.{int(refused[-1]) + 1}")
        # The first refusal delivered again (the executor's publish retried): counted once.
        await observer.js.publish("action.failed", encode(failure("t.assign.3", retryable=False)),
                                  headers={"Nats-Msg-Id": "again:t.assign.3"})
        await asyncio.sleep(0.6)
        assert rejected == []
        await fail(observer, "t.assign.5", retryable=False)
        await wait_for(lambda: rejected, what="t given up")
        await asyncio.sleep(0.6)
    finally:
        await policy.stop()
    assert sorted(d.decision_id for d in observer.decisions) == [f"t.assign{s}" for s in ("", ".2", ".3", ".4", ".5")]
    assert [r.task_id for r in rejected] == ["t"]
    assert "refused by the executor 3 times, last as t.assign.5" in rejected[0].reason
