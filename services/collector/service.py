"""The collector service: samples every GPU it can read and publishes it.

- ``telemetry.gpu.<node>``: one batch of ``GpuSample`` per node per interval (core NATS);
- ``telemetry.task.<task>``: per-task process memory samples;
- ``topology.report.<node>``: the node's topology at start and every ``topology_every_s``;
- the ``gpu_state`` bucket keeps the latest sample per GPU for late joiners.

With ``source = sim`` it hosts the simulated fleet (advanced ``speed`` virtual seconds per
real second) and answers ``sim.control`` so the executor can run tasks on it; simulated
hardware events (a task finished, was OOM-killed or lost to a fatal XID, faults) go out on
``sim.event.<node>``.

NVML reads go through ``watchdog.NvmlWatchdog``: one at a time, each bounded by
``nvml_timeout_s``; a hung one is told (log, metric, ``/healthz``) and not piled on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Literal

from fleetpilot.contracts import (
    GpuSample,
    NicPortRate,
    NodeTelemetry,
    SimAck,
    SimCommand,
    SimEvent,
    TopologyReport,
    encode,
    now,
)
from fleetpilot.contracts.codec import NonFiniteFloat
from fleetpilot.fleet.bandwidth import port_rates
from fleetpilot.fleet.nvml_reader import read_ib_ports
from fleetpilot.fleet.reader import FleetEvent, GpuReader
from fleetpilot.fleet.simulator import SimulatedFleet
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import Bus, ServiceHost, ServiceSettings, serve
from fleetpilot.workload import MemoryGrowth
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from .watchdog import NvmlHung, NvmlWatchdog

log = logging.getLogger("fleetpilot.collector")

SIM_NODES_PER_TURN = 32
"""Simulated nodes read between two turns of the event loop (a few milliseconds of work)."""
MAX_STOPPED_TASKS = 100_000
"""How many removed tasks' progress the simulated hardware keeps for a later restore."""


class CollectorSettings(ServiceSettings):
    """``FLEETPILOT_COLLECTOR_*``: where readings come from and how often they go out."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_COLLECTOR_", extra="ignore")

    source: Literal["auto", "nvml", "sim"] = "auto"
    fleet_spec: str = ""
    openb_nodes: str = ""
    # Periods above 0 and finite: 0, a negative or NaN period made the job a busy loop (over
    # NVML, on a real node). The simulator's clock only moves forward, at a finite pace (a
    # negative speed failed every tick, an infinite one made every reading NaN); numpy takes
    # no negative seed.
    interval_s: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    speed: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    topology_every_s: float = Field(default=30.0, gt=0.0, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0)
    # NVML only: the name and site this node reports under, and where the host's /proc and
    # /sys are mounted (a container sees the host's at e.g. /host).
    node_name: str = ""
    site: str = "default"
    host_root: str = "/"
    # NVML only: how long one read (a sample, the XID drain, the topology) may take before it
    # counts as hung (a GPU fallen off the bus, a stuck driver); see watchdog.py.
    nvml_timeout_s: float = Field(default=10.0, gt=0.0, le=600.0, allow_inf_nan=False)
    # NVML only: read PCIe byte counters that wrap within a reading period (32-bit on an
    # H200) on a thread, fast enough to count every wrap (4.7% of a core per GPU measured
    # there); off, each reading takes NVML's 20 ms sampling call per direction instead.
    pcie_poll: bool = True


class NoGpuSource(RuntimeError):
    """Neither NVML nor a simulated fleet is available."""


def open_reader(settings: CollectorSettings) -> tuple[GpuReader, str]:
    """The reader for the configured source; ``auto`` prefers NVML, then a configured simulator.

    ``auto`` only falls back to the simulator when a fleet is configured (a spec or the
    openb node list): a GPU node whose driver broke must not quietly start simulating.
    """
    if settings.source in ("auto", "nvml"):
        from fleetpilot.fleet.nvml_reader import NvmlReader, nvml_available

        if nvml_available():
            return NvmlReader(node=settings.node_name or None, site=settings.site, root=settings.host_root,
                              pcie_poll=settings.pcie_poll), "nvml"
        if settings.source == "nvml":
            raise NoGpuSource("NVML is not available on this machine (no NVIDIA driver)")
    if settings.source == "sim" or settings.fleet_spec or settings.openb_nodes:
        from fleetpilot.fleet.inventory import load_fleet_spec, load_openb_fleet

        try:
            if settings.openb_nodes:
                fleet = load_openb_fleet(settings.openb_nodes)
            elif settings.fleet_spec:
                fleet = load_fleet_spec(Path(settings.fleet_spec))
            else:
                fleet = load_fleet_spec()
        except (OSError, ValueError, KeyError, LookupError) as exc:
            raise NoGpuSource(f"cannot load the simulated fleet: {exc}") from None
        return SimulatedFleet(fleet, seed=settings.seed), "sim"
    raise NoGpuSource("no GPU found (NVML unavailable) and no simulated fleet configured "
                      "(set FLEETPILOT_COLLECTOR_SOURCE=sim, FLEETPILOT_COLLECTOR_FLEET_SPEC "
                      "or FLEETPILOT_COLLECTOR_OPENB_NODES)")


# Simulator event kind -> the kind on ``sim.event``; kinds not listed are not forwarded.
_FORWARDED: dict[str, str] = {"oom": "oom_killed", "task_failed": "task_failed", "xid": "xid", "ecc": "ecc",
                              "overheat": "overheat"}


class SimulatedHardware:
    """The simulated fleet as hardware: runs tasks for their duration, reports what happens.

    A task placed through ``command`` is tracked until exactly one ending event has been
    reported for it: ``finished`` at its end time, ``oom_killed`` or ``task_failed`` (a
    fatal XID) when the simulator kills it, or nothing when the executor removed it.

    The executor stops a task with SIGTERM, on which a trainer checkpoints: a task it removed
    and places again later, or moves, goes on from where it was (its end comes after the rest
    of its run, a move keeps its end time) and plays the rest of its memory curve
    (``MemoryGrowth.restored``: a step schedule comes back at the level it had reached and steps
    on at the same points of its progress). A
    task the simulator killed starts from scratch.
    """

    def __init__(self, fleet: SimulatedFleet) -> None:
        self.fleet = fleet
        self.ends_at: dict[str, float] = {}
        self.node_of: dict[str, str] = {}
        # Per running task: the seconds of its run done before this placement, and when this
        # placement started; per task the executor removed, the seconds of its run done.
        self.run_from: dict[str, tuple[float, float]] = {}
        self.done_s: dict[str, float] = {}

    def _forget(self, task_id: str) -> None:
        self.ends_at.pop(task_id, None)
        self.node_of.pop(task_id, None)
        self.run_from.pop(task_id, None)

    def _progress(self, task_id: str) -> float:
        before, since = self.run_from.get(task_id, (0.0, self.fleet.now_s))
        return before + self.fleet.now_s - since

    def _check_target(self, cmd: SimCommand) -> None:
        # Validate before a move removes the task, so a bad target leaves it running.
        topo = self.fleet.topology(cmd.node)  # KeyError for an unknown node
        if not cmd.gpus or any(not 0 <= g < len(topo.gpus) for g in cmd.gpus) or len(set(cmd.gpus)) != len(cmd.gpus):
            raise ValueError(f"bad GPU list {list(cmd.gpus)!r} for node {cmd.node!r} with {len(topo.gpus)} GPUs")

    @staticmethod
    def _check_figures(cmd: SimCommand) -> None:
        # The wire only says "a float": a figure no task can have is refused with its name,
        # not played out (a negative utilisation was read back as such, with less than idle
        # power) nor bent into another (a negative duration ran for a second). A peak of 0 is
        # "not known" (placed as 1 MB); the executor never sends a duration of 0.
        if not 0.0 <= cmd.utilization_pct <= 100.0:
            raise ValueError(f"utilization_pct {cmd.utilization_pct!r} is not within 0..100")
        if not cmd.peak_memory_mb >= 0.0:
            raise ValueError(f"peak_memory_mb {cmd.peak_memory_mb!r} is below 0")
        if not cmd.duration_s > 0.0:
            raise ValueError(f"duration_s {cmd.duration_s!r} is not above 0")

    def command(self, cmd: SimCommand) -> SimAck:
        """Apply one executor command; a refused one (an unknown node, a bad GPU list, a
        figure no task can have) leaves the fleet as it was, its ack saying why."""
        try:
            running = cmd.task_id in self.fleet.running()
            if cmd.verb == "remove":
                if running:
                    self.done_s[cmd.task_id] = self._progress(cmd.task_id)
                    while len(self.done_s) > MAX_STOPPED_TASKS:
                        self.done_s.pop(next(iter(self.done_s)))
                    self.fleet.remove(cmd.task_id)
                self._forget(cmd.task_id)
                return SimAck(ok=True, detail="" if running else "not running")
            if cmd.verb == "place" and running:
                return SimAck(ok=True, detail="already running")
            self._check_figures(cmd)
            self._check_target(cmd)
            moving = cmd.verb == "move" and running
            done = self._progress(cmd.task_id) if moving else self.done_s.pop(cmd.task_id, 0.0)
            if moving:
                self.fleet.remove(cmd.task_id)
            if not cmd.resumable:
                # It cannot go on from a checkpoint: moved or placed again, its run starts over.
                done = 0.0
                self.ends_at.pop(cmd.task_id, None)
            peak = max(cmd.peak_memory_mb, 1.0)
            growth = MemoryGrowth(pattern=cmd.pattern if cmd.pattern != "unknown" else "flat",
                                  base_mb=peak * 0.3, peak_mb=peak, duration_s=cmd.duration_s,
                                  warmup_s=cmd.duration_s * 0.05, period_s=cmd.duration_s / 6,
                                  noise_mb=peak * 0.003)
            # A move keeps its end; a task placed again has the rest of its run before it.
            end = self.ends_at.get(cmd.task_id, self.fleet.now_s + max(cmd.duration_s - done, 1.0))
            if done > 0:
                growth = growth.restored(done, end - self.fleet.now_s)
            self.fleet.place(cmd.task_id, cmd.node, list(cmd.gpus), growth, util=cmd.utilization_pct)
            self.ends_at[cmd.task_id] = end
            self.node_of[cmd.task_id] = cmd.node
            self.run_from[cmd.task_id] = (done, self.fleet.now_s)
        except (KeyError, ValueError) as exc:
            return SimAck(ok=False, detail=str(exc).strip("'\""))
        return SimAck(ok=True)

    def advance(self, dt_s: float) -> list[SimEvent]:
        """Advance virtual time; report tasks that ended and faults, each ending once."""
        self.fleet.advance(dt_s)
        events: list[SimEvent] = []
        for ev in self.fleet.events():
            kind = _FORWARDED.get(ev.kind)
            if kind is None:
                # The simulator's own "finished" fires at the curve's end; ours (ends_at)
                # is authoritative because a move restarts the curve but not the task.
                continue
            if ev.task_id is not None:
                if ev.task_id not in self.node_of:
                    continue  # already reported or removed by the executor
                self._forget(ev.task_id)
            events.append(self._event(ev, kind))
        for task_id, end in list(self.ends_at.items()):
            if self.fleet.now_s >= end:
                node = self.node_of.get(task_id, "")
                if task_id in self.fleet.running():
                    self.fleet.remove(task_id)
                self._forget(task_id)
                events.append(SimEvent(kind="finished", node=node, task_id=task_id, detail="completed", at=now()))
        return events

    @staticmethod
    def _event(ev: FleetEvent, kind: str) -> SimEvent:
        return SimEvent(kind=kind, node=ev.node, gpu=ev.gpu, task_id=ev.task_id,  # type: ignore[arg-type]
                        detail=ev.detail, at=now())


def build(settings: CollectorSettings | None = None, reader: GpuReader | None = None) -> ServiceHost:
    """Wire the collector; fails with ``NoGpuSource`` when there is nothing to read.

    ``reader`` replaces the configured source (tests pass a ``SimulatedFleet`` or an
    ``NvmlReader`` over ``FakeNvml``).
    """
    settings = settings or CollectorSettings.from_environment()
    if reader is None:
        reader, source = open_reader(settings)
    else:
        source = reader.source
    host = ServiceHost("collector", settings)
    hardware = SimulatedHardware(reader) if isinstance(reader, SimulatedFleet) else None
    # NVML reads, one at a time and each bounded: a hung call is told (log, metric, /healthz)
    # and no other is started behind it. The simulator is read on the loop and never hangs.
    nvml = NvmlWatchdog(settings.nvml_timeout_s, host.metrics.registry) if hardware is None else None
    if nvml is not None:
        host.health_check(nvml.health)
    last = {"at": time.monotonic()}
    unsendable: set[str] = set()  # nodes whose last samples held NaN or an infinity (told once)
    # InfiniBand/RoCE counters of this host (real nodes only): rates come from deltas.
    ports = {"before": read_ib_ports(settings.host_root) if hardware is None else [], "at": time.monotonic()}

    def nic_rates() -> list[NicPortRate]:
        after, at = read_ib_ports(settings.host_root), time.monotonic()
        rates = port_rates(ports["before"], after, at - ports["at"])
        ports.update(before=after, at=at)
        return rates

    def gpu_states(node: str, samples: list[GpuSample]) -> list[tuple[str, bytes]] | None:
        """The node's ``gpu_state`` entries; ``None`` while one of its GPUs reads a value
        JSON cannot carry (NaN, an infinity), told once until it reads well again. Its node's
        batch is then left out, not the fleet's: ``encode`` refuses the value, and in this one
        job the simulator reads every node (sent as null before, no consumer decoded it)."""
        entries = []
        for s in samples:
            try:
                entries.append((f"{node_key(node)}.{s.gpu}", encode(s)))
            except NonFiniteFloat as exc:
                if node not in unsendable:
                    unsendable.add(node)
                    log.error("%s GPU %d: the node's samples are not published while it reads: %s",
                              node, s.gpu, exc)
                return None
        if node in unsendable:
            unsendable.discard(node)
            log.info("%s: every GPU reads a sendable value again; its samples are published", node)
        return entries

    async def publish_topology(bus: Bus) -> None:
        for node in reader.node_names():
            # NVML's topology is hundreds of blocking calls (every NVLink of every GPU, every
            # GPU pair's common ancestor), so it is read off the event loop, as samples are;
            # the simulator is driven from the loop and is read on it.
            if nvml is None:
                topo = reader.topology(node)
            else:
                try:
                    topo = await nvml.call("topology", reader.topology, node)
                except NvmlHung:
                    # Told by the watchdog. No report rather than a stale one: a node whose GPUs
                    # cannot be read should go quiet (not_ready) and take no new work, and the
                    # next heartbeat sends the topology once NVML answers again. At start-up
                    # too: the collector serves on, /healthz not ok, instead of failing to start.
                    return
            await bus.publish(TopologyReport(node=topo, source=source, at=now()))

    host.on_startup(publish_topology)

    def log_xids(events: list[FleetEvent]) -> None:
        for ev in events:
            log.warning("%s GPU %d: %s %s", ev.node, ev.gpu, ev.kind, ev.detail)

    @host.every(settings.interval_s)
    async def sample() -> list:
        bus = host.bus
        assert bus is not None
        out: list = []
        if hardware is not None:
            elapsed = time.monotonic() - last["at"]
            last["at"] = time.monotonic()
            out.extend(hardware.advance(elapsed * settings.speed))
        else:
            # Real XIDs also show in each sample's xid_last/xid_count; drained here so the
            # reader's queue stays bounded, and logged for the operator. Draining waits on
            # NVML's event set, so it too runs off the loop; XIDs a hung drain brings back
            # late are logged all the same (an Xid 79 is what a hang is likely about).
            assert nvml is not None
            try:
                log_xids(await nvml.call("events", reader.events, late=log_xids))
            except NvmlHung:
                return out  # told by the watchdog; nothing is read until NVML answers again
        # An NVML reader reads one node, this host, so its ports belong to that node.
        nics = nic_rates() if hardware is None else []

        def read(nodes: list[str]) -> tuple[list, list[tuple[str, bytes]]]:
            events: list = []
            state: list[tuple[str, bytes]] = []
            for node in nodes:
                samples = reader.sample(node)
                node_state = gpu_states(node, samples)
                if node_state is not None:
                    events.append(NodeTelemetry(node=node, at=now(), source=source, gpus=samples, nic_ports=nics))
                    state.extend(node_state)
                events.extend(reader.task_samples(node))
            return events, state

        # NVML calls block (tens of ms per GPU on some drivers), so they run off the event
        # loop, bounded; the simulator is driven from the loop (sim.control) and is read on it.
        if nvml is None:
            # The simulated fleet is read a few nodes at a time, giving the loop back between:
            # read at once, the openb fleet's 1,213 nodes held it for 0.3 s of every second,
            # and the executor's sim.control requests waited behind them (p95 450 ms).
            names = list(reader.node_names())
            events, state = [], []
            for start in range(0, len(names), SIM_NODES_PER_TURN):
                read_events, read_state = read(names[start:start + SIM_NODES_PER_TURN])
                events.extend(read_events)
                state.extend(read_state)
                await asyncio.sleep(0)
        else:
            try:
                events, state = await nvml.call("sample", read, list(reader.node_names()))
            except NvmlHung:
                return out  # told by the watchdog; a late reading is stale and dropped
        out.extend(events)
        try:
            await (await bus.kv("gpu_state")).put_many(state)
        except Exception as exc:  # noqa: BLE001 - the bucket is a cache; the telemetry still goes
            log.error("gpu_state not written (%s); the samples go out on telemetry.gpu all the same", exc)
        return out

    # The node's heartbeat (its topology, re-sent) is a job of its own: tied to the end of a
    # good sample, a sampling error that repeats every tick (an NVML call failing, the
    # gpu_state bucket timing out) made a node whose collector runs look silent, then
    # unreachable, and its tasks were given up. It reads NVML through the watchdog too, so it
    # skips (and does not pile a thread onto) a read that hung.
    @host.every(settings.topology_every_s)
    async def heartbeat() -> None:
        await publish_topology(host.bus)  # type: ignore[arg-type]

    close_reader = getattr(reader, "close", None)  # NvmlReader's; the simulator holds nothing
    if nvml is not None and close_reader is not None:
        @host.on_shutdown
        async def close_nvml() -> None:
            """Stop the PCIe counter thread and shut NVML down, through the watchdog: behind a
            read that hung, closing would hang too (NVML's global lock), so it is skipped."""
            try:
                await nvml.call("close", close_reader)
            except NvmlHung:
                log.warning("NVML not shut down: a read is still hung; the process exits without it")

    if hardware is not None:
        @host.endpoint("control", "sim.control", SimCommand)
        async def control(cmd: SimCommand) -> SimAck:
            return hardware.command(cmd)

    return host


def main() -> None:
    """Entry point: a one-line error and exit code 2 when there is no GPU source."""
    serve("collector", build, NoGpuSource)
