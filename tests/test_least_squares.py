"""The machine-independent least squares (``fleetpilot.least_squares``)."""

from __future__ import annotations

import numpy as np
import pytest
from fleetpilot.least_squares import exact_dot, fit_columns, fit_straight_line, quadratic_form


def _series(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.sort(rng.uniform(0.0, 20_000.0, n)) + rng.uniform(0.0, 50_000.0)
    return t, 1000.0 + 0.3 * t + 1e-5 * t * t + rng.normal(0.0, 20.0, n)


@pytest.mark.parametrize("seed", range(6))
def test_a_parabola_matches_numpy_lstsq_and_pinv(seed):
    t, y = _series(seed, 50 + 300 * seed)
    u = t / t[-1]
    columns = (np.ones_like(u), u, u * u)
    x = np.column_stack(columns)
    want, *_ = np.linalg.lstsq(x, y, rcond=None)
    fit = fit_columns(columns, y)
    assert fit.coef == pytest.approx(want.tolist(), rel=1e-7)
    assert fit.rss == pytest.approx(float(np.sum((y - x @ want) ** 2)), rel=1e-9)
    np.testing.assert_allclose(fit.xtx_inv, np.linalg.pinv(x.T @ x), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_a_line_matches_numpy_polyfit_with_its_covariance(seed):
    t, y = _series(seed, 3 + 200 * seed)
    slope, intercept = np.polyfit(t, y, 1)
    line = fit_straight_line(t, y)
    assert (line.slope, line.intercept) == pytest.approx((slope, intercept), rel=1e-9)
    x = np.column_stack([np.ones_like(t), t])
    np.testing.assert_allclose(line.xtx_inv, np.linalg.inv(x.T @ x), rtol=1e-6)


def test_the_order_of_the_samples_does_not_change_a_bit():
    # Correctly rounded sums are a function of the numbers alone: whatever order a
    # machine's kernel adds in, the fit is the same. Plain float sums would differ here.
    t, y = _series(7, 1500)
    order = np.random.default_rng(1).permutation(t.size)
    u, v = t / t[-1], (t / t[-1])[order]
    a = fit_columns((np.ones_like(u), u, u * u), y)
    b = fit_columns((np.ones_like(v), v, v * v), y[order])
    assert a.coef == b.coef and a.rss == b.rss
    assert np.array_equal(a.xtx_inv, b.xtx_inv)
    assert fit_straight_line(t, y).slope == fit_straight_line(t[order], y[order]).slope
    assert exact_dot(t, y) == exact_dot(t[order], y[order])


def test_a_column_that_adds_nothing_is_left_out():
    x = np.arange(6.0)
    fit = fit_columns((np.ones(6), 2.0 * np.ones(6), x), 3.0 * x + 1.0)
    assert fit.coef[1] == 0.0
    assert fit.coef[0] == pytest.approx(1.0) and fit.coef[2] == pytest.approx(3.0)
    assert fit.rss == pytest.approx(0.0, abs=1e-20)
    assert not fit.xtx_inv[1].any() and not fit.xtx_inv[:, 1].any()


def test_a_line_over_one_abscissa_is_the_mean_and_an_empty_one_is_refused():
    line = fit_straight_line(np.full(4, 3.0), np.array([1.0, 2.0, 3.0, 6.0]))
    assert (line.slope, line.intercept) == (0.0, 3.0)
    with pytest.raises(ValueError, match="at least one point"):
        fit_straight_line(np.array([]), np.array([]))


def test_quadratic_form():
    m = np.array([[2.0, 1.0], [1.0, 3.0]])
    assert quadratic_form((1.0, 2.0), m) == 2.0 + 2 * 2.0 + 12.0
