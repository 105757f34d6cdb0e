"""The executor service.

Consumes ``decision.made`` and carries each decision out once (``execute_decision`` with a
journal in the ``executions`` bucket), then confirms the ledger reservation (or releases it
when the action failed) and publishes ``action.executed`` / ``action.failed``. Task life
(started, finished, OOM-killed) is published on ``task.lifecycle.<task>``, and a task that
ends gives its capacity back in the ledger.

Backends: ``sim`` drives the simulated fleet hosted by the collector; ``process`` runs the
task's ``command`` as a real process with ``CUDA_VISIBLE_DEVICES`` set.

GPU health, from ``telemetry.gpu.*``:

- **pre-decommission** (:class:`~fleetpilot.executor.PreDecommissionHook`): a GPU too hot
  for too long is labelled ``cordoned`` in the topology bucket (the policy stops placing
  work there, and this executor refuses assigns to it); once drained, or when the drain
  time is over, its remaining tasks are evicted (``task.lifecycle`` ``evicted`` plus a
  ledger release, so the policy re-places them) and it is labelled ``decommissioned``. Of
  several replicas only the holder of the GPU's lock in ``hook_locks`` acts.
- **predictive maintenance** (:class:`~fleetpilot.maintenance.HealthModel`): every
  ``health_interval_s`` each GPU's window of samples is assessed; a risk at or above the
  threshold labels the GPU ``maintenance_pending`` (with ``maintenance_risk``), for the
  policy's rebalancer to migrate its tasks away. The executor publishes no decision.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args

import msgspec
from fleetpilot.contracts import (
    BUCKETS,
    ActionExecuted,
    DecisionMade,
    Event,
    GpuSample,
    HandedOver,
    HandOver,
    NodeLedger,
    NodeTelemetry,
    SimEvent,
    TaskKind,
    TaskLifecycle,
    TaskSubmitted,
    gpu_rules,
    now,
)
from fleetpilot.executor import (
    BackendError,
    Command,
    Cordon,
    DecommissionRules,
    GpuContext,
    LifecycleHook,
    PreDecommissionHook,
    ProcessBackend,
    carried_out_on,
    execute_decision,
)
from fleetpilot.ledger import LedgerStore, without_task
from fleetpilot.ledger.accounting import confirmed, moved_here
from fleetpilot.ledger.store import node_key
from fleetpilot.maintenance import MAINTENANCE_THRESHOLD, HealthModel
from fleetpilot.runtime import Bus, Retry, ServiceHost, ServiceSettings
from pydantic_settings import SettingsConfigDict

from .backends import BusSimBackend, BusTakeOver, KvExecutionJournal
from .fleet_labels import CORDONED, DECOMMISSIONED, MAINTENANCE_PENDING, UNREACHABLE, FleetLabels, LabelGate
from .hook_lock import KvHookLock

log = logging.getLogger("fleetpilot.executor")

# How far back a node's own decisions consumer starts when it is first made (a node that
# joins, or comes back after its consumer was removed): within the journal's time-to-live,
# so a decision carried out before is found there and not run again.
DECISION_REPLAY_S = next(b.ttl_s for b in BUCKETS if b.name == "executions") - 3600.0

# The decision handler publishes these itself, with the decision's ids and a deterministic
# time (so a redelivery republishes the same message); the process backend's own copies
# would be duplicates.
_PUBLISHED_BY_HANDLER = ("started", "evicted", "migrated")


class ExecutorSettings(ServiceSettings):
    """``FLEETPILOT_EXECUTOR_*``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_EXECUTOR_", extra="ignore")

    backend: Literal["sim", "process"] = "sim"
    # The node this replica carries decisions out on (a DaemonSet's NODE_NAME); empty for
    # every node, as the simulated fleet's executor, or the process backend on one machine.
    node: str = ""
    grace_s: float = 10.0
    default_duration_s: float = 120.0
    process_log_dir: str = ""
    decommission_threshold_c: float = 85.0
    decommission_hot_for_s: float = 300.0
    decommission_drain_s: float = 1800.0
    health_interval_s: float = 60.0
    health_window_s: float = 2 * 3600.0
    health_sample_every_s: float = 30.0
    health_threshold: float = MAINTENANCE_THRESHOLD
    # How often the tasks of unreachable nodes are given up, and (with ``node``) this
    # node's processes checked against the ledger.
    silent_check_s: float = 30.0


class HealthWindows:
    """The recent samples of every GPU, thinned to one per ``every_s`` and at most
    ``window_s`` old, so a large fleet's windows stay small (240 samples per GPU by default)."""

    def __init__(self, window_s: float, every_s: float) -> None:
        """Keep ``window_s`` of history, one sample per ``every_s``."""
        self._window_s = window_s
        self._every_s = every_s
        self.windows: dict[tuple[str, int], deque[GpuSample]] = {}

    def add(self, sample: GpuSample) -> None:
        """Keep ``sample`` if enough time passed since the last one kept."""
        window = self.windows.setdefault((sample.node, sample.gpu), deque())
        if window and sample.at - window[-1].at < self._every_s:
            return
        window.append(sample)
        while window and window[0].at < sample.at - self._window_s:
            window.popleft()


class _TopologyBusiness:
    """The business context from the topology bucket (GPU model and ``role`` label) with
    the pre-decommission hook and the label gate, so that assigns to a cordoned GPU are
    refused (by this replica's hook state, and by the labels for a replica started since)."""

    def __init__(self, labels: FleetLabels, hook: LifecycleHook) -> None:
        self._labels = labels
        self._hooks = [hook, LabelGate(labels)]

    def gpu_context(self, node: str, gpu: int) -> GpuContext:
        """Role, driver and allowed kinds (``contracts.gpu_rules`` of the GPU's labels) and
        model as the topology bucket has them: the rules the policies placed by."""
        rules = gpu_rules(self._labels.labels_of(node, gpu))
        return GpuContext(node=node, gpu=gpu, role=rules.role, driver_pin=rules.driver or None,
                          task_kinds=list(rules.task_kinds), model=self._labels.model_of(node, gpu))

    def hooks(self) -> Sequence[LifecycleHook]:
        """The pre-decommission hook, then the label gate."""
        return self._hooks


def resized(ledger: NodeLedger, decision: DecisionMade) -> NodeLedger | None:
    """The ledger after an executed ``resize``: the policy reserved the extra memory as a
    second hold under the resize's decision id; it is folded into the task's hold on each GPU,
    which takes the decision's new ``memory_mb`` and is confirmed. ``None`` when there is
    nothing to change (a redelivered resize, or the task has gone)."""
    sizes = {p.gpu: p.memory_mb for p in decision.placement if p.gpu >= 0}
    kept = []
    for a in ledger.allocations:
        if a.task_id == decision.task_id and a.decision_id == decision.decision_id:
            continue  # the reserved extra, now part of the hold
        if a.task_id == decision.task_id and a.gpu in sizes:
            a = msgspec.structs.replace(a, memory_mb=sizes[a.gpu], state="confirmed")
        kept.append(a)
    return None if kept == ledger.allocations else NodeLedger(node=ledger.node, allocations=kept)


def without_decision(ledger: NodeLedger, decision_id: str) -> NodeLedger | None:
    """The ledger without the holds reserved under ``decision_id`` (a failed resize gives its
    extra memory back, a failed move its target); ``None`` when it holds none."""
    kept = [a for a in ledger.allocations if a.decision_id != decision_id]
    return None if len(kept) == len(ledger.allocations) else NodeLedger(node=ledger.node, allocations=kept)


# Simulated hardware endings -> (lifecycle state, exit code as a process would report it).
_SIM_ENDINGS = {"finished": ("finished", 0), "oom_killed": ("oom_killed", 137), "task_failed": ("failed", 1)}


def build(settings: ExecutorSettings | None = None) -> ServiceHost:
    """Wire the executor."""
    settings = settings or ExecutorSettings()
    host = ServiceHost("executor", settings)
    parts: dict = {}
    # Who asked for what, so lifecycle events carry the decision they belong to.
    decisions: dict[str, DecisionMade] = {}
    windows = HealthWindows(settings.health_window_s, settings.health_sample_every_s)
    model = HealthModel(threshold=settings.health_threshold)
    rules = DecommissionRules(
        threshold_c=settings.decommission_threshold_c,
        hot_for_s=settings.decommission_hot_for_s,
        drain_s=settings.decommission_drain_s,
    )

    async def open_parts(bus: Bus) -> None:
        parts["journal"] = KvExecutionJournal(await bus.kv("executions"))
        parts["ledger"] = ledger = await LedgerStore.open(bus)
        parts["labels"] = labels = FleetLabels(await bus.kv("topology"))
        await labels.load()
        host.background(ledger.follow(), "ledger-view")
        host.background(labels.follow(), "topology-labels")
        parts["locks"] = locks = KvHookLock(await bus.kv("hook_locks"))
        parts["hook"] = hook = PreDecommissionHook(settings.replica, locks, rules=rules)
        parts["business"] = _TopologyBusiness(labels, hook)
        if settings.backend == "sim":
            parts["backend"] = BusSimBackend(bus, settings.default_duration_s)
        else:
            log_dir = Path(settings.process_log_dir) if settings.process_log_dir else None
            # A node's backend takes over the tasks that move to it from other nodes.
            take_over = BusTakeOver(bus) if settings.node else None
            parts["backend"] = ProcessBackend(node=settings.node, log_dir=log_dir, take_over=take_over)

    async def give_up_tasks() -> list[Event]:
        # The tasks run by this executor end with it: children lead their own sessions and
        # would outlive it untracked, and in a container they die with it anyway. Each is
        # stopped with grace, its holds released and ``evicted`` published while the bus is
        # still up, so the policy places it again (the process restarts with its
        # ``command``; a task that checkpoints on SIGTERM resumes from there).
        backend = parts.get("backend")
        if not isinstance(backend, ProcessBackend):
            return []
        out = await poll_backend()  # what happened before the stop, told as usual
        await backend.shutdown(settings.grace_s)
        for change in await backend.poll():
            if change.state in ("started", "migrated"):
                continue  # their decisions' handlers have published these
            if change.node:
                await release(change.task_id, change.node)
            detail = change.detail
            if change.state == "evicted":
                detail = f"the executor on {settings.node or settings.replica} stopped; {detail}".rstrip("; ")
            out.append(lifecycle(change.task_id, change.state, change.node, change.gpus, detail,
                                 change.exit_code, at=change.at))
            decisions.pop(change.task_id, None)
        return out

    async def stop_processes() -> None:
        # A start that raced the stop: nothing is left to publish it on.
        backend = parts.get("backend")
        if isinstance(backend, ProcessBackend):
            await backend.shutdown(settings.grace_s)

    host.on_startup(open_parts)
    host.on_stopping(give_up_tasks)
    host.on_shutdown(stop_processes)

    async def release(task_id: str, node: str) -> None:
        ledger: LedgerStore = parts["ledger"]
        await ledger.mutate(node_key(node), lambda cur: without_task(cur, task_id) if cur else None)

    async def recall(task_id: str, besides: str = "") -> None:
        """Learn the decision that placed ``task_id`` where this replica did not carry it
        out (another replica did, or this one before a restart): the decision id of its
        holds in the ledger (other than ``besides``, the move being carried out), and what
        the journal recorded for it. Call it before the holds are released; without it the
        task's lifecycle events carried no decision, and the feedback service could not
        judge the placement."""
        if task_id in decisions or "ledger" not in parts:
            return
        held = {a.decision_id for ledger in parts["ledger"].nodes.values() for a in ledger.allocations
                if a.task_id == task_id}
        for decision_id in sorted(held - {besides}):
            result = await parts["journal"].result(decision_id)
            if isinstance(result, ActionExecuted):
                kind = result.task_kind
                task = TaskSubmitted(task_id=task_id, kind=kind) if kind in get_args(TaskKind) else None
                decisions[task_id] = DecisionMade(
                    decision_id=decision_id, task_id=task_id, action=result.action, placement=result.placement,
                    confidence=result.confidence, policy=result.policy, shard_id=result.shard_id,
                    decided_at=result.executed_at, task=task)
                return

    def lifecycle(
        task_id: str,
        state,
        node: str,
        gpus: list[int],
        detail: str = "",
        exit_code: int | None = None,
        at: float | None = None,
        replaces: DecisionMade | None = None,
    ) -> TaskLifecycle:
        d = decisions.get(task_id)
        gpu_model = parts["labels"].model_of(node, gpus[0]) if gpus and "labels" in parts else ""
        return TaskLifecycle(
            task_id=task_id,
            state=state,
            node=node,
            gpus=gpus,
            detail=detail,
            exit_code=exit_code,
            decision_id=d.decision_id if d else "",
            policy=d.policy.name if d else "",
            shard_id=d.shard_id if d else "primary",
            confidence=d.confidence if d else 0.0,
            task_kind=d.task.kind if d and d.task else "",
            gpu_model=gpu_model,
            replaces_decision_id=replaces.decision_id if replaces else "",
            at=now() if at is None else at,
        )

    # One node's replicas read every decision on a consumer of their own and keep those for
    # their node: on a consumer shared by all nodes, a decision for one node would be
    # carried out by whichever took it, with the process backend on the wrong machine.
    @host.on(DecisionMade, consumer="executor-decisions", instance=settings.node,
             instance_start_s_ago=DECISION_REPLAY_S)
    async def on_decision(decision: DecisionMade) -> list[Event]:
        if settings.node and not carried_out_on(decision, settings.node):
            return []
        backend = parts["backend"]
        if isinstance(backend, BusSimBackend) and decision.task is not None:
            task = decision.task
            backend.describe(
                task.task_id,
                float(task.gpu_memory_mb or 1000),
                task.labels.get("growth", "flat"),
                task.expected_duration_s,
            )
        result = await execute_decision(
            decision,
            backend,
            parts["journal"],
            owner=settings.replica,
            business=parts["business"],
            grace_s=settings.grace_s,
            # A node's decisions wait in its consumer while it is cut off; by the time it
            # hears again, their capacity may have been given back and the task placed
            # elsewhere.
            still_reserved=still_reserved if settings.node else None,
        )
        if result is None:
            raise Retry("another executor replica is carrying this decision out", 2.0)
        # A redelivered decision gets the recorded result back: everything below is
        # idempotent (ledger writes converge, the events carry the recorded time and so
        # the same Nats-Msg-Id, which the stream drops as a duplicate).
        out: list[Event] = [result]
        node = decision.placement[0].node if decision.placement else ""
        if decision.action in ("migrate", "evict"):
            await recall(decision.task_id, besides=decision.decision_id)  # the placement that ends here
        if isinstance(result, ActionExecuted):
            if decision.action == "assign" and node:
                decisions[decision.task_id] = decision
                await parts["ledger"].mutate(
                    node_key(node), lambda cur: confirmed(cur, decision.task_id) if cur else None
                )
                out.append(
                    lifecycle(
                        decision.task_id,
                        "started",
                        node,
                        [p.gpu for p in decision.placement if p.gpu >= 0],
                        at=result.executed_at,
                    )
                )
            elif decision.action == "migrate" and node:
                # The policy reserved the target; the task has left its source: the holds
                # on the source nodes go, the target's become confirmed.
                for src in {p.node for p in decision.source} - {node}:
                    await release(decision.task_id, src)
                await parts["ledger"].mutate(
                    node_key(node),
                    lambda cur: moved_here(cur, decision.task_id, decision.decision_id) if cur else None,
                )
                # The placement the task left ends here: the feedback service judges it. A
                # redelivered migrate finds itself in ``decisions``: it left nothing new.
                left = decisions.get(decision.task_id)
                if left is not None and left.decision_id == decision.decision_id:
                    left = None
                decisions[decision.task_id] = decision
                out.append(lifecycle(decision.task_id, "migrated", node,
                                     [p.gpu for p in decision.placement if p.gpu >= 0], at=result.executed_at,
                                     replaces=left))
            elif decision.action == "evict":
                for src in {p.node for p in decision.source}:
                    await release(decision.task_id, src)
                # An evict names where the task was in ``source``; its placement is empty.
                src_node = decision.source[0].node if decision.source else node
                src_gpus = sorted({p.gpu for p in decision.source if p.gpu >= 0})
                out.append(lifecycle(decision.task_id, "evicted", src_node, src_gpus, at=result.executed_at))
                decisions.pop(decision.task_id, None)
            elif decision.action == "resize" and node:
                # The policy reserved the extra memory; the task's hold takes the new size.
                await parts["ledger"].mutate(
                    node_key(node), lambda cur: resized(cur, decision) if cur else None
                )
        elif decision.action == "assign" and node:
            await release(decision.task_id, node)
        elif decision.action == "migrate" and node:
            # The move failed: the task still runs at its source; give the target back. Only
            # the holds reserved under the move go: on a move within a node the source hold
            # is on the same ledger and stays.
            await parts["ledger"].mutate(
                node_key(node), lambda cur: without_decision(cur, decision.decision_id) if cur else None
            )
        elif decision.action == "resize" and node:
            # The task keeps its old share: give the reserved extra back.
            await parts["ledger"].mutate(
                node_key(node), lambda cur: without_decision(cur, decision.decision_id) if cur else None
            )
        return out

    if settings.node:
        @host.endpoint("handover", f"executor.handover.{settings.node}", HandOver)
        async def on_hand_over(request: HandOver) -> HandedOver:
            # Another node's executor carries out a move of one of this node's tasks to
            # it: the task is checkpointed and stopped here, and restarts there.
            backend = parts["backend"]
            if not isinstance(backend, ProcessBackend):
                return HandedOver(task_id=request.task_id, ok=False,
                                  error=f"the {settings.backend} backend hands no task over")
            try:
                command, env = await backend.hand_over(request.task_id, request.grace_s)
            except BackendError as error:
                return HandedOver(task_id=request.task_id, ok=False, error=str(error))
            decisions.pop(request.task_id, None)
            log.info("handed %s over for its move from %s", request.task_id, settings.node)
            return HandedOver(task_id=request.task_id, ok=True, command=command, env=env)

    async def still_reserved(decision: DecisionMade) -> bool:
        """Whether the ledger still holds what ``decision`` reserved on its node."""
        node = decision.placement[0].node if decision.placement else ""
        current = await parts["ledger"].read(node) if node else None
        return current is not None and any(a.decision_id == decision.decision_id for a in current.allocations)

    @host.every(settings.silent_check_s)
    async def give_up_unreachable_nodes() -> list[Event]:
        # The topology service labels every GPU of a node whose collector went silent: its
        # tasks are lost with it (nobody there can checkpoint or stop them). One replica,
        # the holder of the node's lock, releases their holds and publishes ``evicted``, and
        # the policy places them again. A move to that node that will not happen only gives
        # its reservation back: the task runs on where it is.
        labels: FleetLabels | None = parts.get("labels")
        ledger: LedgerStore | None = parts.get("ledger")
        if labels is None or ledger is None:
            return []
        out: list[Event] = []
        for key, topo in list(labels.nodes.items()):
            held = ledger.nodes.get(key)
            if not held or not held.allocations or not topo.gpus:
                continue
            if not all(g.labels.get(UNREACHABLE) == "true" for g in topo.gpus):
                continue
            if not await parts["locks"].acquire(f"unreachable.{key}", settings.replica, ttl_s=600.0):
                continue
            for task_id in sorted({a.task_id for a in held.allocations}):
                here = [a for a in held.allocations if a.task_id == task_id]
                runs_elsewhere = any(a.task_id == task_id and a.state == "confirmed"
                                     for other, at in ledger.nodes.items() if other != key for a in at.allocations)
                await recall(task_id)
                await release(task_id, topo.node)
                if runs_elsewhere and all(a.state != "confirmed" for a in here):
                    log.warning("gave back %s's reservation on unreachable %s; it runs on", task_id, topo.node)
                    continue
                log.warning("%s taken as lost with unreachable %s", task_id, topo.node)
                out.append(lifecycle(task_id, "evicted", topo.node, sorted({a.gpu for a in here if a.gpu >= 0}),
                                     detail=f"node {topo.node} unreachable (its collector went silent): the task "
                                            f"is taken as lost with it"))
                decisions.pop(task_id, None)
        return out

    @host.every(settings.silent_check_s)
    async def stop_tasks_given_up() -> None:
        # The other side of the above, on a node that was only cut off: its tasks were given
        # up and placed again elsewhere while it was silent. A process whose hold on this
        # node is gone from the ledger runs for nobody: it is stopped, and nothing is
        # published (its eviction was, when its hold was released).
        backend = parts.get("backend")
        if not settings.node or not isinstance(backend, ProcessBackend):
            return
        for task_id in backend.running():
            view = parts["ledger"].nodes.get(node_key(settings.node))
            if view is not None and any(a.task_id == task_id for a in view.allocations):
                continue
            current = await parts["ledger"].read(settings.node)  # the view may lag: ask the bucket
            if current is not None and any(a.task_id == task_id for a in current.allocations):
                continue
            log.warning("stopping %s: its hold on %s is gone (given up while the node was silent)",
                        task_id, settings.node)
            await backend.stop(task_id, settings.grace_s)
            decisions.pop(task_id, None)

    @host.on_core("sim.event.*", SimEvent, queue="executor")
    async def on_sim_event(event: SimEvent) -> list[Event]:
        # The simulated hardware ended a task: it finished, ran out of memory, or its GPU hit
        # a fatal XID. Either way its capacity goes back to the ledger.
        ending = _SIM_ENDINGS.get(event.kind)
        if event.task_id is None or ending is None:
            return []
        state, exit_code = ending
        await recall(event.task_id)
        if event.node:
            await release(event.task_id, event.node)
        out = [lifecycle(event.task_id, state, event.node, [event.gpu] if event.gpu >= 0 else [],
                         event.detail, exit_code)]
        decisions.pop(event.task_id, None)
        return out

    @host.every(1.0)
    async def poll_backend() -> list[Event]:
        backend = parts.get("backend")
        if backend is None:
            return []
        out: list[Event] = []
        for change in await backend.poll():
            if change.state in _PUBLISHED_BY_HANDLER:
                continue
            await recall(change.task_id)
            if change.state in ("finished", "oom_killed", "failed") and change.node:
                await release(change.task_id, change.node)
            out.append(
                lifecycle(
                    change.task_id,
                    change.state,
                    change.node,
                    change.gpus,
                    change.detail,
                    change.exit_code,
                    at=change.at,
                )
            )
            if change.state in ("finished", "oom_killed", "failed"):
                decisions.pop(change.task_id, None)
        return out

    def tasks_on(node: str, gpu: int) -> list[str]:
        """Tasks holding a share of one GPU in the ledger view (reserved ones included:
        they are about to run there)."""
        ledger = parts["ledger"].nodes.get(node_key(node))
        return sorted({a.task_id for a in ledger.allocations if a.gpu == gpu}) if ledger else []

    async def carry_out(command: Command) -> list[Event]:
        """Do what the pre-decommission hook asks; only the lock holder gets here."""
        labels: FleetLabels = parts["labels"]
        if isinstance(command, Cordon):
            await labels.set(command.node, command.gpu, {CORDONED: "true"})
            log.warning("cordoned %s/%d: %s", command.node, command.gpu, command.reason)
            return []

        async def evict(task_id: str) -> TaskLifecycle | None:
            try:
                await parts["backend"].stop(task_id, settings.grace_s)
            except BackendError as error:
                log.error("could not evict %s from %s/%d: %s", task_id, command.node, command.gpu, error)
                return None
            await recall(task_id)
            await release(task_id, command.node)
            event = lifecycle(
                task_id,
                "evicted",
                command.node,
                [command.gpu],
                detail=f"GPU {command.node}/{command.gpu} decommissioned: {command.reason}",
            )
            decisions.pop(task_id, None)
            return event

        evicted = await asyncio.gather(*(evict(t) for t in command.evict))
        await labels.set(command.node, command.gpu, {CORDONED: "true", DECOMMISSIONED: "true"})
        log.warning("decommissioned %s/%d (%d tasks evicted)", command.node, command.gpu, len(command.evict))
        return [e for e in evicted if e is not None]

    # Every replica takes every sample (no queue group): the hook's state machine and the
    # cordon check in ``before_assign`` need the whole stream on each replica, and the
    # hook lock makes sure one replica acts.
    @host.on_core(f"telemetry.gpu.{settings.node or '*'}", NodeTelemetry)
    async def on_telemetry(batch: NodeTelemetry) -> list[Event]:
        hook: PreDecommissionHook = parts["hook"]  # start-up hooks run before any subscription
        out: list[Event] = []
        for sample in batch.gpus:
            windows.add(sample)
            if parts["labels"].labels_of(sample.node, sample.gpu).get(DECOMMISSIONED) == "true":
                continue  # out of service: nothing left to do, even for a replica started since
            for command in await hook.observe(sample, tasks_on(sample.node, sample.gpu)):
                out.extend(await carry_out(command))
        return out

    @host.every(settings.health_interval_s)
    async def assess_health() -> None:
        labels: FleetLabels | None = parts.get("labels")
        if labels is None:
            return
        for (node, gpu), window in list(windows.windows.items()):
            if len(window) < 2 or labels.labels_of(node, gpu).get(MAINTENANCE_PENDING) == "true":
                continue
            assessment = model.assess(list(window))
            if not assessment.maintenance_pending:
                continue
            # Every replica assesses the same samples; the label write is idempotent, so
            # no lock is needed here.
            if await labels.set(
                node,
                gpu,
                {MAINTENANCE_PENDING: "true", "maintenance_risk": f"{assessment.failure_probability:.2f}"},
            ):
                top = max(assessment.contributions, key=lambda k: assessment.contributions[k])
                log.warning(
                    "maintenance pending on %s/%d: risk %.2f, mostly %s",
                    node,
                    gpu,
                    assessment.failure_probability,
                    top,
                )

    return host


def main() -> None:
    """Console entry point ``fleetpilot-executor``."""
    build().main()
