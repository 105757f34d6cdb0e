"""A bucket mirror (the ledger and fleet views every service decides on) keeps following
its bucket past a value it cannot read, is never left behind it by its own writes, neither
by a late reply nor by a watch catching up, and counts those writes as changes; every name
(node, task or decision id) maps onto a key the server takes."""

from __future__ import annotations

import asyncio
import random
import re

import pytest
from fleetpilot.contracts import Allocation, NodeLedger, encode
from fleetpilot.ledger import LedgerStore, with_allocations
from fleetpilot.ledger.store import KEY_LIMIT, node_key
from fleetpilot.runtime import InMemoryBus, KeyValue
from fleetpilot.runtime.bus import KvEntry
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually


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


async def test_a_write_of_our_own_is_a_change_to_the_views_built_on_the_mirror(bus):
    # The policy keeps a snapshot built on the ledger view and redoes only the keys changed
    # (``changed_at``) since the ``version`` it last looked at; a reservation of our own that
    # is not counted stays out of it until the watch brings it back, and the next decision
    # chooses the space it has just taken.
    kv = await bus.kv("ledger")
    await kv.put("node-a", encode(ledger("node-a", "t1")))
    view = await LedgerStore.open(bus)
    looked_at = view.version
    await view.mutate("node-a", lambda cur: with_allocations(cur, "node-a", ledger("node-a", "t2").allocations))
    assert [key for key, at in view.changed_at.items() if at > looked_at] == ["node-a"]
    assert sorted(a.task_id for a in view.nodes["node-a"].allocations) == ["t1", "t2"]
    assert view.changed.is_set()


class WatchBroughtByHand(KeyValue):
    """The ledger bucket with a watch that brings only what the test hands it, when it does:
    the watch of a replica running behind the bucket."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self._entries: asyncio.Queue = asyncio.Queue()

    async def bring(self, entry: KvEntry) -> None:
        """Hand the watch one entry and wait until the view has taken it in."""
        self._entries.put_nowait(entry)
        await asyncio.wait_for(self._entries.join(), timeout=5)

    async def get(self, key):
        return await self._kv.get(key)

    async def put(self, key, value):
        return await self._kv.put(key, value)

    async def create(self, key, value):
        return await self._kv.create(key, value)

    async def update(self, key, value, revision):
        return await self._kv.update(key, value, revision)

    async def delete(self, key, revision=None):
        await self._kv.delete(key, revision)

    async def keys(self):
        return await self._kv.keys()

    async def watch(self, pattern=">"):
        while True:
            entry = await self._entries.get()
            yield entry
            self._entries.task_done()  # the view asks for the next one: it has applied this one


async def test_the_watch_catching_up_does_not_take_our_own_write_out_of_the_view():
    kv = await InMemoryBus().kv("ledger")

    def tasks(view: LedgerStore) -> list[str]:
        return sorted(a.task_id for a in view.nodes["node-a"].allocations)

    def holding(*names: str) -> NodeLedger:
        return NodeLedger(node="node-a", allocations=[a for n in names for a in ledger("node-a", n).allocations])

    first = await kv.put("node-a", encode(holding("t1")))
    watch = WatchBroughtByHand(kv)
    view = LedgerStore(watch)
    follow = asyncio.create_task(view.follow())
    try:
        await watch.bring(KvEntry("node-a", encode(holding("t1")), first))
        # Another replica reserves t3; our watch has not brought that yet when we reserve t2
        # on top of it, and the reply to our write comes first.
        theirs = await kv.update("node-a", encode(holding("t1", "t3")), first)
        await view.mutate("node-a", lambda cur: with_allocations(cur, "node-a", ledger("node-a", "t2").allocations))
        ours = (await kv.get("node-a")).revision
        assert tasks(view) == ["t1", "t2", "t3"]
        await watch.bring(KvEntry("node-a", encode(holding("t1", "t3")), theirs))
        assert tasks(view) == ["t1", "t2", "t3"]  # not the ledger before our t2
        await watch.bring(KvEntry("node-a", encode(holding("t1", "t3", "t2")), ours))
        assert tasks(view) == ["t1", "t2", "t3"]
        # A server that lost its store numbers its writes from 1 again: that is taken.
        await watch.bring(KvEntry("node-a", encode(holding("t9")), 1))
        assert tasks(view) == ["t9"]
    finally:
        follow.cancel()


@pytest.mark.parametrize(("name", "key"), [
    ("ip-10-0-3-7.ec2.internal", "ip-10-0-3-7.ec2.internal"),  # a valid key is its own
    ("a100-03", "a100-03"),
    ("job/7_y", "job/7_y"),
    ("job/7=x_y", "job/7=3Dx_y"),  # ``=`` is the escape: a name's own is escaped
    ("évaluation-1", "=C3=A9valuation-1"),  # a client's task id: a letter, but not one a key allows
    ("gpu²", "gpu=C2=B2"),
    ("job..2", "job=2E.2"),  # no empty token between dots
    (".hidden", "=2Ehidden"),
    ("trailing.", "trailing=2E"),
    ("a b*c>d", "a=20b=2Ac=3Ed"),
    ("", "="),
])
def test_every_name_maps_onto_a_valid_kv_key(name, key):
    assert node_key(name) == key
    assert re.fullmatch(r"[-/_=.a-zA-Z0-9]+", key) and "" not in key.split(".")


def test_no_two_names_share_a_key():
    # Each character no key allows became ``_``: ``job:1`` and ``job_1`` shared a key, so the
    # second task's pending entry and contract were taken for the first's, and two such nodes
    # shared one ledger.
    assert node_key("job:1") != node_key("job_1")
    assert node_key("évaluation") != node_key("_valuation")
    assert node_key("a..b") != node_key("a._.b")
    rng = random.Random(7)
    alphabet = "ab_.=-/é:²* "
    names = {"".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 7))) for _ in range(20_000)}
    keys = {node_key(name): name for name in names}
    assert len(keys) == len(names)
    for key in keys:
        assert re.fullmatch(r"[-/_=.a-zA-Z0-9]+", key) and "" not in key.split("."), key
        assert node_key(key) == key or "=" in key  # a valid key without ``=`` is its own


def test_the_short_way_for_a_name_that_is_its_own_key_gives_the_escaping_s_key():
    # A valid key without ``=`` is returned as it is, without walking its characters: the
    # same key as the escaping gives, for every name (valid or not) of these characters.
    from fleetpilot.ledger.store import _escaped_key

    rng = random.Random(11)
    alphabet = "aZ09_-/.=é "
    for _ in range(20_000):
        name = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 9)))
        assert node_key(name) == _escaped_key(name), name
    long_name = "n" * (KEY_LIMIT + 1)  # its own key but too long: bounded as before
    assert node_key(long_name) == _escaped_key(long_name) != long_name


async def test_a_ledger_keyed_by_a_name_with_a_letter_no_key_allows_is_written_and_read(nats_server):
    bus = await NatsBus.connect(nats_server.url, "test")
    await bus.ensure_topology()
    try:
        store = await LedgerStore.open(bus)
        for name in ("évaluation-1", "job..2"):
            await store.mutate(node_key(name), lambda cur, name=name: with_allocations(
                cur, name, ledger(name, "t1").allocations))
            held = await store.read(name)
            assert held is not None and [a.task_id for a in held.allocations] == ["t1"]
    finally:
        await bus.drain()


def test_a_name_too_long_for_one_protocol_line_maps_onto_a_bounded_key():
    # A key goes into the subject of every KV operation, and a NATS control line holds 4 KiB:
    # each character a key does not allow took three, so a client's task id of some 1400
    # such characters made a key the server answered by closing the connection.
    long_names = ["é" * 1400, "é" * 1400 + "x", "a" * 5000, "a" * 4999 + "b", "a." * 3000]
    keys = [node_key(name) for name in long_names]
    assert len(set(keys)) == len(long_names)
    for key in keys:
        assert len(key) <= KEY_LIMIT
        assert re.fullmatch(r"[-/_=.a-zA-Z0-9]+", key) and "" not in key.split("."), key
    # No short name shares a key with a long one, and a short one is mapped as before.
    assert node_key("a" * KEY_LIMIT) == "a" * KEY_LIMIT
    assert node_key("a" * KEY_LIMIT) != node_key("a" * (KEY_LIMIT + 1))


async def test_a_ledger_keyed_by_a_very_long_name_is_written_and_read_on_a_live_connection(nats_server):
    bus = await NatsBus.connect(nats_server.url, "test")
    await bus.ensure_topology()
    try:
        store = await LedgerStore.open(bus)
        name = "é" * 1400
        await asyncio.wait_for(store.mutate(node_key(name), lambda cur: with_allocations(
            cur, name, ledger(name, "t1").allocations)), timeout=10)
        held = await asyncio.wait_for(store.read(name), timeout=10)
        assert held is not None and [a.task_id for a in held.allocations] == ["t1"]
        # The connection is still there for every other key.
        await asyncio.wait_for(store.mutate("node-a", lambda cur: with_allocations(
            cur, "node-a", ledger("node-a", "t2").allocations)), timeout=10)
        assert (await store.read("node-a")) is not None
    finally:
        await bus.drain()
