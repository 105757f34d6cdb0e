"""An event that holds NaN or an infinity cannot go on the bus (``encode`` refuses it): what
the runtime does with the handling, job or request that made it.

Before, msgspec wrote such a float as ``null`` and the event went out: every consumer then
dead-lettered it as undecodable, far from the producer that made the bad value."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
from fleetpilot.contracts import DeadLetter, TaskRejected, TaskSubmitted, decode, encode
from fleetpilot.runtime import Delivery, InMemoryBus, ServiceHost, ServiceSettings
from fleetpilot.runtime.testing import eventually as wait_for


def settings() -> ServiceSettings:
    return ServiceSettings(metrics_port=-1, nats_url="unused")


def rejection(task_id: str, at: float = 1.0) -> TaskRejected:
    return TaskRejected(task_id=task_id, code="invalid", reason="test", rejected_at=at)


def rejected_ids(stored: list[tuple[str, bytes]]) -> list[str]:
    return [decode(data, TaskRejected).task_id for subject, data in stored if subject == "task.rejected"]


async def test_a_handler_output_holding_nan_dead_letters_its_input_at_once_and_sends_none_of_it(bus):
    host = ServiceHost("sla", settings())
    deliveries: list[int] = []
    letters: list[DeadLetter] = []
    published: list[bytes] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def judge(task: TaskSubmitted, delivery: Delivery) -> list[TaskRejected]:
        if task.task_id != "bad":
            return [rejection(task.task_id)]
        deliveries.append(delivery.deliveries)
        # The first output is fine: it must not go out alone for an input that is dead-lettered.
        return [rejection("bad-first"), rejection("bad", at=math.nan)]

    async def on_dlq(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    async def on_rejected(msg) -> None:
        published.append(msg.data)

    await host.start(bus)
    await bus.subscribe("dlq.>", on_dlq)
    await bus.subscribe("task.rejected", on_rejected)
    await bus.publish(TaskSubmitted(task_id="bad", submitted_at=1.0))
    await bus.publish(TaskSubmitted(task_id="fine", submitted_at=1.0))
    await wait_for(lambda: letters and published, timeout_s=10, what="the dead letter and the good output")
    await asyncio.sleep(0.3)  # a redelivery (the first retry is after 0.5 s) would show here
    await host.stop()
    letter = letters[0]
    assert (letter.subject, letter.reason, letter.deliveries) == ("task.submitted", "unencodable", 1)
    assert "TaskRejected" in letter.error and "$.rejected_at is nan" in letter.error
    assert "\n" not in letter.error
    assert decode(letter.data, TaskSubmitted).task_id == "bad"
    assert deliveries == [1] and len(letters) == 1
    assert [decode(data, TaskRejected).task_id for data in published] == ["fine"]
    counted = host.metrics.registry.get_sample_value
    assert counted("fleetpilot_dead_letters_total",
                   {"service": "sla", "handler": "sla-submitted", "reason": "unencodable"}) == 1


async def test_an_endpoint_answer_holding_inf_fails_the_request_naming_the_field_logged_and_counted(bus, caplog):
    host = ServiceHost("sla", settings())

    @host.endpoint("quote", "test.quote", TaskSubmitted)
    async def quote(task: TaskSubmitted) -> TaskSubmitted:
        return TaskSubmitted(task_id=task.task_id, size_gb=math.inf)

    await host.start(bus)
    try:
        with pytest.raises(RuntimeError, match=r"test\.quote failed.*\$\.size_gb is inf"):
            await bus.request("test.quote", encode(TaskSubmitted(task_id="q")), timeout_s=5)
    finally:
        await host.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith("endpoint quote failed: NonFiniteFloat: TaskSubmitted")
    counted = host.metrics.registry.get_sample_value
    assert counted("fleetpilot_handler_errors_total", {"service": "sla", "handler": "quote"}) == 1


async def test_a_periodic_job_s_event_holding_nan_is_dropped_and_told_while_the_rest_goes_out(caplog):
    # Kept to be published again, as an event the bus refused is, it was refused again at every
    # tick, for ever, and every event the job made after it queued behind it.
    bus = InMemoryBus()
    host = ServiceHost("sla", settings())
    runs: list[int] = []

    @host.every(0.05)
    async def reject() -> list[TaskRejected]:
        runs.append(len(runs))
        if len(runs) == 1:
            return [rejection("t0"), rejection("bad", at=math.inf), rejection("t1")]
        return [rejection(f"t{len(runs)}")] if len(runs) <= 3 else []

    with caplog.at_level(logging.ERROR, logger="fleetpilot.host"):
        await host.start(bus)
        try:
            await wait_for(lambda: len(runs) >= 5)
        finally:
            await host.stop()
    assert rejected_ids(bus.stored("TASKS")) == ["t0", "t1", "t2", "t3"]
    told = [r.getMessage() for r in caplog.records if r.name == "fleetpilot.host" and r.levelname == "ERROR"]
    assert len(told) == 1 and "periodic job reject" in told[0] and "$.rejected_at is inf" in told[0]
    counted = host.metrics.registry.get_sample_value
    assert counted("fleetpilot_handler_errors_total", {"service": "sla", "handler": "reject"}) == 1


async def test_a_stopping_hook_s_event_holding_nan_is_dropped_and_the_rest_goes_out(caplog):
    bus = InMemoryBus()
    host = ServiceHost("sla", settings())

    @host.on_stopping
    async def give_up() -> list[TaskRejected]:
        return [rejection("bad", at=math.nan), rejection("t0")]

    await host.start(bus)
    await host.stop()
    assert rejected_ids(bus.stored("TASKS")) == ["t0"]
    assert any("$.rejected_at is nan" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")
