"""JSON encoding of events, with encoders and decoders built once per type.

JSON (not msgpack) is the wire format so that any language can read the bus with nothing
but ``proto/``. A decoder accepts only the event types declared for it: an unknown tag,
a wrong type or broken JSON raises ``msgspec.DecodeError`` / ``ValidationError``, which the
runtime turns into a dead letter.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Union

import msgspec

from .base import Event

_ENCODER = msgspec.json.Encoder()


def encode(event: msgspec.Struct) -> bytes:
    """Encode an event (or any record) to JSON bytes."""
    return _ENCODER.encode(event)


class _NoEvent(Event, frozen=True, kw_only=True, tag="_"):
    """Never sent: makes a single type a union, so that msgspec requires the ``type`` tag."""


@cache
def decoder_for(*event_types: type[Event]) -> msgspec.json.Decoder:
    """A cached decoder for a tagged union of the given event types (the tag is required)."""
    members = event_types if len(event_types) > 1 else (*event_types, _NoEvent)
    target: Any = Union[members]  # noqa: UP007
    return msgspec.json.Decoder(target)


def decode(data: bytes, *event_types: type[Event]) -> Any:
    """Decode ``data`` as one of ``event_types``; raises on anything else."""
    return decoder_for(*event_types).decode(data)
