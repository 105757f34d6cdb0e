"""Running tasks the policy acts on, every ``rebalance_s`` (``Moves.rebalance_round``).

* ``resize``: the hold of a task whose fingerprint predicts a peak above it grows, where its
  GPUs have room (``rebalance.resize_plan``);
* ``migrate``: a task whose GPU is going away, or whose fingerprint predicts an OOM in place,
  moves to a target the default policy chooses (``rebalance.move_reason``); one below its
  peak that its envelope watches, only when the envelope says it outgrows its GPU
  (``rebalance.waits_for_its_envelope``);
* ``checkpoint``: a task that should move but has nowhere to go, whose measured growth or
  envelope would overflow its GPU within ``growth_lookahead_s``, is evicted and queued again;
* clearing: when moving the tenants of a node costs less than the wait of the task the
  backfill reservation is for, they are migrated away (``backfill.clearing``);
* moving down: a task blocked for one whole GPU gets one from a tenant that its envelope says
  fits a smaller model for a while (``move_down``).

Every target or extra share is reserved in the ledger with compare-and-set before the
decision is returned. The reservation itself (``reservations_for``) is judged by when the
running tasks are expected to end (``running_ends``), which is why it lives here.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
from fleetpilot.contracts import (
    Allocation,
    DecisionMade,
    Fingerprint,
    GpuInfo,
    NodeLedger,
    NodeTopology,
    Placement,
    PolicyRef,
    TaskAdmitted,
    TaskSubmitted,
    in_service,
    now,
)
from fleetpilot.fingerprint import task_signature
from fleetpilot.ledger import FreeCapacity, free_capacity
from fleetpilot.ledger.store import node_key
from fleetpilot.policy import ClusterState, TaskRequest
from fleetpilot.policy.backfill import (
    MAKE_WAY_PER_ROUND,
    Demand,
    Reservation,
    Room,
    Tenant,
    clearing,
    gpu_free_at,
    hidden,
    leaves_room,
    makes_way,
    queue_key,
    reserve_apart,
    reserve_earliest,
    wide_hosts,
)
from fleetpilot.policy.preempt import Requeue, encode_pending, evict_decision_id, reassign_decision_id
from fleetpilot.policy.rebalance import (
    MIN_BRIDGE_STAY_S,
    MOVE_DOWN_TRIES,
    MoveReason,
    ResizePlan,
    Running,
    bridge_overflow,
    climbs_within_its_gpu,
    could_take,
    envelope_progress_s,
    gpus_going_away,
    migrate_decision_id,
    models_below,
    most_room_mb,
    move_down_ask,
    move_reason,
    placed_at,
    resize_decision_id,
    resize_plan,
    room_in_place,
    run_began_at,
    run_counted_from,
    run_progress_s,
    waits_for_its_envelope,
)
from fleetpilot.policy.restores import bridge_floor_mb
from fleetpilot.policy.state import MILLI, peak_sigma_mb
from fleetpilot.policy.transformers import oom_risk
from fleetpilot.runtime import CasConflict

from .replica import ReplicaState, allocations_for, calibration_key, checked_decide, placement_fits

log = logging.getLogger("fleetpilot.policy")


@dataclass(frozen=True)
class DownTenant:
    """A running task that may move down for a waiter (``Moves.move_down``): what it asks per
    GPU there, where it runs, the models it accepts (any when empty) and its request at its
    peak (a move's)."""

    ask: int
    running: Running
    topo: NodeTopology
    gpu: GpuInfo
    models: tuple[str, ...]
    peak: TaskRequest


@dataclass(frozen=True)
class WayTenant:
    """A running task that may be checkpointed to make way for a waiter (``Moves.make_way``):
    its queue key as if it waited with the run it has left, that run, its checkpoint pause,
    its admission, where it runs (its GPU, its node's site); for making room for a share,
    what is free on its GPU and node and what it holds there (``backfill.leaves_room``)."""

    key: tuple[int, float]
    left_s: float
    pause_s: float
    adm: TaskAdmitted
    running: Running
    gpu: GpuInfo
    site: str = ""
    free: Room | None = None
    held: Room | None = None


class Moves(ReplicaState):
    """What the rebalancer does to running tasks: resize, migrate, checkpoint, and clear a
    node for the task the backfill reservation is for."""

    def reservations_for(self, owners: list[TaskAdmitted]) -> tuple[Reservation | None, list[Reservation]]:
        """The reservations of a round's blocked whole-GPU tasks (``owners``, in the queue's
        order): the first's, where and when it can start earliest at any site its contract
        binds it to (``backfill.reserve_earliest``), and, when it has one, those of the others
        whose nodes no earlier reserved task could use (``backfill.reserve_apart``), as the
        fleet benchmark reserves; one view of the fleet for all of them. Judged by the
        durations the running tasks declared: a hold whose task declared none, or that this
        replica cannot name, is taken never to end."""
        if not owners:
            return None, []
        state = self.snapshot()
        free_at = gpu_free_at(state, self.running_ends(state), now())
        first = self.site_requests(owners[0].task)
        made = reserve_earliest(state, first, free_at)
        if made is None:
            return None, []
        return made[0], reserve_apart(state, first, [self.site_requests(a.task) for a in owners[1:]], free_at)

    def reserved_with_request(self, adm: TaskAdmitted) -> tuple[Reservation, TaskRequest] | None:
        """Where and when ``adm`` can start earliest (``reservations_for``), with the request
        (at the reserved node's site) it was made for."""
        state = self.snapshot()
        return reserve_earliest(state, self.site_requests(adm.task), gpu_free_at(state, self.running_ends(state), now()))

    def site_requests(self, task: TaskSubmitted) -> list[TaskRequest]:
        """The task's request (``request``) at each site its contract binds it to, in the
        contract's order; the request alone for a task bound to none or one."""
        plain = self.request(task)
        sites = self.contract_sites(task.task_id)
        return [plain] if len(sites) <= 1 else [msgspec.structs.replace(plain, site=site) for site in sites]

    def running_ends(self, state: ClusterState) -> list[tuple[int, list[int], float]]:
        """``(row, gpus, expected end)`` of every GPU hold in the ledger.

        A hold ends when its task is expected to (its first hold's time plus the duration it
        declared), except the hold a task is being migrated off: the executor releases it
        once the task is restored on the target, a checkpoint pause after the move was
        decided. So the GPUs a clearing empties are reserved for the task it cleared them
        for as soon as the moves are decided, and nothing that would delay it takes them
        when they free."""
        moving = self.moves_in_flight()
        out: list[tuple[int, list[int], float]] = []
        for ledger in self.ledger.nodes.values():
            try:
                row = state.node_index(ledger.node)
            except KeyError:
                continue
            holds: dict[tuple[str, bool], list[Allocation]] = {}
            for a in ledger.allocations:
                if a.gpu >= 0:
                    move = moving.get(a.task_id)
                    leaving = move is not None and a.decision_id != move[0]
                    holds.setdefault((a.task_id, leaving), []).append(a)
            for (task_id, leaving), allocs in holds.items():
                if leaving:
                    end = moving[task_id][1] + self.checkpoint_pause_s(max(a.memory_mb for a in allocs))
                else:
                    declared = self.declared_s(task_id)
                    running = Running(task_id=task_id, node=ledger.node, allocations=tuple(allocs))
                    end = run_counted_from(running) + declared if declared else math.inf
                out.append((row, [a.gpu for a in allocs], end))
        return out

    def moves_in_flight(self) -> dict[str, tuple[str, float]]:
        """Tasks being migrated: task id -> (the move's decision id, when its target was
        reserved). The target hold stays ``reserved`` until the executor has moved the task."""
        out: dict[str, tuple[str, float]] = {}
        for ledger in self.ledger.nodes.values():
            for a in ledger.allocations:
                own = a.decision_id[len(a.task_id):] if a.decision_id.startswith(a.task_id) else ""
                if a.state == "reserved" and ".migrate." in own:
                    out[a.task_id] = (a.decision_id, a.at)
        return out

    def submitted(self, task_id: str) -> TaskSubmitted | None:
        """The task as submitted, as its admission (or this replica's decision) has it."""
        adm = self.admissions.of(task_id) if self.admissions is not None else None
        return adm.task if adm is not None else self.tasks.get(task_id)

    def declared_s(self, task_id: str) -> float | None:
        """The run time the task declared (``expected_duration_s``), ``None`` when the task
        is unknown to this replica or declared none."""
        task = self.submitted(task_id)
        return task.expected_duration_s if task is not None and task.expected_duration_s else None

    def remaining_s(self, running: Running) -> float | None:
        """What is left of the run a running task declared: its duration less the time
        since its run began (``run_began_at``; unknown, since its holds were reserved), ``None``
        when it declared none (taken as long by ``delayed_by``)."""
        declared = self.declared_s(running.task_id)
        if declared is None:
            return None
        return max(declared - (now() - run_counted_from(running)), 0.0)

    def resumes(self, task_id: str) -> bool:
        """Whether a task goes on from its checkpoint when started again
        (``TaskSubmitted.resumable``); a task this replica does not know is taken to, as
        every task is unless its submitter says otherwise."""
        task = self.submitted(task_id)
        return task is None or task.resumable

    def may_pause(self, running: Running, pause_s: float) -> bool:
        """Whether a move made for others (clearing a node, moving down, making way) may pause
        ``running`` for ``pause_s``: not when it cannot resume (stopped, it would lose its
        run), nor when the pause would make it miss the deadline its contract carries (its
        expected end, by the duration it declared, plus the pause; an unknown end with a
        deadline counts as too late). A queue-time SLA is not touched by a pause, whatever
        the tier."""
        if not self.resumes(running.task_id):
            return False
        adm = self.admissions.of(running.task_id) if self.admissions is not None else None
        deadline = adm.contract.deadline if adm is not None else None
        if deadline is None:
            return True
        remaining = self.remaining_s(running)
        return remaining is not None and now() + remaining + pause_s <= deadline

    async def rebalance_round(self) -> list[DecisionMade]:
        """One rebalancing round (``rebalance``): a ``resize`` for a task whose predicted
        peak is above its hold where its GPU has room, else ``migrate`` for a task that should
        move; then, with what is left of the round's budget, the moves that clear a node for
        the task the reservation is for (``clear_for_reservation``). The extra memory or the
        target is reserved with CAS before the decision is returned. At most
        ``max_migrations_per_round`` decisions."""
        out: list[DecisionMade] = []
        for running in self.running():
            if len(out) >= self.settings.max_migrations_per_round:
                break
            topo = self.fleet.nodes.get(node_key(running.node))
            ledger = self.ledger.nodes.get(node_key(running.node))
            if topo is None or ledger is None or not running.gpus:
                continue
            fp = self.fingerprints.get(running.task_id)
            plan = resize_plan(
                running, topo, ledger, fp, self.settings.oom_migrate_risk, self.settings.resize_margin_mb
            )
            resize_id = resize_decision_id(running, plan.memory_mb) if plan is not None else ""
            # A resize under an id already proposed (by this replica) or taken (by the
            # executor, which failed it: a done resize changes the hold) is not tried again.
            if plan is not None and resize_id not in self.resizes and not await self.journaled(resize_id):
                resized = await self.resize(running, topo, plan)
                if resized is not None:
                    out.append(resized)
                continue  # cheaper than a move; a lost race is tried again next round
            reason = move_reason(running, topo, ledger, fp, self.settings.oom_migrate_risk)
            if reason is None:
                continue
            going_away = gpus_going_away(running, topo)
            if not going_away and not self.resumes(running.task_id):
                # Moved, it would start over: its run is lost for sure, where an OOM takes it
                # only if it comes, and then no later than a restart now would have.
                continue
            samples = tuple(self.usage.get(running.task_id, ()))
            if not going_away and waits_for_its_envelope(
                    running, topo, ledger, fp, samples, envelope_progress_s(running, now()),
                    self.declared_s(running.task_id), self.settings.growth_lookahead_s):
                continue  # below its peak, but its envelope says it fits here a while yet
            if not going_away and climbs_within_its_gpu(running, topo, ledger, fp, samples,
                                                        self.settings.growth_lookahead_s):
                continue  # a climb its measured rate says fits here a while yet
            decision = await self.migrate(running, topo, fp, reason.p_stay_fails, reason.why)
            if decision is None and fp is not None:
                decision = await self.checkpoint(running, topo, ledger, reason)
            if decision is not None:
                out.append(decision)
        budget = self.settings.max_migrations_per_round - len(out)
        if budget > 0:
            out.extend(await self.clear_for_reservation(budget, {d.task_id for d in out}))
        budget = self.settings.max_migrations_per_round - len(out)
        if budget > 0:
            out.extend(await self.move_down(budget, {d.task_id for d in out}))
        budget = min(self.settings.max_migrations_per_round - len(out), MAKE_WAY_PER_ROUND)
        if budget > 0:
            out.extend(await self.make_way(budget, {d.task_id for d in out}))
        budget = min(self.settings.max_migrations_per_round - len(out), MAKE_WAY_PER_ROUND)
        if budget > 0:
            out.extend(await self.make_way(budget, {d.task_id for d in out}, shares=True))
        return out

    async def clear_for_reservation(self, budget: int, moved: set[str]) -> list[DecisionMade]:
        """``migrate`` decisions that empty a node for the task the reservation is for, when
        moving the node's tenants costs less than its wait (``backfill.clearing``); none when
        the plan needs more than ``budget`` moves. ``moved`` already have a decision.

        EASY backfill only waits for GPUs to free; when every node a wide task can use is
        held for hours, that is hours of its wait and of the GPUs kept idle for it, while the
        tenants of one node could run elsewhere at the price of a checkpoint. A tenant costs
        its checkpoint pause (``checkpoint_pause_s`` of its hold) times the GPUs it holds, as
        a share; the waiting task gains the wait it is spared (to the reservation's start,
        less the longest of those pauses) times the GPUs it needs. The targets are the
        default policy's, with the cleared GPUs hidden.

        The waiting task is not placed here: once the executor has moved the tenants and
        released their holds, the next queue round places it. Until then the reservation
        follows the cleared GPUs (``running_ends``: a hold being moved off ends after the
        pause), so nothing that would delay the task takes them. A move lost to a race
        stops the clearing (the rest would not make room); the next round plans again.
        """
        owner = self.reservation
        if owner is None or self.admissions is None:
            return []
        adm = self.admissions.of(owner.task_id)
        if adm is None or self.ledger.holds_of(owner.task_id) is not None:
            return []  # unknown, or no longer waiting: placed since the reservation was made
        # The queue round's reservation may be a round old: judged again on this view, a
        # task that can start now is left to the queue round (a clearing would move tenants
        # onto the very GPUs that freed for it), and the wait weighed is the one of now.
        made = self.reserved_with_request(adm)
        if made is None or made[0].start_s <= now():
            return []
        held, request = made
        state = self.snapshot()
        # Only tasks on nodes the waiting task could use can be in its way.
        hosts = wide_hosts(state, request)
        tenants: dict[str, tuple[Tenant, Running, NodeTopology]] = {}
        for running in self.running():
            topo = self.fleet.nodes.get(node_key(running.node))
            gpu_allocs = [a for a in running.allocations if a.gpu >= 0]
            if running.task_id in moved or topo is None or not gpu_allocs:
                continue
            try:
                row = state.node_index(running.node)
            except KeyError:
                continue
            if not hosts[row]:
                continue
            memory_mb = max(a.memory_mb for a in gpu_allocs)
            pause_s = self.checkpoint_pause_s(memory_mb)
            if not self.may_pause(running, pause_s):
                continue
            tenant = Tenant(
                request=self.move_request(running, topo, self.fingerprints.get(running.task_id)),
                row=row,
                gpus=tuple(running.gpus),
                milli=gpu_allocs[0].milli,
                gpu_memory_mb=memory_mb,
                pause_s=pause_s,
            )
            tenants[running.task_id] = (tenant, running, topo)
        policies = self.active.current
        wait_s = held.start_s - now()
        plan = clearing(state, request, [t for t, _, _ in tenants.values()],
                        functools.partial(checked_decide, policies.guarded[policies.default], policies.default),
                        wait_s=wait_s)
        if plan is None or len(plan.moves) > budget:
            return []
        why = (f"clearing {state.node_names[plan.row]} for {held.task_id} (GPUs {list(plan.gpus)}), which would "
               f"wait {wait_s:.0f} s: moving {len(plan.moves)} tasks costs {plan.cost:.0f} GPU-s")
        log.info("%s", why)
        out: list[DecisionMade] = []
        for move in plan.moves:
            tenant, running, topo = tenants[move.task_id]
            target = [
                Placement(node=state.node_names[move.row], gpu=g, milli=move.milli,
                          memory_mb=tenant.request.gpu_memory_mb)
                for g in move.gpus
            ]
            decision = await self.migrate(running, topo, self.fingerprints.get(move.task_id), 0.0, why, target,
                                          planned_confidence=move.confidence)
            if decision is None:
                break
            out.append(decision)
        return out

    async def move_down(self, budget: int, moved: set[str]) -> list[DecisionMade]:
        """``migrate`` decisions that make room for whole-GPU tasks the last queue round found
        no place for (``blocked``): for each, in the queue's order, a tenant of a GPU of a model
        it needs moves to a GPU of a model it does not need, where its program's envelope says
        it fits for the next quarter hour (``rebalance.move_down_ask``, ``models_below``). At
        most ``budget`` moves; ``moved`` already have a decision.

        On a fleet where only the largest GPUs hold the peaks of some programs, those GPUs
        are mostly held by such programs in a phase a smaller GPU would hold (a step schedule
        before its big step, a run restored low), while tasks that need them wait for hours.
        A tenant qualifies with a fingerprint whose envelope is known and read at its progress
        (``envelope_progress_s``: not for a run restored from a checkpoint),
        ``MOVE_DOWN_LEFT_S`` of its run left, a pause it may take (``may_pause``) and one whole
        GPU the waiter could take (a model it accepts, with room for its request). Of those, up to ``MOVE_DOWN_TRIES`` with the smallest ask are offered
        to the default policy, restricted to the models below, until one finds a target; it
        holds what the target GPU has free, up to its peak (a bridge's hold). Moved, it is
        watched by its envelope and moved up (or checkpointed) when the envelope says it
        outgrows that GPU (``rebalance.waits_for_its_envelope``). A request that found no
        target spares the round any other that needs at least as much (``Demand``): with a
        hundred waiters for the largest GPUs, the smaller ones are full after the first few.

        The waiting task is not placed here: once the executor has moved the tenant and
        released its GPU, the next queue round places it (or a task before it in the queue's
        order). Until that move is done, no other tenant moves down for the same waiter on this
        replica (``making_room``)."""
        in_flight = self.moves_in_flight()
        waiting = self.waiting_for_room(in_flight)
        tenants = self.move_down_tenants(moved, in_flight) if waiting else []
        if not tenants:
            return []
        model_memory = self.gpu_memory_by_model()
        policies = self.active.current
        failed: list[tuple[Demand, bool]] = []
        out: list[DecisionMade] = []
        for adm in waiting:
            if len(out) >= budget or not tenants:
                break
            waiter = adm.task
            need, sites = self.request(waiter), self.contract_sites(waiter.task_id)
            # One view per waiter: ``hidden`` gives back what it masks, and only a move (which
            # ends this waiter's turn) changes the ledger.
            state = self.snapshot()
            tried = 0
            for tenant in tenants:
                if tried >= MOVE_DOWN_TRIES:
                    break
                if not could_take(need, tenant.gpu.model, tenant.gpu.memory_mb, tenant.topo.site, sites):
                    continue
                models = models_below(tenant.models, tenant.ask, need.gpu_models, need.gpu_memory_mb, model_memory)
                if not models:
                    continue
                req = msgspec.structs.replace(tenant.peak, gpu_memory_mb=tenant.ask, gpu_models=models,
                                              predicted_peak_mb=0.0, peak_sigma_mb=0.0)
                kept = self.reservation
                hide = kept is not None and kept.delayed_by(tenant.running.task_id,
                                                             self.remaining_s(tenant.running), now())
                demand = Demand.of(req)
                if any(demand.cannot_fit_after(f) for f, masked in failed if hide or not masked):
                    continue
                tried += 1
                with hidden(state, kept if hide else None):
                    choice = checked_decide(policies.guarded[policies.default], policies.default, state, req)
                if choice.action != "assign" or not choice.placement:
                    failed.append((demand, hide))
                    continue
                target = choice.placements(memory_mb=self.bridge_hold_mb(state, choice, tenant.peak, tenant.ask))
                why = (f"moved down for {waiter.task_id}, which waits for a GPU that holds {need.gpu_memory_mb} MB: "
                       f"its program's envelope says it holds at most {tenant.ask} MB per GPU over the next "
                       f"{(MIN_BRIDGE_STAY_S + self.settings.growth_lookahead_s) / 60:.0f} min, which a "
                       f"{'/'.join(models)} GPU holds; moved up when it says it outgrows it")
                decision = await self.migrate(tenant.running, tenant.topo, self.fingerprints.get(tenant.running.task_id),
                                              0.0, why, target, planned_by="move-down",
                                              planned_confidence=choice.confidence)
                if decision is None:
                    continue
                log.info("%s: %s", tenant.running.task_id, why)
                self.remember(self.making_room, waiter.task_id, (tenant.running.task_id, "", now()), limit=10_000)
                out.append(decision)
                tenants = [t for t in tenants if t is not tenant]
                break
        return out

    def waiting_for_room(self, in_flight: dict[str, tuple[str, float]], *, shares: bool = False) -> list[TaskAdmitted]:
        """The blocked tasks a round may make room for, in the queue's order: a single whole
        GPU each (with ``shares``, a share of one GPU each), not placed since the last retry
        round, no room coming for it yet. Read once per round, before the tenants are
        described: with no such waiter, nobody is."""
        one_gpu = [adm for adm in self.blocked if adm.task.gpus == 1 and adm.task.gpu_milli > 0
                   and (adm.task.gpu_milli < MILLI) == shares]
        if not one_gpu:
            return []
        holding = {a.task_id for ledger in self.ledger.nodes.values() for a in ledger.allocations}
        return [adm for adm in one_gpu
                if adm.task.task_id not in holding and not self.room_coming(adm.task.task_id, in_flight)]

    def room_coming(self, waiter_id: str, in_flight: dict[str, tuple[str, float]]) -> bool:
        """Whether this replica has made room for ``waiter_id`` that is not there yet: the
        tenant it moved down is still moving (``in_flight``), or the tenant it checkpointed
        still holds the GPU it was stopped on (the placement ``making_room`` names), for at most
        ``evict_timeout_s``."""
        made = self.making_room.get(waiter_id)
        if made is None:
            return False
        tenant, stopped, at = made
        if not stopped:
            return tenant in in_flight
        held = self.ledger.holds_of(tenant)
        return (held is not None and any(a.decision_id == stopped for a in held[1])
                and now() - at < self.settings.evict_timeout_s)

    async def make_way(self, budget: int, moved: set[str], *, shares: bool = False) -> list[DecisionMade]:
        """``evict`` decisions that make way for whole-GPU tasks the last queue round found no
        place for (``blocked``): for each, in the queue's order, of the running tasks alone on
        a GPU it could take, the one with the most run left that ``backfill.makes_way`` says
        should give way (the queue's order puts the waiter first, and the tenant has at least
        ``MAKE_WAY_FACTOR`` times the waiter's run and its own pause left) is checkpointed (the
        executor's SIGTERM, on which a trainer checkpoints) and queued again with its progress
        (``Requeue.progress_s``). At most ``budget`` evictions; ``moved`` already have a
        decision.

        Where the largest GPUs are the bottleneck, a run that holds one for hours while tasks
        that need it for minutes wait adds hours to each of their waits; giving way costs it
        their runs and a checkpoint pause. The waiting task is not placed here: once the
        executor has stopped the tenant and released its GPU, the next queue round places it
        (the queue's order puts it before the tenant). Until then no other tenant gives way,
        or moves down, for it on this replica (``room_coming``).

        With ``shares``, the same for the tasks of a share of one GPU (making room): the
        tenants are the running tasks of one GPU, whole or a share, whose going would leave
        room for the waiter on their GPU and node (``backfill.leaves_room``), by the ledger.
        One stop a GPU a round: the room it leaves is only taken at the next queue round, and
        two waiters counting the same free share would each be short of it."""
        if self.pending is None or self.admissions is None:
            return []
        in_flight = self.moves_in_flight()
        waiting = self.waiting_for_room(in_flight, shares=shares)
        tenants = self.way_tenants(moved, in_flight, alone=not shares) if waiting else []
        out: list[DecisionMade] = []
        for adm in waiting:
            if len(out) >= budget or not tenants:
                break
            waiter = adm.task
            need, sites = self.request(waiter), self.contract_sites(waiter.task_id)
            left = self.blocked_left_s(adm)
            first = queue_key(adm.contract.tier, adm.admitted_at, left, self.settings.queue_aging)
            best: WayTenant | None = None
            for tenant in tenants:
                if (could_take(need, tenant.gpu.model, tenant.gpu.memory_mb, tenant.site, sites)
                        and (best is None or tenant.left_s > best.left_s)
                        and (tenant.free is None or tenant.held is None or leaves_room(tenant.free, tenant.held, need))
                        and makes_way(first, left, tenant.key, tenant.left_s, tenant.pause_s)):
                    best = tenant
            if best is None:
                continue
            wants = (f"{need.gpu_milli}/{MILLI} of a GPU with {need.gpu_memory_mb} MB" if shares
                     else f"a GPU that holds {need.gpu_memory_mb} MB")
            why = (f"checkpointed to {'make room' if shares else 'make way'} for {waiter.task_id}, which waits for "
                   f"{wants} and declares {left:.0f} s of run: this run has {best.left_s:.0f} s left")
            note = Requeue(decision_id=reassign_decision_id(best.running), evict_id=evict_decision_id(best.running),
                           at=now(), reason=why,
                           bridge_floor_mb=await self.restore_floor_mb(best.adm.task),
                           progress_s=run_progress_s(best.running, now()) or 0.0)
            decision = await self.stop_and_queue(best.running, best.adm, note, "make-room" if shares else "make-way",
                                                 self.settings.evict_success, why)
            if decision is None:
                continue
            log.info("%s: %s", best.running.task_id, why)
            self.leaving.add(best.running.task_id)
            self.remember(self.making_room, waiter.task_id,
                          (best.running.task_id, best.running.allocations[0].decision_id, now()), limit=10_000)
            out.append(decision)
            tenants = [t for t in tenants if t is not best
                       and (t.running.node, t.gpu.index) != (best.running.node, best.gpu.index)]
        return out

    def one_gpu_tenants(
        self, moved: set[str], in_flight: dict[str, tuple[str, float]], *, whole: bool = True
    ) -> Iterator[tuple[Running, Allocation, NodeTopology, GpuInfo]]:
        """The running tasks room may be made with (``move_down``, ``make_way``), with their
        hold, node and GPU: one whole GPU (or, not ``whole``, one GPU whole or a share of it)
        in service that is not going away, a settled hold, not moving, not queued again
        already (``leaving``), no decision this round (``moved``)."""
        for running in self.running():
            gpu_allocs = [a for a in running.allocations if a.gpu >= 0]
            if (running.task_id in moved or running.task_id in in_flight or running.task_id in self.leaving
                    or len(gpu_allocs) != 1 or (whole and gpu_allocs[0].milli < MILLI)):
                continue
            hold = gpu_allocs[0]
            topo = self.fleet.nodes.get(node_key(running.node))
            gpu = next((g for g in topo.gpus if g.index == hold.gpu), None) if topo is not None else None
            if topo is None or gpu is None or not in_service(gpu.labels) or gpus_going_away(running, topo):
                continue
            yield running, hold, topo, gpu

    def way_tenants(self, moved: set[str], in_flight: dict[str, tuple[str, float]], *,
                    alone: bool = True) -> list[WayTenant]:
        """The tasks that may give way to some waiter (``make_way``), of ``one_gpu_tenants``:
        alone on a whole GPU (or, not ``alone``, on one GPU whole or a share of it, with what
        is free there and what it holds), a hold at or above its predicted peak (a run below it
        is a bridge, watched to move up), a known admission with a declared run, and a pause it
        may take."""
        out = []
        rooms: dict[str, FreeCapacity] = {}  # what is free on each node, once per node
        for running, hold, topo, gpu in self.one_gpu_tenants(moved, in_flight, whole=alone):
            ledger = self.ledger.nodes.get(node_key(running.node))
            if ledger is None or (alone and any(a.gpu == hold.gpu and a.task_id != running.task_id
                                                for a in ledger.allocations)):
                continue
            fp = self.fingerprints.get(running.task_id)
            adm = self.admissions.of(running.task_id) if self.admissions is not None else None
            left = self.remaining_s(running)
            pause = self.checkpoint_pause_s(hold.memory_mb)
            if (adm is None or left is None or (fp is not None and hold.memory_mb < fp.predicted_peak_mb)
                    or not self.may_pause(running, pause)):
                continue
            free = held = None
            if not alone:
                if topo.node not in rooms:
                    rooms[topo.node] = free_capacity(topo, ledger)
                room = rooms[topo.node]
                free = Room(milli=room.gpu_milli[hold.gpu], gpu_memory_mb=room.gpu_memory_mb[hold.gpu],
                            cpu_milli=room.cpu_milli, memory_mb=room.memory_mb)
                held = Room(milli=hold.milli, gpu_memory_mb=hold.memory_mb,
                            cpu_milli=sum(a.cpu_milli for a in running.allocations),
                            memory_mb=sum(a.host_memory_mb for a in running.allocations))
            out.append(WayTenant(key=queue_key(adm.contract.tier, adm.admitted_at, left, self.settings.queue_aging), left_s=left,
                                 pause_s=pause, adm=adm, running=running, gpu=gpu, site=topo.site, free=free, held=held))
        return out

    def move_down_tenants(self, moved: set[str], in_flight: dict[str, tuple[str, float]]) -> list[DownTenant]:
        """The tasks that may move down for some waiter (``move_down``), of
        ``one_gpu_tenants``, smallest ask first: a known admission (its model constraints),
        an ask by its envelope (``rebalance.move_down_ask``) and a pause it may take."""
        out = []
        for running, hold, topo, gpu in self.one_gpu_tenants(moved, in_flight):
            known = self.submitted(running.task_id)
            if known is None:
                continue  # its model constraints are unknown: it stays on its model
            fp = self.fingerprints.get(running.task_id)
            ask = move_down_ask(fp, self.declared_s(running.task_id), envelope_progress_s(running, now()),
                                self.settings.growth_lookahead_s)
            if ask <= 0 or not self.may_pause(running, self.checkpoint_pause_s(hold.memory_mb)):
                continue
            out.append(DownTenant(ask=ask, running=running, topo=topo, gpu=gpu, models=tuple(known.gpu_models),
                                  peak=self.move_request(running, topo, fp)))
        out.sort(key=lambda t: (t.ask, t.running.task_id))
        return out

    async def checkpoint(
        self, running: Running, topo: NodeTopology, ledger: NodeLedger, reason: MoveReason
    ) -> DecisionMade | None:
        """An ``evict`` for a task that should move, has nowhere to go, and would overflow its
        GPU within ``growth_lookahead_s`` by its measured growth or by its program's envelope
        (``bridge_overflow``):
        stopped now (the executor's SIGTERM, on which a trainer checkpoints) and queued again
        under its next ``<task>.assign.<g>``, it loses a restart; left alone, it would lose
        its run to the OOM kill. Its ``pending`` entry is written first, as a preemption's."""
        samples = tuple(self.usage.get(running.task_id, ()))
        adm = self.admissions.of(running.task_id) if self.admissions else None
        fp = self.fingerprints.get(running.task_id)
        # Where its program's envelope is read (``bridge_overflow``): the time since its run
        # began, which its holds carry across moves.
        why = bridge_overflow(running, topo, ledger, fp, samples, envelope_progress_s(running, now()),
                              adm.task.expected_duration_s if adm is not None else None,
                              self.settings.growth_lookahead_s)
        if why is None or self.pending is None:
            return None
        if adm is None:
            log.warning("%s will outgrow its GPU with nowhere to go, but its admission is unknown: not "
                        "checkpointed (%s)", running.task_id, why)
            return None
        # Queued again, it would come back to no more room than it has: every checkpoint
        # would cost a restart and gain nothing. On the fallback scheduler, which places it
        # whatever its fingerprint says, that was a loop: placed, checkpointed, placed again
        # on the same GPUs every round. It runs on; an OOM, if it comes, is the OOM rule's.
        room = min(room_in_place(running, topo, ledger).values())
        if not gpus_going_away(running, topo) and room >= most_room_mb(self.fleet.nodes.values(),
                                                                       adm.task.gpu_models):
            log.info("%s will outgrow its GPU, but no GPU it accepts has more than the %d MB it has there: "
                     "left to run (%s)", running.task_id, room, why)
            return None
        # Bridged again, it is given more room than it is outgrowing here, unless its
        # signature's restores have mostly started over (the fingerprinter counts them) and
        # it stayed here at least a lookahead.
        floor = bridge_floor_mb(await self.signature_stats(task_signature(adm.task)), room,
                                now() - placed_at(running), self.settings.growth_lookahead_s)
        note = Requeue(decision_id=reassign_decision_id(running), evict_id=evict_decision_id(running), at=now(),
                       reason=f"checkpointed: {why}", bridge_floor_mb=floor,
                       progress_s=(run_progress_s(running, now()) or 0.0) if adm.task.resumable else 0.0)
        return await self.stop_and_queue(running, adm, note, "checkpoint",
                                         float(reason.p_stay_fails * self.settings.evict_success),
                                         f"checkpoint and queue again: {reason.why}; no GPU can take it now, and {why}")

    async def stop_and_queue(
        self, running: Running, adm: TaskAdmitted, note: Requeue, policy: str, confidence: float, why: str
    ) -> DecisionMade | None:
        """The ``evict`` (``note.evict_id``, decided by ``policy`` for ``why``) that stops
        ``running`` so that it is placed again as ``note`` says, its ``pending`` entry written
        first (create-only), as a preemption's: ``None`` when the eviction was tried already or
        the task is queued already."""
        assert self.pending is not None
        if await self.journaled(note.evict_id):
            return None  # that eviction was tried: its outcome decides
        try:
            await self.pending.create(node_key(running.task_id), encode_pending(adm, note))
        except CasConflict:
            return None  # another replica (or an earlier round) queued it already
        return DecisionMade(
            decision_id=note.evict_id,
            task_id=running.task_id,
            action="evict",
            source=running.placements(),
            confidence=confidence,
            policy=PolicyRef(name=policy),
            reason=why,
            decided_at=now(),
            task=adm.task,
            contract=adm.contract,
        )

    async def resize(self, running: Running, topo: NodeTopology, plan: ResizePlan) -> DecisionMade | None:
        """Reserve the extra GPU memory of a resize with CAS (a second hold under the resize's
        decision id, which the executor folds into the task's hold once done), then decide."""
        decision_id = resize_decision_id(running, plan.memory_mb)
        held = {a.gpu: a for a in running.allocations if a.gpu >= 0}
        # The extra is on the board of the task's hold it grows (the topology's board at that
        # index for a hold written before holds named theirs), for the executor to follow.
        boards = {g.index: g.uuid for g in topo.gpus}
        extra = [
            Allocation(
                task_id=running.task_id,
                decision_id=decision_id,
                gpu=gpu,
                milli=0,
                memory_mb=more,
                at=now(),
                run_at=run_began_at(running),
                gpu_uuid=(held[gpu].gpu_uuid if gpu in held else "") or boards.get(gpu, ""),
            )
            for gpu, more in sorted(plan.extra.items())
        ]

        def reserve(current: NodeLedger | None) -> NodeLedger | None:
            if current is None or any(a.decision_id == decision_id for a in current.allocations):
                return None  # gone, or another replica reserved this very resize
            mine = {a.gpu: a for a in current.allocations if a.task_id == running.task_id}
            if set(mine) != set(held) or any(mine[g] != held[g] for g in held):
                return None  # the task changed since our view: next round decides again
            free = free_capacity(topo, current)
            if any(free.gpu_memory_mb[a.gpu] < a.memory_mb for a in extra):
                return None
            labels = {g.index: g.labels for g in topo.gpus}
            if not all(in_service(labels.get(a.gpu, {})) for a in extra):
                return None
            return NodeLedger(node=current.node, allocations=[*current.allocations, *extra])

        try:
            written = await self.ledger.mutate(node_key(running.node), reserve)
        except CasConflict:
            return None
        if written is None:
            return None
        self.remember(self.resizes, decision_id, now(), limit=10_000)
        source = [p for p in running.placements() if p.gpu >= 0]
        adm = self.admissions.of(running.task_id) if self.admissions else None
        return DecisionMade(
            decision_id=decision_id,
            task_id=running.task_id,
            action="resize",
            placement=[msgspec.structs.replace(p, memory_mb=plan.memory_mb) for p in source],
            source=source,
            confidence=float(plan.confidence),
            policy=PolicyRef(name="resize"),
            reason=plan.why,
            decided_at=now(),
            task=self.tasks.get(running.task_id) or (adm.task if adm else None),
            contract=adm.contract if adm else None,
        )

    def move_request(self, running: Running, source_topo: NodeTopology, fp: Fingerprint | None) -> TaskRequest:
        """A running task as the policies see it when it moves: the shape it holds, with the
        GPU memory its fingerprint predicts when more."""
        gpu_allocs = [a for a in running.allocations if a.gpu >= 0]
        known = self.tasks.get(running.task_id)
        memory_mb = gpu_allocs[0].memory_mb
        if fp is not None and fp.predicted_peak_mb > 0:
            # Moved for its peak or not, the target holds what the fingerprint predicts (as a
            # resize would), so the move is not followed by a resize or an OOM.
            peak = max(fp.predicted_peak_mb, fp.peak_high_mb) + self.settings.resize_margin_mb
            memory_mb = max(memory_mb, int(math.ceil(peak)))
        model = next((g.model for g in source_topo.gpus if g.index == running.gpus[0]), "")
        return TaskRequest(
            task_id=running.task_id,
            kind=known.kind if known else "batch",
            gpus=len(gpu_allocs),
            gpu_milli=gpu_allocs[0].milli,
            gpu_memory_mb=memory_mb,
            cpu_milli=sum(a.cpu_milli for a in running.allocations),
            memory_mb=sum(a.host_memory_mb for a in running.allocations),
            # A task decided elsewhere may have had model constraints we cannot see: stay on
            # its current model then rather than break them.
            gpu_models=tuple(known.gpu_models) if known else ((model,) if model else ()),
            predicted_peak_mb=fp.predicted_peak_mb if fp else 0.0,
            peak_sigma_mb=peak_sigma_mb(fp) if fp else 0.0,
            site=self.contract_site(running.task_id),
        )

    async def migrate(
        self,
        running: Running,
        source_topo: NodeTopology,
        fp: Fingerprint | None,
        p_stay_fails: float,
        why: str,
        target: list[Placement] | None = None,
        planned_by: str = "clearing",
        planned_confidence: float = 0.0,
    ) -> DecisionMade | None:
        """Choose a target for one task with the default policy (or take ``target``, planned
        by a clearing or a move down: ``planned_by`` names it), reserve it, decide. The target
        holds carry when the run began (``Allocation.run_at``).

        The policy never chooses GPUs reserved for a waiting task that the move would delay
        (the task is expected to run past the reservation's start, or declared no duration):
        a move is a placement like any other, and backfill keeps those GPUs for the wide task.

        **Confidence of a planned move** (``target`` given) is ``planned_confidence``, the
        default policy's confidence in the target placement when the plan chose it, under the
        ``clearing`` policy name (a move down's, under ``move-down``) and calibrated by that
        name's own record. Its goal is not the latency gain a migrate away from an OOM aims
        at: it moves a task that was fine where it was, for another task's sake, and what it
        promises is that the task runs on at its target without an OOM or a failure, which is
        what feedback judges a move by. Before, it was published as 0.0 (that latency goal,
        never met), and the closing report of every run set 0.00 predicted beside 1.00 met.
        Under its own name, these records never move the calibration of the default policy's
        own moves.
        """
        policies = self.active.current
        # As its admission has it, when this replica did not place it (a restart, another
        # replica): the executor reads from it whether the task resumes from its checkpoint.
        known = self.submitted(running.task_id)
        req = self.move_request(running, source_topo, fp)
        if target is None:
            state = self.snapshot()
            state.set_condition(state.node_index(running.node), running.gpus, maintenance=True)  # not where it is
            kept = self.reservation
            if kept is not None and not kept.delayed_by(running.task_id, self.remaining_s(running), now()):
                kept = None
            with hidden(state, kept):
                choice = checked_decide(policies.guarded[policies.default], policies.default, state, req)
            if choice.action != "assign" or not choice.placement:
                log.info("no target to migrate %s to (%s)", running.task_id, why)
                return None
            target = choice.placements(memory_mb=req.gpu_memory_mb)
            gpus = [p.gpu for p in choice.placement if p.gpu >= 0]
            risk_target = float(oom_risk(state, req)[choice.node_row, gpus].max()) if gpus and fp else 0.0
            if fp is not None and risk_target >= p_stay_fails:
                return None  # the move would not make an OOM less likely
            ref = self.policy_ref(policies, policies.default, choice)
            confidence = float(p_stay_fails * choice.confidence)
            if not choice.fallback:
                confidence = self.calibration.apply(calibration_key(ref.name, "migrate"), confidence)
            fallback, why = choice.fallback, f"{why}; target: {choice.reason}"
        else:
            ref, fallback = PolicyRef(name=planned_by), False
            confidence = self.calibration.apply(calibration_key(planned_by, "migrate"), planned_confidence)
        tried = 0
        while await self.journaled(migrate_decision_id(running, tried)):
            tried += 1  # that move failed (a done one would have changed the hold): a new id
        decision_id = migrate_decision_id(running, tried)
        node = target[0].node
        topo = self.fleet.nodes.get(node_key(node))
        if topo is None:
            return None
        # A task that cannot resume starts its run over on the target.
        began = run_began_at(running) if self.resumes(running.task_id) else now()
        holds = allocations_for(req, decision_id, target, began, topo=topo)

        def reserve(current: NodeLedger | None) -> NodeLedger | None:
            if current is not None and any(a.decision_id == decision_id for a in current.allocations):
                return None  # another replica reserved this very move
            if not placement_fits(topo, current, target, req.cpu_milli, req.memory_mb):
                return None
            # Both holds stay until the executor has moved the task and releases the source.
            return NodeLedger(node=node, allocations=[*(current.allocations if current else []), *holds])

        try:
            written = await self.ledger.mutate(node_key(node), reserve)
        except CasConflict:
            return None  # next round
        if written is None:
            return None
        return DecisionMade(
            decision_id=decision_id,
            task_id=running.task_id,
            action="migrate",
            placement=target,
            source=running.placements(),
            confidence=confidence,
            policy=ref,
            fallback=fallback,
            reason=why,
            decided_at=now(),
            task=known,
        )
