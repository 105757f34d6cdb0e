"""Each growth pattern is recognised and its peak predicted, on clean and noisy series."""

from __future__ import annotations

import numpy as np
import pytest
from fleetpilot.fingerprint import analyse_series, burstiness, context_switch_sensitivity, fingerprint_series
from fleetpilot.workload.growth import MemoryGrowth

# (pattern, extra curve parameters); every curve: base 4 GB, peak 20 GB, 3600 s of life.
CURVES = [
    ("flat", {"warmup_s": 240.0}),
    ("linear", {}),
    ("steps", {"n_steps": 5}),
    ("sawtooth", {"period_s": 400.0}),
    ("leak", {}),
]
# (fraction of life observed, noise MB, allowed relative peak error)
CUTS = [
    (1.0, 0.0, 0.01),
    (1.0, 100.0, 0.02),
    (0.5, 100.0, 0.03),
    (0.3, 100.0, 0.06),
]


def _series(pattern: str, extra: dict, frac: float, noise: float, seed: int = 7):
    g = MemoryGrowth(pattern=pattern, base_mb=4_000.0, peak_mb=20_000.0, duration_s=3_600.0,
                     noise_mb=noise, **extra)
    t = np.arange(0.0, frac * g.duration_s + 1e-9, 6.0)
    rng = np.random.default_rng(seed) if noise > 0 else None
    return g, t, g.memory_at(t, rng)


@pytest.mark.parametrize("pattern,extra", CURVES)
@pytest.mark.parametrize("frac,noise,tolerance", CUTS)
def test_pattern_and_peak(pattern, extra, frac, noise, tolerance):
    g, t, y = _series(pattern, extra, frac, noise)
    fp = fingerprint_series(t, y, signature="sig-x", expected_duration_s=g.duration_s)
    assert fp.pattern == pattern
    assert abs(fp.predicted_peak_mb - g.peak_mb) / g.peak_mb <= tolerance
    assert fp.peak_low_mb <= fp.predicted_peak_mb <= fp.peak_high_mb
    assert fp.samples == t.size and fp.signature == "sig-x"


@pytest.mark.parametrize("pattern,extra", CURVES)
def test_interval_covers_truth_under_noise(pattern, extra):
    g, t, y = _series(pattern, extra, 0.5, 150.0, seed=11)
    fp = fingerprint_series(t, y, expected_duration_s=g.duration_s)
    assert fp.peak_low_mb <= g.peak_mb <= fp.peak_high_mb


def test_flat_warmup_and_time_to_peak():
    g, t, y = _series("flat", {"warmup_s": 240.0}, 0.5, 50.0)
    fp = fingerprint_series(t, y, expected_duration_s=g.duration_s)
    assert abs(fp.warmup_s - 240.0) <= 12.0
    assert fp.time_to_peak_s == 0.0
    assert abs(fp.growth_rate_mb_per_s) < 1e-9


def test_linear_growth_rate_and_time_to_peak():
    g, t, y = _series("linear", {}, 0.5, 0.0)
    fp = fingerprint_series(t, y, expected_duration_s=g.duration_s)
    assert fp.growth_rate_mb_per_s == pytest.approx(16_000 / 3_600, rel=0.01)
    assert fp.time_to_peak_s == pytest.approx(3_600 - t[-1], abs=1.0)


def test_without_duration_interval_is_wider():
    g, t, y = _series("linear", {}, 0.25, 100.0)
    known = analyse_series(t, y, expected_duration_s=g.duration_s)
    unknown = analyse_series(t, y)
    def relative_width(fp):
        return (fp.peak_high_mb - fp.peak_low_mb) / fp.predicted_peak_mb

    assert relative_width(unknown.fingerprint) > 1.3 * relative_width(known.fingerprint)
    # Without a duration the horizon is twice the age: the line is extrapolated to 2 x 900 s.
    assert unknown.fingerprint.time_to_peak_s == pytest.approx(t[-1])
    assert any("no expected duration" in n for n in unknown.notes)


def test_first_level_uses_prior_with_low_confidence():
    g, t, y = _series("steps", {"n_steps": 3}, 0.2, 50.0)
    a = analyse_series(t, y, expected_duration_s=g.duration_s)
    assert a.fingerprint.pattern == "steps"
    assert a.fingerprint.pattern_confidence <= 0.55
    assert a.fingerprint.predicted_peak_mb > 1.5 * y.mean()


def test_a_level_held_to_the_known_end_of_life_is_the_peak():
    # A finished run of a flat task, sampled every 60 s after its warm-up: 6,500 MB from the
    # first sample to the last, one interval before the end. Nothing is left to step up to.
    t = np.arange(60.0, 421.0, 60.0)
    y = np.array([6573.1, 6492.2, 6568.1, 6535.1, 6517.2, 6505.3, 6530.0])
    ended = analyse_series(t, y, expected_duration_s=480.0)
    assert ended.fingerprint.pattern == "flat"
    assert ended.fingerprint.predicted_peak_mb == pytest.approx(y.mean(), rel=0.01)
    assert ended.fingerprint.peak_low_mb < y.mean() < ended.fingerprint.peak_high_mb < 1.02 * y.mean()
    assert any("whole known life" in n for n in ended.notes)
    # The same samples with most of the life still ahead: the first level of a step schedule.
    running = analyse_series(t, y, expected_duration_s=1800.0)
    assert running.fingerprint.pattern == "steps"
    assert running.fingerprint.predicted_peak_mb > 1.5 * y.mean()


def test_a_finished_run_peaks_at_what_it_held_not_at_a_fitted_line_carried_on():
    # Four steps of 2,000 MB every 90 s, sampled every 60 s to the end of a 360 s run: a line
    # through the staircase ends above the last level; the run never held more than 9,000 MB.
    t = np.arange(60.0, 361.0, 60.0)
    y = np.array([3000.0, 5000.0, 5000.0, 7000.0, 9000.0, 9000.0]) + np.array([4.0, -3.0, 2.0, -1.0, 3.0, -2.0])
    ended = analyse_series(t, y, expected_duration_s=362.0)
    assert ended.fingerprint.predicted_peak_mb == pytest.approx(9000.0, rel=0.01)
    # A steady line to its end is still carried over the last, unobserved gap.
    ramp = 1000.0 + 20.0 * t
    line = analyse_series(t, ramp, expected_duration_s=400.0)
    assert line.fingerprint.predicted_peak_mb == pytest.approx(1000.0 + 20.0 * 400.0, rel=0.01)


def test_few_samples_still_answer():
    a = analyse_series([0.0, 5.0, 10.0], [1000.0, 1001.0, 999.0])
    assert a.fingerprint.samples == 3 and a.fingerprint.pattern == "unknown"
    assert a.fingerprint.peak_low_mb <= 1000.0 <= a.fingerprint.predicted_peak_mb <= a.fingerprint.peak_high_mb
    assert any("too few" in n for n in a.notes)


@pytest.mark.parametrize("t,y", [
    ([], []),
    ([0.0, 1.0], [1.0]),
    # A sensor's reading that is not a number would make every figure of the fingerprint NaN.
    ([0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0], [1000.0, 1001.0, float("nan"), 1003.0, 1004.0, 1005.0, 1006.0]),
    ([0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0], [1000.0, 1001.0, float("inf"), 1003.0, 1004.0, 1005.0, 1006.0]),
    ([0.0, 5.0, float("nan"), 15.0, 20.0, 25.0, 30.0], [1000.0] * 7),
])
def test_bad_input_raises(t, y):
    with pytest.raises(ValueError):
        fingerprint_series(t, y)


@pytest.mark.parametrize("util,expected_low,expected_high", [
    ([0.5] * 20, 0.0, 0.0),
    ([0.9, 0.1] * 10, 0.4, 0.5),
    ([0.0] * 18 + [1.0, 1.0], 0.7, 0.8),
])
def test_burstiness(util, expected_low, expected_high):
    assert expected_low <= burstiness(util) <= expected_high


@pytest.mark.parametrize("util,coloc,expected", [
    ([0.8, 0.6, 0.4], [1, 2, 3], 0.25),   # loses a quarter of solo utilisation per neighbour
    ([0.8, 0.8, 0.8], [1, 2, 3], 0.0),
    ([0.8, 0.7, 0.9], [2, 2, 2], None),  # count never varies: unknown
])
def test_context_switch_sensitivity(util, coloc, expected):
    got = context_switch_sensitivity(util, coloc)
    assert got == (None if expected is None else pytest.approx(expected, abs=1e-6))


def test_behaviour_fields_flow_into_fingerprint():
    g, t, y = _series("flat", {"warmup_s": 240.0}, 0.5, 0.0)
    util = np.where(np.arange(t.size) % 2 == 0, 0.9, 0.3)
    coloc = np.where(np.arange(t.size) % 2 == 0, 1, 3)
    a = analyse_series(t, y, utilisation=util, colocated=coloc)
    assert a.fingerprint.burstiness > 0.2
    assert a.fingerprint.context_switch_sensitivity == pytest.approx(0.6 / 0.9 / 2, abs=1e-6)
    assert not any("sensitivity" in n for n in a.notes)
    b = analyse_series(t, y)
    assert b.fingerprint.context_switch_sensitivity == 0.0
    assert any("sensitivity unknown" in n for n in b.notes)


@pytest.mark.parametrize("pattern,extra", CURVES)
@pytest.mark.parametrize("duration", [3_600.0, None])
def test_fingerprint_survives_the_wire(pattern, extra, duration):
    from fleetpilot.contracts import TaskFingerprinted, decode, encode

    _, t, y = _series(pattern, extra, 0.4, 80.0)
    fp = fingerprint_series(t, y, expected_duration_s=duration, utilisation=np.linspace(0.2, 0.9, t.size),
                            colocated=np.arange(t.size) % 3)
    event = TaskFingerprinted(task_id="t", fingerprint=fp, source="observed", at=1.0)
    assert decode(encode(event), TaskFingerprinted) == event



def _within(seconds: float, call):
    """``call()``'s answer, failing the test (not hanging it) when it takes over ``seconds``."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(call).result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"no answer within {seconds} s")
    finally:
        pool.shutdown(wait=False)


@pytest.mark.parametrize("t,y", [
    # Two readings stamped alike (a log at whole seconds), the drop between them: a tooth of no length.
    ([0.0, 0.0, *np.arange(1.0, 12.0)], [5_000.0, 100.0, *(100.0 + 10.0 * np.arange(1.0, 12.0))]),
    # Drops microseconds apart (two samplers of one task, interleaved), then a long climb.
    ([0.0, 1e-6, 2e-6, 3e-6, *np.arange(1.0, 2_000.0, 100.0)],
     [9_000.0, 100.0, 9_000.0, 100.0, *(100.0 + np.arange(1.0, 2_000.0, 100.0))]),
], ids=["repeated-stamp", "drops-microseconds-apart"])
def test_a_sawtooth_whose_teeth_have_no_length_is_answered_not_looped_on(t, y):
    fp = _within(5.0, lambda: fingerprint_series(t, y))
    assert fp.pattern == "sawtooth"
    assert np.isfinite(fp.predicted_peak_mb) and fp.time_to_peak_s is not None and fp.time_to_peak_s >= 0.0


@pytest.mark.parametrize("declared", [float("inf"), 1e200, float("nan"), -60.0, 0.0, 1.7e12])
@pytest.mark.parametrize("pattern,extra", [("steps", {"n_steps": 5}), ("linear", {})])
def test_a_declared_life_that_is_no_life_reads_as_none_declared(declared, pattern, extra):
    # Garbled at its source (an epoch time in ms given as a duration, an overflow read as
    # infinity): carried to it, every fit raised or predicted a peak no GPU holds.
    g, t, y = _series(pattern, extra, 0.3, 100.0)
    fp = fingerprint_series(t, y, expected_duration_s=declared)
    assert fp == fingerprint_series(t, y)
    assert fp.pattern == pattern and fp.predicted_peak_mb < 10 * g.peak_mb
