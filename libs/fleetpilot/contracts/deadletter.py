"""The dead-letter envelope: a message no handler could take, kept whole with its reason."""

from __future__ import annotations

import msgspec

from .base import Event


class DeadLetter(Event, frozen=True, kw_only=True, tag="dlq.dead_letter.v1"):
    """Published on ``dlq.<original subject>``; ``data`` is the original bytes, untouched,
    unless ``truncated``: a message near the server's max payload does not fit whole in its
    letter (base64 makes it a third larger), so ``data`` holds its start, and ``original_at``
    (``<stream>:<sequence>``, empty for a message no stream kept) where the whole stays until
    that stream's limits remove it."""

    subject: str
    reason: str
    error: str = ""
    service: str = ""
    deliveries: int = 1
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    data: bytes
    at: float
    truncated: bool = False
    original_at: str = ""
