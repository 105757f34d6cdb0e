"""RestoreMemory: which signatures come back from a checkpoint where they were."""

from __future__ import annotations

from fleetpilot.policy.restores import RestoreMemory, restore_tells


def test_an_unknown_signature_is_taken_to_come_back_where_it_was() -> None:
    assert not RestoreMemory().starts_over("sig-a")


def test_a_signature_whose_restores_came_back_low_starts_over() -> None:
    memory = RestoreMemory()
    assert memory.observe("sig-leak", stopped_mb=38_000.0, restored_mb=15_000.0) is False
    assert memory.starts_over("sig-leak")
    assert not memory.starts_over("sig-other")


def test_the_majority_of_restores_decides_and_a_tie_keeps_the_floor() -> None:
    memory = RestoreMemory()
    assert memory.observe("sig-steps", stopped_mb=30_000.0, restored_mb=29_500.0) is True
    memory.observe("sig-steps", stopped_mb=30_000.0, restored_mb=10_000.0)
    assert not memory.starts_over("sig-steps")  # one each: not known to start over
    memory.observe("sig-steps", stopped_mb=30_000.0, restored_mb=9_000.0)
    assert memory.starts_over("sig-steps")


def test_only_a_run_stopped_well_past_where_it_started_can_tell() -> None:
    # Stopped at 24 GB having started at 20: started over or not, it comes back near 20 GB.
    assert not restore_tells(started_mb=20_000.0, stopped_mb=24_000.0)
    assert restore_tells(started_mb=15_000.0, stopped_mb=38_000.0)
