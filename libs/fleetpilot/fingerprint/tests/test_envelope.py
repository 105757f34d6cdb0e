"""The memory envelope of a program: the most its runs held by each twentieth of their life."""

from __future__ import annotations

import msgspec
from fleetpilot.contracts import Fingerprint
from fleetpilot.fingerprint import (
    ENVELOPE_POINTS,
    OnlineFingerprinter,
    SignatureMemory,
    envelope_at,
    keep_signature_knowledge,
    merge_envelopes,
    run_envelope,
)


def fingerprint(**fields) -> Fingerprint:
    return Fingerprint(signature="sig-s", pattern="steps", pattern_confidence=0.9, growth_rate_mb_per_s=0.0,
                       predicted_peak_mb=30_000.0, peak_low_mb=29_000.0, peak_high_mb=31_000.0, **fields)


def test_a_step_counts_from_the_sample_before_the_one_that_showed_it() -> None:
    # Samples every 100 s of a 2,000 s run: 10 GB, then 20 GB from the sample at 1,000 s.
    t = [100.0 * i for i in range(21)]
    used = [10_000.0 if s < 1000 else 20_000.0 for s in t]
    envelope = run_envelope(t, used, 2000.0)
    assert len(envelope) == ENVELOPE_POINTS
    # The step may have come just after 900 s: by 900 s (point 9) it may already hold 20 GB.
    assert envelope[:8] == (10_000.0,) * 8
    assert envelope[8:] == (20_000.0,) * 12


def test_the_last_point_is_the_most_a_run_held_even_past_its_declared_end() -> None:
    envelope = run_envelope([0.0, 50.0, 100.0, 150.0], [1.0, 2.0, 3.0, 9.0], 100.0)
    assert envelope[-1] == 9.0 and envelope[-2] == 3.0
    assert run_envelope([], [], 100.0) == () and run_envelope([0.0], [1.0], 0.0) == ()


def test_envelopes_merge_pointwise_to_the_larger_and_are_read_at_the_point_covering_an_instant() -> None:
    a, b = (1.0, 5.0, 5.0, 5.0), (2.0, 2.0, 6.0, 6.0)
    assert merge_envelopes(a, b) == (2.0, 5.0, 6.0, 6.0)
    assert merge_envelopes((), b) == b and merge_envelopes(a, ()) == a
    envelope = tuple(float(k) for k in range(1, ENVELOPE_POINTS + 1))
    assert envelope_at(envelope, 0.0, 2000.0) == 1.0
    assert envelope_at(envelope, 100.0, 2000.0) == 1.0  # the first twentieth, ends included
    assert envelope_at(envelope, 101.0, 2000.0) == 2.0
    assert envelope_at(envelope, 5000.0, 2000.0) == 20.0  # past the declared end: the most
    assert envelope_at((), 10.0, 100.0) == 0.0


def test_an_observed_fingerprint_keeps_what_its_signature_predicted() -> None:
    predicted = fingerprint(envelope_mb=(1.0, 2.0), fit_peak_mb=31_000.0, run_peaks_mb=(30_000.0, 31_000.0))
    observed = fingerprint(samples=12)
    kept = keep_signature_knowledge(observed, predicted)
    assert (kept.envelope_mb, kept.fit_peak_mb, kept.samples) == ((1.0, 2.0), 31_000.0, 12)
    assert kept.run_peaks_mb == (30_000.0, 31_000.0)
    assert keep_signature_knowledge(observed, None) is observed
    newer = fingerprint(envelope_mb=(3.0, 4.0), fit_peak_mb=32_000.0, run_peaks_mb=(32_000.0,))
    assert keep_signature_knowledge(newer, predicted) is newer


def test_only_a_run_seen_from_its_start_teaches_an_envelope_and_the_signature_keeps_the_largest() -> None:
    memory = SignatureMemory()
    for from_start, level in ((True, 10_000.0), (False, 40_000.0), (True, 12_000.0)):
        online = OnlineFingerprinter("sig-s", expected_duration_s=1000.0, from_start=from_start)
        for i in range(50):
            online.add(20.0 * i, level if i < 25 else 2 * level)
        final = online.finish()
        assert final is not None
        assert bool(final.envelope_mb) == from_start
        memory.observe(final)
    stats = memory.stats("sig-s")
    assert stats is not None and stats.count == 3
    assert stats.envelope_mb[0] == 12_000.0 and stats.envelope_mb[-1] == 24_000.0  # not the restored run's
    predicted = memory.predict("sig-s")
    assert predicted is not None and predicted.envelope_mb == stats.envelope_mb
    assert msgspec.json.decode(msgspec.json.encode(stats), type=type(stats)) == stats


def test_a_declared_duration_that_is_not_a_number_gives_no_envelope_and_reads_its_last_point():
    assert run_envelope([0.0, 10.0], [1_000.0, 2_000.0], float("nan")) == ()
    assert envelope_at((1.0,) * 19 + (2.0,), 50.0, float("nan")) == 2.0
