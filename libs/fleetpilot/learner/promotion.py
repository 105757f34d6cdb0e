"""Learning from outcomes, and the gate a learned model passes before a policy uses it.

The outcomes are ordered by when they were recorded; the model is trained on the earlier
three quarters and scored on the latest quarter, which it has never seen, against the
policy's own confidence on the same decisions (the weighted Brier score: the mean squared
gap between the confidence and what happened). It is promoted only when it beats the
policy's confidence there by a margin, and by more than chance would give it on that many
outcomes (``MIN_EVIDENCE``, a paired comparison outcome by outcome); a promoted model is then trained again on every
outcome, so what serves has seen the latest quarter too. Pure: no I/O and no clock.

The model already serving is judged on the same latest quarter, on the outcomes in it that
were recorded after those it learnt from (``OutcomeModel.trained_through``): the world it
learnt may have gone (a fleet's new GPUs, a fixed driver, a policy that learnt the same
lesson), and a model no better than the policy's own confidence there is withdrawn
(``Assessment.withdraw``), unless the new one replaces it.

How strongly the correction is held to the policy's confidence (the prior, worth
``PRIOR_CHOICES`` outcomes) is chosen on the earlier three quarters alone, by how a model
trained on some programs predicts the outcomes of the others (the folds split the task
signatures, ``fingerprint.task_signature``): the tasks a model will be asked about are
often of programs it never saw, and a model that learnt each program's own record scores
well on that program's later runs and badly on the next program. (With thousands of
outcomes and a prior worth 5, a model of the k8s-default's placements beat its confidence on
the latest quarter of its training workloads, 0.030 against 0.072, and tied it on new
workloads: 0.0749 against 0.0750.)
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import msgspec
import numpy as np

from fleetpilot.contracts import DecisionMade, HeldOutFigures
from fleetpilot.fingerprint.signature import task_signature

from .features import LEARNED_ACTIONS, OutcomeFeatures
from .model import PRIOR_OUTCOMES, OutcomeModel, prior_probability, train

MIN_EXAMPLES = 200
"""Fewer judged placements than this teach nothing worth serving."""
HELD_OUT_SHARE = 0.25
MIN_GAIN = 0.02
"""How much lower (relative) the model's held-out Brier score must be than the policy's."""
MIN_EVIDENCE = 1.645
"""How far the held-out gain must stand above chance: the mean of the outcome-by-outcome
gains in squared error, in standard errors of that mean (one-sided, 95%). Without it a model
that learnt noise from 150 outcomes beat a well-calibrated policy by 2% on 50 in one round of
seven."""
PRIOR_CHOICES = (PRIOR_OUTCOMES, 50.0, 500.0)
"""How many outcomes the prior may be worth; the weakest wins a tie."""
FOLDS = 3
"""Folds of programs the prior is chosen by."""
CHOICE_ROWS = 12_000
"""At most this many of the latest training outcomes choose the prior (it trains
``FOLDS × len(PRIOR_CHOICES)`` models)."""


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
    and why, in one line, and how many outcomes its prior was worth."""

    model: OutcomeModel | None
    figures: HeldOutFigures
    promoted: bool
    reason: str
    prior_outcomes: float = PRIOR_OUTCOMES
    serving_brier: float | None = None
    """The Brier score of the model serving when the round began, on the held-out outcomes
    recorded after those it learnt from (``None``: none serving, or none of those yet)."""
    withdraw: bool = False
    """The serving model no longer beats the policy's confidence and nothing replaces it."""


def learnable(example: Example) -> bool:
    """Whether an outcome can teach the model: a placement, from a record worth something."""
    return example.decision.action in LEARNED_ACTIONS and example.weight > 0


def weighted_brier(p: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """``Σ w (p − y)² / Σ w`` (0 when no weight)."""
    total = float(w.sum())
    return float((w * (p - y) ** 2).sum() / total) if total > 0 else 0.0


def gain_evidence(p_model: np.ndarray, p_prior: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """How many standard errors the model's weighted mean gain in squared error over the
    prior stands above zero, outcome by outcome on the same outcomes (a paired comparison),
    and above what chance would give it were the prior's confidence right (the lower of the
    two); 0 when there is no weight, no gain, or fewer than two outcomes' worth of weight (no
    spread can be measured)."""
    total, squares = float(w.sum()), float((w * w).sum())
    if total <= 0:
        return 0.0
    gains = (p_prior - y) ** 2 - (p_model - y) ** 2
    mean = float((w * gains).sum()) / total
    if mean <= 0:
        return 0.0
    effective = total * total / squares  # as many equally weighted outcomes as these are worth
    if effective < 2.0 - 1e-9:  # two equal weights sum to 2 up to rounding
        # One outcome (or one that carries nearly all the weight) has no spread to measure:
        # its gain was "infinitely" many standard errors, and a single held-out placement
        # promoted a model of noise; one exact record among 49 nearly weightless ones stood
        # at 30.
        return 0.0
    # The gains' variance as a sample's (reliability weights: divided by total - squares /
    # total, n - 1 for equal weights). Taken as the population's, it understated the standard
    # error by sqrt(n / (n - 1)): 41% more evidence on two outcomes, 15% on four.
    spread = float((w * (gains - mean) ** 2).sum()) / (total - squares / total)
    measured = float("inf") if spread == 0 else mean / (spread / effective) ** 0.5
    # The spread of the gains is that of the outcomes that happened: a held-out quarter of a
    # policy right at 0.97 holds no failure one time in five, and then every model a little
    # more confident gains on every outcome alike, with no spread at all (infinitely many
    # standard errors: a model of noise was promoted in 3 rounds of 30). So the gain must also
    # stand above what the outcomes' own chance gives were the policy's confidence q right:
    # each outcome's gain then has mean -(m - q)² and variance 4 q (1 - q) (m - q)².
    q = np.clip(p_prior, 0.0, 1.0)
    expected = float((w * -((p_model - q) ** 2)).sum()) / total
    variance = float((w * w * 4.0 * q * (1.0 - q) * (p_model - q) ** 2).sum()) / (total * total)
    by_chance = float("inf") if variance == 0 else (mean - expected) / variance**0.5
    return min(measured, by_chance)


def _arrays(features: OutcomeFeatures, examples: list[Example]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = features.matrix([(e.decision, e.gpu_model) for e in examples])
    y = np.array([1.0 if e.success else 0.0 for e in examples])
    w = np.clip(np.array([e.weight for e in examples], dtype=float), 0.0, 1.0)
    return x, y, w


def fold_of(example: Example, folds: int) -> int:
    """The fold of an outcome's program (its task's signature; its task id without one)."""
    task = example.decision.task
    key = task_signature(task) if task is not None else example.decision.task_id
    return zlib.crc32(key.encode()) % folds  # the same in every process, unlike hash()


def choose_prior(examples: list[Example], *, seed: int = 0, folds: int = FOLDS,
                 choices: tuple[float, ...] = PRIOR_CHOICES) -> float:
    """The prior strength whose models, trained on the other programs, predict each fold's
    programs best (weighted Brier over every fold); the weakest when the folds cannot be
    made (fewer than two programs)."""
    examples = examples[-CHOICE_ROWS:]
    fold = np.array([fold_of(e, folds) for e in examples])
    if len(set(fold.tolist())) < 2:
        return choices[0]
    layout = OutcomeFeatures.for_models({e.gpu_model for e in examples})
    x, y, w = _arrays(layout, examples)
    scores = []
    for strength in choices:
        predicted = np.empty(len(y))
        for k in sorted(set(fold.tolist())):
            inside = fold != k
            model = train(layout, x[inside], y[inside], w[inside], seed=seed, prior_outcomes=strength)
            predicted[~inside] = model.predict(x[~inside])
        scores.append(weighted_brier(predicted, y, w))
    return choices[int(np.argmin(scores))]


def held_out_figures(model: OutcomeModel, examples: list[Example], *, trained_on: int = 0) -> HeldOutFigures:
    """How ``model`` and the policy's own confidence did on ``examples`` (rows in the
    model's own layout: the GPU models it knew when it was trained), for a model trained on
    ``trained_on`` outcomes."""
    return _judged(model, examples, trained_on)[0]


def _judged(model: OutcomeModel, examples: list[Example], trained_on: int = 0) -> tuple[HeldOutFigures, float]:
    """``held_out_figures`` and the evidence of the model's gain there (``gain_evidence``),
    from one prediction of each outcome."""
    x, y, w = _arrays(model.features, examples)
    predicted, prior = model.predict(x), prior_probability(x)
    figures = HeldOutFigures(examples=trained_on, held_out=len(examples), brier_model=weighted_brier(predicted, y, w),
                             brier_prior=weighted_brier(prior, y, w), mean_predicted=float(predicted.mean()),
                             mean_prior=float(prior.mean()), observed=float(y.mean()))
    return figures, gain_evidence(predicted, prior, y, w)


def learn(examples: list[Example], *, seed: int = 0, min_examples: int = MIN_EXAMPLES,
          held_out_share: float = HELD_OUT_SHARE, min_gain: float = MIN_GAIN,
          min_evidence: float = MIN_EVIDENCE, serving: OutcomeModel | None = None) -> Assessment:
    """Train on the earlier outcomes, score on the latest, promote if the model wins; judge
    the ``serving`` model on the latest outcomes it did not learn from."""
    usable = sorted((e for e in examples if learnable(e)), key=lambda e: (e.recorded_at, e.decision.decision_id))
    # Whatever the caller asks, two at least: one outcome to train on and one to judge by.
    needed = max(min_examples, 2)
    if len(usable) < needed:
        nothing = HeldOutFigures(examples=len(usable), held_out=0, brier_model=0.0, brier_prior=0.0,
                                 mean_predicted=0.0, mean_prior=0.0, observed=0.0)
        return Assessment(None, nothing, False, f"{len(usable)} judged placements, {needed} needed")
    cut = len(usable) - max(1, int(round(len(usable) * held_out_share)))
    head, tail = usable[:cut], usable[cut:]
    # The layout knows only the GPU models of the outcomes it trains on: a model first seen
    # in the held-out quarter is scored as "other", as it would be when serving.
    strength = choose_prior(head, seed=seed)
    layout = OutcomeFeatures.for_models({e.gpu_model for e in head})
    x, y, w = _arrays(layout, head)
    model = msgspec.structs.replace(train(layout, x, y, w, seed=seed, prior_outcomes=strength),
                                    trained_through=head[-1].recorded_at)
    figures, evidence = _judged(model, tail, trained_on=len(usable))
    brier_model, brier_prior = figures.brier_model, figures.brier_prior
    better = brier_model <= brier_prior * (1.0 - min_gain) and brier_model < brier_prior
    promoted = better and evidence >= min_evidence
    if promoted:
        layout = OutcomeFeatures.for_models({e.gpu_model for e in usable})
        model = msgspec.structs.replace(train(layout, *_arrays(layout, usable), seed=seed, prior_outcomes=strength),
                                        trained_through=usable[-1].recorded_at)
        reason = f"held-out Brier {brier_model:.5f} beats the policy's {brier_prior:.5f}"
    elif better:
        reason = (f"held-out Brier {brier_model:.5f} beats the policy's {brier_prior:.5f} by too little to tell "
                  f"from chance: {evidence:.2f} standard errors, {min_evidence:g} needed")
    else:
        reason = (f"held-out Brier {brier_model:.5f} does not beat the policy's {brier_prior:.5f} "
                  f"by {min_gain:.0%}")
    reason = f"{reason} (prior worth {strength:g} outcomes)"
    # The serving model is judged only on the latest outcomes it never learnt from: a model
    # promoted last round was trained on nearly all of this round's latest quarter, and scored
    # there it was judged on what it remembered, not on the world as it is now; a model that
    # had learnt noise kept serving however the new outcomes went. Against the policy's own
    # confidence on the same outcomes.
    serving_brier, serving_prior, unseen = None, brier_prior, tail
    if serving is not None:
        if serving.trained_through is not None:
            unseen = [e for e in tail if e.recorded_at > serving.trained_through]
        if unseen:
            judged = held_out_figures(serving, unseen)
            serving_brier, serving_prior = judged.brier_model, judged.brier_prior
    withdraw = serving_brier is not None and not promoted and serving_brier >= serving_prior
    if withdraw:
        reason = (f"the model serving scores {serving_brier:.5f} on the latest {len(unseen)} outcomes it did not "
                  f"learn from, no better than the policy's {serving_prior:.5f}: withdrawn; the new one: {reason}")
    return Assessment(model, figures, promoted, reason, strength, serving_brier, withdraw)
