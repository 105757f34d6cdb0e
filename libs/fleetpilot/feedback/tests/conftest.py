"""Fixtures for the feedback store tests: a PostgreSQL DSN that skips locally, fails in CI."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg
import pytest
from fleetpilot.feedback import PostgresFeedbackStore, SqliteFeedbackStore
from fleetpilot.feedback.store import FeedbackStore

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"


async def _reachable(dsn: str) -> str | None:
    try:
        conn = await asyncio.wait_for(asyncpg.connect(dsn), timeout=5)
    except Exception as error:  # any failure to connect means "no server here"
        return f"{type(error).__name__}: {error}"
    await conn.close()
    return None


async def _pg_dsn_or_skip() -> str:
    dsn = os.environ.get("FLEETPILOT_TEST_PG_DSN", DEFAULT_DSN)
    problem = await _reachable(dsn)
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL required in CI but unreachable at {dsn}: {problem}")
        pytest.skip(f"PostgreSQL unreachable at {dsn}: {problem}")
    return dsn


@asynccontextmanager
async def _pg_store(dsn: str) -> AsyncIterator[PostgresFeedbackStore]:
    store = await PostgresFeedbackStore.open(dsn, schema=f"fp_test_{uuid.uuid4().hex[:12]}")
    try:
        yield store
    finally:
        await store.drop_schema()
        await store.close()


@pytest.fixture
async def pg_dsn() -> str:
    """The test DSN; skips when unreachable, unless ``CI`` is set (then the test fails)."""
    return await _pg_dsn_or_skip()


@pytest.fixture
async def pg_store(pg_dsn: str) -> AsyncIterator[PostgresFeedbackStore]:
    """A PostgreSQL store in a schema unique to this test, dropped afterwards."""
    async with _pg_store(pg_dsn) as store:
        yield store


@pytest.fixture(params=["sqlite", "postgres"])
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[FeedbackStore]:
    """Each backend in turn, empty (PostgreSQL in its own schema, dropped afterwards)."""
    if request.param == "sqlite":
        store = SqliteFeedbackStore(tmp_path / "feedback.db")
        yield store
        await store.close()
    else:
        async with _pg_store(await _pg_dsn_or_skip()) as pg:
            yield pg
