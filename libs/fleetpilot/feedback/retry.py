"""Exponential backoff with jitter for retrying conflicting transactions (pure)."""

from __future__ import annotations

import random

RETRYABLE_SQLSTATES: frozenset[str] = frozenset({"40001", "40P01"})
"""Serialization failure and deadlock: the transaction did nothing and may simply rerun."""


def backoff_delay(
    attempt: int, *, base_s: float = 0.002, cap_s: float = 0.25, rng: random.Random | None = None
) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based), "equal jitter" style.

    The ceiling doubles per attempt up to ``cap_s``; the wait is half the ceiling plus a
    uniform random share of the other half, so writers that collided once spread out
    instead of colliding again in lock-step, while every retry still waits a little.
    """
    # The exponent is bounded: 2**1024 is no float, and the 1024th retry raised
    # OverflowError instead of waiting (any cap is reached long before 2**64 times the base).
    ceiling = min(cap_s, base_s * 2.0 ** min(max(attempt, 0), 64))
    draw = (rng or random).random()
    return ceiling / 2 + draw * ceiling / 2


def is_retryable(error: BaseException) -> bool:
    """Whether ``error`` is a database error whose SQLSTATE says "just run it again"."""
    return getattr(error, "sqlstate", None) in RETRYABLE_SQLSTATES
