"""The feedback store interface, shared by the SQLite and PostgreSQL implementations."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from typing import Literal, Protocol, runtime_checkable

from fleetpilot.contracts import FeedbackRecorded, Measured

from .aggregates import KEY_FIELDS, Aggregate


@runtime_checkable
class FeedbackStore(Protocol):
    """Where every action's outcome is kept once, with statistics maintained as it grows.

    Implementations store the raw record and update the aggregate rows of its key in the
    same transaction, so a reader never sees one without the other.
    """

    async def record(self, event: FeedbackRecorded) -> bool:
        """Store one outcome; ``False`` when its ``action_id`` was already stored (no change)."""
        ...

    async def amend_late_result(self, action_id: str, latency: Measured,
                                saving_if_success_mb: float) -> FeedbackRecorded | None:
        """Give the record of ``action_id``, stored with its latency unknown (weight 0: judged
        before its action's result came), what the result brings: the measured ``latency``
        and, if the record is a success, ``saving_if_success_mb``
        (``aggregates.late_result_amendment``). Its raw row and its key's sums in one
        transaction, once (a row measured already is left alone, so a redelivered result adds
        nothing). The record as amended; ``None`` when nothing changed."""
        ...

    async def get(self, action_id: str) -> FeedbackRecorded | None:
        """The record stored for ``action_id`` as it was stored, ``None`` when there is none."""
        ...

    async def aggregates(self, by: Sequence[str] = KEY_FIELDS) -> list[Aggregate]:
        """Statistics grouped by a subset of ``KEY_FIELDS``, sorted by key."""
        ...

    def raw(self) -> AsyncIterator[FeedbackRecorded]:
        """Every stored record, in ``action_id`` order."""
        ...

    async def close(self) -> None:
        """Release connections; the store is unusable afterwards."""
        ...


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def store_target(url: str) -> tuple[Literal["postgresql", "sqlite"], str]:
    """The backend a store URL names and what to open: ``("postgresql", dsn)`` for
    ``postgresql://`` or ``postgres://`` (any case), ``("sqlite", path)`` for
    ``sqlite:///relative.db``, ``sqlite:////abs/path.db`` (SQLAlchemy's convention) or a
    bare path; ``ValueError`` for any other ``scheme://``.

    Anything else used to be taken for a SQLite path: ``postgresql+asyncpg://...`` (how
    SQLAlchemy spells it) or a typo opened a file like ``./postgresql+asyncpg:/user@db/x``
    and kept every record there, on the container's disk, while the operator believed them
    in PostgreSQL.
    """
    match = _SCHEME.match(url)
    if match is None:
        return "sqlite", url
    scheme = match.group(1).lower()
    rest = url[match.end():]
    if scheme in ("postgresql", "postgres"):
        # Schemes are case-insensitive (RFC 3986); asyncpg is handed the one it knows.
        return "postgresql", f"{scheme}://{rest}"
    if scheme == "sqlite" and rest.startswith("/") and len(rest) > 1:
        return "sqlite", rest[1:]
    raise ValueError(
        f"feedback store URL {url.split('@')[-1]!r}: unknown scheme {match.group(1)!r} or no path; use "
        "postgresql://user@host/db, postgres://..., sqlite:///relative.db, sqlite:////abs/path.db or a path"
    )


async def open_store(url: str, *, schema: str = "fleetpilot_feedback") -> FeedbackStore:
    """Open the store a config URL names (see :func:`store_target`): PostgreSQL in
    ``schema``, or SQLite."""
    kind, target = store_target(url)
    if kind == "postgresql":
        from .postgres_store import PostgresFeedbackStore

        return await PostgresFeedbackStore.open(target, schema=schema)
    from .sqlite_store import SqliteFeedbackStore

    return SqliteFeedbackStore(target)
