"""Learning from outcomes, and the gate a learned model passes before a policy uses it.

The outcomes are ordered by when they were recorded; the model is trained on the earlier
three quarters and scored on the latest quarter, which it has never seen, against the
policy's own confidence on the same decisions (the weighted Brier score: the mean squared
gap between the confidence and what happened). It is promoted only when it beats the
policy's confidence there by a margin; a promoted model is then trained again on every
outcome, so what serves has seen the latest quarter too. Pure: no I/O and no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fleetpilot.contracts import DecisionMade, HeldOutFigures

from .features import LEARNED_ACTIONS, OutcomeFeatures
from .model import OutcomeModel, prior_probability, train

MIN_EXAMPLES = 200
"""Fewer judged placements than this teach nothing worth serving."""
HELD_OUT_SHARE = 0.25
MIN_GAIN = 0.02
"""How much lower (relative) the model's held-out Brier score must be than the policy's."""


@dataclass(frozen=True)
class Example:
    """One judged placement: the decision, the model of the GPU it went to, whether it met
    its goal, how far its record can be trusted (0..1) and when it was recorded."""

    decision: DecisionMade
    gpu_model: str
    success: bool
    weight: float
    recorded_at: float


@dataclass(frozen=True)
class Assessment:
    """What one round of learning gave: the model (``None`` when there was too little to
    learn from), how it and the policy did on the held-out outcomes, whether it is promoted
    and why, in one line."""

    model: OutcomeModel | None
    figures: HeldOutFigures
    promoted: bool
    reason: str


def learnable(example: Example) -> bool:
    """Whether an outcome can teach the model: a placement, from a record worth something."""
    return example.decision.action in LEARNED_ACTIONS and example.weight > 0


def weighted_brier(p: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """``Σ w (p − y)² / Σ w`` (0 when no weight)."""
    total = float(w.sum())
    return float((w * (p - y) ** 2).sum() / total) if total > 0 else 0.0


def _arrays(features: OutcomeFeatures, examples: list[Example]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = features.matrix([(e.decision, e.gpu_model) for e in examples])
    y = np.array([1.0 if e.success else 0.0 for e in examples])
    w = np.clip(np.array([e.weight for e in examples], dtype=float), 0.0, 1.0)
    return x, y, w


def learn(examples: list[Example], *, seed: int = 0, min_examples: int = MIN_EXAMPLES,
          held_out_share: float = HELD_OUT_SHARE, min_gain: float = MIN_GAIN) -> Assessment:
    """Train on the earlier outcomes, score on the latest, promote if the model wins."""
    usable = sorted((e for e in examples if learnable(e)), key=lambda e: (e.recorded_at, e.decision.decision_id))
    if len(usable) < min_examples:
        nothing = HeldOutFigures(examples=len(usable), held_out=0, brier_model=0.0, brier_prior=0.0,
                                 mean_predicted=0.0, mean_prior=0.0, observed=0.0)
        return Assessment(None, nothing, False, f"{len(usable)} judged placements, {min_examples} needed")
    cut = len(usable) - max(1, int(round(len(usable) * held_out_share)))
    head, tail = usable[:cut], usable[cut:]
    # The layout knows only the GPU models of the outcomes it trains on: a model first seen
    # in the held-out quarter is scored as "other", as it would be when serving.
    layout = OutcomeFeatures.for_models({e.gpu_model for e in head})
    x, y, w = _arrays(layout, head)
    model = train(layout, x, y, w, seed=seed)
    xt, yt, wt = _arrays(layout, tail)
    predicted, prior = model.predict(xt), prior_probability(xt)
    brier_model, brier_prior = weighted_brier(predicted, yt, wt), weighted_brier(prior, yt, wt)
    promoted = brier_model <= brier_prior * (1.0 - min_gain) and brier_model < brier_prior
    if promoted:
        layout = OutcomeFeatures.for_models({e.gpu_model for e in usable})
        model = train(layout, *_arrays(layout, usable), seed=seed)
        reason = f"held-out Brier {brier_model:.5f} beats the policy's {brier_prior:.5f}"
    else:
        reason = (f"held-out Brier {brier_model:.5f} does not beat the policy's {brier_prior:.5f} "
                  f"by {min_gain:.0%}")
    figures = HeldOutFigures(examples=len(usable), held_out=len(tail), brier_model=brier_model,
                             brier_prior=brier_prior, mean_predicted=float(predicted.mean()),
                             mean_prior=float(prior.mean()), observed=float(yt.mean()))
    return Assessment(model, figures, promoted, reason)
