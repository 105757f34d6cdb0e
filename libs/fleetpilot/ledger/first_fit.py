"""The simplest correct placement: the first node, in name order, where the task fits.

It is the policy service's last resort when no policy engine profile is configured, and
the reference that the tests of the ledger arithmetic use.
"""

from __future__ import annotations

from collections.abc import Mapping

from fleetpilot.contracts import NodeLedger, NodeTopology, Placement, TaskSubmitted

from .accounting import free_capacity


def fits_on(node: NodeTopology, ledger: NodeLedger | None, task: TaskSubmitted) -> list[Placement] | None:
    """The placement of ``task`` on ``node`` given its holds, or ``None`` if it does not fit."""
    if task.gpu_models and not any(g.model in task.gpu_models for g in node.gpus):
        return None
    free = free_capacity(node, ledger)
    if free.cpu_milli < task.cpu_milli or free.memory_mb < task.memory_mb:
        return None
    if task.gpus == 0:
        return [Placement(node=node.node, gpu=-1, milli=0)]
    allowed = [i for i, g in enumerate(node.gpus) if not task.gpu_models or g.model in task.gpu_models]
    if task.gpus == 1 and task.gpu_milli < 1000:
        for i in allowed:
            if free.gpu_milli[i] >= task.gpu_milli and free.gpu_memory_mb[i] >= task.gpu_memory_mb:
                return [Placement(node=node.node, gpu=i, milli=task.gpu_milli, memory_mb=task.gpu_memory_mb)]
        return None
    whole = [i for i in allowed if free.gpu_milli[i] >= 1000 and free.gpu_memory_mb[i] >= task.gpu_memory_mb]
    if len(whole) < task.gpus:
        return None
    return [Placement(node=node.node, gpu=i, milli=1000, memory_mb=task.gpu_memory_mb) for i in whole[: task.gpus]]


def first_fit(nodes: Mapping[str, NodeTopology], ledgers: Mapping[str, NodeLedger],
              task: TaskSubmitted) -> list[Placement] | None:
    """The first node (by name) where ``task`` fits."""
    for name in sorted(nodes):
        placement = fits_on(nodes[name], ledgers.get(name), task)
        if placement is not None:
            return placement
    return None
