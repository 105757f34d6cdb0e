"""Fixtures shared by the collector's tests."""

from __future__ import annotations

import pytest
from fleetpilot.runtime.nats_bus import NatsBus


@pytest.fixture
async def client(nats_server):
    """A bus on the test's nats-server with the catalog's streams and buckets, as the other
    services see it."""
    bus = await NatsBus.connect(nats_server.url, "collector-test")
    await bus.ensure_topology()
    yield bus
    await bus.drain()
