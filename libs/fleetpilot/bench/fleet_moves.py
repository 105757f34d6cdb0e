"""Fleetpilot's moves for the tasks that wait in the fleet benchmark: clearing a node for the
reservation, moving down, making way and making room."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from fleetpilot.policy import TaskRequest
from fleetpilot.policy.backfill import (
    Demand,
    Move,
    Reservation,
    Room,
    Tenant,
    clearing,
    hidden,
    leaves_room,
    makes_way,
    queue_key,
    wide_hosts,
)
from fleetpilot.policy.rebalance import (
    GROWTH_LOOKAHEAD_S,
    MOVE_DOWN_TRIES,
    could_take,
    models_below,
    move_down_ask,
)
from fleetpilot.policy.state import MILLI

from .fleet_job import Job


class FleetMoves:
    """The rebalance round's moves that start a waiting task sooner by pausing or moving running
    ones, as the policy service's ``Moves`` makes them (``FleetRun`` mixes it in and holds the
    state it reads)."""

    def _may_pause(self, job: Job, now: float) -> bool:
        """A running task may be paused for a checkpoint (to clear a node, move down, make
        way) if it resumes from one, unless the pause would make it miss the deadline it asked
        for (its expected end, by its declared duration, plus the pause); a queue-time SLA is
        not touched by a pause, whatever the tier."""
        if not job.task.resumable:
            return False
        deadline = job.task.deadline_s
        return deadline is None or max(self._expected_end(job), now) + self._pause(job, now) <= deadline

    def _clear_for(self, job: Job, reservation: Reservation, now: float) -> None:
        """Migrate the tenants of a node so that the reserved task starts now, when that costs
        less than its wait (``backfill.clearing``); the task starts once the checkpoints are
        taken (their longest pause, counted as its queue time)."""
        if job.state != "pending":
            return
        # At the reserved node's site: the task may run at any of its contract's sites.
        site = self.node_site[self.state.node_index(reservation.node)]
        req = next((r for r in self._plain_requests(job) if r.site in ("", site)), self._request(job))
        # Only tasks on nodes the request could use can be in the way: the others are not
        # described (thousands of them, every cycle).
        hosts = wide_hosts(self.state, req)
        tenants = {j.task.task_id: Tenant(request=self._request(j), row=j.row, gpus=tuple(j.gpus), milli=j.milli,
                                          gpu_memory_mb=j.reserved_mb, pause_s=self._pause(j, now))
                   for j in self.jobs
                   if j.state == "running" and hosts[j.row] and not j.bridged and self._may_pause(j, now)}
        plan = clearing(self.state, req, list(tenants.values()), self.policy.decide, wait_s=reservation.start_s - now)
        if plan is None or len(plan.moves) > self.decisions_left:
            return  # a plan the round's budget cannot carry out whole waits (``clear_for_reservation``)
        wait = max(tenants[m.task_id].pause_s for m in plan.moves)
        moved = [self._migrate(self.by_id[move.task_id], now, reason="clearing", target=move) for move in plan.moves]
        if not all(moved):
            return  # a move that did not happen leaves the node short: the task waits on
        self.counts["clearings"] += 1
        job.queue_s += wait
        self.pending.remove(job)
        self.blocked.discard(job.task.task_id)
        if job.confidence is None:
            decision = self.policy.decide(self.state, req)
            job.confidence = self.calibration.apply(self.mode, decision.confidence) if decision.action == "assign" else 0.5
        self._start(job, plan.row, list(plan.gpus), MILLI, now, pause=wait)

    def _blocked_single_gpu_waiters(self) -> list[Job]:
        """The waiting tasks of one whole GPU that found no place since the last cycle: those
        moving down and making way find room for."""
        return [j for j in self.pending if j.task.task_id in self.blocked and j.task.gpus == 1
                and j.task.gpu_milli >= MILLI]

    def _move_down(self, now: float, reservation: Reservation | None) -> None:
        """Moving down, as the policy service's rebalance round does (``Moves.move_down``): for
        each blocked task of one whole GPU, in the queue's order, a tenant of a GPU it could
        take, whose envelope read at its progress says it fits a model the waiter cannot take
        for the next quarter hour (``rebalance.move_down_ask``, ``models_below``), moves there
        (bridged: watched by its envelope, moved up when it says), the smallest ask of up to
        ``MOVE_DOWN_TRIES`` that the policy finds a target for. The waiter then starts where
        the policy places it, after the tenant's checkpoint pause (the service's next queue
        round, once the executor has moved the tenant), with what the cycle's rounds have left
        (``decisions_left``); a request that found no target spares the cycle any other that
        needs at least as much."""
        waiters = self._blocked_single_gpu_waiters()
        if not waiters:
            return
        tenants = []
        for j in self.jobs:
            if (j.state != "running" or len(j.gpus) != 1 or j.milli < MILLI
                    or self.excluded[self.offset[j.row] + j.gpus[0]]):
                continue
            ask = move_down_ask(j.prediction, j.task.declared_duration_s, now - j.run_at if j.from_start else None,
                                GROWTH_LOOKAHEAD_S)
            if ask > 0 and self._may_pause(j, now):
                tenants.append((ask, j.task.task_id, j))
        tenants.sort(key=lambda c: (c[0], c[1]))
        failed: list[tuple[Demand, bool]] = []  # what found no target spares any that needs as much
        model_memory = {m: int(mb) for m, mb in self.memory_of.items()}
        for waiter in waiters:
            if self.decisions_left <= 0 or not tenants:
                return
            need = self._request(waiter)
            tried = 0
            for ask, task_id, tenant in list(tenants):
                if tried >= MOVE_DOWN_TRIES:
                    break
                total = int(self.state.gpu_mem_total[tenant.row, tenant.gpus[0]])
                if not could_take(need, self.node_model[tenant.row], total, self.node_site[tenant.row],
                                  waiter.bound_sites):
                    continue
                models = models_below(tenant.task.gpu_models, ask, need.gpu_models, need.gpu_memory_mb, model_memory)
                if not models or tenant.state != "running":
                    continue
                req = msgspec.structs.replace(self._request(tenant), gpu_memory_mb=ask, gpu_models=models,
                                              predicted_peak_mb=0.0, peak_sigma_mb=0.0)
                hide = reservation is not None and reservation.delayed_by(task_id, self._remaining(tenant), now)
                demand = Demand.of(req)
                if any(demand.cannot_fit_after(f) for f, masked in failed if hide or not masked):
                    continue
                tried += 1
                with hidden(self.state, reservation if hide else None):
                    decision = self.policy.decide(self.state, req)
                if decision.action != "assign" or not decision.placement:
                    failed.append((demand, hide))
                    continue
                pause = self._pause(tenant, now)
                target = Move(task_id=task_id, row=decision.node_row,
                              gpus=tuple(p.gpu for p in decision.placement if p.gpu >= 0),
                              milli=decision.placement[0].milli)
                if not self._migrate(tenant, now, reason="down", target=target, bridge=True):
                    continue
                tenants = [c for c in tenants if c[1] != task_id]
                if self._try_start(waiter, now, reservation, [], pause=pause):
                    self.pending.remove(waiter)
                    self.blocked.discard(waiter.task.task_id)
                break

    def _make_way(self, now: float, reservation: Reservation | None) -> None:
        """Making way, as the policy service's rebalance round does (``Moves.make_way``): for
        each blocked task of one whole GPU still waiting, in the queue's order, of the running
        tasks alone on a GPU it could take and that may pause, the one with the most run left
        that ``backfill.makes_way`` says should give way is checkpointed and queued again
        (progress kept), and the waiter starts where the policy places it after that pause. At
        most ``MAKE_WAY_PER_ROUND`` a round, with making room (``_give_way``)."""
        waiters = sorted(self._blocked_single_gpu_waiters(), key=self._key)
        if waiters:
            tenants = [c for c in self._way_tenants(now) if c[0].milli >= MILLI
                       and self.on_gpu.get((c[0].row, c[0].gpus[0]), set()) == {c[0].task.task_id}]
            self._give_way(waiters, tenants, now, reservation, made="made_way", blocked=self.blocked)

    def _make_room(self, now: float, reservation: Reservation | None) -> None:
        """Making room for a share of a GPU, on the same terms (``Moves.make_way`` serves both):
        for each blocked task of a share of one GPU, of the running tasks of one GPU whose going
        would leave room for it on their GPU and node (``backfill.leaves_room``), the one with
        the most run left that should give way is checkpointed and queued again, with what
        making way left of the cycle's rounds (``_give_way``)."""
        waiters = sorted((j for j in self.pending if j.task.task_id in self.blocked_shares), key=self._key)
        if not waiters:
            return
        state = self.state

        def room(need: TaskRequest, j: Job) -> bool:
            row, g = j.row, j.gpus[0]
            free = Room(milli=int(state.gpu_free[row, g]), gpu_memory_mb=int(state.gpu_mem_free[row, g]),
                        cpu_milli=int(state.cpu_free[row]), memory_mb=int(state.mem_free[row]))
            held = Room(milli=j.milli, gpu_memory_mb=j.reserved_mb, cpu_milli=j.task.cpu_milli,
                        memory_mb=j.task.memory_mb)
            return leaves_room(free, held, need)

        self._give_way(waiters, self._way_tenants(now), now, reservation, made="made_room",
                       blocked=self.blocked_shares, room=room)

    def _way_tenants(self, now: float) -> list[tuple[Job, float, tuple[int, float], float]]:
        """``(task, run left, its queue key by that, checkpoint pause)`` of every running task
        of one GPU that may give way: settled (not bridged), on a GPU in service, free to pause."""
        out = []
        for j in self.jobs:
            if (j.state == "running" and len(j.gpus) == 1 and not j.bridged
                    and not self.excluded[self.offset[j.row] + j.gpus[0]] and self._may_pause(j, now)):
                its_left = max(self._expected_end(j) - now, 0.0)
                out.append((j, its_left, queue_key(j.task.tier, j.task.arrival_s, its_left, self.queue_aging),
                            self._pause(j, now)))
        return out

    def _give_way(self, waiters: list[Job], tenants: list[tuple[Job, float, tuple[int, float], float]], now: float,
                  reservation: Reservation | None, *, made: str, blocked: set[str],
                  room: Callable[[TaskRequest, Job], bool] | None = None) -> None:
        """For each of ``waiters``, in order, checkpoint the tenant with the most run left on a
        GPU the waiter could take (and where ``room`` says its going leaves enough) that
        ``backfill.makes_way`` says should give way, then start the waiter after that pause;
        counted under ``made``. As the policy service's rounds budget making way and making room
        together (at most ``MAKE_WAY_PER_ROUND`` a round, ``ROUNDS_PER_CYCLE`` rounds a cycle),
        with what the round's other decisions left, both share ``ways_left`` and
        ``decisions_left``, which ``_new_cycle`` fills again."""
        for waiter in waiters:
            if self.ways_left <= 0 or self.decisions_left <= 0 or not tenants:
                return
            need = self._request(waiter)
            left = self._remaining(waiter)
            first = queue_key(waiter.task.tier, waiter.task.arrival_s, left, self.queue_aging)
            chosen, most = None, 0.0
            for tenant in tenants:
                j, its_left, key, pause = tenant
                row, g = j.row, j.gpus[0]
                if (its_left > most and (room is None or room(need, j))
                        and could_take(need, self.node_model[row], int(self.state.gpu_mem_total[row, g]),
                                       self.node_site[row], waiter.bound_sites)
                        and makes_way(first, left, key, its_left, pause)):
                    chosen, most = tenant, its_left
            if chosen is None:
                continue
            tenants.remove(chosen)
            self._checkpoint(chosen[0], now)
            self.counts[made] += 1
            self.ways_left -= 1
            if self._try_start(waiter, now, reservation, [], pause=chosen[3]):
                self.pending.remove(waiter)
                blocked.discard(waiter.task.task_id)
