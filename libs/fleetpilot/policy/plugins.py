"""Built-in plugins, registered by name at their extension points.

Scores follow the FGD reference simulator where a paper baseline is reproduced (bestfit,
packing, fgd: integer scores in 0..100); Fleetpilot's own plugins are continuous.
"""

from __future__ import annotations

import msgspec
import numpy as np

from .fragmentation import FragTable, TaskShape, fgd_score
from .framework import (
    ConfidencePlugin,
    Cycle,
    DevicePlugin,
    FilterPlugin,
    NormalisePlugin,
    ScorePlugin,
    SelectPlugin,
    register,
)
from .state import MILLI, ClusterState, TaskRequest
from .transformers import (
    DemandPressure,
    cpu_per_gpu_milli,
    cpu_stranding,
    oom_risk,
    role_affinity,
    thermal_headroom,
)

# ---------------------------------------------------------------------------------------
# Shared per-decision helpers (cached on the cycle so several plugins reuse them).


def model_mask(state: ClusterState, task: TaskRequest) -> np.ndarray:
    """Nodes whose GPU model the task accepts (all nodes for CPU-only or unconstrained)."""
    if not task.gpu_models or task.gpus <= 0 or task.gpu_milli <= 0:
        return np.ones(state.n_nodes, dtype=bool)
    idx = [state.models.index(m) for m in set(task.gpu_models) if m in state.models]
    return np.isin(state.node_model, idx)


def fitting_gpus(cycle: Cycle, whole_only: bool = False) -> np.ndarray:
    """``(N, G)`` mask of GPUs that could hold (one GPU's share of) the task."""
    key = ("fit", whole_only)
    if key not in cycle.extras:
        task, state = cycle.task, cycle.state
        need = MILLI if (whole_only or not task.shares_gpu) else task.gpu_milli
        fit = cycle.free >= need
        if task.gpu_memory_mb > 0:
            fit &= state.gpu_mem_free >= task.gpu_memory_mb
        cycle.extras[key] = fit
    return cycle.extras[key]


def uses_gpu(task: TaskRequest) -> bool:
    """True when the task asks for any GPU."""
    return task.gpus > 0 and task.gpu_milli > 0


# ---------------------------------------------------------------------------------------
# filter


class ResourceArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``whole_gpus_only``: every GPU task needs whole free GPUs (the NVIDIA device plugin)."""

    whole_gpus_only: bool = False


@register
class NodeResources(FilterPlugin):
    """Enough free CPU, memory, and GPUs: one GPU with ``gpu_milli`` free for a sharing task
    (never split), else ``gpus`` fully free GPUs; GPU memory too when the task asks for it."""

    name = "node-resources"
    Args = ResourceArgs

    def filter(self, cycle: Cycle) -> np.ndarray:
        """Feasibility mask over nodes."""
        state, task = cycle.state, cycle.task
        ok = (state.cpu_free >= task.cpu_milli) & (state.mem_free >= task.memory_mb)
        if uses_gpu(task):
            ok &= fitting_gpus(cycle, self.args.whole_gpus_only).sum(axis=1) >= task.gpus
        return ok

    def shortfalls(self, cycle: Cycle) -> list[tuple[str, np.ndarray]]:
        """Free CPU, free memory, free GPUs (whole, or one with the share's milli; a GPU the
        task's business rules bar counts as not free) and, on nodes with enough of those, free
        GPU memory, each on its own."""
        state, task = cycle.state, cycle.task
        found = [("lack free CPU", state.cpu_free < task.cpu_milli),
                 ("lack free memory", state.mem_free < task.memory_mb)]
        if uses_gpu(task):
            whole = self.args.whole_gpus_only or not task.shares_gpu
            enough = (cycle.free >= (MILLI if whole else task.gpu_milli)).sum(axis=1) >= task.gpus
            fit = fitting_gpus(cycle, self.args.whole_gpus_only).sum(axis=1) >= task.gpus
            found += [("lack free GPUs" if whole else "lack a GPU with the share free", ~enough),
                      ("lack free GPU memory", enough & ~fit)]
        return found


@register
class GpuModel(FilterPlugin):
    """Only nodes whose GPU model the task lists (any model when it lists none)."""

    name = "gpu-model"

    def filter(self, cycle: Cycle) -> np.ndarray:
        """Model mask over nodes."""
        return model_mask(cycle.state, cycle.task)

    def shortfalls(self, cycle: Cycle) -> list[tuple[str, np.ndarray]]:
        """The nodes whose GPUs are of a model the task does not list."""
        return [("not of a GPU model it accepts", ~self.filter(cycle))]


# ---------------------------------------------------------------------------------------
# score


@register
class LeastAllocated(ScorePlugin):
    """kube-scheduler NodeResourcesFit/LeastAllocated: mean over CPU and memory of
    ``(free - request) * 100 // capacity`` (integer, as Kubernetes computes it)."""

    name = "least-allocated"

    def score(self, cycle: Cycle) -> np.ndarray:
        """Integer scores 0..100."""
        s, t, r = cycle.state, cycle.task, cycle.rows
        cpu = (s.cpu_free[r] - t.cpu_milli) * 100 // np.maximum(s.cpu_total[r], 1)
        mem = (s.mem_free[r] - t.memory_mb) * 100 // np.maximum(s.mem_total[r], 1)
        return ((cpu + mem) // 2).astype(np.float64)


class BestFitArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Normalising constants of the reference bestfit: max CPU and max GPU milli per node."""

    max_cpu_milli: float = 128000.0
    max_gpu_milli: float = 8000.0


@register
class BestFit(ScorePlugin):
    """``int((1 - ((c - p_c)/128000 * 0.5 + (L - p_n*p_m)/8000 * 0.5)) * 100)``: the node
    left with the least free CPU and GPU wins (the FGD paper's bestfit baseline)."""

    name = "bestfit"
    Args = BestFitArgs

    def score(self, cycle: Cycle) -> np.ndarray:
        """Integer scores 0..100 (to be min-max normalised)."""
        s, t, r = cycle.state, cycle.task, cycle.rows
        total = cycle.free[r].sum(axis=1).astype(np.float64)
        x = (s.cpu_free[r] - t.cpu_milli) / self.args.max_cpu_milli * 0.5
        x = x + (total - t.total_milli) / self.args.max_gpu_milli * 0.5
        return np.trunc((1.0 - x) * 100.0)


@register
class GpuPacking(ScorePlugin):
    """The reference simulator's GPU packing: (1) a partly used GPU, scored
    ``100 - freeRatio/10`` capped at 50..100; (2) fully free GPUs of a used node,
    ``50 - n`` capped at 33..50; (3) an idle node, ``33 - G`` (at least G); CPU tasks 0."""

    name = "packing"

    def score(self, cycle: Cycle) -> np.ndarray:
        """Integer scores 0..100."""
        s, t, r = cycle.state, cycle.task, cycle.rows
        if not uses_gpu(t):
            return np.zeros(r.size)
        free = cycle.free[r]
        exists = s.gpu_exists[r]
        n_gpu = exists.sum(axis=1)
        fully = ((free == MILLI) & exists).sum(axis=1)
        idle = np.maximum(100 // 3 - fully, fully)
        if t.shares_gpu:
            # The tightest GPU that fits is the one the reference walks to first.
            cand = np.where(free >= t.gpu_milli, free, MILLI + 1)
            tight = cand.min(axis=1)
            shared = np.maximum(100 - (tight * 100 // MILLI) // 10, 50)
            used = np.where(tight == MILLI, np.maximum(50 - 1, 33), shared)
        else:
            used = np.full(r.size, max(50 - t.gpus, 33))
        return np.where(fully == n_gpu, idle, used).astype(np.float64)


class FgdArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The typical-task distribution (shapes with frequencies summing to 1)."""

    typical: list[TaskShape] = msgspec.field(default_factory=list)


class _FragScorer(ScorePlugin):
    """Shared machinery: a ``FragTable`` compiled per fleet layout, per-GPU deltas."""

    def _table(self, state: ClusterState) -> FragTable:
        key = (tuple(state.models), state.max_gpus)
        if getattr(self, "_key", None) != key:
            self._key = key
            self._frag = FragTable(self.args.typical, state.models, state.max_gpus)
        return self._frag

    def _deltas(self, cycle: Cycle) -> np.ndarray:
        """``frag_before - frag_after`` per row, or per (row, GPU) for a sharing task, ``-inf``
        on a GPU that cannot hold it."""
        table = self._table(cycle.state)
        delta, _ = table.placement_deltas(cycle.state, cycle.task, cycle.rows, cycle.free)
        if delta.ndim == 2:
            # The table knows compute only; the GPU chosen here is the GPU the task takes
            # (``Scored``), so it must hold the task's memory too, as the filter required of
            # some GPU of the node.
            delta = np.where(fitting_gpus(cycle)[cycle.rows], delta, -np.inf)
        return delta


@register
class Fgd(_FragScorer):
    """Fragmentation gradient descent: ``int(100 * sigmoid((frag_before - frag_after)/1000))``;
    a sharing task's node score is that of its best GPU (first index on equal scores), which
    is also the GPU it takes (``cycle.gpu_choice``)."""

    name = "fgd"
    Args = FgdArgs

    def score(self, cycle: Cycle) -> np.ndarray:
        """Integer scores 0..100."""
        t = cycle.task
        if not uses_gpu(t) and t.cpu_milli == 0 and t.memory_mb == 0:
            return np.full(cycle.rows.size, 100.0)
        delta = self._deltas(cycle)
        if delta.ndim == 2:
            per_gpu = np.where(np.isfinite(delta), fgd_score(np.where(np.isfinite(delta), delta, 0.0)), -1.0)
            gpu = per_gpu.argmax(axis=1)
            cycle.gpu_choice = gpu
            return per_gpu[np.arange(gpu.size), gpu]
        return fgd_score(delta)


class FleetpilotFragArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Typical tasks, the weight of the demand pressure, whether to keep FGD's integer
    quantisation (measured better than continuous scores on openb: the seeded tie-break
    spreads equally good placements), optionally the demand distribution the pressure is
    computed from (default: the typical tasks; better: every shape seen, since rare
    multi-GPU classes matter by the capacity they need), and the CPU-stranding weight."""

    typical: list[TaskShape] = msgspec.field(default_factory=list)
    pressure_weight: float = 1.0
    integer: bool = True
    demand: list[TaskShape] | None = None
    cpu_weight: float = 1.0


@register
class FleetpilotFrag(_FragScorer):
    """Demand-aware fragmentation.

    Score = ``frag_before - frag_after - pressure_weight * (cost - min cost) - cpu_weight *
    (stranded_after - stranded_before)`` inside FGD's sigmoid, all in milli-GPU.

    ``cost`` is the demand pressure (``DemandPressure``) of the capacity the placement takes
    away: every task class (from ``demand``, default the typical tasks) prices the capacity
    it can use at its demand per usable milli, relative to the fleet average. The request
    consumed on a node that constrained classes need costs more than on one nobody needs
    exclusively (a class is constrained by GPU model, and by the node CPU and GPU count it
    needs); leaving a node with fewer free GPUs (or less CPU) than a multi-GPU class needs
    costs that class's usable capacity there, dearer as such nodes get scarce. A task that
    can run anywhere is thus steered away from capacity only some classes can use; when
    every candidate costs the same (no constrained or multi-GPU demand) the term vanishes.
    The multi-GPU part is priced against the demand per *usable* free milli (free less FGD's
    fragmentation over the fleet, ``_usable_free``), the unit its own prices count in.

    The second term charges the GPU milli a placement strands for lack of CPU
    (``cpu_stranding``): FGD only notices CPU once a typical task no longer fits a node, so
    it lets CPU-hungry placements drain the CPU that the node's remaining GPUs will need; the
    fluid estimate sees the drain before the cliff. The pressure enters with weight 1; the
    built-in profile weighs the stranding 2 (``builtin.FLEETPILOT_CPU_WEIGHT``).
    """

    name = "fleetpilot-frag"
    Args = FleetpilotFragArgs

    def _stranding(self, cycle: Cycle) -> np.ndarray:
        """Increase, per row, of the GPU milli stranded for lack of CPU (``cpu_stranding``)."""
        if getattr(self, "_cpm", None) is None:
            self._cpm = cpu_per_gpu_milli(self.args.typical)
        s, t, r = cycle.state, cycle.task, cycle.rows
        free = cycle.free[r].sum(axis=1)
        cpu = s.cpu_free[r]
        return cpu_stranding(free - t.total_milli, cpu - t.cpu_milli, self._cpm) - cpu_stranding(free, cpu, self._cpm)

    def _usable_free(self, cycle: Cycle) -> float:
        """The fleet's free milli less FGD's fragmentation summed over every node (what the
        typical tasks could still use), for ``DemandPressure.costs``.

        A full pass costs ~1.5 ms on openb's 1,213 nodes, twice a whole decision, so the
        per-node fragmentation is cached and only the nodes whose free GPU milli, free CPU or
        model changed since the last call are recomputed (one node after a placement)."""
        state, free = cycle.state, cycle.free
        table = self._table(state)
        cache = getattr(self, "_nf", None)
        if cache is None or cache[0] is not table or cache[1].shape != free.shape:
            rows = None
        else:
            changed = (free != cache[1]).any(axis=1) | (state.cpu_free != cache[2]) | (state.node_model != cache[3])
            rows = np.flatnonzero(changed)
        if rows is None:
            frag = table.node_frag(state, free)
        else:
            frag = cache[4]
            if rows.size:
                frag = frag.copy()
                frag[rows] = table.node_frag(state, free, rows)
        if rows is None or rows.size:
            self._nf = (table, free.copy(), state.cpu_free.copy(), state.node_model.copy(), frag, float(frag.sum()))
        return float(free.sum()) - self._nf[5]

    def _pressure(self, state: ClusterState) -> DemandPressure:
        key = tuple(state.models)
        if getattr(self, "_pkey", None) != key:
            self._pkey = key
            self._pm = DemandPressure(self.args.demand if self.args.demand is not None else self.args.typical,
                                      state.models)
        return self._pm

    def score(self, cycle: Cycle) -> np.ndarray:
        """Scores (integer 0..100 when ``integer``, else continuous milli)."""
        s, t, r = cycle.state, cycle.task, cycle.rows
        if not uses_gpu(t) and t.cpu_milli == 0 and t.memory_mb == 0:
            return np.full(r.size, 100.0)
        delta = self._deltas(cycle)
        penalty = np.zeros(r.size)
        if self.args.cpu_weight > 0:
            penalty = penalty + self.args.cpu_weight * self._stranding(cycle)
        if delta.ndim == 2:
            penalty = penalty[:, None] + np.zeros(delta.shape)
        if self.args.pressure_weight > 0:
            free_r = cycle.free[r]
            if t.shares_gpu:
                taken = (free_r >= MILLI).astype(np.int64)
            else:
                taken = np.full(r.size, t.gpus if uses_gpu(t) else 0, dtype=np.int64)
            cost = self._pressure(s).costs(s, cycle.free, r, t.total_milli, t.cpu_milli, taken,
                                           usable_free=self._usable_free(cycle))
            valid = np.isfinite(delta)
            if valid.any():
                cost = cost - cost[valid].min()
                if cost[valid].max(initial=0.0) > 0:
                    cycle.notes.append(f"demand pressure up to {cost[valid].max():.0f} milli")
            penalty = penalty + self.args.pressure_weight * cost
        if delta.ndim == 2:
            x = delta - penalty
            valid = np.isfinite(x)
            per_gpu = fgd_score(np.where(valid, x, 0.0)) if self.args.integer else np.where(valid, x, 0.0)
            per_gpu = np.where(valid, per_gpu, -np.inf)
            gpu = per_gpu.argmax(axis=1)
            cycle.gpu_choice = gpu
            return per_gpu[np.arange(gpu.size), gpu]
        x = delta - penalty
        return fgd_score(x) if self.args.integer else x


class TierArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Multipliers of a smooth term per SLA tier (a VIP task cares more about risk)."""

    vip: float = 2.0
    standard: float = 1.0
    best_effort: float = 0.5


def _tier_factor(args: TierArgs, tier: str) -> float:
    return {"vip": args.vip, "best_effort": args.best_effort}.get(tier, args.standard)


def _best_over_fitting(values: np.ndarray, fit: np.ndarray, worst: float) -> np.ndarray:
    """Per row, the best (max) value over the GPUs that fit (``worst`` if none)."""
    return np.where(fit, values, worst).max(axis=1)


@register
class OomRiskScore(ScorePlugin):
    """``-100 * tier * P(OOM)`` on the least risky fitting GPU of each node (smooth: the
    risk is a normal CDF of predicted peak vs free memory, never a cut-off)."""

    name = "oom-risk"
    Args = TierArgs

    def score(self, cycle: Cycle) -> np.ndarray:
        """Scores in -200..0."""
        s, t, r = cycle.state, cycle.task, cycle.rows
        if not uses_gpu(t) or (t.predicted_peak_mb <= 0 and t.gpu_memory_mb <= 0):
            return np.zeros(r.size)
        safe = 1.0 - oom_risk(s, t)[r]
        best = _best_over_fitting(safe, fitting_gpus(cycle)[r], 0.0)
        return -100.0 * _tier_factor(self.args, t.tier) * (1.0 - best)


@register
class ThermalScore(ScorePlugin):
    """``100 * tier * headroom`` of the coolest fitting GPU (0..1 headroom, clipped)."""

    name = "thermal"
    Args = TierArgs

    def score(self, cycle: Cycle) -> np.ndarray:
        """Scores in 0..200."""
        t, r = cycle.task, cycle.rows
        if not uses_gpu(t):
            return np.zeros(r.size)
        head = thermal_headroom(cycle.state)[r]
        return 100.0 * _tier_factor(self.args, t.tier) * _best_over_fitting(head, fitting_gpus(cycle)[r], 0.0)


@register
class RoleAffinityScore(ScorePlugin):
    """``100 * affinity`` of the best fitting GPU (1 = same role, 0.5 = unroled, 0 = other)."""

    name = "role-affinity"

    def score(self, cycle: Cycle) -> np.ndarray:
        """Scores in 0..100."""
        t, r = cycle.task, cycle.rows
        if not uses_gpu(t):
            return np.zeros(r.size)
        aff = role_affinity(cycle.state, t)[r]
        return 100.0 * _best_over_fitting(aff, fitting_gpus(cycle)[r], 0.0)


@register
class TopologyScore(ScorePlugin):
    """For multi-GPU tasks: ``-100 * (NUMA spread of the first free GPUs + NVLink
    congestion) / 2`` — prefer nodes where the GPUs it would get are close and links idle."""

    name = "topology"

    def score(self, cycle: Cycle) -> np.ndarray:
        """Scores in -100..0 (0 for single-GPU and CPU tasks)."""
        s, t, r = cycle.state, cycle.task, cycle.rows
        if t.gpus < 2 or not uses_gpu(t):
            return np.zeros(r.size)
        fit = fitting_gpus(cycle)[r]
        # Cost of the first `gpus` fitting slots: mean link cost between them.
        order = np.argsort(~fit, axis=1, kind="stable")[:, : t.gpus]
        links = s.gpu_link[r[:, None, None], order[:, :, None], order[:, None, :]].astype(np.float64)
        spread = np.clip((links.sum(axis=(1, 2)) / (t.gpus * (t.gpus - 1)) - 1.0) / 5.0, 0.0, 1.0)
        util = np.where(s.gpu_exists[r], s.gpu_nvlink_util[r], 0.0).sum(axis=1) / np.maximum(s.gpu_exists[r].sum(axis=1), 1)
        return -50.0 * (spread + np.clip(util, 0.0, 1.0))


# ---------------------------------------------------------------------------------------
# normalise


@register
class NoNormalise(NormalisePlugin):
    """Scores pass through unchanged."""

    name = "none"

    def normalise(self, scores: np.ndarray) -> np.ndarray:
        """Identity."""
        return scores


@register
class MinMax(NormalisePlugin):
    """Integer min-max to 0..100 as the reference simulator's ``NormalizeScore`` (all 0 when
    every node scores the same)."""

    name = "min-max"

    def normalise(self, scores: np.ndarray) -> np.ndarray:
        """Scores mapped to 0..100."""
        if scores.size == 0 or scores.min() == scores.max():
            return np.zeros_like(scores)
        lo, hi = scores.min(), scores.max()
        return np.floor((scores - lo) * 100.0 / (hi - lo))


# ---------------------------------------------------------------------------------------
# select


class PriorityArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``seed`` of the per-run random node priority that breaks ties between equal scores."""

    seed: int = 0


@register
class PrioritySelect(SelectPlugin):
    """Highest score; among equal scores the node earliest in a random priority order drawn
    once from ``seed`` (so ties do not always favour the first nodes of the inventory)."""

    name = "priority"
    Args = PriorityArgs

    def rank(self, n: int) -> np.ndarray:
        """Priority rank of each node row (0 = first), cached per fleet size."""
        if getattr(self, "_n", None) != n:
            self._n = n
            order = np.random.default_rng(self.args.seed).permutation(n)
            self._rank = np.empty(n, dtype=np.int64)
            self._rank[order] = np.arange(n)
        return self._rank

    def select(self, cycle: Cycle, total: np.ndarray) -> int:
        """Position of the chosen row."""
        best = np.flatnonzero(total == total.max())
        if best.size == 1:
            return int(best[0])
        ranks = self.rank(cycle.state.n_nodes)[cycle.rows[best]]
        return int(best[int(np.argmin(ranks))])


@register
class FirstSelect(SelectPlugin):
    """Highest score, ties to the lowest row (deterministic, for tests and replays)."""

    name = "first"

    def select(self, cycle: Cycle, total: np.ndarray) -> int:
        """Position of the chosen row."""
        return int(np.argmax(total))


# ---------------------------------------------------------------------------------------
# devices


@register
class FirstFree(DevicePlugin):
    """The NVIDIA device plugin: the first fully free GPU indices; with
    ``whole_gpus_only`` a sharing task still holds a whole GPU."""

    name = "first-free"
    Args = ResourceArgs

    def devices(self, cycle: Cycle, pos: int) -> tuple[list[int], int]:
        """GPU indices and milli per GPU."""
        t = cycle.task
        if not uses_gpu(t):
            return [], 0
        row = int(cycle.rows[pos])
        fit = fitting_gpus(cycle, self.args.whole_gpus_only or not t.shares_gpu)[row]
        milli = MILLI if (self.args.whole_gpus_only or not t.shares_gpu) else t.gpu_milli
        return [int(j) for j in np.flatnonzero(fit)[: t.gpus]], milli


def tightest_devices(cycle: Cycle, row: int) -> tuple[list[int], int]:
    """A sharing task on the fitting GPU with the least free milli (first on ties); whole
    GPUs in index order."""
    t = cycle.task
    if not uses_gpu(t):
        return [], 0
    fit = fitting_gpus(cycle)[row]
    if t.shares_gpu:
        cand = np.where(fit, cycle.free[row], np.iinfo(np.int32).max)
        return [int(np.argmin(cand))], t.gpu_milli
    return [int(j) for j in np.flatnonzero(fit)[: t.gpus]], t.gpu_milli


@register
class Tightest(DevicePlugin):
    """Best fit inside the node (see ``tightest_devices``)."""

    name = "tightest"

    def devices(self, cycle: Cycle, pos: int) -> tuple[list[int], int]:
        """GPU indices and milli per GPU."""
        return tightest_devices(cycle, int(cycle.rows[pos]))


@register
class Scored(DevicePlugin):
    """The GPU a score plugin proposed for this row (FGD's least-fragmenting GPU), else the
    tightest fit."""

    name = "scored"

    def devices(self, cycle: Cycle, pos: int) -> tuple[list[int], int]:
        """GPU indices and milli per GPU."""
        t = cycle.task
        if cycle.gpu_choice is not None and t.shares_gpu:
            return [int(cycle.gpu_choice[pos])], t.gpu_milli
        return tightest_devices(cycle, int(cycle.rows[pos]))


# ---------------------------------------------------------------------------------------
# confidence


class PriorArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``success``: the historical success rate of this policy's assignments (from the
    feedback store; 0.9 when none is known)."""

    success: float = 0.9


@register
class PriorConfidence(ConfidencePlugin):
    """Heuristic baselines: ``success * (1 - P(OOM on the chosen GPUs))``. The heuristic
    itself knows nothing else about the outcome, so it claims no more than its track record."""

    name = "prior"
    Args = PriorArgs

    def confidence(self, cycle: Cycle, pos: int, gpus: list[int], total: np.ndarray) -> float:
        """Probability in 0..1."""
        row = int(cycle.rows[pos])
        risk = float(oom_risk(cycle.state, cycle.task)[row, gpus].max()) if gpus else 0.0
        return self.args.success * (1.0 - risk)


class FleetpilotConfidenceArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``success``: historical success of assignments; ``throttle_cost``: how much a hot
    GPU lowers the odds; ``frag_cost``: how much an increase of fragmentation does."""

    success: float = 0.95
    throttle_cost: float = 0.1
    frag_cost: float = 0.1


@register
class FleetpilotConfidence(ConfidencePlugin):
    """``success * (1 - P(OOM)) * (1 - throttle_cost * (1 - headroom)) * (1 - frag_cost * u)``
    where ``u`` in 0..1 is how far the chosen node's score sits below the best possible
    (0 = the top score, i.e. no node would have fragmented less)."""

    name = "fleetpilot"
    Args = FleetpilotConfidenceArgs

    def confidence(self, cycle: Cycle, pos: int, gpus: list[int], total: np.ndarray) -> float:
        """Probability in 0..1."""
        row = int(cycle.rows[pos])
        a = self.args
        risk = float(oom_risk(cycle.state, cycle.task)[row, gpus].max()) if gpus else 0.0
        head = float(thermal_headroom(cycle.state)[row, gpus].min()) if gpus else 1.0
        spread = float(total.max() - total.min())
        u = 0.0 if spread <= 0 else float((total.max() - total[pos]) / spread)
        return a.success * (1.0 - risk) * (1.0 - a.throttle_cost * (1.0 - head)) * (1.0 - a.frag_cost * u)
