"""The health model on windows that are not a full, evenly sampled two hours: a gap in
reporting (a collector restarted, a node rebooted) and a window only minutes long (an
executor just started, a board just replaced). One reading after a gap, or a burst in the
first minutes, must weigh as much as it would in a full window, not as a trend or an hourly
rate."""

from __future__ import annotations

import pytest
from fleetpilot.maintenance import HealthModel, features_of
from fleetpilot.maintenance.faults import gpu_reading


def test_one_warm_reading_after_a_gap_is_not_a_thermal_trend() -> None:
    # Ten minutes of readings at 65 °C, the collector down for an hour and a half, then one
    # reading at 90 °C: as alarming as that one reading at the end of an unbroken window.
    before = [gpu_reading("n1", 0, i * 120.0, temperature_c=65.0) for i in range(6)]
    gap = [*before, gpu_reading("n1", 0, 6600.0, temperature_c=90.0)]
    unbroken = [gpu_reading("n1", 0, i * 120.0, temperature_c=65.0) for i in range(55)]
    unbroken.append(gpu_reading("n1", 0, 6600.0, temperature_c=90.0))
    features = features_of(gap)
    assert features.thermal_slope == 0.0
    assert features.hot_fraction == pytest.approx(2 / 60)  # one 2-minute sampling period of an hour
    model = HealthModel()
    assert not model.assess(gap).maintenance_pending
    assert model.assess(gap).failure_probability < 0.1
    assert model.assess(unbroken).failure_probability < 0.1


def test_a_steady_climb_still_reads_as_one_however_it_was_sampled() -> None:
    # 10 °C/h over two hours, sampled unevenly with a 40-minute hole in the middle.
    times = [*range(0, 2400, 120), *range(4800, 7201, 120)]
    window = [gpu_reading("n1", 0, float(t), temperature_c=60.0 + 10.0 * t / 3600.0) for t in times]
    assert features_of(window).thermal_slope == pytest.approx(10.0 / 5.0)


def test_a_burst_in_the_first_minutes_of_a_window_is_not_an_hourly_rate() -> None:
    # 40 corrected ECC errors and 100 PCIe replays between two readings two minutes apart:
    # no more an alarm than the same burst at the end of a full window.
    short = [gpu_reading("n1", 0, 0.0, ecc_corrected=100, pcie_replays=100),
             gpu_reading("n1", 0, 120.0, ecc_corrected=140, pcie_replays=200)]
    hour = [gpu_reading("n1", 0, i * 120.0, ecc_corrected=100, pcie_replays=100) for i in range(30)]
    hour.append(gpu_reading("n1", 0, 3600.0, ecc_corrected=140, pcie_replays=200))
    model = HealthModel()
    assert model.assess(short).failure_probability == pytest.approx(model.assess(hour).failure_probability)
    assert not model.assess(short).maintenance_pending


@pytest.mark.parametrize("readings", [[95.0], [60.0, 95.0], [60.0, 95.0, 95.0]])
def test_a_hot_reading_in_the_first_minutes_of_a_window_is_not_a_window_spent_hot(readings: list[float]) -> None:
    # An executor restarted (or a board swapped) during a transient: the window is a minute or
    # two long, and a reading above 85 °C in it must weigh as it would in a full window,
    # where that GPU is far from maintenance.
    fresh = [gpu_reading("n1", 0, 1000.0 + i * 60.0, temperature_c=t) for i, t in enumerate(readings)]
    full = [gpu_reading("n1", 0, 1000.0 + i * 60.0 - 7200.0, temperature_c=60.0) for i in range(120)] + fresh
    model = HealthModel()
    assert features_of(fresh).hot_fraction == pytest.approx((len(readings) - 1) / 60)  # minutes of an hour
    assert not model.assess(fresh).maintenance_pending
    assert model.assess(fresh).failure_probability <= model.assess(full).failure_probability + 0.05
