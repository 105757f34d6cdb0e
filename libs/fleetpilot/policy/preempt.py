"""VIP preemption: which running ``best_effort`` tasks to evict so that a waiting ``vip`` task
fits, the ids of those evictions, and the pending entries that bring the evicted tasks back.

Pure functions over the topology, the ledger and the tiers; the service confirms the chosen
node with the routed policy, writes the pending entries and publishes the ``evict``
decisions.

**Who may preempt.** A task whose contract tier is ``vip`` and that waits in ``pending``
(it fits nowhere now). The SLA negotiator writes ``may_preempt`` into ``contract.notes`` when
the admission itself counted on preemption; we do not require that note: a ``vip`` admitted
on free capacity that someone else took before the policy placed it is just as entitled.
``standard`` and ``best_effort`` waiters never cause an eviction.

**Who may be evicted.** Only tasks whose tier is known to be ``best_effort`` (from the
``contracts`` bucket, else from the admissions this replica placed) and that run settled on
one node (every hold confirmed, one decision: see ``rebalance.running_tasks``). A task whose
tier is unknown is never evicted. An operator who puts vip queue-time SLAs before the mean
wait may let a vip that no best_effort work can make room for evict ``standard`` work too
(the policy service's ``vip_evicts_standard``, off by default): only a run that resumes from
its checkpoint and whose contract's deadline still holds after its checkpoint pause and a
whole queue-time SLA's wait behind the queue (``spares_an_eviction``).

**Cheapest set.** On each node, the set of victims whose removal lets the vip task fit
(``fits``: CPU, host memory, and ``gpus`` healthy GPUs of an accepted model with the milli
and GPU memory it asks) with the least lost work. A victim's cost is
``Σ milli/1000 × (age_s + restart_s)`` over its GPU holds: a task that does not resume from a
checkpoint throws away what it has run so far plus a restart. One that resumes
(``TaskSubmitted.resumable``) checkpoints on the executor's SIGTERM and is queued again with
its progress, so it loses its restart only: ``Σ milli/1000 × restart_s``. Between sets
that lose as much (resumable victims mostly do), the one that frees the most run still to do
wins, of as few victims (``Victim.left_s``): those hours go back to the queue behind the higher tiers, where a
run near its end would have released its GPU soon anyway, and evicting it frees nothing
later. Up to
``EXACT_LIMIT`` victims on a node every subset is tried (the optimum; a superset always
costs more, so no victim is superfluous); beyond that, a greedy choice by cost per freed
milli, then every victim that is not needed dropped again. The cheapest node wins.

**Ids.** A task's *generation* g counts its placements: ``<task>.assign`` is g = 1, the
re-placement after an eviction is ``<task>.assign.<g>``. The eviction of generation g is
``<task>.evict.<g>`` and its re-placement ``<task>.assign.<g+1>``, so a redelivered or
re-derived eviction has the same id on every replica, and the executor (whose journal keys
on the decision id) never mistakes the new assign for the old one.

**Confidence of an evict** = the probability that the vip task is then placed: each of the
``k`` evictions must be carried out (``EVICT_SUCCESS`` = 0.97 each, an assumption until the
feedback on evictions calibrates it) and the policy has already confirmed that the vip task
fits the freed node, so ``0.97^k``. It does not count the chance that a new admission takes
the freed space in the ``pending_retry_s`` before the vip retries (then it preempts again).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from fleetpilot.contracts import (
    TASK_LABEL_DRIVER,
    Allocation,
    NodeLedger,
    NodeTopology,
    TaskAdmitted,
    TaskSubmitted,
    gpu_rules,
    in_service,
)

from .rebalance import Running, generation

EXACT_LIMIT = 12
"""Up to this many best_effort tasks on a node, every subset of them is tried."""
EVICT_SUCCESS = 0.97
"""P(one eviction is carried out), until feedback on evictions says otherwise."""
RESTART_S = 60.0
"""Work an evicted task loses on top of its age: its start-up again."""


def evict_decision_id(task: Running) -> str:
    """``<task>.evict.<g>``: every replica derives the same id for the same eviction."""
    return f"{task.task_id}.evict.{generation(task.task_id, task.allocations[0].decision_id)}"


def reassign_decision_id(task: Running) -> str:
    """``<task>.assign.<g+1>``: the id of the evicted task's next placement."""
    return f"{task.task_id}.assign.{generation(task.task_id, task.allocations[0].decision_id) + 1}"


def assign_id(task_id: str, generation: int) -> str:
    """The assign of a task's ``generation``-th placement: ``<task>.assign`` for the first,
    ``<task>.assign.<g>`` after that."""
    return f"{task_id}.assign" if generation <= 1 else f"{task_id}.assign.{generation}"


@dataclass(frozen=True)
class Victim:
    """A running task a vip could evict (best_effort, or standard work its contract spares),
    and what that costs."""

    running: Running
    admitted: TaskAdmitted
    cost: float
    # The run it has left by its declared duration (0 when it declared none).
    left_s: float = 0.0

    @property
    def task_id(self) -> str:
        """The victim's task id."""
        return self.running.task_id

    @property
    def frees(self) -> float:
        """GPU-seconds of run its eviction sends back to the queue: ``Σ milli/1000 × left_s``."""
        return sum(a.milli / 1000.0 for a in self.running.allocations if a.gpu >= 0) * self.left_s


@dataclass(frozen=True)
class Preemption:
    """The victims on one node whose eviction lets the vip task fit there."""

    node: str
    victims: tuple[Victim, ...]

    @property
    def cost(self) -> float:
        """The work thrown away."""
        return sum(v.cost for v in self.victims)

    @property
    def rank(self) -> tuple[float, int, float]:
        """How it compares with another: the work thrown away (to the microsecond: sums of
        restarts tie), then the fewest victims, then the most run sent back to the queue
        (``Victim.frees``)."""
        return round(self.cost, 6), len(self.victims), -sum(v.frees for v in self.victims)


def eviction_cost(task: Running, at: float, restart_s: float = RESTART_S, *, resumes: bool = False) -> float:
    """``Σ milli/1000 × (age + restart_s)`` over the task's GPU holds, or for a task that
    ``resumes`` from its checkpoint ``Σ milli/1000 × restart_s`` (module docstring)."""
    return (
        sum(a.milli / 1000.0 * ((0.0 if resumes else max(0.0, at - a.at)) + restart_s)
            for a in task.allocations if a.gpu >= 0)
        or restart_s / 1000.0
    )


def spares_an_eviction(*, at: float, resumes: bool, left_s: float | None, pause_s: float,
                       deadline: float | None, max_queue_s: float | None) -> bool:
    """Whether a running ``standard`` task may be evicted for a vip at ``at`` without its
    contract being broken: it ``resumes`` from its checkpoint, and its ``deadline`` still holds
    after the run it has left by its declared duration (``left_s``), its checkpoint pause
    (``pause_s``) and a whole wait of its queue-time SLA (``max_queue_s``), which the queue
    keeps for it once it waits again. A run that starts over loses what it has done, and one
    with no deadline, no queue-time bound or no declared run gives nothing to check: neither is
    evicted."""
    if not resumes or deadline is None or max_queue_s is None or left_s is None:
        return False
    return at + left_s + pause_s + max_queue_s <= deadline


def fits(task: TaskSubmitted, topo: NodeTopology, allocations: Iterable[Allocation]) -> bool:
    """Whether ``task`` fits ``topo`` beside ``allocations`` the way the policies' resource
    filter sees it: CPU and host memory, then ``gpus`` healthy GPUs of an accepted model, each
    with the milli (all of it unless the task shares one GPU) and GPU memory it asks."""
    milli = {g.index: 1000 for g in topo.gpus}
    memory = {g.index: g.memory_mb for g in topo.gpus}
    cpu, host = topo.cpu_milli, topo.memory_mb
    for a in allocations:
        if a.gpu in milli:
            milli[a.gpu] -= a.milli
            memory[a.gpu] -= a.memory_mb
        cpu -= a.cpu_milli
        host -= a.host_memory_mb
    if cpu < task.cpu_milli or host < task.memory_mb:
        return False
    if task.gpus <= 0 or task.gpu_milli <= 0:
        return True
    need = task.gpu_milli if task.gpus == 1 and task.gpu_milli < 1000 else 1000
    models = set(task.gpu_models)
    usable = 0
    for g in topo.gpus:
        if models and g.model not in models:
            continue
        if not in_service(g.labels):
            continue
        if gpu_rules(g.labels).refusal(task.kind, task.labels.get(TASK_LABEL_DRIVER)) is not None:
            continue  # evicting work here would free a GPU the task may not use
        if milli[g.index] >= need and (task.gpu_memory_mb <= 0 or memory[g.index] >= task.gpu_memory_mb):
            usable += 1
    return usable >= task.gpus


def cheapest_on_node(
    task: TaskSubmitted, topo: NodeTopology, ledger: NodeLedger, victims: list[Victim]
) -> Preemption | None:
    """The cheapest set of ``victims`` (all on this node) whose eviction lets ``task`` fit."""
    if not victims:
        return None
    all_allocs = list(ledger.allocations)

    def fits_without(chosen: Iterable[Victim]) -> bool:
        gone = {v.task_id for v in chosen}
        return fits(task, topo, (a for a in all_allocs if a.task_id not in gone))

    if not fits_without(victims):
        return None  # even evicting every best_effort task here is not enough
    ordered = sorted(victims, key=lambda v: (v.cost, v.task_id))
    if len(ordered) <= EXACT_LIMIT:
        best: Preemption | None = None
        for size in range(1, len(ordered) + 1):
            for combo in itertools.combinations(ordered, size):
                plan = Preemption(topo.node, combo)
                if (best is None or plan.rank < best.rank) and fits_without(combo):
                    best = plan
        return best
    freed = {v.task_id: sum(a.milli for a in v.running.allocations if a.gpu >= 0) or 1 for v in ordered}
    chosen: list[Victim] = []
    for v in sorted(ordered, key=lambda v: (v.cost / freed[v.task_id], v.task_id)):
        chosen.append(v)
        if fits_without(chosen):
            break
    for v in sorted(chosen, key=lambda v: (-v.cost, v.task_id)):
        rest = [c for c in chosen if c is not v]
        if rest and fits_without(rest):
            chosen = rest
    return Preemption(topo.node, tuple(sorted(chosen, key=lambda v: v.task_id)))


def preemptions(
    task: TaskSubmitted,
    nodes: Mapping[str, NodeTopology],
    ledgers: Mapping[str, NodeLedger],
    victims: Iterable[Victim],
) -> list[Preemption]:
    """Per node, the cheapest preemption that lets ``task`` fit; cheapest first.

    ``nodes`` and ``ledgers`` are keyed alike (the KV keys); a victim belongs to the node its
    ``Running`` names.
    """
    by_node: dict[str, list[Victim]] = {}
    for v in victims:
        by_node.setdefault(v.running.node, []).append(v)
    topo_by_name = {t.node: (k, t) for k, t in nodes.items()}
    out = []
    for name, vs in by_node.items():
        if name not in topo_by_name:
            continue
        key, topo = topo_by_name[name]
        ledger = ledgers.get(key)
        if ledger is None:
            continue
        plan = cheapest_on_node(task, topo, ledger, vs)
        if plan is not None:
            out.append(plan)
    return sorted(out, key=lambda p: (*p.rank, p.node))


def evict_confidence(victims: int, success: float = EVICT_SUCCESS) -> float:
    """P(the vip task is placed after ``victims`` evictions) (module docstring)."""
    return success**victims


# ---- pending entries ------------------------------------------------------------------------


class Requeue(msgspec.Struct, frozen=True, kw_only=True):
    """Why an entry is in ``pending`` although it ran: evicted for ``for_task`` by
    ``evict_id`` (decided at ``at``); it is placed again as ``decision_id`` once its holds
    are released. A task the executor evicted on its own (a decommissioned GPU) has no evict
    id and no vip: ``evict_id`` and ``for_task`` are empty, ``reason`` says why."""

    decision_id: str
    evict_id: str = ""
    for_task: str = ""
    at: float = 0.0
    reason: str = ""
    bridge_floor_mb: int = 0
    """A bridge for it asks at least this per GPU: one checkpointed because it was about to
    outgrow the room it had would, on no more room, be stopped again at once, or (a step
    schedule comes back from its checkpoint where it was) die of OOM at its next step; one
    preempted or evicted by the executor asks what it held when stopped, on which it comes
    back. Nothing when its signature's restores have mostly started over."""
    avoid_node: str = ""
    """A node to place it elsewhere than, when another can take it: the one whose executor
    failed its last placement, or never took it (the node's executor down)."""
    progress_s: float = 0.0
    """How far its run had got when it was checkpointed (``rebalance.run_progress_s``), 0 when
    unknown or when it was stopped without a checkpoint: restored, it goes on from there, so
    its new holds say its run began that long before they were reserved
    (``Allocation.run_at``) and what is left of it orders the queue and counts its end (its
    program's envelope is not read for it: ``rebalance.envelope_progress_s``)."""

    oom_floor_mb: int = 0
    """What its request asks at least per GPU, placed again after an OOM killed it alone on
    its GPUs (``Evictions.oom_floor_mb``): more than they have and than it held. 0 for a
    task killed beside others, and for any other stop."""

    def run_began_at(self, restored_at: float) -> float:
        """When the run restored at ``restored_at`` began, as its new holds carry it
        (``Allocation.run_at``): ``progress_s`` before; 0 when its progress is unknown."""
        return restored_at - self.progress_s if self.progress_s > 0 else 0.0


def run_left_s(adm: TaskAdmitted, progress_s: float = 0.0) -> float | None:
    """What is left of an admitted task's declared run (``expected_duration_s``) once
    ``progress_s`` of it has run (a checkpoint's ``Requeue.progress_s``); ``None`` when it
    declared none."""
    declared = adm.task.expected_duration_s
    return max(declared - progress_s, 0.0) if declared else None


class NoRoom(msgspec.Struct, frozen=True, kw_only=True):
    """What kept a queued task off every node at its latest try (``at``): the policy's
    ``shortfall`` for its plain request (``PolicyDecision.shortfall``). Kept in its ``pending``
    entry, as ``requeue`` is, for whoever asks what it waits for (``fleetpilot queue``).

    ``like``: the task was not tried itself, because ``like``, which asks no more of anything
    and accepts every model it does (``backfill.Demand.cannot_fit_after``), found no node in
    the same round; ``shortfall`` is that task's, and every node it names lacks at least as
    much for this one."""

    shortfall: str
    at: float
    like: str = ""


class _Envelope(msgspec.Struct):
    requeue: Requeue | None = None
    no_room: NoRoom | None = None


_ENVELOPE = msgspec.json.Decoder(_Envelope)
_ADMITTED = msgspec.json.Decoder(TaskAdmitted)


def encode_pending(adm: TaskAdmitted, requeue: Requeue | None = None) -> bytes:
    """A ``pending`` value: the ``TaskAdmitted`` itself, plus a ``requeue`` field for an
    evicted task (readers that only know ``TaskAdmitted`` ignore it)."""
    raw = msgspec.json.encode(adm)
    if requeue is None:
        return raw
    doc = msgspec.json.decode(raw)
    doc["requeue"] = msgspec.to_builtins(requeue)
    return msgspec.json.encode(doc)


def decode_pending(raw: bytes) -> tuple[TaskAdmitted, Requeue | None]:
    """The admission in a ``pending`` value and its ``requeue`` note, if any."""
    return _ADMITTED.decode(raw), _ENVELOPE.decode(raw).requeue


def waiting_since(adm: TaskAdmitted, requeue: Requeue | None) -> float:
    """When a ``pending`` entry's task began its wait: its requeue (evicted, checkpointed or
    failed), else its admission."""
    return requeue.at if requeue is not None and requeue.at > 0 else adm.admitted_at


def with_no_room(raw: bytes, no_room: NoRoom) -> bytes:
    """The ``pending`` value ``raw`` (unclaimed) telling ``no_room`` instead of what it told
    before; the admission and its ``requeue`` note stay as they are. A refusal that says
    nothing (an empty ``shortfall``) leaves ``raw`` as it is."""
    if not no_room.shortfall:
        return raw
    doc = msgspec.json.decode(raw)
    doc["no_room"] = msgspec.to_builtins(no_room)
    return msgspec.json.encode(doc)


def no_room_of(raw: bytes) -> NoRoom | None:
    """What a ``pending`` value (unclaimed) says kept its task off every node, if it says."""
    return _ENVELOPE.decode(raw).no_room


CLAIM_PREFIX = b"claimed "


def claim_pending(raw: bytes, at: float) -> bytes:
    """The ``pending`` value of an entry a replica is placing now: the claim's time, then
    the entry as it was, so that the entry survives a replica that dies holding it."""
    return CLAIM_PREFIX + f"{at:.3f} ".encode() + raw


def claim_of(raw: bytes) -> tuple[float, bytes] | None:
    """``(when, the entry as it was)`` of a claimed ``pending`` value, ``None`` for an
    unclaimed one. A bare ``claimed`` (written by earlier versions) has no entry left."""
    if raw == CLAIM_PREFIX.strip():
        return 0.0, b""
    if not raw.startswith(CLAIM_PREFIX):
        return None
    at, _, entry = raw[len(CLAIM_PREFIX):].partition(b" ")
    try:
        return float(at), entry
    except ValueError:
        return 0.0, b""
