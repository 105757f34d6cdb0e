"""One executor replica: its parts (journal, ledger view, topology labels, locks, backend)
and what it does with decisions and with the ends of tasks.

``ExecutorReplica`` carries a decision out once and keeps the ledger in step with it
(confirm, move, release), tells each task's life on ``task.lifecycle`` naming the decision
that placed it, hands a task over to another node's executor, and gives its tasks back when
it stops. ``GpuHealth`` (``health.py``) builds on it for what the GPUs' health asks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import get_args

from fleetpilot.contracts import (
    ActionExecuted,
    DecisionMade,
    Event,
    HandedOver,
    HandOver,
    NodeLedger,
    SimEvent,
    TaskKind,
    TaskLifecycle,
    TaskSubmitted,
    gpu_rules,
    now,
)
from fleetpilot.executor import (
    ALLOW,
    STARTED_OVER,
    BackendError,
    DecommissionRules,
    ExecutorBackend,
    GpuContext,
    HookVerdict,
    LifecycleHook,
    PreDecommissionHook,
    ProcessBackend,
    execute_decision,
    resumes,
)
from fleetpilot.ledger import LedgerStore, without_task
from fleetpilot.ledger.accounting import confirmed, moved_here, resized, without_decision
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import Bus, Retry
from fleetpilot.workload import GROWTH_LABEL
from prometheus_client import CollectorRegistry

from .backends import BusSimBackend, BusTakeOver, KvExecutionJournal, simulated_peak_mb
from .fleet_labels import CORDONED, DECOMMISSIONED, FleetLabels, LabelGate
from .hook_lock import KvHookLock
from .metrics import ExecutorMetrics
from .settings import ExecutorSettings

log = logging.getLogger("fleetpilot.executor")

# The decision handler publishes these itself, with the decision's ids and a deterministic
# time (so a redelivery republishes the same message); the process backend's own copies
# would be duplicates.
PUBLISHED_BY_HANDLER = ("started", "evicted", "migrated")

# Simulated hardware endings -> (lifecycle state, exit code as a process would report it).
SIM_ENDINGS = {"finished": ("finished", 0), "oom_killed": ("oom_killed", 137), "task_failed": ("failed", 1)}

Background = Callable[[Callable[[], Awaitable[None]], str], None]


class HeldBoardGate:
    """A :class:`fleetpilot.executor.LifecycleHook` that follows an ``assign``'s or a move's
    holds to the boards they name (``Allocation.gpu_uuid``, the board the policy's topology
    had at the index): it refuses one whose board is cordoned or decommissioned wherever it
    reads now (by this replica's hook state, or by the board's labels for a replica started
    since), or whose index another board reads at now
    (:meth:`~fleetpilot.executor.PreDecommissionHook.held_board_refusal`). The hook and the
    label gate judge the index alone, the board reading there now: after a renumbering the
    policy's topology had not caught up with, the task ran on that board while its hold named
    the hot one, whose drain waited for it and whose pull evicted it. Holds that name no board
    (an earlier version's) are judged by their index only."""

    def __init__(self, ledger: LedgerStore, hook: PreDecommissionHook, labels: FleetLabels) -> None:
        """Read the holds from ``ledger``, the boards' states from ``hook`` and ``labels``."""
        self._ledger = ledger
        self._hook = hook
        self._labels = labels

    async def boards_held(self, decision: DecisionMade) -> dict[tuple[str, int], str]:
        """The board each of ``decision``'s holds names, by (node, index): from the ledger
        view, or the bucket where the view has none of them yet (it follows the bucket, which
        the policy wrote just before it published the decision)."""
        out: dict[tuple[str, int], str] = {}
        for node in sorted({p.node for p in decision.placement if p.gpu >= 0}):
            view = self._ledger.nodes.get(node_key(node))
            mine = [a for a in (view.allocations if view else ()) if a.decision_id == decision.decision_id]
            if not mine:
                current = await self._ledger.read(node)
                mine = [a for a in (current.allocations if current else ()) if a.decision_id == decision.decision_id]
            out.update({(node, a.gpu): a.gpu_uuid for a in mine if a.task_id == decision.task_id and a.gpu_uuid})
        return out

    async def before_assign(self, decision: DecisionMade) -> HookVerdict:
        """Refuse a placement whose hold names a board taken out of service, or another board
        than the one reading at its index now."""
        held = await self.boards_held(decision)
        for p in decision.placement:
            uuid = held.get((p.node, p.gpu), "")
            if p.gpu < 0 or not uuid:
                continue
            refusal = self._hook.held_board_refusal(p.node, p.gpu, uuid)
            labels = self._labels.labels_of(p.node, p.gpu, uuid=uuid)
            flagged = next((label for label in (DECOMMISSIONED, CORDONED) if labels.get(label) == "true"), "")
            if not refusal and flagged:
                refusal = f"{p.node}/{p.gpu}: the board its hold names, {uuid}, is labelled {flagged}"
            if refusal:
                return HookVerdict(allow=False, reason=refusal)
        return ALLOW

    async def after_finish(self, event: TaskLifecycle) -> None:
        """Nothing to do."""

    async def pre_decommission(self, node: str, gpu: int, running_tasks: Sequence[str]) -> HookVerdict:
        """Not this gate's business."""
        return ALLOW


class TopologyBusiness:
    """The business context from the topology bucket (GPU model and ``role`` label) with
    the pre-decommission hook, the label gate and, with the ledger, the gate of the boards the
    holds name, so that assigns to a cordoned GPU are refused (by this replica's hook state,
    and by the labels for a replica started since), by its index and by its board."""

    def __init__(self, labels: FleetLabels, hook: PreDecommissionHook, ledger: LedgerStore | None = None) -> None:
        """Read the rules from ``labels``; ``hook`` is the pre-decommission hook; ``ledger``
        the holds whose boards are followed (none: by index only)."""
        self._labels = labels
        self._hooks: list[LifecycleHook] = [hook, LabelGate(labels)]
        if ledger is not None:
            self._hooks.append(HeldBoardGate(ledger, hook, labels))

    def gpu_context(self, node: str, gpu: int) -> GpuContext:
        """Role, driver and allowed kinds (``contracts.gpu_rules`` of the GPU's labels) and
        model as the topology bucket has them: the rules the policies placed by."""
        rules = gpu_rules(self._labels.labels_of(node, gpu))
        return GpuContext(node=node, gpu=gpu, role=rules.role, driver_pin=rules.driver or None,
                          task_kinds=list(rules.task_kinds), model=self._labels.model_of(node, gpu))

    def hooks(self) -> Sequence[LifecycleHook]:
        """The pre-decommission hook, the label gate, then the gate of the held boards."""
        return self._hooks


class ExecutorReplica:
    """The parts of one replica, opened at start-up (``open``), and the decisions it has
    carried out (for the ids on later lifecycle events)."""

    def __init__(self, settings: ExecutorSettings, metrics: ExecutorMetrics | None = None) -> None:
        """A replica with ``settings``, counting on ``metrics`` (a registry of its own when
        none is given); its parts come with ``open``."""
        self.settings = settings
        self.metrics = metrics or ExecutorMetrics(CollectorRegistry())
        self.rules = DecommissionRules(
            threshold_c=settings.decommission_threshold_c,
            hot_for_s=settings.decommission_hot_for_s,
            drain_s=settings.decommission_drain_s,
        )
        # Who asked for what, so lifecycle events carry the decision they belong to.
        self.decisions: dict[str, DecisionMade] = {}
        self.journal: KvExecutionJournal | None = None
        self.ledger: LedgerStore | None = None
        self.labels: FleetLabels | None = None
        self.locks: KvHookLock | None = None
        self.hook: PreDecommissionHook | None = None
        self.business: TopologyBusiness | None = None
        self.backend: ExecutorBackend | None = None
        # What the backend told (``poll``) and ``backend_changes`` has not yet: kept across a
        # failure, in order.
        self._changes: deque[TaskLifecycle] = deque()

    async def open(self, bus: Bus, background: Background) -> None:
        """Open the journal, the ledger and topology views (followed by ``background``
        tasks), the hook locks and the backend."""
        settings = self.settings
        self.journal = KvExecutionJournal(await bus.kv("executions"))
        self.ledger = await LedgerStore.open(bus)
        self.labels = FleetLabels(await bus.kv("topology"))
        await self.labels.load()
        background(self.ledger.follow, "ledger-view")
        background(self.labels.follow, "topology-labels")
        self.locks = KvHookLock(await bus.kv("hook_locks"))
        self.hook = PreDecommissionHook(settings.replica, self.locks, rules=self.rules)
        self.business = TopologyBusiness(self.labels, self.hook, self.ledger)
        self.labels.on_forget.append(self.forget_node)
        if settings.backend == "sim":
            self.backend = BusSimBackend(bus, settings.default_duration_s)
        else:
            log_dir = Path(settings.process_log_dir) if settings.process_log_dir else None
            # A node's backend takes over the tasks that move to it from other nodes.
            take_over = BusTakeOver(bus, settings.checkpoint_s) if settings.node else None
            registry = Path(settings.state_dir) / f"executor-processes-{settings.node or settings.replica}.json"
            self.backend = ProcessBackend(node=settings.node, log_dir=log_dir, take_over=take_over,
                                          registry=registry, checkpoint_s=settings.checkpoint_s,
                                          log_max_bytes=int(settings.process_log_max_mb * 1024 * 1024))
            if settings.node:
                await self.reclaim_left_behind(bus)

    def forget_node(self, node: str) -> None:
        """``node`` left the fleet (its topology key was deleted): what the pre-decommission
        hook made of its GPUs goes, for a node back under its name to start anew."""
        if self.hook is not None:
            self.hook.forget_node(node)

    def node_trouble(self) -> str:
        """Why no task can start on this node now, as its process backend saw its starts
        fail (empty: nothing known; the simulated fleet's backend knows of none)."""
        backend = self.backend
        return backend.node_trouble if isinstance(backend, ProcessBackend) else ""

    async def recheck_node(self) -> str:
        """``node_trouble`` after a trial start on a node in trouble (which ends it if it
        works): a node out of service gets no task whose start would tell."""
        backend = self.backend
        return await backend.recheck_node() if isinstance(backend, ProcessBackend) else ""

    async def reclaim_left_behind(self, bus: Bus) -> None:
        """At the start of a node's executor, before it takes any decision: what the last
        one left behind. It died without giving its tasks back (killed, or its container
        restarted): their processes died with it, or run on untracked and are stopped now
        (the backend's registry), and their holds would stay in the ledger for ever. Each
        such task's holds are released and ``evicted`` published, so the policy places it
        again. One executor per node, as the DaemonSet runs them: every confirmed hold on the
        node belonged to the last one, and so did a reserved hold whose decision the journal
        records as carried out (it died between the record and the confirmation; carried
        out, a move's source gave the task up, and its holds there go too). Any other
        reserved hold is a decision still to come and stays."""
        assert isinstance(self.backend, ProcessBackend)
        assert self.ledger is not None and self.journal is not None
        node = self.settings.node
        stopped = await self.backend.stop_left_behind(self.settings.grace_s)
        held = await self.ledger.read(node)
        allocations = held.allocations if held else []
        left = {a.task_id for a in allocations if a.state == "confirmed"}
        moved: set[str] = set()
        for decision_id, task_id in sorted({(a.decision_id, a.task_id) for a in allocations
                                            if a.state == "reserved" and a.task_id not in left}):
            result = await self.journal.result(decision_id)
            if isinstance(result, ActionExecuted):
                left.add(task_id)
                if result.action == "migrate":
                    moved.add(task_id)
        for task_id in sorted(left):
            gpus = sorted({a.gpu for a in allocations if a.task_id == task_id and a.gpu >= 0})
            await self.recall(task_id)
            await self.release(task_id, node)
            if task_id in moved:
                elsewhere = {ledger.node for ledger in self.ledger.nodes.values()
                             if any(a.task_id == task_id for a in ledger.allocations)}
                for other in sorted(elsewhere - {node}):
                    await self.release(task_id, other)
            how = "stopped now" if stopped.get(task_id) else "gone with it"
            log.warning("%s was left behind on %s by an executor that did not stop; its process was %s",
                        task_id, node, how)
            await bus.publish(self.lifecycle(task_id, "evicted", node, gpus, detail=(
                f"the executor on {node} stopped without giving the task back; its process was {how}")))
            self.decisions.pop(task_id, None)

    # ---- the ledger and the lifecycle ----------------------------------------------------
    async def release(self, task_id: str, node: str) -> bool:
        """Give back every hold of ``task_id`` on ``node``; whether it held any (a task whose
        end was told has none left: its holds went back then)."""
        assert self.ledger is not None
        held = False

        def change(cur: NodeLedger | None) -> NodeLedger | None:
            nonlocal held  # set on every attempt: a lost compare-and-set runs it again
            held = cur is not None and any(a.task_id == task_id for a in cur.allocations)
            return without_task(cur, task_id) if held else None

        await self.ledger.mutate(node_key(node), change)
        return held

    async def recall(self, task_id: str, besides: str = "") -> None:
        """Learn the decision that placed ``task_id`` where this replica did not carry it
        out (another replica did, or this one before a restart): the decision id of its
        holds in the ledger (other than ``besides``, the move being carried out), and what
        the journal recorded for it. Call it before the holds are released; without it the
        task's lifecycle events carried no decision, and the feedback service could not
        judge the placement."""
        if task_id in self.decisions or self.ledger is None or self.journal is None:
            return
        held = {a.decision_id for ledger in self.ledger.nodes.values() for a in ledger.allocations
                if a.task_id == task_id}
        for decision_id in sorted(held - {besides}):
            result = await self.journal.result(decision_id)
            if isinstance(result, ActionExecuted):
                kind = result.task_kind
                task = TaskSubmitted(task_id=task_id, kind=kind) if kind in get_args(TaskKind) else None
                self.decisions[task_id] = DecisionMade(
                    decision_id=decision_id, task_id=task_id, action=result.action, placement=result.placement,
                    confidence=result.confidence, policy=result.policy, shard_id=result.shard_id,
                    decided_at=result.executed_at, task=task)
                return

    def lifecycle(
        self,
        task_id: str,
        state,
        node: str,
        gpus: list[int],
        detail: str = "",
        exit_code: int | None = None,
        at: float | None = None,
        replaces: DecisionMade | None = None,
    ) -> TaskLifecycle:
        """A ``task.lifecycle`` event naming the decision the task runs under (and, for a
        move, the one it left)."""
        d = self.decisions.get(task_id)
        gpu_model = self.labels.model_of(node, gpus[0]) if gpus and self.labels is not None else ""
        return TaskLifecycle(
            task_id=task_id,
            state=state,
            node=node,
            gpus=gpus,
            detail=detail,
            exit_code=exit_code,
            decision_id=d.decision_id if d else "",
            policy=d.policy.name if d else "",
            policy_version=d.policy.version if d else "",
            decision_action=d.action if d else "",
            shard_id=d.shard_id if d else "primary",
            confidence=d.confidence if d else 0.0,
            task_kind=d.task.kind if d and d.task else "",
            gpu_model=gpu_model,
            replaces_decision_id=replaces.decision_id if replaces else "",
            at=now() if at is None else at,
        )

    def end_untold(self, task_id: str) -> bool:
        """Whether the backend saw ``task_id`` end by itself and has not told it yet (the
        next ``backend_changes`` tells it and gives its holds back)."""
        backend = self.backend
        return isinstance(backend, ProcessBackend) and backend.ended_untold(task_id)

    async def holds_of(self, decision: DecisionMade) -> list[str]:
        """The states (``reserved``, ``confirmed``) of the holds ``decision`` has on its node,
        as the ledger (the bucket, not the view) says now."""
        assert self.ledger is not None
        node = decision.placement[0].node if decision.placement else ""
        current = await self.ledger.read(node) if node else None
        return [a.state for a in current.allocations if a.decision_id == decision.decision_id] if current else []

    async def still_reserved(self, decision: DecisionMade) -> bool:
        """Whether the ledger still holds what ``decision`` reserved on its node (reserved or,
        once carried out, confirmed)."""
        return bool(await self.holds_of(decision))

    # ---- decisions -------------------------------------------------------------------------
    async def carry_out(self, decision: DecisionMade) -> list[Event]:
        """Carry ``decision`` out once, keep the ledger in step, and say what happened."""
        assert self.backend is not None and self.journal is not None and self.ledger is not None
        settings, backend, ledger = self.settings, self.backend, self.ledger
        if isinstance(backend, BusSimBackend) and decision.task is not None:
            task = decision.task
            backend.describe(
                task.task_id,
                simulated_peak_mb(task),
                task.labels.get(GROWTH_LABEL, "flat"),
                task.expected_duration_s,
                task.resumable,
            )
        result = await execute_decision(
            decision,
            backend,
            self.journal,
            owner=settings.replica,
            business=self.business,
            grace_s=settings.grace_s,
            # A node's decisions wait in its consumer while it is cut off; by the time it
            # hears again, their capacity may have been given back and the task placed
            # elsewhere.
            still_reserved=self.still_reserved if settings.node else None,
        )
        if result is None:
            raise Retry("another executor replica is carrying this decision out", 2.0)
        # A redelivered decision gets the recorded result back: everything below is
        # idempotent (ledger writes converge, the events carry the recorded time and so
        # the same Nats-Msg-Id, which the stream drops as a duplicate).
        out: list[Event] = [result]
        node = decision.placement[0].node if decision.placement else ""
        if decision.action in ("migrate", "evict"):
            await self.recall(decision.task_id, besides=decision.decision_id)  # the placement that ends here
        if isinstance(result, ActionExecuted):
            if decision.action == "assign" and node:
                still_held = False

                def confirm(cur: NodeLedger | None) -> NodeLedger | None:
                    nonlocal still_held  # set on every attempt: a lost compare-and-set runs it again
                    still_held = cur is not None and any(a.decision_id == decision.decision_id
                                                         for a in cur.allocations)
                    if cur is None or not still_held:
                        return None
                    return confirmed(cur, decision.task_id, decision.decision_id)

                await ledger.mutate(node_key(node), confirm)
                if still_held:
                    self.decisions[decision.task_id] = decision
                    out.append(self.lifecycle(decision.task_id, "started", node,
                                              [p.gpu for p in decision.placement if p.gpu >= 0],
                                              at=result.executed_at))
                else:
                    # Its holds went back since it was carried out: the task ended, or was
                    # given back (an executor of the node that died before confirming), and
                    # that was told. A ``started`` now, from a copy delivered again after the
                    # stream's duplicate window, had the policy take it as running for ever.
                    log.info("%s: %s holds nothing on %s any more; no start to tell", decision.decision_id,
                             decision.task_id, node)
            elif decision.action == "migrate" and node and not (held := await self.holds_of(decision)):
                # Folded already, and the task moved on since (back to its source, say): the
                # holds of its source and target now belong to a later decision. The recorded
                # result is the whole answer to this late copy.
                log.info("%s: redelivered after a later move of %s; nothing to change", decision.decision_id,
                         decision.task_id)
            elif decision.action == "migrate" and node:
                if "reserved" in held:
                    # The policy reserved the target; the task has left its source: the holds
                    # on the source nodes go, the target's become confirmed. Only while the
                    # target's holds are still reserved: a copy delivered again after the fold
                    # would give back, at a source, what a later move reserved there.
                    for src in {p.node for p in decision.source} - {node}:
                        await self.release(decision.task_id, src)
                    await ledger.mutate(
                        node_key(node),
                        lambda cur: moved_here(cur, decision.task_id, decision.decision_id) if cur else None,
                    )
                # The placement the task left ends here: the feedback service judges it. A
                # redelivered migrate finds itself in ``decisions``: it left nothing new.
                left = self.decisions.get(decision.task_id)
                if left is not None and left.decision_id == decision.decision_id:
                    left = None
                self.decisions[decision.task_id] = decision
                out.append(self.lifecycle(decision.task_id, "migrated", node,
                                          [p.gpu for p in decision.placement if p.gpu >= 0],
                                          "" if resumes(decision) else STARTED_OVER,
                                          at=result.executed_at, replaces=left))
            elif decision.action == "evict":
                # Its process may have ended by itself a moment before, its end not yet told
                # by the backend's poll (once a second), which gives the holds back and tells
                # it: taking them here would tell "evicted" too, and the policy would run the
                # finished task again.
                untold = self.end_untold(decision.task_id)
                held = [] if untold else [
                    await self.release(decision.task_id, src) for src in sorted({p.node for p in decision.source})
                ]
                # An evict names where the task was in ``source``; its placement is empty.
                src_node = decision.source[0].node if decision.source else node
                src_gpus = sorted({p.gpu for p in decision.source if p.gpu >= 0})
                if any(held):
                    out.append(self.lifecycle(decision.task_id, "evicted", src_node, src_gpus, at=result.executed_at))
                else:
                    # It ended on its own before the eviction reached it, and that end was told
                    # (its holds went back then): "evicted" now would have the policy run a
                    # finished task again. (A redelivery finds no holds either: the first
                    # handling told the eviction.)
                    log.info("%s had ended before %s reached it: nothing to tell", decision.task_id,
                             decision.decision_id)
                self.decisions.pop(decision.task_id, None)
            elif decision.action == "resize" and node:
                # The policy reserved the extra memory; the task's hold takes the new size.
                await ledger.mutate(node_key(node), lambda cur: resized(cur, decision) if cur else None)
        elif decision.action in ("assign", "migrate", "resize") and node:
            # Only the holds reserved under this decision go back. A failed assign delivered
            # again may find the task placed anew on the same node (``<task>.assign.<g>``),
            # whose holds are not its own. A failed move: the task still runs at its source;
            # give the target back (within a node the source hold stays). A failed resize:
            # the task keeps its old share; give the reserved extra back.
            await ledger.mutate(
                node_key(node), lambda cur: without_decision(cur, decision.decision_id) if cur else None
            )
        return out

    async def hand_over(self, request: HandOver) -> HandedOver:
        """Another node's executor carries out a move of one of this node's tasks to it: the
        task is checkpointed and stopped here, to restart there."""
        if not isinstance(self.backend, ProcessBackend):
            return HandedOver(task_id=request.task_id, ok=False,
                              error=f"the {self.settings.backend} backend hands no task over")
        try:
            command, env = await self.backend.hand_over(request.task_id, request.grace_s, resumes=request.resumable)
        except BackendError as error:
            return HandedOver(task_id=request.task_id, ok=False, error=str(error))
        self.decisions.pop(request.task_id, None)
        log.info("handed %s over for its move from %s", request.task_id, self.settings.node)
        return HandedOver(task_id=request.task_id, ok=True, command=command, env=env)

    async def take_back_stranded(self) -> list[Event]:
        """Restart here, from its checkpoint (over, for one that cannot resume), a task handed
        over for a move that never took it: ``hand_over_taken_within_s`` later, its hold on this node is still in the ledger
        (a move that took it released that). Without this, a target that gave up after the
        task was stopped here (its answers lost) left the task stopped everywhere, and the
        policy, which places again only failed assigns, believing it ran here. One whose
        move took it is forgotten. The restart is told ``started`` (with the decision that
        placed the task here), as a decision's handler tells a start."""
        backend = self.backend
        if not isinstance(backend, ProcessBackend) or self.ledger is None:
            return []
        node = self.settings.node
        out: list[Event] = []
        stranded = backend.handed_over_before(time.time() - self.settings.hand_over_taken_within_s)
        held = await self.ledger.read(node) if stranded else None
        for task_id in stranded:
            elsewhere = any(a.task_id == task_id for key, ledger in self.ledger.nodes.items()
                            if key != node_key(node) for a in ledger.allocations)
            if held is None or not any(a.task_id == task_id for a in held.allocations) or elsewhere:
                # The move took it (its hold here released, or the task holds GPUs on another
                # node, a release here that failed notwithstanding): nothing to take back.
                backend.settle_hand_over(task_id)
                continue
            try:
                handle = await backend.take_back(task_id)
            except BackendError as error:
                log.error("%s: handed over and never taken, and not restarted here: %s", task_id, error)
                continue
            log.warning("%s was handed over from %s for a move that never took it: restarted here (from its "
                        "checkpoint, if it resumes)", task_id, node)
            await self.recall(task_id)
            out.append(self.lifecycle(task_id, "started", node, handle.gpus,
                                      detail=f"pid {handle.pid}: taken back, its move never took it"))
        return out

    # ---- the ends of tasks -----------------------------------------------------------------
    async def sim_ended(self, event: SimEvent) -> list[Event]:
        """The simulated hardware ended a task: it finished, ran out of memory, or its GPU
        hit a fatal XID. Either way its capacity goes back to the ledger."""
        ending = SIM_ENDINGS.get(event.kind)
        if event.task_id is None or ending is None:
            return []
        state, exit_code = ending
        await self.recall(event.task_id)
        if event.node:
            await self.release(event.task_id, event.node)
        out = [self.lifecycle(event.task_id, state, event.node, [event.gpu] if event.gpu >= 0 else [],
                              event.detail, exit_code)]
        self.decisions.pop(event.task_id, None)
        self.metrics.ended(state)
        return out

    async def backend_changes(self) -> list[Event]:
        """What the backend saw happen to its tasks since the last look; an ended task's
        holds go back to the ledger. A change whose ledger write fails (the bus away for a
        moment) is kept, with those after it, for the next look: ``poll`` gives each change
        once, and raised, the error lost them all, each ended task's end untold and its holds
        kept in the ledger for ever."""
        if self.backend is None:
            return []
        self._changes.extend(await self.backend.poll())
        out: list[Event] = []
        while self._changes:
            change = self._changes[0]
            try:
                event = await self._told(change)
            except Exception as error:  # noqa: BLE001 - kept, and told on the next look
                log.warning("%s %s not told now (%s: %s); told on the next look, with %d changes after it",
                            change.task_id, change.state, type(error).__name__, error, len(self._changes) - 1)
                break
            self._changes.popleft()
            if event is not None:
                out.append(event)
        return out

    async def _told(self, change: TaskLifecycle) -> TaskLifecycle | None:
        """The ``task.lifecycle`` event of one change the backend saw (``None``: its decision's
        handler tells it), its holds given back for an end. Safe to run again after a failure:
        the release and the recall are."""
        if change.state in PUBLISHED_BY_HANDLER:
            return None
        await self.recall(change.task_id)
        if change.state in ("finished", "oom_killed", "failed") and change.node:
            await self.release(change.task_id, change.node)
        event = self.lifecycle(change.task_id, change.state, change.node, change.gpus, change.detail,
                               change.exit_code, at=change.at)
        if change.state in ("finished", "oom_killed", "failed"):
            self.decisions.pop(change.task_id, None)
            self.metrics.ended(change.state)
        return event

    async def give_up_tasks(self) -> list[Event]:
        """When the executor stops: the tasks it runs end with it. Children lead their own
        sessions and would outlive it untracked, and in a container they die with it anyway.
        Each is stopped with grace, its holds released and ``evicted`` published while the
        bus is still up, so the policy places it again (the process restarts with its
        ``command``; a task that checkpoints on SIGTERM resumes from there)."""
        backend = self.backend
        if not isinstance(backend, ProcessBackend):
            return []
        out = await self.backend_changes()  # what happened before the stop, told as usual
        await backend.shutdown(self.settings.grace_s)
        for change in await backend.poll():
            if change.state in ("started", "migrated"):
                continue  # their decisions' handlers have published these
            if change.node:
                await self.release(change.task_id, change.node)
            detail = change.detail
            if change.state == "evicted":
                who = self.settings.node or self.settings.replica
                detail = f"the executor on {who} stopped; {detail}".rstrip("; ")
            out.append(self.lifecycle(change.task_id, change.state, change.node, change.gpus, detail,
                                      change.exit_code, at=change.at))
            self.decisions.pop(change.task_id, None)
        return out

    async def stop_processes(self) -> None:
        """After the bus drained: a start that raced the stop has nothing left to publish
        on; it is stopped all the same."""
        if isinstance(self.backend, ProcessBackend):
            await self.backend.shutdown(self.settings.grace_s)

    async def stop_tasks_given_up(self) -> None:
        """On a node that was only cut off: its tasks were given up and placed again
        elsewhere while it was silent. A process whose hold on this node is gone from the
        ledger runs for nobody: it is stopped, and nothing is published (its eviction was,
        when its hold was released)."""
        backend, ledger, node = self.backend, self.ledger, self.settings.node
        if not node or not isinstance(backend, ProcessBackend) or ledger is None:
            return
        for task_id in backend.running():
            view = ledger.nodes.get(node_key(node))
            if view is not None and any(a.task_id == task_id for a in view.allocations):
                continue
            current = await ledger.read(node)  # the view may lag: ask the bucket
            if current is not None and any(a.task_id == task_id for a in current.allocations):
                continue
            log.warning("stopping %s: its hold on %s is gone (given up while the node was silent)", task_id, node)
            await backend.stop(task_id, self.settings.grace_s)
            self.decisions.pop(task_id, None)
