"""The replica's state: its live view of the fleet and the ledger, the fingerprints and
contracts it knows, its policies, and the placement of an admitted task.

``ReplicaState.place`` chooses with the routed policy (its predicted peak first, then, for a
smooth grower, its ask: a bridge), reserves the chosen shares in the ledger with
compare-and-set (re-choosing on a lost race) and only then returns the ``assign``; the
service publishes it. The kept snapshot (``snapshot``) makes a decision cost a copy, not a
rebuild of the fleet.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from collections.abc import Iterable
from pathlib import Path

import msgspec
from fleetpilot.contracts import (
    ActionExecuted,
    Allocation,
    DecidedBy,
    DecisionMade,
    Fingerprint,
    NodeLedger,
    NodeTopology,
    Placement,
    PolicyRef,
    TaskAdmitted,
    TaskSubmitted,
    TaskTelemetry,
    in_service,
    now,
)
from fleetpilot.executor import recorded_result
from fleetpilot.fingerprint import SignatureStats, restores_start_over, stored_stats, task_signature
from fleetpilot.ledger import FleetView, LedgerStore, free_capacity, with_allocations
from fleetpilot.ledger.accounting import without_decision
from fleetpilot.ledger.store import node_key
from fleetpilot.policy import ClusterState, GuardedPolicy, PolicyDecision, TaskRequest, record
from fleetpilot.policy.backfill import Reservation, hidden_from, node_hidden
from fleetpilot.policy.calibration import ConfidenceCalibration
from fleetpilot.policy.preempt import Requeue, run_left_s
from fleetpilot.policy.rebalance import (
    SMOOTH_GROWTH,
    Running,
    envelope_bridge_mb,
    gpu_conditions,
    nodes_out_of_service,
    running_tasks,
)
from fleetpilot.policy.spread import RecentWaits, spread_ask_mb
from fleetpilot.policy.state import MILLI
from fleetpilot.runtime import CasConflict, KeyValue, Retry
from fleetpilot.sla import bound_sites

from .admissions import Admissions
from .metrics import PolicyMetrics
from .policy_set import ActivePolicies, PolicySet
from .record_file import RecordFile
from .settings import PolicySettings

log = logging.getLogger("fleetpilot.policy")


def decision_id_for(task_id: str, action: str) -> str:
    """Deterministic decision id: every replica and every redelivery agrees on it."""
    return f"{task_id}.{action}"


RECORD_FILE = "policy-states.jsonl"
"""The replay record's file in ``state_dir`` (``FLEETPILOT_POLICY_RECORD_EVERY``), shared by
the replicas that share the directory and kept across their restarts; rotated to ``.1``, ``.2``...
at ``RECORD_MAX_MB`` (``record_file``)."""

MIB = 1024 * 1024

QUEUE_CONFIDENCE = 0.95
"""The confidence of a ``queue`` decision before calibration."""

PEAK_HEADROOM = 1.05
"""A task with a fingerprint asks for (and the ledger holds) its predicted peak times this,
as the fleet benchmark reserves (``bench.fleet``'s ``_reservation``)."""

FINGERPRINT_READ_LIMIT_S = 120.0
"""The longest a replica that started waits to have read the recent fingerprints back before
it places tasks (``reading_fingerprints``): past it, it places on what it has read, rather
than hold every admission up behind a backlog it cannot get through."""

SETTLED_AFTER_S = 60.0
"""A reserved hold this old whose decision the executor settled elsewhere is a leftover
(``release_settled_reservations``): well past a result recorded before its hold's confirmation."""

BRIDGE_PATTERNS = SMOOTH_GROWTH
"""Growth patterns a task may be bridged for on its ask: memory that rises smoothly gives the
rebalancer rounds to move the task up before the peak; a step or a burst may come before the
next one, so those are bridged only by their signature's envelope (``envelope_bridge_mb``)."""


def calibration_key(policy: str, action: str) -> str:
    """The ``ConfidenceCalibration`` key of a policy's decisions of one action: each action
    has its own goal (an assign runs its course, a move is followed by no OOM...), so each is
    corrected by its own record."""
    return f"{policy}:{action}"



def allocations_for(
    task: TaskSubmitted | TaskRequest, decision_id: str, placement: list[Placement], run_at: float = 0.0,
    decided: DecidedBy | None = None, topo: NodeTopology | None = None,
) -> list[Allocation]:
    """The ledger holds of a placement (of a new task, or the target of a move); CPU and
    host memory are charged once, and so is ``decided`` recorded (``Allocation.decided``: who
    decided an assign, to publish it again as decided). ``run_at`` is when the run they carry
    began (``Allocation.run_at``): now for a first placement, the source's for a move. Each
    hold names the board ``topo`` (the node placed on, as placed by) has at its index
    (``Allocation.gpu_uuid``), which the executor follows through a renumbering."""
    boards = {g.index: g.uuid for g in topo.gpus} if topo is not None else {}
    return [
        Allocation(
            task_id=task.task_id,
            decision_id=decision_id,
            gpu=p.gpu,
            milli=p.milli,
            memory_mb=p.memory_mb,
            cpu_milli=task.cpu_milli if i == 0 else 0,
            host_memory_mb=task.memory_mb if i == 0 else 0,
            at=now(),
            run_at=run_at,
            decided=decided if i == 0 else None,
            gpu_uuid=boards.get(p.gpu, "") if p.gpu >= 0 else "",
        )
        for i, p in enumerate(placement)
    ]


def placement_fits(
    topo: NodeTopology, ledger: NodeLedger | None, placement: list[Placement], cpu_milli: int, memory_mb: int
) -> bool:
    """Whether exactly these GPU shares (not just some GPU of the node) are free on the
    ledger we are about to overwrite, and no GPU has been taken out of service meanwhile."""
    free = free_capacity(topo, ledger)
    if free.cpu_milli < cpu_milli or free.memory_mb < memory_mb:
        return False
    labels = {g.index: g.labels for g in topo.gpus}
    for p in placement:
        if p.gpu < 0:
            continue
        if (
            p.gpu >= len(free.gpu_milli)
            or free.gpu_milli[p.gpu] < p.milli
            or free.gpu_memory_mb[p.gpu] < p.memory_mb
        ):
            return False
        lab = labels.get(p.gpu, {})
        if not in_service(lab):
            return False
    return True


def placement_problem(choice: PolicyDecision, req: TaskRequest) -> str | None:
    """What an ``assign`` holds short of the request (``None`` when nothing): a GPU task given
    no GPU, fewer or more GPUs than asked, one GPU twice, or a share below its ask.

    The breaker judges exceptions, time and confidence, not the placement, and the ledger
    write checks only that the chosen shares are free: a module's device plugin that forgot
    the GPUs had its task reserved and assigned on ``gpu -1`` with 0 milli, the GPU it would
    use left free for another task to be booked on."""
    if req.gpus <= 0 or req.gpu_milli <= 0:
        return None  # a CPU-only task: no GPU share to check
    gpus = [p.gpu for p in choice.placement]
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus) or len(gpus) != req.gpus:
        return f"placement on GPUs {gpus} for a task of {req.gpus} GPU(s)"
    least = req.gpu_milli if req.shares_gpu else MILLI
    short = [p.milli for p in choice.placement if not least <= p.milli <= MILLI]
    if short:
        return f"placement of {short} milli for a task of {req.gpu_milli} milli per GPU"
    return None


def checked_decide(guarded: GuardedPolicy, name: str, state: ClusterState, req: TaskRequest) -> PolicyDecision:
    """``guarded.decide``, with a primary ``assign`` that holds short of the request
    (``placement_problem``) taken as the primary failing: its breaker records it and the
    fallback scheduler decides instead, as for an exception."""
    choice = guarded.decide(state, req)
    if choice.fallback or choice.action != "assign":
        return choice
    problem = placement_problem(choice, req)
    if problem is None:
        return choice
    guarded.breaker.record("exception")
    log.warning("policy %s: %s: %s; the fallback scheduler decides it", name, req.task_id, problem)
    fb = guarded.fallback.decide(state, req)
    return msgspec.structs.replace(fb, reason=f"{fb.reason} (primary: {problem})")


def mark_conditions(state: ClusterState, nodes: list[NodeTopology]) -> None:
    """Flag in ``state`` what ``nodes``' labels say (``gpu_conditions``, ``nodes_out_of_service``):
    a GPU out of service takes no new work, one pending maintenance has its tasks moved (per
    GPU: only that GPU stops taking work), a node out of service as a whole takes no task. An
    index outside the slots, or a node ``state`` lacks, flags nothing."""
    def row_of(node: str) -> int | None:
        try:
            return state.node_index(node)
        except KeyError:
            return None

    unhealthy, maintenance = gpu_conditions(nodes)
    for gpus, flag in ((unhealthy, {"healthy": False}), (maintenance, {"maintenance": True})):
        for node, gpu in gpus:
            if (row := row_of(node)) is not None and 0 <= gpu < state.max_gpus:
                state.set_condition(row, [gpu], **flag)
    for node in nodes_out_of_service(nodes):
        if (row := row_of(node)) is not None:
            state.node_ready[row] = False  # type: ignore[index]


class ReplicaState:
    """The replica's live view (fleet + ledger + fingerprints + the executor's journal), its
    policies, and the choose-reserve steps of a placement. ``Moves`` and ``Evictions`` build
    on it; the service's ``PolicyState`` is the three together."""

    def __init__(
        self,
        fleet: FleetView,
        ledger: LedgerStore,
        settings: PolicySettings,
        active: ActivePolicies,
        metrics: PolicyMetrics,
    ) -> None:
        self.fleet = fleet
        self.ledger = ledger
        self.settings = settings
        self.active = active
        self.metrics = metrics
        # Latest fingerprint per task; bounded so a long-lived replica does not grow forever.
        self.fingerprints: OrderedDict[str, Fingerprint] = OrderedDict()
        # When each task's fingerprint was published: a redelivered older one does not replace it.
        self.fingerprinted_at: OrderedDict[str, float] = OrderedDict()
        # The runs' spread last seen per signature (``with_shared_spread``).
        self.spreads: OrderedDict[str, tuple[float, ...]] = OrderedDict()
        # Tasks this replica decided, so a migration keeps the task's own GPU model constraints.
        self.tasks: OrderedDict[str, TaskSubmitted] = OrderedDict()
        # Contracts (tiers) of the running tasks: set at start-up, before any decision.
        self.admissions: Admissions | None = None
        # What kept a task's request off every node, the last time the policy found none for
        # it (``place``, ``PolicyDecision.shortfall``): its ``queue`` decision tells an operator.
        self.refusals: OrderedDict[str, str] = OrderedDict()
        # Resizes this replica proposed: one that failed is not proposed again under its id.
        self.resizes: OrderedDict[str, float] = OrderedDict()
        # The executor's journal (``executions``): which decision ids it has already taken.
        self.executions: KeyValue | None = None
        # The queue of tasks waiting for a placement (``pending``).
        self.pending: KeyValue | None = None
        # Per running task, its memory samples (``telemetry.task``) over the last
        # ``growth_lookahead_s``: (time, MB over all its GPUs). Dropped when it stops or moves.
        self.usage: OrderedDict[str, deque[tuple[float, float]]] = OrderedDict()
        # The fingerprinter's statistics per signature (``fingerprints``): how a program's
        # runs come back from a checkpoint, learnt from every restore in the fleet.
        self.signatures: KeyValue | None = None
        # How long the latest tasks this replica placed on each GPU size waited: what asking
        # for that size costs now (``policy.spread``, read by ``request``).
        self.recent_waits = RecentWaits()
        self.decided_inputs = 0
        # A replica that starts reads the recent fingerprints back (its consumer starts two
        # days back) and places nothing meanwhile (``reading_fingerprints``): set when its
        # consumer has delivered the last one stored, or at once when there is none to read.
        self.fingerprints_read = False
        self.started_at = now()
        # One replay record per state directory, not per replica: a replica's default id (host
        # and pid) changes at every start, and each run left a file of its own for ever.
        self.record_path = Path(settings.state_dir) / RECORD_FILE
        self.record_file = RecordFile(
            self.record_path, max_bytes=int(settings.record_max_mb * MIB), keep=settings.record_keep
        )
        # The kept snapshot (``snapshot``): the topology and ledger versions it reflects.
        self._view: ClusterState | None = None
        self._view_topology = self._view_ledger = -1
        self._view_rows: dict[str, int] = {}
        # EASY backfill: GPUs kept for the first blocked whole-GPU task of the last queue
        # round; a task expected to outlast their release is placed as if they were taken.
        self.reservation: Reservation | None = None
        # Reservations for later blocked tasks, each on nodes no earlier reserved task could
        # use (``backfill.reserve_apart``): kept off the same way.
        self.reservations_apart: list[Reservation] = []
        # The tasks the last queue round found no place for, in the queue's order: the
        # rebalancer may move a tenant down to make room for one (``Moves.move_down``).
        self.blocked: list[TaskAdmitted] = []
        # How far the runs of blocked tasks restored from a checkpoint had got
        # (``Requeue.progress_s``): what is left of them orders the queue.
        self.blocked_progress: dict[str, float] = {}
        # Tasks queued again whose holds the executor has not released yet (evicted, being
        # checkpointed), as the last queue round found them: no room is made with them again.
        self.leaving: set[str] = set()
        # Waiter -> the tenant this replica moved down or checkpointed to make room for it, the
        # placement it checkpointed ("" for a move) and when: no other makes room for the same
        # waiter while that is under way (``Moves.room_coming``).
        self.making_room: OrderedDict[str, tuple[str, str, float]] = OrderedDict()
        # Per policy, the correction of its confidence learnt from the feedback totals.
        self.calibration = ConfidenceCalibration()
        # ``gpu_memory_by_model``, valid for one topology version.
        self._largest: dict[str, int] = {}
        self._largest_at = -1
        # ``running`` as of one ledger version.
        self._running: list[Running] = []
        self._running_at = -1

    def checkpoint_pause_s(self, memory_mb: float) -> float:
        """Seconds a task holding ``memory_mb`` per GPU makes no progress when moved: its
        checkpoint and restore. Each GPU's state is written in parallel, so what one GPU
        holds sets the pause, not the sum over the task's GPUs."""
        return self.settings.checkpoint_base_s + self.settings.checkpoint_s_per_gb * memory_mb / 1024.0

    def observe(self, sample: TaskTelemetry) -> None:
        """Keep a task's memory sample, and only those of the last ``growth_lookahead_s``."""
        kept = self.usage.get(sample.task_id)
        if kept is None:
            kept = deque()
        if kept and sample.at < kept[-1][0] - self.settings.growth_lookahead_s:
            # Earlier than the last by more than the window: the clock was stepped back (or
            # one sample was stamped ahead). Dropped as late, every sample until the clock
            # caught up went unseen, and with them the growth that checkpoints before an OOM.
            kept = deque()
        elif kept and sample.at <= kept[-1][0]:
            return  # a late or repeated sample
        kept.append((sample.at, sample.memory_used_mb))
        while kept[0][0] < sample.at - self.settings.growth_lookahead_s:
            kept.popleft()
        self.remember(self.usage, sample.task_id, kept, limit=50_000)

    async def signature_stats(self, signature: str) -> SignatureStats | None:
        """The fingerprinter's statistics of ``signature`` (``fingerprints``); ``None`` when it
        has none, or none this replica can read (then nothing is known of the signature)."""
        if self.signatures is None:
            return None
        entry = await self.signatures.get(signature)
        return stored_stats(signature, entry.value if entry is not None else None)

    async def restore_floor_mb(self, task: TaskSubmitted) -> int:
        """What a bridge of ``task``, stopped now to be placed again (preempted, evicted by the
        executor), must ask per GPU: what its latest sample held (a step schedule comes back
        from its checkpoint where it was, and on less room it would die of OOM at once),
        unless its signature's restores have mostly started over; 0 when it has no sample."""
        samples = self.usage.get(task.task_id)
        if not samples or restores_start_over(await self.signature_stats(task_signature(task))):
            return 0
        return math.ceil(samples[-1][1] / max(task.gpus, 1))

    def forget_run(self, task_id: str) -> None:
        """Drop a task's samples: it stopped, or was restored elsewhere from a checkpoint (a
        slope measured across the stop would mean nothing)."""
        self.usage.pop(task_id, None)

    async def taken_at(self, decision_id: str) -> float | None:
        """When the executor took ``decision_id`` (its journal entry in ``executions``: the
        claim, the result), ``None`` when it never did; 0 when the entry carries no time."""
        if self.executions is None:
            return None
        found = await self.executions.get(node_key(decision_id))
        if found is None or not found.value:
            return None
        try:
            doc = msgspec.json.decode(found.value)
        except msgspec.DecodeError:
            return 0.0
        times = [doc.get(f) for f in ("executed_at", "failed_at", "at")] if isinstance(doc, dict) else []
        return next((float(t) for t in times if isinstance(t, int | float)), 0.0)

    async def release_settled_reservations(self) -> int:
        """Give back the reserved holds whose decision the executor has already settled
        somewhere else; how many decisions' holds went back.

        Two replicas whose rebalance rounds overlap, with views that differ, can reserve one
        move (``<task>.migrate.<n>``) on two target nodes. The stream keeps one decision of
        that id; the other hold was never carried out, and nothing else gave it back. A
        reserved hold older than ``SETTLED_AFTER_S`` whose decision the journal records as
        carried out on other nodes, or as failed, is such a leftover."""
        if self.executions is None:
            return 0
        cutoff = now() - SETTLED_AFTER_S
        reserved = {(key, a.decision_id) for key, ledger in self.ledger.nodes.items()
                    for a in ledger.allocations if a.state == "reserved" and 0 < a.at <= cutoff}
        released = 0
        for key, decision_id in sorted(reserved):
            found = await self.executions.get(node_key(decision_id))
            try:
                result = recorded_result(found.value if found is not None else None)
            except msgspec.DecodeError:
                continue
            if result is None:
                continue  # not carried out yet (or being carried out now)
            if isinstance(result, ActionExecuted) and key in {node_key(p.node) for p in result.placement}:
                continue  # its own node: the executor confirms it there
            if await self.ledger.mutate(key, lambda cur, d=decision_id: without_decision(cur, d) if cur else None):
                log.warning("%s: gave back its reservation on %s, left over (the decision was settled elsewhere)",
                            decision_id, key)
                released += 1
        return released

    def reading_fingerprints(self) -> bool:
        """Whether this replica still reads back the fingerprints stored before it started,
        for at most ``FINGERPRINT_READ_LIMIT_S``: a task placed meanwhile may have its own at
        the end of that backlog, and would be held for its ask, not its predicted peak."""
        return not self.fingerprints_read and now() - self.started_at < FINGERPRINT_READ_LIMIT_S

    async def journaled(self, decision_id: str) -> bool:
        """Whether the executor has taken ``decision_id`` (claimed it, or recorded its result).
        A re-proposal under such an id would be dropped by the stream's duplicate window or
        the journal, and its fresh reservation would then be held until the task ends."""
        return await self.taken_at(decision_id) is not None

    def blocked_left_s(self, adm: TaskAdmitted) -> float | None:
        """What is left of a blocked task's declared run: its ``expected_duration_s`` less the
        progress its checkpoint kept (``blocked_progress``); ``None`` when it declared none."""
        return run_left_s(adm, self.blocked_progress.get(adm.task.task_id, 0.0))

    # ---- views --------------------------------------------------------------------------
    def with_shared_spread(self, fp: Fingerprint) -> Fingerprint:
        """``fp``, its runs' spread (up to 200 peaks) shared with the fingerprints of the other
        tasks of its signature that carry the same one: each arrives decoded on its own, and
        ``fingerprints`` keeps 100,000 tasks."""
        if not fp.run_peaks_mb:
            return fp
        kept = self.spreads.get(fp.signature)
        if kept is not None and kept == fp.run_peaks_mb:
            self.spreads.move_to_end(fp.signature)
            return msgspec.structs.replace(fp, run_peaks_mb=kept)
        self.remember(self.spreads, fp.signature, fp.run_peaks_mb, limit=10_000)
        return fp

    def remember(self, cache: OrderedDict, key: str, value, limit: int = 100_000) -> None:
        """Keep ``value`` as the newest entry of a bounded cache."""
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > limit:
            cache.popitem(last=False)

    def running(self) -> list[Running]:
        """The tasks running settled on one node (``rebalance.running_tasks``), worked out
        again only when the ledger changed: each waiting vip of a retry round, and the
        rebalance round, ask it, and on the openb fleet with 2,400 tasks running it costs
        8 ms."""
        if self._running_at != self.ledger.version:
            self._running, self._running_at = running_tasks(list(self.ledger.nodes.values())), self.ledger.version
        return self._running

    def snapshot(self, without: frozenset[str] = frozenset()) -> ClusterState:
        """The fleet as the policies see it: topology, ledger holds, GPU condition labels;
        ``without`` drops those tasks' holds (the fleet after evicting them).

        Building it from the records costs ~25 ms on the openb fleet (1,213 nodes, 24,330
        links; 98 ms before nodes of one make shared their links' and labels' working-out),
        several times a decision, so the view is kept and brought up to date row by row for
        the topology keys (``_redo_topology_rows``) and ledger keys (``set_holds``) changed
        since; built afresh only for a node new or gone, or one the rows cannot take.
        Each caller gets its own copy, free to mask or allocate on. ``without`` redoes only
        the rows of the nodes those tasks hold (a vip's preemption asks it for up to three
        plans a round; each was a build from the records)."""
        if without:
            view = self.snapshot()
            for key, ledger in self.ledger.nodes.items():
                row = self._view_rows.get(key)
                if row is not None and any(a.task_id in without for a in ledger.allocations):
                    view.set_holds(row, [a for a in ledger.allocations if a.task_id not in without])
            return view
        if self._view is not None and self._view_topology != self.fleet.version:
            if self._redo_topology_rows():
                self._view_topology = self.fleet.version
            else:
                self._view = None
        if self._view is None:
            self._view_topology, self._view_ledger = self.fleet.version, self.ledger.version
            self._view = self.build_snapshot()
            self._view_rows = {node_key(name): row for row, name in enumerate(self._view.node_names)}
        elif self._view_ledger != self.ledger.version:
            for key in self.ledger.changed_since(self._view_ledger):
                row = self._view_rows.get(key)
                if row is not None:
                    ledger = self.ledger.nodes.get(key)
                    self._view.set_holds(row, ledger.allocations if ledger is not None else ())
            self._view_ledger = self.ledger.version
        return self._view.copy()

    def _redo_topology_rows(self) -> bool:
        """Bring the kept view up to the topology keys changed since it was, row by row: each
        node's row made again from its record (``ClusterState.set_topology``), then its
        conditions and its holds. ``False`` where a row cannot be redone (a node new or gone,
        more GPU slots, a new model or site): the view is then built afresh. A build costs
        ~30 ms on the openb fleet, and one label changing made the next decision pay it."""
        view = self._view
        assert view is not None
        changed = self.fleet.changed_since(self._view_topology)
        if any(key not in self._view_rows or key not in self.fleet.nodes for key in changed):
            return False
        for key in changed:
            row, topo = self._view_rows[key], self.fleet.nodes[key]
            if not view.set_topology(row, topo):
                return False
            mark_conditions(view, [topo])
            ledger = self.ledger.nodes.get(key)
            view.set_holds(row, ledger.allocations if ledger is not None else ())
        return True

    def build_snapshot(self, without: frozenset[str] = frozenset()) -> ClusterState:
        """``snapshot`` built from the records, every node."""
        nodes = list(self.fleet.nodes.values())
        state = ClusterState.from_topology(nodes, {
            ledger.node: [a for a in ledger.allocations if a.task_id not in without]
            for ledger in self.ledger.nodes.values()
        })
        mark_conditions(state, nodes)
        return state

    def request(self, task: TaskSubmitted) -> TaskRequest:
        """The task as the policies see it, with its fingerprint when one has arrived.

        With a predicted peak, the GPU memory asked is the peak times ``PEAK_HEADROOM``
        (never less than the task's own ask), so the task waits for GPUs that hold it, and
        its models are those whose GPUs can (the model-demand pressure then keeps flexible
        work off the big GPUs). Nothing holds more than the largest GPU of a model the task
        accepts: a prediction above it needs a whole one of those rather than no GPU ever.
        Nor more than the smallest such GPU that held nearly all of its program's runs
        (``Fingerprint.fit_peak_mb``): a program whose mean sits just under a GPU's size
        runs there, at the small OOM risk its runs' spread tells, instead of waiting for a
        bigger GPU that the margin on its mean would ask. And where GPUs of that size have
        kept their latest starts waiting, a smaller GPU whose share of runs not held that
        wait makes worth risking (``policy.spread``; ``recent_waits``, from this replica's
        placements).
        """
        fp = self.fingerprints.get(task.task_id)
        # At the first of its contract's sites (``requests`` adds the others): what is asked
        # for here is a placement, and a task being placed holds nothing yet.
        req = msgspec.structs.replace(TaskRequest.from_submitted(task, fp),
                                      site=next(iter(self.contract_sites(task.task_id)), ""))
        if fp is None or fp.predicted_peak_mb <= 0 or req.gpus <= 0 or req.gpu_milli <= 0:
            return req
        want = int(math.ceil(fp.predicted_peak_mb * PEAK_HEADROOM))
        largest = self.largest_gpu_mb(req.gpu_models)
        if largest > 0:
            sizes = [mb for m, mb in self.gpu_memory_by_model().items() if not req.gpu_models or m in req.gpu_models]
            want = int(spread_ask_mb(min(want, largest), sizes, fp.fit_peak_mb,
                                     fp.run_peaks_mb if self.settings.wait_risk else (), self.recent_waits,
                                     task.expected_duration_s or 0.0))
        return self.at_least(req, want)

    def workload(self, seen: Iterable[TaskSubmitted]) -> list[TaskRequest]:
        """The tasks seen, as the policies' typical tasks and demand count them: each as it is
        asked now (``request``), on the models its fingerprint says can hold it. Counted as
        submitted, a program that only the big GPUs hold looked as flexible as its user's
        ask, and the demand pressure priced the big GPUs as if nothing needed them."""
        return [self.request(task) for task in seen]

    def bridge_request(self, task: TaskSubmitted, plain: TaskRequest, floor_mb: int = 0, *,
                       from_start: bool = True) -> TaskRequest | None:
        """The request a task may start on when ``plain`` (its peak) finds no node: the task
        as submitted, its ask (at least ``floor_mb``: ``Requeue.bridge_floor_mb``) and no
        predicted peak, for a fingerprint that predicts smooth growth (``BRIDGE_PATTERNS``)
        beyond that; for a run ``from_start`` (its first placement) whose signature's envelope
        keeps it below its peak for a while (a step schedule), what the envelope says it needs
        for that while (``envelope_bridge_mb``; ``envelope_overflow`` checkpoints it before it
        outgrows that); ``None`` for any other task.

        A task that cannot resume (``TaskSubmitted.resumable``) is not bridged: moved up as it
        grows, it would start over. A task that asks no GPU memory is not bridged: nothing says
        what it needs at the start, so the bridge would put it anywhere. No OOM floor applies:
        the ``Fingerprint`` the service receives carries none (the fingerprinter folds the
        signature's floor into the predicted peak), and the ask is what the submitter says the
        task starts with.
        """
        fp = self.fingerprints.get(task.task_id)
        if fp is None or task.gpu_memory_mb <= 0 or not task.resumable:
            return None
        if fp.pattern in BRIDGE_PATTERNS:
            ask = max(task.gpu_memory_mb, floor_mb)
        else:
            envelope = envelope_bridge_mb(fp, task.expected_duration_s, self.settings.growth_lookahead_s)
            if not from_start or envelope <= 0:
                return None
            ask = max(task.gpu_memory_mb, floor_mb, envelope)
        if task.gpus <= 0 or task.gpu_milli <= 0 or ask >= plain.gpu_memory_mb:
            return None
        return msgspec.structs.replace(TaskRequest.from_submitted(task), site=plain.site, gpu_memory_mb=ask)

    def contract_sites(self, task_id: str) -> list[str]:
        """The sites the task's contract binds it to, the one it was estimated at first;
        empty: any site (``fleetpilot.sla.bound_sites``).

        A contract binds only where a term of it depends on the site: a warm-up bound, or a
        deadline (the warm-up counts towards it); then to every site that keeps those terms,
        an admission's as an accepted offer's. Bound to none, an admission was placed where
        its data's trip broke its warm-up; bound to its one site, an accepted offer waited
        there while another site that kept its terms stood free. Without such a term any site
        keeps the contract (its models keep the rest)."""
        adm = self.admissions.of(task_id) if self.admissions is not None else None
        return bound_sites(adm.contract) if adm is not None else []

    def contract_site(self, task_id: str) -> str:
        """The one site a running task's move names (``TaskRequest.site``), else ``""``: the
        only site of its contract (``contract_sites``); of several, the one it holds capacity
        at (it stays there: a move names one site) or else the first."""
        sites = self.contract_sites(task_id)
        if len(sites) <= 1:
            return sites[0] if sites else ""
        held = self.ledger.holds_of(task_id)
        topo = self.fleet.nodes.get(held[0]) if held is not None else None
        return topo.site if topo is not None and topo.site in sites else sites[0]

    def requests(self, task: TaskSubmitted, requeue: Requeue | None = None) -> list[TaskRequest]:
        """What ``place`` tries for the task, in order: its request, then its bridge if any
        (no less than a checkpointed task's ``requeue.bridge_floor_mb``). A checkpointed task
        needs no floor on its request: it was stopped because its fingerprint predicts more
        than it could have there, and the request asks for that.

        A task an OOM killed asks at least its note's ``oom_floor_mb``, its bridge too.

        A task whose contract binds it to several sites (``contract_sites``) is tried at each,
        in the contract's order, its request at every site before its bridge at any: a request
        names one site, and the task may run at any of them."""
        plain = self.request(task)
        oom_floor = requeue.oom_floor_mb if requeue is not None else 0
        if oom_floor > plain.gpu_memory_mb:
            plain = self.at_least(plain, oom_floor)
        bridge = self.bridge_request(task, plain, max(requeue.bridge_floor_mb, oom_floor) if requeue is not None else 0,
                                     from_start=requeue is None)
        tried = [plain] if bridge is None else [plain, bridge]
        sites = self.contract_sites(task.task_id)
        if len(sites) <= 1:
            return tried
        return [msgspec.structs.replace(req, site=site) for req in tried for site in sites]

    def at_least(self, req: TaskRequest, memory_mb: int) -> TaskRequest:
        """``req`` asking ``memory_mb`` per GPU, never more than the largest GPU of a model it
        accepts, on the models whose GPUs hold that much (as ``request`` asks a peak)."""
        largest = self.largest_gpu_mb(req.gpu_models)
        memory_mb = max(min(memory_mb, largest) if largest > 0 else memory_mb, req.gpu_memory_mb)
        models = tuple(m for m in req.gpu_models if self.largest_gpu_mb((m,)) >= memory_mb) or req.gpu_models
        return msgspec.structs.replace(req, gpu_memory_mb=memory_mb, gpu_models=models)

    def gpu_memory_by_model(self) -> dict[str, int]:
        """The memory of the largest GPU of each model in the fleet, worked out again only
        when the topology changed."""
        if self._largest_at != self.fleet.version:
            largest: dict[str, int] = {}
            for topo in self.fleet.nodes.values():
                for g in topo.gpus:
                    largest[g.model] = max(largest.get(g.model, 0), g.memory_mb)
            self._largest, self._largest_at = largest, self.fleet.version
        return self._largest

    def largest_gpu_mb(self, models: tuple[str, ...]) -> int:
        """The memory of the largest GPU in the fleet of one of ``models`` (any model when
        empty); 0 when the fleet has none."""
        by_model = self.gpu_memory_by_model()
        return max((mb for m, mb in by_model.items() if not models or m in models), default=0)

    def bridge_hold_mb(self, state: ClusterState, choice: PolicyDecision, plain: TaskRequest, ask_mb: int) -> int:
        """GPU memory a bridged task holds on each chosen GPU: what the least free of them has
        free, up to what its plain request wanted, never less than its ask. It grows there
        until it is moved up, so nothing else may be placed into that room meanwhile (the
        fleet benchmark holds the same)."""
        gpus = [p.gpu for p in choice.placement if p.gpu >= 0]
        if not gpus:
            return ask_mb
        free = int(state.gpu_mem_free[state.node_index(choice.placement[0].node), gpus].min())
        return max(ask_mb, min(plain.gpu_memory_mb, free))

    def record_input(self, state: ClusterState, req: TaskRequest) -> None:
        """Append every ``record_every``-th decision input to the replay file."""
        every = self.settings.record_every
        if every <= 0:
            return
        self.decided_inputs += 1
        if self.decided_inputs % every:
            return
        try:
            # Replicas sharing the state directory append to the one file, each line whole,
            # under a lock; the file is rotated at its bound (else it grew until the disk was full).
            self.record_file.append(msgspec.json.encode(record(state, req)) + b"\n")
        except OSError as exc:  # recording is best effort: never lose a decision over it
            log.warning("cannot record a state for replay: %s", exc)

    # ---- decisions ----------------------------------------------------------------------
    def assign_decision(
        self,
        adm: TaskAdmitted,
        placement: list[Placement],
        confidence: float,
        reason: str,
        policy: PolicyRef,
        shard_id: str = "primary",
        fallback: bool = False,
        decision_id: str | None = None,
    ) -> DecisionMade:
        """The ``assign`` decision of a reserved placement (``<task>.assign`` unless this is
        the re-placement of an evicted task)."""
        return DecisionMade(
            decision_id=decision_id or decision_id_for(adm.task.task_id, "assign"),
            task_id=adm.task.task_id,
            action="assign",
            placement=placement,
            confidence=confidence,
            policy=policy,
            shard_id=shard_id,
            fallback=fallback,
            reason=reason,
            decided_at=now(),
            task=adm.task,
            contract=adm.contract,
        )

    def existing(self, adm: TaskAdmitted, decision_id: str | None = None) -> DecisionMade | None:
        """The decision already reserved for this task, if a previous delivery got that far:
        as it was decided (``Allocation.decided``: the policy and version, shard, fallback,
        confidence and reason recorded with the hold), so that a replica taking over from one
        that died before publishing publishes what that one would have. A hold that records
        none (written before they were recorded) is re-issued under the default policy."""
        held = self.ledger.holds_of(adm.task.task_id)
        if held is None:
            return None
        key, allocs = held
        # The decision's own holds where the node has them: not a resize's extra on one of its
        # GPUs, which would name that GPU twice.
        mine = [a for a in allocs if a.decision_id == (decision_id or decision_id_for(adm.task.task_id, "assign"))]
        allocs = mine or allocs
        node = self.ledger.nodes[key].node
        placement = [Placement(node=node, gpu=a.gpu, milli=a.milli, memory_mb=a.memory_mb) for a in allocs]
        decided = next((a.decided for a in allocs if a.decided is not None), None)
        if decided is None:
            return self.assign_decision(adm, placement, 0.9, "re-issued: capacity already reserved",
                                        PolicyRef(name=self.active.current.default), decision_id=decision_id)
        return self.assign_decision(adm, placement, decided.confidence, decided.reason, decided.policy,
                                    decided.shard_id, decided.fallback, decision_id)

    def policy_ref(self, policies: PolicySet, name: str, choice: PolicyDecision) -> PolicyRef:
        """Who decided: the routed policy and its version, or the fallback scheduler."""
        if choice.fallback:
            return PolicyRef(name="fallback", version=str(policies.generation))
        return PolicyRef(name=name, version=policies.versions.get(name, "1"))

    async def place(
        self, adm: TaskAdmitted, requeue: Requeue | None = None
    ) -> tuple[DecisionMade | None, str, str]:
        """Choose, reserve with CAS (re-choosing on conflict); the decision (``None`` when
        nothing fits) and the policy name and shard the task was routed to. A re-placement
        comes with the note it waited with, which names it (``<task>.assign.<g>``). A task
        that already holds capacity for this placement (any hold, for a first one; holds under
        the note's id, for a re-placement) gets that reservation's decision again."""
        task = adm.task
        self.remember(self.tasks, task.task_id, task)
        if self.admissions is not None:
            self.admissions.placed(adm)
        decision_id = requeue.decision_id if requeue is not None else decision_id_for(task.task_id, "assign")
        held_now = self.ledger.holds_of(task.task_id)
        if held_now is not None and (requeue is None or any(a.decision_id == decision_id for a in held_now[1])):
            # Already reserved for this placement: by a replica that died before it published
            # or cleared the entry (its claim taken over), or by a later delivery of an
            # admission that was queued. The same decision again; choosing afresh could land on
            # another node and leave one of the two holds held by nobody for good.
            name, shard_id = self.active.current.route(task)
            return self.existing(adm, decision_id), name, shard_id
        for attempt in range(10):
            policies = self.active.current  # one set for the whole decision, swaps fall between
            name, shard_id = policies.route(task)
            state = self.snapshot()
            kept = (self.reservation, *self.reservations_apart)
            # The request with the predicted peak first; a smooth grower that finds no GPU for
            # its peak may then start on its ask (a bridge), under the same policy and rules.
            requests = self.requests(task, requeue)
            fp = self.fingerprints.get(task.task_id)  # the one the requests were built from
            avoid = requeue.avoid_node if requeue is not None else ""
            refusal = ""
            for req in requests:
                with hidden_from(state, kept, task.task_id, task.expected_duration_s, now()):
                    # Elsewhere than the node that failed or never took its last placement,
                    # if anywhere; else there again (it may be the only node that holds it).
                    with node_hidden(state, avoid):
                        choice = checked_decide(policies.guarded[name], name, state, req)
                    if avoid and not (choice.action == "assign" and choice.placement):
                        choice = checked_decide(policies.guarded[name], name, state, req)
                if attempt == 0:
                    self.record_input(state, req)
                if choice.action == "assign" and choice.placement:
                    break
                if req is requests[0]:
                    refusal = choice.shortfall
            else:
                self.remember(self.refusals, task.task_id, refusal, limit=10_000)
                return None, name, shard_id
            plain = requests[0]
            # A bridge asks less than the peak; the request at another of the contract's sites
            # asks the same (``requests``) and is no bridge.
            bridged = req.gpu_memory_mb < plain.gpu_memory_mb
            memory_mb = self.bridge_hold_mb(state, choice, plain, req.gpu_memory_mb) if bridged else req.gpu_memory_mb
            placement = choice.placements(memory_mb=memory_mb)
            node = placement[0].node
            topo = self.fleet.nodes.get(node_key(node))
            if topo is None:
                continue
            # The fallback's confidence is already its historical success rate.
            confidence = (choice.confidence if choice.fallback
                          else self.calibration.apply(calibration_key(name, "assign"), choice.confidence))
            reason = choice.reason
            if bridged and fp is not None:
                reason = (
                    f"bridge: starts on {'its ask of ' if req.gpu_memory_mb == task.gpu_memory_mb else ''}"
                    f"{req.gpu_memory_mb} MB (holds {memory_mb} MB); its fingerprint "
                    f"predicts {fp.pattern} growth to {fp.predicted_peak_mb:.0f} MB, which no free GPU holds now; "
                    f"moved up before it gets there; {choice.reason}"
                )
            # Recorded with the hold: a replica that finds it reserved and unpublished (this one
            # died in between) publishes this decision again, not one of its own making.
            decided = DecidedBy(policy=self.policy_ref(policies, name, choice), shard_id=shard_id,
                                fallback=choice.fallback, confidence=confidence, reason=reason)

            def reserve(
                current: NodeLedger | None, placement=placement, node=node, topo=topo, decided=decided
            ) -> NodeLedger | None:
                # Re-check on the ledger we are about to overwrite: the view may be stale.
                if current is not None and any(a.task_id == task.task_id for a in current.allocations):
                    return None  # another delivery of this task reserved meanwhile
                if not placement_fits(topo, current, placement, task.cpu_milli, task.memory_mb):
                    return None
                # A first placement starts the run; a re-placement restores one from where its
                # checkpoint left it, unknown (0) when the checkpoint did not say.
                run_at = now() if requeue is None else requeue.run_began_at(now())
                holds = allocations_for(task, decision_id, placement, run_at, decided, topo)
                return with_allocations(current, node, holds)

            try:
                written = await self.ledger.mutate(node_key(node), reserve)
            except CasConflict:
                continue
            if written is None:
                again = self.existing(adm, decision_id)
                if again is not None:
                    return again, name, shard_id
                continue  # someone took the space between our view and the write: choose again
            gpu_mb = next((g.memory_mb for g in topo.gpus if g.index == placement[0].gpu), 0)
            if gpu_mb > 0:
                # Waited since admitted, or since queued again for a re-placement.
                since = adm.admitted_at if requeue is None or requeue.at <= 0 else requeue.at
                self.recent_waits.started(gpu_mb, now() - since)
            return (
                self.assign_decision(adm, placement, confidence, reason, decided.policy, shard_id, choice.fallback,
                                     decision_id),
                name,
                shard_id,
            )
        raise Retry("ledger contention", 0.2)
