"""One node's ledger value that does not decode stops nothing in the policy: a task the executor
evicted, or whose assign failed, elsewhere is still queued again (its re-queue reads every
node's ledger, fresh, to see whether the task holds capacity somewhere). Before, the value
raised in that read: every eviction and failed assign in the fleet failed its handler, was
retried and dead-lettered, and the task never ran again."""

from __future__ import annotations

import msgspec
from fleetpilot.contracts import ActionFailed, Allocation, NodeLedger, Placement, PolicyRef, encode, now
from fleetpilot.ledger import FleetView, LedgerStore
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import InMemoryBus
from fleetpilot_services.policy.admissions import Admissions
from fleetpilot_services.policy.metrics import PolicyMetrics
from fleetpilot_services.policy.policy_set import ActivePolicies, PolicyConfig
from fleetpilot_services.policy.service import PolicyState
from prometheus_client import CollectorRegistry

from .conftest import admitted, node, settings


async def test_a_failed_assign_is_queued_again_though_another_nodes_ledger_is_unreadable(tmp_path):
    bus = InMemoryBus()
    ledger_kv, pending = await bus.kv("ledger"), await bus.kv("pending")
    busy = Allocation(task_id="t2", decision_id="t2.assign", gpu=0, milli=500, state="confirmed")
    await ledger_kv.put("n1", encode(NodeLedger(node="n1", allocations=[busy])))
    fleet = FleetView(None)  # type: ignore[arg-type]
    for n in ("n0", "n1"):
        fleet._apply(node_key(n), encode(node(n)), 1)
    state = PolicyState(fleet, await LedgerStore.open(bus), settings("nats://unused", tmp_path),
                        ActivePolicies(PolicyConfig(profile="bestfit")), PolicyMetrics(CollectorRegistry()))
    state.admissions = Admissions(await bus.kv("contracts"))
    state.admissions.placed(admitted("t1", gpu_milli=500))
    await ledger_kv.put("n1", b'{"node": "n1", "allocations": [{"task_id": "t2", "gpu": ')  # a hand edit cut short

    failed = ActionFailed(action_id="t1.assign.exec", decision_id="t1.assign", task_id="t1", action="assign",
                          placement=[Placement(node="n0", gpu=0, milli=500)], backend="sim",
                          error="backend timeout", retryable=True, policy=PolicyRef(name="bestfit"),
                          confidence=0.9, failed_at=now())
    note = await state.requeue_failed(failed, pending, ledger_kv)
    assert note is not None and note.decision_id == "t1.assign.2"
    assert (await pending.get(node_key("t1"))) is not None

    # A task the unreadable node still holds, as this replica last read it, is not queued.
    state.admissions.placed(admitted("t2", gpu_milli=500))
    failed_t2 = msgspec.structs.replace(failed, action_id="t2.x", decision_id="t2.assign.2", task_id="t2")
    assert await state.requeue_failed(failed_t2, pending, ledger_kv) is None
    assert (await pending.get(node_key("t2"))) is None
