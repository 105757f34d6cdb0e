"""A configuration document is taken whole or refused with its reason: a misspelt field at
any depth, or a breaker that makes no sense, leaves the previous policies serving."""

from __future__ import annotations

import pytest
from fleetpilot_services.policy.metrics import PolicyMetrics
from fleetpilot_services.policy.policy_set import ActivePolicies, parse_config
from prometheus_client import CollectorRegistry

# Each was taken before, the misspelt field silently dropped for its default. The first sent
# every matching task to the canary (a rule's weight defaults to 1), the last every decision
# to the fallback (a score plugin's weight of 1 dwarfed the profile's own).
MISSPELT = [
    (b'{"profile": "bestfit", "shaping": [{"condition": "true", "wieght": 0.05, "policy": "fgd"}]}',
     "shaping[0].wieght"),
    (b'{"breaker": {"cooldown": 5}}', "breaker.cooldown"),
    (b'{"profile": {"name": "mine", "filtres": [{"name": "node-resources"}]}}', "profile.filtres"),
    (b'{"profiles": {"v2": {"scores": [{"name": "fgd"}, {"name": "thermal", "wieght": 0.05}]}},'
     b' "shaping": [{"weight": 0.1, "policy": "v2"}]}', "profiles.v2.scores[1].wieght"),
]


@pytest.mark.parametrize(("doc", "field"), MISSPELT)
def test_a_misspelt_field_at_any_depth_is_refused_with_its_path(doc: bytes, field: str) -> None:
    with pytest.raises(ValueError, match=r"invalid policy config") as caught:
        parse_config(doc)
    assert field in str(caught.value)
    assert "\n" not in str(caught.value)


# Each was taken before: a budget of 0 or below, or a floor above 1, judged every decision a
# failure (every task to the fallback); a threshold or probe count of 0 opened the breaker at
# once, or closed it without a probe; a negative cooldown probed on every call.
NONSENSE = [
    b'{"breaker": {"time_budget_s": 0}}',
    b'{"breaker": {"time_budget_s": -1}}',
    b'{"breaker": {"failure_threshold": 0}}',
    b'{"breaker": {"probe_successes": 0}}',
    b'{"breaker": {"cooldown_s": -30}}',
    b'{"breaker": {"confidence_floor": 1.5}}',
    b'{"breaker": {"confidence_floor": -0.1}}',
]


@pytest.mark.parametrize("doc", NONSENSE)
def test_a_breaker_that_makes_no_sense_is_refused_and_the_previous_set_serves(doc: bytes) -> None:
    with pytest.raises(ValueError, match=r"breaker\."):
        parse_config(doc)
    # Built by hand (not through the bucket), it still does not compile: the swap is refused.
    import msgspec
    from fleetpilot.policy import BreakerConfig
    from fleetpilot_services.policy.policy_set import PolicyConfig

    active = ActivePolicies(parse_config(b'{"profile": "bestfit"}'))
    bad = msgspec.convert(msgspec.json.decode(doc)["breaker"], BreakerConfig)
    assert not active.apply_config(PolicyConfig(profile="fgd", breaker=bad), "kv")
    assert (active.current.default, active.current.generation) == ("bestfit", 1)


def test_sensible_breaker_edges_and_the_documented_example_are_accepted() -> None:
    for doc in (b'{"breaker": {"cooldown_s": 0, "confidence_floor": 0, "failure_threshold": 1}}',
                b'{"breaker": {"confidence_floor": 1, "time_budget_s": 1e-6}}',
                b'{"profile": "fleetpilot", "shaping": [{"condition": "task.kind == \'finetune\' and task.size_gb > 5",'
                b' "weight": 0.05, "policy": "fleetpilot-v2", "shard": "ft-canary"}], "profiles": {"fleetpilot-v2":'
                b' {"filters": [{"name": "node-resources"}, {"name": "gpu-model"}], "scores": [{"name": "fgd"},'
                b' {"name": "thermal", "weight": 0.05}], "devices": {"name": "scored"}, "version": "2"}},'
                b' "breaker": {"failure_threshold": 3, "cooldown_s": 30, "time_budget_s": 0.05,'
                b' "confidence_floor": 0.3}, "seed": 0}'):
        ActivePolicies(parse_config(doc))


def test_an_open_breaker_a_swap_reported_closed_is_not_brought_back_open() -> None:
    """Config A's breaker opens; config B (another breaker config) leaves it guarding nothing,
    reported closed; back to A, that breaker served again, still open, every decision going
    to the fallback while ``fleetpilot_policy_breaker_open`` said 0. What was reported closed
    is forgotten: A comes back with a closed breaker, as the gauge says."""
    metrics = PolicyMetrics(CollectorRegistry())
    a = parse_config(b'{"profile": "bestfit", "breaker": {"failure_threshold": 1}}')
    b = parse_config(b'{"profile": "bestfit", "breaker": {"failure_threshold": 2}}')
    active = ActivePolicies(a)
    active.on_breaker = metrics.breaker_changed

    def gauge() -> float:
        return metrics.breaker_open.labels("bestfit")._value.get()

    active.current.guarded["bestfit"].breaker.record("exception")
    assert gauge() == 1.0
    assert active.apply_config(b, "kv rev 2") and gauge() == 0.0
    assert active.apply_config(a, "kv rev 3")
    breaker = active.current.guarded["bestfit"].breaker
    assert (breaker.state == "closed") == (gauge() == 0.0)
