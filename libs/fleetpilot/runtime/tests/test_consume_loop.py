"""A replica's consume loop outlives a message it could not settle: a dead letter whose
publish failed (JetStream briefly unavailable, a leader election) must not stop the replica
consuming while its /healthz still says ok."""

from __future__ import annotations

import time

from fleetpilot.contracts import DeadLetter, TaskSubmitted, decode
from fleetpilot.contracts.catalog import ConsumerSpec
from fleetpilot.runtime.dispatch import Dispatcher
from fleetpilot.runtime.metrics import HandlerMetrics
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually


class DeadLettersTimeOutOnce(NatsBus):
    """A bus whose first dead letter's publish times out, as it does mid-failover."""

    failed = 0

    async def publish_raw(self, subject, data, *, headers=None, durable=True) -> None:
        if subject.startswith("dlq.") and not self.failed:
            self.failed += 1
            raise TimeoutError("nats: timeout")
        await super().publish_raw(subject, data, headers=headers, durable=durable)


async def test_a_dead_letter_that_cannot_be_published_does_not_stop_the_consumer(nats_url):
    bus = await DeadLettersTimeOutOnce.connect(nats_url, "replica")
    await bus.ensure_topology()
    spec = ConsumerSpec("settles-later", "TASKS", "task.submitted", ack_wait_s=1.0)
    handled: list[str] = []
    letters: list[DeadLetter] = []

    async def handle(task: TaskSubmitted) -> None:
        handled.append(task.task_id)

    async def on_dlq(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    try:
        await bus.subscribe("dlq.>", on_dlq)
        await bus.consume(spec, Dispatcher(bus, "test", spec.durable, (TaskSubmitted,), handle,
                                           HandlerMetrics("test"), ack_wait_s=spec.ack_wait_s))
        await bus.publish_raw("task.submitted", b"{not json", headers={"Nats-Msg-Id": "garbage"})
        await bus.publish(TaskSubmitted(task_id="after", submitted_at=time.time()))
        await eventually(lambda: "after" in handled, timeout_s=5, what="the message after the failed dead letter")
        # Not settled, the bad message came again after the ack wait and was dead-lettered then.
        await eventually(lambda: letters, timeout_s=5, what="the dead letter, published at its second try")
        assert bus.failed == 1 and letters[0].reason == "undecodable"
    finally:
        await bus.drain()


async def test_a_core_message_whose_dead_letter_cannot_be_published_is_said_lost(nats_url, caplog):
    # nats-py hands a callback's error to error_cb, which logs at debug: the sample was gone
    # without a word at any level an operator reads.
    bus = await DeadLettersTimeOutOnce.connect(nats_url, "replica")
    try:
        await bus.subscribe("telemetry.task.*", Dispatcher(bus, "test", "telemetry", (TaskSubmitted,), _never,
                                                           HandlerMetrics("test"), redelivered=False))
        await bus.publish_raw("telemetry.task.t1", b"{not json", durable=False)
        await eventually(lambda: any(r.levelname == "ERROR" and "was lost" in r.getMessage() for r in caplog.records),
                         timeout_s=5, what="the loss said at error level")
        assert bus.failed == 1  # the loss said is the dead letter whose publish failed
    finally:
        await bus.drain()


async def _never(task: TaskSubmitted) -> None:
    raise AssertionError("an undecodable message never reaches its handler")
