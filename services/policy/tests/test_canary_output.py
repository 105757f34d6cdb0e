"""A canary whose output does not hold what the task asked is a failing policy: the breaker
hears of it and the fallback places the task, instead of the ledger holding less than the
task will use."""

from __future__ import annotations

from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for, write_module

# An operator's device picker that forgets the GPUs: the task is given its node, no GPU.
NO_GPUS = """
from fleetpilot.policy import register
from fleetpilot.policy.framework import DevicePlugin

@register
class NoGpus(DevicePlugin):
    name = "forgets-the-gpus"

    def devices(self, cycle, pos):
        return [], 0

PROFILES = {"forgetful": {"filters": [{"name": "node-resources"}], "devices": {"name": "forgets-the-gpus"}}}
"""


async def test_a_canary_placement_without_the_asked_gpus_goes_to_the_fallback(observer, nats_url, tmp_path):
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    write_module(plugin_dir, "forgetful.py", NO_GPUS)
    await observer.put_fleet([node("n0", gpus=2)])
    shaping = [{"condition": "task.size_gb > 5", "weight": 1.0, "policy": "forgetful", "shard": "c"}]
    host = build(settings(nats_url, tmp_path, profile="bestfit", shaping_rules=shaping,
                          plugin_dir=str(plugin_dir), breaker={"time_budget_s": 2.0, "failure_threshold": 1}))
    await host.start()
    try:
        await observer.admit(admitted("c1", size_gb=10.0, gpu_milli=500))
        await observer.admit(admitted("p1", kind="train", gpu_milli=300))
        await wait_for(lambda: len(observer.decisions) >= 2, what="two decisions")
        trips = host.metrics.registry.get_sample_value(
            "fleetpilot_policy_breaker_trips_total", {"policy": "forgetful", "outcome": "exception"})
        ledgers = await observer.ledgers()
    finally:
        await host.stop()
    decided = {d.task_id: d for d in observer.decisions}
    canary = decided["c1"]
    assert canary.action == "assign" and canary.shard_id == "c"
    # Before: an assign on gpu -1 (no GPU) went out, its hold 0 milli: the GPU was free to be
    # booked again under a task that would use it.
    assert canary.fallback and canary.policy.name == "fallback", canary
    assert [(p.gpu >= 0, p.milli) for p in canary.placement] == [(True, 500)]
    assert trips == 1.0
    held = {(a.task_id, a.milli) for ledger in ledgers.values() for a in ledger.allocations if a.gpu >= 0}
    assert held == {("c1", 500), ("p1", 300)}
    assert not decided["p1"].fallback and decided["p1"].policy.name == "bestfit"
