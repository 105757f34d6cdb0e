"""A handler that raises ``CancelledError`` without being cancelled (it awaited a task that
something else cancelled) fails that one message or request; its consumer, subscription or
endpoint goes on."""

from __future__ import annotations

import asyncio

import pytest
from fleetpilot.contracts import DeadLetter, TaskSubmitted, TaskTelemetry, decode, encode
from fleetpilot.runtime import ServiceHost, ServiceSettings
from fleetpilot.runtime.testing import eventually as wait_for


def settings() -> ServiceSettings:
    return ServiceSettings(metrics_port=-1, nats_url="unused")


async def cancelled_elsewhere() -> None:
    """What a handler meets when it awaits work another party gave up on (a shared lookup
    cancelled by its owner's shutdown, a client library's own timeout)."""
    work = asyncio.ensure_future(asyncio.sleep(10))
    work.cancel()
    await work


async def test_a_durable_handler_that_raises_cancelled_fails_once_and_its_consumer_goes_on(bus):
    # The consume loop took the CancelledError for its own cancellation and ended, silently:
    # the replica consumed nothing more, and /healthz said ok.
    host = ServiceHost("sla", settings())
    handled: list[tuple[str, int]] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def admit(task: TaskSubmitted, delivery) -> None:
        if task.task_id == "first" and delivery.deliveries == 1:
            await cancelled_elsewhere()
        handled.append((task.task_id, delivery.deliveries))

    await host.start(bus)
    try:
        await bus.publish(TaskSubmitted(task_id="first", submitted_at=1.0))
        await bus.publish(TaskSubmitted(task_id="second", submitted_at=2.0))
        await wait_for(lambda: sorted(handled) == [("first", 2), ("second", 1)], timeout_s=10,
                       what="the next message handled and the first one retried")
    finally:
        await host.stop()
    assert host.metrics.errors.labels("sla", "sla-submitted")._value.get() == 1


async def test_a_core_handler_that_raises_cancelled_loses_one_sample_not_the_subscription(bus):
    # nats-py ends a subscription's message loop on a CancelledError from its callback: the
    # service heard no telemetry again, its subscription still open on the server.
    host = ServiceHost("fingerprinter", settings())
    seen: list[str] = []
    letters: list[DeadLetter] = []

    @host.on_core("telemetry.task.>", TaskTelemetry)
    async def sample(event: TaskTelemetry) -> None:
        if event.task_id == "t1":
            await cancelled_elsewhere()
        seen.append(event.task_id)

    async def on_dlq(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await host.start(bus)
    await bus.subscribe("dlq.>", on_dlq)
    try:
        await bus.publish(TaskTelemetry(task_id="t1", node="n0", gpus=[0], at=1.0, memory_used_mb=1.0))
        await wait_for(lambda: letters, timeout_s=10, what="the first sample dead-lettered")
        await bus.publish(TaskTelemetry(task_id="t2", node="n0", gpus=[0], at=2.0, memory_used_mb=1.0))
        await wait_for(lambda: seen == ["t2"], timeout_s=10, what="the next sample handled")
    finally:
        await host.stop()
    assert (letters[0].subject, letters[0].reason) == ("telemetry.task.t1", "failed")
    assert "CancelledError" in letters[0].error


async def test_an_endpoint_whose_handler_raises_cancelled_fails_one_request_and_answers_the_next(bus):
    # nats.micro catches Exception only: the CancelledError ended the endpoint's subscription
    # loop, and every later request (an interactive negotiation) timed out.
    host = ServiceHost("sla", settings())
    calls: list[str] = []

    @host.endpoint("quote", "test.quote", TaskSubmitted)
    async def quote(task: TaskSubmitted) -> TaskSubmitted:
        calls.append(task.task_id)
        if len(calls) == 1:
            await cancelled_elsewhere()
        return task

    await host.start(bus)
    try:
        with pytest.raises(RuntimeError, match="test.quote failed.*CancelledError"):
            await bus.request("test.quote", encode(TaskSubmitted(task_id="q1", submitted_at=1.0)), timeout_s=5)
        reply = decode(await bus.request("test.quote", encode(TaskSubmitted(task_id="q2", submitted_at=1.0)),
                                         timeout_s=5), TaskSubmitted)
    finally:
        await host.stop()
    assert reply.task_id == "q2"
