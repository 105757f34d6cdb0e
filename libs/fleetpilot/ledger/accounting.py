"""Pure ledger arithmetic over ``NodeTopology`` and ``NodeLedger`` records."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from fleetpilot.contracts import Allocation, DecisionMade, NodeLedger, NodeTopology


@dataclass(frozen=True)
class FreeCapacity:
    """What is still free on one node: per-GPU milli and memory, CPU and host memory."""

    node: str
    gpu_milli: tuple[int, ...]
    gpu_memory_mb: tuple[int, ...]
    cpu_milli: int
    memory_mb: int


def free_capacity(node: NodeTopology, ledger: NodeLedger | None) -> FreeCapacity:
    """Subtract every hold in ``ledger`` from the node's capacity."""
    milli = [1000] * len(node.gpus)
    memory = [g.memory_mb for g in node.gpus]
    cpu, host_mem = node.cpu_milli, node.memory_mb
    for alloc in ledger.allocations if ledger else ():
        if 0 <= alloc.gpu < len(milli):
            milli[alloc.gpu] -= alloc.milli
            memory[alloc.gpu] -= alloc.memory_mb
        cpu -= alloc.cpu_milli
        host_mem -= alloc.host_memory_mb
    return FreeCapacity(node.node, tuple(milli), tuple(memory), cpu, host_mem)


def on_board(hold: Allocation, gpu: int, uuid: str = "") -> bool:
    """Whether ``hold`` is on the board ``uuid``, which reads at index ``gpu`` now (``""``:
    not known). By the board the hold names where both are known: indices renumber under
    running tasks, and by index a hot board's drain counted, and evicted, the tasks of the
    board that took its number. By index otherwise: a hold written before holds named their
    board (``Allocation.gpu_uuid``), or a board whose uuid NVML never read."""
    if hold.gpu_uuid and uuid:
        return hold.gpu_uuid == uuid
    return hold.gpu == gpu


def with_allocations(ledger: NodeLedger | None, node: str, allocations: list[Allocation]) -> NodeLedger:
    """A new ledger with ``allocations`` added (replacing the same task's earlier holds).

    Raises ``ValueError`` when ``allocations`` hold one GPU twice for one task: each hold is
    checked against the GPU's free share on its own (the policy's ``placement_fits``), so a
    placement naming GPU 0 twice at 800 milli passed as fitting and booked 1600 of its 1000."""
    seen: set[tuple[str, int]] = set()
    for a in allocations:
        if a.gpu >= 0 and (a.task_id, a.gpu) in seen:
            raise ValueError(f"{a.task_id} would hold GPU {a.gpu} of {node} twice ({a.decision_id})")
        seen.add((a.task_id, a.gpu))
    task_ids = {a.task_id for a in allocations}
    kept = [a for a in (ledger.allocations if ledger else []) if a.task_id not in task_ids]
    return NodeLedger(node=node, allocations=kept + list(allocations))


def without_task(ledger: NodeLedger, task_id: str) -> NodeLedger:
    """A new ledger without any hold of ``task_id``."""
    return NodeLedger(node=ledger.node, allocations=[a for a in ledger.allocations if a.task_id != task_id])


def confirmed(ledger: NodeLedger, task_id: str, decision_id: str) -> NodeLedger:
    """A new ledger where the holds ``decision_id`` reserved for ``task_id`` are marked
    confirmed by the executor; the task's other holds (a move's target, still to come) stay
    as they are."""
    return NodeLedger(node=ledger.node, allocations=[
        msgspec.structs.replace(a, state="confirmed") if a.task_id == task_id and a.decision_id == decision_id
        else a for a in ledger.allocations])


def moved_here(ledger: NodeLedger, task_id: str, decision_id: str) -> NodeLedger | None:
    """A new ledger after ``task_id`` moved onto this node by ``decision_id``: the holds that
    decision reserved become confirmed and the task's older holds here (a move within the
    node) are gone. ``None`` when the decision holds nothing reserved here: it was folded
    already (a redelivered move) and the task's other holds here belong to a later decision,
    which must keep them.

    A fold confirms the decision's holds, so a redelivery finds them confirmed. Taken as a
    move still to fold, it dropped every other hold of the task here: the extra memory a
    later resize had reserved, or the target of a later move within the node, which the
    executor then carried out on a share the ledger no longer held."""
    if not any(a.task_id == task_id and a.decision_id == decision_id and a.state == "reserved"
               for a in ledger.allocations):
        return None
    return NodeLedger(node=ledger.node, allocations=[
        msgspec.structs.replace(a, state="confirmed") if a.task_id == task_id else a
        for a in ledger.allocations if a.task_id != task_id or a.decision_id == decision_id])


def resized(ledger: NodeLedger, decision: DecisionMade) -> NodeLedger | None:
    """The ledger after an executed ``resize``: the policy reserved the extra memory as a
    second hold under the resize's decision id; it is folded into the task's hold on each GPU,
    which takes the decision's new ``memory_mb`` and is confirmed. ``None`` when there is
    nothing to change: no hold reserved under the decision is left (a redelivered resize,
    possibly after a later, larger one whose size must stay, or the task has gone)."""
    if not any(a.task_id == decision.task_id and a.decision_id == decision.decision_id
               for a in ledger.allocations):
        return None
    sizes = {p.gpu: p.memory_mb for p in decision.placement if p.gpu >= 0}
    kept = []
    for a in ledger.allocations:
        if a.task_id == decision.task_id and a.decision_id == decision.decision_id:
            continue  # the reserved extra, now part of the hold
        if a.task_id == decision.task_id and a.gpu in sizes:
            a = msgspec.structs.replace(a, memory_mb=sizes[a.gpu], state="confirmed")
        kept.append(a)
    return NodeLedger(node=ledger.node, allocations=kept)


def without_decision(ledger: NodeLedger, decision_id: str) -> NodeLedger | None:
    """The ledger without the holds reserved under ``decision_id`` (a failed resize gives its
    extra memory back, a failed move its target); ``None`` when it holds none."""
    kept = [a for a in ledger.allocations if a.decision_id != decision_id]
    return None if len(kept) == len(ledger.allocations) else NodeLedger(node=ledger.node, allocations=kept)
