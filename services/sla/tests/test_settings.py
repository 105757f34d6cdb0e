"""Settings that make no sense stop the service with one line naming the variable."""

from __future__ import annotations

import pytest
from fleetpilot.runtime.config import BadSettings
from fleetpilot_services.sla.service import SlaSettings


@pytest.mark.parametrize(("variable", "value"), [
    ("OFFER_VALIDITY_S", "nan"),        # valid_until NaN: no reply is ever late, no offer ever expires
    ("OFFER_VALIDITY_S", "-5"),         # every offer born expired
    ("MAX_OPTIONS", "0"),               # an offer with nothing to accept
    ("MAX_OPTIONS", "-1"),              # options[:-1]: the last one silently dropped
    ("EXPIRY_INTERVAL_S", "0"),
    ("RESERVE_FRACTION", "1.5"),
    ("RESERVE_FRACTION", "nan"),
    ("LOCAL_BANDWIDTH_GBPS", "0"),      # warm-up = size / 0: the negotiator raised on every task with data
    ("DEFAULT_BANDWIDTH_GBPS", "-1"),   # a negative warm-up meets every warm-up bound
    ("REFERENCE_P95_MS", "inf"),
    ("DEFAULT_PRICE_PER_GPU_HOUR", "-2"),
    ("FLEET_WAIT_S", "nan"),
    ("QUEUE_AGING", "0"),               # the queue's order is undefined at 0 (completion_order)
])
def test_a_setting_out_of_its_range_is_refused_naming_it(monkeypatch, variable, value):
    monkeypatch.setenv(f"FLEETPILOT_SLA_{variable}", value)
    with pytest.raises(BadSettings) as caught:
        SlaSettings.from_environment()
    assert f"FLEETPILOT_SLA_{variable}" in str(caught.value) and "\n" not in str(caught.value)


def test_the_defaults_are_accepted():
    settings = SlaSettings()
    assert settings.offer_validity_s == 30.0 and settings.max_options == 4


def test_the_queue_aging_is_shared_with_the_policy_unless_set_for_one(monkeypatch):
    # The negotiator estimates a wait by the policy's queue order: set apart, the two could
    # disagree on which tasks come first. FLEETPILOT_QUEUE_AGING sets both.
    from fleetpilot_services.policy.settings import PolicySettings

    monkeypatch.setenv("FLEETPILOT_QUEUE_AGING", "0.25")
    assert SlaSettings.from_environment().queue_aging == PolicySettings.from_environment().queue_aging == 0.25
    monkeypatch.setenv("FLEETPILOT_SLA_QUEUE_AGING", "2")
    assert SlaSettings.from_environment().queue_aging == 2.0
    monkeypatch.delenv("FLEETPILOT_SLA_QUEUE_AGING")
    monkeypatch.setenv("FLEETPILOT_QUEUE_AGING", "-1")
    with pytest.raises(BadSettings) as caught:  # named by the shared variable, which set it
        SlaSettings.from_environment()
    assert str(caught.value).startswith("FLEETPILOT_QUEUE_AGING='-1'")
