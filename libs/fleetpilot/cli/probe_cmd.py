"""``fleetpilot probe``: what the collector would read on this node, read through NVML now.

Run it on a GPU node before deploying the collector there: it prints the node's topology
as NVML reports it (GPUs, NUMA node, CPU affinity, links, InfiniBand ports), then
``--samples`` readings of every GPU ``--interval`` seconds apart (the same ``GpuSample``
the collector publishes on ``telemetry.gpu.<node>``), the processes on the GPUs grouped
by task (``FLEETPILOT_TASK_ID`` from ``/proc/<pid>/environ``) and any XID seen meanwhile.
Fields that this GPU or driver refuses are listed, not hidden: they are the ones the
collector will publish at their default with ``nvml_unsupported`` set.

Without a driver it prints one line and exits 2.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import msgspec

from fleetpilot.contracts import GpuSample, NodeTopology, TaskTelemetry
from fleetpilot.fleet.nvml_reader import NvmlReader

from .arguments import positive_int, probe_interval

MB_PER_GB = 1024.0


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot probe``."""
    parser.add_argument("--samples", type=positive_int, default=1, help="readings of every GPU (default 1)")
    parser.add_argument("--interval", type=probe_interval, default=1.0,
                        help="seconds between readings, at most 86400 (default 1)")
    parser.add_argument("--node", default=None, help="node name to report under (default: the host name)")
    parser.add_argument("--site", default="default", help="site label (default: default)")
    parser.add_argument("--host-root", default="/",
                        help="where the host's /proc and /sys are mounted (default /; in a container e.g. /host)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")


class TimedNvml:
    """A ``pynvml``-like module that times every ``nvml*`` call it passes on.

    The collector samples on a fixed period, so a slow NVML call (some drivers take tens
    of milliseconds for process accounting) limits how many GPUs one collector can read;
    the probe shows which call it is.
    """

    def __init__(self, nvml: Any) -> None:
        """Wrap ``nvml``; ``calls`` maps a function name to its durations in ms."""
        self._nvml = nvml
        self.calls: dict[str, list[float]] = {}

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nvml, name)
        if not (name.startswith("nvml") and callable(value)):
            return value  # constants, NVMLError and its subclasses pass through

        def timed(*args: Any) -> Any:
            began = time.perf_counter()
            try:
                return value(*args)
            finally:
                self.calls.setdefault(name, []).append((time.perf_counter() - began) * 1000.0)

        return timed

    def slowest(self, n: int = 5) -> dict[str, dict[str, float]]:
        """The ``n`` calls with the most total time: calls, mean and total ms."""
        ranked = sorted(self.calls.items(), key=lambda kv: -sum(kv[1]))[:n]
        return {name: {"calls": len(ms), "mean_ms": round(sum(ms) / len(ms), 3), "total_ms": round(sum(ms), 2)}
                for name, ms in ranked}


class ProbeResult(msgspec.Struct, kw_only=True):
    """Everything one probe read: the topology, the rounds of samples, tasks and XIDs."""

    driver_version: str
    topology: NodeTopology
    rounds: list[list[GpuSample]]
    tasks: list[TaskTelemetry]
    xids: list[dict[str, Any]]
    unsupported: dict[int, list[str]]
    read_ms: list[float]
    slowest_calls: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    # How often a thread reads the PCIe byte counters (they wrap sooner than a reading
    # period: 32-bit on an H200); None where they are not polled.
    pcie_poll_ms: float | None = None


def probe(reader: NvmlReader, *, samples: int, interval_s: float, sleep=time.sleep) -> ProbeResult:
    """Read ``samples`` rounds through ``reader`` (the caller closes it)."""
    node = reader.node
    topology = reader.topology(node)
    rounds: list[list[GpuSample]] = []
    read_ms: list[float] = []
    tasks: list[TaskTelemetry] = []
    for i in range(samples):
        if i:
            sleep(interval_s)
        began = time.perf_counter()
        rounds.append(reader.sample(node))
        read_ms.append(round((time.perf_counter() - began) * 1000.0, 2))
        tasks = reader.task_samples(node)
    unsupported: dict[int, list[str]] = {}
    for s in rounds[-1]:
        if fields := s.labels.get("nvml_unsupported", ""):
            unsupported[s.gpu] = fields.split(",")
    xids = [{"gpu": e.gpu, "xid": e.value, "at": e.at} for e in reader.events() if e.kind == "xid"]
    poll_s = reader.pcie_poll_s
    return ProbeResult(driver_version=topology.labels.get("driver_version", ""), topology=topology, rounds=rounds,
                       tasks=tasks, xids=xids, unsupported=unsupported, read_ms=read_ms,
                       pcie_poll_ms=round(poll_s * 1000.0, 2) if poll_s is not None else None)


def _gb(mb: float) -> str:
    return f"{mb / MB_PER_GB:.1f}"


def render_text(result: ProbeResult) -> str:
    """The human view: one block per GPU, then links, tasks, XIDs and refused fields."""
    topo = result.topology
    lines = [f"node {topo.node} (site {topo.site}): {len(topo.gpus)} GPU(s), driver {result.driver_version or '?'}, "
             f"{topo.numa_nodes} NUMA node(s), {len(result.rounds)} reading(s), "
             f"read time median {sorted(result.read_ms)[len(result.read_ms) // 2]:.1f} ms"]
    last = {s.gpu: s for s in result.rounds[-1]}
    for g in topo.gpus:
        s = last.get(g.index)
        lines.append(f"GPU{g.index} {g.model} {g.uuid} bus {g.pci_bus_id or '?'} "
                     f"NUMA {g.numa_node if g.numa_node is not None else '?'} CPUs {g.cpu_affinity or '?'}")
        if s is None:
            continue
        lines.append(f"  memory {_gb(s.memory_used_mb)}/{_gb(s.memory_total_mb)} GB, util {s.utilization_gpu_pct:.0f}% "
                     f"(memory {s.utilization_memory_pct:.0f}%), {s.temperature_c:.0f} C, "
                     f"{s.power_w:.0f}/{s.power_limit_w:.0f} W, SM {s.sm_clock_mhz:.0f} MHz")
        lines.append(f"  PCIe x{s.pcie_link_width}/x{s.pcie_link_width_max}, tx {s.pcie_tx_kbps:.0f} rx "
                     f"{s.pcie_rx_kbps:.0f} KB/s, replays {s.pcie_replays}; ECC {s.ecc_corrected} corrected "
                     f"{s.ecc_uncorrected} uncorrected, retired pages {s.retired_pages}, "
                     f"remapped rows {s.remapped_rows}; XID last {s.xid_last} count {s.xid_count}")
        nv, cs = s.nvlink_bandwidth_utilization_ratio, s.cuda_context_switches_per_sec
        lines.append(f"  NVLink use {nv.value:.3f} (uncertainty {nv.uncertainty_score:.1f}), "
                     f"context switches {cs.value:.0f}/s (uncertainty {cs.uncertainty_score:.1f}), "
                     f"{len(s.processes)} process(es)")
    for link in topo.links:
        lines.append(f"link {link.a}-{link.b} {link.kind}" + (f" x{link.nvlinks}" if link.nvlinks else ""))
    for nic in topo.nics:
        ports = ", ".join(f"port {p.port} {p.rate_gbps:g} Gb/s {p.link_layer} {p.state}" for p in nic.ports)
        lines.append(f"NIC {nic.name} NUMA {nic.numa_node if nic.numa_node is not None else '?'}: {ports}")
    for t in result.tasks:
        lines.append(f"task {t.task_id}: {_gb(t.memory_used_mb)} GB on GPU {','.join(map(str, t.gpus))}, "
                     f"SM {t.utilization_gpu_pct:.0f}%, pids {','.join(map(str, t.pids))}")
    lines.extend(f"XID {x['xid']} on GPU{x['gpu']}" for x in result.xids)
    if result.slowest_calls:
        lines.append("slowest NVML calls: " + ", ".join(
            f"{name} {c['mean_ms']:.2f} ms x{c['calls']:.0f}" for name, c in result.slowest_calls.items()))
    if result.pcie_poll_ms is not None:
        lines.append(f"PCIe byte counters read every {result.pcie_poll_ms:.1f} ms: they wrap sooner than a reading "
                     "period at the link's top rate")
    for gpu, fields in sorted(result.unsupported.items()):
        lines.append(f"GPU{gpu} refuses: {', '.join(fields)} (published at their default)")
    return "\n".join(lines)


def main(args, out=None, nvml: Any = None) -> int:
    """Open NVML (``nvml`` injects a fake in tests), probe, print; exit 2 without a driver."""
    out = out or sys.stdout
    try:
        if nvml is None:
            import pynvml as nvml  # noqa: PLC0415 - the real module only when none is injected
        timed = TimedNvml(nvml)
        reader = NvmlReader(timed, node=args.node, site=args.site, root=args.host_root)
    except Exception as exc:  # noqa: BLE001 - no library, no driver, no device: one line, exit 2
        print(f"fleetpilot probe: NVML unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    try:
        result = probe(reader, samples=args.samples, interval_s=args.interval)
    finally:
        reader.close()
    result.slowest_calls = timed.slowest()
    if args.json:
        print(json.dumps(msgspec.to_builtins(result), indent=2), file=out)
    else:
        print(render_text(result), file=out)
    return 0
