"""The simulated fleet: growth patterns played out, OOM, sharing, thermals, faults, speed."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from fleetpilot.contracts.telemetry import GpuSample
from fleetpilot.fleet.inventory import Fleet, Site, build_fleet, load_fleet_spec
from fleetpilot.fleet.reader import GpuReader, lifecycle_for
from fleetpilot.fleet.simulator import (
    CONTEXT_MB,
    SWITCH_RATE_PER_PEER,
    THERMAL_TAU_S,
    SimulatedFleet,
    memory_at_vectorised,
)
from fleetpilot.workload.growth import GROWTH_PATTERNS, MemoryGrowth, random_growth

CURVES = {
    "flat": MemoryGrowth(pattern="flat", base_mb=2_000, peak_mb=30_000, duration_s=1_000, warmup_s=100),
    "linear": MemoryGrowth(pattern="linear", base_mb=1_000, peak_mb=20_000, duration_s=1_000),
    "steps": MemoryGrowth(pattern="steps", base_mb=4_000, peak_mb=24_000, duration_s=1_000, n_steps=4),
    "sawtooth": MemoryGrowth(pattern="sawtooth", base_mb=5_000, peak_mb=25_000, duration_s=1_000, period_s=150),
    "leak": MemoryGrowth(pattern="leak", base_mb=1_000, peak_mb=35_000, duration_s=1_000),
}


@pytest.fixture
def sim() -> SimulatedFleet:
    return SimulatedFleet(load_fleet_spec(), seed=7, start_at=1_000.0)


def test_vectorised_growth_matches_the_ground_truth_for_every_pattern() -> None:
    rng = np.random.default_rng(3)
    curves = [random_growth(rng, p) for p in GROWTH_PATTERNS for _ in range(20)]
    ages = rng.uniform(-10, 8_000, len(curves))
    got = memory_at_vectorised(
        np.array([GROWTH_PATTERNS.index(c.pattern) for c in curves]), np.array([c.base_mb for c in curves]),
        np.array([c.peak_mb for c in curves]), np.array([c.duration_s for c in curves]),
        np.array([c.warmup_s for c in curves]), np.array([c.n_steps for c in curves], float),
        np.array([c.period_s for c in curves]), ages)
    want = np.array([float(c.memory_at(a)) for c, a in zip(curves, ages, strict=True)])
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("pattern", sorted(CURVES))
def test_gpu_memory_follows_each_growth_pattern(sim: SimulatedFleet, pattern: str) -> None:
    growth = CURVES[pattern]
    sim.place("t", "h100-00", [2], growth, util=70)
    for t in (0, 37, 120, 260, 499, 730, 999):
        sim.advance(t - sim.now_s)
        (gpu,) = [s for s in sim.sample("h100-00") if s.gpu == 2]
        expected = float(growth.memory_at(t)) + CONTEXT_MB
        assert gpu.memory_used_mb == pytest.approx(expected, abs=0.1), (pattern, t)
        assert gpu.memory_free_mb == pytest.approx(gpu.memory_total_mb - gpu.memory_used_mb, abs=0.2)
        assert [p.task_id for p in gpu.processes] == ["t"]
    sim.advance(1.0)
    assert sim.running() == []
    assert [(e.kind, e.task_id) for e in sim.events()] == [("finished", "t")]


def test_a_task_placed_to_start_later_holds_nothing_until_then(sim: SimulatedFleet) -> None:
    growth = CURVES["linear"]
    start = sim.now_s + 30.0
    sim.place("later", "h100-00", [1], growth, util=60, start_s=start)
    (gpu,) = [s for s in sim.sample("h100-00") if s.gpu == 1]
    assert gpu.memory_used_mb == 0.0 and gpu.processes == [] and gpu.utilization_gpu_pct == 0.0
    sim.advance(60.0)  # 30 s into its run
    (gpu,) = [s for s in sim.sample("h100-00") if s.gpu == 1]
    assert gpu.memory_used_mb == pytest.approx(float(growth.memory_at(30.0)) + CONTEXT_MB, abs=0.1)
    assert [p.task_id for p in gpu.processes] == ["later"] and gpu.utilization_gpu_pct == pytest.approx(60.0)
    sim.advance(start + growth.duration_s - sim.now_s - 1.0)
    assert sim.running() == ["later"]
    sim.advance(1.0)
    assert sim.running() == []
    with pytest.raises(ValueError, match="before now"):
        sim.place("past", "h100-00", [1], growth, start_s=sim.now_s - 1.0)


def test_task_samples_sum_memory_over_the_task_gpus(sim: SimulatedFleet) -> None:
    growth = MemoryGrowth(pattern="linear", base_mb=1_000, peak_mb=11_000, duration_s=100)
    sim.place("dp", "a100-01", [0, 1, 2], growth, util=50)
    sim.advance(50)
    (task,) = sim.task_samples("a100-01")
    assert task.gpus == [0, 1, 2] and len(task.pids) == 3
    assert task.memory_used_mb == pytest.approx(3 * (6_000 + CONTEXT_MB))
    assert task.utilization_gpu_pct == pytest.approx(50)
    assert sim.task_samples("a100-02") == []


def test_oom_kills_the_task_that_pushed_the_gpu_over(sim: SimulatedFleet) -> None:
    steady = MemoryGrowth(pattern="flat", base_mb=20_000, peak_mb=20_000, duration_s=10_000)
    leak = MemoryGrowth(pattern="leak", base_mb=1_000, peak_mb=40_000, duration_s=1_000)
    sim.place("steady", "a100-00", [3], steady, util=40)
    sim.place("leaky", "a100-00", [3, 4], leak, util=40)
    killed_at = None
    for _ in range(100):
        sim.advance(10)
        events = [e for e in sim.events() if e.kind == "oom"]
        if events:
            (event,) = events
            killed_at = sim.now_s
            break
    assert killed_at is not None and event.task_id == "leaky" and event.gpu == 3 and event.node == "a100-00"
    # It died when steady + leak + contexts first exceeded 40,960 MB.
    leak_at = float(leak.memory_at(killed_at))
    assert 20_000 + leak_at + 2 * CONTEXT_MB > 40_960
    assert 20_000 + float(leak.memory_at(killed_at - 10)) + 2 * CONTEXT_MB <= 40_960
    assert sim.running() == ["steady"]
    gpus = {s.gpu: s for s in sim.sample("a100-00")}
    assert gpus[4].memory_used_mb == 0 and gpus[3].memory_used_mb == pytest.approx(20_000 + CONTEXT_MB)
    lifecycle = lifecycle_for(event, [3, 4])
    assert lifecycle is not None and lifecycle.state == "oom_killed" and lifecycle.gpus == [3, 4]


def test_a_new_task_that_does_not_fit_is_the_victim_not_the_resident(sim: SimulatedFleet) -> None:
    sim.place("resident", "a100-00", [0], MemoryGrowth(pattern="flat", base_mb=30_000, peak_mb=30_000,
                                                       duration_s=10_000), util=50)
    sim.advance(5)
    sim.place("newcomer", "a100-00", [0], MemoryGrowth(pattern="flat", base_mb=15_000, peak_mb=15_000,
                                                       duration_s=10_000), util=50)
    (event,) = sim.events()
    assert (event.kind, event.task_id) == ("oom", "newcomer")
    assert sim.running() == ["resident"]


def test_utilisation_saturates_and_context_switches_grow_with_colocated_processes(sim: SimulatedFleet) -> None:
    flat = MemoryGrowth(pattern="flat", base_mb=1_000, peak_mb=1_000, duration_s=10_000)
    rates = []
    for k in range(4):
        sim.place(f"p{k}", "h100-01", [5], flat, util=40)
        sim.advance(1)
        (gpu,) = [s for s in sim.sample("h100-01") if s.gpu == 5]
        assert gpu.utilization_gpu_pct == pytest.approx(min(40 * (k + 1), 100))
        assert len(gpu.processes) == k + 1
        rates.append(gpu.cuda_context_switches_per_sec.value)
        assert 0 < gpu.cuda_context_switches_per_sec.uncertainty_score < 1
    assert rates == pytest.approx([0.0, SWITCH_RATE_PER_PEER * 0.8, SWITCH_RATE_PER_PEER * 2, SWITCH_RATE_PER_PEER * 3])
    shares = {t.task_id: t.utilization_gpu_pct for t in sim.task_samples("h100-01")}
    assert shares == pytest.approx({f"p{k}": 25.0 for k in range(4)})


def pcie_fleet() -> Fleet:
    return build_fleet({"sites": [{"name": "s", "groups": [{"prefix": "pcie-", "count": 1, "shape": {
        "gpu_model": "V100-32GB", "gpus": 4, "nvlink": "none"}}]}]})


def test_multi_gpu_traffic_goes_over_nvlink_when_present_else_pcie(sim: SimulatedFleet) -> None:
    growth = MemoryGrowth(pattern="flat", base_mb=1_000, peak_mb=1_000, duration_s=10_000)
    sim.place("tp", "h100-02", [0, 1], growth, util=100)
    sim.place("solo", "h100-02", [2], growth, util=100)
    sim.advance(1)
    gpus = {s.gpu: s for s in sim.sample("h100-02")}
    assert gpus[0].nvlink_bandwidth_utilization_ratio.value == pytest.approx(0.25)
    assert gpus[2].nvlink_bandwidth_utilization_ratio.value == 0.0
    other = SimulatedFleet(pcie_fleet(), seed=1, start_at=0.0)
    other.place("tp", "pcie-00", [0, 1], growth, util=100)
    other.advance(1)
    pcie = {s.gpu: s for s in other.sample("pcie-00")}
    assert pcie[0].nvlink_bandwidth_utilization_ratio.value == 0.0
    assert pcie[0].nvlink_bandwidth_utilization_ratio.uncertainty_score == 0.0  # no NVLink: exact zero
    assert pcie[0].pcie_rx_kbps > gpus[0].pcie_rx_kbps > 0


def test_temperature_follows_load_with_first_order_lag(sim: SimulatedFleet) -> None:
    start = sim.sample("a100-05")[0].temperature_c
    sim.place("hot", "a100-05", [0], MemoryGrowth(pattern="flat", base_mb=1, peak_mb=1, duration_s=1e6), util=100)
    sim.advance(THERMAL_TAU_S)
    after_tau = sim.sample("a100-05")[0]
    sim.advance(20 * THERMAL_TAU_S)
    settled = sim.sample("a100-05")[0]
    assert settled.power_w == pytest.approx(400.0) and settled.sm_clock_mhz == 1_410
    assert (after_tau.temperature_c - start) / (settled.temperature_c - start) == pytest.approx(1 - math.exp(-1), abs=0.01)
    sim.remove("hot")
    sim.advance(20 * THERMAL_TAU_S)
    assert sim.sample("a100-05")[0].temperature_c < settled.temperature_c - 20


def test_fatal_xid_kills_the_gpu_tasks_and_a_benign_one_does_not(sim: SimulatedFleet) -> None:
    growth = MemoryGrowth(pattern="flat", base_mb=1_000, peak_mb=1_000, duration_s=1e6)
    sim.place("a", "a100-02", [1], growth)
    sim.place("b", "a100-02", [2], growth)
    sim.inject_xid("a100-02", 2, 13)
    sim.inject_xid("a100-02", 1, 79)
    events = [(e.kind, e.gpu, e.task_id, e.value) for e in sim.events()]
    assert events == [("xid", 2, None, 13), ("xid", 1, None, 79), ("task_failed", 1, "a", 1_000.0)]
    assert sim.running() == ["b"]
    gpus = {s.gpu: s for s in sim.sample("a100-02")}
    assert (gpus[1].xid_last, gpus[1].xid_count, gpus[2].xid_last) == (79, 1, 13)


def test_uncorrected_ecc_retires_memory_and_raises_xid_48(sim: SimulatedFleet) -> None:
    sim.inject_ecc("h100-00", 0, corrected=5)
    sim.inject_ecc("h100-00", 0, uncorrected=1)
    gpu = sim.sample("h100-00")[0]
    assert (gpu.ecc_corrected, gpu.ecc_uncorrected, gpu.retired_pages, gpu.remapped_rows) == (5, 1, 1, 1)
    assert (gpu.xid_last, gpu.xid_count) == (48, 1)
    assert [e.kind for e in sim.events()] == ["ecc", "ecc", "xid"]


def test_overheat_throttles_and_reports_once(sim: SimulatedFleet) -> None:
    sim.place("w", "a100-03", [6], MemoryGrowth(pattern="flat", base_mb=1, peak_mb=1, duration_s=1e6), util=100)
    sim.inject_overheat("a100-03", 6, extra_c=40, duration_s=3_000)
    for _ in range(10):
        sim.advance(30)
    gpu = sim.sample("a100-03")[6]
    assert gpu.temperature_c > 87 and gpu.sm_clock_mhz == pytest.approx(1_410 * 0.7)
    assert [e.kind for e in sim.events()] == ["overheat"]
    sim.advance(3_000)
    assert sim.sample("a100-03")[6].sm_clock_mhz == 1_410


@pytest.mark.parametrize(("kind", "field"), [
    ("ecc_corrected", "ecc_corrected"), ("retired_pages", "retired_pages"),
    ("remapped_rows", "remapped_rows"), ("pcie_replays", "pcie_replays"),
])
def test_slow_degradations_accelerate(sim: SimulatedFleet, kind: str, field: str) -> None:
    sim.degrade("a100-07", 2, kind, rate_per_h=10, accel_per_h2=20)  # type: ignore[arg-type]
    counts = []
    for _ in range(3):
        for _ in range(60):
            sim.advance(60)
        counts.append(getattr(sim.sample("a100-07")[2], field))
    first, second, third = counts[0], counts[1] - counts[0], counts[2] - counts[1]
    assert first == pytest.approx(10 + 20 / 2, abs=1)     # integral of 10 + 20 h over the first hour
    assert third > second > first
    assert getattr(sim.sample("a100-07")[3], field) == 0


def test_link_width_down_trains(sim: SimulatedFleet) -> None:
    sim.degrade("h100-03", 1, "link_width", rate_per_h=50)
    widths = []
    for _ in range(24):
        sim.advance(600)
        gpu = sim.sample("h100-03")[1]
        widths.append(gpu.pcie_link_width)
        assert gpu.pcie_link_width_max == 16
    assert widths == sorted(widths, reverse=True) and widths[-1] < 16
    assert all(w in (1, 2, 4, 8, 16) for w in widths)


def test_sample_fills_the_schema_and_reader_protocol(sim: SimulatedFleet) -> None:
    assert isinstance(sim, GpuReader) and sim.source == "sim"
    assert len(sim.node_names()) == 28
    samples = sim.sample("orin-03")
    assert len(samples) == 1 and isinstance(samples[0], GpuSample)
    s = samples[0]
    assert s.model == "Jetson-Orin" and s.uuid.startswith("GPU-") and s.at == 1_000.0
    assert s.memory_total_mb == 65_536 and s.power_limit_w == 60 and s.pcie_link_width == 16
    assert s.labels["business_role"] == "encode" and s.labels["site"] == "edge" and s.labels["driver_version"]
    assert sim.topology("orin-03").gpus[0].uuid == s.uuid


@pytest.mark.parametrize(("call", "error"), [
    (lambda s: s.place("x", "nope", [0], CURVES["flat"]), KeyError),
    (lambda s: s.place("x", "a100-00", [8], CURVES["flat"]), ValueError),
    (lambda s: s.place("x", "a100-00", [0, 0], CURVES["flat"]), ValueError),
    (lambda s: s.remove("ghost"), KeyError),
    (lambda s: s.advance(-1), ValueError),
    (lambda s: s.inject_xid("a100-00", 9), ValueError),
])
def test_bad_calls_raise(sim: SimulatedFleet, call, error: type[Exception]) -> None:
    with pytest.raises(error):
        call(sim)


def test_duplicate_task_is_rejected(sim: SimulatedFleet) -> None:
    sim.place("x", "a100-00", [0], CURVES["flat"])
    with pytest.raises(ValueError):
        sim.place("x", "a100-00", [1], CURVES["flat"])


def test_a_large_fleet_advances_fast() -> None:
    fleet = build_fleet({"sites": [{"name": "big", "groups": [{"prefix": "n", "count": 780, "shape": {
        "gpu_model": "T4", "gpus": 8}}]}]})
    assert fleet.gpu_count == 6_240
    sim = SimulatedFleet(fleet, seed=0, start_at=0.0)
    rng = np.random.default_rng(0)
    for k, node in enumerate(fleet.nodes):
        for g in range(8):
            sim.place(f"t{k}-{g}", node.node, [g], random_growth(rng, peak_mb=8_000), util=60)
    sim.advance(1)
    began = time.perf_counter()
    for _ in range(5):
        sim.advance(1)
    per_tick = (time.perf_counter() - began) / 5
    assert per_tick < 0.25, f"{per_tick * 1000:.1f} ms per virtual second"
    assert Fleet(sites=[Site(name="x")]).gpu_count == 0


def test_a_process_s_peak_is_what_it_held_at_any_instant_not_only_at_a_step(sim: SimulatedFleet) -> None:
    # A sawtooth that climbs towards 25 GB by 600 s, drops, and ends near 18 GB; a leak whose
    # last minute is its steepest: a step a minute apart would miss both tops.
    saw = MemoryGrowth(pattern="sawtooth", base_mb=5_000, peak_mb=25_000, duration_s=1_000, period_s=600)
    leak = MemoryGrowth(pattern="leak", base_mb=2_000, peak_mb=30_000, duration_s=330)
    sim.place("saw", "a100-00", [0, 1], saw, util=40)
    sim.place("leak", "a100-00", [2], leak, util=40)
    assert sim.peak_held_mb("saw") == CONTEXT_MB + 5_000  # at its start
    sim.advance(300)
    assert sim.peak_held_mb("saw") == pytest.approx(CONTEXT_MB + 15_000)
    assert sim.peak_held_mb("leak") == pytest.approx(CONTEXT_MB + 2_000 + 28_000 * (300 / 330) ** 2)
    sim.advance(60)
    (done,) = [e for e in sim.events() if e.kind == "finished"]
    assert (done.task_id, done.value) == ("leak", pytest.approx(CONTEXT_MB + 30_000))  # at its end, 30 s ago
    sim.advance(420)  # 780 s: past its drop at 600 s
    assert sim.peak_held_mb("saw") == pytest.approx(CONTEXT_MB + 25_000)
    sim.advance(240)
    (done,) = [e for e in sim.events() if e.kind == "finished"]
    assert (done.task_id, done.value) == ("saw", pytest.approx(CONTEXT_MB + 25_000))
    with pytest.raises(KeyError):
        sim.peak_held_mb("saw")
    later = MemoryGrowth(pattern="flat", base_mb=1_000, peak_mb=1_000, duration_s=100)
    sim.place("later", "a100-00", [3], later, start_s=sim.now_s + 60)
    assert sim.peak_held_mb("later") == 0.0  # placed to start later: nothing held yet
