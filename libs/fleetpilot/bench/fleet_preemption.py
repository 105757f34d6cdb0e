"""Preemption in the fleet benchmark: the baselines' ``DefaultPreemption`` and Fleetpilot's vip
preemption."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import msgspec

from fleetpilot.contracts import Allocation, Contract, NodeLedger, TaskAdmitted
from fleetpilot.policy.preempt import Victim, eviction_cost, preemptions, spares_an_eviction
from fleetpilot.policy.rebalance import Running

from .default_preemption import PRIORITY_CLASS, TERMINATION_GRACE_S, RunningPod, preempt
from .fleet_job import Job


class FleetPreemption:
    """Preemption for a waiting task that found no node, in every mode: kube-scheduler's
    ``DefaultPreemption`` for the baselines, the policy service's vip preemption for Fleetpilot
    (``FleetRun`` mixes it in and holds the state it reads)."""

    def _preempt_for(self, job: Job, now: float) -> bool:
        """A preemption for a waiting task that found no node; whether it started.

        A baseline plays kube-scheduler's ``DefaultPreemption`` (``default_preemption``; on
        shared GPUs under ``kai-share``): the lower-priority pods it picks are evicted (each a failed attempt of its Job, which
        counts toward the backoff limit and starts again from scratch), and the pod starts
        there after their grace period (counted as its queue time). Fleetpilot plays its
        policy service's vip preemption (``_vip_preempts``)."""
        if self.smart:
            return self._vip_preempts(job, now)
        priority = PRIORITY_CLASS.get(job.task.tier, 0)
        if not self.preempts or priority <= min(PRIORITY_CLASS.values()):
            return False
        plan = preempt(self.state, self._request(job), priority, self.holder_priority, self._pods_on,
                       shared=self.shares)
        if plan is None:
            return False
        for pod in plan.victims:
            self._kill(self.by_id[pod.pod_id], now, "preempted")
        # The only node that changed is the one it fits now, so the policy places it there.
        return self._try_start(job, now, None, [], pause=TERMINATION_GRACE_S)

    def _vip_preempts(self, job: Job, now: float) -> bool:
        """The policy service's vip preemption (``Evictions.preemption_for``): for each of
        the vip's requests in order, the cheapest best-effort tasks on one node whose eviction
        lets it fit (``policy.preempt.preemptions``: the work they have done plus a restart),
        among the three cheapest nodes the first where the policy, those tasks gone, places
        it; then, with ``vip_evicts_standard``, the same among them and the standard tasks
        whose contracts spare an eviction (``policy.preempt.spares_an_eviction``). They are
        evicted (``_evict_for_vip``) and it starts there after their grace period, counted as
        its queue time; whether it started."""
        if job.task.tier != "vip":
            return False
        running = [j for j in self.jobs if j.state == "running"]
        best_effort = [j for j in running if j.task.tier == "best_effort"]
        started = self._vip_preempts_among(job, best_effort, now)
        # A preemption carried out ends this try, whether or not the vip then started (as the
        # service's round publishes its evictions and waits for them); only where none was
        # found does the search go on among the standard work its contract spares.
        if started is not None or not self.vip_evicts_standard:
            return bool(started)
        spared = [j for j in running if j.task.tier == "standard" and self._spares_an_eviction(j, now)]
        return bool(spared and self._vip_preempts_among(job, best_effort + spared, now))

    def _spares_an_eviction(self, job: Job, now: float) -> bool:
        """Whether a running standard task's contract lets a vip evict it now
        (``policy.preempt.spares_an_eviction``, as ``Evictions.victims`` reads it)."""
        t = job.task
        return spares_an_eviction(at=now, resumes=t.resumable,
                                  left_s=max(self._expected_end(job) - now, 0.0) if t.declared_duration_s else None,
                                  pause_s=self._pause(job, now), deadline=t.deadline_s, max_queue_s=t.max_queue_s)

    def _vip_preempts_among(self, job: Job, victims: list[Job], now: float) -> bool | None:
        """``_vip_preempts`` with these candidate ``victims``: whether the vip started after
        the evictions it chose, ``None`` when it found none to choose."""
        if not victims:
            return None
        # The ledgers and the victims as the policy service reads them, once for every request.
        ledgers = {row: self._ledger(row) for row in sorted({j.row for j in victims})}
        all_chosen = []
        for j in victims:
            holds = tuple(a for a in ledgers[j.row].allocations if a.task_id == j.task.task_id)
            running = Running(task_id=j.task.task_id, node=self.state.node_names[j.row], allocations=holds)
            all_chosen.append((j.row, Victim(running=running, admitted=self._admitted(j),
                                             cost=eviction_cost(running, now, resumes=j.task.resumable),
                                             left_s=max(self._expected_end(j) - now, 0.0))))
        for _, req in self._requests(job):
            wanted = msgspec.structs.replace(job.submitted, gpu_memory_mb=req.gpu_memory_mb,
                                             gpu_models=list(req.gpu_models))
            # A contract bound to a site frees room on that site only; a node of no model the
            # request takes frees nothing it could use.
            candidates = {r for r in ledgers if (not req.site or self.node_site[r] == req.site)
                          and (not req.gpu_models or self.node_model[r] in req.gpu_models)}
            if not candidates:
                continue
            nodes = {self.state.node_names[r]: self.gpu_nodes[r] for r in candidates}
            chosen = [v for r, v in all_chosen if r in candidates]
            for plan in preemptions(wanted, nodes, {self.state.node_names[r]: ledgers[r] for r in candidates},
                                    chosen)[:3]:
                leaving = [self.by_id[v.task_id] for v in plan.victims]
                row = self.state.node_index(plan.node)
                with self._without(leaving):
                    decision = self.policy.decide(self.state, req)
                if decision.action != "assign" or decision.node_row != row:
                    continue  # the pure fit check and the policy rarely disagree
                for victim in leaving:
                    self._evict_for_vip(victim, now)
                return self._try_start(job, now, None, [], pause=TERMINATION_GRACE_S)
        return None

    def _evict_for_vip(self, victim: Job, now: float) -> None:
        """A vip's victim stopped, as the executor stops it (SIGTERM, then SIGKILL after the
        grace) and the policy service queues it again (``Evictions.preemption_for``): a run
        that resumes checkpoints on the SIGTERM and goes on from there, its progress kept
        (``Requeue.progress_s``); any other starts over from scratch."""
        if not victim.task.resumable:
            self._kill(victim, now, "preempted")
            return
        self.counts["preempted"] += 1
        victim.evictions += 1
        self._checkpoint(victim, now, by_round=False)

    def _ledger(self, row: int) -> NodeLedger:
        """The holds on node ``row`` as the policy service's ledger has them: one per GPU of
        each task running there, its CPU and host memory on the first."""
        holds = []
        for j in self._running_on(row):
            for i, g in enumerate(j.gpus):
                holds.append(Allocation(task_id=j.task.task_id, decision_id=f"{j.task.task_id}.assign", gpu=g,
                                        milli=j.milli, memory_mb=j.reserved_mb, state="confirmed", at=j.seg_start,
                                        cpu_milli=j.task.cpu_milli if i == 0 else 0,
                                        host_memory_mb=j.task.memory_mb if i == 0 else 0))
        return NodeLedger(node=self.state.node_names[row], allocations=holds)

    @staticmethod
    def _admitted(job: Job) -> TaskAdmitted:
        """``job`` as the policy service knows a running task: its admission."""
        return TaskAdmitted(task=job.submitted, contract=Contract(tier=job.task.tier), tenant=job.submitted.tenant,
                            admitted_at=job.task.arrival_s)

    @contextmanager
    def _without(self, jobs: Sequence[Job]) -> Iterator[None]:
        """The state as if ``jobs`` had released their holds, for a decision within."""
        for j in jobs:
            self.state.release(j.row, j.gpus, j.milli, cpu_milli=j.task.cpu_milli, memory_mb=j.task.memory_mb,
                               gpu_memory_mb=j.reserved_mb)
        try:
            yield
        finally:
            for j in jobs:
                self.state.allocate(j.row, j.gpus, j.milli, cpu_milli=j.task.cpu_milli, memory_mb=j.task.memory_mb,
                                    gpu_memory_mb=j.reserved_mb)

    def _pods_on(self, row: int) -> list[RunningPod]:
        """The baseline's pods running on node ``row``, as preemption sees them."""
        return [RunningPod(pod_id=j.task.task_id, priority=PRIORITY_CLASS.get(j.task.tier, 0), started_s=j.seg_start,
                           gpus=tuple(j.gpus), cpu_milli=j.task.cpu_milli, memory_mb=j.task.memory_mb,
                           milli=j.milli, gpu_memory_mb=j.reserved_mb)
                for j in self._running_on(row)]
