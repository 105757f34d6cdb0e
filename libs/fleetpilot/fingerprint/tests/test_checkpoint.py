"""A run's series in progress written as a checkpoint and restored: the same model, whole or
bounded, its envelope kept exactly."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from fleetpilot.fingerprint import (
    SeriesCheckpoint,
    TaskSeries,
    bounded,
    checkpoint_of,
    decode_checkpoint,
    encode_checkpoint,
    restore,
)

DECLARED_S = 10_000.0


def steps(t: float) -> float:
    """A step schedule: 12 GB, then 3 GB more at each quarter of the declared life, with noise."""
    return 12_000.0 + 3_000.0 * min(int(t // (DECLARED_S / 4)), 3) + 40.0 * math.sin(t / 7.0)


def fed(model: TaskSeries, times, start: float = 1_000_000.0) -> list:
    """Feed ``model`` the step schedule at ``times`` (seconds since the run's start); what it published."""
    out = []
    for t in times:
        at = start + float(t)
        model.latest_at = at
        fp = model.add(at, steps(float(t)), utilisation=50.0 + 30.0 * math.sin(float(t)))
        if fp is not None:
            out.append(fp)
    return out


def through_the_bucket(model: TaskSeries, *, max_samples: int = 2_000, **service_state) -> TaskSeries:
    kept = checkpoint_of("task-1", model, now_wall=5_000.0, now_monotonic=100.0, **service_state)
    return restore(decode_checkpoint(encode_checkpoint(kept, max_samples)), now_wall=5_030.0, now_monotonic=900.0)


def test_a_restored_series_goes_on_as_the_one_never_interrupted():
    whole = TaskSeries("sig-1", expected_duration_s=DECLARED_S, only_trusted=True, from_start=True)
    first = TaskSeries("sig-1", expected_duration_s=DECLARED_S, only_trusted=True, from_start=True)
    times = np.arange(0.0, DECLARED_S, 20.0)
    cut = 180  # in the second level: before its step, after a trusted fingerprint went out
    published_before = fed(first, times[:cut])
    assert published_before, "nothing trusted before the cut: the test would not check the publications"
    restored = through_the_bucket(first)

    assert fed(whole, times) == published_before + fed(restored, times[cut:])
    assert (restored.signature, restored.from_start, restored.samples) == ("sig-1", True, len(times))
    end = 1_000_000.0 + DECLARED_S
    assert restored.finish(ended_at=end) == whole.finish(ended_at=end)
    assert restored.finish(ended_at=end).envelope_mb  # it began with its run: the envelope is taught


def test_what_the_service_keeps_beside_the_series_comes_back_and_heard_at_is_on_this_replica_s_clock():
    model = TaskSeries("sig-1", expected_duration_s=DECLARED_S, only_trusted=True, from_start=False)
    fed(model, np.arange(0.0, 200.0, 10.0))
    model.heard_at = 90.0  # heard 10 s before the checkpoint was written
    kept = checkpoint_of("task-1", model, now_wall=5_000.0, now_monotonic=100.0, peak_before_mb=20_000.0,
                         last_stop=999_000.0, last_start=998_000.0, stopped=(18_000.0, 999_000.0))
    back = decode_checkpoint(encode_checkpoint(kept))
    assert back == kept
    assert (back.heard_wall, back.peak_before_mb, back.last_stop, back.last_start, back.stopped_mb,
            back.stopped_at) == (4_990.0, 20_000.0, 999_000.0, 998_000.0, 18_000.0, 999_000.0)
    restored = restore(back, now_wall=5_030.0, now_monotonic=900.0)
    assert restored.heard_at == pytest.approx(860.0)  # 40 s before now, on the new clock
    assert restored.latest_at == model.latest_at and restored.from_start is False


def test_a_long_series_is_bounded_keeping_its_envelope_its_peak_and_its_ends():
    model = TaskSeries("sig-1", expected_duration_s=DECLARED_S, only_trusted=True, from_start=True)
    times = np.arange(0.0, DECLARED_S * 0.9, 2.5)  # 3,600 samples, into the last level
    fed(model, times)
    kept = checkpoint_of("task-1", model, now_wall=5_000.0, now_monotonic=100.0)
    small = bounded(kept, 500)
    assert len(small.t_s) <= 500 and len(small.utilisation) <= 500 and len(kept.t_s) == len(times)
    assert len(encode_checkpoint(kept, 500)) < 40_000
    assert small.samples == len(times)
    assert (small.t_s[0], small.used_mb[0]) == (kept.t_s[0], kept.used_mb[0])
    assert (small.t_s[-1], small.used_mb[-1]) == (kept.t_s[-1], kept.used_mb[-1])
    assert max(small.used_mb) == max(kept.used_mb)

    restored = through_the_bucket(model, max_samples=500)
    assert restored.envelope(DECLARED_S) == model.envelope(DECLARED_S)
    assert restored.peak_so_far_mb == model.peak_so_far_mb
    for t in np.arange(DECLARED_S * 0.9, DECLARED_S, 2.5):  # the rest of its run
        for series in (model, restored):
            series.add(1_000_000.0 + float(t), steps(float(t)), utilisation=50.0)
    end = 1_000_000.0 + DECLARED_S
    whole, resumed = model.finish(ended_at=end), restored.finish(ended_at=end)
    assert resumed.envelope_mb == whole.envelope_mb
    assert resumed.pattern == whole.pattern
    assert resumed.predicted_peak_mb == pytest.approx(whole.predicted_peak_mb, rel=0.01)
    assert resumed.samples == whole.samples


def test_a_short_series_is_kept_whole():
    model = TaskSeries("sig-1", expected_duration_s=DECLARED_S, only_trusted=True)
    fed(model, np.arange(0.0, 300.0, 1.0))
    kept = checkpoint_of("task-1", model, now_wall=5_000.0, now_monotonic=100.0)
    assert bounded(kept, 300) is kept


def test_a_value_that_is_not_a_checkpoint_is_refused_not_misread():
    with pytest.raises(msgspec.ValidationError):
        decode_checkpoint(b'{"checkpoint": "series.v2", "task_id": "t", "written_wall": 1, "heard_wall": 1}')
    with pytest.raises(msgspec.DecodeError):
        decode_checkpoint(b"not json")
    torn = SeriesCheckpoint(task_id="t", written_wall=1.0, heard_wall=1.0, samples=3, t_s=(0.0, 1.0, 2.0),
                            used_mb=(1.0, 2.0))
    with pytest.raises(ValueError, match="checkpoint of t"):
        restore(torn, now_wall=2.0, now_monotonic=2.0)
