"""kube-scheduler's ``DefaultPreemption``, as the fleet benchmark's baseline plays it.

A pod that finds no node (its Filter phase failed everywhere) runs the PostFilter plugin
``DefaultPreemption``: it looks for a node where evicting pods of *lower priority* lets it fit,
evicts them (with their grace period) and is nominated to that node. A team that sets a
PriorityClass per tier gets this by default (``preemptionPolicy: PreemptLowerPriority``), so a
faithful baseline plays it. What is modelled, from
``pkg/scheduler/framework/plugins/defaultpreemption`` and ``framework/preemption``:

- **Victims on a node** (``SelectVictimsOnNode``): every pod of lower priority is removed; if the
  pod still does not fit, the node is no candidate. Then the potential victims are *reprieved*
  one by one, most important first (higher priority, then earlier start), each put back unless
  the pod no longer fits with it. No PodDisruptionBudgets: none is set on batch Jobs here.
- **One node** (``pickOneNodeForPreemption``), by the scheduler's criteria in order: the lowest
  highest-priority victim; the smallest sum of victim priorities (each offset by 2^31 + 1, so
  fewer victims weigh first); the fewest victims; the latest start among the highest-priority
  victims (the work that began last is evicted first); then the first node.
- **Simplified:** every node is a candidate (the scheduler dry-runs at least 100 nodes or 10% of
  them, from a random offset, and picks among those).

The resources are those the baseline's filters see: whole GPUs (the NVIDIA device plugin),
CPU and host memory, the GPU models the pod accepts, healthy GPUs in service. Where pods share
GPUs (``shared``: the ``kai-share`` baseline, KAI-Scheduler's GPU sharing), a GPU counts as
what its free compute and GPU memory come to once the victims have gone, as KAI's preemption
frees a share's fraction and memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fleetpilot.policy.state import MILLI, ClusterState, TaskRequest

PRIORITY_CLASS: dict[str, int] = {"vip": 1_000_000, "standard": 1_000, "best_effort": 0}
"""The value of each tier's PriorityClass (the order is what matters; the values are typical)."""
TERMINATION_GRACE_S = 30.0
"""A pod's default ``terminationGracePeriodSeconds``: the victims' time to stop before the
preemptor can start on what they held."""
NO_POD = np.iinfo(np.int64).max
"""``holder_priority`` of a GPU no pod holds (where pods share one, it is the lowest of theirs)."""
_PRIORITY_OFFSET = 2**31 + 1  # the scheduler's MaxInt32 + 1, which makes every priority count positive


@dataclass(frozen=True)
class RunningPod:
    """A running pod as preemption sees it: its priority, when it started, and what it holds."""

    pod_id: str
    priority: int
    started_s: float
    gpus: tuple[int, ...]
    cpu_milli: int
    memory_mb: int
    milli: int = MILLI  # of each of its GPUs (less: a share)
    gpu_memory_mb: int = 0  # held on each of its GPUs, where pods share them


@dataclass(frozen=True)
class Preemption:
    """Evict ``victims`` on node ``row``: the preemptor then fits there (and nowhere else)."""

    row: int
    victims: tuple[RunningPod, ...]


def usable_gpus(state: ClusterState, request: TaskRequest) -> np.ndarray:
    """``(N, G)``: the GPUs the pod's filters accept, free or not: existing, healthy, in
    service, of a model it accepts, allowed by their business rules, on a ready node."""
    ok = state.gpu_exists & state.gpu_healthy & ~state.gpu_maintenance & state.allowed(request)
    ok &= state.node_ready[:, None]
    if request.gpu_models:
        wanted = [state.model_index(m) for m in request.gpu_models]
        ok &= np.isin(state.node_model, wanted)[:, None]
    return ok


def preempt(state: ClusterState, request: TaskRequest, priority: int, holder_priority: np.ndarray,
            pods_on: Callable[[int], Sequence[RunningPod]], *, shared: bool = False) -> Preemption | None:
    """Where a pod of ``priority`` that fits nowhere gets in by evicting lower-priority pods,
    and which; ``None`` when no node would take it even with all of them gone.

    ``holder_priority`` is ``(N, G)``: the lowest priority of the pods holding each GPU
    (``NO_POD`` where none does); ``pods_on(row)`` the pods running on a node. ``shared``:
    pods hold shares of GPUs and GPU memory (``RunningPod.milli``, ``gpu_memory_mb``), and a
    GPU fits the pod when its free compute and GPU memory hold the request's."""
    gpu_task = request.gpus > 0 and request.gpu_milli > 0
    usable = usable_gpus(state, request)
    free = usable & (state.gpu_free >= (request.gpu_milli if shared else MILLI))
    if shared:
        free &= state.gpu_mem_free >= request.gpu_memory_mb
    # Nodes where the GPUs free, or held by lower-priority pods, are enough (CPU and host
    # memory are checked on each candidate below).
    rows = np.flatnonzero(((free | (usable & (holder_priority < priority))).sum(axis=1) >= request.gpus)
                          if gpu_task else state.node_ready)
    candidates = []
    for row in rows:
        lower = [p for p in pods_on(int(row)) if p.priority < priority]
        if not lower:
            continue
        chosen = _victims_on_node(state, request, int(row), free[row], usable[row], lower, gpu_task, shared)
        if chosen is not None:
            candidates.append(chosen)
    return min(candidates, key=_node_order) if candidates else None


def _victims_on_node(state: ClusterState, request: TaskRequest, row: int, free: np.ndarray, usable: np.ndarray,
                     lower: list[RunningPod], gpu_task: bool, shared: bool) -> Preemption | None:
    def fits_without(gone: Sequence[RunningPod]) -> bool:
        cpu = state.cpu_free[row] + sum(p.cpu_milli for p in gone)
        memory = state.mem_free[row] + sum(p.memory_mb for p in gone)
        if cpu < request.cpu_milli or memory < request.memory_mb:
            return False
        if not gpu_task:
            return True
        if shared:
            milli, gpu_memory = state.gpu_free[row].copy(), state.gpu_mem_free[row].copy()
            for p in gone:
                milli[list(p.gpus)] += p.milli
                gpu_memory[list(p.gpus)] += p.gpu_memory_mb
            freed = (milli >= request.gpu_milli) & (gpu_memory >= request.gpu_memory_mb)
            return int((freed & usable).sum()) >= request.gpus
        freed = free.copy()
        for p in gone:
            freed[list(p.gpus)] = True
        return int((freed & usable).sum()) >= request.gpus

    if not fits_without(lower):
        return None
    # Reprieve the most important first: higher priority, then the earlier start.
    victims = sorted(lower, key=lambda p: (-p.priority, p.started_s, p.pod_id))
    for pod in list(victims):
        rest = [p for p in victims if p is not pod]
        if fits_without(rest):
            victims = rest
    return Preemption(row=row, victims=tuple(victims)) if victims else None


def _node_order(candidate: Preemption) -> tuple[float, ...]:
    victims = candidate.victims
    top = max(p.priority for p in victims)
    # The latest of the earliest starts among the highest-priority victims wins.
    earliest_of_top = min(p.started_s for p in victims if p.priority == top)
    return (top, sum(p.priority + _PRIORITY_OFFSET for p in victims), len(victims), -earliest_of_top, candidate.row)
