"""Reading the simulated fleet observes it: it neither changes what happens next nor kills."""

from __future__ import annotations

from fleetpilot.fleet.inventory import load_fleet_spec
from fleetpilot.fleet.simulator import CONTEXT_MB, SimulatedFleet
from fleetpilot.workload.growth import MemoryGrowth

NOISY = MemoryGrowth(pattern="flat", base_mb=20_000, peak_mb=20_000, duration_s=10_000, warmup_s=1, noise_mb=500)


def _run(read_between: bool) -> list[float]:
    sim = SimulatedFleet(load_fleet_spec(), seed=3, start_at=0.0)
    node = sim.node_names()[0]
    used = []
    for step in range(5):
        sim.place(f"t{step}", node, [step % 2], NOISY, util=50)
        if read_between:
            sim.sample(node)  # what the collector does whenever a tick follows a placement
            sim.task_samples(node)
            sim.events()
        sim.advance(10.0)
        used.extend(s.memory_used_mb for s in sim.sample(node))
    return used


def test_the_same_seed_plays_the_same_fleet_however_often_it_is_read() -> None:
    assert _run(read_between=True) == _run(read_between=False)


def test_a_read_without_time_passing_does_not_change_a_reading() -> None:
    sim = SimulatedFleet(load_fleet_spec(), seed=5, start_at=0.0)
    node, other = sim.node_names()[:2]
    sim.place("a", node, [0], NOISY, util=50)
    sim.advance(10.0)
    before = sim.sample(node)[0].memory_used_mb
    sim.place("b", other, [0], NOISY, util=50)  # elsewhere; no time passes
    assert sim.sample(node)[0].memory_used_mb == before
    assert sim.sample(other)[0].memory_used_mb >= CONTEXT_MB  # the new task is there at once
