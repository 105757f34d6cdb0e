"""The FeedbackStore contract on both backends (PostgreSQL skipped locally when absent)."""

from __future__ import annotations

import asyncio
import multiprocessing
import sqlite3
import threading
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
from fleetpilot.feedback.aggregates import MAX_LATENCY_US, BinTotals, Totals, totals_of
from fleetpilot.feedback.migrations import (
    POSTGRES_MIGRATIONS,
    RAW_COLUMNS,
    SQLITE_MIGRATIONS,
    SUM_FIELDS_V1,
    raw_values,
)
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


def _open_sqlite_store(path: str, start: multiprocessing.synchronize.Barrier) -> None:
    start.wait()
    SqliteFeedbackStore(path)  # an error here exits the process with code 1


def test_sqlite_replicas_starting_at_once_on_a_new_file_all_start(tmp_path: Path) -> None:
    """Replicas sharing one file, started together on a new one (``fleetpilot up``, a host's
    first boot): the switch to WAL did not wait on the busy timeout, and in one round of four
    replicas in four to eight one failed with "database is locked"."""
    fork = multiprocessing.get_context("fork")
    for round_ in range(50):
        path = str(tmp_path / f"f{round_}.db")
        start = fork.Barrier(4)
        replicas = [fork.Process(target=_open_sqlite_store, args=(path, start)) for _ in range(4)]
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.join(60)
        assert [r.exitcode for r in replicas] == [0] * 4, f"round {round_}"
        assert SqliteFeedbackStore(path).applied_migrations() == [m.version for m in SQLITE_MIGRATIONS]


def test_a_sqlite_start_up_waits_for_a_write_lock_held_on_a_new_file(tmp_path: Path) -> None:
    """The mechanism of the race above, made certain: a replica switching a new file to WAL
    while another holds its write lock got "database is locked" at once (SQLite does not
    wait on the busy timeout there), instead of waiting as every other statement does."""
    path = tmp_path / "f.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("CREATE TABLE another_replicas_work (x)")
    release = threading.Timer(0.3, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        began = time.monotonic()
        store = SqliteFeedbackStore(path)
        assert time.monotonic() - began >= 0.2  # it waited for the lock, then opened
        assert store.applied_migrations() == [m.version for m in SQLITE_MIGRATIONS]
    finally:
        release.join()
        holder.close()


async def test_postgres_migrations_idempotent(pg_store: PostgresFeedbackStore, pg_dsn: str) -> None:
    await pg_store.record(writer_stream(0, 1)[0])
    again = await PostgresFeedbackStore.open(pg_dsn, schema=pg_store.schema)
    try:
        assert await again.applied_migrations() == [m.version for m in POSTGRES_MIGRATIONS]
        assert len([e async for e in again.raw()]) == 1
    finally:
        await again.close()


async def test_a_postgres_that_does_not_answer_fails_a_write_in_time_not_never(pg_dsn: str) -> None:
    """A lock nobody releases (an operator's LOCK TABLE, a stuck migration elsewhere) or a
    server behind a partition that drops packets: the write waited for ever, and the
    message's in-progress beats kept it from every other replica. It fails after the
    command timeout, so the message is retried, then dead-lettered, never stuck."""
    schema = f"fp_test_{uuid.uuid4().hex[:12]}"
    store = await PostgresFeedbackStore.open(pg_dsn, schema=schema, command_timeout_s=1.0)
    holder = await asyncpg.connect(pg_dsn)
    try:
        locked = holder.transaction()
        await locked.start()
        await holder.execute(f'LOCK TABLE "{schema}".feedback_raw IN ACCESS EXCLUSIVE MODE')
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(store.record(writer_stream(0, 1)[0]), timeout=30)
        assert time.monotonic() - began < 15  # the store's own timeout, not the test's
        await locked.rollback()
        assert await store.record(writer_stream(0, 1)[0])  # the lock gone: written
    finally:
        await holder.close()
        await store.drop_schema()
        await store.close()


async def test_a_command_timeout_that_cannot_work_is_refused(pg_dsn: str) -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="command_timeout_s"):
            await PostgresFeedbackStore.open(pg_dsn, schema="fp_never_made", command_timeout_s=bad)


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


_MIGRATIONS_TABLE = ("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL,"
                     " applied_at DOUBLE PRECISION NOT NULL)")


def sqlite_at_version(path: Path, version: int) -> sqlite3.Connection:
    """A connection to a new SQLite database at ``path`` migrated as a store of ``version``
    left it (the first ``version`` migrations, recorded), to write that version's rows into."""
    db = sqlite3.connect(str(path))
    db.execute(_MIGRATIONS_TABLE)
    for m in SQLITE_MIGRATIONS[:version]:
        for statement in m.statements:
            db.execute(statement)
        db.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", (m.version, m.name, time.time()))
    return db


async def postgres_at_version(dsn: str, schema: str, version: int) -> asyncpg.Connection:
    """A connection whose search path is the new ``schema``, migrated as a store of ``version``
    left it; the caller closes it."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
        await conn.execute(f'SET search_path TO "{schema}"')
        await conn.execute(_MIGRATIONS_TABLE)
        for m in POSTGRES_MIGRATIONS[:version]:
            for statement in m.statements:
                await conn.execute(statement)
            await conn.execute("INSERT INTO schema_migrations VALUES ($1, $2, $3)", m.version, m.name, time.time())
    except BaseException:
        await conn.close()
        raise
    return conn


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
    db = sqlite_at_version(path, 2)
    old = _v2_events()
    for e in old:
        for sql, args in _v2_writes(e, lambda i: "?"):
            db.execute(sql, args)
    db.commit()
    db.close()
    store = SqliteFeedbackStore(path)
    try:
        assert store.applied_migrations() == [m.version for m in SQLITE_MIGRATIONS]
        await _check_upgraded(store, old)
    finally:
        await store.close()


async def test_postgres_upgrade_keeps_version_2_data(pg_dsn: str) -> None:
    schema = f"fp_test_{uuid.uuid4().hex[:12]}"
    conn = await postgres_at_version(pg_dsn, schema, 2)
    try:
        old = _v2_events()
        for e in old:
            for sql, args in _v2_writes(e, lambda i: f"${i}"):
                await conn.execute(sql, *args)
    finally:
        await conn.close()
    store = await PostgresFeedbackStore.open(pg_dsn, schema=schema)
    try:
        assert await store.applied_migrations() == [m.version for m in POSTGRES_MIGRATIONS]
        await _check_upgraded(store, old)
    finally:
        await store.drop_schema()
        await store.close()


# --- upgrading a version-4 database (SQLite's aggregate sums 64-bit integers) -------------

_V4_SUMS = (*SUM_FIELDS_V1, "measured")  # the aggregate sums as version 4 left them


def _v4_data() -> tuple[list, list[tuple], list[tuple], list[tuple]]:
    """Events and the rows a version-4 store held for them: ``(events, raw, aggregate,
    calibration)``, each row in its table's column order. One key has 10,000 latencies of
    ``MAX_LATENCY_US`` at weight 1, so its ``latency_us`` and ``weighted_latency`` sums lie
    within 6,000 of 2**63 - 1, the most a version-4 SQLite row could hold (written directly:
    ten thousand records through ``record`` would be slow); the others are ordinary."""
    base = writer_stream(0, 1, seed=7, shared_every=0)[0]
    latency = Measured(value=MAX_LATENCY_US / 1000.0, uncertainty_score=0.9999)  # weight_units 1
    events = [msgspec.structs.replace(base, action_id=f"long-{i:05d}", latency_ms=latency) for i in range(10_000)]
    events += writer_stream(4, 60, seed=9, shared_every=0)
    rows = [row_from_event(e) for e in events]
    sums: dict[tuple, Totals] = {}
    bins: dict[tuple, BinTotals] = {}
    for row in rows:
        sums.setdefault(row.key, Totals()).add(totals_of(row))
        bins.setdefault((*row.key, row.calibration_bin), BinTotals()).add(
            BinTotals(count=1, confidence_units=row.confidence_units, successes=row.success))
    near = sums[rows[0].key]
    assert rows[0].weight_units == 1 and 2**63 - 6_000 < near.latency_us == near.weighted_latency < 2**63
    raw = [raw_values(row, e) for row, e in zip(rows, events, strict=True)]
    agg = [(*key, *(getattr(t, f) for f in _V4_SUMS)) for key, t in sums.items()]
    cal = [(*key, b.count, b.confidence_units, b.successes) for key, b in bins.items()]
    return events, raw, agg, cal


_V4_INSERTS = (
    ("feedback_raw", RAW_COLUMNS),
    ("feedback_aggregate", (*KEY_FIELDS, *_V4_SUMS)),
    ("feedback_calibration", (*KEY_FIELDS, "bin", "count", "confidence_units", "successes")),
)


async def _check_upgraded_from_v4(store: FeedbackStore, events: list) -> None:
    """Same figures as before the upgrade; then the near key's sums pass 2**63, still exact."""
    rows = [row_from_event(e) for e in events]
    groupings = (KEY_FIELDS, ("policy", "action"), ())
    for by in groupings:
        assert await store.aggregates(by) == recompute(rows, by)
    more = [msgspec.structs.replace(events[0], action_id=f"past-{i}",
                                    latency_ms=Measured(value=600_000.0, uncertainty_score=0.0)) for i in range(2)]
    for e in more:
        assert await store.record(e)  # a version-4 SQLite store raised OverflowError here
    rows += [row_from_event(e) for e in more]
    for by in groupings:
        assert await store.aggregates(by) == recompute(rows, by)
    key = dict(zip(KEY_FIELDS, rows[0].key, strict=True))
    [near] = [a.totals for a in await store.aggregates() if a.key == key]
    assert near.latency_us > 2**63 and near.weighted_latency > 2**63


async def test_sqlite_upgrade_from_version_4_serves_the_same_figures_past_64_bits(tmp_path: Path) -> None:
    path = tmp_path / "v4.db"
    db = sqlite_at_version(path, 4)
    events, *tables = _v4_data()
    for (table, columns), values in zip(_V4_INSERTS, tables, strict=True):
        marks = ", ".join("?" for _ in columns)
        db.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})", values)
    db.commit()
    assert db.execute("SELECT DISTINCT typeof(latency_us) FROM feedback_aggregate").fetchall() == [("integer",)]
    db.close()
    store = SqliteFeedbackStore(path)
    try:
        assert store.applied_migrations() == [1, 2, 3, 4, 5]
        await _check_upgraded_from_v4(store, events)
    finally:
        await store.close()
    db = sqlite3.connect(str(path))
    try:  # declared TEXT, so SQLite keeps the digits rather than turning them into a REAL
        assert db.execute("SELECT DISTINCT typeof(latency_us), typeof(weighted_latency) FROM feedback_aggregate"
                          ).fetchall() == [("text", "text")]
    finally:
        db.close()


async def test_sqlite_upgrade_reads_a_sum_an_older_version_turned_into_a_float(tmp_path: Path) -> None:
    # Before the overflow check, SQLite's `+` turned a sum past 64 bits into a REAL; such a
    # sum (inexact already) must still read back as an integer after the conversion to text.
    path = tmp_path / "real.db"
    db = sqlite_at_version(path, 4)
    db.execute("INSERT INTO feedback_aggregate (policy, shard_id, task_kind, gpu_model, action, count,"
               " weight_units, weighted_latency) VALUES ('p', 's', 'k', 'g', '', 2, 20000, 1e19)")
    db.commit()
    db.close()
    store = SqliteFeedbackStore(path)
    try:
        [aggregate] = await store.aggregates()
        assert aggregate.totals.weighted_latency == 10**19 and isinstance(aggregate.totals.weighted_latency, int)
        assert aggregate.weighted_mean_latency_ms == 10**19 / 20_000 / 1000
    finally:
        await store.close()


async def test_postgres_upgrade_from_version_4_serves_the_same_figures_past_64_bits(pg_dsn: str) -> None:
    schema = f"fp_test_{uuid.uuid4().hex[:12]}"
    conn = await postgres_at_version(pg_dsn, schema, 4)
    try:
        events, *tables = _v4_data()
        for (table, columns), values in zip(_V4_INSERTS, tables, strict=True):
            await conn.copy_records_to_table(table, records=values, columns=columns, schema_name=schema)
    finally:
        await conn.close()
    store = await PostgresFeedbackStore.open(pg_dsn, schema=schema)
    try:
        assert await store.applied_migrations() == [1, 2, 3, 4, 5]
        await _check_upgraded_from_v4(store, events)
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


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+asyncpg://postgres@127.0.0.1:5432/test",  # SQLAlchemy's spelling
        "postgresq://postgres@127.0.0.1:5432/test",  # a typo
        "sqlite://feedback.db",  # two slashes: no path in SQLAlchemy's convention either
        "mysql://user@db/fleetpilot",
    ],
)
async def test_a_url_of_another_scheme_is_refused_not_taken_for_a_sqlite_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    # Anything but postgresql:// or postgres:// was taken for a SQLite path: the store
    # opened a file such as ./postgresql+asyncpg:/postgres@127.0.0.1:5432/test and kept
    # every record there, on a container's disk, while the operator believed them in
    # PostgreSQL.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="scheme"):
        await open_store(url)
    assert list(tmp_path.iterdir()) == []  # no file, no folder made


async def test_a_postgres_url_is_known_whatever_the_case_of_its_scheme(pg_dsn: str) -> None:
    # URL schemes are case-insensitive (RFC 3986): POSTGRESQL:// opened a SQLite file.
    upper = pg_dsn.replace("postgresql://", "POSTGRESQL://", 1).replace("postgres://", "POSTGRES://", 1)
    store = await open_store(upper, schema=f"fp_test_{uuid.uuid4().hex[:12]}")
    try:
        assert isinstance(store, PostgresFeedbackStore)
    finally:
        await store.drop_schema()
        await store.close()


async def test_a_store_that_may_not_try_even_once_is_refused(pg_dsn: str) -> None:
    # max_attempts=0 ran no attempt and raised AssertionError("unreachable") on every write.
    with pytest.raises(ValueError, match="max_attempts"):
        await PostgresFeedbackStore.open(pg_dsn, schema=f"fp_test_{uuid.uuid4().hex[:12]}", max_attempts=0)


async def test_a_result_come_after_the_judgement_amends_the_record_once(any_store: FeedbackStore) -> None:
    """A placement whose end was handled before its result is stored with its latency
    unknown (0, uncertainty 1: weight 0) and no resource saving (the end names no GPU share);
    the late result's latency, and a success's saving, amend it, once, and the sums stay
    those of a recomputation from the raw rows."""
    events = writer_stream(0, 40, seed=5)
    blind = [msgspec.structs.replace(e, latency_ms=Measured(value=0.0, uncertainty_score=1.0), resource_saving_mb=0.0)
             for e in events[:20]]
    events = blind + events[20:]
    for e in events:
        assert await any_store.record(e)
    timed = Measured(value=37.5, uncertainty_score=0.05)
    before = await any_store.aggregates()
    success = next(e for e in blind if e.outcome == "success")
    failure = next(e for e in blind if e.outcome != "success")

    amended = await any_store.amend_late_result(success.action_id, timed, 12_345.0)
    amended_failure = await any_store.amend_late_result(failure.action_id, timed, 12_345.0)

    assert amended == msgspec.structs.replace(success, latency_ms=timed, resource_saving_mb=12_345.0)
    assert amended_failure == msgspec.structs.replace(failure, latency_ms=timed)  # saved nothing
    assert await any_store.get(success.action_id) == amended  # get and raw read it amended
    truth = [{amended.action_id: amended, failure.action_id: amended_failure}.get(e.action_id, e) for e in events]
    for by in (KEY_FIELDS, ("policy",), ()):
        assert await any_store.aggregates(by) == recompute([row_from_event(e) for e in truth], by), by
        assert await any_store.aggregates(by) == recompute([row_from_event(e) async for e in any_store.raw()], by)
    after = {tuple(a.key.values()): a for a in await any_store.aggregates()}
    key = tuple(row_from_event(amended).key)
    old = next(a for a in before if tuple(a.key.values()) == key)
    assert (after[key].measured, after[key].count) == (old.measured + 1 + (row_from_event(failure).key == key),
                                                       old.count)
    assert after[key].total_resource_saving_mb == pytest.approx(old.total_resource_saving_mb + 12_345.0)

    # Once: a redelivered result, another latency, adds nothing.
    assert await any_store.amend_late_result(success.action_id, timed, 12_345.0) is None
    assert await any_store.amend_late_result(success.action_id, Measured(value=99.0, uncertainty_score=0.0), 0.0) is None
    # A record measured already, one not stored, a latency that is no measurement: unchanged.
    measured = next(e for e in events[20:] if row_from_event(e).weight_units > 0)
    assert await any_store.amend_late_result(measured.action_id, timed, 12_345.0) is None
    assert await any_store.amend_late_result("act-never-stored", timed, 0.0) is None
    untouched = next(e for e in blind if e.action_id not in (success.action_id, failure.action_id))
    assert await any_store.amend_late_result(untouched.action_id, Measured(value=5.0, uncertainty_score=1.0), 0.0) is None
    assert await any_store.get(untouched.action_id) == untouched
    assert await any_store.aggregates() == recompute([row_from_event(e) for e in truth])
