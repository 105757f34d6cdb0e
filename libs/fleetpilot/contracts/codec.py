"""JSON encoding of events, with encoders and decoders built once per type.

JSON (not msgpack) is the wire format so that any language can read the bus with nothing
but ``proto/``. A decoder accepts only the event types declared for it: an unknown tag,
a wrong type or broken JSON raises ``msgspec.DecodeError`` / ``ValidationError``, which the
runtime turns into a dead letter.

JSON has no NaN nor infinity, and msgspec writes them as ``null``: every consumer then
failed to decode the event (a float got ``null``), far from whoever made the value, or
read an optional bound as "not set". ``encode`` refuses them instead (``NonFiniteFloat``),
so the producer fails where the value was made; a value meant to be unbounded is sent as
``None`` where its field allows it (``SlaRequest``: ``None`` = no bound).
"""

from __future__ import annotations

import math
import re
from functools import cache
from typing import Any, Union

import msgspec

from .base import Event

_ENCODER = msgspec.json.Encoder()
_PACKER = msgspec.msgpack.Encoder()
# msgspec writes every float to MessagePack as a float 64: 0xcb, then its IEEE 754 bits,
# big-endian. NaN and the infinities are exactly the floats whose 11 exponent bits are all
# ones, so their bytes always match this; a match elsewhere (inside an int's or another
# float's bytes) only costs the walk that finds the field.
_NON_FINITE_FLOAT64 = re.compile(rb"\xcb[\x7f\xff][\xf0-\xff]")


class NonFiniteFloat(ValueError):
    """An event or record holds NaN or an infinity, which JSON cannot carry. A ``ValueError``:
    no retry can change the value, and the runtime dead-letters the message whose handling
    made it (reason ``unencodable``)."""

    def __init__(self, type_name: str, path: str, value: float) -> None:
        super().__init__(f"{type_name} cannot be encoded: {path} is {value!r} (JSON has no NaN or infinity; "
                         "msgspec would write null, which no consumer decodes as a float)")
        self.path = path
        """Where the value is, as msgspec names a field in its errors: ``$.gpus[1].power_w``."""


def encode(event: msgspec.Struct) -> bytes:
    """Encode an event (or any record) to JSON bytes; raises ``NonFiniteFloat`` (one line,
    naming the field) when it holds NaN or an infinity."""
    data = _ENCODER.encode(event)
    # The check is on the hot path (telemetry), so it is cheap first, exact after:
    # - msgspec writes NaN and infinities as null, so only an encoding with a null can hold
    #   one; looking for it costs a fraction of the encoding (find: ``in`` is slower on bytes);
    # - most nulls are a None (an optional field, a process with no task): MessagePack tells
    #   those from NaN at about the cost of another encoding;
    # - the walk in Python that names the field (tens of microseconds) runs only for a NaN or
    #   an infinity, or the rare look-alike.
    if data.find(b"null") != -1 and _may_hold_non_finite(event):
        found = _non_finite(event)
        if found is not None:
            value, steps = found
            raise NonFiniteFloat(type(event).__name__, "$" + "".join(reversed(steps)), value)
    return data


def _may_hold_non_finite(event: msgspec.Struct) -> bool:
    """False only when ``event`` surely holds no NaN nor infinity (``_NON_FINITE_FLOAT64``)."""
    try:
        packed = _PACKER.encode(event)
    except (OverflowError, msgspec.EncodeError):
        return True  # an int beyond 64 bits, which JSON takes and MessagePack does not: walk
    return _NON_FINITE_FLOAT64.search(packed) is not None


def _non_finite(value: Any) -> tuple[float, list[str]] | None:
    """The first NaN or infinity in ``value`` (structs, lists, tuples, dicts, sets: what an
    event is made of) and the steps to it, innermost first; ``None`` when there is none."""
    if type(value) is float:  # msgspec encodes no float subclass (numpy's neither)
        return None if math.isfinite(value) else (value, [])
    if isinstance(value, msgspec.Struct):
        for name, wire in zip(value.__struct_fields__, value.__struct_encode_fields__, strict=True):
            found = _non_finite(getattr(value, name))
            if found is not None:
                found[1].append(f".{wire}")
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _non_finite(item)
            if found is not None:
                found[1].append(f"[{index}]")
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _non_finite(item)
            if found is not None:
                found[1].append(f"[{key!r}]")
                return found
    elif isinstance(value, set | frozenset):
        for item in value:
            found = _non_finite(item)
            if found is not None:
                found[1].append("[*]")
                return found
    return None


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
