"""Calibration of a policy's confidence against what its decisions did, learnt from feedback.

A decision's ``confidence`` is meant as the probability that the action meets its goal. The
policies compute it from what they know at decision time (a success prior, the OOM risk of
the fingerprint, thermal headroom, ...; see the policy README), and the prior is a guess
until outcomes come in. The feedback store keeps, per policy, the sum of the confidences of
the recorded actions (``expected_successes``) and how many met their goal (``successes``).
``ConfidenceCalibration`` turns those totals into one multiplicative correction per policy
(calibration in the large: over a policy's decisions, the corrected confidences add up to
the successes observed), shrunk towards no correction while few outcomes are known::

    factor = (met + n0) / (raw + n0)

``raw`` is the sum of the *uncorrected* confidences of the judged decisions and ``n0``
(``prior_decisions``) how many outcomes the prior is worth. The feedback totals hold the
confidences as published, which were already corrected; each update therefore takes only
the new part of the totals and divides it by the factor in force, so a correction is never
applied on top of itself (the loop cannot wind up). Pure: no I/O and no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PRIOR_DECISIONS = 50.0
"""How many judged decisions the uncorrected confidence is worth."""


@dataclass
class _PolicyTally:
    raw: float = 0.0
    met: float = 0.0
    totals: tuple[float, float] = (0.0, 0.0)  # (expected, successes) at the last update
    ceiling: float = 1.0


@dataclass
class ConfidenceCalibration:
    """One correction factor per policy name, from cumulative feedback totals."""

    prior_decisions: float = PRIOR_DECISIONS
    _tallies: dict[str, _PolicyTally] = field(default_factory=dict)

    def factor(self, policy: str) -> float:
        """The multiplier of ``policy``'s confidences (1.0 while nothing is known)."""
        t = self._tallies.get(policy)
        if t is None:
            return 1.0
        return (t.met + self.prior_decisions) / (t.raw + self.prior_decisions)

    def update(self, policy: str, expected_successes: float, successes: float, count: float | None = None) -> float:
        """Fold in ``policy``'s feedback totals (cumulative, as the stats endpoint reports
        them, over confidences as they were published) and return the new factor. Totals
        that went down (a store emptied or swapped) restart the count from them.

        With ``count`` (how many actions the totals cover), the correction may raise a
        confidence only up to ``(successes + 1) / (count + 2)``, the policy's success rate by
        Laplace's rule: after 80 successes in 80 a 0.94 may become 0.99, never 1.0. (It never
        lowers one below what the policy said: a short record caps the raise, not the policy.)
        Totals that are not finite are ignored (the factor in force is returned)."""
        if not (math.isfinite(expected_successes) and math.isfinite(successes)):
            # A total that is no number (a broken stats reply) says nothing; folded in, a NaN
            # stayed in the tally for good and every later confidence came out 0.
            return self.factor(policy)
        if count is not None and count >= 0 and math.isfinite(count):
            self._tallies.setdefault(policy, _PolicyTally()).ceiling = (successes + 1.0) / (count + 2.0)
        t = self._tallies.setdefault(policy, _PolicyTally())
        d_expected = expected_successes - t.totals[0]
        d_met = successes - t.totals[1]
        if d_expected < 0 or d_met < 0:
            self._tallies[policy] = _PolicyTally(totals=(expected_successes, successes), ceiling=t.ceiling)
            return self.factor(policy)
        t.raw += d_expected / self.factor(policy)
        t.met += d_met
        t.totals = (expected_successes, successes)
        return self.factor(policy)

    def apply(self, policy: str, confidence: float) -> float:
        """``confidence`` corrected for ``policy``, kept in 0..1; a raise stops at the
        record's ceiling (``update``)."""
        t = self._tallies.get(policy)
        ceiling = max(t.ceiling if t is not None else 1.0, confidence)
        return min(1.0, ceiling, max(0.0, confidence * self.factor(policy)))
