"""Calibration of confidences from feedback totals: the factor, shrinkage, no wind-up."""

from __future__ import annotations

import math

import pytest
from fleetpilot.policy.calibration import ConfidenceCalibration


def test_nothing_known_means_no_correction_and_confidences_stay_in_0_1() -> None:
    cal = ConfidenceCalibration()
    assert cal.factor("fgd") == 1.0
    assert cal.apply("fgd", 0.8) == 0.8
    cal.update("fgd", expected_successes=50.0, successes=100.0)  # far more successes than predicted
    assert cal.apply("fgd", 0.99) == 1.0 and cal.apply("fgd", -0.1) == 0.0


@pytest.mark.parametrize(("expected", "met", "factor"), [(90.0, 99.0, 149 / 140), (95.0, 60.0, 110 / 145),
                                                         (0.0, 0.0, 1.0)])
def test_the_factor_is_the_observed_over_the_predicted_shrunk_by_the_prior(expected: float, met: float,
                                                                           factor: float) -> None:
    cal = ConfidenceCalibration(prior_decisions=50.0)
    assert cal.update("p", expected, met) == pytest.approx(factor)
    assert cal.factor("other") == 1.0


def test_the_same_totals_read_again_change_nothing() -> None:
    cal = ConfidenceCalibration()
    first = cal.update("p", 90.0, 99.0)
    for _ in range(10):
        assert cal.update("p", 90.0, 99.0) == pytest.approx(first)


@pytest.mark.parametrize(("said", "met_per_100", "converged"), [(0.9, 99.0, 0.99), (0.95, 60.0, 0.60)])
def test_published_confidences_are_not_corrected_twice_and_the_loop_converges(said: float, met_per_100: float,
                                                                              converged: float) -> None:
    # The policy says `said`; `met_per_100` of every 100 placements succeed. Each round
    # publishes 100 corrected confidences and the feedback totals grow by what was published
    # and what succeeded: under- and overconfidence both settle on the observed rate.
    cal = ConfidenceCalibration()
    expected = met = 0.0
    for _ in range(60):
        expected += 100 * cal.apply("p", said)
        met += met_per_100
        cal.update("p", expected, met)
    assert cal.apply("p", said) == pytest.approx(converged, abs=0.01)


def test_totals_that_go_down_restart_the_count() -> None:
    cal = ConfidenceCalibration(prior_decisions=50.0)
    cal.update("p", 90.0, 99.0)
    assert cal.update("p", 10.0, 5.0) == 1.0  # a new, empty store: nothing learnt from it yet
    assert cal.update("p", 100.0, 95.0) == pytest.approx((90 + 50) / (90 + 50))


def test_with_counts_a_confidence_stays_under_the_policys_record() -> None:
    cal = ConfidenceCalibration()
    cal.update("p", expected_successes=60.0, successes=80.0, count=80.0)  # said 0.75 on average, all met
    assert cal.apply("p", 0.94) == pytest.approx(81 / 82)  # raised, but 80 of 80 is not a certainty
    assert cal.apply("p", 0.99) == 0.99  # a raise is capped; the policy's own word is not lowered
    assert cal.apply("p", 0.5) == pytest.approx(0.5 * cal.factor("p"))  # under the ceiling: untouched
    fresh = ConfidenceCalibration()
    fresh.update("p", expected_successes=0.0, successes=0.0, count=0.0)  # no record: the policy's word
    assert fresh.apply("p", 0.95) == 0.95
    cal.update("p", expected_successes=95.0, successes=80.0, count=100.0)  # failures since: lowered
    assert cal.apply("p", 0.9) < 0.9


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_totals_that_are_no_number_are_ignored_and_never_stick(bad: float) -> None:
    # One NaN total (a broken stats reply) made the factor NaN for good: every later update
    # added to a NaN, and every confidence of the policy came out 0.
    cal = ConfidenceCalibration()
    cal.update("p", 100.0, 90.0)
    factor = cal.factor("p")
    assert cal.update("p", bad, 95.0) == factor
    assert cal.update("p", 110.0, bad) == factor
    assert cal.update("p", 110.0, 99.0, count=bad) == cal.factor("p")
    assert math.isfinite(cal.factor("p")) and cal.factor("p") != factor  # the good totals still count
    assert 0.0 < cal.apply("p", 0.9) <= 1.0
