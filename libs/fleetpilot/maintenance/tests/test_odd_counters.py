"""The health model on the readings a real collector sends besides clean ones: a field NVML
failed to read (the collector sends its default, 0, and names it under ``nvml_unsupported``),
a counter that dips for one reading, one that restarts from zero, a link width above its
maximum. None of them is a sign of decay, and none may stop the assessment."""

from __future__ import annotations

import math

import msgspec
import pytest
from fleetpilot.contracts import GpuSample
from fleetpilot.maintenance import HealthModel, features_of
from fleetpilot.maintenance.faults import gpu_reading

# A GPU a year into service: its aggregate counters are far from zero, and quiet now.
WORN = dict(ecc_corrected=5000, retired_pages=20, pcie_replays=3000, xid_count=5, xid_last=79, pcie_link_width=16)
FAILED_READ = dict(ecc_corrected=0, ecc_uncorrected=0, retired_pages=0, pcie_replays=0, pcie_link_width=0,
                   temperature_c=0.0, labels={"nvml_unsupported": "ecc,pcie_link_width,pcie_replays,retired_pages,"
                                                                  "temperature"})


def worn_window(n: int = 61, period: float = 120.0) -> list[GpuSample]:
    return [gpu_reading("n1", 0, i * period, temperature_c=65.0, **WORN) for i in range(n)]


@pytest.mark.parametrize("at", [0, 1, 30, 60])
def test_a_failed_read_is_no_sign_of_decay_wherever_it_falls_in_the_window(at: int) -> None:
    window = worn_window()
    window[at] = msgspec.structs.replace(window[at], **FAILED_READ)
    assessment = HealthModel().assess(window)
    clean = msgspec.structs.asdict(features_of(worn_window()))
    assert msgspec.structs.asdict(assessment.features) == pytest.approx(clean, abs=1e-9)
    assert not assessment.maintenance_pending


@pytest.mark.parametrize("at", [0, 30])
def test_an_unlabelled_dip_to_zero_is_no_sign_of_decay(at: int) -> None:
    # A collector of another version that leaves fields out: they decode as 0, unlabelled.
    window = worn_window()
    window[at] = msgspec.structs.replace(window[at], ecc_corrected=0, retired_pages=0, pcie_replays=0, xid_count=0)
    features = features_of(window)
    assert (features.xid, features.ecc_corrected, features.remap, features.pcie_replays) == (0.0, 0.0, 0.0, 0.0)
    assert not HealthModel().assess(window).maintenance_pending


@pytest.mark.parametrize("at", [1, 30, 59])
def test_a_one_reading_jump_that_comes_back_is_no_sign_of_decay(at: int) -> None:
    # A garbage value above the count for one reading (a bit flip on the wire, a driver bug):
    # before, the jump counted as growth for the whole window, then the way back as a reset.
    window = worn_window()
    window[at] = msgspec.structs.replace(window[at], ecc_corrected=2**31, ecc_uncorrected=7, retired_pages=2**20,
                                         pcie_replays=10**9, xid_count=500, xid_last=48)
    assessment = HealthModel().assess(window)
    clean = msgspec.structs.asdict(features_of(worn_window()))
    assert msgspec.structs.asdict(assessment.features) == pytest.approx(clean, abs=1e-9)
    assert not assessment.maintenance_pending


def test_a_jump_counts_only_as_far_as_the_readings_after_it_allow() -> None:
    # 5000 -> garbage -> 5040 -> 5100: the counter grew by 100, not by the garbage.
    window = worn_window()
    window[30] = msgspec.structs.replace(window[30], ecc_corrected=10**9)
    window[31:] = [msgspec.structs.replace(s, ecc_corrected=5040) for s in window[31:]]
    window[-1] = msgspec.structs.replace(window[-1], ecc_corrected=5100)
    assert features_of(window).ecc_corrected == pytest.approx(math.log1p(100 / 2.0))


def test_a_jump_then_a_restart_from_zero_counts_the_growth_after_the_restart() -> None:
    # A garbage reading, the count back, then the collector restarted and saw two DBEs.
    window = worn_window()
    window[20] = msgspec.structs.replace(window[20], xid_count=10**6, xid_last=48)
    window[40:] = [msgspec.structs.replace(s, xid_count=0) for s in window[40:]]
    window[-1] = msgspec.structs.replace(window[-1], xid_count=2, xid_last=48)
    assert features_of(window).xid == 2.0


def test_a_counter_restarted_from_zero_counts_what_came_after() -> None:
    # The collector restarted (its XID count starts again) and then saw two DBEs.
    window = worn_window()
    window[40:] = [msgspec.structs.replace(s, xid_count=0) for s in window[40:]]
    window[-1] = msgspec.structs.replace(window[-1], xid_count=2, xid_last=48)
    assert features_of(window).xid == 2.0


def test_real_growth_still_counts() -> None:
    window = worn_window()
    window[-1] = msgspec.structs.replace(window[-1], ecc_corrected=5200, retired_pages=26, xid_count=8, xid_last=63)
    features = features_of(window)
    assert features.ecc_corrected == pytest.approx(math.log1p(100.0))
    assert features.remap == pytest.approx(math.log1p(6))
    assert features.xid == pytest.approx(1.5)


@pytest.mark.parametrize("width", [32, 2**40])
def test_a_link_wider_than_its_maximum_neither_lowers_the_risk_nor_overflows(width: int) -> None:
    window = [msgspec.structs.replace(s, pcie_link_width=width) for s in worn_window()]
    window[-1] = msgspec.structs.replace(window[-1], ecc_uncorrected=5, xid_count=9, xid_last=48)
    assessment = HealthModel().assess(window)
    assert assessment.features.link_downtrain == 0.0
    assert assessment.maintenance_pending  # five DBEs: the link reading must not hide them


def test_the_risk_is_finite_for_any_log_odds() -> None:
    from fleetpilot.maintenance import HealthFeatures, LogisticWeights

    model = HealthModel(weights=LogisticWeights(hot_fraction=-1e6))
    assert model.probability(HealthFeatures(hot_fraction=1.0)) == 0.0
    assert HealthModel(weights=LogisticWeights(hot_fraction=1e6)).probability(HealthFeatures(hot_fraction=1.0)) == 1.0


def test_the_module_s_worked_figures_are_the_model_s() -> None:
    import re

    from fleetpilot.maintenance import health

    doc = " ".join(health.__doc__.split())
    bias = float(re.search(r"bias at (-?[0-9.]+)", doc).group(1))
    quiet = float(re.search(r"quiet GPU scores ~([0-9.]+)", doc).group(1))
    dbe = float(re.search(r"one isolated DBE \(an XID 48 and one uncorrected ECC error\) ~([0-9.]+)", doc).group(1))
    fresh = [gpu_reading("n1", 0, i * 120.0, pcie_link_width=16) for i in range(61)]
    window = [*fresh[:-1], msgspec.structs.replace(fresh[-1], xid_count=1, xid_last=48, ecc_uncorrected=1)]
    assert bias == HealthModel().weights.bias
    assert HealthModel().assess(fresh).failure_probability == pytest.approx(quiet, abs=0.0005)
    assert HealthModel().assess(window).failure_probability == pytest.approx(dbe, abs=0.005)


def unopened(at: float) -> GpuSample:
    """What the collector sends for a GPU NVML could not open (``NvmlReader._unopened_sample``):
    every field at its default, no uuid, the reason under ``nvml_error`` and no
    ``nvml_unsupported`` label; only the XID count is still read."""
    return gpu_reading("n1", 0, at, temperature_c=0.0, uuid="", model="", pcie_link_width_max=0, xid_count=5,
                       xid_last=79, labels={"nvml_error": "Unknown Error"})


@pytest.mark.parametrize("unopened_for", [1, 10, 30])
def test_a_gpu_nvml_could_not_open_for_a_while_is_no_sign_of_decay_once_it_opens(unopened_for: int) -> None:
    # Its lifetime counters must not read as growth from the zeros it was sent as, nor its
    # temperature as a climb from 0 °C.
    window = [unopened(i * 120.0) for i in range(unopened_for)] + worn_window()[unopened_for:]
    assessment = HealthModel().assess(window)
    features = assessment.features
    assert (features.ecc_corrected, features.remap, features.pcie_replays, features.thermal_slope) == (0, 0, 0, 0)
    assert not assessment.maintenance_pending


def test_the_tasks_to_migrate_off_a_gpu_that_fell_off_the_bus_are_those_it_last_ran() -> None:
    # Memory decaying, then the GPU falls off the bus: every NVML call fails, the process
    # list included, and the last sample names no process. Its tasks still have to move.
    from fleetpilot.contracts import ProcessMemory

    running = [ProcessMemory(pid=7, used_mb=100.0, task_id="train-a")]
    window = [gpu_reading("n1", 0, i * 120.0, temperature_c=65.0, processes=running, **WORN) for i in range(60)]
    window[-1] = msgspec.structs.replace(window[-1], ecc_corrected=7000, remapped_rows=8, xid_count=9, xid_last=94)
    fallen = {**FAILED_READ, "labels": {"nvml_unsupported": FAILED_READ["labels"]["nvml_unsupported"] + ",processes"}}
    window.append(gpu_reading("n1", 0, 7320.0, xid_count=10, xid_last=79, **fallen))
    assessment = HealthModel().assess(window)
    assert assessment.maintenance_pending
    assert assessment.tasks_to_migrate == ["train-a"]


def test_garbage_readings_anywhere_but_the_newest_never_add_growth() -> None:
    # A counter that only grows, some of its readings replaced by garbage (zero, far above,
    # double, half): what is counted never exceeds what it really grew since the window's
    # baseline (its second reading, the median of the first three when they are clean).
    import random

    from fleetpilot.maintenance.health import counter_increments

    for seed in range(2000):
        rng = random.Random(seed)
        count, true = rng.randint(0, 10**6), []
        for _ in range(rng.randint(5, 80)):
            count += rng.choice([0, 0, 0, 1, 5, 100])
            true.append(count)
        read = list(true)
        for i in rng.sample(range(3, len(read) - 1), k=min(rng.randint(1, 4), len(read) - 4)):
            read[i] = rng.choice([0, rng.randint(0, 2**40), read[i] * 2 + 1, read[i] // 2])
        assert sum(counter_increments(read)) <= true[-1] - true[1], (seed, read)
