"""The simulated fleet: every GPU of a ``Fleet`` as numpy arrays, advanced in virtual time.

``SimulatedFleet`` implements ``reader.GpuReader`` (the interface of the NVML backend),
so the collector reads it exactly as it reads real nodes. Tasks are placed on GPUs with a
``MemoryGrowth`` (the ground truth of ``workload.growth``) and a utilisation demand;
``advance(dt_s)`` plays them out for every GPU at once:

- memory: each task holds ``growth.memory_at(age)`` (+ seeded noise, drawn once per tick of
  virtual time: reading the fleet changes nothing) on *each* of its
  GPUs, plus ``CONTEXT_MB`` of CUDA context per process; a task ends at ``duration_s``;
- OOM: when a GPU's used memory exceeds its total, the task that pushed it over (the
  largest growth on that GPU during the tick; the newest task on a tie) is killed on all
  its GPUs and an ``oom`` event is queued; repeated until the GPU fits;
- utilisation: demands add up and saturate at 100 %; memory-bandwidth utilisation is
  the tasks' own share (default half their SM utilisation);
- context switching: with ``n`` processes time-sliced on one busy GPU the rate is
  ``SWITCH_RATE_PER_PEER * (n - 1) * busy`` per second: it grows with co-located processes;
- NVLink / PCIe: multi-GPU tasks exchange ``comm_gbps`` per GPU over NVLink when the node
  has it, over PCIe otherwise; every task also moves ``pcie_gbps`` of host traffic;
- power ``idle + (tdp - idle) * util`` and temperature with a first-order lag
  (``THERMAL_TAU_S``) towards ``ambient + THERMAL_RISE_C * power / tdp``; SM clocks drop
  by ``THROTTLE_FACTOR`` above the model's slowdown temperature;
- faults: ``inject_xid``, ``inject_ecc``, ``inject_overheat`` and slow degradations
  (``degrade``: rising corrected ECC, retired pages, remapped rows, PCIe replays,
  link-width down-training) that predictive maintenance can learn from.

Everything per GPU is a vector operation; only rare events (OOM, task end) loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from fleetpilot.contracts.telemetry import GpuSample, ProcessMemory, Reading, TaskTelemetry
from fleetpilot.contracts.topology import NodeTopology
from fleetpilot.workload.growth import GROWTH_PATTERNS, MemoryGrowth

from .catalogue import gpu_model
from .inventory import Fleet
from .reader import FATAL_XIDS, FleetEvent

CONTEXT_MB = 300.0
SWITCH_RATE_PER_PEER = 400.0
THERMAL_TAU_S = 30.0
THERMAL_RISE_C = 45.0
THROTTLE_FACTOR = 0.7
IDLE_SM_CLOCK_MHZ = 210.0
PID_BASE = 10_000

# Uncertainties reported with the derived readings. The simulator knows the truth, but it
# reports what the NVML path can know, so nothing downstream learns to trust the sim more.
CTX_SWITCH_UNCERTAINTY = 0.6
NVLINK_UNCERTAINTY = 0.1

DegradationKind = Literal["ecc_corrected", "retired_pages", "remapped_rows", "pcie_replays", "link_width"]
_PATTERN_CODE = {name: i for i, name in enumerate(GROWTH_PATTERNS)}


def memory_at_vectorised(code: np.ndarray, base: np.ndarray, peak: np.ndarray, duration: np.ndarray,
                         warmup: np.ndarray, n_steps: np.ndarray, period: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``MemoryGrowth.memory_at`` for many curves at once (one age per curve), noiseless.

    ``code`` indexes ``GROWTH_PATTERNS``. Mirrors ``workload.growth`` formula by formula;
    the tests hold the two equal for every pattern.
    """
    t = np.clip(t, 0.0, duration)
    span = peak - base
    life = np.maximum(duration, 1e-9)
    frac = np.zeros_like(t)
    flat = code == _PATTERN_CODE["flat"]
    frac[flat] = np.minimum(t[flat] / np.maximum(warmup[flat], 1e-9), 1.0)
    linear = code == _PATTERN_CODE["linear"]
    frac[linear] = t[linear] / life[linear]
    steps = code == _PATTERN_CODE["steps"]
    k = np.maximum(n_steps[steps], 1)
    frac[steps] = np.minimum(np.floor(t[steps] / life[steps] * k) + 1, k) / k
    saw = code == _PATTERN_CODE["sawtooth"]
    p = np.maximum(period[saw], 1e-9)
    frac[saw] = np.mod(t[saw], p) / p
    leak = code == _PATTERN_CODE["leak"]
    frac[leak] = (t[leak] / life[leak]) ** 2
    return np.maximum(base + span * frac, 0.0)


@dataclass
class _Task:
    task_id: str
    node: str
    gpus: list[int]
    global_gpus: list[int]
    growth: MemoryGrowth
    util: float
    mem_util: float
    comm_gbps: float
    pcie_gbps: float
    start_s: float
    seq: int
    pids: list[int] = field(default_factory=list)


@dataclass
class _Degradation:
    gpu: int
    kind: DegradationKind
    rate_per_h: float
    accel_per_h2: float
    since_s: float


class GpuArrays:
    """Per-GPU state vectors (length = GPUs in the fleet); read-only for callers."""

    def __init__(self, fleet: Fleet, ambient_c: float) -> None:
        gpus = [(n, g) for n in fleet.nodes for g in n.gpus]
        models = [gpu_model(g.model) for _, g in gpus]
        nodes_with_nvlink = {n.node for n in fleet.nodes if any(link.kind == "NV" for link in n.links)}
        self.count = len(gpus)
        self.memory_total_mb = np.array([g.memory_mb or m.memory_mb for (_, g), m in zip(gpus, models, strict=True)], float)
        self.tdp_w = np.array([m.tdp_w for m in models], float)
        self.idle_w = np.array([m.idle_w for m in models], float)
        self.max_clock_mhz = np.array([m.max_sm_clock_mhz for m in models], float)
        self.slowdown_c = np.array([m.slowdown_temp_c for m in models], float)
        self.has_nvlink = np.array([n.node in nodes_with_nvlink and m.nvlink_links > 0 for (n, _), m in zip(gpus, models, strict=True)])
        self.nvlink_peak_gbps = np.array([m.nvlink_peak_gbps for m in models], float)
        self.pcie_peak_gbps = np.array([m.pcie_peak_gbps for m in models], float)
        self.ambient_c = ambient_c
        zeros = np.zeros(self.count)
        self.memory_used_mb = zeros.copy()
        self.utilization_gpu = zeros.copy()
        self.utilization_memory = zeros.copy()
        self.processes = np.zeros(self.count, dtype=np.int64)
        self.ctx_switches_per_s = zeros.copy()
        self.nvlink_gbps = zeros.copy()
        self.pcie_tx_gbps = zeros.copy()
        self.pcie_rx_gbps = zeros.copy()
        self.power_w = self.idle_w.copy()
        self.temperature_c = np.full(self.count, ambient_c + THERMAL_RISE_C * 0.1)
        self.sm_clock_mhz = np.full(self.count, IDLE_SM_CLOCK_MHZ)
        self.heat_offset_c = zeros.copy()
        self.heat_until_s = zeros.copy()
        self.ecc_corrected = zeros.copy()
        self.ecc_uncorrected = zeros.copy()
        self.retired_pages = zeros.copy()
        self.remapped_rows = zeros.copy()
        self.pcie_replays = zeros.copy()
        self.pcie_link_width_max = np.full(self.count, 16, dtype=np.int64)
        self.pcie_link_width = self.pcie_link_width_max.copy()
        self.xid_last = np.zeros(self.count, dtype=np.int64)
        self.xid_count = np.zeros(self.count, dtype=np.int64)
        self.throttled = np.zeros(self.count, dtype=bool)


class SimulatedFleet:
    """A fleet of simulated GPUs in virtual time; a ``GpuReader`` like the NVML backend.

    ``start_at`` is the wall-clock time (epoch seconds) of virtual time 0, stamped on
    samples and events; ``seed`` fixes memory noise.
    """

    source: Literal["sim"] = "sim"

    def __init__(self, fleet: Fleet, *, seed: int = 0, start_at: float | None = None, ambient_c: float = 28.0) -> None:
        self.fleet = fleet
        self.now_s = 0.0
        self.start_at = time.time() if start_at is None else start_at
        self.gpu = GpuArrays(fleet, ambient_c)
        self._rng = np.random.default_rng(seed)
        self._topology = {n.node: n for n in fleet.nodes}
        self._offset: dict[str, int] = {}
        offset = 0
        for n in fleet.nodes:
            self._offset[n.node] = offset
            offset += len(n.gpus)
        self._tasks: dict[str, _Task] = {}
        # Per-node view of the same tasks, so sampling one node does not scan the fleet.
        self._on_node: dict[str, dict[str, _Task]] = {n.node: {} for n in fleet.nodes}
        self._seq = 0
        self._events: list[FleetEvent] = []
        self._degradations: list[_Degradation] = []
        self._gpu_node_names = [n.node for n in fleet.nodes for _ in n.gpus]
        self._task_list: list[_Task] = []
        self._s_task = np.zeros(0, dtype=np.int64)
        self._s_gpu = np.zeros(0, dtype=np.int64)
        self._prev_share_mem = np.zeros(0)
        self._t_z = np.zeros(0)  # each task's memory-noise draw of this tick (standard normal)
        self._rebuild()
        self._task_mem = np.zeros(0)
        self._demand = np.zeros(self.gpu.count)
        self._dirty = True

    # -- GpuReader -------------------------------------------------------------------

    def node_names(self) -> list[str]:
        """Every node of the fleet."""
        return list(self._topology)

    def topology(self, node: str) -> NodeTopology:
        """The node's topology as the fleet model built it."""
        return self._topology[node]

    def events(self) -> list[FleetEvent]:
        """Drain queued OOM / fault / task-end events."""
        self._refresh_if_dirty()
        out, self._events = self._events, []
        return out

    def sample(self, node: str) -> list[GpuSample]:
        """One reading of every GPU of ``node`` at the current virtual time."""
        self._refresh_if_dirty()
        topo = self._topology[node]
        base = self._offset[node]
        g = self.gpu
        at = self.start_at + self.now_s
        procs: dict[int, list[ProcessMemory]] = {}
        for task in self._on_node[node].values():
            if task.start_s > self.now_s:
                continue  # placed to start later: no process yet
            per_gpu = float(self._task_mem[self._task_index[task.task_id]]) + CONTEXT_MB
            for local, pid in zip(task.gpus, task.pids, strict=True):
                procs.setdefault(local, []).append(ProcessMemory(pid=pid, used_mb=round(per_gpu, 1), task_id=task.task_id))
        out = []
        for info in topo.gpus:
            i = base + info.index
            used = float(g.memory_used_mb[i])
            has_nvlink = bool(g.has_nvlink[i])
            nvlink_ratio = float(g.nvlink_gbps[i] / g.nvlink_peak_gbps[i]) if has_nvlink else 0.0
            out.append(GpuSample(
                node=node, gpu=info.index, uuid=info.uuid, model=info.model, at=at,
                utilization_gpu_pct=round(float(g.utilization_gpu[i]), 2),
                utilization_memory_pct=round(float(g.utilization_memory[i]), 2),
                memory_total_mb=float(g.memory_total_mb[i]), memory_used_mb=round(used, 1),
                memory_free_mb=round(float(g.memory_total_mb[i]) - used, 1),
                temperature_c=round(float(g.temperature_c[i]), 2), power_w=round(float(g.power_w[i]), 2),
                power_limit_w=float(g.tdp_w[i]), sm_clock_mhz=float(g.sm_clock_mhz[i]),
                pcie_tx_kbps=round(float(g.pcie_tx_gbps[i]) * 1e6, 1), pcie_rx_kbps=round(float(g.pcie_rx_gbps[i]) * 1e6, 1),
                ecc_corrected=int(g.ecc_corrected[i]), ecc_uncorrected=int(g.ecc_uncorrected[i]),
                retired_pages=int(g.retired_pages[i]), remapped_rows=int(g.remapped_rows[i]),
                pcie_replays=int(g.pcie_replays[i]), pcie_link_width=int(g.pcie_link_width[i]),
                pcie_link_width_max=int(g.pcie_link_width_max[i]), xid_last=int(g.xid_last[i]),
                xid_count=int(g.xid_count[i]),
                cuda_context_switches_per_sec=Reading(value=round(float(g.ctx_switches_per_s[i]), 2),
                                                      uncertainty_score=CTX_SWITCH_UNCERTAINTY),
                nvlink_bandwidth_utilization_ratio=Reading(
                    value=round(min(nvlink_ratio, 1.0), 4),
                    # Without NVLink the ratio is exactly 0, as NVML's link count of 0 says.
                    uncertainty_score=NVLINK_UNCERTAINTY if has_nvlink else 0.0),
                processes=sorted(procs.get(info.index, []), key=lambda p: p.pid),
                labels={**info.labels, "site": topo.site},
            ))
        return out

    def task_samples(self, node: str) -> list[TaskTelemetry]:
        """Each task on ``node``: memory summed over its GPUs, mean utilisation it receives."""
        self._refresh_if_dirty()
        base = self._offset[node]
        at = self.start_at + self.now_s
        out = []
        for task in self._on_node[node].values():
            if task.start_s > self.now_s:
                continue  # placed to start later: no process yet
            per_gpu = float(self._task_mem[self._task_index[task.task_id]]) + CONTEXT_MB
            demand = self._demand[[base + k for k in task.gpus]]
            got = task.util * np.minimum(1.0, 100.0 / np.maximum(demand, 1e-9))
            out.append(TaskTelemetry(task_id=task.task_id, node=node, gpus=list(task.gpus), at=at,
                                     memory_used_mb=round(per_gpu * len(task.gpus), 1),
                                     utilization_gpu_pct=round(float(got.mean()), 2), pids=list(task.pids)))
        return out

    # -- tasks -----------------------------------------------------------------------

    def place(self, task_id: str, node: str, gpus: list[int], growth: MemoryGrowth, util: float = 80.0, *,
              mem_util: float | None = None, comm_gbps: float | None = None, pcie_gbps: float = 0.5,
              start_s: float | None = None) -> None:
        """Start ``task_id`` on ``gpus`` of ``node`` now (or at ``start_s``, not before now:
        until then it holds and uses nothing); its memory follows ``growth`` on each GPU.
        A later start lets a caller that steps the fleet a minute at a time start a task at
        the instant it was decided within the coming step.

        ``util`` is the SM utilisation (%) it demands per GPU; ``comm_gbps`` the GPU-to-GPU
        traffic per GPU (default: a quarter of the NVLink peak scaled by ``util`` for
        multi-GPU tasks, zero otherwise). Placement is not admission: a task that does not
        fit is OOM-killed at the next refresh. Raises ``KeyError`` for an unknown node,
        ``ValueError`` for a duplicate task or a bad GPU index.
        """
        if task_id in self._tasks:
            raise ValueError(f"task {task_id!r} is already placed")
        if start_s is not None and start_s < self.now_s:
            raise ValueError(f"task {task_id!r} cannot start at {start_s}, before now ({self.now_s})")
        topo = self._topology[node]
        if not gpus or len(set(gpus)) != len(gpus) or any(not 0 <= k < len(topo.gpus) for k in gpus):
            raise ValueError(f"bad GPU list {gpus!r} for node {node!r} with {len(topo.gpus)} GPUs")
        base = self._offset[node]
        glob = [base + k for k in gpus]
        if comm_gbps is None:
            peak = float(self.gpu.nvlink_peak_gbps[glob[0]]) if self.gpu.has_nvlink[glob[0]] else 4.0
            comm_gbps = 0.25 * peak * util / 100.0 if len(gpus) > 1 else 0.0
        self._seq += 1
        task = self._tasks[task_id] = _Task(
            task_id=task_id, node=node, gpus=list(gpus), global_gpus=glob, growth=growth, util=float(util),
            mem_util=float(mem_util if mem_util is not None else util * 0.5), comm_gbps=float(comm_gbps),
            pcie_gbps=float(pcie_gbps), start_s=self.now_s if start_s is None else float(start_s), seq=self._seq,
            pids=[PID_BASE + self._seq * 8 + j for j in range(len(gpus))],
        )
        self._on_node[node][task_id] = task
        self._dirty = True

    def remove(self, task_id: str) -> None:
        """Stop a task and free its GPUs; ``KeyError`` when it is not running."""
        task = self._tasks.pop(task_id)
        del self._on_node[task.node][task_id]
        self._dirty = True

    def running(self) -> list[str]:
        """Ids of the tasks running now."""
        return list(self._tasks)

    def peak_held_mb(self, task_id: str) -> float:
        """The most a running task has held per GPU since it was placed, its CUDA context
        included, as NVML's per-process accounting keeps it (``maxMemoryUsage``): at any
        instant, not only at this simulator's steps (``MemoryGrowth.highest_until``); 0 before
        it started. ``KeyError`` when it is not running."""
        task = self._tasks[task_id]
        age = self.now_s - task.start_s
        return task.growth.highest_until(age) + CONTEXT_MB if age >= 0 else 0.0

    # -- faults ----------------------------------------------------------------------

    def _global(self, node: str, gpu: int) -> int:
        if not 0 <= gpu < len(self._topology[node].gpus):
            raise ValueError(f"node {node!r} has no GPU {gpu}")
        return self._offset[node] + gpu

    def _emit(self, kind: str, gi: int, *, task_id: str | None = None, value: float = 0.0, detail: str = "") -> None:
        node, local = self._locate(gi)
        self._events.append(FleetEvent(kind=kind, node=node, gpu=local, at=self.start_at + self.now_s,  # type: ignore[arg-type]
                                       task_id=task_id, value=value, detail=detail))

    def _locate(self, gi: int) -> tuple[str, int]:
        node = self._gpu_node_names[gi]
        return node, gi - self._offset[node]

    def inject_xid(self, node: str, gpu: int, xid: int = 79) -> None:
        """Raise XID ``xid`` on a GPU; a fatal XID (``FATAL_XIDS``) kills the GPU's tasks."""
        gi = self._global(node, gpu)
        self._refresh_if_dirty()  # so tasks placed just now are known, with their memory
        self.gpu.xid_last[gi] = xid
        self.gpu.xid_count[gi] += 1
        self._emit("xid", gi, value=xid, detail=f"Xid {xid}")
        if xid in FATAL_XIDS:
            for task in [t for t in self._on_node[node].values() if gi in t.global_gpus]:
                self._kill(task, "task_failed", gi, f"Xid {xid} on GPU {gpu}")

    def inject_ecc(self, node: str, gpu: int, corrected: int = 0, uncorrected: int = 0) -> None:
        """Add ECC errors; an uncorrected one retires a page / remaps a row and raises Xid 48."""
        gi = self._global(node, gpu)
        self.gpu.ecc_corrected[gi] += corrected
        self.gpu.ecc_uncorrected[gi] += uncorrected
        self._emit("ecc", gi, value=corrected + uncorrected, detail=f"corrected={corrected} uncorrected={uncorrected}")
        if uncorrected:
            self.gpu.retired_pages[gi] += uncorrected
            self.gpu.remapped_rows[gi] += uncorrected
            self.inject_xid(node, gpu, 48)

    def inject_overheat(self, node: str, gpu: int, extra_c: float = 30.0, duration_s: float = 600.0) -> None:
        """Raise a GPU's thermal target by ``extra_c`` for ``duration_s`` (a failed fan, a blocked inlet)."""
        gi = self._global(node, gpu)
        self.gpu.heat_offset_c[gi] = extra_c
        self.gpu.heat_until_s[gi] = self.now_s + duration_s
        self._dirty = True

    def degrade(self, node: str, gpu: int, kind: DegradationKind, rate_per_h: float, accel_per_h2: float = 0.0) -> None:
        """Start a slow degradation: the counter grows at ``rate_per_h + accel_per_h2 * hours``.

        For ``link_width`` the "counter" is the hazard of a down-training step (halving the
        PCIe width, 16 -> 8 -> 4 ...) per hour.
        """
        gi = self._global(node, gpu)
        self._degradations.append(_Degradation(gpu=gi, kind=kind, rate_per_h=rate_per_h,
                                               accel_per_h2=accel_per_h2, since_s=self.now_s))

    # -- time ------------------------------------------------------------------------

    def advance(self, dt_s: float) -> None:
        """Move virtual time forward by ``dt_s`` seconds and update every GPU."""
        if dt_s < 0:
            raise ValueError("time only moves forward")
        self.now_s += dt_s
        self._step(dt_s)

    def _refresh_if_dirty(self) -> None:
        if self._dirty:
            self._step(0.0)

    def _rebuild(self) -> None:
        # Memory of surviving shares at the previous tick, so "who grew most" (the OOM
        # victim rule) stays meaningful across a rebuild; new shares start from zero.
        previous: dict[tuple[str, int], float] = {}
        if len(self._prev_share_mem) == len(self._s_task):
            previous = {(self._task_list[int(ti)].task_id, int(gi)): float(m)
                        for ti, gi, m in zip(self._s_task, self._s_gpu, self._prev_share_mem, strict=True)}
        # A task keeps its noise draw until the next tick: a rebuild (a placement, a kill)
        # moves no time, and a new task holds its noiseless curve until time moves.
        drawn = ({t.task_id: float(z) for t, z in zip(self._task_list, self._t_z, strict=True)}
                 if len(self._t_z) == len(self._task_list) else {})
        tasks = list(self._tasks.values())
        self._task_list = tasks
        self._task_index = {t.task_id: i for i, t in enumerate(tasks)}
        gr = [t.growth for t in tasks]
        self._t_code = np.array([_PATTERN_CODE[x.pattern] for x in gr], dtype=np.int64)
        self._t_base = np.array([x.base_mb for x in gr], float)
        self._t_peak = np.array([x.peak_mb for x in gr], float)
        self._t_duration = np.array([x.duration_s for x in gr], float)
        self._t_warmup = np.array([x.warmup_s for x in gr], float)
        self._t_steps = np.array([x.n_steps for x in gr], float)
        self._t_period = np.array([x.period_s for x in gr], float)
        self._t_noise = np.array([x.noise_mb for x in gr], float)
        self._t_z = np.array([drawn.get(t.task_id, 0.0) for t in tasks], float)
        self._t_start = np.array([t.start_s for t in tasks], float)
        self._t_seq = np.array([t.seq for t in tasks], dtype=np.int64)
        self._t_util = np.array([t.util for t in tasks], float)
        self._t_mem_util = np.array([t.mem_util for t in tasks], float)
        self._t_comm = np.array([t.comm_gbps for t in tasks], float)
        self._t_pcie = np.array([t.pcie_gbps for t in tasks], float)
        self._s_task = np.array([i for i, t in enumerate(tasks) for _ in t.global_gpus], dtype=np.int64)
        self._s_gpu = np.array([g for t in tasks for g in t.global_gpus], dtype=np.int64)
        self._s_multi = np.array([len(t.global_gpus) > 1 for t in tasks for _ in t.global_gpus], dtype=bool)
        self._prev_share_mem = np.array([previous.get((tasks[int(ti)].task_id, int(gi)), 0.0)
                                         for ti, gi in zip(self._s_task, self._s_gpu, strict=True)], float)
        self._dirty = False

    def _kill(self, task: _Task, kind: str, gi: int, detail: str) -> None:
        k = self._task_index.get(task.task_id)
        held = float(self._task_mem[k]) if k is not None and k < len(self._task_mem) else 0.0
        self._emit(kind, gi, task_id=task.task_id, value=held, detail=detail)
        if self._tasks.pop(task.task_id, None) is not None:
            del self._on_node[task.node][task.task_id]
        self._dirty = True

    def _step(self, dt: float) -> None:
        g = self.gpu
        n = g.count
        # Tasks that reached their duration end before this tick is accounted.
        if self._dirty:
            self._rebuild()
        for k in np.flatnonzero(self._t_start + self._t_duration <= self.now_s):
            task = self._task_list[int(k)]
            # Its value: the most it held per GPU (``peak_held_mb``), as accounting reports it
            # once the process has exited.
            self._emit("finished", task.global_gpus[0], task_id=task.task_id, detail="completed",
                       value=self.peak_held_mb(task.task_id))
            self.remove(task.task_id)
        draw = dt > 0
        while True:
            if self._dirty:
                self._rebuild()
            noisy = self._t_noise > 0
            if draw:
                # Noise is drawn once per tick of virtual time, never by a refresh (a read
                # after a placement) nor again after an OOM kill: reading the fleet must not
                # change what it does next (the seed's run), nor OOM-kill a task by itself.
                draw = False
                self._t_z = np.zeros(len(self._task_list))
                self._t_z[noisy] = self._rng.normal(0.0, 1.0, int(noisy.sum()))
            age = self.now_s - self._t_start
            mem = memory_at_vectorised(self._t_code, self._t_base, self._t_peak, self._t_duration,
                                       self._t_warmup, self._t_steps, self._t_period, age)
            if noisy.any():
                mem[noisy] = np.maximum(mem[noisy] + self._t_z[noisy] * self._t_noise[noisy], 0.0)
            started = age >= 0.0  # a task placed to start later holds nothing yet
            mem[~started] = 0.0
            self._task_mem = mem
            live = started[self._s_task]
            share_mem = (mem[self._s_task] + CONTEXT_MB) * live
            used = np.bincount(self._s_gpu, share_mem, minlength=n)
            over = np.flatnonzero(used > g.memory_total_mb)
            if over.size == 0:
                break
            # OOM: on each over-committed GPU kill the task that grew most this tick
            # (the allocation that failed); the newest task breaks ties.
            growth = share_mem - self._prev_share_mem
            for gi in over:
                on_gpu = np.flatnonzero(self._s_gpu == gi)
                order = np.lexsort((-self._t_seq[self._s_task[on_gpu]], -growth[on_gpu]))
                victim = self._task_list[int(self._s_task[on_gpu[order[0]]])]
                if victim.task_id in self._tasks:
                    self._kill(victim, "oom", int(gi),
                               f"needed {used[gi]:.0f} MB of {g.memory_total_mb[gi]:.0f} MB on GPU {gi - self._offset[victim.node]}")
            self._dirty = True
        self._prev_share_mem = share_mem

        g.memory_used_mb = used
        demand = np.bincount(self._s_gpu, self._t_util[self._s_task] * live, minlength=n)
        self._demand = demand
        g.utilization_gpu = np.minimum(demand, 100.0)
        g.utilization_memory = np.minimum(np.bincount(self._s_gpu, self._t_mem_util[self._s_task] * live, minlength=n), 100.0)
        g.processes = np.bincount(self._s_gpu[live], minlength=n)
        busy = g.utilization_gpu / 100.0
        g.ctx_switches_per_s = SWITCH_RATE_PER_PEER * np.maximum(g.processes - 1, 0) * busy

        comm = np.bincount(self._s_gpu, (self._t_comm[self._s_task] * (self._s_multi & live)), minlength=n)
        host = np.bincount(self._s_gpu, self._t_pcie[self._s_task] * live, minlength=n)
        g.nvlink_gbps = np.where(g.has_nvlink, np.minimum(comm, g.nvlink_peak_gbps), 0.0)
        pcie_peak = g.pcie_peak_gbps * g.pcie_link_width / np.maximum(g.pcie_link_width_max, 1)
        pcie = host + np.where(g.has_nvlink, 0.0, comm)
        g.pcie_tx_gbps = np.minimum(pcie * 0.5, pcie_peak)
        g.pcie_rx_gbps = np.minimum(pcie, pcie_peak)

        g.power_w = g.idle_w + (g.tdp_w - g.idle_w) * busy
        hot = g.heat_until_s > self.now_s
        target = g.ambient_c + THERMAL_RISE_C * g.power_w / g.tdp_w + np.where(hot, g.heat_offset_c, 0.0)
        if dt > 0:
            g.temperature_c = target + (g.temperature_c - target) * np.exp(-dt / THERMAL_TAU_S)
        throttled = g.temperature_c > g.slowdown_c
        for gi in np.flatnonzero(throttled & ~g.throttled):
            self._emit("overheat", int(gi), value=float(g.temperature_c[gi]),
                       detail=f"{g.temperature_c[gi]:.1f} C above slowdown {g.slowdown_c[gi]:.0f} C")
        g.throttled = throttled
        g.sm_clock_mhz = np.where(busy > 0, g.max_clock_mhz * np.where(throttled, THROTTLE_FACTOR, 1.0), IDLE_SM_CLOCK_MHZ)

        if dt > 0 and self._degradations:
            self._degrade(dt)

    def _degrade(self, dt: float) -> None:
        g = self.gpu
        for d in self._degradations:
            hours = (self.now_s - d.since_s) / 3600.0
            rate = max(d.rate_per_h + d.accel_per_h2 * hours, 0.0)
            amount = rate * dt / 3600.0
            if d.kind == "link_width":
                # A down-training step is a rare event: draw it with the accumulated hazard.
                if g.pcie_link_width[d.gpu] > 1 and self._rng.random() < 1.0 - np.exp(-amount):
                    g.pcie_link_width[d.gpu] //= 2
            else:
                counter = getattr(g, d.kind)
                counter[d.gpu] += amount
