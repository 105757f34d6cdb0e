"""The memory samples a replica keeps per running task (``observe``), over a clock that jumps."""

from __future__ import annotations

from pathlib import Path

from fleetpilot.contracts import TaskTelemetry

from .conftest import policy_state


def sample(at: float, mb: float) -> TaskTelemetry:
    return TaskTelemetry(task_id="t", node="n0", gpus=[0], at=at, memory_used_mb=mb)


def test_a_clock_stepped_back_starts_the_series_again_instead_of_blinding_it(tmp_path: Path) -> None:
    ps = policy_state(tmp_path)
    for i in range(3):
        ps.observe(sample(1000.0 + i, 1000.0 + 100 * i))
    # The node's clock was an hour ahead for one sample, then set right (NTP stepped it back).
    ps.observe(sample(4600.0, 1300.0))
    for i in range(3, 6):
        ps.observe(sample(1000.0 + i, 1000.0 + 100 * i))
    # Before, every sample after the jump counted as late and was dropped until the clock
    # caught up an hour later: the growth that checkpoints a task before its OOM went unseen.
    assert list(ps.usage["t"]) == [(1003.0, 1300.0), (1004.0, 1400.0), (1005.0, 1500.0)]


def test_a_late_or_repeated_sample_is_still_dropped(tmp_path: Path) -> None:
    ps = policy_state(tmp_path)
    for at in (1000.0, 1001.0, 1002.0, 1001.5, 1002.0):
        ps.observe(sample(at, at))
    assert [at for at, _ in ps.usage["t"]] == [1000.0, 1001.0, 1002.0]
