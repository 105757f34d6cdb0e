"""The root of every wire event.

Every event is a frozen, keyword-only ``msgspec.Struct`` carrying a versioned tag in the
``type`` field (``"task.submitted.v1"``). Unknown fields are tolerated on purpose: a newer
producer may add fields with defaults and older consumers keep working.
"""

from __future__ import annotations

import time

import msgspec

INT_KEYS = msgspec.Meta(extra_json_schema={"propertyNames": {"pattern": "^-?(0|[1-9][0-9]*)$"}})
"""Annotates a ``dict`` keyed by ``int`` (``Annotated[dict[int, int], INT_KEYS]``). JSON keys are
strings, and msgspec takes only those that spell an integer in decimal (``"48"``, not ``"048"``,
``"+48"`` or ``"48.0"``), while the schema it makes says only "an object": this puts the rule in
``proto/``, so that a client validating against it is refused nothing it took. Schema only: the
wire and the decoder are the same either way."""


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base class of all events; subclasses set ``tag="<family>.<name>.v<N>"``."""


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """Base class of the plain (untagged) structs nested inside events."""


def now() -> float:
    """Wall-clock time in seconds since the epoch, the unit of every ``*_at`` field."""
    return time.time()
