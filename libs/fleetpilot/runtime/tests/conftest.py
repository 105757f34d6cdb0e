"""Fixtures shared by the runtime's tests."""

from __future__ import annotations

import pytest
from fleetpilot.runtime import InMemoryBus
from fleetpilot.runtime.nats_bus import NatsBus


@pytest.fixture(params=["memory", "nats"])
async def bus(request):
    """Each test twice: on the in-memory bus and on a real nats-server, with the catalog's
    streams and buckets."""
    if request.param == "memory":
        bus = InMemoryBus()
    else:
        server = request.getfixturevalue("nats_server")
        bus = await NatsBus.connect(server.url, "test")
    await bus.ensure_topology()
    yield bus
    await bus.drain()
