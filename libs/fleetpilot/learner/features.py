"""What the outcome model sees of a decision: a fixed vector of numbers per placement.

Everything comes from the ``DecisionMade`` event itself (the task it carries, its contract,
its placement, the policy's own confidence) and the model of the GPU it went to, so the
learner (which reads decisions off the bus) and the policy (which has just built one) compute
the same vector from the same event: no feature depends on a clock or on state only one of
them holds.

The policy's own confidence is an input, not something to replace: the model learns a
correction of it (see ``model.py``). It is read from ``prior_confidence`` when the decision
has one (the confidence was the learned model's), else ``confidence``, so a model never
learns from its own output.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from fleetpilot.contracts import DecisionMade

LEARNED_ACTIONS = ("assign", "migrate")
"""The actions whose outcome the model predicts: the placements, judged by how they end."""
KINDS = ("train", "finetune", "infer", "encode", "batch")
TIERS = ("vip", "standard", "best_effort")
OTHER_MODEL = "other"
"""The column of a GPU model the training set never saw."""
CONFIDENCE_FLOOR = 1e-3
"""Confidences are clipped to ``[floor, 1 - floor]`` before their logit is taken."""


def prior_confidence(decision: DecisionMade) -> float:
    """The policy's own confidence in ``decision``, before any learned model."""
    value = decision.prior_confidence if decision.prior_confidence is not None else decision.confidence
    return min(1.0 - CONFIDENCE_FLOOR, max(CONFIDENCE_FLOOR, float(value)))


def logit(p: float) -> float:
    """``log(p / (1 - p))`` of a probability already kept off 0 and 1."""
    return math.log(p / (1.0 - p))


class OutcomeFeatures(msgspec.Struct, frozen=True, kw_only=True):
    """The feature layout of one model: the fixed columns, then one column per GPU model
    the training set held (in this order) and one for any other model."""

    gpu_models: tuple[str, ...] = ()

    @classmethod
    def for_models(cls, gpu_models: set[str] | list[str]) -> OutcomeFeatures:
        """The layout for a training set whose placements went to ``gpu_models``."""
        return cls(gpu_models=tuple(sorted(m for m in gpu_models if m)))

    def names(self) -> list[str]:
        """One name per column, for reports and for checking a model against its layout."""
        return ([f"action={a}" for a in LEARNED_ACTIONS] + [f"kind={k}" for k in KINDS]
                + [f"tier={t}" for t in TIERS]
                + ["log_gpus", "sharing", "gpu_share", "log_ask_gb", "log_held_gb", "headroom",
                   "prior_logit", "fallback", "has_duration", "log_duration_h"]
                + [f"gpu_model={m}" for m in self.gpu_models] + [f"gpu_model={OTHER_MODEL}"])

    def width(self) -> int:
        """How many columns a vector has."""
        return len(LEARNED_ACTIONS) + len(KINDS) + len(TIERS) + 10 + len(self.gpu_models) + 1

    def vector(self, decision: DecisionMade, gpu_model: str) -> np.ndarray:
        """The columns of ``decision``, placed on a GPU of ``gpu_model``."""
        task = decision.task
        row = np.zeros(self.width())
        col = 0
        for group, value in ((LEARNED_ACTIONS, decision.action),
                             (KINDS, task.kind if task else ""),
                             (TIERS, _tier(decision))):
            if value in group:
                row[col + group.index(value)] = 1.0
            col += len(group)
        gpus = task.gpus if task else len(decision.placement)
        milli = task.gpu_milli if task else max((p.milli for p in decision.placement), default=1000)
        # A negative ask or hold (a producer's bug: nothing on the wire forbids it) reads as
        # unknown, like none at all: its logarithm would raise, and the one decision would
        # fail every round of learning while it stays among the outcomes kept, and every
        # prediction the policy asks of it.
        ask_mb = max(float(task.gpu_memory_mb), 0.0) if task else 0.0
        held = [p.memory_mb for p in decision.placement if p.gpu >= 0]
        held_mb = max(float(sum(held) / len(held)), 0.0) if held else 0.0
        # How much room the hold leaves above what the task asked for (negative: below it),
        # relative to the hold; 0 when either is unknown.
        headroom = (held_mb - ask_mb) / held_mb if held_mb > 0 and ask_mb > 0 else 0.0
        duration = task.expected_duration_s if task else None
        row[col:col + 10] = (
            math.log1p(max(gpus, 0)),
            1.0 if gpus == 1 and milli < 1000 else 0.0,
            min(max(milli, 0), 1000) / 1000.0,
            math.log1p(ask_mb / 1024.0),
            math.log1p(held_mb / 1024.0),
            min(1.0, max(-1.0, headroom)),
            logit(prior_confidence(decision)),
            1.0 if decision.fallback else 0.0,
            1.0 if duration else 0.0,
            math.log1p(max(duration or 0.0, 0.0) / 3600.0),
        )
        col += 10
        row[col + (self.gpu_models.index(gpu_model) if gpu_model in self.gpu_models else len(self.gpu_models))] = 1.0
        return row

    def matrix(self, rows: list[tuple[DecisionMade, str]]) -> np.ndarray:
        """The vectors of several ``(decision, gpu_model)`` pairs, one row each."""
        if not rows:
            return np.zeros((0, self.width()))
        return np.stack([self.vector(d, m) for d, m in rows])


PRIOR_COLUMN = len(LEARNED_ACTIONS) + len(KINDS) + len(TIERS) + 6
"""The column of the policy's own confidence (its logit): the model's starting point."""


def _tier(decision: DecisionMade) -> str:
    if decision.contract is not None:
        return decision.contract.tier
    return decision.task.sla.tier if decision.task else "standard"
