"""Reading a stream through ``NatsBus.stream_messages`` (``fleetpilot dead-letters``, the
fingerprinter's start-up, the policy's untaken decisions) ends when nothing more is stored,
whichever timeout nats-py raises for that: its own, or the builtin one it lets out when its
wait ran out between its two requests, as on a loaded machine (a test run under four workers
on two cores read a stream of nothing and failed with it)."""

from __future__ import annotations

import nats.errors
import nats.js.client
import pytest
from fleetpilot.runtime.nats_bus import NatsBus


@pytest.mark.parametrize("raised", [nats.errors.TimeoutError, TimeoutError], ids=["nats-py", "builtin"])
async def test_reading_a_stream_with_nothing_more_ends_whichever_timeout_nats_py_raises(nats_url, monkeypatch, raised):
    bus = await NatsBus.connect(nats_url, "reader")
    fetched: list[int] = []

    async def nothing_comes(self, batch: int = 1, *args, **kwargs):
        fetched.append(batch)
        raise raised()

    try:
        await bus.ensure_topology()
        monkeypatch.setattr(nats.js.client.JetStreamContext.PullSubscription, "fetch", nothing_comes)
        stored = [m async for m in bus.stream_messages("TASKS", "task.submitted")]
    finally:
        await bus.drain()
    assert stored == [] and fetched == [256]
