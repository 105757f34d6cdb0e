"""A service keeps consuming across a NATS server restart: reconnect, then re-bind."""

from __future__ import annotations

from fleetpilot.contracts import TaskSubmitted
from fleetpilot.runtime import ServiceHost, ServiceSettings
from fleetpilot.runtime.embedded import EmbeddedNats
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually as wait_for


async def test_consumer_survives_a_server_restart(tmp_path):
    server = EmbeddedNats(tmp_path / "nats").start()
    host = ServiceHost("sla", ServiceSettings(nats_url=server.url, metrics_port=-1))
    seen: list[str] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def record(task: TaskSubmitted) -> None:
        seen.append(task.task_id)

    await host.start()
    client = await NatsBus.connect(server.url, "client")
    try:
        await client.publish(TaskSubmitted(task_id="before", submitted_at=1.0))
        await wait_for(lambda: seen == ["before"])

        server.kill()  # no goodbye: the way a crashed server goes
        await wait_for(lambda: not host.bus.connected)
        server.start()  # same port, same JetStream store
        await wait_for(lambda: host.bus.connected and client.connected)

        await client.publish(TaskSubmitted(task_id="after", submitted_at=2.0))
        await wait_for(lambda: "after" in seen)
        assert seen == ["before", "after"]
        assert host.health()["ok"]
    finally:
        await client.drain()
        await host.stop()
        server.stop()


async def test_consumer_rebinds_when_a_fresh_server_lost_its_state(tmp_path):
    server = EmbeddedNats(tmp_path / "nats-a").start()
    port = server.port
    host = ServiceHost("sla", ServiceSettings(nats_url=server.url, metrics_port=-1))
    seen: list[str] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def record(task: TaskSubmitted) -> None:
        seen.append(task.task_id)

    await host.start()
    server.kill()
    # A replacement server with an empty store: streams and consumers must be re-created.
    fresh = EmbeddedNats(tmp_path / "nats-b", port=port).start()
    client = None
    try:
        await wait_for(lambda: host.bus.connected)
        client = await NatsBus.connect(fresh.url, "client")
        await client.ensure_topology()
        await client.publish(TaskSubmitted(task_id="on-fresh-server", submitted_at=1.0))
        await wait_for(lambda: seen == ["on-fresh-server"], timeout_s=30)
    finally:
        if client is not None:
            await client.drain()
        await host.stop()
        fresh.stop()
