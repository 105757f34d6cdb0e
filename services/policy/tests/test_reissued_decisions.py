"""A decision reserved by a replica that died before publishing it goes out again as it was
decided: the hold records who decided (policy and version, shard, fallback), how sure it was
and why, and the replica that finds the hold publishes that. Before, it published the default
policy's name with no version, shard ``primary``, no fallback and a confidence of 0.9: the
feedback credited the wrong policy and shard, and the calibration learnt from a number no
policy said. A hold written before these were recorded is still read, and re-issued as before."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from fleetpilot.contracts import Allocation, DecidedBy, NodeLedger, PolicyRef, encode
from fleetpilot.ledger import FleetView, LedgerStore
from fleetpilot.ledger.store import node_key
from fleetpilot.policy.shaping import RouteRule
from fleetpilot.runtime import InMemoryBus
from fleetpilot_services.policy.metrics import PolicyMetrics
from fleetpilot_services.policy.policy_set import ActivePolicies, PolicyConfig
from fleetpilot_services.policy.replica import calibration_key
from fleetpilot_services.policy.service import PolicyState, build
from prometheus_client import CollectorRegistry

from .conftest import admitted, node, settings, wait_for

CANARY = PolicyConfig(profile="bestfit", shaping=[RouteRule(policy="packing", shard="canary")])


async def replica(bus: InMemoryBus, tmp_path, name: str) -> PolicyState:
    """A replica over the shared ``ledger`` bucket, with the fleet of one node in its view."""
    fleet = FleetView(None)  # type: ignore[arg-type]
    fleet._apply(node_key("n0"), encode(node("n0")), 1)
    ledger = await LedgerStore.open(bus)
    return PolicyState(fleet, ledger, settings("nats://unused", tmp_path, replica=name), ActivePolicies(CANARY),
                       PolicyMetrics(CollectorRegistry()))


async def test_a_decision_reserved_by_a_replica_that_died_goes_out_again_as_it_was_decided(tmp_path):
    bus = InMemoryBus()
    dead = await replica(bus, tmp_path, "dead")
    # Its record corrects the canary's assigns down: the confidence it decided with is its own.
    dead.calibration.update(calibration_key("packing", "assign"), 90.0, 50.0, 100.0)
    adm = admitted("t1", gpu_milli=500)
    decided, name, shard = await dead.place(adm)
    assert decided is not None and (name, shard) == ("packing", "canary")
    assert decided.confidence < 0.85  # not what the re-issue used to say

    # It died before publishing. Another replica, with a view read since, finds the hold.
    taker = await replica(bus, tmp_path, "taker")
    again, _, _ = await taker.place(adm)
    assert again is not None
    published = lambda d: msgspec.structs.replace(d, decided_at=0.0)  # noqa: E731
    assert published(again) == published(decided)
    assert (again.policy, again.shard_id, again.fallback) == (PolicyRef(name="packing", version="1"), "canary", False)
    # The hold records it once (the first hold of the placement).
    held = taker.ledger.nodes["n0"].allocations
    assert [a.decided is not None for a in held] == [True]


async def test_a_hold_written_before_the_decision_was_recorded_is_read_and_re_issued_as_before(tmp_path):
    bus = InMemoryBus()
    kv = await bus.kv("ledger")
    old = {"node": "n0", "allocations": [{"task_id": "t1", "decision_id": "t1.assign", "gpu": 0, "milli": 500,
                                          "memory_mb": 0, "state": "reserved", "at": 1.0}]}
    await kv.put("n0", msgspec.json.encode(old))
    taker = await replica(bus, tmp_path, "taker")
    again, _, _ = await taker.place(admitted("t1", gpu_milli=500))
    assert again is not None and again.decision_id == "t1.assign"
    assert (again.policy, again.shard_id, again.fallback, again.confidence) == (
        PolicyRef(name="bestfit"), "primary", False, pytest.approx(0.9))
    assert again.reason == "re-issued: capacity already reserved"


async def test_an_admission_delivered_again_publishes_the_recorded_decision_and_counts_it(
        observer, nats_url, tmp_path):
    """The admission handler re-issues a held decision itself (``existing``): it goes out as
    recorded, and like every decision through ``outgoing`` (counted under its policy and shard,
    a learned model's confidence applied). Before, it skipped both."""
    await observer.put_fleet([node("n0")])
    decided = DecidedBy(policy=PolicyRef(name="packing", version="7"), shard_id="canary", confidence=0.61,
                        reason="packed onto the fullest GPU")
    hold = Allocation(task_id="t1", decision_id="t1.assign", gpu=0, milli=500, decided=decided)
    await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[hold])))
    policy = build(settings(nats_url, tmp_path, profile="bestfit"))
    await policy.start()
    try:
        await observer.admit(admitted("t1", gpu_milli=500))
        await wait_for(lambda: len(observer.decisions) == 1, what="the re-issued decision")
        await asyncio.sleep(0.2)
        counted = policy.metrics.registry.get_sample_value(
            "fleetpilot_policy_decisions_total",
            {"action": "assign", "policy": "packing", "shard": "canary", "fallback": "false"})
    finally:
        await policy.stop()
    [d] = observer.decisions
    assert (d.decision_id, d.policy, d.shard_id, d.fallback, d.confidence, d.reason) == (
        "t1.assign", PolicyRef(name="packing", version="7"), "canary", False, pytest.approx(0.61),
        "packed onto the fullest GPU")
    assert counted == 1
