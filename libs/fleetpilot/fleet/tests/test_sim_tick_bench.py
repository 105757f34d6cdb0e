"""The simulator benchmark runs on a small fleet and its loop baseline agrees with the simulator."""

from __future__ import annotations

import pytest
from fleetpilot.bench.sim_tick import measure, populate, python_loop_tick
from fleetpilot.fleet.inventory import build_fleet
from fleetpilot.fleet.simulator import SimulatedFleet

SMALL = {"sites": [{"name": "s", "groups": [{"prefix": "n", "count": 20, "shape": {"gpu_model": "T4", "gpus": 4}}]}]}


def test_baseline_computes_the_same_memory_and_power_as_the_simulator() -> None:
    fleet = build_fleet(SMALL)
    sim = SimulatedFleet(fleet, seed=0, start_at=0.0)
    loop = populate(sim)
    # Noise is only in the simulator; compare without it by reading the noiseless curve.
    sim.advance(5.0)
    python_loop_tick(loop, 5.0, 5.0)
    samples = [s for node in sim.node_names() for s in sim.sample(node)]
    assert len(samples) == len(loop) == 80
    for s, g in zip(samples, loop, strict=True):
        assert s.memory_used_mb == pytest.approx(g.used_mb, rel=0.05)
        assert s.power_w == pytest.approx(g.power_w, abs=0.01)
        assert s.temperature_c == pytest.approx(g.temperature_c, abs=0.01)


def test_measure_reports_a_ratio() -> None:
    result = measure(build_fleet(SMALL), ticks=3, baseline_ticks=1)
    assert result["gpus"] == 80 and result["tasks"] == 100
    assert result["sim_ms"] > 0 and result["ratio"] == pytest.approx(result["baseline_ms"] / result["sim_ms"])
