"""Settings that make no sense are refused at start-up with one line naming the variable."""

from __future__ import annotations

import pytest
from fleetpilot.runtime.config import BadSettings
from fleetpilot_services.policy.settings import PolicySettings

# Each was accepted before: a period of 0 spun its loop, NaN never woke it (the queue was
# never retried), a claim timeout of 0 let replicas take each other's claims mid-placement,
# a negative lookahead failed every telemetry sample, probabilities left (0, 1].
REFUSED = [
    ("PENDING_RETRY_S", "0"),
    ("PENDING_RETRY_S", "nan"),
    ("CLAIM_TIMEOUT_S", "0"),
    ("CLAIM_TIMEOUT_S", "inf"),
    ("REBALANCE_S", "-1"),
    ("STATS_REFRESH_S", "nan"),
    ("STATS_TIMEOUT_S", "0"),
    ("PLUGIN_POLL_S", "0"),
    # A module's vetting limit: 0 refused every module, NaN never refused a hanging one.
    ("PLUGIN_IMPORT_TIMEOUT_S", "0"),
    ("PLUGIN_IMPORT_TIMEOUT_S", "nan"),
    ("WORKLOAD_REFRESH_S", "0"),
    ("WORKLOAD_WINDOW", "0"),
    ("OOM_MIGRATE_RISK", "nan"),
    ("OOM_MIGRATE_RISK", "1.5"),
    ("MAX_MIGRATIONS_PER_ROUND", "-1"),
    ("RESIZE_MARGIN_MB", "-512"),
    ("CHECKPOINT_BASE_S", "-1"),
    ("CHECKPOINT_S_PER_GB", "nan"),
    ("PREEMPT_RESTART_S", "-60"),
    ("EVICT_SUCCESS", "1.5"),
    ("EVICT_SUCCESS", "0"),
    ("EVICT_TIMEOUT_S", "0"),
    ("REFUSED_REPLACEMENTS", "-1"),
    ("GROWTH_LOOKAHEAD_S", "-10"),
    ("QUEUE_AGING", "inf"),
    # The replay record's bound: ignored before (the file grew until the disk was full); a
    # negative sampling period was taken for "off" without a word.
    ("RECORD_MAX_MB", "0"),
    ("RECORD_MAX_MB", "-256"),
    ("RECORD_MAX_MB", "nan"),
    ("RECORD_MAX_MB", "inf"),
    ("RECORD_KEEP", "-1"),
    ("RECORD_KEEP", "2.5"),
    ("RECORD_EVERY", "-1"),
]


@pytest.mark.parametrize(("name", "value"), REFUSED)
def test_a_setting_that_makes_no_sense_is_refused_in_one_line(monkeypatch, name: str, value: str) -> None:
    monkeypatch.setenv(f"FLEETPILOT_POLICY_{name}", value)
    with pytest.raises(BadSettings) as caught:
        PolicySettings.from_environment()
    message = str(caught.value)
    assert f"FLEETPILOT_POLICY_{name}" in message
    assert "is not a setting" not in message  # refused for its value, not as an unknown name
    assert "\n" not in message


def test_the_defaults_and_sensible_edges_are_accepted(monkeypatch) -> None:
    for name, value in (("MAX_MIGRATIONS_PER_ROUND", "0"), ("REFUSED_REPLACEMENTS", "0"),
                        ("RESIZE_MARGIN_MB", "0"), ("OOM_MIGRATE_RISK", "1"), ("EVICT_SUCCESS", "1"),
                        ("RECORD_KEEP", "0"), ("RECORD_MAX_MB", "0.5")):
        monkeypatch.setenv(f"FLEETPILOT_POLICY_{name}", value)
    got = PolicySettings.from_environment()
    assert (got.max_migrations_per_round, got.refused_replacements, got.oom_migrate_risk) == (0, 0, 1.0)
    assert (got.record_keep, got.record_max_mb) == (0, 0.5)
    assert PolicySettings().pending_retry_s == 1.0


def test_the_replay_record_is_bounded_unless_an_operator_says_otherwise() -> None:
    # 256 MiB and 3 older files: at most 1 GiB on disk. Before, no bound: the disk filled.
    got = PolicySettings.from_environment()
    assert (got.record_every, got.record_max_mb, got.record_keep) == (0, 256.0, 3)


# The policies' own settings, taken before: a misspelt field of a rule or of the breaker was
# dropped for its default (a rule's weight of 1: every matching task to the canary); a weight
# out of 0..1 or a condition that does not parse stopped the replica only once connected, with
# a traceback; a time budget of NaN never timed out, one of 0 failed every decision.
REFUSED_POLICIES = [
    ("SHAPING_RULES", '[{"condition": "true", "wieght": 0.05, "policy": "fgd"}]'),
    ("SHAPING_RULES", '[{"condition": "true", "weight": 1.5, "policy": "fgd"}]'),
    ("SHAPING_RULES", '[{"condition": "task.kind ==", "weight": 0.05, "policy": "fgd"}]'),
    ("SHAPING_RULES", '[{"condition": "true", "weight": NaN, "policy": "fgd"}]'),
    ("BREAKER", '{"cooldown": 5}'),
    ("BREAKER", '{"time_budget_s": 0}'),
    ("BREAKER", '{"time_budget_s": NaN}'),
    ("BREAKER", '{"confidence_floor": NaN}'),
    ("BREAKER", '{"cooldown_s": Infinity}'),
    ("BREAKER", '{"failure_threshold": 0}'),
]


# A policy name no built-in has, with no module directory to define it: taken before, and the
# replica stopped only once connected, with a traceback ("unknown policy 'bestfitt'").
REFUSED_POLICIES += [
    ("PROFILE", "bestfitt"),
    ("PROFILE", ""),
    ("SHAPING_RULES", '[{"condition": "true", "weight": 0.05, "policy": "fgd-v2"}]'),
]


@pytest.mark.parametrize(("name", "value"), REFUSED_POLICIES)
def test_a_shaping_rule_or_breaker_that_makes_no_sense_is_refused_in_one_line(monkeypatch, name: str,
                                                                               value: str) -> None:
    monkeypatch.setenv(f"FLEETPILOT_POLICY_{name}", value)
    with pytest.raises(BadSettings) as caught:
        PolicySettings.from_environment()
    message = str(caught.value)
    assert f"FLEETPILOT_POLICY_{name}" in message
    assert "\n" not in message


def test_sensible_shaping_rules_and_breaker_are_accepted(monkeypatch) -> None:
    monkeypatch.setenv("FLEETPILOT_POLICY_SHAPING_RULES",
                       '[{"condition": "task.kind == \'finetune\'", "weight": 0, "policy": "fgd", "shard": "c"}]')
    monkeypatch.setenv("FLEETPILOT_POLICY_BREAKER", '{"failure_threshold": 1, "cooldown_s": 0, "time_budget_s": 2}')
    got = PolicySettings.from_environment().policy_config()
    assert (got.shaping[0].weight, got.breaker.cooldown_s, got.breaker.time_budget_s) == (0.0, 0.0, 2.0)


def test_a_policy_name_is_refused_when_the_module_directory_is_not_there(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FLEETPILOT_POLICY_PROFILE", "mine")
    monkeypatch.setenv("FLEETPILOT_POLICY_PLUGIN_DIR", str(tmp_path / "polcies"))
    with pytest.raises(BadSettings) as caught:
        PolicySettings.from_environment()
    assert "FLEETPILOT_POLICY_PROFILE" in str(caught.value) and "polcies" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_module_profile_name_is_accepted_with_a_module_directory(monkeypatch, tmp_path) -> None:
    # Its modules are loaded once connected: the name may be one of theirs.
    monkeypatch.setenv("FLEETPILOT_POLICY_PROFILE", "mine")
    monkeypatch.setenv("FLEETPILOT_POLICY_SHAPING_RULES", '[{"condition": "true", "weight": 0.1, "policy": "theirs"}]')
    monkeypatch.setenv("FLEETPILOT_POLICY_PLUGIN_DIR", str(tmp_path))
    got = PolicySettings.from_environment()
    assert (got.profile, got.shaping_rules[0]["policy"]) == ("mine", "theirs")
