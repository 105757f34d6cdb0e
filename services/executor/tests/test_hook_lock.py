"""``KvHookLock`` over a real nats-server: one winner, owner-only release, expiry takeover."""

from __future__ import annotations

import asyncio

import nats
import pytest
from fleetpilot.executor import HookLock
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot_services.executor.hook_lock import KvHookLock


class FakeClock:
    """Wall-clock stand-in the test moves forward."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def bus(nats_url):
    bus = await NatsBus.connect(nats_url, "lock-test")
    await bus.ensure_topology()
    yield bus
    await bus.drain()


async def test_is_a_hook_lock_and_the_bucket_expires_locks_after_35_minutes(bus, nats_url):
    assert isinstance(KvHookLock(await bus.kv("hook_locks")), HookLock)
    nc = await nats.connect(nats_url)
    status = await (await nc.jetstream().key_value("hook_locks")).status()
    await nc.close()
    assert status.ttl == 35 * 60


async def test_of_many_racing_replicas_exactly_one_takes_the_lock(bus):
    kv = await bus.kv("hook_locks")
    locks = [KvHookLock(kv) for _ in range(8)]
    won = await asyncio.gather(
        *(lock.acquire("decommission.n1.0", f"r{i}", 60) for i, lock in enumerate(locks))
    )
    assert sum(won) == 1
    winner = f"r{won.index(True)}"
    assert await locks[0].holder("decommission.n1.0") == winner
    assert await locks[3].acquire("decommission.n1.0", winner, 60) is True  # re-entrant for its owner


async def test_only_the_owner_releases_and_then_another_can_take_it(bus):
    kv = await bus.kv("hook_locks")
    a, b = KvHookLock(kv), KvHookLock(kv)
    assert await a.acquire("k", "a", 60)
    assert await b.release("k", "b") is False
    assert await b.holder("k") == "a"
    assert await a.release("k", "a") is True
    assert await a.holder("k") is None
    assert await b.acquire("k", "b", 60)  # create over a deleted key
    assert await a.holder("k") == "b"


async def test_an_expired_lock_is_taken_over_by_exactly_one_replica(bus):
    kv = await bus.kv("hook_locks")
    clock = FakeClock()
    dead = KvHookLock(kv, clock)
    assert await dead.acquire("k", "dead", 30)
    others = [KvHookLock(kv, clock) for _ in range(5)]
    assert not any(await asyncio.gather(*(o.acquire("k", f"o{i}", 30) for i, o in enumerate(others))))
    clock.t += 31
    assert await dead.holder("k") is None
    won = await asyncio.gather(*(o.acquire("k", f"o{i}", 30) for i, o in enumerate(others)))
    assert sum(won) == 1
    assert await dead.release("k", "dead") is False  # the late owner cannot free the new holder's lock
    assert await dead.holder("k") == f"o{won.index(True)}"


async def test_a_release_leaves_a_lock_taken_over_between_its_read_and_its_delete(bus):
    kv = await bus.kv("hook_locks")
    clock = FakeClock()
    assert await KvHookLock(kv, clock).acquire("k", "late", 30)
    taker = KvHookLock(kv, FakeClock(clock.t + 31))  # by its clock the lock has run out

    class TakenOverAfterTheRead:
        """The bucket, where another replica takes the lock over right after the owner read it."""

        def __getattr__(self, name):
            return getattr(kv, name)

        async def get(self, key):
            entry = await kv.get(key)
            assert await taker.acquire(key, "taker", 30)
            return entry

    assert await KvHookLock(TakenOverAfterTheRead(), clock).release("k", "late") is False
    assert await taker.holder("k") == "taker"


async def test_an_unreadable_value_does_not_wedge_the_lock(bus):
    kv = await bus.kv("hook_locks")
    await kv.put("k", b"not a lock")
    lock = KvHookLock(kv)
    assert await lock.holder("k") is None
    assert await lock.acquire("k", "a", 60)
    assert await lock.holder("k") == "a"
