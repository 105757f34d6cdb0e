"""From a memory series to a fingerprint: growth pattern, predicted peak, warm-up, behaviour.

How it works (see README.md in this folder):

1. The noise level comes from the robust spread of second differences, which no growth
   shape disturbs (:func:`fleetpilot.fingerprint.curves.noise_sd`).
2. A sharp drop (more than 30% of the range and eight noise deviations) makes the series a
   sawtooth. Otherwise each remaining shape is fitted — one level, a ramp that ends in a
   plateau (flat), a line (linear), an upward parabola (leak), piecewise-constant levels
   (steps) — and scored ``RSS / sigma^2 + k ln n``; the lowest score wins and the
   normalised likelihoods ``exp(-score / 2)`` give the confidence.
3. The winning shape is extrapolated to the end of the task's life (``expected_duration_s``)
   for the predicted peak. Without a duration the horizon is twice the task's age (a task
   that has run ``t`` seconds is, without other knowledge, as likely as not to run ``t``
   more), the interval's upper end reaches four times its age and its lower end is what the
   task holds now; a run known to have ended (``ended``) ended at its last sample. Shapes that are nearly as
   likely as the winner widen the interval to cover their own predictions.

A series that has held one level since its first sample has shown no growth yet. Flat
tasks ramp while they load, so such a series is read as the first level of a step
schedule, with low confidence, and its peak comes from :class:`LevelPrior` — unless the
series reaches the task's known end of life (no further sample would fit before it, as
when a finished run is fingerprinted with its real duration): then the level was its
peak, and the pattern is flat; so it is when the run is known to have ended (``ended``,
whatever it declared). Likewise the peak of a growing series that reaches its end
is the most it held plus the growth of the final gap, not the fitted curve carried to
the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from fleetpilot.contracts import Fingerprint, GrowthPattern
from fleetpilot.least_squares import exact_dot, fit_straight_line

from .curves import (
    HingeFit,
    LevelFit,
    LineFit,
    QuadFit,
    StepFit,
    ToothFit,
    fit_accel,
    fit_hinge,
    fit_level,
    fit_line,
    fit_quad,
    fit_steps,
    fit_teeth,
    noise_sd,
)

# Fewest samples that carry a shape; below this only a level is reported.
MIN_SAMPLES = 6
# Two-sided ~99% normal quantile for the statistical part of an interval.
_Z = 2.6
# Alternatives at least this likely (relative weight) widen the interval.
_ALTERNATIVE_WEIGHT = 0.05
# Extra evidence (in score units, like a prior log-odds of 2) a leak with a free starting
# rate needs over a line:
# fitted on training seeds, where chance curvature in straight lines is common enough to
# cost accuracy without it.
LEAK_MARGIN = 4.0
# Confidence of "steps" read from a level that has not stepped yet.
_FIRST_LEVEL_CONFIDENCE = 0.55
LONGEST_LIFE_S = 1e9
"""The longest life a task may declare (about 32 years): a longer one is garbled (an epoch time
given as a duration, say), and read as no declared life (``declared_life``)."""


def declared_life(expected_duration_s: float | None) -> float | None:
    """``expected_duration_s`` as a life a fit may be carried to, ``None`` when it says nothing:
    none declared, or not a number of seconds a task can live (zero or negative, infinite,
    NaN, beyond ``LONGEST_LIFE_S``). Taken as they came, an infinite or huge one made every
    fit of the task raise (infinities in its sums: no fingerprint, every sample dead-lettered)
    or predict a peak no GPU holds, and a NaN one cut the run's envelope at no time."""
    if expected_duration_s is None or not 0.0 < expected_duration_s <= LONGEST_LIFE_S:
        return None
    return float(expected_duration_s)


@dataclass(frozen=True)
class LevelPrior:
    """Peak of a task that has shown no growth yet, as a multiple of its current level.

    Defaults were fitted on training seeds 0..399 of ``workload.growth.random_growth``
    by ``bench.fingerprint_eval`` (median and 10th/90th percentiles of true peak / level
    for series that still hold their first level); they are never fitted on the
    evaluation seeds. A known signature replaces them with its own history.
    """

    ratio: float = 1.99
    low_ratio: float = 1.63
    high_ratio: float = 2.64


@dataclass(frozen=True)
class SeriesAnalysis:
    """A fingerprint plus what the contract has no field for: notes and the fit's evidence."""

    fingerprint: Fingerprint
    notes: tuple[str, ...] = ()
    weights: dict[str, float] = field(default_factory=dict)
    noise_mb: float = 0.0
    observed_peak_mb: float = 0.0


@dataclass(frozen=True)
class _Candidate:
    key: str
    pattern: GrowthPattern
    score: float
    peak: float
    low: float
    high: float
    growth: float
    time_to_peak: float | None
    warmup: float


def burstiness(utilisation: np.ndarray | list[float]) -> float:
    """How bursty a utilisation series is, in ``[0, 1)``: ``sd / (sd + mean)``.

    0 is perfectly steady; 0.5 means the spread equals the mean; it nears 1 for rare spikes
    over idleness. This is the Goh-Barabasi burstiness ``(sd - mean) / (sd + mean)`` moved
    onto ``[0, 1)``.
    """
    u = np.asarray(utilisation, dtype=np.float64)
    if u.size < 2:
        return 0.0
    mean, sd = float(np.mean(u)), float(np.std(u))
    return 0.0 if sd + mean <= 0 else sd / (sd + mean)


def context_switch_sensitivity(utilisation: np.ndarray | list[float],
                               colocated: np.ndarray | list[float]) -> float | None:
    """Relative utilisation lost per extra co-located process, in ``[0, 1]``.

    A line ``u = a + b * n`` is fitted to utilisation against the count of processes
    sharing the GPU; the sensitivity is ``-b / a`` (the share of solo utilisation lost for
    each neighbour), clipped to ``[0, 1]``. ``None`` when the count never varies.
    """
    u = np.asarray(utilisation, dtype=np.float64)
    n = np.asarray(colocated, dtype=np.float64)
    if u.size != n.size or u.size < 3 or float(np.ptp(n)) == 0.0:
        return None
    line = fit_straight_line(n, u)
    slope, icpt = line.slope, line.intercept
    solo = icpt + slope * float(n.min())
    if solo <= 0:
        return None
    return float(np.clip(-slope / solo, 0.0, 1.0))


def _score(rss: float, k: int, n: int, sigma: float) -> float:
    return rss / (sigma * sigma) + k * math.log(n)


def _horizon(now: float, duration: float | None) -> tuple[float, float]:
    """(predicted end of life, far end for the interval's upper bound)."""
    if duration is not None and duration > 0:
        end = max(duration, now)
        return end, end
    return 2.0 * now, 4.0 * now


def _line_candidate(fit: LineFit, n: int, sigma: float, now: float, end: float, far: float) -> _Candidate:
    peak = fit.at(end)
    se = fit.se_at(end, sigma)
    return _Candidate("linear", "linear", _score(fit.rss, fit.n_params, n, sigma), peak,
                      peak - _Z * se - 2 * sigma, max(fit.at(far), peak) + _Z * se + 2 * sigma,
                      fit.slope, max(end - now, 0.0), 0.0)


def _quad_candidate(fit: QuadFit, n: int, sigma: float, now: float, end: float, far: float) -> _Candidate:
    peak = fit.at(end)
    se = fit.se_at(end, sigma)
    margin = LEAK_MARGIN if fit.n_params > 2 else 0.0
    return _Candidate("leak", "leak", _score(fit.rss, fit.n_params, n, sigma) + margin, peak,
                      peak - _Z * se - 2 * sigma, max(fit.at(far), peak) + _Z * se + 2 * sigma,
                      fit.b + 2 * fit.c * now, max(end - now, 0.0), 0.0)


def _hinge_candidate(fit: HingeFit, n: int, sigma: float, now: float) -> _Candidate:
    margin = _Z * sigma / math.sqrt(max(fit.n_plateau, 1)) + 2 * sigma
    return _Candidate("flat", "flat", _score(fit.rss, fit.n_params, n, sigma), fit.plateau,
                      fit.plateau - margin, fit.plateau + margin, 0.0, 0.0, fit.knee_s)


def _steps_candidate(fit: StepFit, n: int, sigma: float, now: float, end: float, far: float,
                     known_end: bool) -> _Candidate:
    m = len(fit.change_s)
    jumps = np.diff(fit.levels)
    height = float(np.mean(jumps))
    ks = np.arange(1, m + 1, dtype=np.float64)
    # The first level starts with the task, so the k-th change lands near k step lengths.
    period = exact_dot(ks, np.asarray(fit.change_s)) / exact_dot(ks, ks)
    last = fit.levels[-1]
    total = max(end / period, m + 1.0) if period > 0 else m + 1.0
    n_levels = max(round(total), m + 1)
    peak = last + height * (n_levels - (m + 1))
    # A step count within a third of a level of a half-integer could round either way.
    ambiguous = abs(total - math.floor(total) - 0.5) < 0.35
    spread = float(np.std(jumps)) if m > 1 else 0.25 * height
    low = peak - (height if ambiguous else 0.0) - spread - 2 * sigma
    far_levels = max(math.floor(far / period) if period > 0 else m + 1, n_levels)
    high = last + height * (far_levels - (m + 1)) + (height if ambiguous or not known_end else 0.0)
    high += spread + 2 * sigma
    ttp = max((n_levels - 1) * period - now, 0.0)
    return _Candidate("steps", "steps", _score(fit.rss, fit.n_params, n, sigma), peak, low, high,
                      height / period if period > 0 else 0.0, ttp, 0.0)


def _teeth_candidate(fit: ToothFit, sigma: float, now: float) -> _Candidate:
    tops = np.asarray(fit.tops)
    peak = float(np.median(tops))
    low = float(tops.min()) - 2 * sigma
    high = float(tops.max()) + 2 * sigma
    drops = np.asarray((0.0, *fit.drop_s))
    period = float(np.median(np.diff(drops)))
    # The first drop after now, counted in whole periods, not stepped to: teeth of no length
    # (readings stamped alike, drops microseconds apart) made a step of nothing, and the
    # fitting thread, every task's, looped for ever.
    ahead = now - fit.drop_s[-1]
    # The least whole number of periods after the last drop that reaches now, one at least.
    periods = max(math.ceil(ahead / period), 1) if period > 0 and math.isfinite(ahead / period) else 1
    next_drop = fit.drop_s[-1] + periods * period if period > 0 else now
    return _Candidate("sawtooth", "sawtooth", 0.0, peak, low, high, fit.slope, max(next_drop - now, 0.0), 0.0)


def _level_candidate(fit: LevelFit, n: int, sigma: float, prior: LevelPrior, *, lived: bool = False) -> _Candidate:
    score = _score(fit.rss, fit.n_params, n, sigma)
    if lived:
        # The whole known life at one level: nothing is left to step up to.
        return _Candidate("held", "flat", score, fit.level, fit.level - 2 * sigma, fit.level + 2 * sigma,
                          0.0, None, 0.0)
    return _Candidate("level", "steps", score, fit.level * prior.ratio,
                      max(fit.level * prior.low_ratio, fit.level - 2 * sigma),
                      fit.level * prior.high_ratio, 0.0, None, 0.0)


def analyse_series(t_s: np.ndarray | list[float], used_mb: np.ndarray | list[float], *,
                   signature: str = "", expected_duration_s: float | None = None,
                   utilisation: np.ndarray | list[float] | None = None,
                   colocated: np.ndarray | list[float] | None = None,
                   prior: LevelPrior | None = None, ended: bool = False) -> SeriesAnalysis:
    """Fingerprint a memory series (``t_s``: seconds since the task started, ``used_mb``: MB).

    ``ended``: the run is over, so a level held from the first sample to the last is its
    peak (flat), not the first level of a step schedule that may still step up.

    ``expected_duration_s`` is the task's whole life when known; the peak is then the
    fitted shape at end of life (one that is no life, ``declared_life``, is not known).
    ``utilisation`` (0..1 or percent, one per sample or any length) gives burstiness; with
    ``colocated`` (process count sharing the GPU, aligned with ``utilisation``) it gives the
    context-switch sensitivity.
    Raises ``ValueError`` for an empty series, mismatched lengths, or a time or memory value
    that is not a finite number.
    """
    t = np.asarray(t_s, dtype=np.float64)
    y = np.asarray(used_mb, dtype=np.float64)
    expected_duration_s = declared_life(expected_duration_s)
    if t.size == 0 or t.size != y.size:
        raise ValueError(f"need matching, non-empty series (got {t.size} times, {y.size} values)")
    if not (np.isfinite(t).all() and np.isfinite(y).all()):
        # One NaN (a sensor's failed reading) would make every figure of the fingerprint NaN.
        bad = int(np.flatnonzero(~(np.isfinite(t) & np.isfinite(y)))[0])
        raise ValueError(f"sample {bad} is not a number (time {t[bad]:g}, memory {y[bad]:g})")
    order = np.argsort(t, kind="stable")
    t, y = t[order], y[order]
    prior = prior or LevelPrior()
    notes: list[str] = []
    n = t.size
    now = float(t[-1])
    sigma = noise_sd(y)
    end, far = _horizon(now, expected_duration_s)
    known_end = expected_duration_s is not None and expected_duration_s > 0
    # The series reaches the known end of life when no further sample would fit before it
    # (a finished run fingerprinted with its real duration): a level held so far is final.
    interval = float(np.median(np.diff(t))) if n >= 2 else 0.0
    lived = known_end and end - now <= interval
    if ended and not known_end:
        # A run that ended without a declared life ended at its last sample (within one
        # interval): nothing is carried past it, not to twice its age.
        end = far = now
        lived = True
        notes.append("ended without an expected duration: its life ended at the last sample")
    elif not known_end:
        notes.append("no expected duration: horizon is twice the task's age, interval reaches 4x its age")
    # A level to the last sample of a run that ended, or to the end of its known life, was final.
    held = lived or ended

    candidates: list[_Candidate] = []
    if n < MIN_SAMPLES:
        notes.append(f"only {n} samples: too few for a shape, reporting the level")
        fit = fit_level(t, y)
        level = _level_candidate(fit, n, sigma, prior, lived=held)
        # Too few samples to trust even "no growth yet": the peak may be the level itself.
        candidates.append(replace(level, key="unknown", pattern="unknown", low=fit.level - 2 * sigma))
    else:
        teeth = fit_teeth(t, y, sigma)
        if teeth is not None and teeth.tops:
            candidates.append(_teeth_candidate(teeth, sigma, now))
        else:
            fits = _shape_fits(t, y, sigma)
            # Score with the noise the best shape leaves behind: the difference-based
            # estimate is robust but noisy, and a 15% error in sigma doubles a small gap.
            fitted = min(f.rss / max(n - f.n_params, 1) for f in fits)
            sigma = max(math.sqrt(fitted), 5e-4 * float(np.median(np.abs(y))) + 1e-6)
            candidates.extend(_shape_candidates(fits, n, sigma, now, end, far, known_end, prior, held))
    weights = _weights(candidates)
    best = candidates[int(np.argmax([weights[i] for i in range(len(candidates))]))]
    confidence = weights[candidates.index(best)]
    low, high = best.low, best.high
    for i, cand in enumerate(candidates):
        if cand is not best and weights[i] >= _ALTERNATIVE_WEIGHT:
            low, high = min(low, cand.low), max(high, cand.high)
    if best.key == "level":
        confidence = min(confidence, _FIRST_LEVEL_CONFIDENCE)
        notes.append("one level since the first sample: read as a step schedule's first level; peak from prior")
    elif best.key == "held":
        notes.append("one level for the whole known life: flat at that level")
    if lived and best.key in ("linear", "leak", "steps"):
        # A finished run peaked at the most it held plus the growth of the unobserved final
        # gap, not where a fitted curve carried to the end lands: a line through a staircase,
        # say, ends half a step above the last level the run ever held. The gap gets the
        # growth the run last showed, if slower than the fit's: a staircase that reached its
        # last level is not climbing any more.
        last = (y[-1] - y[-2]) / (t[-1] - t[-2]) if n >= 2 and t[-1] > t[-2] else best.growth
        reached = float(y.max()) + max(min(best.growth, float(last)), 0.0) * (end - now)
        best = replace(best, peak=min(best.peak, reached))
    # The noiseless peak cannot be below what the task already holds.
    floor = _held_level(y, sigma)
    peak = max(best.peak, floor)
    low = min(max(low, floor - 2 * sigma), peak)
    if not known_end:
        # Without a known end the task may stop any moment: what it holds now is a possible peak.
        low = min(low, max(floor, 0.0))
    high = max(high, peak)

    burst = 0.0
    sensitivity = 0.0
    if utilisation is not None and len(utilisation) > 0:
        burst = burstiness(utilisation)
        if colocated is not None:
            s = context_switch_sensitivity(utilisation, colocated)
            if s is None:
                notes.append("co-located count never varied: context-switch sensitivity unknown (0)")
            else:
                sensitivity = s
        else:
            notes.append("no co-location series: context-switch sensitivity unknown (0)")
    else:
        notes.append("no utilisation series: burstiness and context-switch sensitivity unknown (0)")

    fp = Fingerprint(
        signature=signature,
        pattern=best.pattern,
        pattern_confidence=round(float(confidence), 4),
        growth_rate_mb_per_s=float(best.growth),
        predicted_peak_mb=float(peak),
        peak_low_mb=float(max(low, 0.0)),
        peak_high_mb=float(high),
        time_to_peak_s=best.time_to_peak,
        warmup_s=float(best.warmup),
        burstiness=float(burst),
        context_switch_sensitivity=float(sensitivity),
        samples=int(n),
    )
    return SeriesAnalysis(fingerprint=fp, notes=tuple(notes),
                          weights={c.key: float(weights[i]) for i, c in enumerate(candidates)},
                          noise_mb=float(sigma), observed_peak_mb=float(y.max()))


def fingerprint_series(t_s: np.ndarray | list[float], used_mb: np.ndarray | list[float], *,
                       signature: str = "", expected_duration_s: float | None = None,
                       utilisation: np.ndarray | list[float] | None = None,
                       colocated: np.ndarray | list[float] | None = None,
                       prior: LevelPrior | None = None) -> Fingerprint:
    """The :class:`~fleetpilot.contracts.Fingerprint` of a series; see :func:`analyse_series`."""
    return analyse_series(t_s, used_mb, signature=signature, expected_duration_s=expected_duration_s,
                          utilisation=utilisation, colocated=colocated, prior=prior).fingerprint


def _held_level(y: np.ndarray, sigma: float) -> float:
    """The level the task surely reached: a high quantile of the series, less the noise."""
    return float(np.percentile(y, 95)) - 2.0 * sigma


_Fit = LevelFit | LineFit | QuadFit | HingeFit | StepFit


def _shape_fits(t: np.ndarray, y: np.ndarray, sigma: float) -> list[_Fit]:
    """Every non-sawtooth shape that is admissible for this series."""
    out: list[_Fit] = [fit_level(t, y)]
    line = fit_line(t, y)
    if line.slope > 0:
        out.append(line)
    quad = fit_quad(t, y)
    # A leak accelerates: upward curvature, and not a line that merely bends at its start.
    if quad.c > 0 and quad.b > -quad.c * float(t[-1]):
        out.append(quad)
    accel = fit_accel(t, y)
    if accel.c > 0:
        out.append(accel)
    hinge = fit_hinge(t, y)
    if hinge is not None and hinge.slope > 0:
        out.append(hinge)
    steps = fit_steps(t, y, sigma)
    jumps = np.diff(steps.levels)
    # A single jump in the first samples is a warm-up (flat), not a schedule of steps.
    if steps.change_s and np.all(jumps > 0) and (steps.first_len >= 3 or len(steps.change_s) >= 2):
        out.append(steps)
    return out


def _shape_candidates(fits: list[_Fit], n: int, sigma: float, now: float, end: float, far: float,
                      known_end: bool, prior: LevelPrior, held: bool) -> list[_Candidate]:
    out: list[_Candidate] = []
    for fit in fits:
        if isinstance(fit, LevelFit):
            out.append(_level_candidate(fit, n, sigma, prior, lived=held))
        elif isinstance(fit, LineFit):
            out.append(_line_candidate(fit, n, sigma, now, end, far))
        elif isinstance(fit, QuadFit):
            out.append(_quad_candidate(fit, n, sigma, now, end, far))
        elif isinstance(fit, HingeFit):
            out.append(_hinge_candidate(fit, n, sigma, now))
        else:
            out.append(_steps_candidate(fit, n, sigma, now, end, far, known_end))
    return out


def _weights(candidates: list[_Candidate]) -> dict[int, float]:
    scores = np.array([c.score for c in candidates])
    w = np.exp(-0.5 * (scores - scores.min()))
    w = w / w.sum()
    return {i: float(w[i]) for i in range(len(candidates))}
