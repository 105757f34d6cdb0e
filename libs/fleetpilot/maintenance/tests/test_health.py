"""The health model's features, probability, threshold and migration plan."""

from __future__ import annotations

import msgspec
import pytest
from fleetpilot.contracts import GpuSample, ProcessMemory
from fleetpilot.maintenance import (
    MAINTENANCE_THRESHOLD,
    HealthFeatures,
    HealthModel,
    features_of,
    migration_plan,
    xid_severity,
)

BASE = GpuSample(
    node="n1",
    gpu=2,
    uuid="GPU-x",
    model="H100",
    at=0.0,
    utilization_gpu_pct=90,
    utilization_memory_pct=50,
    memory_total_mb=81920,
    memory_used_mb=40000,
    memory_free_mb=41920,
    temperature_c=60,
    power_w=500,
    power_limit_w=700,
    sm_clock_mhz=1900,
    pcie_tx_kbps=0,
    pcie_rx_kbps=0,
    pcie_link_width=16,
    pcie_link_width_max=16,
    processes=[
        ProcessMemory(pid=1, used_mb=1000, task_id="train-b"),
        ProcessMemory(pid=2, used_mb=1000, task_id="train-a"),
        ProcessMemory(pid=3, used_mb=10),
    ],
)


def series(n: int = 61, period: float = 120.0, **changes_at_end: object) -> list[GpuSample]:
    """A two-hour quiet window whose last sample carries ``changes_at_end``."""
    window = [msgspec.structs.replace(BASE, at=i * period) for i in range(n)]
    window[-1] = msgspec.structs.replace(window[-1], **changes_at_end)
    return window


@pytest.mark.parametrize(
    ("window", "feature", "expected"),
    [
        (series(), "xid", 0.0),
        (series(xid_count=2, xid_last=48), "xid", 2.0),  # two DBEs in the last interval
        (series(xid_count=3, xid_last=13), "xid", pytest.approx(0.3)),  # application errors weigh little
        (series(ecc_uncorrected=9), "ecc_uncorrected", 5.0),  # capped
        (series(pcie_link_width=4), "link_downtrain", 0.75),
        (series(temperature_c=95.0), "overheat", 2.0),
        (series(temperature_c=87.5), "overheat", 0.5),
        (series(retired_pages=3, remapped_rows=13), "remap_level", 0.25),
    ],
)
def test_features(window: list[GpuSample], feature: str, expected: float) -> None:
    assert getattr(features_of(window), feature) == expected


def test_rates_are_per_hour_and_counters_may_reset() -> None:
    window = series(ecc_corrected=200, pcie_replays=20)  # over 2 hours
    f = features_of(window)
    assert f.ecc_corrected == pytest.approx(__import__("math").log1p(100.0))
    reset = [msgspec.structs.replace(s, ecc_corrected=500) for s in window[:-1]] + [window[-1]]
    assert features_of(reset).ecc_corrected == 0.0  # a counter that went down reads as no errors


def test_thermal_trend_needs_an_hour() -> None:
    rising = [
        msgspec.structs.replace(BASE, at=i * 60.0, temperature_c=60 + i) for i in range(20)
    ]  # 60 °C/h, 19 min
    assert features_of(rising).thermal_slope == 0.0
    slow = [
        msgspec.structs.replace(BASE, at=i * 120.0, temperature_c=60 + i * 0.2) for i in range(61)
    ]  # 6 °C/h
    assert features_of(slow).thermal_slope == pytest.approx(6.0 / 5.0)
    hot = [msgspec.structs.replace(BASE, at=i * 60.0, temperature_c=90 if i >= 10 else 70) for i in range(20)]
    assert features_of(hot).hot_fraction == pytest.approx(10 / 60)  # 10 minutes hot, of at least an hour


def test_an_interval_of_several_codes_is_scored_code_by_code() -> None:
    """A double-bit error (48) and the cleanups of the contexts it killed (45) in one
    interval: its last code is 45, which weighs nothing, and the DBE was scored as nothing.
    With the collector's count of each code, each is scored as itself; a code counted
    before the window's change adds nothing."""
    earlier = {13: 2}
    window = [msgspec.structs.replace(s, xid_count=2, xid_last=13, xid_codes=earlier) for s in series()]
    window[-1] = msgspec.structs.replace(window[-1], xid_count=10, xid_last=45, xid_codes={13: 2, 48: 1, 45: 7})
    assert features_of(window).xid == pytest.approx(xid_severity(48) + 7 * xid_severity(45)) == 1.0
    # Samples from a collector that does not count codes: the last code, as before.
    assert features_of(series(xid_count=2, xid_last=48)).xid == 2.0


def test_xid_severity_orders_hardware_over_software() -> None:
    assert xid_severity(48) > xid_severity(63) > xid_severity(13) >= xid_severity(43)
    assert xid_severity(79) == 1.0 and 0 < xid_severity(99999) < 0.5


@pytest.mark.parametrize(
    ("changes", "pending"),
    [
        ({}, False),
        ({"xid_count": 1, "xid_last": 48, "ecc_uncorrected": 1}, False),  # one DBE alone is not enough
        ({"xid_count": 1, "xid_last": 13}, False),
        ({"xid_count": 3, "xid_last": 63, "ecc_corrected": 2000, "remapped_rows": 6}, True),
        ({"pcie_link_width": 4, "pcie_replays": 5000}, True),
    ],
)
def test_threshold_and_tasks_to_migrate(changes: dict, pending: bool) -> None:
    assessment = HealthModel().assess(series(**changes))
    assert assessment.maintenance_pending is pending
    assert (assessment.failure_probability >= MAINTENANCE_THRESHOLD) is pending
    assert assessment.tasks_to_migrate == (["train-a", "train-b"] if pending else [])


def test_quiet_gpu_is_near_zero_and_contributions_explain() -> None:
    model = HealthModel()
    assert model.probability(HealthFeatures()) < 0.01
    a = model.assess(series(pcie_link_width=8))
    assert max(a.contributions, key=a.contributions.__getitem__) == "link_downtrain"


def test_migration_plan_riskiest_first() -> None:
    model = HealthModel()
    sick = model.assess(series(pcie_link_width=4, pcie_replays=5000))
    sicker_window = [
        msgspec.structs.replace(s, node="n9", processes=[ProcessMemory(pid=9, used_mb=1, task_id="infer-z")])
        for s in series(pcie_link_width=2, pcie_replays=50000, xid_count=2, xid_last=79)
    ]
    sicker = model.assess(sicker_window)
    well = model.assess(series())
    plan = migration_plan([sick, well, sicker])
    assert [(m.task_id, m.node) for m in plan] == [("infer-z", "n9"), ("train-a", "n1"), ("train-b", "n1")]
    assert all("maintenance_pending" in m.reason for m in plan)
    fleet = model.assess_fleet({"a": series(), "b": sicker_window, "c": []})
    assert [a.node for a in fleet] == ["n9", "n1"]
    with pytest.raises(ValueError, match="cannot assess an empty window"):
        model.assess([])


def test_an_unrecovered_ecc_error_weighs_as_an_uncontained_one() -> None:
    # XID 140 (NVIDIA: uncorrectable errors in GPU memory that kept the driver from retiring
    # or remapping the page; DCGM fails its health watch on it) is a hardware memory fault at
    # least as grave as a DBE, not an unknown code.
    assert xid_severity(140) == xid_severity(95) == xid_severity(48) == 1.0
    unrecovered, dbe = (features_of(series(xid_count=1, xid_last=code)).xid for code in (140, 48))
    assert unrecovered == dbe == 1.0
