"""The restart limits' counter (``Evictions.count_failure`` over the ``placement_failures``
bucket): each failure once however often it is told, none lost when replicas count at once,
and an unreadable value counted again rather than failing every kill of the task."""

from __future__ import annotations

import asyncio

from fleetpilot.ledger import FleetView, LedgerStore
from fleetpilot.ledger.store import node_key
from fleetpilot.policy.restart_limits import decode_failures
from fleetpilot.runtime import InMemoryBus
from fleetpilot_services.policy.metrics import PolicyMetrics
from fleetpilot_services.policy.policy_set import ActivePolicies, PolicyConfig
from fleetpilot_services.policy.service import PolicyState
from prometheus_client import CollectorRegistry

from .conftest import settings


class Interleaving:
    """A bucket whose every read lets the other handlers run before it returns, as a round
    trip to the server does: two counts read the same value and race to write it."""

    def __init__(self, kv) -> None:
        self.kv = kv

    async def get(self, key: str):
        entry = await self.kv.get(key)
        await asyncio.sleep(0)
        return entry

    def __getattr__(self, name: str):
        return getattr(self.kv, name)


async def state_and_bucket(tmp_path):
    bus = InMemoryBus()
    state = PolicyState(FleetView(None), await LedgerStore.open(bus), settings("nats://unused", tmp_path),  # type: ignore[arg-type]
                        ActivePolicies(PolicyConfig(profile="bestfit")), PolicyMetrics(CollectorRegistry()))
    return state, Interleaving(await bus.kv("placement_failures"))


async def test_kills_told_at_once_and_again_are_each_counted_once(tmp_path):
    state, failures = await state_and_bucket(tmp_path)
    kills = [f"t.assign.{g}" for g in range(2, 10)]
    # Two replicas' handlers, every kill told twice, all at once.
    counts = await asyncio.gather(*(state.count_failure(failures, "t", "oom_killed", k) for k in kills + kills))
    assert max(counts) == len(kills)
    stored = decode_failures((await failures.get(node_key("t"))).value)
    assert sorted(stored.oom_killed) == sorted(kills) and stored.refused == ()
    # Refusals are their own count.
    assert await state.count_failure(failures, "t", "refused", "t.assign.10") == 1
    assert await state.count_failure(failures, "t", "oom_killed", "t.assign.2") == len(kills)


async def test_an_unreadable_value_is_counted_again_from_the_failure_at_hand(tmp_path, caplog):
    state, failures = await state_and_bucket(tmp_path)
    await failures.put(node_key("t"), b'{"oom_killed": ["t.assign", ')  # a hand edit cut short
    assert await state.count_failure(failures, "t", "oom_killed", "t.assign.2") == 1
    assert decode_failures((await failures.get(node_key("t"))).value).oom_killed == ("t.assign.2",)
    assert "unreadable" in caplog.text
