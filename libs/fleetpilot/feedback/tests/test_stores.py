"""The FeedbackStore contract on both backends (PostgreSQL skipped locally when absent)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from pathlib import Path

import asyncpg
import msgspec
import pytest
from fleetpilot.contracts import Measured, encode
from fleetpilot.feedback import (
    KEY_FIELDS,
    PostgresFeedbackStore,
    SqliteFeedbackStore,
    recompute,
    row_from_event,
)
from fleetpilot.feedback.aggregates import totals_of
from fleetpilot.feedback.migrations import POSTGRES_MIGRATIONS, SQLITE_MIGRATIONS, SUM_FIELDS_V1
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
    # One record looked up by its action_id, as it was stored.
    assert await any_store.get(events[3].action_id) == events[3]
    assert await any_store.get("act-never-stored") is None


@pytest.mark.parametrize("by", [KEY_FIELDS, ("policy", "shard_id"), ("gpu_model",), ()])
async def test_aggregates_equal_recomputation(any_store: FeedbackStore, by: tuple[str, ...]) -> None:
    events = writer_stream(1, 300, seed=2)
    for e in events:
        await any_store.record(e)
    expected = recompute([row_from_event(e) for e in events], by)
    assert await any_store.aggregates(by) == expected
    assert expected  # the comparison is not vacuous


async def test_latency_figures_count_measured_records_only(any_store: FeedbackStore) -> None:
    """A record judged without its action's result (latency 0, uncertainty 1) and a latency
    measured with little confidence weigh nothing, or little, in the latency figures."""
    base = writer_stream(0, 1)[0]

    def record(i: int, latency: float, uncertainty: float):
        return msgspec.structs.replace(base, action_id=f"a{i:03d}", latency_ms=Measured(value=latency,
                                       uncertainty_score=uncertainty))

    events = [record(i, 0.0, 1.0) for i in range(30)]  # judged blind
    events += [record(100 + i, 10.0, 0.0) for i in range(90)]  # timed, trusted
    events += [record(200 + i, 900.0, 0.9) for i in range(10)]  # timed, barely trusted
    for e in events:
        assert await any_store.record(e)
    [agg] = await any_store.aggregates(())
    assert (agg.count, agg.measured) == (130, 100)
    assert agg.mean_latency_ms == pytest.approx((90 * 10 + 10 * 900) / 100)
    assert agg.p95_latency_ms == pytest.approx(10.0)
    assert [agg] == recompute([row_from_event(e) for e in events], ())


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
    with pytest.raises(ValueError, match="schema must be a lower-case SQL identifier"):
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


# --- upgrading a version-2 database (four-field key, latency summed over every record) ----

_V2_KEYS = ("policy", "shard_id", "task_kind", "gpu_model")
_V2_RAW = ("action_id", *_V2_KEYS, "success", "weight_units", "latency_us", "saving_milli_mb", "confidence_units",
           "side_effects", "recorded_at", "payload")


def _v2_writes(event, mark) -> list[tuple[str, tuple]]:
    """The rows a version-2 store wrote for ``event``, as ``(sql, args)`` with ``mark(i)``
    the backend's i-th placeholder (plain inserts: every event has its own key here)."""
    row = row_from_event(event)
    totals = totals_of(row)
    keys = tuple(getattr(row, k) for k in _V2_KEYS)
    raw = (row.action_id, *keys, row.success, row.weight_units, row.latency_us, row.saving_milli_mb,
           row.confidence_units, row.side_effects, event.recorded_at, encode(event).decode())
    # As version 2 summed them: every record's latency, measured or not.
    totals.latency_us = row.latency_us
    agg = (*keys, *(getattr(totals, f) for f in SUM_FIELDS_V1))
    cal = (*keys, row.calibration_bin, 1, row.confidence_units, row.success)

    def insert(table: str, columns: tuple[str, ...], args: tuple) -> tuple[str, tuple]:
        marks = ", ".join(mark(i + 1) for i in range(len(args)))
        return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})", args

    return [insert("feedback_raw", _V2_RAW, raw),
            insert("feedback_aggregate", (*_V2_KEYS, *SUM_FIELDS_V1), agg),
            insert("feedback_calibration", (*_V2_KEYS, "bin", "count", "confidence_units", "successes"), cal)]


def _v2_events() -> list:
    """Distinct keys, no action (a version-2 record had none)."""
    events = []
    for i, e in enumerate(writer_stream(3, 40, seed=5, shared_every=0)):
        events.append(msgspec.structs.replace(e, action="", task_kind=f"k{i}"))
    return events


async def _check_upgraded(store: FeedbackStore, old: list) -> None:
    """Old sums kept under action "", new records keyed by their action, all exact, the
    latency sums now over measured records only (the old ones summed every record's)."""
    new = [msgspec.structs.replace(e, action_id=f"new-{e.action_id}", action="migrate") for e in old[:10]]
    for e in new:
        assert await store.record(e)
    rows = [row_from_event(e) for e in old + new]
    assert await store.aggregates() == recompute(rows)
    by_action = {a.key["action"]: a.count for a in await store.aggregates(("action",))}
    assert by_action == {"": len(old), "migrate": len(new)}


async def test_sqlite_upgrade_keeps_version_2_data(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    db = sqlite3.connect(str(path))
    db.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL,"
               " applied_at DOUBLE PRECISION NOT NULL)")
    for m in SQLITE_MIGRATIONS[:2]:
        for statement in m.statements:
            db.execute(statement)
        db.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", (m.version, m.name, time.time()))
    old = _v2_events()
    for e in old:
        for sql, args in _v2_writes(e, lambda i: "?"):
            db.execute(sql, args)
    db.commit()
    db.close()
    store = SqliteFeedbackStore(path)
    try:
        assert store.applied_migrations() == [1, 2, 3, 4]
        await _check_upgraded(store, old)
    finally:
        await store.close()


async def test_postgres_upgrade_keeps_version_2_data(pg_dsn: str) -> None:
    schema = f"fp_test_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
        await conn.execute(f'SET search_path TO "{schema}"')
        await conn.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL,"
                           " applied_at DOUBLE PRECISION NOT NULL)")
        for m in POSTGRES_MIGRATIONS[:2]:
            for statement in m.statements:
                await conn.execute(statement)
            await conn.execute("INSERT INTO schema_migrations VALUES ($1, $2, $3)", m.version, m.name, time.time())
        old = _v2_events()
        for e in old:
            for sql, args in _v2_writes(e, lambda i: f"${i}"):
                await conn.execute(sql, *args)
    finally:
        await conn.close()
    store = await PostgresFeedbackStore.open(pg_dsn, schema=schema)
    try:
        assert await store.applied_migrations() == [1, 2, 3, 4]
        await _check_upgraded(store, old)
    finally:
        await store.drop_schema()
        await store.close()


async def test_raw_yields_a_record_whose_action_id_is_empty(any_store: FeedbackStore) -> None:
    # raw() paged from "after the empty string", so a stored record whose action_id is ""
    # (nothing in the contract forbids it) was counted in the aggregates but never read
    # back: a recomputation from raw() disagreed with the stored sums.
    events = [msgspec.structs.replace(e, action_id=i) for e, i in zip(writer_stream(0, 3, seed=3), ("", "a", "b"),
                                                                       strict=True)]
    for e in events:
        assert await any_store.record(e)
    stored = [e async for e in any_store.raw()]
    assert [e.action_id for e in stored] == ["", "a", "b"]
    assert await any_store.aggregates() == recompute([row_from_event(e) for e in stored])
