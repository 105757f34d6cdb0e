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


def rows_times(matrix: np.ndarray, vector: np.ndarray) -> np.ndarray:
    """``matrix @ vector``, summed by numpy itself rather than by OpenBLAS.

    OpenBLAS picks its kernels by the CPU and they add in different orders, so ``@`` differs
    in the last bits from one machine to the next; a pressure that ties two nodes on one
    machine and not on another would make a decision that its replay elsewhere does not.
    numpy's own reduction adds in an order fixed by the array's shape alone."""
    return np.sum(matrix * vector[None, :], axis=1)


def times_rows(vector: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """``vector @ matrix``, summed by numpy itself (see ``rows_times``)."""
    return np.sum(vector[:, None] * matrix, axis=0)


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


# Chebyshev fit of erfc (Numerical Recipes' ``erfcc``): erfc(z) = t exp(-z^2 + P(t)) with
# t = 1/(1 + z/2), fractional error below 1.2e-7 for every z >= 0.
_ERFC_POLY = (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418,
              0.37409196, 1.00002368, -1.26551223)


def erfc(x: np.ndarray) -> np.ndarray:
    """Complementary error function, vectorised: fractional error < 1.2e-7 for ``x >= 0``
    (so the small tail stays accurate), absolute error < 1e-7 everywhere; NaN stays NaN."""
    shape = np.shape(x)
    x = np.atleast_1d(np.asarray(x, dtype=np.float64))   # 0-d results are scalars: no in-place steps
    z = np.abs(x)
    t = 0.5 * z
    t += 1.0
    np.reciprocal(t, out=t)
    poly = np.full_like(t, _ERFC_POLY[0])
    for c in _ERFC_POLY[1:]:             # Horner, in place (this runs on every GPU slot per decision)
        poly *= t
        poly += c
    with np.errstate(over="ignore"):     # z*z -> inf for huge |x|: exp(-inf) = 0, as it should
        z *= z
        poly -= z
        np.exp(poly, out=poly)
    poly *= t
    return np.where(x >= 0, poly, 2.0 - poly).reshape(shape)


def normal_cdf(x: np.ndarray) -> np.ndarray:
    """Standard normal CDF, vectorised: ``erfc(-x/sqrt 2)/2`` (absolute error < 5e-8, and
    relative error < 1.2e-7 in the lower tail, where a small OOM risk is read)."""
    return 0.5 * erfc(-np.asarray(x, dtype=np.float64) / math.sqrt(2.0))


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
        cap_a = rows_times(self.accept, cap)
        share = np.divide(self.demand, cap_a, out=np.zeros_like(self.demand), where=cap_a > 0)
        load = times_rows(share, self.accept)
        rho = load / (demand_total / total_free)
        return np.where(cap > 0, rho, rho.max(initial=1.0))


class DemandPressure:
    """Scarcity of the capacity each placement would take away, generalising ``ModelPressure``
    from GPU-model constraints to every constraint a task class has.

    A class ``t`` (frequency ``f``, ``n`` GPUs of ``r`` milli, CPU ``c``, models ``A``) brings
    demand ``d_t = f n r`` and can only use capacity ``U_t`` that it fits: a node of an
    accepted model with at least ``c`` CPU and ``n`` GPUs in total, and for a multi-GPU class
    (``n >= 2``, whole GPUs) only the fully free GPUs of nodes that still have ``n`` of them
    and ``c`` free CPU (that is what it needs *now*). Each free milli of capacity usable by
    ``t`` carries the price ``s_t = d_t / U_t`` (demand per usable milli), relative to the
    fleet average ``sum d / free``; a placement's cost is ``sum_t s_t * (usable_t lost) /
    avg`` in milli-GPU, FGD's unit:

    * single-GPU and sharing classes lose the request itself on every node they accept (the
      capacity consumed): with no constraint anywhere this is the same on every node and
      vanishes once the minimum over the candidates is subtracted, and it grows smoothly
      with the share of constrained demand (the old model pressure is the case ``c = 0``);
    * a multi-GPU class loses the node's whole usable capacity when the placement leaves it
      fewer than ``n`` free GPUs (or not enough CPU): breaking the last idle nodes that an
      8-GPU class can use costs ``8000 * s_t / avg``, which rises as those nodes get scarce
      relative to the remaining demand. It vanishes as such classes vanish from the demand.

    The two parts are relative to different averages, each in the unit its prices use. A
    single-GPU price counts every free milli of the nodes a class accepts, fragments
    included, so it is compared with ``sum d / free``. A multi-GPU price counts only the
    whole GPUs the class can take now, so it is compared with the demand per *usable* free
    milli, ``sum d / usable_free``, where ``usable_free`` is the free milli minus FGD's
    fragmentation summed over the fleet (what a typical task could still use; the caller
    passes it, ``free.sum()`` when it does not). Against the raw average, a multi-GPU price
    climbs as fragments pile up that no task can use: near a full fleet breaking an idle
    node looks dearer than stranding its GPUs. Scaled this way, the multi-GPU cost is
    ``usable_free / free`` times the raw one; the two are equal on an unfragmented fleet.

    Node "types" (model, total CPU, GPU count) make the static part a small matrix; the
    dynamic multi-GPU part costs ``O(nodes × multi-GPU classes)`` per decision.
    """

    def __init__(self, shapes: Sequence[TaskShape], models: Sequence[str]) -> None:
        gpu_shapes = [s for s in shapes if s.gpus > 0 and s.gpu_milli > 0]
        self.shapes = gpu_shapes
        self.models = list(models)
        self.demand_total = float(sum(s.weight * s.gpus * s.gpu_milli for s in gpu_shapes))
        self._key: object = None

    def _compile(self, state: ClusterState) -> None:
        # Node totals never change in place: the arrays' identity (and a checksum, against a
        # recycled id) tells a new fleet layout from the same one.
        quick = (state.n_nodes, id(state.cpu_total), id(state.node_model), id(state.gpu_exists),
                 int(state.cpu_total.sum()), int(state.node_model.sum()))
        if quick == getattr(self, "_quick", None):
            return
        self._quick = quick
        n_gpu = state.gpu_exists.sum(axis=1)
        key = (state.n_nodes, tuple(state.models), state.node_model.tobytes(), state.cpu_total.tobytes(),
               n_gpu.tobytes())
        if key == self._key:
            return
        self._key = key
        types, type_of = np.unique(np.stack([state.node_model.astype(np.int64), state.cpu_total.astype(np.int64),
                                             n_gpu.astype(np.int64)], axis=1), axis=0, return_inverse=True)
        self.type_of = type_of.reshape(-1)
        self.n_types = len(types)
        t_model, t_cpu, t_gpus = types[:, 0], types[:, 1], types[:, 2]
        single: dict[bytes, float] = {}
        single_rows: dict[bytes, np.ndarray] = {}
        multi: dict[tuple[int, int, bytes], float] = {}
        multi_rows: dict[tuple[int, int, bytes], np.ndarray] = {}
        for s in self.shapes:
            ok_model = np.asarray([m >= 0 and ((not s.models) or state.models[m] in s.models) for m in t_model])
            acc = ok_model & (t_cpu >= s.cpu_milli) & (t_gpus >= s.gpus)
            d = s.weight * s.gpus * s.gpu_milli
            if s.gpus >= 2:
                k = (s.gpus, s.cpu_milli, acc.tobytes())
                multi[k] = multi.get(k, 0.0) + d
                multi_rows[k] = acc
            else:
                k2 = acc.tobytes()
                single[k2] = single.get(k2, 0.0) + d
                single_rows[k2] = acc
        self.single_demand = np.asarray(list(single.values()), dtype=np.float64)
        self.single_accept = np.asarray([single_rows[k] for k in single], dtype=np.float64).reshape(-1, self.n_types)
        keys = list(multi)
        self.multi_demand = np.asarray([multi[k] for k in keys], dtype=np.float64)
        self.multi_gpus = np.asarray([k[0] for k in keys], dtype=np.int64)
        self.multi_cpu = np.asarray([k[1] for k in keys], dtype=np.int64)
        # (classes, nodes): static acceptance per node
        self.multi_accept = np.asarray([multi_rows[k][self.type_of] for k in keys], dtype=bool).reshape(-1, state.n_nodes)

    def costs(self, state: ClusterState, free: np.ndarray, rows: np.ndarray, request: int, cpu: int,
              whole_taken: np.ndarray, usable_free: float | None = None) -> np.ndarray:
        """Cost in milli-GPU of a placement on each of ``rows``; ``whole_taken`` (broadcastable
        to ``(R, ...)``) says how many fully free GPUs it takes there (a sharing task: 1 on a
        free GPU, 0 on a used one); ``usable_free``: the fleet's free milli less its FGD
        fragmentation (default ``free.sum()``), which the multi-GPU part is priced against.
        Returns an array of ``whole_taken``'s shape."""
        self._compile(state)
        total_free = float(free.sum())
        if self.demand_total <= 0 or total_free <= 0:
            return np.zeros(np.shape(whole_taken))
        avg = self.demand_total / total_free
        # usable / free in 0..1: the multi-GPU part over the average per usable milli.
        usable_share = 1.0 if usable_free is None else min(max(float(usable_free), 0.0) / total_free, 1.0)
        node_free = free.sum(axis=1).astype(np.float64)
        cap_type = np.bincount(self.type_of, weights=node_free, minlength=self.n_types)
        cap = rows_times(self.single_accept, cap_type)
        price = np.divide(self.single_demand, cap, out=np.zeros_like(cap), where=cap > 0)
        per_type = times_rows(price, self.single_accept)  # (types,)
        cost = per_type[self.type_of[rows]] * float(request)
        cost = np.broadcast_to(cost.reshape((-1,) + (1,) * (np.ndim(whole_taken) - 1)), np.shape(whole_taken))
        if self.multi_demand.size:
            full = (free >= MILLI).sum(axis=1)
            cpu_free = state.cpu_free
            # (classes, nodes): usable whole-GPU milli per multi-GPU class now
            ok = self.multi_accept & (full[None, :] >= self.multi_gpus[:, None]) & (cpu_free[None, :] >= self.multi_cpu[:, None])
            usable = np.where(ok, full[None, :] * float(MILLI), 0.0)
            cap_m = usable.sum(axis=1)
            price_m = np.divide(self.multi_demand, cap_m, out=np.zeros_like(cap_m), where=cap_m > 0)
            live = price_m > 0
            if live.any():
                price_m = price_m[live]
                acc = self.multi_accept[live][:, rows]                      # (C, R)
                need_g, need_c = self.multi_gpus[live][:, None], self.multi_cpu[live][:, None]
                before = usable[live][:, rows]
                r_full = full[rows][None, :]
                cpu_ok = (cpu_free[rows] - cpu)[None, :] >= need_c

                def lost_with(k: int) -> np.ndarray:
                    after_full = r_full - k
                    after = np.where(acc & cpu_ok & (after_full >= need_g), after_full * float(MILLI), 0.0)
                    return times_rows(price_m, before - after)             # (R,)

                wt = np.asarray(whole_taken)
                if wt.ndim == 1 and wt.size and (wt == wt[0]).all():
                    cost = cost + usable_share * lost_with(int(wt[0]))
                else:  # a sharing task: 1 where it would break a fully free GPU, else 0
                    l0 = lost_with(0).reshape((-1,) + (1,) * (wt.ndim - 1))
                    l1 = lost_with(1).reshape((-1,) + (1,) * (wt.ndim - 1))
                    cost = cost + usable_share * np.where(wt > 0, l1, l0)
        return cost / avg
