"""The dead-letter envelope: a message no handler could take, kept whole with its reason."""

from __future__ import annotations

import msgspec

from .base import Event


class DeadLetter(Event, frozen=True, kw_only=True, tag="dlq.dead_letter.v1"):
    """Published on ``dlq.<original subject>``; ``data`` is the original bytes, untouched."""

    subject: str
    reason: str
    error: str = ""
    service: str = ""
    deliveries: int = 1
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    data: bytes
    at: float
