"""Online fingerprinting: first answer after a few samples, refinements, material changes."""

from __future__ import annotations

import numpy as np
import pytest
from fleetpilot.contracts import Fingerprint
from fleetpilot.fingerprint import TRUST_CONFIDENCE, TRUST_SAMPLES, OnlineFingerprinter, changed_materially
from fleetpilot.workload.growth import MemoryGrowth


def _fp(pattern="linear", peak=1000.0, low=900.0, high=1100.0) -> Fingerprint:
    return Fingerprint(signature="s", pattern=pattern, pattern_confidence=0.9, growth_rate_mb_per_s=1.0,
                       predicted_peak_mb=peak, peak_low_mb=low, peak_high_mb=high)


@pytest.mark.parametrize("old,new,expected", [
    (None, _fp(), True),
    (_fp(), _fp(), False),
    (_fp(), _fp(pattern="leak"), True),
    (_fp(), _fp(peak=1090.0, low=990.0, high=1190.0), False),   # 9% move, same width
    (_fp(), _fp(peak=1110.0, low=1010.0, high=1210.0), True),   # 11% move
    (_fp(), _fp(low=880.0, high=1120.0), False),                # width +20%
    (_fp(), _fp(low=870.0, high=1130.0), True),                 # width +30%
    (_fp(), _fp(low=930.0, high=1070.0), True),                 # width -30%
])
def test_changed_materially(old, new, expected):
    assert changed_materially(old, new) is expected


def test_online_converges_and_publishes_sparingly():
    g = MemoryGrowth(pattern="leak", base_mb=3000.0, peak_mb=24000.0, duration_s=3000.0, noise_mb=80.0)
    t = np.arange(0.0, 3000.0, 6.0)
    y = g.memory_at(t, np.random.default_rng(5))
    prior = _fp(pattern="flat", peak=5000.0)
    online = OnlineFingerprinter("sig-1", expected_duration_s=3000.0, started_at=-0.0, prior=prior)
    assert online.current is prior
    published = []
    for i, (a, b) in enumerate(zip(t, y, strict=True)):
        fp = online.add(float(a), float(b))
        if i < 5:
            assert fp is None  # too few samples to fit
        if fp is not None:
            published.append((i, fp))
    assert published and published[0][0] == 5
    assert len(published) < 40  # refits are geometric and only material changes publish
    online.refit()
    final = online.current
    assert final.pattern == "leak" and final.samples == t.size
    assert abs(final.predicted_peak_mb - 24000.0) / 24000.0 < 0.02
    # A quarter into its life it already knew the shape and the peak.
    early = [fp for i, fp in published if i <= t.size // 4][-1]
    assert early.pattern == "leak" and abs(early.predicted_peak_mb - 24000.0) / 24000.0 < 0.1


def test_a_long_series_is_thinned_to_its_bound_and_keeps_its_peak_shape_and_ends():
    g = MemoryGrowth(pattern="leak", base_mb=3000.0, peak_mb=24000.0, duration_s=3000.0, noise_mb=80.0)
    t = np.arange(0.0, 3000.0, 0.5)
    y = g.memory_at(t, np.random.default_rng(5))
    online = OnlineFingerprinter("sig-1", expected_duration_s=3000.0, started_at=0.0, max_samples=1000)
    held = 0
    for a, b in zip(t, y, strict=True):
        online.add(float(a), float(b))
        held = max(held, online.held_samples)
    assert held <= 1000 < t.size
    assert (online.samples, online.first_mb, online.last_mb) == (t.size, y[0], y[-1])
    assert online.peak_so_far_mb == y.max()
    final = online.finish()
    assert final.pattern == "leak" and final.samples == t.size
    assert abs(final.predicted_peak_mb - 24000.0) / 24000.0 < 0.02


def test_online_uses_its_own_clock_origin():
    online = OnlineFingerprinter(min_samples=6)
    for k in range(8):
        online.add(1_700_000_000.0 + 10.0 * k, 1000.0 + 10.0 * k)
    assert online.current is not None and online.current.pattern == "linear"
    assert online.current.growth_rate_mb_per_s == pytest.approx(1.0, rel=1e-6)


def _flat_short_run(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A 90 s task that finished loading before its first sample: ``n`` samples 10 s apart
    at 9.3 GB, as the demo's inference tasks look to the fingerprinter."""
    rng = np.random.default_rng(seed)
    return np.arange(n) * 10.0, 9_300.0 + rng.normal(0.0, 30.0, n)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_level_held_to_the_end_is_the_peak_not_a_step_schedule_s_first_level(seed):
    t, y = _flat_short_run(seed, 8)
    online = OnlineFingerprinter("s", expected_duration_s=90.0)
    for a, b in zip(t, y, strict=True):
        online.add(float(a), float(b))
    # Mid-life, with the declared 90 s ahead, the level reads as a step schedule's first.
    assert online.current.predicted_peak_mb > 1.5 * 9_300
    final = online.finish()
    assert abs(final.predicted_peak_mb - 9_300) < 300


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_only_trusted_fingerprints_are_returned_and_an_unreturned_guess_hides_nothing(seed):
    # A leak sampled every 10 s: the first fits, from six samples on, are guesses.
    g = MemoryGrowth(pattern="leak", base_mb=4_000.0, peak_mb=30_000.0, duration_s=600.0, noise_mb=40.0)
    t = np.arange(0.0, 400.0, 10.0)
    y = g.memory_at(t, np.random.default_rng(seed))
    plain = OnlineFingerprinter("s", expected_duration_s=600.0)
    first = next(fp for a, b in zip(t, y, strict=True) if (fp := plain.add(float(a), float(b))) is not None)
    assert first.samples < TRUST_SAMPLES
    online = OnlineFingerprinter("s", expected_duration_s=600.0, only_trusted=True)
    returned = [fp for a, b in zip(t, y, strict=True) if (fp := online.add(float(a), float(b))) is not None]
    assert returned, "a trusted fingerprint came and was returned"
    assert all(fp.samples >= TRUST_SAMPLES and fp.pattern_confidence >= TRUST_CONFIDENCE for fp in returned)
    assert returned[-1].predicted_peak_mb == pytest.approx(online.current.predicted_peak_mb, rel=0.10)


def test_a_guess_that_was_never_returned_does_not_hide_the_same_trusted_fingerprint():
    # A clean line: its fit at six samples already predicts what it predicts at ten, but
    # only at ten is it trusted. That first trusted fit is news: the guess was never returned.
    t = np.arange(0.0, 300.0, 10.0)
    y = 8_000.0 + 30.0 * t + np.random.default_rng(4).normal(0.0, 20.0, t.size)
    online = OnlineFingerprinter("s", expected_duration_s=600.0, only_trusted=True)
    returned = [fp for a, b in zip(t, y, strict=True) if (fp := online.add(float(a), float(b))) is not None]
    assert returned and returned[0].samples == TRUST_SAMPLES and returned[0].pattern == "linear"


def test_a_run_that_ended_without_a_declared_life_is_not_carried_past_its_last_sample():
    # 8 GB growing 30 MB/s for 300 s, no duration declared: while it runs the horizon is
    # twice its age (about 17 GB at 600 s); once it has ended, its peak is what it reached.
    t = np.arange(0.0, 300.0, 10.0)
    y = 8_000.0 + 30.0 * t + np.random.default_rng(6).normal(0.0, 20.0, t.size)
    online = OnlineFingerprinter("s")
    for a, b in zip(t, y, strict=True):
        online.add(float(a), float(b))
    online.refit()
    assert online.current.predicted_peak_mb > 15_000
    final = online.finish()
    assert final.pattern == "linear" and abs(final.predicted_peak_mb - (8_000 + 30.0 * 290)) < 300


def test_a_run_that_ended_before_its_declared_end_is_carried_to_its_real_end():
    # Declared an hour, ran 300 s growing 30 MB/s: carried to the declared hour its line
    # would reach about 116 GB; it ended at 305 s, having reached about 16.7 GB.
    t = np.arange(0.0, 300.0, 10.0)
    y = 8_000.0 + 30.0 * t + np.random.default_rng(8).normal(0.0, 20.0, t.size)

    def run() -> OnlineFingerprinter:
        online = OnlineFingerprinter("s", expected_duration_s=3_600.0, started_at=1_000.0)
        for a, b in zip(t, y, strict=True):
            online.add(1_000.0 + float(a), float(b))
        return online

    assert run().finish().predicted_peak_mb > 100_000  # without its end: the declared hour
    assert abs(run().finish(ended_at=1_305.0).predicted_peak_mb - (8_000 + 30.0 * 305)) < 300
    # A clock that says the run ended before its last sample is not used (its last samples
    # may still be on their way): carried to the declared end, as without one.
    assert run().finish(ended_at=1_100.0).predicted_peak_mb > 100_000


def test_refits_or_thins_on_next_add_says_what_add_then_does(monkeypatch):
    # A service runs the heavy adds off its event loop on this prediction: one that said
    # "append only" before a refit would stall the loop, and one never true would do nothing.
    online = OnlineFingerprinter("s", min_samples=4, max_samples=32)
    calls: list[str] = []
    refit, thin = online.refit, online._thin
    monkeypatch.setattr(online, "refit", lambda: calls.append("refit") or refit())
    monkeypatch.setattr(online, "_thin", lambda: calls.append("thin") or thin())
    said, did = [], []
    for i in range(200):
        said.append(online.refits_or_thins_on_next_add())
        calls.clear()
        online.add(float(i), 100.0 + 5.0 * i)
        did.append(bool(calls))
    assert said == did
    assert 5 < sum(did) < 100  # geometric refits and periodic thinning, not every sample


@pytest.mark.parametrize("at,used_mb,utilisation", [
    (50.0, float("nan"), None),
    (50.0, float("inf"), None),
    (float("nan"), 1_000.0, None),
    (50.0, 1_000.0, float("nan")),
])
def test_a_reading_that_is_not_a_number_is_refused_and_leaves_the_series_as_it_was(at, used_mb, utilisation):
    fp = OnlineFingerprinter("s", expected_duration_s=400.0)
    for t in range(0, 50, 5):
        fp.add(float(t), 1_000.0 + 10.0 * t, utilisation=80.0)
    with pytest.raises(ValueError, match="not a number"):
        fp.add(at, used_mb, utilisation=utilisation)
    assert fp.samples == 10
    for t in range(55, 200, 5):
        fp.add(float(t), 1_000.0 + 10.0 * t, utilisation=80.0)
    final = fp.finish()
    assert final is not None and final.pattern == "linear" and final.samples == 39
    assert np.isfinite([final.predicted_peak_mb, final.peak_low_mb, final.peak_high_mb, final.burstiness]).all()


@pytest.mark.parametrize("declared", [float("nan"), float("inf"), -1.0])
def test_a_declared_life_that_is_no_life_is_none_and_cuts_no_envelope(declared):
    g = MemoryGrowth(pattern="steps", base_mb=8_000.0, peak_mb=20_000.0, duration_s=1_000.0, n_steps=3)
    t = np.arange(0.0, 1_000.0, 10.0)
    model = OnlineFingerprinter("s", expected_duration_s=declared)
    for at in t:
        model.add(float(at), float(g.memory_at(at)))
    assert model.expected_duration_s is None
    # A NaN life cut the envelope at no time: the first level held "to the end" but for the last point.
    assert model.finish().envelope_mb == ()
    model.expected_duration_s = 1_000.0  # told later by its submission: a life it is
    assert model.expected_duration_s == 1_000.0
