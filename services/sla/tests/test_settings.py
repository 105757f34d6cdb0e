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
