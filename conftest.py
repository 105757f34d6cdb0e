"""Fixtures shared by every test folder: a real nats-server per test, a client on it, the
PostgreSQL DSN."""

from __future__ import annotations

import os

# One OpenMP thread per test process, set before anything imports torch. The suite runs one
# worker per core beside nats-servers and service processes; torch's default pool (a thread
# per core, spinning while it waits) then fights them for the cores: the learner's tests ran
# 4 to 5 times slower in the suite than alone. The learner service pins one thread itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from fleetpilot.runtime.embedded import EmbeddedNats


@pytest.fixture
def nats_server(tmp_path):
    """A fresh ``nats-server`` with JetStream on a free port, stopped after the test."""
    server = EmbeddedNats(tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    """The URL of the test's own NATS server."""
    return nats_server.url


@pytest.fixture
async def nats_client(nats_url):
    """A plain nats-py client on the test's server (playing the other services), with the
    catalogued streams and buckets already made."""
    import nats
    from fleetpilot.runtime.nats_bus import NatsBus

    bus = await NatsBus.connect(nats_url, "test-setup")
    await bus.ensure_topology()
    await bus.drain()
    nc = await nats.connect(nats_url)
    yield nc
    await nc.close()


@pytest.fixture
def pg_dsn() -> str:
    """The PostgreSQL DSN for tests; unreachable means skip locally and fail in CI."""
    import asyncio

    import asyncpg

    dsn = os.environ.get("FLEETPILOT_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")

    async def probe() -> None:
        conn = await asyncpg.connect(dsn, timeout=5)
        await conn.close()

    try:
        asyncio.run(probe())
    except Exception as exc:  # noqa: BLE001 - any failure to reach the server counts
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL unreachable at {dsn} in CI: {exc}")
        pytest.skip(f"PostgreSQL unreachable at {dsn}: {exc}")
    return dsn
