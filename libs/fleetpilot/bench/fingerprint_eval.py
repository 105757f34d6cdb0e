"""How well the fingerprinter recognises growth patterns and predicts peaks, on ground truth.

Series come from ``workload.growth.random_growth`` (noise included), one pattern per seed in
turn, sampled every 5-10 s (drawn per series) from the task's start. The task's duration
is known to the predictor, as it is when a submission carries ``expected_duration_s``.

Tuning and evaluation never share seeds: the shape margins in ``fingerprint.analysis`` and
the :class:`~fleetpilot.fingerprint.LevelPrior` were chosen on training seeds
``0..train-1``; this script refits the level prior on those same training seeds and then
reports on evaluation seeds starting at ``EVAL_SEED_BASE``.

Run: ``python -m fleetpilot.bench.fingerprint_eval [--train 400] [--test 500]``.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from fleetpilot.fingerprint.analysis import LevelPrior, analyse_series
from fleetpilot.workload.growth import GROWTH_PATTERNS, MemoryGrowth, random_growth

EVAL_SEED_BASE = 1_000_000
FRACTIONS = (0.10, 0.25, 0.50, 1.0)
BLIND_FRACTIONS = (0.10, 0.25, 0.75)


@dataclass(frozen=True)
class Series:
    """One ground-truth curve and its noisy samples."""

    growth: MemoryGrowth
    t: np.ndarray
    used_mb: np.ndarray


@dataclass(frozen=True)
class Trial:
    """The outcome of fingerprinting one series cut at one fraction of its life."""

    pattern: str
    predicted: str
    fraction: float
    true_peak: float
    predicted_peak: float
    baseline_peak: float
    low: float
    high: float
    confidence: float = 0.0


def make_series(seed: int) -> Series:
    """The series of ``seed``: pattern ``seed % 5``, sampling interval uniform in 5-10 s."""
    rng = np.random.default_rng(seed)
    growth = random_growth(rng, GROWTH_PATTERNS[seed % len(GROWTH_PATTERNS)])
    dt = float(rng.uniform(5.0, 10.0))
    t = np.arange(0.0, growth.duration_s + 1e-9, dt)
    return Series(growth=growth, t=t, used_mb=growth.memory_at(t, rng))


def run_trials(seeds: range, prior: LevelPrior, fractions: tuple[float, ...] = FRACTIONS,
               duration_known: bool = True) -> list[Trial]:
    """Fingerprint every seed's series at every fraction of its life."""
    trials: list[Trial] = []
    for seed in seeds:
        s = make_series(seed)
        for frac in fractions:
            mask = s.t <= frac * s.growth.duration_s + 1e-9
            duration = s.growth.duration_s if duration_known else None
            a = analyse_series(s.t[mask], s.used_mb[mask], expected_duration_s=duration, prior=prior)
            fp = a.fingerprint
            trials.append(Trial(pattern=s.growth.pattern, predicted=fp.pattern, fraction=frac,
                                true_peak=s.growth.true_peak_mb, predicted_peak=fp.predicted_peak_mb,
                                baseline_peak=float(s.used_mb[mask].max()), low=fp.peak_low_mb,
                                high=fp.peak_high_mb, confidence=fp.pattern_confidence))
    return trials


def fit_level_prior(seeds: range) -> LevelPrior:
    """Median and 10/90th percentiles of true peak / held level, for series with no growth yet.

    Runs the analysis with a unit prior, so a "first level" reading predicts the level
    itself; the ratio of the true peak to it is what the prior must supply.
    """
    unit = LevelPrior(ratio=1.0, low_ratio=1.0, high_ratio=1.0)
    ratios: list[float] = []
    for seed in seeds:
        s = make_series(seed)
        for frac in (0.10, 0.25):
            mask = s.t <= frac * s.growth.duration_s + 1e-9
            a = analyse_series(s.t[mask], s.used_mb[mask], expected_duration_s=s.growth.duration_s, prior=unit)
            if any("first level" in note for note in a.notes):
                ratios.append(s.growth.true_peak_mb / a.fingerprint.predicted_peak_mb)
    if not ratios:
        return LevelPrior()
    r = np.asarray(ratios)
    return LevelPrior(ratio=float(np.median(r)), low_ratio=float(np.percentile(r, 10)),
                      high_ratio=float(np.percentile(r, 90)))


def _accuracy_rows(trials: list[Trial]) -> list[str]:
    rows = ["pattern accuracy (share classified right)",
            f"  {'fraction':>8} {'all':>6} " + " ".join(f"{p:>8}" for p in GROWTH_PATTERNS)]
    for frac in FRACTIONS:
        sub = [x for x in trials if x.fraction == frac]
        cells = []
        for p in GROWTH_PATTERNS:
            ps = [x for x in sub if x.pattern == p]
            cells.append(f"{np.mean([x.predicted == p for x in ps]):8.3f}")
        rows.append(f"  {frac:8.2f} {np.mean([x.predicted == x.pattern for x in sub]):6.3f} " + " ".join(cells))
    return rows


def _confusion_rows(trials: list[Trial], frac: float) -> list[str]:
    sub = [x for x in trials if x.fraction == frac]
    labels = [*GROWTH_PATTERNS, "unknown"]
    counts = Counter((x.pattern, x.predicted) for x in sub)
    rows = [f"confusion at {frac:.0%} of life (rows: truth, columns: predicted)",
            f"  {'':>9}" + "".join(f"{p:>9}" for p in labels)]
    for p in GROWTH_PATTERNS:
        rows.append(f"  {p:>9}" + "".join(f"{counts[(p, q)]:9d}" for q in labels))
    return rows


def _calibration_rows(trials: list[Trial]) -> list[str]:
    rows = ["pattern confidence vs accuracy (is the confidence honest?)",
            f"  {'fraction':>8} {'confidence':>12} {'n':>5} {'accuracy':>9}"]
    bins = [(0.0, 0.6), (0.6, 0.9), (0.9, 0.99), (0.99, 1.01)]
    for frac in (0.10, 0.25, 0.50):
        for lo, hi in bins:
            group = [x for x in trials if x.fraction == frac and lo <= x.confidence < hi]
            if group:
                acc = np.mean([x.predicted == x.pattern for x in group])
                rows.append(f"  {frac:8.2f} {f'{lo:.2f}-{min(hi, 1.0):.2f}':>12} {len(group):5d} {acc:9.3f}")
    return rows


def _peak_rows(trials: list[Trial], title: str = "duration known",
               fractions: tuple[float, ...] = (0.10, 0.25, 0.50)) -> list[str]:
    rows = [f"peak prediction ({title}): median absolute error, model vs baseline 'peak so far'",
            f"  {'fraction':>8} {'pattern':>9} {'model MB':>10} {'model %':>8} {'base MB':>10} {'base %':>8}"
            f" {'ratio':>6} {'covered':>8}"]
    for frac in fractions:
        sub = [x for x in trials if x.fraction == frac]
        groups: dict[str, list[Trial]] = defaultdict(list)
        for x in sub:
            groups[x.pattern].append(x)
        for name, group in [("all", sub), *((p, groups[p]) for p in GROWTH_PATTERNS)]:
            model = np.array([abs(x.predicted_peak - x.true_peak) for x in group])
            base = np.array([abs(x.baseline_peak - x.true_peak) for x in group])
            model_pct = np.array([abs(x.predicted_peak - x.true_peak) / x.true_peak for x in group]) * 100
            base_pct = np.array([abs(x.baseline_peak - x.true_peak) / x.true_peak for x in group]) * 100
            covered = np.mean([x.low <= x.true_peak <= x.high for x in group])
            ratio = np.median(model) / max(np.median(base), 1e-9)
            rows.append(f"  {frac:8.2f} {name:>9} {np.median(model):10.0f} {np.median(model_pct):8.2f}"
                        f" {np.median(base):10.0f} {np.median(base_pct):8.2f} {ratio:6.3f} {covered:8.3f}")
    return rows


def evaluate(train: int = 400, test: int = 500) -> list[str]:
    """Fit the level prior on ``train`` seeds, evaluate on ``test`` others; the report lines."""
    started = time.perf_counter()
    prior = fit_level_prior(range(train))
    trials = run_trials(range(EVAL_SEED_BASE, EVAL_SEED_BASE + test), prior)
    blind = run_trials(range(EVAL_SEED_BASE, EVAL_SEED_BASE + test), prior, fractions=BLIND_FRACTIONS,
                       duration_known=False)
    elapsed = time.perf_counter() - started
    acc25 = np.mean([x.predicted == x.pattern for x in trials if x.fraction == 0.25])
    acc50 = np.mean([x.predicted == x.pattern for x in trials if x.fraction == 0.5])
    sub25 = [x for x in trials if x.fraction == 0.25]
    ratio25 = (np.median([abs(x.predicted_peak - x.true_peak) for x in sub25])
               / np.median([abs(x.baseline_peak - x.true_peak) for x in sub25]))
    lines = [
        f"fingerprint evaluation: tuned on seeds 0..{train - 1}, evaluated on seeds "
        f"{EVAL_SEED_BASE}..{EVAL_SEED_BASE + test - 1} ({test} series, {test // 5} per pattern), "
        f"sampled every 5-10 s, duration known",
        f"level prior fitted on training seeds: ratio {prior.ratio:.2f} "
        f"(interval {prior.low_ratio:.2f}..{prior.high_ratio:.2f})",
        "",
        *_accuracy_rows(trials),
        "",
        *_confusion_rows(trials, 0.25),
        "",
        *_confusion_rows(trials, 1.0),
        "",
        *_calibration_rows(trials),
        "",
        *_peak_rows(trials),
        "",
        *_peak_rows(blind, "duration unknown: horizon twice the age", BLIND_FRACTIONS),
        "  (50% is left out here: a horizon of twice the age is exactly the true end there, which flatters)",
        "",
        f"targets: accuracy >= 0.95 at 25%: {acc25:.3f} {'MET' if acc25 >= 0.95 else 'MISSED'}; "
        f"at 50%: {acc50:.3f} {'MET' if acc50 >= 0.95 else 'MISSED'}; "
        f"median peak error at 25% <= 0.5 x baseline: {ratio25:.3f} x {'MET' if ratio25 <= 0.5 else 'MISSED'}",
        f"({len(trials) + len(blind)} fingerprints in {elapsed:.1f} s)",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    """Print the evaluation table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=400, help="training seeds 0..N-1")
    parser.add_argument("--test", type=int, default=500, help="evaluation series")
    args = parser.parse_args(argv)
    print("\n".join(evaluate(args.train, args.test)))


if __name__ == "__main__":
    main()
