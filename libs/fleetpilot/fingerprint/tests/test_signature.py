"""Task signatures are stable and selective; signature memory merges and predicts."""

from __future__ import annotations

import msgspec
import pytest
from fleetpilot.contracts import Fingerprint, TaskSubmitted
from fleetpilot.fingerprint import (
    FIT_MIN_RUNS,
    RUN_PEAKS_KEPT,
    SignatureMemory,
    SignatureStats,
    fit_peak,
    load_stats,
    predicts_nothing,
    task_signature,
    within_its_programs_runs,
)

BASE = dict(task_id="t1", kind="finetune", image="reg/clip:1", command=["python", "ft.py"],
            labels={"model": "clip-vit-l"})


@pytest.mark.parametrize("change,same", [
    ({"task_id": "t2", "tenant": "other", "gpus": 4, "labels": {"model": "clip-vit-l", "team": "x"}}, True),
    ({"kind": "train"}, False),
    ({"image": "reg/clip:2"}, False),
    ({"command": ["python", "ft.py", "--big"]}, False),
    ({"labels": {"model": "clip-vit-b"}}, False),
])
def test_signature_fields(change, same):
    a = task_signature(TaskSubmitted(**BASE))
    b = task_signature(TaskSubmitted(**{**BASE, **change}))
    assert (a == b) is same


def test_signature_is_stable_text():
    sig = task_signature(TaskSubmitted(**BASE))
    assert sig.startswith("sig-") and len(sig) == 20
    assert sig == task_signature(TaskSubmitted(**BASE))


def _fp(sig: str, pattern: str, peak: float, conf: float = 0.9) -> Fingerprint:
    return Fingerprint(signature=sig, pattern=pattern, pattern_confidence=conf, growth_rate_mb_per_s=2.0,
                       predicted_peak_mb=peak, peak_low_mb=peak * 0.9, peak_high_mb=peak * 1.1,
                       warmup_s=30.0, time_to_peak_s=100.0)


def test_memory_merges_and_predicts():
    mem = SignatureMemory()
    assert mem.predict("sig-a") is None
    for pattern, peak, conf in [("leak", 10_000, 0.9), ("leak", 12_000, 0.95), ("linear", 11_000, 0.5)]:
        mem.observe(_fp("sig-a", pattern, peak, conf))
    fp = mem.predict("sig-a")
    assert fp.pattern == "leak"
    assert fp.predicted_peak_mb == pytest.approx(11_000)
    assert fp.peak_low_mb <= 10_000 and fp.peak_high_mb >= 12_000
    assert 0.5 < fp.pattern_confidence < 1.0 and fp.samples == 0
    assert mem.predict("sig-b") is None and len(mem) == 1


def test_stats_roundtrip_through_json():
    mem = SignatureMemory()
    mem.observe(_fp("sig-a", "flat", 8_000))
    raw = msgspec.json.encode(mem.stats("sig-a"))
    again = SignatureMemory({"sig-a": msgspec.json.decode(raw, type=SignatureStats)})
    assert again.predict("sig-a") == mem.predict("sig-a")


def test_stats_in_the_units_of_before_per_gpu_memory_are_not_read():
    mem = SignatureMemory()
    mem.observe(_fp("sig-a", "flat", 8_000))
    raw = msgspec.json.encode(mem.stats("sig-a"))
    assert msgspec.json.decode(raw)["memory"] == "per_gpu"
    assert load_stats(raw) == mem.stats("sig-a")
    # As written before 2026-11-30: the same fields, memory summed over the task's GPUs.
    legacy = msgspec.json.decode(raw)
    del legacy["memory"]
    assert load_stats(msgspec.json.encode(legacy)) is None
    for garbage in (b"[1, 2]", b'{"count": 3}', b"not json"):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            load_stats(garbage)


def test_observe_requires_signature():
    with pytest.raises(ValueError):
        SignatureMemory().observe(_fp("", "flat", 1.0))


def test_an_oom_sets_a_floor_that_no_prediction_goes_under():
    mem = SignatureMemory()
    mem.observe_oom("sig-a", 30_000)
    only = mem.predict("sig-a")  # nothing but the OOM is known
    assert (only.pattern, only.pattern_confidence) == ("unknown", 0.0)
    assert only.predicted_peak_mb == only.peak_low_mb == only.peak_high_mb == 30_000
    mem.observe_oom("sig-a", 20_000)  # a smaller kill (a crowded GPU) lowers nothing
    mem.observe(_fp("sig-a", "leak", 24_000))
    fp = mem.predict("sig-a")
    assert fp.pattern == "leak" and fp.predicted_peak_mb == fp.peak_low_mb == 30_000 and fp.peak_high_mb >= 30_000
    mem.observe(_fp("sig-a", "leak", 40_000))
    mem.observe(_fp("sig-a", "leak", 44_000))
    assert mem.predict("sig-a").predicted_peak_mb == pytest.approx((24_000 + 40_000 + 44_000) / 3)
    assert mem.stats("sig-a").count == 3 and mem.stats("sig-a").oom_floor_mb == 30_000


def test_runs_that_ended_without_a_fingerprint_from_their_start_still_say_how_high_it_goes():
    # Every run was moved before it ended (its series begun mid-run), so none was fingerprinted
    # to its end; the peaks of those that ended are known all the same.
    mem = SignatureMemory()
    for peak in (53_000, 55_000, 57_000):
        mem.observe_run_peak("sig-a", peak)
    assert not predicts_nothing(mem.stats("sig-a"))
    fp = mem.predict("sig-a")
    assert (fp.pattern, fp.pattern_confidence) == ("unknown", 0.0)
    assert fp.predicted_peak_mb == pytest.approx(55_000)
    assert fp.peak_low_mb == pytest.approx(51_000) and fp.peak_high_mb == pytest.approx(59_000)  # +-2 sd
    mem.observe_oom("sig-a", 60_000)  # and a run that needed more than 60 GB lifts it there
    assert mem.predict("sig-a").predicted_peak_mb == 60_000


def test_the_runs_spread_says_what_held_all_but_a_few_of_them_once_enough_are_known():
    mem = SignatureMemory()
    mem.observe(_fp("sig-a", "steps", 31_000))
    # A program whose runs nearly all stay under 32 GB, and one in forty goes above it.
    for k in range(FIT_MIN_RUNS - 1):
        mem.observe_run_peak("sig-a", 30_000 + 100 * k)
    assert fit_peak(mem.stats("sig-a")) == 0.0 and mem.predict("sig-a").fit_peak_mb == 0.0  # too few yet
    assert mem.predict("sig-a").run_peaks_mb == ()
    mem.observe_run_peak("sig-a", 34_000)
    # Twenty runs: a 2.5% share allows half a run above it, so none: the most any held.
    assert mem.predict("sig-a").fit_peak_mb == 34_000
    # The whole spread goes with the prediction, in order, for a policy to weigh.
    assert mem.predict("sig-a").run_peaks_mb == (*[30_000.0 + 100 * k for k in range(FIT_MIN_RUNS - 1)], 34_000.0)
    for k in range(20):
        mem.observe_run_peak("sig-a", 29_950 + 50 * k)
    # Forty runs: one may be above, the other 39 held at most 31,800 MB.
    assert mem.predict("sig-a").fit_peak_mb == 31_800
    mem.observe_oom("sig-a", 33_600)  # killed alone on a 32 GB GPU: one more run above it
    assert mem.predict("sig-a").fit_peak_mb == 33_600
    assert mem.stats("sig-a").oom_floor_mb == 33_600 and len(mem.stats("sig-a").run_peaks_mb) == 41


def test_only_the_latest_runs_are_kept_so_a_changed_program_is_judged_by_its_new_runs():
    mem = SignatureMemory()
    mem.observe(_fp("sig-a", "flat", 8_000))
    for _ in range(RUN_PEAKS_KEPT):
        mem.observe_run_peak("sig-a", 40_000)
    for _ in range(RUN_PEAKS_KEPT - 3):
        mem.observe_run_peak("sig-a", 8_000)
    stats = mem.stats("sig-a")
    assert len(stats.run_peaks_mb) == RUN_PEAKS_KEPT and stats.run_peaks_mb[:3] == (40_000,) * 3
    assert fit_peak(stats) == 8_000  # three old runs above, in two hundred: within the share
    mem.observe(_fp("sig-a", "flat", 8_100))  # a fingerprint folded in keeps the runs known
    assert mem.stats("sig-a").run_peaks_mb == stats.run_peaks_mb
    raw = msgspec.json.encode(mem.stats("sig-a"))
    assert load_stats(raw).run_peaks_mb == stats.run_peaks_mb


def test_a_run_folded_is_known_as_learnt_through_later_folds_and_the_record_stays_bounded():
    from fleetpilot.fingerprint import LEARNT_RUNS_KEPT, learnt, mark_learnt, merge, run_key
    fp = Fingerprint(signature="sig-x", pattern="flat", pattern_confidence=0.9, growth_rate_mb_per_s=0.0,
                     predicted_peak_mb=10_000.0, peak_low_mb=9_000.0, peak_high_mb=11_000.0, samples=50)
    first = run_key("t1", 1_000.0)
    stats = mark_learnt(merge(SignatureStats(signature="sig-x"), fp), first)
    # A later run's fold (``merge`` builds the statistics anew) must not forget the first.
    stats = merge(stats, fp)
    assert learnt(stats, first) and not learnt(stats, run_key("t1", 2_000.0))  # a retry is another run
    assert run_key("t1", 1_000.0) == first and len(first) == 16
    for i in range(LEARNT_RUNS_KEPT):
        stats = mark_learnt(stats, run_key(f"t{i + 2}", 1_000.0))
    assert len(stats.learnt_runs) == LEARNT_RUNS_KEPT and not learnt(stats, first)
    # Statistics written before the record read as no run learnt.
    old = msgspec.json.encode({"memory": "per_gpu", "signature": "sig-x", "count": 3})
    assert load_stats(old).learnt_runs == ()


@pytest.mark.parametrize(
    ("pattern", "peaks", "held", "expected"),
    [
        # Runs of the program peaked at 34-36 GB: a step fit reading 42 GB is held to 36 GB + 5%.
        ("steps", (34_000.0, 35_000.0, 36_000.0), 30_000.0, 37_800.0),
        # ... never below what the run holds already.
        ("steps", (34_000.0, 35_000.0, 36_000.0), 39_000.0, 39_000.0),
        # Two known runs are not enough to say where the program tops out.
        ("steps", (34_000.0, 36_000.0), 30_000.0, 42_000.0),
        # A line's or a leak's peak grows with its run's length: left as it is.
        ("linear", (34_000.0, 35_000.0, 36_000.0), 30_000.0, 42_000.0),
        ("leak", (34_000.0, 35_000.0, 36_000.0), 30_000.0, 42_000.0),
    ],
)
def test_a_runs_own_step_fit_is_held_to_what_its_programs_runs_reached(pattern, peaks, held, expected):
    own = _fp("sig-s", pattern, 42_000.0)
    stats = SignatureStats(signature="sig-s", run_peaks_mb=peaks)
    bounded = within_its_programs_runs(own, stats, held)
    assert bounded.predicted_peak_mb == pytest.approx(expected)
    assert bounded.peak_low_mb <= bounded.predicted_peak_mb <= bounded.peak_high_mb
    assert bounded.peak_high_mb == pytest.approx(expected if expected < 42_000.0 else own.peak_high_mb)


def test_a_step_fit_below_its_programs_runs_or_of_an_unknown_program_is_left_as_it_is():
    own = _fp("sig-s", "steps", 30_000.0)
    assert within_its_programs_runs(own, SignatureStats(signature="sig-s", run_peaks_mb=(34_000.0,) * 3), 0.0) is own
    assert within_its_programs_runs(_fp("sig-s", "steps", 42_000.0), None, 0.0).predicted_peak_mb == 42_000.0
