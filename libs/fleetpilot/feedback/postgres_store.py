"""The production feedback store: PostgreSQL via asyncpg, SERIALIZABLE with retry.

Each record is one SERIALIZABLE transaction running a single statement: a data-modifying
CTE that inserts the raw row (``ON CONFLICT (action_id) DO NOTHING``) and, from the rows
that insert returned, upserts the aggregate and calibration rows of its key. A conflicting
writer gets SQLSTATE 40001 (or 40P01 on a deadlock); the whole transaction is retried
after an exponential backoff with jitter (:mod:`fleetpilot.feedback.retry`), so no record is
lost or counted twice.

The store lives in its own schema (``schema=``, created if missing), which is how tests run
side by side without colliding; migrations are applied at start-up under a transaction-
scoped advisory lock so several replicas may start at once.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import asyncpg

from fleetpilot.contracts import FeedbackRecorded, Measured, decode

from .aggregates import (
    KEY_FIELDS,
    P95_PERCENT,
    TOTALS_FIELDS,
    Aggregate,
    BinTotals,
    Totals,
    assemble,
    late_result_amendment,
    row_from_event,
    totals_of,
    validate_by,
)
from .migrations import MIGRATIONS_TABLE, POSTGRES_MIGRATIONS, pending, raw_values, stored_payload
from .migrations import RAW_COLUMNS as _RAW_COLUMNS
from .retry import backoff_delay, is_retryable

T = TypeVar("T")

_KEYS = ", ".join(KEY_FIELDS)
_N_KEYS = len(KEY_FIELDS)
_N_RAW = len(_RAW_COLUMNS)
_CONFIDENCE_ARG = _RAW_COLUMNS.index("confidence_units") + 1
_SUCCESS_ARG = _RAW_COLUMNS.index("success") + 1
_BIN_ARG = _N_RAW + len(TOTALS_FIELDS) + 1
# One round trip per record: the calibration row reuses the raw row's confidence and
# success parameters; the aggregate and calibration upserts read from ``ins``, so they do
# nothing when the action_id was already stored.
_RECORD = (
    f"WITH ins AS (INSERT INTO feedback_raw ({', '.join(_RAW_COLUMNS)})"
    f" VALUES ({', '.join(f'${i + 1}' for i in range(_N_RAW))})"
    f" ON CONFLICT (action_id) DO NOTHING RETURNING {_KEYS}),"
    f" agg AS (INSERT INTO feedback_aggregate ({_KEYS}, {', '.join(TOTALS_FIELDS)})"
    f" SELECT {_KEYS}, "
    + ", ".join(f"${_N_RAW + i + 1}::numeric" for i in range(len(TOTALS_FIELDS)))
    + f" FROM ins ON CONFLICT ({_KEYS}) DO UPDATE SET "
    + ", ".join(f"{f} = feedback_aggregate.{f} + excluded.{f}" for f in TOTALS_FIELDS)
    + "),"
    f" cal AS (INSERT INTO feedback_calibration ({_KEYS}, bin, count, confidence_units, successes)"
    f" SELECT {_KEYS}, ${_BIN_ARG}::integer, 1, ${_CONFIDENCE_ARG}::numeric, ${_SUCCESS_ARG}::numeric FROM ins"
    f" ON CONFLICT ({_KEYS}, bin) DO UPDATE SET count = feedback_calibration.count + 1,"
    " confidence_units = feedback_calibration.confidence_units + excluded.confidence_units,"
    " successes = feedback_calibration.successes + excluded.successes)"
    " SELECT count(*) FROM ins"
)
_SELECT_UNMEASURED = "SELECT payload FROM feedback_raw WHERE action_id = $1 AND weight_units = 0"
# A late result's amendment (``amend_late_result``): the raw row, only while its latency is
# unknown (``weight_units = 0``), and its key's latency and saving sums, in one statement.
_AMEND = (
    "WITH amended AS (UPDATE feedback_raw SET weight_units = $2, latency_us = $3, saving_milli_mb = $4,"
    f" payload = $5 WHERE action_id = $1 AND weight_units = 0 RETURNING {_KEYS})"
    " UPDATE feedback_aggregate SET "
    + ", ".join(f"{f} = feedback_aggregate.{f} + ${i + 6}::numeric" for i, f in enumerate(TOTALS_FIELDS))
    + " FROM amended WHERE "
    + " AND ".join(f"feedback_aggregate.{k} = amended.{k}" for k in KEY_FIELDS)
)

COMMAND_TIMEOUT_S = 30.0
"""How long a statement may go unanswered before it raises ``TimeoutError``: a lock nobody
releases, or a server behind a partition that drops packets, held a write (and the message
whose handling made it, kept in progress) for ever. As SQLite's busy timeout."""
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresFeedbackStore:
    """A :class:`~fleetpilot.feedback.store.FeedbackStore` on PostgreSQL; build with :meth:`open`."""

    def __init__(
        self, pool: asyncpg.Pool, schema: str, *, max_attempts: int = 50, rng: random.Random | None = None
    ) -> None:
        """Wrap an open pool whose ``search_path`` is ``schema``; prefer :meth:`open`."""
        _check_attempts(max_attempts)
        self._pool = pool
        self.schema = schema
        self._max_attempts = max_attempts
        self._rng = rng or random.Random()
        self.retries = 0
        """How many transactions were rerun after a serialization failure or deadlock."""

    @classmethod
    async def open(
        cls,
        dsn: str,
        *,
        schema: str = "fleetpilot_feedback",
        min_size: int = 1,
        max_size: int = 8,
        max_attempts: int = 50,
        command_timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> PostgresFeedbackStore:
        """Connect, create ``schema`` if needed and apply pending migrations idempotently.
        A statement that has not answered in ``command_timeout_s`` raises ``TimeoutError``."""
        _check_attempts(max_attempts)  # before connecting: nothing to close on the way out
        if not _SCHEMA_NAME.match(schema):
            raise ValueError(f"schema must be a lower-case SQL identifier, got {schema!r}")
        if not (math.isfinite(command_timeout_s) and command_timeout_s > 0):
            raise ValueError(f"command_timeout_s must be a number of seconds above 0, got {command_timeout_s}")
        bootstrap = await asyncpg.connect(dsn, command_timeout=command_timeout_s)
        try:
            # Looked up first: CREATE SCHEMA checks the database's CREATE privilege even when
            # the schema exists, and a least-privilege role owns its schema, not the database.
            if not await bootstrap.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = $1", schema):
                await _retrying(
                    lambda: bootstrap.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'), 10, random.Random()
                )
        finally:
            await bootstrap.close()
        pool = await asyncpg.create_pool(
            dsn, min_size=min_size, max_size=max_size, server_settings={"search_path": schema},
            command_timeout=command_timeout_s,
        )
        store = cls(pool, schema, max_attempts=max_attempts)
        try:
            await store._migrate()
        except BaseException:
            await pool.close()
            raise
        return store

    async def _migrate(self) -> None:
        async def apply(conn: asyncpg.Connection) -> None:
            # Serialises concurrent start-ups; released at commit.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"migrate:{self.schema}")
            await conn.execute(MIGRATIONS_TABLE)
            applied = [r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")]
            for migration in pending(POSTGRES_MIGRATIONS, applied):
                for statement in migration.statements:
                    await conn.execute(statement)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)",
                    migration.version,
                    migration.name,
                    time.time(),
                )

        await self._transaction(apply, isolation="read_committed")

    async def applied_migrations(self) -> list[int]:
        """Versions recorded in ``schema_migrations``."""
        async with self._pool.acquire() as conn:
            return [
                r["version"]
                for r in await conn.fetch("SELECT version FROM schema_migrations ORDER BY version")
            ]

    async def _transaction(
        self,
        body: Callable[[asyncpg.Connection], Awaitable[T]],
        *,
        isolation: str = "serializable",
        readonly: bool = False,
    ) -> T:
        async def once() -> T:
            async with self._pool.acquire() as conn, conn.transaction(isolation=isolation, readonly=readonly):
                return await body(conn)

        result, retries = await _retrying_counted(once, self._max_attempts, self._rng)
        self.retries += retries
        return result

    async def record(self, event: FeedbackRecorded) -> bool:
        """Store one outcome once (SERIALIZABLE, retried); ``False`` for a known ``action_id``."""
        row = row_from_event(event)
        totals = totals_of(row)
        args: tuple[Any, ...] = (
            *raw_values(row, event),
            *(getattr(totals, f) for f in TOTALS_FIELDS),
            row.calibration_bin,
        )

        async def body(conn: asyncpg.Connection) -> bool:
            return await conn.fetchval(_RECORD, *args) == 1

        return await self._transaction(body)

    async def amend_late_result(self, action_id: str, latency: Measured,
                                saving_if_success_mb: float) -> FeedbackRecorded | None:
        """Give the record of ``action_id``, stored with its latency unknown, what its late
        result brings (``late_result_amendment``), once (SERIALIZABLE, retried); the record
        as amended, ``None`` when nothing changed (no record, one whose latency is measured
        already, or ``latency`` no measurement either)."""
        if "\x00" in action_id:
            return None  # never stored (``raw_values`` refuses it); PostgreSQL would raise on it

        async def body(conn: asyncpg.Connection) -> FeedbackRecorded | None:
            # Read and written in one SERIALIZABLE transaction: a concurrent amendment of the
            # row, or a record of its key, makes one of the two fail with 40001 and run again
            # (then this read finds the row measured, and nothing is added twice).
            found = await conn.fetchrow(_SELECT_UNMEASURED, action_id)
            if found is None:
                return None
            amendment = late_result_amendment(decode(found["payload"].encode(), FeedbackRecorded), latency,
                                              saving_if_success_mb)
            if amendment is None:
                return None
            row = amendment.row
            await conn.execute(_AMEND, action_id, row.weight_units, row.latency_us, row.saving_milli_mb,
                               stored_payload(amendment.event), *(getattr(amendment.delta, f) for f in TOTALS_FIELDS))
            return amendment.event

        return await self._transaction(body)

    async def get(self, action_id: str) -> FeedbackRecorded | None:
        """The record stored for ``action_id`` as it was stored, ``None`` when there is none."""
        if "\x00" in action_id:
            return None  # never stored (``raw_values`` refuses it); PostgreSQL would raise on it
        async with self._pool.acquire() as conn:
            payload = await conn.fetchval("SELECT payload FROM feedback_raw WHERE action_id = $1", action_id)
        return None if payload is None else decode(payload.encode(), FeedbackRecorded)

    async def aggregates(self, by: Sequence[str] = KEY_FIELDS) -> list[Aggregate]:
        """Stored sums rolled up to ``by``; the weighted p95 over measured raw rows, one snapshot."""
        fields = validate_by(by)
        group = f" GROUP BY {', '.join(fields)}" if fields else ""
        select_keys = f"{', '.join(fields)}, " if fields else ""
        partition = f"PARTITION BY {', '.join(fields)} " if fields else ""
        # Weighted nearest rank (``aggregates.weighted_nearest_rank``): the default window
        # frame of an ordered window takes in the current row's peers, so ``below`` is the
        # weight of every row at or under this latency; compared in integers, as in Python.
        p95_query = (
            f"SELECT {select_keys}min(latency_us) FROM (SELECT {select_keys}latency_us,"
            f" sum(weight_units) OVER ({partition}ORDER BY latency_us) AS below,"
            f" sum(weight_units) OVER ({partition.strip()}) AS total"
            f" FROM feedback_raw WHERE weight_units > 0) AS ranked"
            f" WHERE below * 100 >= total * {P95_PERCENT}{group}"
        )

        async def body(conn: asyncpg.Connection) -> list[Aggregate]:
            n = _N_KEYS
            base = {
                tuple(r[:n]): Totals(**{f: int(r[f]) for f in TOTALS_FIELDS})
                for r in await conn.fetch(
                    f"SELECT {_KEYS}, {', '.join(TOTALS_FIELDS)} FROM feedback_aggregate"
                )
            }
            bins = {
                (tuple(r[:n]), r[n]): BinTotals(
                    count=int(r[n + 1]), confidence_units=int(r[n + 2]), successes=int(r[n + 3])
                )
                for r in await conn.fetch(
                    f"SELECT {_KEYS}, bin, count, confidence_units, successes FROM feedback_calibration"
                )
            }
            p95 = {
                tuple(r[: len(fields)]): int(r[len(fields)])
                for r in await conn.fetch(p95_query)
                if r[len(fields)] is not None
            }
            return assemble(base, bins, p95, fields)

        return await self._transaction(body, isolation="repeatable_read", readonly=True)

    async def raw(self) -> AsyncIterator[FeedbackRecorded]:
        """Every stored record in ``action_id`` order, read in pages of 500."""
        # The first page starts at ">= ''", not "> ''": an action_id may be empty.
        after, compare = "", ">="
        while True:
            async with self._pool.acquire() as conn:
                page = await conn.fetch(
                    f"SELECT action_id, payload FROM feedback_raw WHERE action_id {compare} $1"
                    " ORDER BY action_id LIMIT 500",
                    after,
                )
            if not page:
                return
            for r in page:
                yield decode(r["payload"].encode(), FeedbackRecorded)
            after, compare = page[-1]["action_id"], ">"

    async def drop_schema(self) -> None:
        """Drop this store's schema and everything in it (tests and teardown only)."""
        async with self._pool.acquire() as conn:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')

    async def close(self) -> None:
        """Close the connection pool."""
        await self._pool.close()


def _check_attempts(max_attempts: int) -> None:
    """``ValueError`` unless a transaction may run at least once: with none, every write
    raised ``AssertionError("unreachable")``, which said nothing of the setting."""
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")


async def _retrying_counted(
    fn: Callable[[], Awaitable[T]], max_attempts: int, rng: random.Random
) -> tuple[T, int]:
    for attempt in range(max_attempts):
        try:
            return await fn(), attempt
        except asyncpg.PostgresError as error:
            if not is_retryable(error) or attempt == max_attempts - 1:
                raise
            await asyncio.sleep(backoff_delay(attempt, rng=rng))
    raise AssertionError("unreachable")


async def _retrying(fn: Callable[[], Awaitable[T]], max_attempts: int, rng: random.Random) -> T:
    try:
        return (await _retrying_counted(fn, max_attempts, rng))[0]
    except asyncpg.UniqueViolationError:
        # Two CREATE SCHEMA IF NOT EXISTS racing: the other one won, which is what we wanted.
        return None  # type: ignore[return-value]
