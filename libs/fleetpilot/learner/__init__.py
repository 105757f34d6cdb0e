"""The learner's library: what a decision looks like to the outcome model (``features``),
the model itself (``model``: trained with torch, served with numpy) and the gate a model
passes before a policy uses it (``promotion``). See the README."""

from .features import LEARNED_ACTIONS, OutcomeFeatures, prior_confidence
from .keys import CANDIDATE_KEY, PROMOTED_KEY, STORE_FILE
from .model import OutcomeModel, prior_probability, train
from .promotion import PRIOR_CHOICES, Assessment, Example, learn, learnable, weighted_brier

__all__ = [
    "CANDIDATE_KEY",
    "PROMOTED_KEY",
    "STORE_FILE",
    "LEARNED_ACTIONS",
    "PRIOR_CHOICES",
    "Assessment",
    "Example",
    "OutcomeFeatures",
    "OutcomeModel",
    "learn",
    "learnable",
    "prior_confidence",
    "prior_probability",
    "train",
    "weighted_brier",
]
