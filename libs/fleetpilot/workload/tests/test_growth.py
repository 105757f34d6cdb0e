"""Memory-growth curves: what a run restored from a checkpoint comes back with."""

from __future__ import annotations

import pytest
from fleetpilot.workload.growth import MemoryGrowth


def curve(pattern: str, **kw: float) -> MemoryGrowth:
    """10 GB rising to 30 GB over 1,000 s, noiseless."""
    return MemoryGrowth(pattern=pattern, base_mb=10_000.0, peak_mb=30_000.0, duration_s=1_000.0,  # type: ignore[arg-type]
                        warmup_s=50.0, period_s=200.0, **kw)


def test_a_step_schedule_comes_back_at_the_level_it_reached_and_keeps_stepping_to_its_peak() -> None:
    steps = curve("steps", n_steps=4)  # levels 15, 20, 25, 30 GB, a quarter of the run each
    back = steps.restored(600.0, 500.0)  # stopped on the third level
    assert float(back.memory_at(0.0)) == pytest.approx(25_000.0)
    assert float(back.memory_at(499.0)) == pytest.approx(30_000.0)
    assert back.n_steps == 2
    assert back.duration_s == 500.0


def test_a_run_stopped_on_its_last_step_comes_back_at_its_peak() -> None:
    back = curve("steps", n_steps=4).restored(900.0, 150.0)
    assert float(back.memory_at(0.0)) == pytest.approx(30_000.0)
    assert float(back.memory_at(149.0)) == pytest.approx(30_000.0)


@pytest.mark.parametrize("pattern", ["linear", "leak", "flat", "sawtooth"])
def test_what_follows_the_process_starts_over(pattern: str) -> None:
    original = curve(pattern)
    back = original.restored(700.0, 400.0)
    assert float(back.memory_at(0.0)) == pytest.approx(float(original.memory_at(0.0)))
    assert back.peak_mb == original.peak_mb
    assert back.duration_s == 400.0
