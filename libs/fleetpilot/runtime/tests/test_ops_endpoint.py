"""Each service's own port: Prometheus /metrics with per-handler figures, and /healthz."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from fleetpilot.contracts import TaskSubmitted
from fleetpilot.runtime import Retry, ServiceHost, ServiceSettings
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


async def test_metrics_and_health_on_the_service_port(nats_server):
    host = ServiceHost("sla", ServiceSettings(nats_url=nats_server.url, metrics_port=0))
    attempts: list[int] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def flaky_once(task: TaskSubmitted, delivery) -> None:
        attempts.append(delivery.deliveries)
        if delivery.deliveries == 1:
            raise Retry("first time fails", delay_s=0.05)

    await host.start()
    client = await NatsBus.connect(nats_server.url, "client")
    try:
        port = host._ops.port
        status, body = await asyncio.to_thread(get, port, "/healthz")
        assert status == 200 and json.loads(body)["ok"] is True and json.loads(body)["service"] == "sla"

        await client.publish(TaskSubmitted(task_id="m1", submitted_at=1.0))
        await eventually(lambda: attempts == [1, 2])

        async def scraped() -> str:
            status, text = await asyncio.to_thread(get, port, "/metrics")
            return status == 200 and 'fleetpilot_messages_handled_total{handler="sla-submitted",service="sla"} 1.0' \
                in text and text

        text = await eventually(scraped)
        assert 'fleetpilot_messages_total{handler="sla-submitted",service="sla"} 2.0' in text
        assert 'fleetpilot_handler_errors_total{handler="sla-submitted",service="sla"} 1.0' in text
        assert 'fleetpilot_redeliveries_total{handler="sla-submitted",service="sla"} 1.0' in text
        assert 'fleetpilot_handler_seconds_count{handler="sla-submitted",service="sla"} 1.0' in text
        assert (await asyncio.to_thread(get, port, "/nope"))[0] == 404

        await client.drain()
        await host.bus.drain()  # the bus is gone: health must say so
        status, body = await asyncio.to_thread(get, port, "/healthz")
        assert status == 503 and json.loads(body)["ok"] is False
    finally:
        await host.stop()
