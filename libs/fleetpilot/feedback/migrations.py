"""Versioned schema migrations for both feedback store backends.

Each backend has an ordered list of :class:`Migration`; a store applies at start-up the ones
missing from its ``schema_migrations`` table, in order, all in one transaction (a failed
start-up leaves the schema as it found it) under a lock that serialises concurrent
start-ups, so starting a store (or several at once) on an up-to-date database changes
nothing. Versions
are never edited once released: a change is a new migration at the end of the list.

Aggregate sums are integers of any size (see :mod:`fleetpilot.feedback.aggregates`):
``NUMERIC`` in PostgreSQL (arbitrary precision) and, since version 5, decimal ``TEXT`` in
SQLite's ``feedback_aggregate`` (its 64-bit integers overflowed; see
:func:`_sqlite_sums_as_text`). The calibration sums stay ``BIGINT`` in SQLite: they grow by
at most ``UNIT`` per record, so 2**63 is some 10**14 records away. ``action_id`` compares
bytewise in both (``COLLATE "C"`` in PostgreSQL), so ``raw()`` pages through the
primary-key index in the same order everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec

from fleetpilot.contracts import FeedbackRecorded, encode

from .aggregates import FeedbackRow


class Migration(msgspec.Struct, frozen=True, kw_only=True):
    """One schema step: a version number, a name and the SQL statements it runs."""

    version: int
    name: str
    statements: tuple[str, ...]


# The columns of ``feedback_raw`` that a record writes, in insert order (both backends).
RAW_COLUMNS = (
    "action_id",
    "policy",
    "shard_id",
    "task_kind",
    "gpu_model",
    "action",
    "success",
    "weight_units",
    "latency_us",
    "saving_milli_mb",
    "confidence_units",
    "side_effects",
    "recorded_at",
    "payload",
)



def stored_payload(event: FeedbackRecorded) -> str:
    """The JSON a store keeps for ``event``; ``ValueError`` when it would not read back.

    JSON has no NaN or infinity: msgspec writes them as ``null``, which no longer decodes
    as a float, so such a row would make ``get`` and ``raw`` raise for ever after. (Off the
    bus they cannot arrive; only a caller in the same process can build them.)
    """
    numbers = {
        "latency_ms.value": event.latency_ms.value,
        "latency_ms.uncertainty_score": event.latency_ms.uncertainty_score,
        "resource_saving_mb": event.resource_saving_mb,
        "confidence": event.confidence,
        "recorded_at": event.recorded_at,
    }
    bad = [f"{name}={value!r}" for name, value in numbers.items() if not math.isfinite(value)]
    if bad:
        raise ValueError(f"feedback {event.action_id!r} not stored: {', '.join(bad)} not finite")
    return encode(event).decode()


_TEXT_COLUMNS = ("action_id", "policy", "shard_id", "task_kind", "gpu_model", "action")


def raw_values(row: FeedbackRow, event: FeedbackRecorded) -> tuple:
    """The values of one ``feedback_raw`` row, in ``RAW_COLUMNS`` order; ``ValueError`` for a
    record no backend can keep alike (see ``stored_payload``).

    PostgreSQL text cannot hold a NUL character: such a record failed there on every
    delivery (and SQLite kept it), so both refuse it before any write.
    """
    bad = [name for name in _TEXT_COLUMNS if "\x00" in getattr(row, name)]
    if bad:
        raise ValueError(f"feedback {event.action_id!r} not stored: NUL character in {', '.join(bad)}")
    return (row.action_id, row.policy, row.shard_id, row.task_kind, row.gpu_model, row.action, row.success,
            row.weight_units, row.latency_us, row.saving_milli_mb, row.confidence_units, row.side_effects,
            event.recorded_at, stored_payload(event))


MIGRATIONS_TABLE = (
    "CREATE TABLE IF NOT EXISTS schema_migrations ("
    " version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)"
)

_KEY_COLUMNS = (
    "policy TEXT NOT NULL, shard_id TEXT NOT NULL, task_kind TEXT NOT NULL, gpu_model TEXT NOT NULL"
)


SUM_FIELDS_V1 = ("count", "successes", "weight_units", "weighted_success_units", "latency_us", "weighted_latency",
                 "saving_milli_mb", "confidence_units", "brier_units2", "side_effects")
"""The aggregate sums as migration 1 created them: frozen, since a released migration never
changes (``aggregates.Totals`` grows with a migration of its own, as ``measured`` did in 4)."""


def _tables(sum_type: str, payload_type: str, id_type: str) -> tuple[str, ...]:
    sums = ", ".join(f"{name} {sum_type} NOT NULL DEFAULT 0" for name in SUM_FIELDS_V1)
    return (
        "CREATE TABLE feedback_raw ("
        f" action_id {id_type} PRIMARY KEY, " + _KEY_COLUMNS + ","
        " success INTEGER NOT NULL, weight_units INTEGER NOT NULL, latency_us BIGINT NOT NULL,"
        " saving_milli_mb BIGINT NOT NULL, confidence_units INTEGER NOT NULL,"
        " side_effects INTEGER NOT NULL, recorded_at DOUBLE PRECISION NOT NULL,"
        f" payload {payload_type} NOT NULL)",
        f"CREATE TABLE feedback_aggregate ({_KEY_COLUMNS}, {sums},"
        " PRIMARY KEY (policy, shard_id, task_kind, gpu_model))",
        f"CREATE TABLE feedback_calibration ({_KEY_COLUMNS}, bin INTEGER NOT NULL,"
        f" count {sum_type} NOT NULL DEFAULT 0, confidence_units {sum_type} NOT NULL DEFAULT 0,"
        f" successes {sum_type} NOT NULL DEFAULT 0,"
        " PRIMARY KEY (policy, shard_id, task_kind, gpu_model, bin))",
    )


_KEY_INDEX = (
    "CREATE INDEX IF NOT EXISTS feedback_raw_key ON feedback_raw"
    " (policy, shard_id, task_kind, gpu_model, latency_us)",
)

def _add_action_key(sum_type: str) -> tuple[str, ...]:
    """Version 3: ``action`` joins the key of every table. Existing rows keep their sums under
    the action ``""`` (unknown): nothing recorded before is reattributed or lost. SQLite
    cannot change a primary key in place, so the keyed tables are copied into new ones."""
    old_keys = "policy, shard_id, task_kind, gpu_model"
    keys = old_keys + ", action"
    key_columns = _KEY_COLUMNS + ", action TEXT NOT NULL"
    sums = ", ".join(f"{name} {sum_type} NOT NULL DEFAULT 0" for name in SUM_FIELDS_V1)
    sum_names = ", ".join(SUM_FIELDS_V1)
    bin_sums = f"count {sum_type} NOT NULL DEFAULT 0, confidence_units {sum_type} NOT NULL DEFAULT 0," \
               f" successes {sum_type} NOT NULL DEFAULT 0"
    return (
        "ALTER TABLE feedback_raw ADD COLUMN action TEXT NOT NULL DEFAULT ''",
        f"CREATE TABLE feedback_aggregate_v3 ({key_columns}, {sums}, PRIMARY KEY ({keys}))",
        f"INSERT INTO feedback_aggregate_v3 ({keys}, {sum_names})"
        f" SELECT {old_keys}, '', {sum_names} FROM feedback_aggregate",
        "DROP TABLE feedback_aggregate",
        "ALTER TABLE feedback_aggregate_v3 RENAME TO feedback_aggregate",
        f"CREATE TABLE feedback_calibration_v3 ({key_columns}, bin INTEGER NOT NULL, {bin_sums},"
        f" PRIMARY KEY ({keys}, bin))",
        f"INSERT INTO feedback_calibration_v3 ({keys}, bin, count, confidence_units, successes)"
        f" SELECT {old_keys}, '', bin, count, confidence_units, successes FROM feedback_calibration",
        "DROP TABLE feedback_calibration",
        "ALTER TABLE feedback_calibration_v3 RENAME TO feedback_calibration",
        "DROP INDEX IF EXISTS feedback_raw_key",
        f"CREATE INDEX feedback_raw_key ON feedback_raw ({keys}, latency_us)",
    )


def _measured_latency(sum_type: str) -> tuple[str, ...]:
    """Version 4: the latency statistics count measured records only (weight above 0). Each
    aggregate row gains ``measured`` and its ``latency_us`` becomes the sum over those, both
    recomputed from the raw rows, which keep every record's weight."""
    same_key = " AND ".join(f"r.{k} = feedback_aggregate.{k}" for k in
                            ("policy", "shard_id", "task_kind", "gpu_model", "action"))
    return (
        f"ALTER TABLE feedback_aggregate ADD COLUMN measured {sum_type} NOT NULL DEFAULT 0",
        "UPDATE feedback_aggregate SET"
        f" measured = (SELECT count(*) FROM feedback_raw r WHERE {same_key} AND r.weight_units > 0),"
        f" latency_us = (SELECT coalesce(sum(r.latency_us), 0) FROM feedback_raw r"
        f" WHERE {same_key} AND r.weight_units > 0)",
    )


SUM_FIELDS_V4 = (*SUM_FIELDS_V1, "measured")
"""The aggregate sums as of version 4 (frozen, like ``SUM_FIELDS_V1``)."""


def _sqlite_sums_as_text() -> tuple[str, ...]:
    """Version 5 (SQLite): every ``feedback_aggregate`` sum becomes a decimal ``TEXT``.

    64 bits were too few: ``weighted_latency`` adds ``weight_units * latency_us``, up to
    10**4 * 6 * 10**8 for one 10-minute latency, so 2**63 was about 1.5 million such
    records away (15 days of 100,000 such actions a day in one key); ``latency_us`` itself
    about 15 billion.
    Options weighed: two INTEGER words per sum (a carry in every ``SET``, two columns per
    sum, every reader recombining them), coarser units (no longer equal to a recomputation
    from the raw rows), or decimal TEXT, chosen as the simplest exact one: Python's
    integers have no bound, and the store adds in Python under ``BEGIN IMMEDIATE``, which
    holds SQLite's only write lock from before the read to the commit, so the read-add-write
    is as atomic as the ``x = x + excluded.x`` it replaces. (PostgreSQL's ``NUMERIC`` does
    the same on the server.)

    The columns must be *declared* TEXT: a BIGINT column turns an integer-looking text too
    large for 64 bits into a REAL, so the table is copied into a new one. Each integer is
    written exactly as its decimal digits; a REAL (a sum a version before the overflow check
    let turn into a float, inexact already) as the integer SQLite prints for it (to some 16
    digits), so it still reads back.
    """
    keys = "policy, shard_id, task_kind, gpu_model, action"
    key_columns = _KEY_COLUMNS + ", action TEXT NOT NULL"
    sums = ", ".join(f"{name} TEXT NOT NULL DEFAULT '0'" for name in SUM_FIELDS_V4)
    sum_names = ", ".join(SUM_FIELDS_V4)
    as_text = ", ".join(
        f"CASE typeof({name}) WHEN 'integer' THEN CAST({name} AS TEXT) ELSE printf('%.0f', {name}) END"
        for name in SUM_FIELDS_V4
    )
    return (
        f"CREATE TABLE feedback_aggregate_v5 ({key_columns}, {sums}, PRIMARY KEY ({keys}))",
        f"INSERT INTO feedback_aggregate_v5 ({keys}, {sum_names}) SELECT {keys}, {as_text} FROM feedback_aggregate",
        "DROP TABLE feedback_aggregate",
        "ALTER TABLE feedback_aggregate_v5 RENAME TO feedback_aggregate",
    )


SQLITE_MIGRATIONS: tuple[Migration, ...] = (
    Migration(version=1, name="raw and aggregate tables", statements=_tables("BIGINT", "TEXT", "TEXT")),
    Migration(version=2, name="raw key index for p95", statements=_KEY_INDEX),
    Migration(version=3, name="action joins the key", statements=_add_action_key("BIGINT")),
    Migration(version=4, name="latency over measured records", statements=_measured_latency("BIGINT")),
    Migration(version=5, name="aggregate sums past 64 bits", statements=_sqlite_sums_as_text()),
)

POSTGRES_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        version=1, name="raw and aggregate tables", statements=_tables("NUMERIC", "TEXT", 'TEXT COLLATE "C"')
    ),
    Migration(version=2, name="raw key index for p95", statements=_KEY_INDEX),
    Migration(version=3, name="action joins the key", statements=_add_action_key("NUMERIC")),
    Migration(version=4, name="latency over measured records", statements=_measured_latency("NUMERIC")),
    # NUMERIC has no 64-bit bound: nothing to convert. The version is kept so that both
    # backends number their schema alike.
    Migration(version=5, name="aggregate sums past 64 bits", statements=()),
)


def pending(migrations: Sequence[Migration], applied: Iterable[int]) -> list[Migration]:
    """The migrations still to apply, in order; raises if the list itself is malformed.

    Versions must run 1, 2, 3 ... without gaps, and a database may not know a version the
    code does not (that would be a downgrade).
    """
    versions = [m.version for m in migrations]
    if versions != list(range(1, len(versions) + 1)):
        raise ValueError(f"migration versions must be 1..n in order, got {versions}")
    done = set(applied)
    unknown = done - set(versions)
    if unknown:
        raise ValueError(f"database has migrations this code does not know: {sorted(unknown)}")
    return [m for m in migrations if m.version not in done]
