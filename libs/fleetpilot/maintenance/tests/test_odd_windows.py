"""The health model on windows a caller did not clean: every reading twice (a redelivery),
and a reading that is not a number. Neither may hide a GPU's decay."""

from __future__ import annotations

import math

import pytest
from fleetpilot.maintenance import HealthModel, features_of
from fleetpilot.maintenance.faults import gpu_reading


def test_a_window_of_doubled_readings_reads_as_hot_as_the_window_itself() -> None:
    # An hour at 95 °C, read every 2 minutes; the same window with each reading delivered
    # twice (at-least-once delivery) is the same hour spent hot, not none of it.
    once = [gpu_reading("n1", 0, i * 120.0, temperature_c=95.0) for i in range(31)]
    twice = [s for s in once for _ in range(2)]
    assert features_of(once).hot_fraction == pytest.approx(1.0)
    assert features_of(twice).hot_fraction == pytest.approx(features_of(once).hot_fraction)
    model = HealthModel()
    assert model.assess(twice).failure_probability == pytest.approx(model.assess(once).failure_probability)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_temperature_that_is_not_a_number_hides_no_failure(bad: float) -> None:
    # A GPU with two double-bit errors in the hour, one of whose readings (here the newest)
    # has no temperature: before, the risk came out NaN and never reached the threshold.
    def reading(i: int, temperature_c: float = 60.0):
        errors = min(i // 10, 2)
        return gpu_reading("n1", 0, i * 120.0, temperature_c=temperature_c, ecc_uncorrected=errors,
                           xid_last=48 if errors else 0, xid_count=errors)

    clean = [reading(i) for i in range(30)]
    window = [*clean[:-1], reading(29, bad)]
    model = HealthModel()
    risk = model.assess(window)
    assert math.isfinite(risk.failure_probability) and risk.maintenance_pending
    assert all(math.isfinite(v) for v in risk.contributions.values())
    # The reading that is not a number is left out, as one NVML could not read.
    assert risk.failure_probability == pytest.approx(model.assess(clean).failure_probability)
