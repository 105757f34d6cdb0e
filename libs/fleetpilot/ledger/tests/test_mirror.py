"""A bucket mirror (the ledger and fleet views every service decides on) keeps following
its bucket past a value it cannot read."""

from __future__ import annotations

import asyncio

import pytest
from fleetpilot.contracts import Allocation, NodeLedger, encode
from fleetpilot.ledger import LedgerStore
from fleetpilot.runtime import InMemoryBus
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually


@pytest.fixture(params=["memory", "nats"])
async def bus(request):
    if request.param == "memory":
        bus = InMemoryBus()
    else:
        bus = await NatsBus.connect(request.getfixturevalue("nats_server").url, "test")
    await bus.ensure_topology()
    yield bus
    await bus.drain()


def ledger(node: str, task: str) -> NodeLedger:
    return NodeLedger(node=node, allocations=[Allocation(task_id=task, decision_id=f"{task}.assign", gpu=0,
                                                         milli=500, memory_mb=8_000, state="confirmed")])


async def test_an_unreadable_value_neither_stops_the_view_nor_erases_what_it_read(bus):
    kv = await bus.kv("ledger")
    await kv.put("node-a", encode(ledger("node-a", "t1")))
    view = await LedgerStore.open(bus)
    follow = asyncio.create_task(view.follow())
    try:
        await kv.put("node-a", b"{not a ledger")  # a hand edit gone wrong
        await kv.put("node-b", encode(ledger("node-b", "t2")))
        await eventually(lambda: "node-b" in view.nodes, timeout_s=5, what="node-b after node-a's bad value")
        assert [a.task_id for a in view.nodes["node-a"].allocations] == ["t1"]  # the last readable one
        assert not follow.done()
    finally:
        follow.cancel()
