"""Replay and diff: run two policies over recorded (state, task) snapshots and compare.

Each snapshot is decided by policy A and by policy B on its own copy of the state, then each
decision is applied to a copy to measure its effect: the fleet's fragmentation afterwards
(FGD's measure when typical tasks are given, else the mean compute fragmentation index) and
the predicted OOM risk of the chosen GPUs. The report says how many decisions differ and how
(another action, another node, other GPUs on the same node) and the mean effect of B vs A.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import msgspec
import numpy as np

from .fragmentation import FragTable, TaskShape
from .framework import PolicyDecision
from .state import ClusterState, ClusterStateRecord, TaskRequest
from .transformers import compute_fragmentation, oom_risk

DiffKind = Literal["same", "action", "node", "gpus"]
PolicyFn = Callable[[ClusterState, TaskRequest], PolicyDecision]


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded decision input (JSON-able)."""

    state: ClusterStateRecord
    task: TaskRequest


def record(state: ClusterState, task: TaskRequest) -> Snapshot:
    """Capture a (state, task) pair for later replay (the state is copied)."""
    return Snapshot(state=state.to_record(), task=task)


class DecisionDiff(msgspec.Struct, frozen=True, kw_only=True):
    """A and B on one snapshot: how they differ and the effect of each."""

    task_id: str
    kind: DiffKind
    a: PolicyDecision
    b: PolicyDecision
    frag_a: float
    frag_b: float
    oom_a: float
    oom_b: float


class DiffReport(msgspec.Struct, frozen=True, kw_only=True):
    """Totals over a replay: counts by kind and mean effects (B minus A)."""

    total: int
    differing: int
    by_kind: dict[str, int]
    mean_frag_delta: float
    mean_oom_delta: float
    items: list[DecisionDiff]


def classify(a: PolicyDecision, b: PolicyDecision) -> DiffKind:
    """How two decisions on the same input differ."""
    if a.action != b.action:
        return "action"
    if a.action != "assign":
        return "same"
    if a.node_row != b.node_row:
        return "node"
    if sorted((p.gpu, p.milli) for p in a.placement) != sorted((p.gpu, p.milli) for p in b.placement):
        return "gpus"
    return "same"


def _effect(state: ClusterState, task: TaskRequest, d: PolicyDecision, table: FragTable | None) -> tuple[float, float]:
    after = state.copy()
    oom = 0.0
    if d.action == "assign" and d.node_row >= 0:
        gpus = [p.gpu for p in d.placement if p.gpu >= 0]
        milli = d.placement[0].milli if gpus else 0
        after.allocate(d.node_row, gpus, milli, cpu_milli=task.cpu_milli, memory_mb=task.memory_mb)
        if gpus:
            oom = float(oom_risk(state, task)[d.node_row, gpus].max())
    if table is not None:
        frag = float(table.node_frag(after).sum())
    else:  # the mean over no node is NaN; a fleet without nodes has nothing fragmented
        frag = float(compute_fragmentation(after).mean()) if after.n_nodes else 0.0
    return frag, oom


def replay(snapshots: Iterable[Snapshot | tuple[ClusterState, TaskRequest]], policy_a: PolicyFn, policy_b: PolicyFn,
           *, typical: Sequence[TaskShape] | None = None) -> DiffReport:
    """Decide every snapshot with A and B and report the differences and their effects."""
    items: list[DecisionDiff] = []
    table: FragTable | None = None
    layout: tuple[tuple[str, ...], int] | None = None
    for snap in snapshots:
        if isinstance(snap, Snapshot):
            state, task = ClusterState.from_record(snap.state), snap.task
        else:
            state, task = snap
        # The table is compiled against the fleet's model names and node width: kept for a
        # snapshot of other models (or wider nodes), it measured it as the one before.
        if typical and layout != (tuple(state.models), state.max_gpus):
            table = FragTable(typical, state.models, state.max_gpus)
            layout = (tuple(state.models), state.max_gpus)
        a = policy_a(state.copy(), task)
        b = policy_b(state.copy(), task)
        fa, oa = _effect(state, task, a, table)
        fb, ob = _effect(state, task, b, table)
        items.append(DecisionDiff(task_id=task.task_id, kind=classify(a, b), a=a, b=b,
                                  frag_a=fa, frag_b=fb, oom_a=oa, oom_b=ob))
    kinds = Counter(i.kind for i in items)
    n = len(items)
    return DiffReport(
        total=n,
        differing=n - kinds.get("same", 0),
        by_kind={k: kinds.get(k, 0) for k in ("same", "action", "node", "gpus")},
        mean_frag_delta=float(np.mean([i.frag_b - i.frag_a for i in items])) if n else 0.0,
        mean_oom_delta=float(np.mean([i.oom_b - i.oom_a for i in items])) if n else 0.0,
        items=items,
    )
