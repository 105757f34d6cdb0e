"""Least squares that give the same bits on every machine.

numpy's ``lstsq``, ``pinv``, ``polyfit``, ``dot`` and ``@`` go through OpenBLAS, which picks
its kernels by the CPU it finds (``SkylakeX`` on an AVX-512 EPYC, ``Haswell`` or ``Zen`` on
others), and those kernels add in different orders, so the last bits of a fit differ from
one machine to the next. A fingerprint's pattern is chosen by comparing the fits' residuals,
and a fleet's decisions follow its fingerprints: those last bits moved the fleet
benchmark's figures by several points on some workloads (openb seed 201's mean queue −70%
with one kernel, −65% with the other, the same code on the same machine) and would make a
fingerprint depend on where the fingerprinter runs, which a replay must not.

Here every sum is ``math.fsum`` (correctly rounded: a function of the numbers alone, not of
their order), products are elementwise IEEE arithmetic, and the little algebra left is done
in Python floats, so a fit is the same on every machine and with every numpy.

A straight line is fitted about the mean of its abscissae (its two columns are then
orthogonal); more columns by a QR factorisation (modified Gram–Schmidt), whose error grows
with the columns' condition number and not with its square, as the normal equations' would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# A column whose part not explained by the columns before it is below this share of its own
# norm adds nothing the others do not: it is left out (coefficient 0), as a pseudo-inverse
# with numpy's default cut-off would.
_DEPENDENT = 1e-12


def exact_sum(values: np.ndarray) -> float:
    """The correctly rounded sum of ``values``."""
    return math.fsum(np.asarray(values, dtype=np.float64).ravel().tolist())


def exact_dot(a: np.ndarray, b: np.ndarray) -> float:
    """The correctly rounded sum of the elementwise products of ``a`` and ``b``."""
    return exact_sum(np.multiply(a, b, dtype=np.float64))


def quadratic_form(x: Sequence[float], m: np.ndarray) -> float:
    """``xᵀ m x``, correctly rounded from its terms."""
    k = len(x)
    return math.fsum(float(x[i]) * float(m[i, j]) * float(x[j]) for i in range(k) for j in range(k))


@dataclass(frozen=True)
class StraightLine:
    """``intercept + slope * x`` fitted by least squares, with ``(XᵀX)⁻¹`` of its columns ``[1, x]``."""

    intercept: float
    slope: float
    rss: float
    xtx_inv: np.ndarray


def fit_straight_line(x: np.ndarray, y: np.ndarray) -> StraightLine:
    """The least-squares line through ``(x, y)`` (``np.polyfit(x, y, 1)``, machine-independent).

    When every ``x`` is the same the slope is 0 and the line is the mean of ``y``.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = x.size
    if n == 0:
        raise ValueError("a line needs at least one point")
    x_mean, y_mean = exact_sum(x) / n, exact_sum(y) / n
    centred = x - x_mean
    sxx = exact_dot(centred, centred)
    slope = exact_dot(centred, y) / sxx if sxx > 0 else 0.0
    intercept = y_mean - slope * x_mean
    residual = y - (intercept + slope * x)
    if sxx > 0:
        inv = np.array([[1.0 / n + x_mean * x_mean / sxx, -x_mean / sxx], [-x_mean / sxx, 1.0 / sxx]])
    else:
        inv = np.array([[1.0 / n, 0.0], [0.0, 0.0]])
    return StraightLine(intercept=intercept, slope=slope, rss=exact_dot(residual, residual), xtx_inv=inv)


@dataclass(frozen=True)
class ColumnFit:
    """Least-squares coefficients of ``y`` on some columns, with ``(XᵀX)⁻¹`` (zero on left-out columns)."""

    coef: tuple[float, ...]
    rss: float
    xtx_inv: np.ndarray


def fit_columns(columns: Sequence[np.ndarray], y: np.ndarray) -> ColumnFit:
    """Least squares of ``y`` on ``columns`` (each as long as ``y``), machine-independent."""
    y = np.asarray(y, dtype=np.float64)
    k = len(columns)
    q: list[np.ndarray | None] = []
    r = [[0.0] * k for _ in range(k)]
    for j, column in enumerate(columns):
        v = np.asarray(column, dtype=np.float64).copy()
        norm = math.sqrt(exact_dot(v, v))
        for i in range(j):
            qi = q[i]
            if qi is not None:
                r[i][j] = exact_dot(qi, v)
                v -= r[i][j] * qi
        rest = math.sqrt(exact_dot(v, v))
        if rest <= _DEPENDENT * norm:
            q.append(None)
            continue
        r[j][j] = rest
        q.append(v / rest)
    kept = [j for j in range(k) if q[j] is not None]
    # Qᵀy, then R c = Qᵀy by back substitution over the kept columns.
    qty = {j: exact_dot(q[j], y) for j in kept}
    coef = [0.0] * k
    for j in reversed(kept):
        coef[j] = (qty[j] - math.fsum(r[j][m] * coef[m] for m in kept if m > j)) / r[j][j]
    fitted = np.zeros_like(y)
    for j in kept:
        fitted = fitted + coef[j] * np.asarray(columns[j], dtype=np.float64)
    residual = y - fitted
    # (XᵀX)⁻¹ = R⁻¹ R⁻ᵀ on the kept columns.
    r_inv = [[0.0] * k for _ in range(k)]
    for j in reversed(kept):
        r_inv[j][j] = 1.0 / r[j][j]
        for i in reversed([m for m in kept if m < j]):
            r_inv[i][j] = -math.fsum(r[i][m] * r_inv[m][j] for m in kept if i < m <= j) / r[i][i]
    inv = np.array([[math.fsum(r_inv[a][m] * r_inv[b][m] for m in kept) for b in range(k)] for a in range(k)])
    return ColumnFit(coef=tuple(coef), rss=exact_dot(residual, residual), xtx_inv=inv)
