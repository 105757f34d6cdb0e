"""The root of every wire event.

Every event is a frozen, keyword-only ``msgspec.Struct`` carrying a versioned tag in the
``type`` field (``"task.submitted.v1"``). Unknown fields are tolerated on purpose: a newer
producer may add fields with defaults and older consumers keep working.
"""

from __future__ import annotations

import time

import msgspec


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base class of all events; subclasses set ``tag="<family>.<name>.v<N>"``."""


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """Base class of the plain (untagged) structs nested inside events."""


def now() -> float:
    """Wall-clock time in seconds since the epoch, the unit of every ``*_at`` field."""
    return time.time()
