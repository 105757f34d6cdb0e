"""The FeedbackStore contract on both backends (PostgreSQL skipped locally when absent)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import msgspec
import pytest
from fleetpilot.feedback import (
    KEY_FIELDS,
    PostgresFeedbackStore,
    SqliteFeedbackStore,
    recompute,
    row_from_event,
)
from fleetpilot.feedback.migrations import POSTGRES_MIGRATIONS, SQLITE_MIGRATIONS
from fleetpilot.feedback.store import FeedbackStore, open_store
from fleetpilot.feedback.synthetic import writer_stream


async def test_each_action_stored_once(any_store: FeedbackStore) -> None:
    events = writer_stream(0, 50, seed=1)
    assert [await any_store.record(e) for e in events] == [True] * 50
    assert [await any_store.record(e) for e in events[:5]] == [False] * 5
    stored = [e async for e in any_store.raw()]
    assert sorted(e.action_id for e in stored) == sorted(e.action_id for e in events)
    assert {e.action_id: e for e in stored} == {e.action_id: e for e in events}  # lossless round trip
    assert sum(a.count for a in await any_store.aggregates()) == 50


@pytest.mark.parametrize("by", [KEY_FIELDS, ("policy", "shard_id"), ("gpu_model",), ()])
async def test_aggregates_equal_recomputation(any_store: FeedbackStore, by: tuple[str, ...]) -> None:
    events = writer_stream(1, 300, seed=2)
    for e in events:
        await any_store.record(e)
    expected = recompute([row_from_event(e) for e in events], by)
    assert await any_store.aggregates(by) == expected
    assert expected  # the comparison is not vacuous


async def test_empty_store(any_store: FeedbackStore) -> None:
    assert await any_store.aggregates() == []
    assert await any_store.aggregates(()) == []
    assert [e async for e in any_store.raw()] == []


async def test_sqlite_migrations_idempotent(tmp_path: Path) -> None:
    path = tmp_path / "f.db"
    first = SqliteFeedbackStore(path)
    await first.record(writer_stream(0, 1)[0])
    await first.close()
    again = SqliteFeedbackStore(path)  # reopening applies nothing and keeps the data
    assert again.applied_migrations() == [m.version for m in SQLITE_MIGRATIONS]
    assert len([e async for e in again.raw()]) == 1
    await again.close()


async def test_postgres_migrations_idempotent(pg_store: PostgresFeedbackStore, pg_dsn: str) -> None:
    await pg_store.record(writer_stream(0, 1)[0])
    again = await PostgresFeedbackStore.open(pg_dsn, schema=pg_store.schema)
    try:
        assert await again.applied_migrations() == [m.version for m in POSTGRES_MIGRATIONS]
        assert len([e async for e in again.raw()]) == 1
    finally:
        await again.close()


def test_both_backends_satisfy_the_protocol(tmp_path: Path) -> None:
    store = SqliteFeedbackStore(tmp_path / "p.db")
    assert isinstance(store, FeedbackStore)
    assert all(hasattr(PostgresFeedbackStore, m) for m in ("record", "aggregates", "raw", "close"))


async def test_postgres_concurrent_startups_migrate_once(pg_dsn: str) -> None:
    schema = f"fp_test_{uuid.uuid4().hex[:12]}"
    stores = await asyncio.gather(*(PostgresFeedbackStore.open(pg_dsn, schema=schema) for _ in range(4)))
    try:
        expected = [m.version for m in POSTGRES_MIGRATIONS]
        assert [await s.applied_migrations() for s in stores] == [expected] * 4
        assert await stores[0].record(writer_stream(0, 1)[0])
        assert not await stores[3].record(writer_stream(0, 1)[0])
    finally:
        await stores[0].drop_schema()
        for s in stores:
            await s.close()


async def test_postgres_rejects_unsafe_schema_names(pg_dsn: str) -> None:
    with pytest.raises(ValueError):
        await PostgresFeedbackStore.open(pg_dsn, schema='x"; DROP TABLE y; --')


async def test_raw_order_is_bytewise_on_every_backend(any_store: FeedbackStore) -> None:
    ids = ["b", "B", "a-1", "a_1", "Z", "a1", "é"]
    template = writer_stream(0, 1)[0]
    for action_id in ids:
        await any_store.record(msgspec.structs.replace(template, action_id=action_id))
    assert [e.action_id async for e in any_store.raw()] == sorted(ids, key=lambda s: s.encode())


@pytest.mark.parametrize("prefix", ["sqlite:///", ""])
async def test_open_store_from_url_sqlite(tmp_path: Path, prefix: str) -> None:
    store = await open_store(f"{prefix}{tmp_path / 'u.db'}")
    assert isinstance(store, SqliteFeedbackStore)
    assert await store.record(writer_stream(0, 1)[0])
    await store.close()


async def test_open_store_from_url_postgres(pg_dsn: str) -> None:
    store = await open_store(pg_dsn, schema=f"fp_test_{uuid.uuid4().hex[:12]}")
    assert isinstance(store, PostgresFeedbackStore)
    await store.drop_schema()
    await store.close()
