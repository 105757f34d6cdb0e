"""Runs the real thing for end-to-end tests: a nats-server and the eight services as OS processes."""

from __future__ import annotations

import asyncio
import time
from argparse import Namespace
from pathlib import Path

import nats
import nats.errors
import nats.js.api
from fleetpilot.cli.local import local_keyring, local_token
from fleetpilot.cli.up import SERVICES, ServiceProcesses
from fleetpilot.contracts import TaskSubmitted, encode, msg_id_for
from fleetpilot.runtime.embedded import EmbeddedNats
from fleetpilot.runtime.nats_bus import bucket_subject_keys


class Fleet:
    """A nats-server, the services, and a client connection, all in one temporary directory."""

    def __init__(self, root: Path, *, speed: float = 1.0, fingerprinter_partitions: int = 1) -> None:
        self.state = root / "state"
        self.server = EmbeddedNats(root / "nats").start()
        local_keyring(self.state)
        self.token = local_token(self.state, "e2e-tenant")
        self.procs = ServiceProcesses(self.state, self.server.url,
                                      Namespace(metrics_port_base=0, speed=speed, fleet=""),
                                      fingerprinter_partitions=fingerprinter_partitions)
        self.nc = None

    async def start(self) -> None:
        """Start every service and connect the test client; wait until the fleet is known
        and every service has said it started (a test that kills the server right after
        must not catch one still starting: that is another test's matter)."""
        self.procs.start_all()
        self.nc = await nats.connect(self.server.url)
        js = self.nc.jetstream()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if await bucket_subject_keys(js, "topology") and not self.starting():
                    return
            except Exception:  # noqa: BLE001 - bucket not created yet
                pass
            assert not self.procs.dead(), f"services died: {self.procs.dead()} (logs in {self.state / 'logs'})"
            await asyncio.sleep(0.3)
        raise AssertionError(f"the fleet topology never appeared, or {self.starting()} never started")

    def starting(self) -> list[str]:
        """The services whose log does not say yet that they started."""
        def said_started(name: str) -> bool:
            log = self.state / "logs" / f"{name}.log"
            return log.exists() and ": started (" in log.read_text(errors="replace")
        return [name for name in self.procs.procs if not said_started(name)]

    async def submit(self, task: TaskSubmitted) -> None:
        """Publish a task with the tenant's bearer token."""
        await self.nc.jetstream().publish("task.submitted", encode(task), headers={
            "Authorization": f"Bearer {self.token}", "Nats-Msg-Id": msg_id_for(task)})

    async def stream(self, stream: str, subject: str, idle_s: float = 1.0) -> list:
        """Every message a stream holds on ``subject`` (an ephemeral consumer from the start)."""
        js = self.nc.jetstream()
        sub = await js.pull_subscribe(subject, stream=stream,
                                      config=nats.js.api.ConsumerConfig(deliver_policy=nats.js.api.DeliverPolicy.ALL,
                                                                        ack_policy=nats.js.api.AckPolicy.NONE))
        out = []
        while True:
            try:
                batch = await sub.fetch(256, timeout=idle_s)
            except (nats.errors.TimeoutError, TimeoutError):  # nats-py raises either
                break
            out.extend(batch)
        await sub.unsubscribe()
        return out

    def restart(self, name: str) -> None:
        """Start a service again (after the test killed it)."""
        self.procs.start(name)

    async def close(self) -> None:
        """Stop everything."""
        if self.nc is not None:
            await self.nc.close()
        self.procs.stop_all(timeout_s=10)
        self.server.stop()


__all__ = ["Fleet", "SERVICES"]
