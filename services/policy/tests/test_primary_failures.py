"""A primary that fails in the ways a loaded module's plugin does: the breaker hears of every
failure as one, opens at its threshold and stays open while the primary still fails, and the
replica's decisions go on meanwhile, whether the plugin holds short, hangs or exits."""

from __future__ import annotations

import threading
import time

import numpy as np
from fleetpilot.policy import ClusterState, PluginSpec, ProfileConfig, TaskRequest, register
from fleetpilot.policy.framework import DevicePlugin, ScorePlugin
from fleetpilot_services.policy.policy_set import ActivePolicies, PluginProfile, load_config
from fleetpilot_services.policy.replica import checked_decide

from .conftest import node


@register
class ForgetsTheGpus(DevicePlugin):
    """A device picker that gives the task its node and no GPU."""

    name = "test-forgets-the-gpus"

    def devices(self, cycle, pos):
        """No GPU at all."""
        return [], 0


HANG = {"release": threading.Event(), "hang": True, "calls": 0, "returned": 0}


@register
class Hangs(ScorePlugin):
    """A score plugin waiting on something that does not answer (a remote scorer down)."""

    name = "test-hangs"

    def score(self, cycle):
        """Zeros, once released (at most 10 s)."""
        HANG["calls"] += 1
        try:
            if HANG["hang"]:
                HANG["release"].wait(10.0)
            return np.zeros(cycle.rows.size)
        finally:
            HANG["returned"] += 1


@register
class Exits(ScorePlugin):
    """A score plugin that calls ``sys.exit`` (an argparse on the service's own arguments)."""

    name = "test-exits"

    def score(self, cycle):
        """Never returns."""
        raise SystemExit(2)


def policies(plugin: ProfileConfig, **breaker) -> tuple[ActivePolicies, list[tuple[str, str, str]]]:
    """A replica's policies with ``plugin`` as the default, and the breaker changes they tell."""
    changes: list[tuple[str, str, str]] = []
    active = ActivePolicies(load_config({"profile": plugin.name, "breaker": breaker}), "test",
                            {plugin.name: PluginProfile(plugin, "1+test", "test.py")})
    active.on_breaker = lambda name, state, outcome: changes.append((name, state, outcome))
    return active, changes


def decide(active: ActivePolicies, state: ClusterState, task_id: str):
    """One decision as a replica makes it (the checked, guarded default policy)."""
    current = active.current
    req = TaskRequest(task_id=task_id, kind="train", gpus=1, gpu_milli=500, gpu_memory_mb=1000)
    return checked_decide(current.guarded[current.default], current.default, state, req)


def fleet() -> ClusterState:
    """Two H100 nodes."""
    return ClusterState.from_topology([node("n0"), node("n1")])


def test_a_primary_that_holds_short_opens_its_breaker_at_the_threshold_and_a_failed_probe_keeps_it_open() -> None:
    forgetful = ProfileConfig(name="forgetful", filters=[PluginSpec(name="node-resources")],
                              devices=PluginSpec(name="test-forgets-the-gpus"))
    active, changes = policies(forgetful, failure_threshold=3, cooldown_s=0.2, time_budget_s=2.0)
    state = fleet()
    breaker = active.current.guarded["forgetful"].breaker
    for i in range(3):
        choice = decide(active, state, f"t{i}")
        assert choice.fallback and [p.gpu >= 0 for p in choice.placement] == [True], choice
    # Before: each call was recorded ok, then failed: the count went 0, 1, 0, 1, ... and the
    # breaker never opened (every task to the fallback, its gauge closed, no trip counted).
    assert breaker.state == "open"
    assert changes == [("forgetful", "open", "exception")]
    assert "breaker open" in decide(active, state, "t3").reason
    time.sleep(0.25)
    probe = decide(active, state, "t4")
    assert probe.fallback
    # Before: the probe was recorded ok and closed the breaker before its failure counted.
    assert breaker.state == "open"
    assert changes == [("forgetful", "open", "exception")] * 2


def test_a_primary_that_hangs_is_given_up_on_and_its_breaker_opens_and_closes_once_it_answers() -> None:
    HANG.update(hang=True, calls=0, returned=0)
    HANG["release"].clear()
    hanging = ProfileConfig(name="hanging", filters=[PluginSpec(name="node-resources")],
                            scores=[PluginSpec(name="test-hangs")])
    # A budget of 50 ms: given up on after 1 s (the least hang limit).
    active, changes = policies(hanging, failure_threshold=3, cooldown_s=0.3, time_budget_s=0.05)
    state = fleet()
    try:
        started = time.monotonic()
        first = decide(active, state, "t0")
        waited = time.monotonic() - started
        # Before: the decision (and the event loop it runs on) waited as long as the plugin did.
        assert waited < 3.0, waited
        assert first.fallback and first.placement[0].gpu >= 0 and "(primary: timeout)" in first.reason
        started = time.monotonic()
        for i in (1, 2):
            assert decide(active, state, f"t{i}").fallback
        # The policy still deciding t0 is not called again meanwhile (its object on two
        # threads), nor waited for.
        assert time.monotonic() - started < 0.5 and HANG["calls"] == 1
        assert changes == [("hanging", "open", "timeout")]
    finally:
        HANG["release"].set()
    deadline = time.monotonic() + 5.0
    while HANG["returned"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    HANG["hang"] = False
    time.sleep(0.35)
    # Answering again, the primary decides after the cooldown, and the breaker closes.
    back = decide(active, state, "t3")
    assert not back.fallback and back.policy == "hanging", back
    assert changes[-1] == ("hanging", "closed", "ok")


def test_a_primary_that_calls_sys_exit_is_a_failure_the_fallback_decides() -> None:
    exiting = ProfileConfig(name="exiting", filters=[PluginSpec(name="node-resources")],
                            scores=[PluginSpec(name="test-exits")])
    active, changes = policies(exiting, failure_threshold=1, time_budget_s=2.0)
    # Before: SystemExit went past the breaker (it catches failures) and out of the event
    # loop: the replica stopped.
    choice = decide(active, fleet(), "t0")
    assert choice.fallback and choice.placement[0].gpu >= 0
    assert changes == [("exiting", "open", "exception")]
