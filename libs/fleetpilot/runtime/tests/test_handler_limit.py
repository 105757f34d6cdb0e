"""A handler that hangs is cut at its consumer's limit: its message is retried, then
dead-lettered, and the consumer goes on with the next one."""

from __future__ import annotations

import asyncio
import dataclasses

from fleetpilot.contracts import CONSUMERS, DeadLetter, TaskSubmitted, decode
from fleetpilot.runtime import InMemoryBus, ServiceHost, ServiceSettings
from fleetpilot.runtime.testing import eventually as wait_for


async def test_a_handler_that_hangs_is_cut_at_its_limit_and_the_consumer_goes_on(monkeypatch):
    # A statement waiting on a lock nobody releases, a request to a server behind a partition:
    # the handler never returned, its in-progress beats kept its message from every other
    # replica, and on this replica the consumer took nothing else. /healthz said ok.
    monkeypatch.setitem(CONSUMERS, "sla-submitted",
                        dataclasses.replace(CONSUMERS["sla-submitted"], handler_limit_s=0.3, max_deliver=2,
                                            backoff_s=(0.0,)))
    bus = InMemoryBus()
    await bus.ensure_topology()
    host = ServiceHost("sla", ServiceSettings(metrics_port=-1, nats_url="unused"))
    handled: list[str] = []
    letters: list[DeadLetter] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def hangs_on_one(task: TaskSubmitted) -> None:
        if task.task_id == "stuck":
            await asyncio.Event().wait()  # never set
        handled.append(task.task_id)

    async def on_letter(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await bus.subscribe("dlq.>", on_letter)
    await host.start(bus)
    try:
        await bus.publish(TaskSubmitted(task_id="stuck", submitted_at=1.0))
        await bus.publish(TaskSubmitted(task_id="next", submitted_at=2.0))
        await wait_for(lambda: handled == ["next"] and letters, timeout_s=10,
                       what="the next message handled and the stuck one dead-lettered")
    finally:
        await host.stop()
    [letter] = letters
    assert (letter.subject, letter.reason, letter.deliveries) == ("task.submitted", "max_deliver", 2)
    assert "ran past its limit of 0.3 s" in letter.error


def test_every_consumer_has_a_limit_its_handlers_can_meet():
    for spec in CONSUMERS.values():
        assert spec.handler_limit_s >= 600, spec.durable  # past the longest wait a handler is built for
