"""The feedback store: every action's outcome stored once, with exact running statistics.

``SqliteFeedbackStore`` is the embedded default, ``PostgresFeedbackStore`` the production
backend; both implement :class:`FeedbackStore` and keep aggregates that
:func:`recompute` reproduces exactly from the raw rows.
"""

from .aggregates import (
    KEY_FIELDS,
    Aggregate,
    FeedbackRow,
    ReliabilityBin,
    Totals,
    recompute,
    row_from_event,
    weighted_nearest_rank,
)
from .migrations import POSTGRES_MIGRATIONS, SQLITE_MIGRATIONS, Migration, pending
from .outcomes import ending_outcome, feedback_for, outcome_of, resource_saving_of, side_effects_of
from .postgres_store import PostgresFeedbackStore
from .retry import backoff_delay, is_retryable
from .sqlite_store import SqliteFeedbackStore
from .store import FeedbackStore, open_store, store_target

__all__ = [
    "KEY_FIELDS",
    "Aggregate",
    "FeedbackRow",
    "FeedbackStore",
    "Migration",
    "POSTGRES_MIGRATIONS",
    "PostgresFeedbackStore",
    "ReliabilityBin",
    "SQLITE_MIGRATIONS",
    "SqliteFeedbackStore",
    "Totals",
    "backoff_delay",
    "ending_outcome",
    "feedback_for",
    "is_retryable",
    "open_store",
    "outcome_of",
    "pending",
    "recompute",
    "resource_saving_of",
    "row_from_event",
    "side_effects_of",
    "store_target",
    "weighted_nearest_rank",
]
