"""The ledger tests' bus: each test runs on the in-memory bus and on a real nats-server."""

from __future__ import annotations

import pytest
from fleetpilot.runtime import InMemoryBus
from fleetpilot.runtime.nats_bus import NatsBus


@pytest.fixture(params=["memory", "nats"])
async def bus(request):
    """A bus with the catalogued streams and buckets, drained after the test."""
    if request.param == "memory":
        bus = InMemoryBus()
    else:
        bus = await NatsBus.connect(request.getfixturevalue("nats_server").url, "test")
    await bus.ensure_topology()
    yield bus
    await bus.drain()
