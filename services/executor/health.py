"""What the executor does for the health of GPUs and nodes, on top of ``ExecutorReplica``.

- **pre-decommission** (:class:`~fleetpilot.executor.PreDecommissionHook`): a GPU too hot
  for too long is labelled ``cordoned`` in the topology bucket (the policy stops placing
  work there, and the executor refuses assigns to it); once drained, or when the drain time
  is over, its remaining tasks are evicted (``task.lifecycle`` ``evicted`` plus a ledger
  release, so the policy re-places them) and it is labelled ``decommissioned``. Of several
  replicas only the holder of the GPU's lock in ``hook_locks`` acts.
- **predictive maintenance** (:class:`~fleetpilot.maintenance.HealthModel`): every
  ``health_interval_s`` each GPU's window of samples is assessed; a risk at or above the
  threshold labels the GPU ``maintenance_pending`` (with ``maintenance_risk``), for the
  policy's rebalancer to migrate its tasks away. The executor publishes no decision.
- **unreachable nodes**: the tasks of a node the topology service labelled ``unreachable``
  are given up (holds released, ``evicted`` published) by the holder of the node's lock.
"""

from __future__ import annotations

import asyncio
import logging

from fleetpilot.contracts import Event, GpuSample, NodeTelemetry, TaskLifecycle, marked_condition
from fleetpilot.executor import BackendError, Command, Cordon
from fleetpilot.ledger.accounting import on_board
from fleetpilot.ledger.store import node_key
from fleetpilot.maintenance import HealthModel
from fleetpilot.maintenance.windows import HealthWindows

from .fleet_labels import CORDONED, DECOMMISSIONED, MAINTENANCE_PENDING, UNREACHABLE
from .metrics import ExecutorMetrics
from .replica import ExecutorReplica
from .settings import ExecutorSettings

log = logging.getLogger("fleetpilot.executor")

MAINTENANCE_BOARD = "maintenance_board"
"""The label naming the board (NVML uuid) that ``maintenance_pending`` was set for."""
GPUS_PER_TURN = 64
"""GPUs a health round assesses between two turns of the event loop (tens of milliseconds)."""


def _as_risk(label: str) -> float:
    """The failure probability a ``maintenance_risk`` label says; 1 when it says none (an
    operator set ``maintenance_pending`` by hand, or wrote something else)."""
    try:
        risk = float(label)
    except ValueError:
        return 1.0
    return risk if 0.0 <= risk <= 1.0 else 1.0


class GpuHealth(ExecutorReplica):
    """The replica with the GPUs' recent samples, their health model, and what both ask."""

    def __init__(self, settings: ExecutorSettings, metrics: ExecutorMetrics | None = None) -> None:
        """The replica, with empty windows and the health model at the set threshold."""
        super().__init__(settings, metrics)
        self.windows = HealthWindows(settings.health_window_s, settings.health_sample_every_s)
        self.model = HealthModel(threshold=settings.health_threshold)

    def forget_node(self, node: str) -> None:
        """As the replica does, and the node's samples go too: assessed, the evidence of
        the node before it was forgotten flagged the new one for maintenance."""
        super().forget_node(node)
        self.windows.forget_node(node)

    def tasks_on(self, node: str, gpu: int, uuid: str = "") -> list[str]:
        """Tasks holding a share of one GPU in the ledger view (reserved ones included:
        they are about to run there): of the board ``uuid``, which reads at index ``gpu`` now,
        by the board their holds name, wherever they were reserved (``on_board``; by index for
        holds that name none)."""
        ledger = self.ledger.nodes.get(node_key(node)) if self.ledger is not None else None
        return sorted({a.task_id for a in ledger.allocations if on_board(a, gpu, uuid)}) if ledger else []

    async def observe(self, batch: NodeTelemetry) -> list[Event]:
        """Keep a node's samples and run the pre-decommission hook on each GPU."""
        assert self.hook is not None and self.labels is not None  # opened before any subscription
        out: list[Event] = []
        for sample in batch.gpus:
            self.windows.add(sample)
            # The board's labels, wherever the topology entry has it: an entry behind a
            # renumbering holds another board at this index. A sample NVML could not read is
            # of the board last read at its index.
            board = sample.uuid or self.hook.boards.get(sample.node, sample.gpu) or ""
            if self.labels.labels_of(sample.node, sample.gpu, uuid=board).get(DECOMMISSIONED) == "true":
                continue  # out of service: nothing left to do, even for a replica started since
            # Its drain counts, and its pull evicts, the tasks held on the board: by index, a
            # hot board renumbered counted those of the board that took its number.
            for command in await self.hook.observe(sample, self.tasks_on(sample.node, sample.gpu, board)):
                out.extend(await self.decommission(command))
        return out

    async def decommission(self, command: Command) -> list[Event]:
        """Do what the pre-decommission hook asks; only the lock holder gets here."""
        assert self.labels is not None and self.backend is not None
        backend = self.backend
        if isinstance(command, Cordon):
            await self._label(command.node, command.gpu, {CORDONED: "true"}, command.uuid)
            log.warning("cordoned %s/%d (%s): %s", command.node, command.gpu, command.uuid or "no uuid", command.reason)
            return []

        async def evict(task_id: str) -> TaskLifecycle | None:
            try:
                await backend.stop(task_id, self.settings.grace_s)
            except BackendError as error:
                log.error("could not evict %s from %s/%d: %s", task_id, command.node, command.gpu, error)
                return None
            if self.end_untold(task_id):
                return None  # it ended by itself meanwhile: the backend's poll tells that end
            await self.recall(task_id)
            if not await self.release(task_id, command.node):
                return None  # it ended meanwhile, and its end was told
            event = self.lifecycle(task_id, "evicted", command.node, [command.gpu],
                                   detail=f"GPU {command.node}/{command.gpu} decommissioned: {command.reason}")
            self.decisions.pop(task_id, None)
            return event

        # A task that only holds a reservation here (a move's target) and runs elsewhere is not
        # on this GPU: stopped, it was stopped where it runs (or, on another node's executor,
        # told evicted while it ran on, and placed a second time). Its move is refused by the
        # labels (``LabelGate``) and its reservation goes back on that path.
        running = [t for t in command.evict
                   if not self.only_reserved_here(t, command.node, command.gpu, command.uuid)]
        for task_id in sorted(set(command.evict) - set(running)):
            log.info("%s only holds a reservation on %s/%d and runs elsewhere: not evicted with it",
                     task_id, command.node, command.gpu)
        evicted = await asyncio.gather(*(evict(t) for t in running))
        await self._label(command.node, command.gpu, {CORDONED: "true", DECOMMISSIONED: "true"}, command.uuid)
        log.warning("decommissioned %s/%d (%s; %d tasks evicted)", command.node, command.gpu,
                    command.uuid or "no uuid", len(running))
        return [e for e in evicted if e is not None]

    def only_reserved_here(self, task_id: str, node: str, gpu: int, uuid: str = "") -> bool:
        """Whether ``task_id`` holds only reservations on ``node``/``gpu`` (the board ``uuid``
        reading there now, as ``tasks_on`` finds its holds) and runs, its hold confirmed, on
        another GPU (of this node or another)."""
        if self.ledger is None:
            return False
        held = self.ledger.nodes.get(node_key(node))
        here = [a for a in (held.allocations if held else ()) if a.task_id == task_id and on_board(a, gpu, uuid)]
        if not here or any(a.state == "confirmed" for a in here):
            return False
        return any(a.task_id == task_id and a.state == "confirmed"
                   and (key != node_key(node) or not on_board(a, gpu, uuid))
                   for key, other in self.ledger.nodes.items() for a in other.allocations)

    async def _label(self, node: str, gpu: int, wanted: dict[str, str], uuid: str = "") -> None:
        """Label a GPU (the board ``uuid``, at index ``gpu`` now) for the hook. The hook emits
        each command once: a write that fails now is kept and written again on the next
        health round (``apply_pending``), and the evictions already done are told rather
        than lost with a raised error."""
        assert self.labels is not None
        try:
            await self.labels.set(node, gpu, wanted, uuid=uuid)
        except Exception as error:  # noqa: BLE001 - kept to be written again
            log.error("labels %s of %s/%d not written now (%s: %s); written again on the next round",
                      wanted, node, gpu, type(error).__name__, error)

    async def assess_health(self) -> None:
        """Label ``maintenance_pending`` each GPU whose window the health model finds at risk."""
        labels = self.labels
        if labels is None:
            return
        self.windows.forget_silent()
        await labels.apply_pending()
        self.take_overrides()
        risks: dict[tuple[str, int], float] = {}
        for assessed, (node, gpu, window) in enumerate(self.windows.current()):
            if assessed and assessed % GPUS_PER_TURN == 0:
                # Assessed at once, the openb fleet's 6,212 full windows (0.65 ms each) held
                # the loop 4 s a round: no decision carried out, no sample read meanwhile.
                await asyncio.sleep(0)
            if len(window) < 2:
                continue
            # The labels of the window's board: by index alone, a topology entry behind a
            # renumbering gave the board now at this index another board's flag, taken for
            # a replaced board's and lifted (``_clear_if_replaced``).
            current = labels.labels_of(node, gpu, uuid=HealthWindows.board(window))
            if current.get(MAINTENANCE_PENDING) == "true":
                # Not assessed again while it waits for its board's replacement: shown at
                # the risk it was flagged at.
                risks[node, gpu] = _as_risk(current.get("maintenance_risk", ""))
                await self._clear_if_replaced(node, gpu, window, current)
                continue
            try:
                risks[node, gpu] = await self._label_if_at_risk(node, gpu, list(window))
            except Exception:  # noqa: BLE001 - one GPU's failure must not skip the GPUs after it
                # The next round tries this GPU again.
                log.exception("could not assess the health of %s/%d", node, gpu)
        self.metrics.assessed(risks)

    def take_overrides(self) -> None:
        """Read afresh the history of each GPU whose ``maintenance_pending`` someone else set
        otherwise (an operator's ``"false"``): the evidence that flagged it is spent, and
        assessed again it would flag the GPU again at once. The GPU is the topology entry's at
        that index: the board the entry names there, wherever the samples read it now."""
        if self.labels is None:
            return
        overridden, self.labels.overridden = self.labels.overridden, []
        for node, gpu, label, _ in overridden:
            if label == MAINTENANCE_PENDING:
                topo = self.labels.nodes.get(node_key(node))
                uuid = next((g.uuid for g in topo.gpus if g.index == gpu), "") if topo else ""
                self.windows.drop(node, gpu, uuid)

    async def _clear_if_replaced(self, node: str, gpu: int, window, current) -> None:
        """Take a GPU flagged for maintenance back into service once its board was replaced:
        the label was of the board flagged (``maintenance_board``), and another reports now."""
        flagged, board = current.get(MAINTENANCE_BOARD, ""), HealthWindows.board(window)
        if not flagged or not board or board == flagged:
            return
        assert self.labels is not None
        if await self.labels.set(node, gpu, {MAINTENANCE_PENDING: "false", MAINTENANCE_BOARD: board}, uuid=board):
            log.warning("%s/%d: board %s replaced by %s; back in service", node, gpu, flagged, board)

    async def _label_if_at_risk(self, node: str, gpu: int, window: list[GpuSample]) -> float:
        """Assess the GPU's window, label it ``maintenance_pending`` if it is at risk; its
        failure probability."""
        assert self.labels is not None
        assessment = self.model.assess(window)
        if not assessment.maintenance_pending:
            return assessment.failure_probability
        # Every replica assesses the same samples; the label write is idempotent, so
        # no lock is needed here. The board is named, so that its replacement lifts the label.
        risk = f"{assessment.failure_probability:.2f}"
        flagged = {MAINTENANCE_PENDING: "true", "maintenance_risk": risk}
        if board := HealthWindows.board(window):
            flagged[MAINTENANCE_BOARD] = board
        if await self.labels.set(node, gpu, flagged, uuid=board):
            top = max(assessment.contributions, key=lambda k: assessment.contributions[k])
            log.warning("maintenance pending on %s/%d: risk %.2f, mostly %s", node, gpu,
                        assessment.failure_probability, top)
        return assessment.failure_probability

    async def give_up_unreachable_nodes(self) -> list[Event]:
        """The tasks of a node whose GPUs the topology service labelled ``unreachable`` (its
        collector went silent) are lost with it: nobody there can checkpoint or stop them.
        One replica, the holder of the node's lock, releases their holds and publishes
        ``evicted``, and the policy places them again. A move to that node that will not
        happen only gives its reservation back: the task runs on where it is."""
        labels, ledger, locks = self.labels, self.ledger, self.locks
        if labels is None or ledger is None or locks is None:
            return []
        out: list[Event] = []
        for key, topo in list(labels.nodes.items()):
            held = ledger.nodes.get(key)
            if not held or not held.allocations:
                continue
            if marked_condition(topo) != UNREACHABLE:
                continue
            if not await locks.acquire(f"unreachable.{key}", self.settings.replica, ttl_s=600.0):
                continue
            for task_id in sorted({a.task_id for a in held.allocations}):
                here = [a for a in held.allocations if a.task_id == task_id]
                runs_elsewhere = any(a.task_id == task_id and a.state == "confirmed"
                                     for other, at in ledger.nodes.items() if other != key for a in at.allocations)
                await self.recall(task_id)
                await self.release(task_id, topo.node)
                if runs_elsewhere and all(a.state != "confirmed" for a in here):
                    log.warning("gave back %s's reservation on unreachable %s; it runs on", task_id, topo.node)
                    continue
                log.warning("%s taken as lost with unreachable %s", task_id, topo.node)
                out.append(self.lifecycle(task_id, "evicted", topo.node, sorted({a.gpu for a in here if a.gpu >= 0}),
                                          detail=f"node {topo.node} unreachable (its collector went silent): the "
                                                 f"task is taken as lost with it"))
                self.decisions.pop(task_id, None)
        return out
