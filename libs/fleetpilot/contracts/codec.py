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


class _TagOnly(msgspec.Struct):
    """Just the ``type`` of a payload, read to explain why it did not decode."""

    type: Any = None


_TAG_ONLY = msgspec.json.Decoder(_TagOnly)


class EventDecoder:
    """A decoder for a tagged union of event types whose errors name an unknown tag as such.

    msgspec says only ``Invalid value 'task.submitted.v2' - at `$.type```; in a dead letter
    that reads like a malformed field, while it is an event this consumer does not know (a
    producer on a newer version, or another event on the subject), and the operator needs
    the tags it does take to tell which."""

    def __init__(self, event_types: tuple[type[Event], ...]) -> None:
        members = event_types if len(event_types) > 1 else (*event_types, _NoEvent)
        target: Any = Union[members]  # noqa: UP007
        self._decoder = msgspec.json.Decoder(target)
        self.tags: tuple[str, ...] = tuple(str(t.__struct_config__.tag) for t in event_types)
        """The tags this decoder accepts."""

    def decode(self, data: bytes) -> Any:
        """Decode ``data`` as one of the event types; raises ``msgspec.DecodeError`` or
        ``msgspec.ValidationError`` (one line) on anything else."""
        try:
            event = self._decoder.decode(data)
        except msgspec.ValidationError as exc:
            tag = self._unknown_tag(data)
            if tag is None:
                raise
            raise self._unknown(tag) from exc
        if type(event) is _NoEvent:
            # The placeholder's own tag decodes to it: no handler could take that.
            raise self._unknown(_NoEvent.__struct_config__.tag)
        return event

    def _unknown(self, tag: object) -> msgspec.ValidationError:
        return msgspec.ValidationError(
            f"unknown event type {tag!r} (this consumer takes {', '.join(self.tags)}): an event of "
            "a newer version than this consumer knows, or another event on this subject")

    def _unknown_tag(self, data: bytes) -> str | None:
        """The payload's ``type`` when it is a string this decoder does not accept."""
        try:
            tag = _TAG_ONLY.decode(data).type
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return tag if isinstance(tag, str) and tag not in self.tags else None


@cache
def decoder_for(*event_types: type[Event]) -> EventDecoder:
    """A cached decoder for a tagged union of the given event types (the tag is required)."""
    return EventDecoder(event_types)


def decode(data: bytes, *event_types: type[Event]) -> Any:
    """Decode ``data`` as one of ``event_types``; raises on anything else."""
    return decoder_for(*event_types).decode(data)
