"""A message whose handler runs longer than its consumer's ack wait is not handed to another
replica meanwhile: the dispatcher tells the server it is in progress."""

from __future__ import annotations

import asyncio
import time

from fleetpilot.contracts import TaskSubmitted
from fleetpilot.contracts.catalog import ConsumerSpec
from fleetpilot.runtime.dispatch import Dispatcher
from fleetpilot.runtime.metrics import HandlerMetrics
from fleetpilot.runtime.nats_bus import NatsBus

ACK_WAIT_S = 2.0
HANDLING_S = 5.0  # two and a half ack waits


async def test_a_slow_handler_keeps_its_message_from_the_other_replica(nats_url):
    # Two replicas on one durable consumer whose ack wait is two seconds (an executor's is 30 s,
    # and an eviction's grace or a migration may take longer).
    spec = ConsumerSpec("slow-handler", "TASKS", "task.submitted", ack_wait_s=ACK_WAIT_S)
    handled: list[tuple[str, int]] = []
    replicas: list[NatsBus] = []

    for name in ("replica-a", "replica-b"):
        bus = await NatsBus.connect(nats_url, name)
        await bus.ensure_topology()

        async def handle(task: TaskSubmitted, delivery, name=name) -> None:
            handled.append((name, delivery.deliveries))
            await asyncio.sleep(HANDLING_S)

        await bus.consume(spec, Dispatcher(bus, "test", spec.durable, (TaskSubmitted,), handle,
                                           HandlerMetrics("test"), ack_wait_s=spec.ack_wait_s))
        replicas.append(bus)
    try:
        await replicas[0].publish(TaskSubmitted(task_id="slow", submitted_at=time.time()))
        # Long enough for the handling to end and for any redelivery that came meanwhile.
        await asyncio.sleep(HANDLING_S + 2 * ACK_WAIT_S)
    finally:
        for bus in replicas:
            await bus.drain()
    assert len(handled) == 1, handled
    assert handled[0][1] == 1
