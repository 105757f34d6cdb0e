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


async def test_a_message_whose_handler_never_settled_it_is_dead_lettered_past_max_deliver(nats_url):
    # The server's max_deliver is off (the dispatcher dead-letters the last failure itself), so
    # a message whose handler kills the process (OOM, a segfault in a driver call) was handed
    # out for ever, crashing each replica in turn; only a failure the handler raised counted.
    bus = await NatsBus.connect(nats_url, "replica")
    await bus.ensure_topology()
    spec = ConsumerSpec("poison", "TASKS", "task.submitted", max_deliver=3)
    handled: list[int] = []
    letters: list[DeadLetter] = []

    async def handle(task: TaskSubmitted, delivery) -> None:
        handled.append(delivery.deliveries)

    async def on_dlq(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    try:
        task = TaskSubmitted(task_id="poison", submitted_at=time.time())
        await bus.publish(task)
        # Three deliveries never settled by their handler: each process died in it (a nak
        # without delay stands for the ack wait that followed, as both count a delivery).
        crashed = await bus._bind(spec)
        for _ in range(spec.max_deliver):
            [msg] = await crashed.fetch(1, timeout=5)
            await msg.nak()
        await bus.subscribe("dlq.>", on_dlq)
        await bus.consume(spec, Dispatcher(bus, "test", spec.durable, (TaskSubmitted,), handle,
                                           HandlerMetrics("test"), max_deliver=spec.max_deliver,
                                           ack_wait_s=spec.ack_wait_s))
        await eventually(lambda: letters, timeout_s=5, what="the dead letter of the message past its limit")
        assert handled == []
        [letter] = letters
        assert (letter.reason, letter.deliveries) == ("max_deliver", spec.max_deliver + 1)
        assert decode(letter.data, TaskSubmitted) == task and letter.headers["Nats-Msg-Id"]
    finally:
        await bus.drain()


async def test_draining_lets_a_request_and_a_core_message_in_hand_finish(nats_url):
    # A rolling restart (SIGTERM) closed the connection under the handlers at work: the SLA
    # negotiation in flight was cut and its caller got a timeout, the sample being handled was
    # gone without a dead letter.
    import asyncio

    serving = await NatsBus.connect(nats_url, "serving")
    asking = await NatsBus.connect(nats_url, "asking")
    started: list[str] = []
    finished: list[str] = []

    async def answer(data: bytes, headers: dict[str, str]) -> bytes:
        started.append("request")
        await asyncio.sleep(0.5)
        finished.append("request")
        return b"offer"

    async def sample(msg) -> None:
        started.append("sample")
        await asyncio.sleep(0.5)
        finished.append("sample")

    try:
        await serving.serve("sla", "negotiate", "test.negotiate", answer)
        await serving.subscribe("telemetry.task.*", sample)
        reply = asyncio.create_task(asking.request("test.negotiate", b"{}", timeout_s=5))
        await asking.publish_raw("telemetry.task.t1", b"{}", durable=False)
        await eventually(lambda: len(started) == 2, timeout_s=5, what="both handlers at work")
        await serving.drain()
        assert await reply == b"offer"
        assert sorted(finished) == ["request", "sample"]
    finally:
        await asking.drain()
        await serving.drain()


class DeadLetterAcksLostOnce(NatsBus):
    """A bus whose first dead letter is stored but its ack lost, as in a failover."""

    tries = 0

    async def publish_raw(self, subject, data, *, headers=None, durable=True) -> None:
        await super().publish_raw(subject, data, headers=headers, durable=durable)
        if subject.startswith("dlq."):
            self.tries += 1
            if self.tries == 1:
                raise TimeoutError("nats: timeout")


async def test_a_dead_letter_whose_ack_was_lost_is_stored_once(nats_url):
    # The original, unsettled, came again after the ack wait and was dead-lettered again: two
    # letters for one message, each listed and redriven by `fleetpilot dead-letters` on its own.
    bus = await DeadLetterAcksLostOnce.connect(nats_url, "replica")
    await bus.ensure_topology()
    spec = ConsumerSpec("dead-letters-once", "TASKS", "task.submitted", ack_wait_s=1.0)
    try:
        await bus.consume(spec, Dispatcher(bus, "test", spec.durable, (TaskSubmitted,), _never,
                                           HandlerMetrics("test"), ack_wait_s=spec.ack_wait_s))
        await bus.publish_raw("task.submitted", b"{not json", headers={"Nats-Msg-Id": "garbage"})
        await eventually(lambda: bus.tries == 2, timeout_s=5, what="the dead letter published again")
        stored = [m async for m in bus.stream_messages("DLQ", "dlq.>")]
        assert len(stored) == 1
        letter = decode(stored[0].data, DeadLetter)
        assert (letter.reason, letter.data, letter.headers["Nats-Msg-Id"]) == ("undecodable", b"{not json", "garbage")
    finally:
        await bus.drain()
