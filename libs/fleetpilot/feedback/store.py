"""The feedback store interface, shared by the SQLite and PostgreSQL implementations."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from fleetpilot.contracts import FeedbackRecorded

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


async def open_store(url: str, *, schema: str = "fleetpilot_feedback") -> FeedbackStore:
    """Open the store a config URL names: ``postgresql://...`` (or ``postgres://``) for
    PostgreSQL in ``schema``; for SQLite ``sqlite:///relative.db``, ``sqlite:////abs/path.db``
    (SQLAlchemy's convention) or a bare path."""
    if url.startswith(("postgresql://", "postgres://")):
        from .postgres_store import PostgresFeedbackStore

        return await PostgresFeedbackStore.open(url, schema=schema)
    from .sqlite_store import SqliteFeedbackStore

    return SqliteFeedbackStore(url.removeprefix("sqlite:///"))
