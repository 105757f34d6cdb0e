"""A bucket mirror (the ledger and fleet views every service decides on) keeps following
its bucket past a value it cannot read, and is never left behind it by its own writes."""

from __future__ import annotations

import asyncio

import pytest
from fleetpilot.contracts import Allocation, NodeLedger, encode
from fleetpilot.ledger import LedgerStore, with_allocations
from fleetpilot.runtime import InMemoryBus, KeyValue
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


class ReplyAfterTheNextWrite(KeyValue):
    """The ledger bucket as one replica sees it when the reply to its compare-and-set comes
    after the watch has already brought another replica's next write (the server sends the
    two on separate subscriptions, in no set order)."""

    def __init__(self, kv: KeyValue, next_write) -> None:
        self._kv, self._next_write = kv, next_write

    async def get(self, key):
        return await self._kv.get(key)

    async def put(self, key, value):
        return await self._kv.put(key, value)

    async def create(self, key, value):
        return await self._kv.create(key, value)

    async def update(self, key, value, revision):
        written = await self._kv.update(key, value, revision)
        await self._next_write()
        return written

    async def delete(self, key, revision=None):
        await self._kv.delete(key, revision)

    async def keys(self):
        return await self._kv.keys()

    def watch(self, pattern=">"):
        return self._kv.watch(pattern)


async def test_a_late_reply_to_a_write_does_not_put_the_view_behind_the_bucket():
    bus = InMemoryBus()
    kv = await bus.kv("ledger")
    await kv.put("node-a", encode(ledger("node-a", "t1")))

    def tasks(held: NodeLedger | None) -> list[str]:
        return sorted(a.task_id for a in held.allocations) if held else []

    async def another_replica_reserves_t3() -> None:
        # Its write comes right after ours, and the watch brings it before our reply.
        entry = await kv.get("node-a")
        current = LedgerStore.decoder.decode(entry.value)
        await kv.update("node-a", encode(with_allocations(current, "node-a", ledger("node-a", "t3").allocations)),
                        entry.revision)
        await eventually(lambda: tasks(view.nodes.get("node-a")) == ["t1", "t2", "t3"],
                         timeout_s=5, what="the watch bringing t3")

    view = LedgerStore(ReplyAfterTheNextWrite(kv, another_replica_reserves_t3))
    follow = asyncio.create_task(view.follow())
    try:
        await eventually(lambda: "node-a" in view.nodes, timeout_s=5, what="node-a")
        await view.mutate("node-a", lambda cur: with_allocations(cur, "node-a", ledger("node-a", "t2").allocations))
        await asyncio.sleep(0.1)  # whatever the watch still has to bring
        assert tasks(await view.read("node-a")) == ["t1", "t2", "t3"]
        # The view holds what the bucket holds, not the older ledger our write made.
        assert tasks(view.nodes["node-a"]) == ["t1", "t2", "t3"]
    finally:
        follow.cancel()
