"""The terms of an accepted counter-offer, over a real nats-server: a contract that names a
site is placed on that site only, and one that starts the task later (``not_before``) is
queued until then."""

from __future__ import annotations

import msgspec
from fleetpilot.contracts import Allocation, Contract, NodeLedger, encode, now
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


def bound(task_id: str, **terms) -> object:
    """A one-GPU task admitted under a contract with ``terms``."""
    return msgspec.structs.replace(admitted(task_id, gpu_milli=1000), contract=Contract(**terms))


async def test_a_contract_that_names_a_site_is_placed_there(observer, nats_url, tmp_path):
    # bestfit prefers the fuller node: a-0 (one of its four GPUs taken) over b-0 (four free).
    await observer.put_fleet([node("a-0", gpus=4, site="site-a"), node("b-0", gpus=4, site="site-b")])
    taken = Allocation(task_id="old", decision_id="old.assign", gpu=0, milli=1000, memory_mb=1000, state="confirmed")
    await observer.kv_put("ledger", "a-0", encode(NodeLedger(node="a-0", allocations=[taken])))
    policy = build(settings(nats_url, tmp_path, profile="bestfit"))
    await policy.start()
    try:
        await observer.admit(bound("free"))  # no site: where bestfit likes it
        await wait_for(lambda: len(observer.decisions) == 1, what="the free task placed")
        await observer.admit(bound("bound", site="site-b"))
        await wait_for(lambda: len(observer.decisions) == 2, what="the bound task placed")
    finally:
        await policy.stop()
    where = {d.task_id: (d.action, d.placement[0].node) for d in observer.decisions}
    assert where == {"free": ("assign", "a-0"), "bound": ("assign", "b-0")}


async def test_a_contract_that_names_a_site_without_room_waits_for_it(observer, nats_url, tmp_path):
    await observer.put_fleet([node("a-0", site="site-a"), node("b-0", gpus=1, site="site-b")])
    taken = Allocation(task_id="old", decision_id="old.assign", gpu=0, milli=1000, memory_mb=1000, state="confirmed")
    await observer.kv_put("ledger", "b-0", encode(NodeLedger(node="b-0", allocations=[taken])))
    policy = build(settings(nats_url, tmp_path, profile="bestfit"))
    await policy.start()
    try:
        await observer.admit(bound("bound", site="site-b"))
        await wait_for(lambda: len(observer.decisions) == 1, what="a decision")
    finally:
        await policy.stop()
    assert [d.action for d in observer.decisions] == ["queue"]  # a-0 is free, but on site-a


async def test_a_contract_that_starts_the_task_later_queues_it_until_then(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0")])
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.1))
    await policy.start()
    start = now() + 1.5
    try:
        await observer.admit(bound("later", not_before=start))
        await observer.admit(bound("now"))
        await wait_for(lambda: sum(d.action == "assign" for d in observer.decisions) == 2, timeout_s=10.0,
                       what="both placed")
    finally:
        await policy.stop()
    first = {task: ds[0] for task, ds in observer.by_task().items()}
    assert first["now"].action == "assign"
    assert first["later"].action == "queue" and "the contract starts it" in first["later"].reason
    placed = next(d for d in observer.decisions if d.task_id == "later" and d.action == "assign")
    assert placed.decided_at >= start
