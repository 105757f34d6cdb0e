"""A module's plugin whose constructor hangs must not stop a swap, and with it the replica.

Every swap (a config document, a module, the feedback statistics, the workload) builds every
policy again, in-process on the event loop: a plugin whose constructor never returns on the
arguments a config document gives it (the module's own profiles, vetted in a child, never
gave it those) stopped the replica's every decision and heartbeat for good."""

from __future__ import annotations

import time

import msgspec
import pytest
from fleetpilot.policy import register
from fleetpilot.policy.framework import ScorePlugin
from fleetpilot_services.policy.policy_set import ActivePolicies, PolicyConfig


class _Args(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    hang: bool = False


@register
class _SlowToBuild(ScorePlugin):
    """Builds at once, unless told to hang (then never, until the test ends)."""

    name = "test-hanging-build-slow"
    Args = _Args

    def __init__(self, args=None) -> None:
        super().__init__(args)
        while self.args.hang:
            time.sleep(0.01)

    def score(self, cycle):
        """Any scores."""
        return cycle.rows * 0.0


def _config(hang: bool) -> PolicyConfig:
    return PolicyConfig(profile="slow", profiles={"slow": {
        "filters": [{"name": "node-resources"}],
        "scores": [{"name": "test-hanging-build-slow", "args": {"hang": hang}}]}})


@pytest.mark.timeout(60)
def test_a_config_whose_plugin_hangs_while_built_is_refused_within_the_limit() -> None:
    active = ActivePolicies(PolicyConfig(profile="bestfit"), build_limit_s=1.0)
    assert active.apply_config(_config(hang=False), "policies.default rev 1")
    serving = active.current
    started = time.monotonic()
    assert active.apply_config(_config(hang=True), "policies.default rev 2") is False
    assert 1.0 <= time.monotonic() - started < 10.0
    assert active.current is serving and active.refused is not None
    # Tried again (another swap) while that build is still stuck: refused at once, no second thread.
    started = time.monotonic()
    assert active.apply_config(_config(hang=True), "policies.default rev 3") is False
    assert time.monotonic() - started < 0.5
    # A swap of anything else still rebuilds and goes through.
    assert active.apply_config(_config(hang=False), "policies.default rev 4")
