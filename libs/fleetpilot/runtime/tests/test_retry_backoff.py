"""A failed message is delivered again on the consumer's declared back-off schedule."""

from __future__ import annotations

from fleetpilot.contracts import CONSUMERS, TaskSubmitted
from fleetpilot.runtime import InMemoryBus, ServiceHost, ServiceSettings
from fleetpilot.runtime.bus import Inbound
from fleetpilot.runtime.dispatch import Dispatcher
from fleetpilot.runtime.metrics import HandlerMetrics
from fleetpilot.runtime.testing import eventually as wait_for


class _RecordingBus(InMemoryBus):
    """An in-memory bus that notes each ``nak``'s delay and redelivers at once (the delays
    asked for, 17.5 s in all, are what is looked at; waiting them out proves nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.nak_delays: list[float] = []

    async def consume(self, spec, handler) -> None:
        bus = self

        class Noted(Inbound):
            def __init__(self, inner: Inbound) -> None:
                self._inner = inner
                self.subject, self.data, self.headers = inner.subject, inner.data, inner.headers
                self.deliveries, self.pending, self.origin = inner.deliveries, inner.pending, inner.origin

            async def ack(self) -> None:
                await self._inner.ack()

            async def term(self) -> None:
                await self._inner.term()

            async def in_progress(self) -> None:
                await self._inner.in_progress()

            async def nak(self, delay_s: float) -> None:
                bus.nak_delays.append(delay_s)
                await self._inner.nak(0.0)

        async def noted(inbound: Inbound) -> None:
            await handler(Noted(inbound))

        await super().consume(spec, noted)


async def test_a_failing_handler_s_message_comes_again_on_the_consumer_s_back_off():
    # The catalog declares each consumer's back-off (0.5, 2, 5, 10 s) and publishes it in the
    # language-neutral contract (proto/asyncapi.yaml, backoffSeconds); the dispatcher used its
    # own 0.5, 1, 2, 4 instead, so a dependency away for 8 s dead-lettered every message
    # handled meanwhile, where the declared schedule rides out 17 s.
    bus = _RecordingBus()
    await bus.ensure_topology()
    host = ServiceHost("sla", ServiceSettings(metrics_port=-1, nats_url="unused"))

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def failing(task: TaskSubmitted) -> None:
        raise ConnectionError("the store is away")

    await host.start(bus)
    try:
        await bus.publish(TaskSubmitted(task_id="t1", submitted_at=1.0))
        spec = CONSUMERS["sla-submitted"]
        await wait_for(lambda: len(bus.nak_delays) == spec.max_deliver - 1, what="every retry")
        await bus.settle()
        assert bus.nak_delays == list(spec.backoff_s)[:spec.max_deliver - 1] == [0.5, 2, 5, 10]
    finally:
        await host.stop()


async def test_past_the_back_off_s_last_step_the_last_delay_is_kept():
    bus = _RecordingBus()
    await bus.ensure_topology()
    async def failing(task: TaskSubmitted) -> None:
        raise ConnectionError("the store is away")

    dispatcher = Dispatcher(bus, "sla", "sla-submitted", (TaskSubmitted,), failing, HandlerMetrics("sla"),
                            max_deliver=7, backoff_s=(1.0, 3.0))
    await bus.consume(CONSUMERS["sla-submitted"], dispatcher)
    await bus.publish(TaskSubmitted(task_id="t1", submitted_at=1.0))
    await wait_for(lambda: len(bus.nak_delays) == 6, what="every retry")
    assert bus.nak_delays == [1.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    await bus.drain()
