"""The collector service: samples every GPU it can read and publishes it.

- ``telemetry.gpu.<node>``: one batch of ``GpuSample`` per node per interval (core NATS);
- ``telemetry.task.<task>``: per-task process memory samples;
- ``topology.report.<node>``: the node's topology at start and every ``topology_every_s``;
- the ``gpu_state`` bucket keeps the latest sample per GPU for late joiners.

With ``source = sim`` it hosts the simulated fleet (advanced ``speed`` virtual seconds per
real second) and answers ``sim.control`` so the executor can run tasks on it; simulated
hardware events (a task finished or was OOM-killed, faults) go out on ``sim.event.<node>``.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Literal

from pydantic_settings import SettingsConfigDict

from fleetpilot.contracts import (
    NodeTelemetry,
    SimAck,
    SimCommand,
    SimEvent,
    TopologyReport,
    encode,
    now,
)
from fleetpilot.fleet.reader import GpuReader
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import Bus, ServiceHost, ServiceSettings
from fleetpilot.workload import MemoryGrowth

log = logging.getLogger("fleetpilot.collector")


class CollectorSettings(ServiceSettings):
    """``FLEETPILOT_COLLECTOR_*``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_COLLECTOR_", extra="ignore")

    source: Literal["auto", "nvml", "sim"] = "auto"
    fleet_spec: str = ""
    openb_nodes: str = ""
    interval_s: float = 1.0
    speed: float = 1.0
    topology_every_s: float = 30.0
    seed: int = 0


class NoGpuSource(RuntimeError):
    """Neither NVML nor a simulated fleet is available."""


def open_reader(settings: CollectorSettings) -> tuple[GpuReader, str]:
    """The reader for the configured source; ``auto`` prefers NVML, then a configured simulator."""
    if settings.source in ("auto", "nvml"):
        from fleetpilot.fleet.nvml_reader import NvmlReader, nvml_available

        if nvml_available():
            return NvmlReader(), "nvml"
        if settings.source == "nvml":
            raise NoGpuSource("NVML is not available on this machine (no NVIDIA driver)")
    if settings.source == "sim" or settings.fleet_spec or settings.openb_nodes:
        from fleetpilot.fleet.inventory import load_fleet_spec, load_openb_fleet
        from fleetpilot.fleet.simulator import SimulatedFleet

        if settings.openb_nodes:
            fleet = load_openb_fleet(settings.openb_nodes)
        elif settings.fleet_spec:
            fleet = load_fleet_spec(Path(settings.fleet_spec))
        else:
            fleet = load_fleet_spec()
        return SimulatedFleet(fleet, seed=settings.seed), "sim"
    raise NoGpuSource("no GPU found (NVML unavailable) and no simulated fleet configured "
                      "(set FLEETPILOT_COLLECTOR_SOURCE=sim)")


class SimulatedHardware:
    """The simulated fleet as hardware: runs tasks for their duration, reports what happens."""

    def __init__(self, fleet) -> None:
        self.fleet = fleet
        self.ends_at: dict[str, float] = {}
        self.node_of: dict[str, str] = {}

    def command(self, cmd: SimCommand) -> SimAck:
        """Apply one executor command."""
        try:
            if cmd.verb in ("remove", "move") and cmd.task_id in self.fleet.running():
                self.fleet.remove(cmd.task_id)
                if cmd.verb == "remove":
                    self.ends_at.pop(cmd.task_id, None)
            if cmd.verb in ("place", "move"):
                if cmd.task_id in self.fleet.running():
                    return SimAck(ok=True, detail="already running")
                peak = max(cmd.peak_memory_mb, 1.0)
                growth = MemoryGrowth(pattern=cmd.pattern if cmd.pattern != "unknown" else "flat",
                                      base_mb=peak * 0.3, peak_mb=peak, duration_s=cmd.duration_s,
                                      warmup_s=cmd.duration_s * 0.05, period_s=cmd.duration_s / 6,
                                      noise_mb=peak * 0.003)
                self.fleet.place(cmd.task_id, cmd.node, list(cmd.gpus), growth, util=cmd.utilization_pct)
                self.ends_at.setdefault(cmd.task_id, self.fleet.now_s + cmd.duration_s)
                self.node_of[cmd.task_id] = cmd.node
        except (KeyError, ValueError) as exc:
            return SimAck(ok=False, detail=str(exc))
        return SimAck(ok=True)

    def advance(self, dt_s: float) -> list[SimEvent]:
        """Advance virtual time; finished tasks leave, OOM kills and faults are reported."""
        self.fleet.advance(dt_s)
        events: list[SimEvent] = []
        for ev in self.fleet.events():
            kind = {"oom": "oom_killed"}.get(ev.kind, ev.kind)
            if kind in ("oom_killed", "xid", "ecc", "overheat"):
                if ev.task_id:
                    self.ends_at.pop(ev.task_id, None)
                events.append(SimEvent(kind=kind, node=ev.node, gpu=ev.gpu, task_id=ev.task_id,
                                       detail=ev.detail, at=now()))
        for task_id, end in list(self.ends_at.items()):
            if self.fleet.now_s >= end:
                node = self.node_of.pop(task_id, "")
                if task_id in self.fleet.running():
                    self.fleet.remove(task_id)
                del self.ends_at[task_id]
                events.append(SimEvent(kind="finished", node=node, task_id=task_id, at=now()))
        return events


def build(settings: CollectorSettings | None = None) -> ServiceHost:
    """Wire the collector; fails with ``NoGpuSource`` when there is nothing to read."""
    settings = settings or CollectorSettings()
    reader, source = open_reader(settings)
    host = ServiceHost("collector", settings)
    hardware = SimulatedHardware(reader) if source == "sim" else None
    last = {"at": time.monotonic(), "topology": 0.0}

    async def publish_topology(bus: Bus) -> None:
        for node in reader.node_names():
            await bus.publish(TopologyReport(node=reader.topology(node), source=source, at=now()))
        last["topology"] = time.monotonic()

    host.on_startup(publish_topology)

    @host.every(settings.interval_s)
    async def sample() -> list:
        bus = host.bus
        assert bus is not None
        out: list = []
        if hardware is not None:
            elapsed = time.monotonic() - last["at"]
            last["at"] = time.monotonic()
            out.extend(hardware.advance(elapsed * settings.speed))
        gpu_state = await bus.kv("gpu_state")
        for node in reader.node_names():
            samples = reader.sample(node)
            out.append(NodeTelemetry(node=node, at=now(), source=source, gpus=samples))
            out.extend(reader.task_samples(node))
            for s in samples:
                await gpu_state.put(f"{node_key(node)}.{s.gpu}", encode(s))
        if time.monotonic() - last["topology"] > settings.topology_every_s:
            await publish_topology(bus)
        return out

    if hardware is not None:
        @host.endpoint("control", "sim.control", SimCommand)
        async def control(cmd: SimCommand) -> SimAck:
            return hardware.command(cmd)

    return host


def main() -> None:
    """Entry point with the one-line error the issue asks for when no GPU source exists."""
    try:
        host = build()
    except NoGpuSource as exc:
        print(f"fleetpilot-collector: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    host.main()
