"""Start-up across an outage: the server a service connected to goes away (a restart, a
failover) while the service sets itself up. Each step is tried again once the server is back,
up to the start-up limit, after which the service says why in one line and exits 2; a SIGTERM
meanwhile still stops it at once with exit 0."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import nats
import nats.js.errors
import pytest
from fleetpilot.contracts import TaskSubmitted
from fleetpilot.runtime import ServiceHost, ServiceSettings
from fleetpilot.runtime.embedded import EmbeddedNats
from fleetpilot.runtime.host import StartupRefused
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually as wait_for


class TopologyHeldBack(NatsBus):
    """A bus whose first ``ensure_topology`` waits for ``go``, so that a test can take the
    server away after the connection and before the step talks to it."""

    async def ensure_topology(self) -> None:
        if not self.go.is_set():
            self.held.set()
            await self.go.wait()
        await super().ensure_topology()

    def hold_back(self) -> TopologyHeldBack:
        """Hold the next ``ensure_topology`` until ``go`` is set."""
        self.held, self.go = asyncio.Event(), asyncio.Event()
        return self


def _retries_of(caplog, step: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "fleetpilot.host" and r.levelno == logging.WARNING and step in r.getMessage()]


def _recording_host(url: str, seen: list[str], **settings) -> ServiceHost:
    host = ServiceHost("sla", ServiceSettings(nats_url=url, metrics_port=-1, **settings))

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def record(task: TaskSubmitted) -> None:
        seen.append(task.task_id)
    return host


async def test_the_topology_set_up_is_tried_again_once_jetstream_is_back(tmp_path, caplog):
    server = EmbeddedNats(tmp_path / "nats").start()
    seen: list[str] = []
    host = _recording_host(server.url, seen)
    bus = (await TopologyHeldBack.connect(server.url, "sla")).hold_back()
    starting = asyncio.create_task(host.start(bus))
    client = None
    core_only = EmbeddedNats(tmp_path / "nats", port=server.port, jetstream=False)
    try:
        await wait_for(bus.held.is_set)
        # The server restarts; it is back on its port, but its JetStream does not serve yet
        # (JetStream API requests find no responders, as on a cluster node still recovering).
        server.kill()
        await wait_for(lambda: not bus.connected, what="the host disconnected")
        core_only.start()
        await wait_for(lambda: bus.connected, what="the host reconnected")
        bus.go.set()
        await wait_for(lambda: _retries_of(caplog, "the streams and buckets") or starting.done(),
                       what="a retry of the set-up")
        assert not starting.done(), starting.exception()  # waiting for JetStream, not given up
        core_only.stop()
        server.start()  # JetStream again, same store
        await asyncio.wait_for(starting, 15)
        client = await NatsBus.connect(server.url, "client")
        await client.publish(TaskSubmitted(task_id="after-the-outage", submitted_at=1.0))
        await wait_for(lambda: seen == ["after-the-outage"], what="the task handled")
        assert "ServiceUnavailableError" in _retries_of(caplog, "the streams and buckets")[0]
    finally:
        starting.cancel()
        if client is not None:
            await client.drain()
        await host.stop()
        core_only.stop()
        server.stop()


async def test_a_start_up_hook_cut_by_a_server_restart_is_run_again_whole(tmp_path, caplog):
    # The hook asks another service (as the policy asks the feedback service for statistics):
    # the request goes out while the server is down and times out, "nats: timeout" in the field.
    server = EmbeddedNats(tmp_path / "nats").start()
    responder = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)

    async def ready(msg) -> None:
        await msg.respond(b"ready")

    await responder.subscribe("test.ready", cb=ready)
    seen: list[str] = []
    host = _recording_host(server.url, seen)
    runs: list[bytes] = []
    watching = {"now": 0, "ever": 0}
    go, updates = asyncio.Event(), asyncio.Event()

    async def follow() -> None:
        watching["now"] += 1
        watching["ever"] += 1
        try:
            await updates.wait()  # held by the test, as a watch's subscription is by the client
        finally:
            watching["now"] -= 1

    @host.on_startup
    async def open_views(bus) -> None:
        host.background(follow, "view-watch")
        await go.wait()
        runs.append(await bus.request("test.ready", b"", timeout_s=0.5))

    starting = asyncio.create_task(host.start())
    client = None
    try:
        await wait_for(lambda: watching["now"] == 1, what="the hook started")
        server.kill()
        await wait_for(lambda: not host.bus.connected, what="the host disconnected")
        go.set()
        await wait_for(lambda: _retries_of(caplog, "start-up hook open_views") or starting.done(),
                       what="a retry of the hook")
        assert not starting.done(), starting.exception()
        server.start()  # same port, same store
        await asyncio.wait_for(starting, 15)
        client = await NatsBus.connect(server.url, "client")
        await client.publish(TaskSubmitted(task_id="after-the-outage", submitted_at=1.0))
        await wait_for(lambda: seen == ["after-the-outage"], what="the task handled")
        assert runs == [b"ready"]
        assert "no reply on test.ready" in _retries_of(caplog, "start-up hook open_views")[0]
        # The failed run's watch was stopped: one follows the view, not two.
        assert watching == {"now": 1, "ever": 2}
    finally:
        starting.cancel()
        if client is not None:
            await client.drain()
        await responder.close()
        await host.stop()
        server.stop()


async def test_a_refusal_is_not_taken_for_an_outage(nats_url):
    # A missing bucket is the server's answer, not its absence: asking again would not help.
    host = ServiceHost("sla", ServiceSettings(nats_url=nats_url, metrics_port=-1, startup_timeout_s=60))
    runs: list[str] = []

    @host.on_startup
    async def open_unknown(bus) -> None:
        runs.append("run")
        await bus.kv("no-such-bucket")

    try:
        with pytest.raises(StartupRefused, match="open_unknown refused by the NATS server") as refused:
            await asyncio.wait_for(host.start(), 10)
        assert isinstance(refused.value.__cause__, nats.js.errors.BucketNotFoundError)
        assert runs == ["run"]
    finally:
        await host.stop()


async def test_an_endpoint_served_again_is_one_endpoint(nats_url):
    # Start-up serves an endpoint again when its first try failed after it subscribed.
    bus = await NatsBus.connect(nats_url, "sla")
    client = await nats.connect(nats_url)
    calls: list[bytes] = []

    async def answer(data: bytes, headers: dict[str, str]) -> bytes:
        calls.append(data)
        return b"ok"

    try:
        await bus.serve("sla", "offer", "test.offer", answer)
        await bus.serve("sla", "offer", "test.offer", answer)
        info = (await client.request("$SRV.INFO.fleetpilot-sla", b"", timeout=2)).data
        assert info.count(b'"test.offer"') == 1
        pings = []

        async def pinged(msg) -> None:
            pings.append(msg.data)

        sub = await client.subscribe("_test.pings", cb=pinged)
        await client.publish("$SRV.PING.fleetpilot-sla", b"", reply="_test.pings")
        await client.flush()
        await wait_for(lambda: pings, what="a ping answered")
        await asyncio.sleep(0.2)  # a second service instance would answer within this
        await sub.unsubscribe()
        assert len(pings) == 1
        assert await bus.request("test.offer", b"x") == b"ok" and calls == [b"x"]
    finally:
        await client.close()
        await bus.drain()


class FirstSubscriptionUnconfirmed(NatsBus):
    """A bus whose first wait for the server to confirm its subscriptions times out, as it
    does when the server goes away right after the SUB was queued."""

    unconfirmed = 0

    async def _subscriptions_known(self) -> None:
        if not self.unconfirmed:
            self.unconfirmed += 1
            raise TimeoutError("nats: timeout")
        await super()._subscriptions_known()


async def test_a_subscription_tried_again_handles_each_message_once(nats_url):
    bus = await FirstSubscriptionUnconfirmed.connect(nats_url, "topology")
    client = await nats.connect(nats_url)
    handled: list[bytes] = []

    async def handle(inbound) -> None:
        handled.append(inbound.data)

    try:
        with pytest.raises(TimeoutError):
            await bus.subscribe("test.telemetry", handle)
        await bus.subscribe("test.telemetry", handle)  # what start-up does once the server is back
        await client.publish("test.telemetry", b"one")
        await client.publish("test.telemetry", b"two")
        await wait_for(lambda: b"two" in handled, what="the messages handled")
        await client.flush()
        await asyncio.sleep(0.2)  # a second subscription's copies would arrive within this
        assert handled == [b"one", b"two"]
    finally:
        await client.close()
        await bus.drain()


_SERVICE = """
from fleetpilot.contracts import TaskSubmitted
from fleetpilot.runtime import ServiceHost, ServiceSettings

host = ServiceHost("sla", ServiceSettings(metrics_port=-1, log_json=False))

@host.on(TaskSubmitted, consumer="sla-submitted")
async def record(task: TaskSubmitted) -> None:
    pass

host.main()
"""


async def _service(url: str, startup_timeout_s: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "FLEETPILOT_NATS_URL": url, "FLEETPILOT_STARTUP_TIMEOUT_S": startup_timeout_s}
    return await asyncio.create_subprocess_exec(sys.executable, "-c", _SERVICE, env=env,
                                                stderr=asyncio.subprocess.PIPE)


async def _stderr_until(proc: asyncio.subprocess.Process, text: str, timeout_s: float = 15) -> list[str]:
    """The lines the service wrote to standard error up to the first that contains ``text``
    (all of them, if it exited first)."""
    lines: list[str] = []
    while not lines or text not in lines[-1]:
        line = await asyncio.wait_for(proc.stderr.readline(), timeout_s)
        if not line:
            break
        lines.append(line.decode().rstrip("\n"))
    return lines


async def test_start_up_gives_up_at_its_limit_in_one_line(tmp_path):
    # Connected, but JetStream never serves: after FLEETPILOT_STARTUP_TIMEOUT_S, one line, exit 2.
    server = EmbeddedNats(tmp_path / "nats", jetstream=False).start()
    try:
        proc = await _service(server.url, "1")
        lines = await _stderr_until(proc, "cannot start")
        assert await asyncio.wait_for(proc.wait(), 10) == 2
        assert any("trying again" in line for line in lines)
        assert lines[-1].startswith(
            "fleetpilot-sla: cannot start: the streams and buckets still failed after 1 s, the start-up limit "
            "(FLEETPILOT_STARTUP_TIMEOUT_S): nats: ServiceUnavailableError")
        assert await proc.stderr.read() == b""  # one line: no traceback after it
    finally:
        server.stop()


async def test_sigterm_while_start_up_waits_for_the_server_stops_at_once(tmp_path):
    server = EmbeddedNats(tmp_path / "nats", jetstream=False).start()
    try:
        proc = await _service(server.url, "60")
        lines = await _stderr_until(proc, "trying again")
        assert lines and "trying again" in lines[-1], lines
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 5) == 0
        rest = (await proc.stderr.read()).decode()
        assert "stopping before it started" in rest and "cannot start" not in rest
    finally:
        server.stop()


async def test_a_stream_the_server_will_not_take_is_one_line_at_start_up(tmp_path):
    # An operator made TASKS in memory; a stream's storage cannot be changed by an update.
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        client = await nats.connect(server.url)
        await client.jetstream().add_stream(name="TASKS", subjects=["task.>"], storage="memory")
        await client.close()
        proc = await _service(server.url, "60")
        lines = await _stderr_until(proc, "cannot start")
        assert await asyncio.wait_for(proc.wait(), 10) == 2
        assert lines[-1].startswith(
            "fleetpilot-sla: cannot start: the streams and buckets refused by the NATS server:"), lines
        assert "trying again" not in "\n".join(lines)
        assert await proc.stderr.read() == b""  # one line: no traceback after it
    finally:
        server.stop()


async def test_a_stream_whose_subjects_another_stream_takes_is_told_as_such(nats_url):
    # An operator's own stream on task.> (a backup): the catalog's TASKS could not be made, and
    # the update tried in its place found no TASKS, so the line said "stream not found", which
    # sent the operator looking for a stream that was never meant to be there already.
    client = await nats.connect(nats_url)
    await client.jetstream().add_stream(name="BACKUP", subjects=["task.>"])
    await client.close()
    host = ServiceHost("sla", ServiceSettings(nats_url=nats_url, metrics_port=-1))
    try:
        with pytest.raises(StartupRefused, match="streams and buckets refused by the NATS server: .*overlap"):
            await asyncio.wait_for(host.start(), 10)
    finally:
        await host.stop()
