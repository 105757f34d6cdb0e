"""The default feedback store: one SQLite file (stdlib ``sqlite3``) in WAL mode.

One connection is shared behind a lock and every call runs in a worker thread
(``asyncio.to_thread``) so the event loop never blocks on disk. Each record is one
``BEGIN IMMEDIATE`` transaction that inserts the raw row (``INSERT OR IGNORE`` on the
``action_id`` key) and, only when the row is new, adds its contribution to the aggregate
and calibration rows. Several processes may share the file: WAL plus a busy timeout
serialises their writers.

The aggregate sums are decimal ``TEXT`` (schema version 5; see
``migrations._sqlite_sums_as_text``) added in Python, which has no 64-bit bound; the
calibration sums, which cannot come near one, stay integers added in SQL.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from fleetpilot.contracts import FeedbackRecorded, Measured, decode

from .aggregates import (
    KEY_FIELDS,
    TOTALS_FIELDS,
    Aggregate,
    BinTotals,
    Totals,
    assemble,
    late_result_amendment,
    p95_by_group,
    row_from_event,
    totals_of,
    validate_by,
)
from .migrations import MIGRATIONS_TABLE, SQLITE_MIGRATIONS, pending, raw_values, stored_payload
from .migrations import RAW_COLUMNS as _RAW_COLUMNS

T = TypeVar("T")

_KEYS = ", ".join(KEY_FIELDS)
_N_KEYS = len(KEY_FIELDS)
_KEY_MARKS = ", ".join("?" for _ in KEY_FIELDS)
_INSERT_RAW = (
    f"INSERT OR IGNORE INTO feedback_raw ({', '.join(_RAW_COLUMNS)})"
    f" VALUES ({', '.join('?' for _ in _RAW_COLUMNS)})"
)
_SELECT_AGGREGATE = (
    f"SELECT {', '.join(TOTALS_FIELDS)} FROM feedback_aggregate WHERE "
    + " AND ".join(f"{k} = ?" for k in KEY_FIELDS)
)
# The new sums are computed in Python (SQLite's ``+`` would overflow 64 bits, then turn
# into a float): the row is read and rewritten inside the same BEGIN IMMEDIATE transaction.
_UPSERT_AGGREGATE = (
    f"INSERT INTO feedback_aggregate ({_KEYS}, {', '.join(TOTALS_FIELDS)})"
    f" VALUES ({_KEY_MARKS}, {', '.join('?' for _ in TOTALS_FIELDS)})"
    f" ON CONFLICT ({_KEYS}) DO UPDATE SET "
    + ", ".join(f"{f} = excluded.{f}" for f in TOTALS_FIELDS)
)
_SELECT_UNMEASURED = f"SELECT {_KEYS}, payload FROM feedback_raw WHERE action_id = ? AND weight_units = 0"
# ``weight_units = 0`` again: the row is amended once, only while its latency is unknown.
_AMEND_RAW = (
    "UPDATE feedback_raw SET weight_units = ?, latency_us = ?, saving_milli_mb = ?, payload = ?"
    " WHERE action_id = ? AND weight_units = 0"
)
_UPSERT_BIN = (
    f"INSERT INTO feedback_calibration ({_KEYS}, bin, count,"
    f" confidence_units, successes) VALUES ({_KEY_MARKS}, ?, 1, ?, ?)"
    f" ON CONFLICT ({_KEYS}, bin) DO UPDATE SET"
    " count = count + 1, confidence_units = confidence_units + excluded.confidence_units,"
    " successes = successes + excluded.successes"
    " RETURNING count, confidence_units, successes"
)


def _require_integers(table: str, sums: tuple) -> None:
    """Raise when an upsert's sums came back as floats: SQLite's ``+`` turns a 64-bit
    overflow into a REAL instead of failing, which would leave the sums inexact in silence.
    (Only the calibration sums are added in SQL, and they grow by at most ``UNIT`` a record.)"""
    if not all(isinstance(value, int) for value in sums):
        raise OverflowError(f"a {table} sum would overflow 64 bits; the record is not stored")


def _totals_from_text(values: Sequence[str]) -> Totals:
    """The exact sums of one stored ``feedback_aggregate`` row (decimal text, in
    ``TOTALS_FIELDS`` order)."""
    return Totals(**{f: int(v) for f, v in zip(TOTALS_FIELDS, values, strict=True)})


def _switch_to_wal(db: sqlite3.Connection, busy_timeout_s: float) -> None:
    """``PRAGMA journal_mode=WAL``, tried again until ``busy_timeout_s`` while the file is locked.

    On a new file another replica is switching too, or already applying the migrations, and
    SQLite answers this pragma "database is locked" at once rather than wait on the busy
    timeout (it would deadlock the two): replicas started together on a new file failed to
    start. Once the file is in WAL mode the pragma takes no lock.
    """
    deadline = time.monotonic() + busy_timeout_s
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if error.sqlite_errorname != "SQLITE_BUSY" or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


class SqliteFeedbackStore:
    """A :class:`~fleetpilot.feedback.store.FeedbackStore` on a SQLite file (``":memory:"`` works)."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0) -> None:
        """Open (creating if needed) the database and apply pending migrations."""
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            str(path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        _switch_to_wal(self._db, busy_timeout_s)
        # In WAL mode NORMAL syncs at checkpoints, not at every commit: a committed record
        # survives the process (a crash, a kill, a restart), but a power cut or a kernel
        # crash can take the last commits back, after their messages were acknowledged.
        # FULL would fsync each record; the store for a fleet that cannot lose one is
        # PostgreSQL (its own ``synchronous_commit``).
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._migrate()

    def _migrate(self) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(MIGRATIONS_TABLE)
                applied = [v for (v,) in self._db.execute("SELECT version FROM schema_migrations")]
                for migration in pending(SQLITE_MIGRATIONS, applied):
                    for statement in migration.statements:
                        self._db.execute(statement)
                    self._db.execute(
                        "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                        (migration.version, migration.name, time.time()),
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    async def _run(self, fn: Callable[[], T]) -> T:
        def locked() -> T:
            with self._lock:
                return fn()

        return await asyncio.to_thread(locked)

    def applied_migrations(self) -> list[int]:
        """Versions recorded in ``schema_migrations`` (for tests and operators)."""
        with self._lock:
            return [v for (v,) in self._db.execute("SELECT version FROM schema_migrations ORDER BY version")]

    async def record(self, event: FeedbackRecorded) -> bool:
        """Store one outcome once; ``False`` for an ``action_id`` already stored."""
        row = row_from_event(event)
        totals = totals_of(row)
        values = raw_values(row, event)  # refuses, before any write, what would not read back

        def write() -> bool:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cursor = self._db.execute(_INSERT_RAW, values)
                inserted = cursor.rowcount == 1
                if inserted:
                    # BEGIN IMMEDIATE took the write lock before this read: no other
                    # connection or process can change the row until COMMIT.
                    stored = self._db.execute(_SELECT_AGGREGATE, row.key).fetchone()
                    sums = Totals() if stored is None else _totals_from_text(stored)
                    sums.add(totals)
                    self._db.execute(_UPSERT_AGGREGATE, (*row.key, *(str(getattr(sums, f)) for f in TOTALS_FIELDS)))
                    bin_sums = self._db.execute(
                        _UPSERT_BIN, (*row.key, row.calibration_bin, row.confidence_units, row.success)
                    ).fetchone()
                    _require_integers("feedback_calibration", bin_sums)
                self._db.execute("COMMIT")
                return inserted
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

        return await self._run(write)

    async def amend_late_result(self, action_id: str, latency: Measured,
                                saving_if_success_mb: float) -> FeedbackRecorded | None:
        """Give the record of ``action_id``, stored with its latency unknown, what its late
        result brings (``late_result_amendment``), once; the record as amended, ``None`` when
        nothing changed (no record, one whose latency is measured already, or ``latency`` no
        measurement either)."""

        def write() -> FeedbackRecorded | None:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                # BEGIN IMMEDIATE holds the write lock from this read to COMMIT: the row and
                # its key's sums cannot change in between (another amendment, a record).
                found = self._db.execute(_SELECT_UNMEASURED, (action_id,)).fetchone()
                amendment = None
                if found is not None:
                    amendment = late_result_amendment(decode(found[_N_KEYS].encode(), FeedbackRecorded), latency,
                                                      saving_if_success_mb)
                if amendment is not None:
                    row, key = amendment.row, tuple(found[:_N_KEYS])
                    self._db.execute(_AMEND_RAW, (row.weight_units, row.latency_us, row.saving_milli_mb,
                                                  stored_payload(amendment.event), action_id))
                    stored = self._db.execute(_SELECT_AGGREGATE, key).fetchone()
                    sums = Totals() if stored is None else _totals_from_text(stored)
                    sums.add(amendment.delta)
                    self._db.execute(_UPSERT_AGGREGATE, (*key, *(str(getattr(sums, f)) for f in TOTALS_FIELDS)))
                self._db.execute("COMMIT")
                return None if amendment is None else amendment.event
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

        return await self._run(write)

    async def get(self, action_id: str) -> FeedbackRecorded | None:
        """The record stored for ``action_id`` as it was stored, ``None`` when there is none."""
        row = await self._run(
            lambda: self._db.execute("SELECT payload FROM feedback_raw WHERE action_id = ?", (action_id,)).fetchone()
        )
        return None if row is None else decode(row[0].encode(), FeedbackRecorded)

    async def aggregates(self, by: Sequence[str] = KEY_FIELDS) -> list[Aggregate]:
        """Stored sums rolled up to ``by``; p95 from the raw measured latencies, in one read snapshot."""
        fields = validate_by(by)

        def read() -> list[Aggregate]:
            self._db.execute("BEGIN")
            try:
                n = _N_KEYS
                base = {
                    tuple(r[:n]): _totals_from_text(r[n:])
                    for r in self._db.execute(f"SELECT {_KEYS}, {', '.join(TOTALS_FIELDS)} FROM feedback_aggregate")
                }
                bins = {
                    (tuple(r[:n]), r[n]): BinTotals(count=r[n + 1], confidence_units=r[n + 2], successes=r[n + 3])
                    for r in self._db.execute(
                        f"SELECT {_KEYS}, bin, count, confidence_units, successes FROM feedback_calibration"
                    )
                }
                latencies = (
                    (tuple(r[:n]), r[n], r[n + 1])
                    for r in self._db.execute(
                        f"SELECT {_KEYS}, latency_us, weight_units FROM feedback_raw WHERE weight_units > 0"
                    )
                )
                p95 = p95_by_group(latencies, fields)  # type: ignore[arg-type]
            finally:
                self._db.execute("COMMIT")
            return assemble(base, bins, p95, fields)  # type: ignore[arg-type]

        return await self._run(read)

    async def raw(self) -> AsyncIterator[FeedbackRecorded]:
        """Every stored record in ``action_id`` order, read in pages of 500."""
        # The first page starts at ">= ''", not "> ''": an action_id may be empty.
        after, compare = "", ">="
        while True:
            page = await self._run(
                lambda after=after, compare=compare: self._db.execute(
                    f"SELECT action_id, payload FROM feedback_raw WHERE action_id {compare} ?"
                    " ORDER BY action_id LIMIT 500",
                    (after,),
                ).fetchall()
            )
            if not page:
                return
            for _, payload in page:
                yield decode(payload.encode(), FeedbackRecorded)
            after, compare = page[-1][0], ">"

    async def close(self) -> None:
        """Close the connection."""
        await self._run(self._db.close)
