"""A node's ledger value that does not decode (garbled by a hand edit, written by a writer of
another schema) does not wedge the node: the next reservation, confirmation or release takes it
as lost, rebuilds it from what is known (the holds in it that still decode, and the view's last
readable value), says so once in the log with the key and the value, and writes over it with
compare-and-set. Before, every later write to that node raised for ever: its executor's confirms
and releases went to the dead letters and a retry round that chose the node stopped there."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from fleetpilot.contracts import Allocation, NodeLedger, encode
from fleetpilot.ledger import LedgerStore, with_allocations, without_task
from fleetpilot.runtime.testing import eventually


def hold(task: str, gpu: int = 0) -> Allocation:
    return Allocation(task_id=task, decision_id=f"{task}.assign", gpu=gpu, milli=500, memory_mb=8_000,
                      state="confirmed")


def holding(*holds: Allocation) -> NodeLedger:
    return NodeLedger(node="node-a", allocations=list(holds))


def reserve(task: str, gpu: int = 1):
    return lambda cur: with_allocations(cur, "node-a", [hold(task, gpu)])


def tasks(ledger: NodeLedger | None) -> list[str]:
    return sorted(a.task_id for a in ledger.allocations) if ledger else []


async def garbled_after(bus, value: bytes, *before: NodeLedger) -> tuple[LedgerStore, asyncio.Task, int]:
    """A store that followed ``before`` on node-a, then saw ``value`` written over it."""
    kv = await bus.kv("ledger")
    for ledger in before:
        await kv.put("node-a", encode(ledger))
    store = await LedgerStore.open(bus)
    follow = asyncio.create_task(store.follow())
    revision = await kv.put("node-a", value)
    await eventually(lambda: store.revisions.get("node-a") == revision, timeout_s=5, what="the bad value seen")
    return store, follow, revision


async def test_a_garbled_value_is_rebuilt_from_the_last_one_read_and_the_node_takes_writes_again(bus, caplog):
    store, follow, revision = await garbled_after(bus, b'{"node": "node-a", "allocations": [{"task_', holding(hold("t1")))
    try:
        with caplog.at_level(logging.ERROR, logger="fleetpilot.ledger"):
            written = await asyncio.wait_for(store.mutate("node-a", reserve("t2")), timeout=5)
        assert tasks(written) == ["t1", "t2"]
        assert tasks(await store.read("node-a")) == ["t1", "t2"]  # readable again, in the bucket
        rebuilt = [r.getMessage() for r in caplog.records if "rebuilt" in r.getMessage()]
        assert len(rebuilt) == 1 and "node-a" in rebuilt[0] and f"revision {revision}" in rebuilt[0]
        assert '{"task_' in rebuilt[0]  # the value itself, for whoever repairs it by hand
        # A release (the executor's, when t1 ends) goes through like any other write.
        await store.mutate("node-a", lambda cur: without_task(cur, "t1") if cur else None)
        assert tasks(await store.read("node-a")) == ["t2"]
    finally:
        follow.cancel()


async def test_holds_of_another_schema_keep_those_that_decode_and_the_rest_come_from_the_view(bus):
    # A writer of another version stored t3's hold with a GPU it names as a string: t1's hold
    # still decodes as it is now (confirmed), t3's comes from what the view last read.
    value = msgspec.json.encode({"node": "node-a", "allocations": [
        msgspec.to_builtins(msgspec.structs.replace(hold("t1"), state="confirmed")),
        {**msgspec.to_builtins(hold("t3", gpu=1)), "gpu": "one"},
    ]})
    before = holding(msgspec.structs.replace(hold("t1"), state="reserved"), hold("t3", gpu=1))
    store, follow, _ = await garbled_after(bus, value, before)
    try:
        written = await asyncio.wait_for(store.mutate("node-a", reserve("t2", gpu=0)), timeout=5)
        assert tasks(written) == ["t1", "t2", "t3"]
        assert {a.task_id: a.state for a in written.allocations}["t1"] == "confirmed"
        assert tasks(await store.read("node-a")) == ["t1", "t2", "t3"]
    finally:
        follow.cancel()


async def test_a_store_that_never_read_the_node_takes_an_unreadable_value_as_lost(bus):
    kv = await bus.kv("ledger")
    await kv.put("node-a", encode(holding(hold("t1"))))
    await kv.put("node-a", b"\x00not json")
    store = await LedgerStore.open(bus)  # started after the value went bad: nothing to rebuild from
    assert await store.read("node-a") is None
    # A release of what it cannot see changes nothing and fails nothing...
    assert await store.mutate("node-a", lambda cur: without_task(cur, "t1") if cur else None) is None
    # ...and a reservation writes the node's ledger afresh.
    await asyncio.wait_for(store.mutate("node-a", reserve("t2")), timeout=5)
    assert tasks(await store.read("node-a")) == ["t2"]
