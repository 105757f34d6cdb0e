"""The in-memory bus drains as ``Bus.drain`` promises: in-flight handlers finish."""

from __future__ import annotations

import asyncio

from fleetpilot.contracts import TaskSubmitted, TaskTelemetry
from fleetpilot.runtime import InMemoryBus, ServiceHost, ServiceSettings
from fleetpilot.runtime.testing import eventually as wait_for


async def test_stopping_lets_the_handlers_at_work_finish_their_messages():
    # The in-memory bus cancelled its consumers' workers at drain, handler and all: a service
    # test stopping its host while a handler was at work (an eviction's grace, a store write)
    # saw the handler cut, where the real bus lets it finish and settles its message.
    bus = InMemoryBus()
    await bus.ensure_topology()
    host = ServiceHost("sla", ServiceSettings(metrics_port=-1, nats_url="unused"))
    release = asyncio.Event()
    started: list[str] = []
    finished: list[str] = []

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def slow(task: TaskSubmitted) -> None:
        started.append(task.task_id)
        await release.wait()
        finished.append(task.task_id)

    @host.on_core("telemetry.task.*", TaskTelemetry)
    async def slow_sample(sample: TaskTelemetry) -> None:
        started.append(sample.task_id)
        await release.wait()
        finished.append(sample.task_id)

    await host.start(bus)
    await bus.publish(TaskSubmitted(task_id="durable", submitted_at=1.0))
    await bus.publish(TaskTelemetry(task_id="core", node="n1", gpus=[0], at=1.0, memory_used_mb=1.0))
    await wait_for(lambda: sorted(started) == ["core", "durable"], what="both handlers at work")
    stopping = asyncio.create_task(host.stop())
    await wait_for(lambda: not bus.consuming, what="the drain to begin")
    release.set()
    await stopping
    assert sorted(finished) == ["core", "durable"]


async def test_the_stopping_hooks_run_once_the_handlers_have_finished_and_can_still_publish():
    # The stopping hooks ran before the bus drained: a checkpoint written there missed the
    # samples handled during the drain, and an executor giving its tasks up could see a
    # decision's handler start a process after it. They now run after the last handler.
    bus = InMemoryBus()
    await bus.ensure_topology()
    host = ServiceHost("sla", ServiceSettings(metrics_port=-1, nats_url="unused"))
    release = asyncio.Event()
    handled: list[str] = []
    seen_by_hook: list[list[str]] = []

    at_work = asyncio.Event()

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def slow(task: TaskSubmitted) -> None:
        at_work.set()
        await release.wait()
        handled.append(task.task_id)

    @host.on_stopping
    async def last_word() -> TaskSubmitted:
        seen_by_hook.append(list(handled))
        return TaskSubmitted(task_id="last-word", submitted_at=2.0)

    await host.start(bus)
    await bus.publish(TaskSubmitted(task_id="in-flight", submitted_at=1.0))
    await asyncio.wait_for(at_work.wait(), 5)
    stopping = asyncio.create_task(host.stop())
    await wait_for(lambda: not bus.consuming, what="the stop to begin")
    await bus.publish(TaskSubmitted(task_id="too-late", submitted_at=1.5))  # stored, handed to nobody
    release.set()
    await stopping
    assert seen_by_hook == [["in-flight"]] and handled == ["in-flight"]
    stored = [subject for subject, _ in bus.stored("TASKS")]
    assert stored.count("task.submitted") == 3  # the hook's last word went out after the handlers stopped
