"""Candidate curve fits for one task's memory series.

Each fit explains the series with one growth shape and reports its residual sum of squares
(RSS) and parameter count, so that :mod:`fleetpilot.fingerprint.analysis` can choose between
them with a BIC-like score against a noise level estimated independently of any shape.
All fits are vectorised over the samples with cumulative sums: a 1,500-sample series fits
in about a millisecond, which keeps the online fingerprinter cheap to refit. The
least-squares fits sum with ``fleetpilot.least_squares`` rather than numpy's BLAS, so a
fingerprint is the same whichever CPU computed it.

Times are seconds since the task started; memory is MB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fleetpilot.least_squares import fit_columns, fit_straight_line, quadratic_form

# Robust-scale constant: MAD * 1.4826 estimates a normal standard deviation.
_MAD_TO_SD = 1.4826


def noise_sd(used_mb: np.ndarray) -> float:
    """Noise standard deviation (MB) from second differences, blind to the growth shape.

    Second differences cancel constants and straight lines and turn a parabola into a
    constant, so their robust spread is the sample noise whatever the pattern; the jumps of
    steps and the drops of a sawtooth are rare outliers that the median absolute deviation
    ignores. A floor of 0.05% of the level keeps a noiseless series from scoring every
    tiny misfit as infinitely unlikely.
    """
    y = np.asarray(used_mb, dtype=np.float64)
    floor = 5e-4 * float(np.median(np.abs(y))) + 1e-6 if y.size else 1e-6
    if y.size < 4:
        return floor
    dd = y[2:] - 2.0 * y[1:-1] + y[:-2]
    mad = float(np.median(np.abs(dd - np.median(dd))))
    return max(_MAD_TO_SD * mad / np.sqrt(6.0), floor)


@dataclass(frozen=True)
class LevelFit:
    """One constant level: no growth seen yet."""

    level: float
    rss: float
    n_params: int = 1


@dataclass(frozen=True)
class LineFit:
    """A straight line ``intercept + slope * t`` with its parameter covariance per unit noise."""

    intercept: float
    slope: float
    rss: float
    xtx_inv: np.ndarray
    n_params: int = 2

    def at(self, t: float) -> float:
        """Fitted memory (MB) at ``t`` seconds."""
        return self.intercept + self.slope * t

    def se_at(self, t: float, sigma: float) -> float:
        """Standard error (MB) of the fitted value at ``t`` given noise ``sigma``."""
        return float(sigma * math.sqrt(max(quadratic_form((1.0, t), self.xtx_inv), 0.0)))


@dataclass(frozen=True)
class QuadFit:
    """A parabola ``a + b t + c t^2`` (a leak when ``c > 0``) with its covariance per unit noise."""

    a: float
    b: float
    c: float
    rss: float
    xtx_inv: np.ndarray
    scale_s: float
    n_params: int = 3

    def at(self, t: float) -> float:
        """Fitted memory (MB) at ``t`` seconds."""
        return self.a + self.b * t + self.c * t * t

    def se_at(self, t: float, sigma: float) -> float:
        """Standard error (MB) of the fitted value at ``t`` given noise ``sigma``."""
        u = t / self.scale_s
        return float(sigma * math.sqrt(max(quadratic_form((1.0, u, u * u), self.xtx_inv), 0.0)))


@dataclass(frozen=True)
class HingeFit:
    """A warm-up ramp that ends in a plateau: ``base + slope * min(t, knee_s)``."""

    base: float
    slope: float
    knee_s: float
    rss: float
    n_plateau: int
    n_params: int = 3

    @property
    def plateau(self) -> float:
        """The plateau level (MB) reached at the knee."""
        return self.base + self.slope * self.knee_s


@dataclass(frozen=True)
class StepFit:
    """Piecewise-constant levels; ``change_s[i]`` is when ``levels[i + 1]`` began."""

    levels: tuple[float, ...]
    change_s: tuple[float, ...]
    first_len: int
    rss: float

    @property
    def n_params(self) -> int:
        """One parameter per level and one per change time."""
        return 2 * len(self.change_s) + 1


@dataclass(frozen=True)
class ToothFit:
    """A sawtooth: ramps that drop back at ``drop_s``; ``tops`` are the complete teeth's crests."""

    drop_s: tuple[float, ...]
    tops: tuple[float, ...]
    slope: float
    rss: float
    n_params: int


def fit_level(t: np.ndarray, y: np.ndarray) -> LevelFit:
    """The best constant: the mean."""
    level = float(np.mean(y))
    return LevelFit(level=level, rss=float(np.sum((y - level) ** 2)))


def fit_line(t: np.ndarray, y: np.ndarray) -> LineFit:
    """Ordinary least squares line through the series."""
    line = fit_straight_line(t, y)
    return LineFit(intercept=line.intercept, slope=line.slope, rss=line.rss, xtx_inv=line.xtx_inv)


def fit_quad(t: np.ndarray, y: np.ndarray) -> QuadFit:
    """Least squares parabola; time is rescaled internally to keep the normal equations tame."""
    scale = max(float(t[-1]), 1.0)
    u = t / scale
    fit = fit_columns((np.ones_like(u), u, u * u), y)
    a, b, c = fit.coef
    return QuadFit(a=a, b=b / scale, c=c / scale**2, rss=fit.rss, xtx_inv=fit.xtx_inv, scale_s=scale)


def fit_accel(t: np.ndarray, y: np.ndarray) -> QuadFit:
    """Least squares ``a + c t^2``: a leak that starts at rest and accelerates steadily.

    It has as many parameters as a line, so a leak's curvature competes with a straight
    line on equal terms instead of paying for a third parameter.
    """
    scale = max(float(t[-1]), 1.0)
    u = t / scale
    fit = fit_columns((np.ones_like(u), u * u), y)
    a, c = fit.coef
    inv3 = np.zeros((3, 3))
    inv3[np.ix_([0, 2], [0, 2])] = fit.xtx_inv
    return QuadFit(a=a, b=0.0, c=c / scale**2, rss=fit.rss, xtx_inv=inv3,
                   scale_s=scale, n_params=2)


def fit_hinge(t: np.ndarray, y: np.ndarray, min_plateau: int = 3) -> HingeFit | None:
    """Best ramp-then-plateau over every knee at a sample time, all knees solved at once.

    For a knee at ``t[j]`` the regressor is ``min(t, t[j])``, whose sums follow from
    prefix sums, so every candidate knee costs O(1). ``None`` when the series is too short
    to show a plateau of ``min_plateau`` samples after a knee.
    """
    n = t.size
    if n < min_plateau + 2:
        return None
    ct, ctt, cty = np.cumsum(t), np.cumsum(t * t), np.cumsum(t * y)
    cy = np.cumsum(y)
    sy, syy = float(cy[-1]), float(np.sum(y * y))
    j = np.arange(1, n - min_plateau + 1)
    rest = (n - 1 - j).astype(np.float64)
    tj = t[j]
    sx = ct[j] + rest * tj
    sxx = ctt[j] + rest * tj * tj
    sxy = cty[j] + tj * (sy - cy[j])
    den = n * sxx - sx * sx
    ok = den > 1e-12
    if not np.any(ok):
        return None
    b = np.where(ok, (n * sxy - sx * sy) / np.where(ok, den, 1.0), 0.0)
    a = (sy - b * sx) / n
    rss = np.where(ok, syy - a * sy - b * sxy, np.inf)
    best = int(np.argmin(rss))
    return HingeFit(base=float(a[best]), slope=float(b[best]), knee_s=float(tj[best]),
                    rss=max(float(rss[best]), 0.0), n_plateau=int(rest[best]))


def _segment_rss(cy: np.ndarray, cyy: np.ndarray, i: int, k: np.ndarray | int) -> np.ndarray:
    """RSS of the constant fit on samples ``[i, k)`` from prefix sums padded with a leading 0."""
    s = cy[k] - cy[i]
    ss = cyy[k] - cyy[i]
    m = np.asarray(k) - i
    return ss - s * s / np.maximum(m, 1)


def fit_steps(t: np.ndarray, y: np.ndarray, sigma: float, max_changes: int = 12,
              min_len: int = 2) -> StepFit:
    """Piecewise-constant levels by greedy binary segmentation.

    A split is kept while it explains more than a BIC penalty's worth of variance
    (two parameters, ``2 ln n`` in units of the noise variance, plus a margin) so that noise
    alone does not invent steps; a change time is the midpoint between the samples either
    side of the jump.
    """
    n = t.size
    cy = np.concatenate([[0.0], np.cumsum(y)])
    cyy = np.concatenate([[0.0], np.cumsum(y * y)])
    cuts = [0, n]
    penalty = (2.0 * np.log(max(n, 2)) + 6.0) * sigma * sigma
    for _ in range(max_changes):
        best_gain, best_cut = 0.0, -1
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            if hi - lo < 2 * min_len:
                continue
            k = np.arange(lo + min_len, hi - min_len + 1)
            whole = float(_segment_rss(cy, cyy, lo, hi))
            gain = whole - (_segment_rss(cy, cyy, lo, k) + _segment_rss(cy, cyy, k, hi))
            g = int(np.argmax(gain))
            if gain[g] > best_gain:
                best_gain, best_cut = float(gain[g]), int(k[g])
        if best_cut < 0 or best_gain <= penalty:
            break
        cuts = sorted(cuts + [best_cut])
    levels = tuple(float((cy[hi] - cy[lo]) / (hi - lo)) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True))
    rss = float(sum(_segment_rss(cy, cyy, lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)))
    changes = tuple(float(0.5 * (t[c - 1] + t[c])) for c in cuts[1:-1])
    return StepFit(levels=levels, change_s=changes, first_len=cuts[1] - cuts[0], rss=max(rss, 0.0))


def fit_teeth(t: np.ndarray, y: np.ndarray, sigma: float) -> ToothFit | None:
    """A sawtooth from its drops; ``None`` when the series never drops sharply.

    A drop must beat both eight noise deviations of a first difference and 30% of the
    series' robust range: a released allocation gives back most of what the tooth grew,
    while noise and step jumps never fall that far in one sample.
    """
    if t.size < 4:
        return None
    d = np.diff(y)
    spread = float(np.percentile(y, 98) - np.percentile(y, 2))
    threshold = max(8.0 * sigma * np.sqrt(2.0), 0.3 * spread)
    drops = np.flatnonzero(d - np.median(d) < -threshold)
    if drops.size == 0:
        return None
    bounds = [0, *(int(i) + 1 for i in drops), t.size]
    tops: list[float] = []
    slopes: list[float] = []
    rss = 0.0
    for seg, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        ts, ys = t[lo:hi], y[lo:hi]
        if ts.size >= 3:
            line = fit_straight_line(ts, ys)
            slope, icpt = line.slope, line.intercept
            rss += line.rss
            slopes.append(slope)
        else:
            slope, icpt = 0.0, float(np.mean(ys))
        if seg < drops.size:  # a complete tooth: its crest is just before the drop
            drop_t = 0.5 * (t[hi - 1] + t[hi])
            top = icpt + slope * drop_t if ts.size >= 3 else float(ys.max())
            tops.append(float(top))
    drop_s = tuple(float(0.5 * (t[i] + t[i + 1])) for i in drops)
    return ToothFit(drop_s=drop_s, tops=tuple(tops), slope=float(np.median(slopes)) if slopes else 0.0,
                    rss=rss, n_params=2 * (len(bounds) - 1))
