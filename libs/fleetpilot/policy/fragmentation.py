"""Fragmentation as FGD measures it, vectorised over the fleet.

For a distribution of "typical tasks" (shape + frequency), a node's fragmentation is the
expected free GPU milli that a typical task could not use (Weng et al., USENIX ATC'23):

* a typical task that cannot run on the node at all (wrong model, not enough CPU, not enough
  GPUs that fit it) sees all the node's free milli ``L`` as fragment;
* a CPU-only typical task uses no GPU, so it too sees all of ``L`` as fragment (the paper's
  "x-axis" tasks; the reference simulator counts them this way);
* otherwise the fragment is the free milli of the GPUs too small for it.

Rewriting ``frag = sum_t f_t * (can_t ? S_t : L)`` as ``L * F - sum_k (L - S_k) * W_k`` — where
``k`` runs over the distinct per-GPU milli thresholds of the typical tasks, ``S_k`` is the free
milli on GPUs below threshold ``k`` and ``W_k`` the total frequency of typical tasks with that
threshold that fit the node — turns the sum over tasks into a table lookup: ``W_k`` depends
only on (node model, threshold, CPU level, count of GPUs at or above the threshold). The
table has a few thousand entries and is built once per distribution, so scoring every
candidate GPU of every node costs ``O(candidates × thresholds)``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from .state import MILLI, ClusterState, TaskRequest


class TaskShape(msgspec.Struct, frozen=True, kw_only=True):
    """One typical task shape and its frequency (``weight``, the shapes sum to 1)."""

    cpu_milli: int
    gpu_milli: int
    gpus: int
    models: tuple[str, ...] = ()
    weight: float = 0.0


def shape_of(task: TaskRequest) -> tuple[int, int, int, tuple[str, ...]]:
    """The grouping key of a task: CPU, per-GPU milli, GPU count, acceptable models."""
    gpus = task.gpus if task.gpu_milli > 0 else 0
    milli = task.gpu_milli if gpus > 0 else 0
    return (task.cpu_milli, milli, gpus, tuple(sorted(set(task.gpu_models))) if gpus else ())


def typical_tasks(tasks: Iterable[TaskRequest], coverage: float = 0.95) -> list[TaskShape]:
    """The most frequent task shapes covering ``coverage`` of the tasks, renormalised.

    Shapes are counted over the tasks the policy has seen (for openb, the trace). Ties in
    frequency are ordered by the shape (larger first), which makes the cut deterministic.
    """
    counts = Counter(shape_of(t) for t in tasks)
    total = sum(counts.values())
    if total == 0:
        return []
    ordered = sorted(counts.items(), key=lambda kv: (kv[1], kv[0][0], kv[0][1], kv[0][2], "|".join(kv[0][3])),
                     reverse=True)
    chosen: list[tuple[tuple[int, int, int, tuple[str, ...]], int]] = []
    cum = 0
    for key, cnt in ordered:
        if cum >= coverage * total:
            break
        chosen.append((key, cnt))
        cum += cnt
    return [TaskShape(cpu_milli=k[0], gpu_milli=k[1], gpus=k[2], models=k[3], weight=c / cum) for k, c in chosen]


class FragTable:
    """Typical tasks compiled against one fleet's model list for fast fragmentation.

    ``weights`` overrides the shapes' frequencies (same order), e.g. scarcity-weighted ones.
    """

    def __init__(self, shapes: Sequence[TaskShape], models: Sequence[str], max_gpus: int,
                 weights: Sequence[float] | None = None) -> None:
        w = np.asarray([s.weight for s in shapes] if weights is None else list(weights), dtype=np.float64)
        self.total_weight = float(w.sum())
        gpu_idx = [i for i, s in enumerate(shapes) if s.gpus > 0 and s.gpu_milli > 0]
        self.thresholds = np.asarray(sorted({shapes[i].gpu_milli for i in gpu_idx}), dtype=np.int32)
        self.cpu_levels = np.asarray(sorted({shapes[i].cpu_milli for i in gpu_idx}), dtype=np.int64)
        k_n, c_n, g_n = len(self.thresholds), len(self.cpu_levels), max_gpus
        # Row 0 is "no GPU model" (a node without GPUs); model m is row m + 1.
        table = np.zeros((len(models) + 1, max(k_n, 1), c_n + 1, g_n + 1), dtype=np.float64)
        for i in gpu_idx:
            s = shapes[i]
            k = int(np.searchsorted(self.thresholds, s.gpu_milli))
            c = int(np.searchsorted(self.cpu_levels, s.cpu_milli)) + 1  # levels needed: >= c
            rows = [m + 1 for m, name in enumerate(models) if not s.models or name in s.models]
            n = min(s.gpus, g_n + 1)
            if s.gpus > g_n:
                continue  # no node can ever host it; it adds f*L everywhere via total_weight
            for r in rows:
                table[r, k, c:, n:] += w[i]
        self.table = table
        self._k = np.arange(max(k_n, 1))

    def node_terms(self, free: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per node: ``L`` (N,), ``S`` (N, K) and GPU counts at/above each threshold (N, K)."""
        thr = self.thresholds
        below = free[:, :, None] < thr[None, None, :]
        s = np.where(below, free[:, :, None], 0).sum(axis=1)
        cnt = (~below).sum(axis=1)  # padded slots hold 0 < every threshold: never counted
        return free.sum(axis=1), s, cnt

    def frag_from_terms(self, model: np.ndarray, cpu: np.ndarray, total: np.ndarray, s: np.ndarray,
                        cnt: np.ndarray) -> np.ndarray:
        """Fragmentation from precomputed terms; shapes broadcast as (..., K) for S and cnt."""
        if len(self.thresholds) == 0:
            return total * self.total_weight
        ci = np.searchsorted(self.cpu_levels, cpu, side="right")
        gmax = self.table.shape[3] - 1
        w = self.table[(model + 1)[..., None], self._k, ci[..., None], np.minimum(cnt, gmax)]
        return total * self.total_weight - ((total[..., None] - s) * w).sum(axis=-1)

    def node_frag(self, state: ClusterState, free: np.ndarray | None = None,
                  rows: np.ndarray | None = None) -> np.ndarray:
        """Fragmentation of every node (or of ``rows``) in milli-GPU."""
        f = state.usable_free() if free is None else free
        cpu, model = state.cpu_free, state.node_model
        if rows is not None:
            f, cpu, model = f[rows], cpu[rows], model[rows]
        total, s, cnt = self.node_terms(f)
        return self.frag_from_terms(model, cpu, total, s, cnt)

    def placement_deltas(self, state: ClusterState, task: TaskRequest, rows: np.ndarray,
                         free: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``frag_before - frag_after`` of placing ``task`` on each node in ``rows``.

        Returns ``(delta, gpu)``: for a sharing task, ``delta`` is ``(R, G)`` per candidate GPU
        (``-inf`` where the GPU cannot hold it) and ``gpu`` is unused; for other tasks
        ``delta`` is ``(R,)`` and the GPUs taken are the first fully free ones.
        """
        f = (state.usable_free() if free is None else free)[rows]
        cpu, model = state.cpu_free[rows], state.node_model[rows]
        total, s, cnt = self.node_terms(f)
        before = self.frag_from_terms(model, cpu, total, s, cnt)
        cpu_after = cpu - task.cpu_milli
        thr = self.thresholds
        if task.shares_gpu:
            m = task.gpu_milli
            g = f[:, :, None]                     # (R, G, 1)
            g2 = g - m
            th = thr[None, None, :]
            ds = np.where(g2 < th, g2, 0) - np.where(g < th, g, 0)
            dc = (g2 >= th).astype(np.int64) - (g >= th)
            s2 = s[:, None, :] + ds               # (R, G, K)
            c2 = cnt[:, None, :] + dc
            t2 = (total - m)[:, None]
            after = self.frag_from_terms(model[:, None], cpu_after[:, None],
                                         np.broadcast_to(t2, f.shape), s2, c2)
            delta = before[:, None] - after
            return np.where(f >= m, delta, -np.inf), np.empty(0)
        if task.gpus > 0 and task.gpu_milli > 0:
            n = task.gpus
            # Whole GPUs go from MILLI to 0: S unchanged, counts at every threshold drop by n.
            after = self.frag_from_terms(model, cpu_after, total - n * MILLI, s, cnt - n)
            return before - after, np.empty(0)
        after = self.frag_from_terms(model, cpu_after, total, s, cnt)
        return before - after, np.empty(0)


def fgd_score(delta: np.ndarray) -> np.ndarray:
    """FGD's integer node score ``int(100 * sigmoid(delta / 1000))`` (vectorised)."""
    with np.errstate(over="ignore"):
        x = 100.0 / (1.0 + np.exp(-delta / 1000.0))
    return np.floor(x)


def fragmentation_index(free: np.ndarray) -> np.ndarray:
    """Per-GPU-set memory/compute fragmentation index ``(total_free - largest)/total_free``.

    ``free`` is ``(..., G)``; returns ``(...)`` in 0..1 (0 when nothing is free).
    """
    total = free.sum(axis=-1)
    largest = free.max(axis=-1)
    return np.where(total > 0, (total - largest) / np.maximum(total, 1), 0.0)
