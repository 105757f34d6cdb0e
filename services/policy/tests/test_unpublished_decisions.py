"""A decision whose holds a periodic round reserved is published even when the bus refuses
it the first time (a NATS restart, a publish that timed out): it goes out on the next round.
Before, the runtime published the round's list and gave up at the first failure: the rest
of the list was lost, their holds reserved for nobody and their ``pending`` entries gone, so
those tasks never ran."""

from __future__ import annotations

import msgspec
from fleetpilot.contracts import DecisionMade
from fleetpilot.policy.preempt import encode_pending
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


async def test_decisions_the_bus_refused_after_a_round_go_out_on_the_next_one(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0", gpus=2)])
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    assert policy.bus is not None
    publish = policy.bus.publish
    refused: list[str] = []

    async def flaky(event, *, headers=None):
        # The first decision of the round goes out; the bus fails on the second, once.
        if isinstance(event, DecisionMade) and event.task_id == "second" and not refused:
            refused.append(event.decision_id)
            raise TimeoutError("nats: timeout")
        await publish(event, headers=headers)

    policy.bus.publish = flaky  # type: ignore[method-assign]
    pending = await observer.js.key_value("pending")
    try:
        # Queued while the fleet was full; both fit now and one round places them, in order.
        for task_id, at in (("first", 1.0), ("second", 2.0)):
            adm = admitted(task_id, gpu_milli=1000)
            await pending.put(task_id, encode_pending(msgspec.structs.replace(adm, admitted_at=adm.admitted_at + at)))
        await wait_for(lambda: {d.task_id for d in observer.decisions} == {"first", "second"},
                       what="both decisions published")
    finally:
        await policy.stop()
    assert refused == ["second.assign"]
    assert sorted(d.decision_id for d in observer.decisions) == ["first.assign", "second.assign"]
    assert await observer.live_keys("pending") == []
