"""Tasks that stop and wait to be placed again.

* A ``vip`` task that fits nowhere preempts the cheapest set of ``best_effort`` tasks on one
  node (``preempt.preemptions``, confirmed with the routed policy): their ``pending`` entries
  are written first, each with its re-placement id, then the ``evict`` decisions go out.
  Where no such set makes room and ``vip_evicts_standard`` is on, ``standard`` tasks whose
  contracts spare an eviction (``preempt.spares_an_eviction``) are candidates too.
* A task the executor evicted without a decision of ours (a decommissioned GPU) and a task
  whose assign the executor failed or refused are queued again under their next
  ``<task>.assign.<g>`` (``requeue``); a task refused more than ``refused_replacements`` times
  is given up (``given_up``: ``task.rejected``).
* A task killed by an OOM is queued again the same way, to start over (killed alone on its
  GPUs, asking more than they have), up to ``oom_restarts`` times; killed once more, it is given
  up (``restart_after_oom``, ``oom_given_up``).

Both limits count their own failures (``count_failure``, the ``placement_failures`` bucket:
``restart_limits``), not placements: a task preempted or moved off a failing GPU is placed
again through no fault of its own.
"""

from __future__ import annotations

import logging
import math

import msgspec
from fleetpilot.contracts import (
    ActionFailed,
    DecisionMade,
    PolicyRef,
    TaskAdmitted,
    TaskLifecycle,
    TaskRejected,
    now,
)
from fleetpilot.ledger.store import node_key
from fleetpilot.policy import PolicyDecision
from fleetpilot.policy.preempt import (
    Preemption,
    Requeue,
    Victim,
    assign_id,
    encode_pending,
    evict_confidence,
    evict_decision_id,
    eviction_cost,
    preemptions,
    reassign_decision_id,
    spares_an_eviction,
)
from fleetpilot.policy.rebalance import generation, run_counted_from, run_progress_s
from fleetpilot.policy.restart_limits import FailureKind, PlacementFailures, decode_failures, encode_failures
from fleetpilot.runtime import CasConflict, KeyValue, Retry

from .replica import PEAK_HEADROOM, ReplicaState

log = logging.getLogger("fleetpilot.policy")


class Evictions(ReplicaState):
    """Tasks stopped to be placed again: the victims of a vip's preemption, a task the
    executor evicted on its own, an assign it failed or refused."""

    # ---- tasks the executor evicted on its own ----------------------------------------------
    async def requeue_evicted(
        self, life: TaskLifecycle, pending: KeyValue, ledger: KeyValue
    ) -> Requeue | None:
        """Queue a task the executor evicted without a decision of ours (its GPU was
        decommissioned) for a new placement (``requeue``).

        Evicted by a decision of ours, it waits in ``pending`` already, and that entry is
        touched (written again as it is): a round may be giving it up this moment, its
        eviction timed out on a view that still showed the holds, and its delete at the
        revision it judged then fails, so the task is placed instead of lost. A write in
        between (that round's delete) has the event judged again, and then queued here."""
        key = node_key(life.task_id)
        entry = await pending.get(key)
        if entry is not None and entry.value:
            try:
                await pending.update(key, entry.value, entry.revision)
            except CasConflict as exc:
                raise Retry(f"pending {key} changed while {life.task_id} was evicted; judged again", 0.2) from exc
            return None
        return await self.requeue(
            life.task_id, life.decision_id, life.at,
            life.detail or f"evicted by the executor from {life.node} {life.gpus}", pending, ledger,
        )

    async def requeue_failed(
        self, failed: ActionFailed, pending: KeyValue, ledger: KeyValue
    ) -> Requeue | None:
        """Queue again a task whose assign the executor could not carry out; it released the
        hold. A passing failure (``retryable``: the backend did not answer) is retried every
        time. A refusal (a business rule, a GPU cordoned or reserved since the decision) is
        retried ``refused_replacements`` times: called once ``given_up`` has said it is not
        given up."""
        if failed.action != "assign":
            return None
        what = "failed" if failed.retryable else "refused"
        return await self.requeue(
            failed.task_id, failed.decision_id, failed.failed_at, f"assign {what}: {failed.error}",
            pending, ledger, avoid_node=next((p.node for p in failed.placement), ""),
        )

    async def oom_given_up(self, life: TaskLifecycle, failures: KeyValue) -> TaskRejected | None:
        """The ``task.rejected`` that tells the submitter a task an OOM killed will not be
        placed again (which also ends its contract): this kill, counted in ``failures``, is
        one more than ``oom_restarts``; ``None`` for any other event."""
        if life.state != "oom_killed":
            return None
        # A kill the executor could not tie to a decision is named by where and when it
        # happened, which a redelivery repeats.
        kills = await self.count_failure(failures, life.task_id, "oom_killed",
                                         life.decision_id or f"{life.node}@{life.at:.6f}")
        if kills <= self.settings.oom_restarts:
            return None
        g = generation(life.task_id, life.decision_id) if life.decision_id else 1
        return await self.rejection(
            life.task_id, life.at,
            f"killed by an OOM {kills} times, last on {life.node} (placement {g}), past the "
            f"{self.settings.oom_restarts} restarts allowed (oom_restarts): not placed again",
        )

    async def count_failure(self, failures: KeyValue, task_id: str, kind: FailureKind, placement: str) -> int:
        """Count ``placement`` of ``task_id`` as ended by ``kind`` in the
        ``placement_failures`` bucket; how many of its placements ended so, this one
        included. Once however often its event is delivered, and by compare-and-set, so two
        replicas counting at once lose neither. A value that does not decode (a hand edit) is
        counted again from this failure, with a warning."""
        key = node_key(task_id)
        for _ in range(20):
            entry = await failures.get(key)
            known = PlacementFailures()
            if entry is not None and entry.value:
                try:
                    known = decode_failures(entry.value)
                except msgspec.DecodeError as exc:
                    log.warning("placement_failures %s unreadable (%s): counted again from now", key, exc)
            updated = known.with_failure(kind, placement)
            if updated is None:
                return len(known.of(kind))
            try:
                if entry is None or not entry.value:
                    await failures.create(key, encode_failures(updated))
                else:
                    await failures.update(key, encode_failures(updated), entry.revision)
            except CasConflict:
                continue
            return len(updated.of(kind))
        raise Retry(f"placement_failures {key} kept changing", 0.2)

    async def rejection(self, task_id: str, at: float, reason: str) -> TaskRejected:
        """The ``task.rejected`` (code ``infeasible``) that gives up an admitted task, naming
        its contract's tenant: the sla service ends only the contract of the tenant a
        rejection names: read fresh (``Admissions.fetch``) when the bucket's watch has not
        delivered the contract yet."""
        adm = await self.admissions.fetch(task_id) if self.admissions is not None else None
        return TaskRejected(task_id=task_id, tenant=adm.tenant if adm else "", code="infeasible", reason=reason,
                            rejected_at=at)

    async def restart_after_oom(self, life: TaskLifecycle, pending: KeyValue, ledger: KeyValue) -> Requeue | None:
        """Queue a task an OOM killed (not given up: ``oom_given_up``) to start over, as its
        Job would restart it, asking at least ``oom_floor_mb``; read before its samples are
        forgotten. The rest is ``requeue``'s: a task already waiting in ``pending`` (evicted,
        its end overtaking its eviction) is placed again by that entry, and a redelivered or
        stale kill queues nothing."""
        floor = self.oom_floor_mb(life)
        return await self.requeue(
            life.task_id, life.decision_id, life.at,
            f"killed by an OOM on {life.node} {life.gpus}: started over"
            + (f", asking at least {floor} MB per GPU" if floor else ""),
            pending, ledger, oom_floor_mb=floor,
        )

    def oom_floor_mb(self, life: TaskLifecycle) -> int:
        """What a task killed by an OOM asks at least per GPU, placed again. Killed alone on
        its GPUs (nobody else took the memory), it needs more than they have, and more than
        it was seen to hold: the larger, times ``PEAK_HEADROOM``, as the fingerprinter folds
        the kill into its signature's floor. Killed beside other tasks, 0: its fingerprint,
        told that floor, asks for it (asking more than it held as well was measured in the
        fleet benchmark and cost more queue than it saved OOMs: the policy README)."""
        topo = self.fleet.nodes.get(life.node)
        tenants = self.ledger.nodes.get(life.node)
        others = {a.gpu for a in tenants.allocations if a.task_id != life.task_id} if tenants else set()
        if topo is None or not life.gpus or others & set(life.gpus):
            return 0
        room = min((g.memory_mb for g in topo.gpus if g.index in life.gpus), default=0)
        samples = self.usage.get(life.task_id) or ()
        held = max((mb for _, mb in samples), default=0.0) / len(life.gpus)
        return int(math.ceil(max(held, room) * PEAK_HEADROOM))

    async def given_up(self, failed: ActionFailed, failures: KeyValue) -> TaskRejected | None:
        """The ``task.rejected`` that tells the submitter a task will not run: its assign was
        refused (counted in ``failures``) once more than ``refused_replacements`` allows; a
        passing failure (``retryable``) counts toward nothing. The policy applies the same
        rules as the executor, from the topology's labels, so a placement made after the
        labels changed avoids the refusing GPU; a refusal that repeats beyond that comes from a
        rule the labels do not carry, and placing again would only be refused again."""
        if failed.action != "assign" or failed.retryable:
            return None
        refusals = await self.count_failure(failures, failed.task_id, "refused", failed.decision_id)
        if refusals <= self.settings.refused_replacements:
            return None
        return await self.rejection(
            failed.task_id, failed.failed_at,
            f"refused by the executor {refusals} times, last as {failed.decision_id}: {failed.error}",
        )

    async def requeue(
        self, task_id: str, decision_id: str, at: float, reason: str,
        pending: KeyValue, ledger: KeyValue, avoid_node: str = "", oom_floor_mb: int = 0,
    ) -> Requeue | None:
        """Queue ``task_id``, whose placement ``decision_id`` ended at ``at``, for a new one:
        its admission goes to ``pending`` with a ``requeue`` note naming
        ``<task>.assign.<g+1>`` (and ``avoid_node``, ``oom_floor_mb``), created only if the task has no entry
        (create-only: a redelivered event, or another replica, finds it and stops). The
        note, or ``None`` when there is nothing to do:

        * the task already has an entry (the policy's own eviction, an earlier delivery of
          this event, a replica placing it right now);
        * it holds capacity somewhere (already placed again, or moving: a fresh read of the
          ledger, since the view may lag the executor's release), other than under
          ``decision_id`` itself, whose holds are on their way back (an expired reservation
          is failed first, and given back after);
        * the event is stale: the executor took the task's next assign after it;
        * its admission is unknown (no ``contract.<task>``, not placed by this replica).
        """
        key = node_key(task_id)
        entry = await pending.get(key)
        if entry is not None and entry.value:
            return None
        for node in await ledger.keys():
            # Read as the ledger store reads it: one node's value that does not decode is
            # rebuilt from what is known of it (``LedgerStore.rebuilt``), not raised, which
            # failed the re-queue of every task in the fleet for as long as it stayed.
            held = self.ledger.decoded(node, await ledger.get(node))
            if held is None:
                continue
            if any(a.task_id == task_id and a.decision_id != decision_id for a in held.allocations):
                log.info("%s (%s) holds capacity on %s: not queued again", task_id, reason, node)
                return None

        # g is the placement the executor ended. The event names its decision when the
        # evicting replica carried that placement out itself (else g starts at 1); the
        # executor's journal then says which later ``<task>.assign.<g>`` it has already taken
        # (a re-used id would be dropped by the stream's duplicate window and the journal).
        # One it took after this eviction means the eviction has been dealt with already (a
        # late redelivery, the task placed again since, perhaps finished): nothing to do.
        g = generation(task_id, decision_id) if decision_id else 1
        for _ in range(1000):
            taken = await self.taken_at(assign_id(task_id, g + 1))
            if taken is None:
                break
            if taken >= at:
                log.info("stale news of %s (%s): placed again as %s since", task_id, reason, assign_id(task_id, g + 1))
                return None
            g += 1
        adm = await self.admissions.fetch(task_id) if self.admissions is not None else None
        if adm is None:
            log.warning("%s (%s): its admission is unknown, not queued again", task_id, reason)
            return None
        note = Requeue(decision_id=assign_id(task_id, g + 1), at=now(), reason=reason,
                       bridge_floor_mb=await self.restore_floor_mb(adm.task), avoid_node=avoid_node,
                       oom_floor_mb=oom_floor_mb)
        try:
            await pending.create(key, encode_pending(adm, note))
        except CasConflict:
            return None  # queued meanwhile: by another delivery, a replica, or a preemption
        log.warning("%s (%s): queued again as %s", task_id, note.reason, note.decision_id)
        return note

    # ---- preemption -------------------------------------------------------------------------
    def victims(self, exclude: set[str], *, standard: bool = False) -> list[Victim]:
        """Running tasks that a vip may preempt: tier known to be ``best_effort``, and with
        ``standard`` the ``standard`` ones whose contract spares an eviction
        (``spares_an_eviction``: a run that resumes, its deadline kept through its pause and a
        whole queue-time SLA's wait)."""
        assert self.admissions is not None
        at = now()
        out = []
        for running in self.running():
            if running.task_id in exclude:
                continue
            adm = self.admissions.of(running.task_id)
            if adm is None or adm.contract.tier not in ("best_effort", "standard"):
                continue
            declared = adm.task.expected_duration_s or 0.0
            left = max(declared - (at - run_counted_from(running)), 0.0) if declared else None
            if adm.contract.tier == "standard" and not (standard and spares_an_eviction(
                    at=at, resumes=adm.task.resumable, left_s=left,
                    pause_s=self.checkpoint_pause_s(max((a.memory_mb for a in running.allocations), default=0)),
                    deadline=adm.contract.deadline, max_queue_s=adm.contract.max_queue_s)):
                continue
            out.append(Victim(running, adm, eviction_cost(running, at, self.settings.preempt_restart_s,
                                                          resumes=adm.task.resumable), left_s=left or 0.0))
        return out

    def preemption_for(self, adm: TaskAdmitted, leaving: frozenset[str] = frozenset()
                       ) -> tuple[Preemption, PolicyDecision] | None:
        """The cheapest preemption after which the routed policy places the vip task, among
        tasks not ``leaving`` already (evicted for another vip, or by the executor): their
        room is promised elsewhere, and evicting them again frees nothing. Among best_effort
        tasks first; then, with ``vip_evicts_standard``, among them and the standard tasks
        whose contracts spare an eviction.

        Tried for what ``place`` asks, in its order: the predicted peak first, then a smooth
        grower's ask (its bridge). The victims are chosen for that same memory: chosen for
        the ask alone, they would free too little for a peak the policy then looks for, and
        the vip would never preempt."""
        policies = self.active.current
        name, _ = policies.route(adm.task)
        # One read of the candidates: best_effort work first; standard work spared by its
        # contract (there only when the operator allows it) only where that fails.
        candidates = self.victims({adm.task.task_id} | leaving, standard=self.settings.vip_evicts_standard)
        best_effort = [v for v in candidates if v.admitted.contract.tier == "best_effort"]
        rounds = [best_effort] if len(best_effort) == len(candidates) else [best_effort, candidates]
        for victims in rounds:
            for req in self.requests(adm.task):
                wanted = msgspec.structs.replace(adm.task, gpu_memory_mb=req.gpu_memory_mb,
                                                 gpu_models=list(req.gpu_models))
                # A contract bound to a site frees room on that site only.
                nodes = {k: t for k, t in self.fleet.nodes.items() if not req.site or t.site == req.site}
                plans = preemptions(wanted, nodes, self.ledger.nodes, victims)
                for plan in plans[:3]:  # the pure fit check and the policy rarely disagree
                    state = self.snapshot(without=frozenset(v.task_id for v in plan.victims))
                    choice = policies.guarded[name].decide(state, req)
                    if choice.action == "assign" and choice.placement and choice.placement[0].node == plan.node:
                        return plan, choice
        return None

    @staticmethod
    async def _withdraw(pending: KeyValue, written: list[tuple[str, int]]) -> None:
        """Remove the entries a dropped preemption wrote (each only as written): no evict goes
        out for those victims, and an entry left behind would hold the queue for the vip until
        ``evict_timeout_s``."""
        for key, revision in written:
            try:
                await pending.delete(key, revision=revision)
            except CasConflict:
                continue  # written again since: no longer ours

    async def preempt(self, adm: TaskAdmitted, pending, leaving: frozenset[str] = frozenset()
                      ) -> list[DecisionMade]:
        """``evict`` decisions for the cheapest preemption that lets the vip task fit without
        the tasks already ``leaving``, after the victims' ``pending`` entries are written
        (each with its re-placement id)."""
        found = self.preemption_for(adm, leaving)
        if found is None:
            return []
        plan, choice = found
        confidence = evict_confidence(len(plan.victims), self.settings.evict_success)
        out = []
        written: list[tuple[str, int]] = []
        for v in plan.victims:
            evict_id = evict_decision_id(v.running)
            note = Requeue(
                decision_id=reassign_decision_id(v.running),
                evict_id=evict_id,
                for_task=adm.task.task_id,
                at=now(),
                bridge_floor_mb=await self.restore_floor_mb(v.admitted.task),
                # Stopped with SIGTERM, a run that resumes goes on from its checkpoint: its
                # queue order and its restored hold count what it has done (as a checkpoint's).
                progress_s=(run_progress_s(v.running, now()) or 0.0) if v.admitted.task.resumable else 0.0,
            )
            # Queued before the decision goes out: the entry waits until the executor has
            # released the victim's holds, so it can never be placed twice. Create-only, as
            # every other stop: another replica may have queued the victim since this round
            # read the queue (checkpointed it, preempted it for another vip), and its note
            # (the progress its checkpoint kept, the vip it stops for) must stand.
            try:
                written.append((node_key(v.task_id), await pending.create(node_key(v.task_id),
                                                                           encode_pending(v.admitted, note))))
            except CasConflict:
                await self._withdraw(pending, written)
                log.info("vip %s: %s was queued again by another replica meanwhile; preemption dropped "
                         "(the next round plans again)", adm.task.task_id, v.task_id)
                return []
            out.append(
                DecisionMade(
                    decision_id=evict_id,
                    task_id=v.task_id,
                    action="evict",
                    source=v.running.placements(),
                    confidence=confidence,
                    policy=PolicyRef(name="preempt"),
                    reason=(
                        f"preempted for vip task {adm.task.task_id}, which fits nowhere now; evicting "
                        f"{', '.join(x.task_id for x in plan.victims)} on {plan.node} lets it fit "
                        f"({choice.reason})"
                    ),
                    decided_at=now(),
                    task=v.admitted.task,
                    contract=v.admitted.contract,
                )
            )
        log.info(
            "vip %s preempts %s on %s (cost %.0f)",
            adm.task.task_id,
            [v.task_id for v in plan.victims],
            plan.node,
            plan.cost,
        )
        return out
