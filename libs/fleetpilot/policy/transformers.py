"""StateTransformers: smooth features derived from a raw ``ClusterState``.

Each transformer is a pure function of the state (and the task) returning a numpy array in a
documented range, so that policies weigh it continuously (clipped, weighted) instead of
cutting on one hard threshold. None of them mutates the state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .fragmentation import TaskShape, fragmentation_index
from .state import MILLI, ClusterState, TaskRequest


def memory_fragmentation(state: ClusterState) -> tuple[np.ndarray, np.ndarray]:
    """``(total_free - largest_placeable_block) / total_free`` per GPU and per node.

    Per GPU the "blocks" are the free memory of that GPU alone, so its index is 0 by
    construction and is returned for symmetry; per node the blocks are the GPUs' free memory,
    so a node whose free memory is spread over many GPUs scores close to 1. Range 0..1.
    """
    free = np.where(state.gpu_exists, state.gpu_mem_free, 0).astype(np.float64)
    per_gpu = np.zeros_like(free)
    return per_gpu, fragmentation_index(free)


def compute_fragmentation(state: ClusterState) -> np.ndarray:
    """The same index over free milli-GPU per node (0 = all free compute in one GPU)."""
    return fragmentation_index(state.usable_free().astype(np.float64))


def nvlink_congestion(state: ClusterState) -> np.ndarray:
    """Mean NVLink utilisation of each node's GPUs, 0..1 (0 = idle links)."""
    util = np.where(state.gpu_exists, state.gpu_nvlink_util, 0.0)
    count = np.maximum(state.gpu_exists.sum(axis=1), 1)
    return np.clip(util.sum(axis=1) / count, 0.0, 1.0)


def numa_distance(state: ClusterState, node: int, gpus: Sequence[int]) -> float:
    """Mean pairwise link cost of a multi-GPU placement, scaled to 0..1 (0 = one GPU/NVLink).

    Costs come from ``gpu_link`` (``LINK_COST``); a cross-socket (``SYS``) pair scores 1.
    """
    idx = list(gpus)
    if len(idx) < 2:
        return 0.0
    sub = state.gpu_link[node][np.ix_(idx, idx)].astype(np.float64)
    pairs = len(idx) * (len(idx) - 1)
    return float(np.clip((sub.sum() / pairs - 1.0) / 5.0, 0.0, 1.0))


def normal_cdf(x: np.ndarray) -> np.ndarray:
    """Standard normal CDF, vectorised (via ``erf``)."""
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return 0.5 * (1.0 + erf(np.asarray(x, dtype=np.float64) / math.sqrt(2.0)))


def oom_risk(state: ClusterState, task: TaskRequest) -> np.ndarray:
    """Probability per GPU slot that the task's peak exceeds the GPU's free memory.

    The peak is modelled as normal(``predicted_peak_mb``, ``peak_sigma_mb``); without a
    fingerprint (peak 0) the asked ``gpu_memory_mb`` is used with a 10% spread, and without
    either the risk is 0 (nothing known, nothing claimed). Range 0..1, shape ``(N, G)``.
    """
    peak = task.predicted_peak_mb or float(task.gpu_memory_mb)
    if peak <= 0:
        return np.zeros(state.gpu_free.shape)
    sigma = task.peak_sigma_mb if task.predicted_peak_mb > 0 else 0.1 * peak
    sigma = max(sigma, 1.0)
    free = state.gpu_mem_free.astype(np.float64)
    # A sharing task gets its share of the GPU's memory only if the GPU has no memory size.
    z = (peak - free) / sigma
    risk = normal_cdf(z)
    return np.where(state.gpu_exists & (state.gpu_mem_total > 0), risk, 0.0)


def thermal_headroom(state: ClusterState, limit_c: float = 85.0, idle_c: float = 35.0) -> np.ndarray:
    """Per GPU, ``(limit - temperature) / (limit - idle)`` clipped to 0..1 (1 = cool)."""
    return np.clip((limit_c - state.gpu_temp_c.astype(np.float64)) / (limit_c - idle_c), 0.0, 1.0)


def role_affinity(state: ClusterState, task: TaskRequest) -> np.ndarray:
    """Per GPU: 1 where the GPU's business role matches the task's, 0.5 where the GPU has no
    role, 0 where it is reserved for another role. A task without a role sees 1 on unroled
    GPUs and 0.5 on roled ones (it should leave them to their owners when it can)."""
    role = state.roles.index(task.role) if task.role in state.roles and task.role else -1
    unroled = state.gpu_role == 0
    if role <= 0:
        return np.where(unroled, 1.0, 0.5)
    return np.where(state.gpu_role == role, 1.0, np.where(unroled, 0.5, 0.0))


def model_pressure(state: ClusterState, shapes: Sequence[TaskShape], free: np.ndarray | None = None) -> np.ndarray:
    """Demand pressure per GPU model, 1.0 = average; ``(len(state.models),)``.

    Each typical task class ``t`` (frequency ``f``, milli ``r``, acceptable models ``A``)
    spreads its demand ``f * r`` over the free capacity of ``A`` in proportion to it; a model's
    load is the demand per free milli it attracts: ``sum_{t: g in A_t} f_t r_t / free(A_t)``.
    Dividing by the fleet-wide ``sum f r / free(all)`` gives 1 everywhere when no task is
    constrained and more than 1 on models that constrained classes need. Models with no free
    capacity get the maximum pressure seen (they cannot be consumed anyway).
    """
    return ModelPressure(shapes, state.models)(state, free)


def cpu_per_gpu_milli(shapes: Sequence[TaskShape]) -> float:
    """Typical CPU milli asked per GPU milli: ``sum f*cpu / sum f*gpus*milli`` over GPU shapes."""
    gpu = [s for s in shapes if s.gpus > 0 and s.gpu_milli > 0]
    milli = sum(s.weight * s.gpus * s.gpu_milli for s in gpu)
    return sum(s.weight * s.cpu_milli for s in gpu) / milli if milli > 0 else 0.0


def cpu_stranding(free_milli: np.ndarray, cpu_free: np.ndarray, cpu_per_milli: float) -> np.ndarray:
    """GPU milli a node cannot use for lack of CPU, in a fluid approximation.

    Its free GPU milli ``L`` will need about ``L * c`` CPU (``c`` = ``cpu_per_gpu_milli`` of the
    typical tasks); the part its free CPU cannot cover, ``max(0, L*c - cpu) / c``, is stranded.
    Smooth in both resources (no per-task cliff); 0 when ``c`` is 0.
    """
    if cpu_per_milli <= 0:
        return np.zeros(np.shape(free_milli))
    need = np.asarray(free_milli, dtype=np.float64) * cpu_per_milli
    return np.maximum(0.0, need - np.asarray(cpu_free, dtype=np.float64)) / cpu_per_milli


def gpus_for_whole(free_row: np.ndarray, n: int) -> list[int]:
    """The first ``n`` fully free GPU indices of a node (the device plugin's order)."""
    return [int(j) for j in np.flatnonzero(free_row >= MILLI)[:n]]


class ModelPressure:
    """``model_pressure`` compiled for one model list (acceptance matrix built once).

    Call it with a state (and optionally its usable free milli) to get ``rho`` per model.
    """

    def __init__(self, shapes: Sequence[TaskShape], models: Sequence[str]) -> None:
        gpu_shapes = [s for s in shapes if s.gpus > 0 and s.gpu_milli > 0]
        self.demand = np.asarray([s.weight * s.gpus * s.gpu_milli for s in gpu_shapes], dtype=np.float64)
        self.accept = np.asarray(
            [[(not s.models) or (m in s.models) for m in models] for s in gpu_shapes], dtype=np.float64
        ).reshape(len(gpu_shapes), len(models))
        self.n_models = len(models)

    def __call__(self, state: ClusterState, free: np.ndarray | None = None) -> np.ndarray:
        """Pressure per model, 1.0 = fleet average."""
        m = self.n_models
        f = state.usable_free() if free is None else free
        model = state.node_model
        valid = model >= 0
        cap = np.bincount(model[valid], weights=f.sum(axis=1)[valid].astype(np.float64), minlength=m)[:m]
        total_free = cap.sum()
        demand_total = self.demand.sum()
        if m == 0 or total_free <= 0 or demand_total <= 0:
            return np.ones(m)
        cap_a = self.accept @ cap
        share = np.divide(self.demand, cap_a, out=np.zeros_like(self.demand), where=cap_a > 0)
        load = share @ self.accept
        rho = load / (demand_total / total_free)
        return np.where(cap > 0, rho, rho.max(initial=1.0))
