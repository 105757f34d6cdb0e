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


def test_a_restored_step_schedule_steps_at_the_same_points_of_its_progress() -> None:
    steps = curve("steps", n_steps=4)  # steps at 250, 500 and 750 s of progress
    # Stopped at 700 s and restored in 30 s: it holds 25 GB for the restore and the 50 s of
    # progress left to its step, then 30 GB (not halfway through what is left).
    back = steps.restored(700.0, 330.0)
    assert float(back.memory_at(79.0)) == pytest.approx(25_000.0)
    assert float(back.memory_at(81.0)) == pytest.approx(30_000.0)
    # Restored twice: the second restore goes on from the first one's schedule.
    once = steps.restored(100.0, 930.0)  # 15 GB for 30 + 150 s, then a level every 250 s
    assert [float(once.memory_at(t)) for t in (179.0, 181.0, 431.0, 681.0)] == pytest.approx(
        [15_000.0, 20_000.0, 25_000.0, 30_000.0])
    twice = once.restored(300.0, 660.0)  # on 20 GB, 130 s of progress from its next step
    assert [float(twice.memory_at(t)) for t in (0.0, 159.0, 161.0, 411.0, 659.0)] == pytest.approx(
        [20_000.0, 20_000.0, 25_000.0, 30_000.0, 30_000.0])


def test_a_restore_shorter_than_the_steps_left_spreads_them_over_it() -> None:
    back = curve("steps", n_steps=4).restored(100.0, 400.0)  # three steps of 250 s left
    assert [float(back.memory_at(t)) for t in (0.0, 99.0, 101.0, 399.0)] == pytest.approx(
        [15_000.0, 15_000.0, 20_000.0, 30_000.0])


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
