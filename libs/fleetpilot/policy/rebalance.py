"""Which running tasks should move, and how sure we are that moving them pays off.

Pure functions over the ledger, the topology labels and the fingerprints; the service
chooses the target with the active policy and reserves it with compare-and-set.

A task is worth migrating when staying put is likely to end badly:

* one of its GPUs is labelled ``decommissioned`` (it goes away: probability 1) or
  ``maintenance_pending`` (probability = the label ``maintenance_risk`` the executor wrote
  with it, else ``MAINTENANCE_DEFAULT_RISK``);
* its fingerprint predicts an OOM where it is: ``P(peak > memory it can have on its GPU)``,
  the peak modelled as normal(predicted, spread) like the library's ``oom_risk``, at least
  ``oom_threshold``.

**Confidence of a ``migrate``** (the issue's goal: latency improves by more than 15% and no
OOM follows) is ``P(staying fails) × confidence of the target placement``. We have no model
that predicts a latency gain on a healthy GPU, so we never propose a move for latency alone;
when staying ends in an OOM kill or an eviction, the task's completion time grows far more
than 15% (it restarts), so a move improves it with the probability that staying would have
failed. The target's confidence is the active policy's own estimate that the placement
succeeds without OOM (for ``fleetpilot``: success prior × (1 − P(OOM on the target)) × ...).
Feedback on migrations will show how well this is calibrated; nothing here is fitted.

**Resize before migrate.** A task whose fingerprint predicts a peak above the GPU memory it
holds (``P(peak > hold) ≥ threshold``) but whose GPUs are not going away gets a ``resize``
when every one of its GPUs has the difference free in the ledger: the hold grows to
``target = max(peak, peak_high) + margin`` (the fingerprint's 90% upper bound plus a
margin). That costs a ledger write instead of a restart elsewhere, so it is preferred; only
without that room does the OOM rule above move the task. **Confidence of a ``resize``**
(goal: no OOM follows) is ``P(peak ≤ target)`` under the same normal model.

**Bridges and moving down.** A run may hold less than its peak: started on less (a bridge),
or moved down to a smaller GPU to make room for a blocked task (``move_down_ask``,
``models_below``). Such a run is watched by its program's envelope when its progress is known
and it was not restored from a checkpoint (``envelope_progress_s``: its holds carry when its
run began across moves and restores, ``run_progress_s``) and by its measured rate
(``bridge_watches``), and moved up or checkpointed when they say it outgrows its GPU
(``bridge_overflow``, ``waits_for_its_envelope``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fleetpilot.contracts import (
    GPU_LABEL_CORDONED,
    GPU_LABEL_DECOMMISSIONED,
    GPU_LABEL_MAINTENANCE_PENDING,
    GPU_LABEL_MAINTENANCE_RISK,
    GPU_LABEL_NOT_READY,
    GPU_LABEL_UNREACHABLE,
    Allocation,
    Fingerprint,
    NodeLedger,
    NodeTopology,
    Placement,
    in_service,
    marked_condition,
)
from fleetpilot.fingerprint import envelope_at
from fleetpilot.ledger import free_capacity

from .state import TaskRequest, peak_sigma_mb

# The operational labels, as the contracts name them.
CORDONED = GPU_LABEL_CORDONED
DECOMMISSIONED = GPU_LABEL_DECOMMISSIONED
MAINTENANCE_PENDING = GPU_LABEL_MAINTENANCE_PENDING
MAINTENANCE_RISK = GPU_LABEL_MAINTENANCE_RISK
NOT_READY = GPU_LABEL_NOT_READY
UNREACHABLE = GPU_LABEL_UNREACHABLE
MAINTENANCE_DEFAULT_RISK = 0.9
"""P(a GPU labelled maintenance_pending is taken out) when the label carries no risk."""
OVERFLOW_FILL = 0.98
"""A task's growth overflows its GPU when it would fill more than this share of its room:
the CUDA allocator fails before the last megabyte."""
GROWTH_LOOKAHEAD_S = 240.0
"""How far measured growth is carried ahead to judge an overflow: long enough to checkpoint
or move a task before it gets there (the policy service's default, the fleet benchmark's)."""
SMOOTH_GROWTH = frozenset({"linear", "leak"})
"""Patterns whose memory rises smoothly: a task bridged onto less than its peak is moved up by
its measured rate (``growth_overflow``); any other pattern only by its envelope."""
MIN_BRIDGE_STAY_S = 900.0
"""A run whose signature's envelope lets it hold less than its peak for at least this long
(a step schedule before the step that outgrows a GPU) may start on a GPU that holds that
much (``envelope_bridge_mb``): a quarter hour of progress is worth a checkpoint pause (30 s
+ 2 s per GB held) several times over."""

_MIGRATE_ID = re.compile(r"\.migrate\.(\d+)$")
_GENERATION = re.compile(r"\.assign\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Running:
    """One task's holds on one node, as the ledger has them."""

    task_id: str
    node: str
    allocations: tuple[Allocation, ...]

    @property
    def gpus(self) -> list[int]:
        """The GPU indices it holds."""
        return sorted({a.gpu for a in self.allocations if a.gpu >= 0})

    def placements(self) -> list[Placement]:
        """Its holds as a decision's placements: the ``source`` of a move, an eviction or a
        resize."""
        return [Placement(node=self.node, gpu=a.gpu, milli=a.milli, memory_mb=a.memory_mb) for a in self.allocations]


@dataclass(frozen=True)
class MoveReason:
    """Why a task should move and the probability that staying put fails."""

    p_stay_fails: float
    why: str


def is_set(labels: Mapping[str, str], label: str) -> bool:
    """Labels are strings; only ``"true"`` counts (an operator clears one with ``"false"``)."""
    return labels.get(label, "").lower() == "true"


def gpu_conditions(nodes: Iterable[NodeTopology]) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(unhealthy, maintenance) GPU lists from the topology labels.

    ``cordoned``, ``decommissioned``, ``not_ready`` and ``unreachable`` GPUs are unhealthy:
    no new work, and their tasks stay (those of an unreachable node are given up by the
    executor, not moved: there is nobody there to checkpoint them; a node not ready may be
    back in a minute). A ``maintenance_pending`` GPU takes no new work either, and its tasks
    are moved away.
    """
    unhealthy, maintenance = [], []
    for topo in nodes:
        for gpu in topo.gpus:
            if any(is_set(gpu.labels, label) for label in (CORDONED, DECOMMISSIONED, NOT_READY, UNREACHABLE)):
                unhealthy.append((topo.node, gpu.index))
            if is_set(gpu.labels, MAINTENANCE_PENDING):
                maintenance.append((topo.node, gpu.index))
    return unhealthy, maintenance


def nodes_out_of_service(nodes: Iterable[NodeTopology]) -> list[str]:
    """The nodes out of service as a whole: the topology service labels a node, and every GPU
    of it, ``not_ready`` (its collector silent, its executor down) or ``unreachable``. They
    take no task at all, one that asks no GPU included (``ClusterState.node_ready``); a node
    without GPUs carries the label on itself only."""
    return [topo.node for topo in nodes if marked_condition(topo)]


def running_tasks(ledgers: Iterable[NodeLedger]) -> list[Running]:
    """Tasks that run settled on one node: every hold confirmed by the executor.

    A task with holds on two nodes, or two decisions on one, is mid-migration; a task with
    reserved holds has not started. Neither is moved again until the executor settles it.
    """
    by_task: dict[str, list[tuple[str, Allocation]]] = {}
    for ledger in ledgers:
        for a in ledger.allocations:
            by_task.setdefault(a.task_id, []).append((ledger.node, a))
    out = []
    for task_id, holds in sorted(by_task.items()):
        nodes = {n for n, _ in holds}
        decisions = {a.decision_id for _, a in holds}
        if len(nodes) == 1 and len(decisions) == 1 and all(a.state == "confirmed" for _, a in holds):
            out.append(Running(task_id=task_id, node=holds[0][0], allocations=tuple(a for _, a in holds)))
    return out


def normal_tail(peak_mb: float, sigma_mb: float, available_mb: float) -> float:
    """``P(X > available)`` for X ~ normal(peak, sigma)."""
    sigma = max(sigma_mb, 1.0)
    return 0.5 * math.erfc((available_mb - peak_mb) / (sigma * math.sqrt(2.0)))


def room_in_place(task: Running, topo: NodeTopology, ledger: NodeLedger) -> dict[int, int]:
    """Per GPU of the task, the memory it can have there: the GPU's memory minus what the
    other tasks on it hold."""
    memory = {g.index: g.memory_mb for g in topo.gpus}
    return {gpu: memory.get(gpu, 0) - sum(a.memory_mb for a in ledger.allocations
                                          if a.gpu == gpu and a.task_id != task.task_id)
            for gpu in task.gpus}


def most_room_mb(nodes: Iterable[NodeTopology], models: Sequence[str]) -> int:
    """The most memory one in-service GPU of ``models`` (of any model, for none) has in
    ``nodes``: more room than that no placement can give a task that accepts them."""
    wanted = set(models)
    return max((g.memory_mb for topo in nodes for g in topo.gpus
                if (not wanted or g.model in wanted) and in_service(g.labels)), default=0)


def oom_risk_in_place(task: Running, topo: NodeTopology, ledger: NodeLedger, fp: Fingerprint) -> float:
    """P(the task's peak exceeds the memory it can have on its GPUs, ``room_in_place``),
    worst GPU."""
    sigma = peak_sigma_mb(fp)
    rooms = [room for room in room_in_place(task, topo, ledger).values() if room > 0]
    return max((normal_tail(fp.predicted_peak_mb, sigma, room) for room in rooms), default=0.0)


def move_reason(
    task: Running, topo: NodeTopology, ledger: NodeLedger, fp: Fingerprint | None, oom_threshold: float
) -> MoveReason | None:
    """Why ``task`` should move, or ``None`` when staying is fine (module docstring)."""
    stays_ok, why = 1.0, []
    labels = {g.index: g.labels for g in topo.gpus}
    for gpu in task.gpus:
        lab = labels.get(gpu, {})
        if is_set(lab, DECOMMISSIONED):
            stays_ok, why = 0.0, [*why, f"GPU {gpu} decommissioned"]
        elif is_set(lab, MAINTENANCE_PENDING):
            try:
                risk = float(lab.get(MAINTENANCE_RISK, MAINTENANCE_DEFAULT_RISK))
            except ValueError:
                risk = MAINTENANCE_DEFAULT_RISK
            if not math.isfinite(risk):  # "nan" parses, and went on into a migrate's confidence
                risk = MAINTENANCE_DEFAULT_RISK
            risk = min(max(risk, 0.0), 1.0)
            stays_ok *= 1.0 - risk
            why.append(f"GPU {gpu} pending maintenance (risk {risk:.2f})")
    if fp is not None and fp.predicted_peak_mb > 0:
        risk = oom_risk_in_place(task, topo, ledger, fp)
        if risk >= oom_threshold:
            stays_ok *= 1.0 - risk
            why.append(f"predicted OOM in place ({risk:.2f}: peak {fp.predicted_peak_mb:.0f} MB)")
    if not why:
        return None
    return MoveReason(p_stay_fails=1.0 - stays_ok, why="; ".join(why))


def is_first_placement(task: Running) -> bool:
    """Whether the task runs under its first placement, as first placed: every hold is
    ``<task>.assign`` (not a re-placement after a stop, nor a move or a resize of one), so
    the run began when the hold was reserved or later."""
    first = f"{task.task_id}.assign"  # ``preempt.assign_id`` of the first generation
    return all(a.decision_id == first for a in task.allocations)


def generation(task_id: str, decision_id: str) -> int:
    """Which placement of the task a hold belongs to: ``<task>.assign`` (and what derives
    from it) is 1, ``<task>.assign.<g>`` (a re-placement after an eviction) is g."""
    rest = decision_id[len(task_id) :] if decision_id.startswith(task_id) else decision_id
    m = _GENERATION.match(rest)
    return int(m.group(1)) if m else 1


def lineage(task_id: str, decision_id: str) -> str:
    """The prefix of the ids derived from a hold: the task id for its first placement,
    ``<task>.assign.<g>`` for a later one, so that a later generation never repeats an id
    the executor's journal already holds."""
    g = generation(task_id, decision_id)
    return task_id if g == 1 else f"{task_id}.assign.{g}"


def migrate_decision_id(task: Running, tried: int = 0) -> str:
    """``<task>.migrate.<n>``: n counts this task's migrations, read from its current hold's
    decision id, so every replica derives the same id for the same move (after an eviction
    and re-placement: ``<task>.assign.<g>.migrate.<n>``). ``tried`` skips that many ids the
    executor has already taken from this hold: moves that failed, whose ids the stream's
    duplicate window and the executor's journal would drop."""
    current = task.allocations[0].decision_id
    m = _MIGRATE_ID.search(current)
    return f"{lineage(task.task_id, current)}.migrate.{(int(m.group(1)) + 1 if m else 1) + tried}"


@dataclass(frozen=True)
class ResizePlan:
    """Grow a task's hold on each of its GPUs to ``memory_mb`` (``extra`` more per GPU)."""

    memory_mb: int
    extra: dict[int, int]
    p_over_hold: float
    confidence: float
    why: str


def gpus_going_away(task: Running, topo: NodeTopology) -> bool:
    """Whether any of the task's GPUs is cordoned, decommissioned or pending maintenance."""
    labels = {g.index: g.labels for g in topo.gpus}
    return any(
        is_set(labels.get(gpu, {}), label)
        for gpu in task.gpus
        for label in (CORDONED, DECOMMISSIONED, MAINTENANCE_PENDING)
    )


OOM_MIGRATE_RISK = 0.5
"""P(a run's peak passes what it holds, or what it can have in place) from which its hold
grows (``resize_target_mb``) or it is moved: the policy service's ``oom_migrate_risk``."""

RESIZE_MARGIN_MB = 512.0
"""Head room a grown hold keeps above the top of its peak's interval: the policy service's
``resize_margin_mb``."""

MAX_MIGRATIONS_PER_ROUND = 10
"""Decisions a rebalance round makes at most (resizes, moves, checkpoints): the policy
service's ``max_migrations_per_round``."""


def resize_target_mb(fp: Fingerprint | None, held_mb: float, threshold: float = OOM_MIGRATE_RISK,
                     margin_mb: float = RESIZE_MARGIN_MB) -> int | None:
    """What a running task's hold of ``held_mb`` per GPU grows to when its fingerprint says
    its peak passes it with probability ``threshold`` or more: the top of the peak's interval
    (at least the peak) plus ``margin_mb``; ``None`` when it need not grow. A hold never
    shrinks here: a prediction that falls leaves it as it is."""
    if fp is None or fp.predicted_peak_mb <= 0:
        return None
    if normal_tail(fp.predicted_peak_mb, peak_sigma_mb(fp), held_mb) < threshold:
        return None
    target = int(math.ceil(max(fp.predicted_peak_mb, fp.peak_high_mb) + margin_mb))
    return target if target > held_mb else None


def resize_plan(
    task: Running,
    topo: NodeTopology,
    ledger: NodeLedger,
    fp: Fingerprint | None,
    threshold: float,
    margin_mb: float,
) -> ResizePlan | None:
    """A resize when the fingerprint's peak is above the hold (``resize_target_mb``) and every
    GPU of the task has room for the difference (module docstring); ``None`` otherwise."""
    if fp is None or fp.predicted_peak_mb <= 0 or not task.gpus or gpus_going_away(task, topo):
        return None
    sigma = peak_sigma_mb(fp)
    holds = {a.gpu: a.memory_mb for a in task.allocations if a.gpu >= 0}
    p_over = max(normal_tail(fp.predicted_peak_mb, sigma, mb) for mb in holds.values())
    target = resize_target_mb(fp, min(holds.values()), threshold, margin_mb)
    if target is None:
        return None
    extra = {gpu: target - mb for gpu, mb in holds.items() if target > mb}
    free = free_capacity(topo, ledger).gpu_memory_mb
    if any(gpu >= len(free) or free[gpu] < more for gpu, more in extra.items()):
        return None
    return ResizePlan(
        memory_mb=target,
        extra=extra,
        p_over_hold=p_over,
        confidence=1.0 - normal_tail(fp.predicted_peak_mb, sigma, target),
        why=(
            f"predicted peak {fp.predicted_peak_mb:.0f} MB (+2 sd up to {fp.peak_high_mb:.0f} MB) above the "
            f"{min(holds.values())} MB held (P {p_over:.2f}); the GPU has room: hold grows to {target} MB"
        ),
    )


def resize_decision_id(task: Running, memory_mb: int) -> str:
    """``<task>.resize.<memory_mb>``: a hold only ever grows within one generation (a move
    keeps its size), so the new size names the resize uniquely and every replica agrees."""
    return f"{lineage(task.task_id, task.allocations[0].decision_id)}.resize.{memory_mb}"


def envelope_level_mb(fp: Fingerprint, at_s: float, declared_s: float) -> float:
    """What a run of ``fp``'s program is expected to hold per GPU by ``at_s`` seconds into a run
    declared at ``declared_s``: its envelope there (``envelope_at``), and where the envelope
    has reached its top, the predicted peak when that is higher. The envelope says when a
    program reaches its peak; the peak says how high: a run that died of an OOM (its floor is
    folded into the predicted peak), or one still growing past the runs the envelope was learnt
    from, shows the program can go higher than every run it holds. Read alone, the envelope let
    a program whose peak straddles a GPU run on it to its last step, and die there. The phases
    before the top are read as they were seen: lifting them too held back bridges that the
    watch on the top keeps safe (measured on the 46 fleet-benchmark runs)."""
    level = envelope_at(fp.envelope_mb, at_s, declared_s)
    top = float(fp.envelope_mb[-1]) if fp.envelope_mb else 0.0
    if top > 0.0 and level >= top:
        level = max(level, float(fp.predicted_peak_mb))
    return level


def envelope_stay_mb(fp: Fingerprint | None, declared_s: float | None, progress_s: float, lookahead_s: float) -> int:
    """What a run ``progress_s`` into its declared run must have per GPU to stay where it is for
    ``MIN_BRIDGE_STAY_S`` (and ``lookahead_s``), by its signature's envelope, its top lifted to
    its predicted peak (``envelope_level_mb``), whatever pattern its fingerprint names; 0 when the
    envelope or the declared duration is unknown."""
    if fp is None or not fp.envelope_mb or not declared_s:
        return 0
    need = envelope_level_mb(fp, progress_s + MIN_BRIDGE_STAY_S + lookahead_s, declared_s)
    return math.ceil(need / OVERFLOW_FILL)


def envelope_bridge_mb(fp: Fingerprint | None, declared_s: float | None, lookahead_s: float) -> int:
    """What a run from its start must have per GPU to stay ``MIN_BRIDGE_STAY_S`` (and
    ``lookahead_s``) where it starts, by its signature's envelope (``envelope_stay_mb``): for a
    program that does not grow smoothly (smooth growth is bridged on its measured rate), whose
    envelope and declared duration are known; 0 otherwise."""
    if fp is None or fp.pattern in SMOOTH_GROWTH:
        return 0
    return envelope_stay_mb(fp, declared_s, 0.0, lookahead_s)


def placed_at(task: Running) -> float:
    """When a running task was placed where it runs now: when its holds there were reserved."""
    return min(a.at for a in task.allocations)


def run_began_at(task: Running) -> float:
    """When the run a running task carries began: its first placement's hold (reserved as the
    run started, or just before), else what its holds carry (``Allocation.run_at``, written by
    its moves and, for a run restored from a checkpoint, by its restore); 0 when unknown."""
    if is_first_placement(task):
        return placed_at(task)
    return min((a.run_at for a in task.allocations if a.run_at > 0), default=0.0)


def run_counted_from(task: Running) -> float:
    """When a running task's declared duration is counted from, to tell when it ends: when its
    run began (``run_began_at``), else when its holds were reserved."""
    return run_began_at(task) or placed_at(task)


def run_progress_s(task: Running, at: float) -> float | None:
    """How far into its run a running task is at ``at`` (``run_began_at``), ``None`` when
    unknown. Overstated by the checkpoint pauses of its moves and by a reservation made before
    the start: the envelope only grows, so reading it there errs early."""
    began = run_began_at(task)
    return at - began if began > 0 else None


def envelope_progress_s(task: Running, at: float) -> float | None:
    """Where a running task's program envelope is read (``run_progress_s``): only for a run of
    its first placement and its moves. A run restored from a checkpoint is not read by it, though
    its progress is known: it came back where it stood, on at least the room it outgrew
    (``restores.bridge_floor_mb``), and the envelope (the most any run held by then) would
    checkpoint it again before steps it mostly survives. Measured on the fleet benchmark's 46
    workloads, reading it there took the mean-queue target from 36 met to 31."""
    if any(generation(task.task_id, a.decision_id) > 1 for a in task.allocations):
        return None
    return run_progress_s(task, at)


MOVE_DOWN_LEFT_S = 1800.0
"""A tenant is moved down to make room for a waiter (``move_down_ask``) only with at least
this much of its declared run left: the move costs a checkpoint pause now and, when its
envelope steps past the smaller GPU, a move up or a checkpoint later; a run near its end
frees its GPU soon enough on its own."""


MOVE_DOWN_TRIES = 8
"""How many tenants, smallest ask first, the policy is asked to find a target for before a
waiter is left for the next round: each is a decision over the whole fleet."""


def move_down_ask(fp: Fingerprint | None, declared_s: float | None, progress_s: float | None,
                  lookahead_s: float) -> int:
    """What a running task must have per GPU to be moved down, onto a GPU model a blocked task
    does not need, and stay there ``MIN_BRIDGE_STAY_S`` by its envelope (``envelope_stay_mb`` at
    its progress); 0 when it may not be: its progress, envelope or declared duration unknown,
    or less than ``MOVE_DOWN_LEFT_S`` of its declared run left."""
    if progress_s is None or not declared_s or declared_s - progress_s < MOVE_DOWN_LEFT_S:
        return 0
    return envelope_stay_mb(fp, declared_s, progress_s, lookahead_s)


def could_take(need: TaskRequest, model: str, memory_mb: int, site: str = "", sites: Sequence[str] = ()) -> bool:
    """Whether a waiter asking ``need`` could take a GPU of ``model`` with ``memory_mb`` at
    ``site`` once its tenant leaves it: a model it accepts (any when it names none), room for
    what it asks, at a site its contract binds it to (``sites``; any when empty). A tenant
    moved down or checkpointed at a site the waiter may not run at made it no room."""
    return ((not need.gpu_models or model in need.gpu_models) and memory_mb >= need.gpu_memory_mb
            and (not sites or site in sites))


def models_below(tenant_models: Sequence[str], tenant_ask_mb: int, waiter_models: Sequence[str],
                 waiter_ask_mb: int, model_memory: Mapping[str, int]) -> tuple[str, ...]:
    """The GPU models a tenant may be moved down to for a waiter: those it accepts (any when it
    names none) whose GPUs hold its ask, and that the waiter cannot take (a model it does not
    accept, or whose GPUs do not hold its ask). ``model_memory`` is the largest GPU of each
    model. Moving a tenant onto a GPU the waiter could have taken makes it no room."""
    if tenant_ask_mb <= 0:
        return ()
    accepted = tenant_models or sorted(model_memory)
    return tuple(m for m in accepted
                 if model_memory.get(m, 0) >= tenant_ask_mb
                 and ((waiter_models and m not in waiter_models) or model_memory.get(m, 0) < waiter_ask_mb))


def envelope_overflow(task: Running, topo: NodeTopology, ledger: NodeLedger, fp: Fingerprint | None,
                      progress_s: float, declared_s: float | None, lookahead_s: float) -> str | None:
    """Why a bridged run from its start must be checkpointed now, or ``None``: what its
    signature's envelope (its top lifted to its predicted peak, ``envelope_level_mb``) says
    it holds ``lookahead_s`` past ``progress_s`` into its declared run would fill more than
    ``OVERFLOW_FILL`` of what it can have on one of its GPUs (``room_in_place``). A step is a
    jump that no measured rate announces; the envelope of the program's earlier runs does. It
    is read whatever pattern the fingerprint names: a schedule of three to five steps can be
    voted a line, and a run bridged by its rate is then watched by both (``bridge_overflow``).
    ``progress_s`` may be overstated (the time since its hold was reserved): the envelope only
    grows, so that errs early."""
    if fp is None or not fp.envelope_mb or not declared_s or not task.gpus:
        return None
    ahead = envelope_level_mb(fp, progress_s + lookahead_s, declared_s)
    for gpu, room in room_in_place(task, topo, ledger).items():
        if ahead > OVERFLOW_FILL * room:
            return (f"its program holds up to {ahead:.0f} MB per GPU by {(progress_s + lookahead_s) / 60:.0f} min "
                    f"into its run (the envelope of its earlier runs): more than the {room} MB it can have on "
                    f"GPU {gpu}")
    return None


def bridge_watches(fp: Fingerprint | None, progress_known: bool) -> tuple[bool, bool]:
    """``(by its envelope, by its rate)``: what watches a bridged run. A run whose progress is
    known (from its start) and whose signature has an envelope is watched by the envelope,
    whatever pattern its fingerprint names; by its measured rate too only when that pattern is
    smooth (``SMOOTH_GROWTH``: a step's jump would read as a steep climb). Any other run is
    watched by its rate alone. The policy service (``bridge_overflow``) and the fleet
    benchmark apply this one rule."""
    by_envelope = progress_known and fp is not None and bool(fp.envelope_mb)
    return by_envelope, not by_envelope or (fp is not None and fp.pattern in SMOOTH_GROWTH)


def bridge_overflow(
    task: Running, topo: NodeTopology, ledger: NodeLedger, fp: Fingerprint | None,
    samples: Sequence[tuple[float, float]], progress_s: float | None, declared_s: float | None, lookahead_s: float,
) -> str | None:
    """Why a task that may be running on less than its peak (a bridge) must be checkpointed
    now, or ``None``: by its envelope (``envelope_overflow``), its measured rate
    (``growth_overflow``) or both, as ``bridge_watches`` says for a run whose progress is known
    (``progress_s``, from its start) or not.

    Both, because the fingerprinter's vote can name a line for a schedule of three to five
    steps: watched by its rate alone, such a run sat flat on a 32 GB GPU between its steps
    and died at the next one (on one benchmark workload, 327 of Fleetpilot's 444 OOM events)."""
    by_envelope, by_rate = bridge_watches(fp, progress_s is not None and bool(declared_s))
    if by_envelope and progress_s is not None:
        why = envelope_overflow(task, topo, ledger, fp, progress_s, declared_s, lookahead_s)
        if why is not None or not by_rate:
            return why
    return growth_overflow(task, topo, ledger, samples, lookahead_s)


def waits_for_its_envelope(
    task: Running, topo: NodeTopology, ledger: NodeLedger, fp: Fingerprint | None,
    samples: Sequence[tuple[float, float]], progress_s: float | None, declared_s: float | None, lookahead_s: float,
) -> bool:
    """Whether a run that holds less than its predicted peak (a bridge: started on less, or
    moved down for a waiter) stays where it is although its peak would not fit there: it is
    watched by its envelope (``bridge_watches``) and nothing watching it says it outgrows its
    GPUs soon (``bridge_overflow``). It moves up when they say so, not as soon as some GPU holds
    its peak: a run moved down made room for a waiter, and an eager move up would take that
    room back, for a checkpoint pause, while the envelope still says it fits where it is."""
    held = max((a.memory_mb for a in task.allocations if a.gpu >= 0), default=0)
    if fp is None or held >= fp.predicted_peak_mb:
        return False
    if not bridge_watches(fp, progress_s is not None and bool(declared_s))[0]:
        return False
    return bridge_overflow(task, topo, ledger, fp, samples, progress_s, declared_s, lookahead_s) is None


def climbs_within_its_gpu(task: Running, topo: NodeTopology, ledger: NodeLedger, fp: Fingerprint | None,
                          samples: Sequence[tuple[float, float]], lookahead_s: float) -> bool:
    """Whether a run whose fingerprint names a steady climb (``linear``) stays where it is
    although its predicted peak would not fit there: its measured rate, carried
    ``lookahead_s`` ahead, still fits (``growth_overflow``), so it is moved when it nears the
    edge, on more of its series. A line fitted to the first minutes of a long run cannot tell
    a warm-up ramp from a climb: carried to the end of the run, a ramp that levels off at
    4 GB read as a 57 GB peak, and a rebalance moved the run for an OOM that never came (seen
    on 20 of 24 shared inference runs). For a true line the measured rate is the prediction,
    so nothing is lost by waiting. Not for an accelerating leak, which outruns its average
    rate, nor a step, which no rate announces. Fewer than two samples watch nothing: moved
    on its prediction."""
    if fp is None or fp.pattern != "linear" or len(samples) < 2:
        return False
    return growth_overflow(task, topo, ledger, samples, lookahead_s) is None


def measured_rate_mb_per_s(samples: Sequence[tuple[float, float]]) -> float | None:
    """How fast a run's memory grows by its ``(time, MB)`` samples: the slope from the first
    to the last, never below 0; ``None`` for fewer than two samples or none apart in time."""
    if len(samples) < 2:
        return None
    (t0, m0), (t1, m1) = samples[0], samples[-1]
    return max((m1 - m0) / (t1 - t0), 0.0) if t1 > t0 else None


def growth_overflow(
    task: Running, topo: NodeTopology, ledger: NodeLedger, samples: Sequence[tuple[float, float]], lookahead_s: float
) -> str | None:
    """Why ``task`` must be checkpointed now, or ``None``: its measured growth
    (``measured_rate_mb_per_s`` of ``samples``, ``(time, MB used over all its GPUs)``), carried
    ``lookahead_s`` ahead, would fill more than ``OVERFLOW_FILL`` of what it can have on one of
    its GPUs (``room_in_place``). Fewer than two samples say nothing."""
    rate = measured_rate_mb_per_s(samples)
    if rate is None or not task.gpus:
        return None
    n = len(task.gpus)
    slope = rate / n
    ahead = samples[-1][1] / n + slope * lookahead_s
    for gpu, room in room_in_place(task, topo, ledger).items():
        if ahead > OVERFLOW_FILL * room:
            return (f"its memory grows {slope * 60:.0f} MB/min per GPU ({samples[-1][1] / n:.0f} MB now): within "
                    f"{lookahead_s:.0f} s it would pass the {room} MB it can have on GPU {gpu}")
    return None
