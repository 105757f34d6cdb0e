"""A decision no executor takes (its node reports, its executor is down) expires: failed in
the executor's journal, its hold given back, its task placed again elsewhere if it can be; an
executor that comes back then carries nothing out. Over a real nats-server, with no executor
running (the test plays it where one is needed)."""

from __future__ import annotations

import asyncio

import msgspec
from fleetpilot.contracts import ActionFailed, DecisionMade, NodeLedger, decode, now
from fleetpilot.executor import execute_decision
from fleetpilot.executor.backend import TaskHandle
from fleetpilot.ledger.store import node_key
from fleetpilot_services.executor.backends import KvExecutionJournal
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


class StartsNothing:
    """An executor backend that counts what it is asked to start (nothing, it must be)."""

    name = "test"

    def __init__(self) -> None:
        self.started: list[str] = []

    async def start(self, task_id, placement, command, env) -> TaskHandle:
        self.started.append(task_id)
        return TaskHandle(task_id=task_id, backend=self.name, node="", gpus=[], started_at=now(), latency_ms=1.0)


async def journal_entry(observer, decision_id: str) -> bytes | None:
    kv = await observer.js.key_value("executions")
    try:
        return (await kv.get(node_key(decision_id))).value
    except Exception:  # noqa: BLE001 - not there
        return None


async def failures(observer) -> list[ActionFailed]:
    """What the ACTIONS stream keeps on ``action.failed``."""
    sub = await observer.js.subscribe("action.failed", ordered_consumer=True)
    out = []
    try:
        while True:
            try:
                out.append(decode((await sub.next_msg(timeout=0.5)).data, ActionFailed))
            except TimeoutError:
                return out
    finally:
        await sub.unsubscribe()


def holds(ledgers: dict[str, NodeLedger]) -> list[tuple[str, str, str]]:
    return sorted((key, a.decision_id, a.state) for key, ledger in ledgers.items() for a in ledger.allocations)


async def a_replica_expiring_after_1_s(nats_url, tmp_path):
    """A started policy replica whose rounds run every 0.2 s and expire untaken
    reservations after 1 s."""
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2, rebalance_s=0.2,
                            untaken_expiry_s=1.0))
    await policy.start()
    return policy

async def test_a_decision_no_executor_takes_expires_and_its_task_goes_elsewhere(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0"), node("n1")])
    policy = await a_replica_expiring_after_1_s(nats_url, tmp_path)
    try:
        await observer.admit(admitted("t", gpu_milli=500))
        await wait_for(lambda: len(observer.decisions) == 1, what="the first placement")
        first = observer.decisions[0]
        await wait_for(lambda: "t.assign.2" in {d.decision_id for d in observer.decisions}, timeout_s=15,
                       what="the task placed again once its reservation expired")
        again = next(d for d in observer.decisions if d.decision_id == "t.assign.2")
        ledgers = await observer.ledgers()
        recorded = await journal_entry(observer, "t.assign")
        told = [f for f in await failures(observer) if f.decision_id == "t.assign"]
    finally:
        await policy.stop()
    gone, other = first.placement[0].node, again.placement[0].node
    assert other != gone  # another node could take it: not back to the silent executor
    assert not any(d == "t.assign" for _, d, _ in holds(ledgers))
    assert (node_key(other), "t.assign.2", "reserved") in holds(ledgers)
    expired = decode(recorded, ActionFailed)
    assert expired.retryable and expired.error.startswith(f"expired: not taken by the executor of {gone}")
    assert expired.latency_ms >= 1000.0  # it took the expiry to fail, not 0 ms
    assert [p.node for p in expired.placement] == [gone] and expired.policy == first.policy
    assert told == [expired]  # published once (the stream keeps one copy)

    # The node's executor comes back and reads the decision from its consumer: it finds the
    # failure in its journal, starts nothing and gives the recorded answer.
    kv = await observer.js.key_value("executions")
    backend = StartsNothing()

    async def still_reserved(decision: DecisionMade) -> bool:
        return True  # as it read the ledger a moment before the policy expired it

    result = await execute_decision(first, backend, KvExecutionJournal(kv), owner=gone, still_reserved=still_reserved)
    assert result == expired and backend.started == []


async def test_a_task_that_only_one_node_holds_goes_back_there(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0"), node("small", model="T4", memory_mb=16_384)])
    policy = await a_replica_expiring_after_1_s(nats_url, tmp_path)
    try:
        await observer.admit(admitted("big", gpu_milli=500, gpu_memory_mb=40_000))
        await wait_for(lambda: "big.assign.2" in {d.decision_id for d in observer.decisions}, timeout_s=15,
                       what="the task placed again")
    finally:
        await policy.stop()
    placed = {d.decision_id: d.placement[0].node for d in observer.decisions}
    assert placed["big.assign"] == placed["big.assign.2"] == "n0"


async def test_a_decision_an_executor_has_claimed_is_left_to_it(observer, nats_url, tmp_path):
    # Taken, and being carried out (a long start, a checkpoint): the claim is the executor's.
    await observer.put_fleet([node("n0")])
    policy = await a_replica_expiring_after_1_s(nats_url, tmp_path)
    try:
        await observer.admit(admitted("slow", gpu_milli=500))
        await wait_for(lambda: len(observer.decisions) == 1, what="the placement")
        await observer.kv_put("executions", node_key("slow.assign"),
                              msgspec.json.encode({"claim": "n0", "at": now()}))
        await asyncio.sleep(2.5)  # past the expiry, rounds every 0.2 s
        ledgers = await observer.ledgers()
        told = await failures(observer)
    finally:
        await policy.stop()
    assert [d.decision_id for d in observer.decisions] == ["slow.assign"]
    assert holds(ledgers) == [("n0", "slow.assign", "reserved")]
    assert told == []
