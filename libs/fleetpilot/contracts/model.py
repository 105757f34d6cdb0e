"""Model family: the learner announces each model it trained, and whether policies may use it."""

from __future__ import annotations

from .base import Event, Record


class HeldOutFigures(Record, frozen=True, kw_only=True):
    """How a learned model did on the latest outcomes, which it was not trained on: over
    ``held_out`` of its ``examples``, the weighted Brier score of its predictions and of the
    policy's own confidence on the same decisions, the mean of each, and the share of those
    decisions that met their goal."""

    examples: int
    held_out: int
    brier_model: float
    brier_prior: float
    mean_predicted: float
    mean_prior: float
    observed: float


class ModelPublished(Event, frozen=True, kw_only=True, tag="model.published.v1"):
    """A learned model was trained and stored in the ``models`` bucket under ``name``, at
    ``version`` (the key's revision there), with its held-out ``figures``. Policies use it
    only when ``promoted``; ``reason`` says why in one line. With ``withdrawn``, the model
    stored under ``name`` at ``version`` was taken out of the bucket instead: on the latest
    outcomes (the round of ``figures``) it no longer beat the policy's own confidence, or the
    value stored there was no model the learner could read (``reason`` says which)."""

    name: str
    version: int
    figures: HeldOutFigures
    promoted: bool
    reason: str
    published_at: float
    withdrawn: bool = False
