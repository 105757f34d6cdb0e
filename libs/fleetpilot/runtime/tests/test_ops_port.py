"""The service's own port (/metrics, /healthz) is bound before the service takes any work,
and /healthz says ok only once the service has started."""

from __future__ import annotations

import asyncio
import socket

import pytest
from fleetpilot.contracts import TaskSubmitted
from fleetpilot.runtime import InMemoryBus, ServiceHost, ServiceSettings


async def test_a_metrics_port_taken_stops_the_start_before_any_work_is_taken():
    # Bound last, a taken port (two replicas on one host given the same port) was found after
    # the start-up hooks had run (the executor's reclaims its last run's tasks) and the
    # consumers had begun handling messages, each then cut when the process exited: in a crash
    # loop, every restart cut a message's handling again until it was dead-lettered.
    bus = InMemoryBus()
    await bus.ensure_topology()
    await bus.publish(TaskSubmitted(task_id="t1", submitted_at=1.0))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        host = ServiceHost("sla", ServiceSettings(nats_url="unused", metrics_port=taken.getsockname()[1]))
        hooks: list[str] = []
        handled: list[str] = []

        @host.on_startup
        async def reclaim(bus) -> None:
            hooks.append("reclaim")

        @host.on(TaskSubmitted, consumer="sla-submitted")
        async def admit(task: TaskSubmitted) -> None:
            handled.append(task.task_id)

        with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1:\d+ .*METRICS_PORT\): .*in use"):
            await host.start(bus)
        await asyncio.sleep(0.2)  # what a consumer bound would have handled by now
    assert hooks == [] and handled == []
    await bus.drain()


async def test_healthz_is_not_ok_until_the_service_has_started():
    # Served from the start, /healthz must not say ok while start-up still waits (a hook
    # reading a view, a consumer not bound yet): the service takes no work then.
    bus = InMemoryBus()
    host = ServiceHost("sla", ServiceSettings(nats_url="unused", metrics_port=0))
    release = asyncio.Event()
    seen: list[dict] = []

    @host.on_startup
    async def slow(bus) -> None:
        seen.append(host.health())
        await release.wait()

    starting = asyncio.create_task(host.start(bus))
    try:
        while not seen:
            await asyncio.sleep(0.01)
        assert seen[0]["ok"] is False and seen[0]["starting"] is True
        release.set()
        await starting
        assert host.health()["ok"] is True and "starting" not in host.health()
    finally:
        await host.stop()
