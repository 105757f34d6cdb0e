"""One mode of the fleet benchmark playing a workload (``FleetRun``): the clock, submission,
the queue and its reservations, and running tasks; what ``fleet``'s docstring describes.
Preemption, the moves for waiting tasks, the memory loop and the figures are its mixins."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import msgspec
import numpy as np

from fleetpilot.contracts import DecisionMade, Fingerprint, TaskSubmitted
from fleetpilot.contracts.task import SlaRequest
from fleetpilot.fingerprint import OnlineFingerprinter, SignatureMemory, task_signature
from fleetpilot.fleet.catalogue import gpu_model
from fleetpilot.fleet.inventory import Fleet
from fleetpilot.fleet.simulator import CONTEXT_MB, SimulatedFleet
from fleetpilot.maintenance import HealthModel
from fleetpilot.policy import ClusterState, Policy, TaskRequest, build_policy, typical_tasks
from fleetpilot.policy.backfill import (
    MAKE_WAY_PER_ROUND,
    TIER_RANK,
    Demand,
    Reservation,
    delays_any,
    gpu_free_at,
    hidden_from,
    queue_key,
    reserve_apart,
    reserve_earliest,
)
from fleetpilot.policy.calibration import ConfidenceCalibration
from fleetpilot.policy.rebalance import GROWTH_LOOKAHEAD_S, SMOOTH_GROWTH, envelope_bridge_mb
from fleetpilot.policy.spread import RecentWaits, spread_ask_mb
from fleetpilot.policy.state import MILLI, peak_sigma_mb
from fleetpilot.sla import Admit, CounterOffer, FleetView, GpuPool, bound_sites, contract_for, negotiate
from fleetpilot.sla.fleet import node_frontier
from fleetpilot.sla.snapshot import frees_in, play_queue, queued
from fleetpilot.workload.growth import MemoryGrowth

from .default_preemption import NO_POD, PRIORITY_CLASS
from .fleet_figures import FleetFigures
from .fleet_job import (
    BACKOFF_LIMIT,
    CONFIDENT_COUNT,
    DECISIONS_PER_CYCLE,
    FEEDBACK_EVERY,
    HEALTH_EVERY,
    MODES,
    ROLE_OF_KIND,
    ROUNDS_PER_CYCLE,
    SLA_KNOBS,
    TICK_S,
    Job,
)
from .fleet_memory import FleetMemory
from .fleet_moves import FleetMoves
from .fleet_preemption import FleetPreemption
from .fleet_report import RunResult
from .fleet_workload import BenchTask, Workload

# ---- the run ------------------------------------------------------------------------------


class FleetRun(FleetPreemption, FleetMoves, FleetMemory, FleetFigures):
    """One mode (``k8s-default``, ``kai-share`` or ``fleetpilot``) playing a workload on a fresh
    simulated fleet."""

    def __init__(self, fleet: Fleet, workload: Workload, mode: str, seed: int, *, knows_peaks: bool = False,
                 queue_aging: float = 1.0, preempts: bool | None = None, vip_evicts_standard: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
        if knows_peaks and mode != "fleetpilot":
            raise ValueError("only Fleetpilot's loop can be told each run's true peak")
        if preempts and mode == "fleetpilot":
            raise ValueError("only a baseline plays kube-scheduler's DefaultPreemption")
        if vip_evicts_standard and mode != "fleetpilot":
            raise ValueError("only Fleetpilot's vips may evict standard work its contract spares")
        self.fleet, self.workload, self.mode, self.seed = fleet, workload, mode, seed
        self.smart = mode == "fleetpilot"
        # KAI-Scheduler's GPU sharing: a share holds its fraction of one GPU and the GPU memory
        # it declared (plus its CUDA context), binpacked, with no isolation and no knowledge of
        # how it grows; a whole-GPU pod is scheduled as under ``k8s-default``.
        self.shares = mode == "kai-share"
        # An analysis, not a scheduler: each run asks for its true peak (``_reservation``), to
        # measure what no better memory prediction could add to the rest of the loop.
        self.knows_peaks = knows_peaks
        # Fleetpilot's queue order (``backfill.completion_order``; the policy service's
        # ``FLEETPILOT_POLICY_QUEUE_AGING``).
        self.queue_aging = queue_aging
        # A vip that no best-effort work makes room for may evict standard work its contract
        # spares (the policy service's ``FLEETPILOT_POLICY_VIP_EVICTS_STANDARD``).
        self.vip_evicts_standard = vip_evicts_standard
        # The baseline's PriorityClasses preempt lower ones (``default_preemption``), unless told
        # they are non-preempting (``preemptionPolicy: Never``): priority orders the queue only.
        self.preempts = not self.smart if preempts is None else preempts
        # The simulator's noise stream is seeded from the workload seed in both runs.
        self.sim = SimulatedFleet(fleet, seed=seed, start_at=0.0)
        self.gpu_nodes = gpu_nodes = [n for n in fleet.nodes if n.gpus]
        self.state = ClusterState.from_topology(gpu_nodes)
        # Row of the policy's state -> first GPU of that node in the simulator's arrays.
        sim_offset, k = {}, 0
        for n in fleet.nodes:
            sim_offset[n.node] = k
            k += len(n.gpus)
        self.offset = np.array([sim_offset[n.node] for n in gpu_nodes], dtype=np.int64)
        self.node_site = [n.site for n in gpu_nodes]
        self.node_model = [n.gpus[0].model for n in gpu_nodes]
        self.excluded = np.zeros(self.sim.gpu.count, dtype=bool)
        # The priority of the baseline's pod holding each GPU (``default_preemption``).
        self.holder_priority = np.full(self.state.gpu_free.shape, NO_POD, dtype=np.int64)
        self.price_per_h = float(sum(gpu_model(g.model).price_usd_per_hour for n in gpu_nodes for g in n.gpus))
        self.jobs = [self._job(t, i) for i, t in enumerate(workload.tasks)]
        self.by_id = {j.task.task_id: j for j in self.jobs}
        self.pending: list[Job] = []
        self.on_gpu: dict[tuple[int, int], set[str]] = {}
        self.memory = SignatureMemory()
        self.learnt: set[str] = set()  # signatures whose statistics changed this cycle (``_tell_waiting``)
        # Per signature no run of which has ended: the trusted fingerprint of its run in
        # progress seen longest (``_predict``).
        self.live: dict[str, Fingerprint] = {}
        self.health = HealthModel()
        self.windows: dict[int, deque] = {}
        self.pending_maintenance: dict[int, float] = {}
        self.failed_gpus: dict[int, float] = {}
        self.killed_runs: list[tuple[float, float, MemoryGrowth, int]] = []
        # Each task's first placement as the policy service would publish it, with the model of
        # its GPU: with how the run went, what the learner would learn from (``outcome_examples``).
        self.first_placements: dict[str, tuple[DecisionMade, str]] = {}
        self.denominators: list[float] = []
        self.memory_of = {n.gpus[0].model: float(n.gpus[0].memory_mb) for n in gpu_nodes}
        self.largest: dict[tuple[str, ...], float] = {}  # by the models a task accepts (``_largest``)
        self.waits_by_task: dict[str, float] = {}  # each task's queue time, once the run is over
        self.counts = {"oom_events": 0, "oom_restarts": 0, "backoff_failed": 0, "gpu_failure_kills": 0,
                       "migrations_oom": 0, "migrations_bridge": 0, "bridged": 0, "migrations_maintenance": 0, "migrations_no_target": 0, "migrations_clearing": 0, "clearings": 0, "migrations_down": 0, "made_way": 0, "made_room": 0, "checkpointed": 0,
                       "admitted": 0, "counter_offers": 0, "rejected": 0, "decisions": 0, "reservations": 0, "preempted": 0}
        self.policy = self._policy([])
        # Fleetpilot corrects its confidence by the outcomes of its placements so far, as the
        # policy service does from the feedback store's totals (``policy.calibration``).
        self.calibration = ConfidenceCalibration()
        self._typical_at = 0
        self._view: dict[tuple[str, str], dict] | None = None  # ``_pool_base``, once a cycle
        self.reservation: Reservation | None = None
        # The cycle's reservations after the first, each on nodes no earlier one's task could use.
        self.reservations_apart: list[Reservation] = []
        self.blocked: set[str] = set()
        # The waiting tasks of a share of one GPU that found no place this cycle (``_make_room``).
        self.blocked_shares: set[str] = set()
        self.bridged_ids: set[str] = set()  # the bridged tasks ``_enveloped`` reads
        self.waits = RecentWaits()  # how long the latest starts on each GPU size waited (``policy.spread``)
        # Each running task's memory samples (per GPU) of the last ``GROWTH_LOOKAHEAD_S``, and the
        # climbs held back from a move last cycle (``_climbs_within_its_gpu``).
        self.usage: dict[str, deque[tuple[float, float]]] = {}
        self.climbing: set[str] = set()
        # What is left of the cycle's rebalance rounds: decisions of any kind, and checkpoints
        # to make way or room (``_new_cycle``).
        self.decisions_left = DECISIONS_PER_CYCLE
        self.ways_left = MAKE_WAY_PER_ROUND * ROUNDS_PER_CYCLE

    # -- construction --------------------------------------------------------------------

    def _job(self, t: BenchTask, seq: int) -> Job:
        sub = TaskSubmitted(
            task_id=t.task_id, tenant="bench", kind=t.kind, gpus=t.gpus, gpu_milli=t.gpu_milli,  # type: ignore[arg-type]
            gpu_memory_mb=int(t.request_mb), gpu_models=list(t.gpu_models), cpu_milli=t.cpu_milli,
            memory_mb=t.memory_mb, sla=SlaRequest(tier=t.tier, max_queue_s=t.max_queue_s, deadline=t.deadline_s),  # type: ignore[arg-type]
            labels={"model": t.program, "role": ROLE_OF_KIND[t.kind]}, image=f"registry.local/{t.program}:1",
            command=["python", "-m", t.program], expected_duration_s=t.declared_duration_s, submitted_at=t.arrival_s,
            resumable=t.resumable)
        return Job(task=t, submitted=sub, signature=task_signature(sub), seq=seq)

    def _policy(self, seen: Sequence[TaskRequest]) -> Policy:
        # A refusal's reason is read by no one here: not working it out keeps a run about 15%
        # shorter on openb (``Policy``'s ``explain``).
        if not self.smart:
            # KAI's default placement strategy for GPUs is binpack: the reference simulator's
            # GPU packing (a partly used GPU first, then the tightest), on shares it holds.
            return build_policy("packing" if self.shares else "k8s-default", seed=self.seed, explain=False)
        if not seen:
            return build_policy("fleetpilot", seed=self.seed, explain=False)
        # As the policy service does: FGD's typical tasks at 95% coverage, and every shape
        # seen as the demand the pressure term prices capacity with.
        return build_policy("fleetpilot", seed=self.seed, typical=typical_tasks(seen),
                            demand=typical_tasks(seen, coverage=1.0), explain=False)

    def _refresh_typical(self, arrived: int) -> None:
        # FGD's typical tasks come from the tasks seen so far; recompiled as their number doubles.
        if not self.smart or arrived < max(32, 2 * self._typical_at):
            return
        self._typical_at = arrived
        self.policy = self._policy([self._request(j) for j in self.jobs[:arrived]])

    # -- requests --------------------------------------------------------------------------

    def _site(self, job: Job) -> str:
        """The site a request of ``job`` names when none is given: where it runs, if its
        contract binds it there (a move stays at its site), else the first its contract names
        (the one it was estimated at); "" for any."""
        if not job.bound_sites:
            return ""
        if job.state == "running" and self.node_site[job.row] in job.bound_sites:
            return self.node_site[job.row]
        return job.bound_sites[0]

    def _request(self, job: Job, *, bridge: bool = False, site: str | None = None) -> TaskRequest:
        t = job.task
        site = self._site(job) if site is None else site
        if bridge:
            # Start on what it asked for (a checkpointed run: on what it held, ``_checkpoint``;
            # a step schedule: what its envelope says it holds for a while, ``_envelope_ask``);
            # the peak is handled by a move before it arrives.
            return TaskRequest(task_id=t.task_id, kind=t.kind, gpus=t.gpus, gpu_milli=t.gpu_milli,
                               gpu_memory_mb=max(int(t.request_mb + CONTEXT_MB), job.stopped_at_mb, job.bridge_floor_mb,
                                                 self._envelope_ask(job)),
                               cpu_milli=t.cpu_milli, memory_mb=t.memory_mb, gpu_models=t.gpu_models, tier=t.tier,
                               role=ROLE_OF_KIND[t.kind], site=site)
        if not self.smart:
            return TaskRequest(task_id=t.task_id, kind=t.kind, gpus=t.gpus, gpu_milli=t.gpu_milli, cpu_milli=t.cpu_milli,
                               memory_mb=t.memory_mb, gpu_models=t.gpu_models, gpu_memory_mb=self._declared_mb(job))
        peak = sigma = 0.0
        if job.prediction is not None:
            peak = float(job.prediction.predicted_peak_mb)
            sigma = peak_sigma_mb(job.prediction)
        reserve = self._reservation(job)
        # The models that can hold the predicted peak are the task's real constraint; stated as
        # such, the policy's model-demand pressure keeps flexible tasks off the big GPUs.
        models = tuple(m for m in t.gpu_models if self.memory_of.get(m, 0.0) >= reserve) or t.gpu_models
        return TaskRequest(task_id=t.task_id, kind=t.kind, gpus=t.gpus, gpu_milli=t.gpu_milli,
                           gpu_memory_mb=reserve, cpu_milli=t.cpu_milli, memory_mb=t.memory_mb,
                           gpu_models=models, tier=t.tier, role=ROLE_OF_KIND[t.kind],
                           predicted_peak_mb=peak, peak_sigma_mb=sigma, site=site)

    def _declared_mb(self, job: Job) -> int:
        """GPU memory a baseline holds per GPU: under ``kai-share`` what the task declared
        plus its CUDA context (KAI's ``gpu-memory``), as Fleetpilot holds it for a task it
        knows nothing of; none under ``k8s-default``, which knows no GPU memory."""
        return int(job.task.request_mb + CONTEXT_MB) if self.shares else 0

    def _hold(self, job: Job, row: int, gpus: list[int]) -> int:
        """The reservation, but never more than the GPUs a bridged task sits on."""
        reserve = self._reservation(job)
        if job.bridged:
            reserve = min(reserve, int(self.state.gpu_mem_total[row, np.asarray(gpus)].min()))
        return reserve

    def _reservation(self, job: Job) -> int:
        """GPU memory the ledger holds per GPU: the predicted peak plus 5% (the ask plus the
        CUDA context when nothing is predicted), at least the signature's OOM floor and what a
        checkpointed run held when it was stopped; at most the smallest GPU the task accepts
        that held nearly all of its program's runs (``fit_peak_mb``), or a smaller one whose
        share of runs not held the recent wait for that size makes worth risking
        (``policy.spread``), as the policy service's request asks; unless this run died of OOM
        alone: it is one of the few that go higher."""
        if self.knows_peaks:
            # The run's own curve's peak, its CUDA context and three sigmas of its noise.
            g = job.task.growth
            return int(min(g.peak_mb + CONTEXT_MB + 3.0 * g.noise_mb, self._largest(job.task.gpu_models)))
        stats = self.memory.stats(job.signature)
        floor = stats.oom_floor_mb if stats is not None else 0.0
        p = job.prediction
        want = job.task.request_mb + CONTEXT_MB if p is None or p.predicted_peak_mb <= 0 else p.predicted_peak_mb * 1.05
        want = max(want, job.stopped_at_mb, floor)
        if p is not None and not job.died_alone:
            sizes = [mb for m in job.task.gpu_models or tuple(self.memory_of) if (mb := self.memory_of.get(m, 0.0)) > 0]
            want = spread_ask_mb(want, sizes, p.fit_peak_mb, p.run_peaks_mb, self.waits, job.task.declared_duration_s,
                                 at_least_mb=job.stopped_at_mb)
        # Nothing can hold more than the largest GPU the task accepts: a prediction above it
        # is treated as "needs a whole one of those" rather than as unplaceable.
        return int(min(want, self._largest(job.task.gpu_models)))

    # -- main loop -------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Play the whole workload; returns the figures."""
        start = time.perf_counter()
        w = self.workload
        arrivals = deque(self.jobs)
        faults = sorted(w.faults, key=lambda f: f.onset_s)
        degrading_started: set[int] = set()
        failed_done: set[int] = set()
        times, utils, queue = [], [], []
        tick = 0
        now = 0.0
        self._arrivals_until(arrivals, TICK_S)
        while now < w.horizon_s:
            tick += 1
            self.sim.advance(TICK_S)
            now = self.sim.now_s
            self._events(now)
            for k, f in enumerate(faults):
                if f.kind == "degrading" and k not in degrading_started and f.onset_s <= now:
                    degrading_started.add(k)
                    # Counters start rising at onset and accelerate until the GPU falls off the bus.
                    self.sim.degrade(f.node, f.gpu, "ecc_corrected", rate_per_h=5.0, accel_per_h2=100.0)
                    self.sim.degrade(f.node, f.gpu, "remapped_rows", rate_per_h=0.2, accel_per_h2=2.0)
                    self.sim.degrade(f.node, f.gpu, "pcie_replays", rate_per_h=5.0, accel_per_h2=50.0)
                if k not in failed_done and f.fails_s <= now:
                    failed_done.add(k)
                    self.sim.inject_xid(f.node, f.gpu, 79)
                    self._events(now)
            if self.smart:
                self._new_cycle()
                self._tell_waiting()
                self._observe_tasks(now)
                if tick % HEALTH_EVERY == 0:
                    self._watch_health(now)
                if tick % FEEDBACK_EVERY == 0:
                    _, _, _, judged, expected, met = self._judged()
                    self.calibration.update(self.mode, expected, met, judged)
            self._schedule(now)
            self._view = None  # the negotiator's snapshot is refreshed once a cycle
            times.append(now / 3600.0)
            utils.append(self._utilisation())
            queue.append(len(self.pending))
            self._arrivals_until(arrivals, now + TICK_S)
        return self._result(now, times, utils, queue, time.perf_counter() - start)

    def _new_cycle(self) -> None:
        """Give the cycle its rebalance rounds' budgets, as each of the policy service's rounds
        starts with ``max_migrations_per_round`` decisions, at most ``MAKE_WAY_PER_ROUND`` of
        them to make way or room (``Moves.rebalance_round``)."""
        self.decisions_left = DECISIONS_PER_CYCLE
        self.ways_left = MAKE_WAY_PER_ROUND * ROUNDS_PER_CYCLE

    def _utilisation(self) -> float:
        g = self.sim.gpu
        keep = ~self.excluded
        total = float(g.memory_total_mb[keep].sum())
        self.denominators.append(total)
        return float(g.memory_used_mb[keep].sum()) / total if total > 0 else 0.0

    # -- submission and queue ----------------------------------------------------------------

    def _arrivals_until(self, arrivals: deque[Job], until: float) -> None:
        """Decide the tasks that arrive before ``until`` (the next cycle), each at its own
        instant, as kube-scheduler does when a pod is created and the policy service on
        ``task.admitted``: negotiated, then tried against the fleet as the last cycle left it
        (completions are seen at cycles) and that cycle's reservation. A task that starts
        starts at its arrival; one that finds no room waits for the next cycle. The
        simulator still steps a minute at a time (its sampling, and so its OOM statistics,
        are those of the cycle): a task started within a step is placed to start later."""
        while arrivals and arrivals[0].task.arrival_s < until:
            job = arrivals.popleft()
            at = max(job.task.arrival_s, self.sim.now_s)
            self._submit(job, at)
            if job.state != "pending":
                continue
            self._refresh_typical(len(self.jobs) - len(arrivals))
            if self._try_start(job, at, self.reservation, []) or self._preempt_for(job, at):
                self.pending.remove(job)  # ``_submit`` queued it (a preemption's victims behind it)
                self._seen_started(job, at)

    def _submit(self, job: Job, now: float) -> None:
        if self.smart:
            # The SLA negotiator reads the signature's statistics (the ``fingerprints`` bucket);
            # the policy is told a run in progress too (``_predict``), by the fingerprinter.
            learnt = self.memory.predict(job.signature)
            decision = negotiate(job.submitted, self._fleet_view(now, ahead_of=self._key(job)[:2]), now=now,
                                 fingerprint=learnt)
            job.prediction = learnt or self._lent(job.signature)
            # Every bench task bounds its wait, so its admission runs on the models its
            # contract lists, as the sla service shapes the task (``admission``): the model it
            # was estimated on and every other that keeps its terms; an accepted offer on the
            # option's models (its own first); either at the sites its contract lists where a
            # term depends on the site (``bound_sites``, the policy's ``contract_sites``).
            if isinstance(decision, Admit):
                self.counts["admitted"] += 1
                contract = decision.contract
                self._bind(job, contract.gpu_models, bound_sites(contract))
                if contract.site is not None and contract.gpu_models:
                    job.agreed_pool = (contract.site, contract.gpu_models[0])
            elif isinstance(decision, CounterOffer):
                # The submitter accepts the first option; the SLA is still measured as asked.
                self.counts["counter_offers"] += 1
                job.counter_offered = True
                first = decision.options[0]
                if first.gpu_model is not None:
                    # The contract accepting it makes, as the sla service makes it: its models,
                    # and its sites only where a term depends on the site (``bound_sites``).
                    terms = contract_for(job.submitted, first, "bench")
                    self._bind(job, terms.gpu_models, bound_sites(terms))
                if first.site is not None and first.gpu_model is not None:
                    job.agreed_pool = (first.site, first.gpu_model)
            else:
                self.counts["rejected"] += 1
                job.state = "rejected"
                return
        self._enqueue(job, now)

    @staticmethod
    def _bind(job: Job, models: Sequence[str], sites: Sequence[str] = ()) -> None:
        """Hold ``job`` to what its contract says: the models it may run on, and the sites it
        binds it to (as the sla service rewrites the admitted task)."""
        if models:
            job.task = replace(job.task, gpu_models=tuple(models))
            job.submitted = msgspec.structs.replace(job.submitted, gpu_models=list(models))
        job.bound_sites = tuple(sites)

    def _largest(self, models: tuple[str, ...]) -> float:
        """The most memory a GPU of ``models`` has (any model's, for none)."""
        if models not in self.largest:
            self.largest[models] = max((self.memory_of.get(m, 0.0) for m in models or self.memory_of), default=0.0)
        return self.largest[models]

    def _enqueue(self, job: Job, now: float) -> None:
        job.state = "pending"
        job.queued_since = now
        self.pending.append(job)

    def _key(self, job: Job) -> tuple[float, ...]:
        if self.smart:
            # Within a tier, the earliest expected completion on an idle fleet first (arrival,
            # weighed by the queue aging, plus the run still to do: ``backfill.completion_order``):
            # short work does not queue behind long work, and nothing starves (at the default
            # aging of 1, a later arrival overtakes a task only while it is expected to end
            # before that task would).
            return (*queue_key(job.task.tier, job.task.arrival_s, self._remaining(job), self.queue_aging), job.seq)
        # PrioritySort: the pod's PriorityClass (its tier), then the time it was created.
        return (TIER_RANK.get(job.task.tier, 1), job.queued_since, job.seq)

    def _schedule(self, now: float) -> None:
        if not self.pending:
            # Nothing waits: no reservation (the policy service's retry round finds no owner).
            self.reservation, self.blocked, self.blocked_shares = None, set(), set()
            return
        self.pending.sort(key=self._key)
        # (demand, decided with the reservation hidden) of the requests that found no node.
        failed: list[tuple[Demand, bool]] = []
        keep: list[Job] = []
        free_at: np.ndarray | None = None
        reservation: Reservation | None = None
        head = self._first_blocked()
        self.reservations_apart = []
        if head is not None:
            free_at = gpu_free_at(self.state, self._running_ends(), now)
            reservation = self._reserve(head, free_at)
            if reservation is not None:
                waiters = sorted((j for j in self.pending if j.task.task_id in self.blocked and j is not head),
                                 key=self._key)
                self.reservations_apart = reserve_apart(
                    self.state, self._plain_requests(head),
                    [self._plain_requests(j) for j in waiters], free_at)
        self.blocked, self.blocked_shares = set(), set()

        def hold_for(refused: TaskRequest) -> None:
            # With no reservation yet this cycle, the first task the policy refuses gets one.
            nonlocal free_at, reservation
            if not self.smart or reservation is not None:
                return
            if free_at is None:
                free_at = gpu_free_at(self.state, self._running_ends(), now)
            reservation = self._reserve(self.by_id[refused.task_id], free_at)
            self.counts["reservations"] += reservation is not None

        # A pod preempted in this pass is queued again at once (its Job's replacement pod),
        # at the end of the list, and decided in the same pass.
        for job in self.pending:
            if not (self._try_start(job, now, reservation, failed, on_refused=hold_for) or self._preempt_for(job, now)):
                keep.append(job)
        self.pending = keep
        self.reservation = reservation
        if reservation is not None and reservation.start_s > now:
            self._clear_for(self.by_id[reservation.task_id], reservation, now)
        if self.smart:
            self._move_down(now, reservation)
            self._make_way(now, reservation)
            self._make_room(now, reservation)

    def _try_start(self, job: Job, now: float, reservation: Reservation | None, failed: list[tuple[Demand, bool]],
                   *, on_refused: Callable[[TaskRequest], None] | None = None, pause: float = 0.0) -> bool:
        """Try to start a waiting task now: its plain request, then (a smooth grower) its
        bridge; whether it started. ``failed`` gathers what found no node, so that a task
        needing no less is not decided again this cycle; ``on_refused`` is told the plain
        request when the policy itself finds it no node (before the bridge is tried).
        ``pause``: it runs only that much later (a tenant is being moved off its GPU), which
        counts as queue time."""
        requests = self._requests(job)
        # Fleetpilot backfills around a reservation for the first blocked whole-GPU task
        # (EASY): a task expected to outlast the reservation's start may not use its GPUs.
        hiding = (reservation, *self.reservations_apart)
        hide = delays_any(hiding, job.task.task_id, self._remaining(job), now)
        for first, (bridge, req) in enumerate(requests):
            k = int(bridge)
            demand = Demand.of(req, whole_gpus=not (self.smart or self.shares))
            # A failure with the reservation hidden says nothing about a task that may use it.
            if any(demand.cannot_fit_after(f) for f, masked in failed if hide or not masked):
                self._note_blocked(job, k)
                continue
            self.counts["decisions"] += 1
            with hidden_from(self.state, hiding, job.task.task_id, self._remaining(job), now):
                decision = self.policy.decide(self.state, req)
            if decision.action != "assign":
                failed.append((demand, hide))
                self._note_blocked(job, k)
                if first == 0 and on_refused is not None:
                    on_refused(req)
                continue
            gpus = [p.gpu for p in decision.placement if p.gpu >= 0]
            if job.confidence is None:
                job.confidence = (self.calibration.apply(self.mode, decision.confidence) if self.smart
                                  else decision.confidence)
            job.bridged = k == 1
            self.counts["bridged"] += job.bridged
            if job.bridged:
                self.bridged_ids.add(job.task.task_id)
            job.queue_s += pause
            self._start(job, decision.node_row, gpus, decision.placement[0].milli, now, pause=pause)
            return True
        return False

    def _requests(self, job: Job) -> list[tuple[bool, TaskRequest]]:
        """What the policy is asked for ``job``, in order, each with whether it is its bridge:
        as the policy service tries a contract bound to sites, the plain request at each of
        them in the contract's order, then the bridge at each (``ReplicaState.requests``)."""
        # Each is built once (its ask is worked out there) and named at every site.
        sites = job.bound_sites or ("",)
        built = [(bridge, self._request(job, bridge=bridge, site=sites[0]))
                 for bridge in ([False, True] if self._bridgeable(job) else [False])]
        return [(bridge, req if site == req.site else msgspec.structs.replace(req, site=site))
                for bridge, req in built for site in sites]

    def _running_on(self, row: int) -> list[Job]:
        """The tasks running on node ``row``, by task id."""
        ids = set().union(*(self.on_gpu.get((row, g), set()) for g in range(self.state.max_gpus)))
        return [j for j in (self.by_id[t] for t in sorted(ids)) if j.state == "running"]

    def _note_blocked(self, job: Job, k: int) -> None:
        if not self.smart or k != 0:
            return
        if job.task.gpu_milli >= MILLI:
            self.blocked.add(job.task.task_id)
        elif job.task.gpus == 1:
            self.blocked_shares.add(job.task.task_id)

    def _reserve(self, job: Job, free_at: np.ndarray) -> Reservation | None:
        """The reservation for a blocked ``job``: the earliest of its plain requests at each
        site its contract binds it to (``backfill.reserve_earliest``), as the policy service
        reserves (``Moves.reservations_for``)."""
        made = reserve_earliest(self.state, self._plain_requests(job), free_at)
        return made[0] if made is not None else None

    def _plain_requests(self, job: Job) -> list[TaskRequest]:
        """``job``'s plain request at each site its contract binds it to (one, anywhere, for
        a task bound to none)."""
        return [req for bridge, req in self._requests(job) if not bridge]

    def _first_blocked(self) -> Job | None:
        """The reservation's owner: of the whole-GPU tasks that found no place since the last
        cycle, the first in the queue's order. Expected completion bounds how long anything
        is overtaken, the wide and the long included (``backfill.completion_order``)."""
        blocked = [j for j in self.pending if j.task.task_id in self.blocked]
        return min(blocked, key=self._key) if blocked else None

    def _remaining(self, job: Job) -> float:
        """What is left of the run the user declared (a checkpointed task keeps its progress)."""
        return max(job.task.declared_duration_s - job.progress_s, 0.0)

    def _running_ends(self) -> list[tuple[int, list[int], float]]:
        """``(row, gpus, expected end)`` of every running task, by its declared duration."""
        return [(j.row, j.gpus, self._expected_end(j)) for j in self.jobs if j.state == "running"]

    def _expected_end(self, job: Job) -> float:
        """When a running task is expected to end, by the duration it declared."""
        return job.seg_start + job.seg_pause + self._remaining(job)

    def _bridgeable(self, job: Job) -> bool:
        """A task predicted to grow smoothly (linear, leak) past every GPU free for it now may
        start on GPUs that hold its ask, and be moved (or checkpointed) when its measured growth
        is about to outrun them: most of a leak's life is spent low. A run from its start whose
        signature's envelope stays below its peak for a while (a step schedule
        before its big steps) may start on GPUs that hold that much, and is moved (or
        checkpointed) before the envelope says it outgrows them (``_enveloped``)."""
        p = job.prediction
        if not self.smart or p is None or not job.task.resumable:
            return False  # one that cannot resume would start over when it moved up
        return p.pattern in SMOOTH_GROWTH or self._envelope_ask(job) > 0

    def _envelope_ask(self, job: Job) -> int:
        """What a run from its start must have per GPU to stay ``MIN_BRIDGE_STAY_S`` where it
        starts, by its signature's envelope (``envelope_bridge_mb``), when that is less than
        its plain request; 0 when it is not, or nothing is known of when it grows, or it grows
        smoothly, or it is restored: the policy service knows a run's progress only from its
        first placement (``envelope_overflow``), and the benchmark does as it does."""
        if job.progress_s > 0 or job.resume is not None:
            return 0
        ask = envelope_bridge_mb(job.prediction, job.task.declared_duration_s, GROWTH_LOOKAHEAD_S)
        return ask if ask < self._reservation(job) else 0

    # -- running tasks -----------------------------------------------------------------------

    def _start(self, job: Job, row: int, gpus: list[int], milli: int, now: float, *,
               growth: MemoryGrowth | None = None, pause: float = 0.0) -> None:
        """Start ``job`` on ``gpus`` of node ``row``. A waiting task given a ``pause`` (the
        checkpoints of the tenants it replaces, a preemption's grace period) begins its run
        only then; a moved one (``growth``: its restored curve) plays its ``pause`` in it."""
        t = job.task
        # A waiting task's run begins after the pause it was given, and after that its restore
        # (a checkpointed one's curve plays it).
        delay = pause if job.state == "pending" else 0.0
        reserve = self._hold(job, row, gpus) if self.smart else self._declared_mb(job)
        self.state.allocate(row, gpus, milli, cpu_milli=t.cpu_milli, memory_mb=t.memory_mb, gpu_memory_mb=reserve)
        if job.state == "pending" and self.smart:
            self.waits.started(float(self.state.gpu_mem_total[row, gpus[0]]), now - job.queued_since)
        if job.state == "pending" and job.resume is not None:
            job.queue_s += now - job.queued_since
            growth, restore = job.resume
            pause = delay + restore
            if job.restored_from is not None:
                # What it holds as it is restored (a collector samples every few seconds; this
                # loop's samples come a minute apart, long enough for a short rest to grow):
                # did it come back where it was stopped?
                self.memory.observe_restore(job.signature, job.restored_from, float(growth.memory_at(0.0)))
            job.resume, job.restored_from, job.stopped_at_mb, job.bridge_floor_mb = None, None, 0, 0
        elif job.state == "pending":
            job.queue_s += now - job.queued_since
            job.attempts += 1
            if job.attempts == 1:
                self._first_placement(job, row, gpus, milli, reserve, now)
            job.progress_s = 0.0
            if self.smart:
                watch = self.memory.stats(job.signature)
                if watch is None or watch.count < CONFIDENT_COUNT or job.bridged:
                    job.fingerprinter = OnlineFingerprinter(job.signature, expected_duration_s=t.declared_duration_s,
                                                            started_at=now, refit_growth=0.5, prior=job.prediction)
        # Whether the series sampled from now begins with the run: only then may it teach the
        # signature's envelope (after a move the fingerprinter service starts a series anew).
        series_from_start = job.state == "pending" and job.progress_s == 0.0
        if job.state == "pending":
            # A move keeps both: the policy service's holds carry when the run began.
            job.from_start = series_from_start
            job.run_at = now if job.from_start else 0.0
        if job.bridged:
            job.history = deque(maxlen=3)
            if job.fingerprinter is None:
                job.fingerprinter = OnlineFingerprinter(job.signature, expected_duration_s=t.declared_duration_s,
                                                        started_at=now, refit_growth=0.5, prior=job.prediction,
                                                        from_start=series_from_start)
        job.state = "running"
        job.row, job.gpus, job.milli, job.reserved_mb = row, list(gpus), milli, reserve
        job.planned_mb = reserve if job.planned_mb == 0 else job.planned_mb
        job.seg_start, job.seg_pause = now, pause
        node = self.state.node_names[row]
        job.curve = growth or t.growth
        self.sim.place(t.task_id, node, gpus, job.curve, util=t.util, start_s=max(now, self.sim.now_s) + delay)
        for g in gpus:
            self.on_gpu.setdefault((row, g), set()).add(t.task_id)
        self._count_holders(row, gpus)

    def _stop(self, job: Job) -> None:
        t = job.task
        self.state.release(job.row, job.gpus, job.milli, cpu_milli=t.cpu_milli, memory_mb=t.memory_mb,
                           gpu_memory_mb=job.reserved_mb)
        for g in job.gpus:
            self.on_gpu.get((job.row, g), set()).discard(t.task_id)
        self._count_holders(job.row, job.gpus)

    def _count_holders(self, row: int, gpus: list[int]) -> None:
        """A baseline's ``holder_priority`` of these GPUs: the lowest priority of the pods on
        each (``NO_POD`` for none), which its preemption looks for first."""
        if self.smart:
            return
        for g in gpus:
            self.holder_priority[row, g] = min((PRIORITY_CLASS.get(self.by_id[i].task.tier, 0)
                                                for i in self.on_gpu.get((row, g), ())), default=NO_POD)

    def _take_off(self, job: Job) -> None:
        """Stop a task's process to move or checkpoint it; its run goes on where it is restored,
        so the most it held so far stays part of its run's peak."""
        job.run_peak_mb = max(job.run_peak_mb, self.sim.peak_held_mb(job.task.task_id))
        self.sim.remove(job.task.task_id)

    def _events(self, now: float) -> None:
        for ev in self.sim.events():
            if ev.kind == "xid" and int(ev.value) == 79:
                row = self.state.node_index(ev.node)
                gi = int(self.offset[row]) + ev.gpu
                self.failed_gpus[gi] = now
                self.excluded[gi] = True
                # The device plugin's health check takes a GPU that fell off the bus out of service.
                self.state.set_condition(row, [ev.gpu], healthy=False)
                continue
            job = self.by_id.get(ev.task_id or "")
            if job is None or job.state != "running":
                continue
            if ev.kind == "finished":
                self._stop(job)
                job.state, job.finished_at = "done", now
                self._remember(job, now)
                if self.smart:
                    # Every completed run's peak, as the fingerprinter service folds in each run
                    # it watched (not only the first few this loop fingerprints).
                    self.memory.observe_run_peak(job.signature, max(job.run_peak_mb, ev.value))
                    self.learnt.add(job.signature)
            elif ev.kind in ("oom", "task_failed"):
                if ev.kind == "oom":
                    self.counts["oom_events"] += 1
                    self._learn_from_oom(job, ev.value)
                else:
                    self.counts["gpu_failure_kills"] += 1
                self._kill(job, now, ev.kind)

    def _kill(self, job: Job, now: float, cause: str) -> None:
        """A run killed by ``cause`` (``oom``, ``task_failed``: its GPU failed; ``preempted``):
        its work is lost, and its Job starts it again from scratch unless that was its last
        attempt (``BACKOFF_LIMIT``). Fleetpilot's evictions for a vip count toward no limit:
        the policy stopped the task, it did not fail."""
        self._stop(job)
        if cause == "preempted":
            self.sim.remove(job.task.task_id)
            self.counts["preempted"] += 1
            job.evictions += self.smart
        self.killed_runs.append((job.seg_start, now, job.curve or job.task.growth, len(job.gpus)))
        job.progress_s, job.run_peak_mb = 0.0, 0.0
        if job.attempts - job.evictions > BACKOFF_LIMIT:
            job.state = "failed"
            self.counts["backoff_failed"] += 1
            return
        if cause == "oom":
            self.counts["oom_restarts"] += 1
        if self.smart:
            job.prediction = self._predict(job.signature) or job.prediction
        job.fingerprinter = None
        self._enqueue(job, now)

    # -- the SLA negotiator's view -------------------------------------------------------------

    def _fleet_view(self, now: float, ahead_of: tuple[int, float]) -> FleetView:
        """The SLA negotiator's view at ``now`` of a request whose place in the queue is
        ``ahead_of``, as the sla service's ``fleet_view`` builds it from the ledger and the
        contracts: free GPUs (with the headroom kept for guaranteed tiers), spare shares,
        preemptible GPUs and completions per (site, model), then the tasks
        admitted, still waiting and served before the request played through them in the
        queue's order (``play_queue``). The running tasks are counted once a cycle and kept
        up to date with the arrivals that start within it (``_seen_started``)."""
        base = self._pool_base(now)
        waiting: dict[tuple[str, str], list[tuple[int, int, float | None]]] = {}
        for j in sorted(self.pending, key=self._key):
            if j.agreed_pool is not None and j.agreed_pool in base and self._key(j)[:2] < ahead_of:
                waiting.setdefault(j.agreed_pool, []).append(queued(j.submitted))
        out = []
        for (site, model), p in base.items():
            free, frees, gaps = play_queue(p["free"], p["completions"], waiting.get((site, model), ()))
            completions: dict[float, int] = {}
            for in_s in frees[:256]:
                completions[in_s] = completions.get(in_s, 0) + 1
            m = gpu_model(model)
            # The headroom kept for guaranteed tiers (best_effort requests never see it), as the
            # service keeps it: a share of the pool's GPUs, at most those free now.
            reserved = min(p["free"], math.ceil(p["total"] * SLA_KNOBS.reserve_fraction))
            out.append(GpuPool(site=site, gpu_model=model, memory_mb_per_gpu=m.memory_mb,
                               price_per_gpu_hour=m.price_usd_per_hour, free_gpus=free, free_milli=p["milli"],
                               reserved_gpus=reserved, preemptible_gpus=p["preemptible"],
                               most_clearable_on_a_node=p["clearable"],
                               completions=tuple(sorted(completions.items())),
                               relative_compute=m.compute_ratio, most_gpus_on_a_node=p["most"],
                               node_shapes=p["shapes"], gaps=tuple(gaps)))
        return FleetView(pools=tuple(out))

    def _pool_base(self, now: float) -> dict[tuple[str, str], dict]:
        """Per (site, model): GPUs free, the largest spare share, when each busy GPU frees
        (seconds from ``now``: when its last holder ends, whole or a share, as the sla
        service's ``fleet_view`` counts it), the most GPUs a node has and each node's GPUs,
        CPU and memory (``node_frontier``); counted at the first arrival after a cycle and
        kept for the arrivals until the next."""
        if self._view is not None:
            return self._view
        s = self.state
        free = s.usable_free()
        pools: dict[tuple[str, str], dict] = {}
        for row in range(s.n_nodes):
            key = (self.node_site[row], self.node_model[row])
            p = pools.setdefault(key, {"free": 0, "milli": 0, "completions": [], "most": 0, "shapes": set(),
                                       "total": 0, "preemptible": 0, "clearable": 0})
            f = free[row][s.gpu_exists[row]]
            p["most"] = max(p["most"], int(f.size))  # every GPU of the node, in service or not
            p["total"] += int(f.size)
            p["shapes"].add((int(f.size), int(s.cpu_total[row]), int(s.mem_total[row])))
            idle = int((f >= MILLI).sum())
            p["free"] += idle
            # GPUs in service whose holders are all best_effort: what a vip may preempt.
            preemptible = sum(1 for g in np.flatnonzero(s.gpu_exists[row])
                              if not self.excluded[self.offset[row] + g] and self.on_gpu.get((row, int(g)))
                              and all(self.by_id[t].task.tier == "best_effort" for t in self.on_gpu[(row, int(g))]))
            p["preemptible"] += preemptible
            p["clearable"] = max(p["clearable"], idle + preemptible)
            part = f[(f > 0) & (f < MILLI)]
            if part.size:
                p["milli"] = max(p["milli"], int(part.max()))
        # Each busy GPU's last holder: (its end, its declared run), the larger first.
        last: dict[tuple[int, int], tuple[float, float]] = {}
        for j in self.jobs:
            if j.state == "running":
                ends = self._ends(j)
                for g in j.gpus:
                    last[(j.row, g)] = max(last.get((j.row, g), ends), ends)
        for (row, _), (end, declared) in last.items():
            pools[(self.node_site[row], self.node_model[row])]["completions"].append(frees_in(end, declared, now))
        for p in pools.values():
            p["shapes"] = node_frontier(p["shapes"])  # once a cycle, not once per arrival's view
        self._view = pools
        return pools

    def _ends(self, job: Job) -> tuple[float, float]:
        """When a running task is expected to end, as the sla service's snapshot counts it
        (when its run began plus its declared run), with that declared run."""
        return job.seg_start + job.task.declared_duration_s - job.progress_s, job.task.declared_duration_s

    def _frees_in(self, job: Job, now: float) -> float:
        """When a running task frees its GPUs, as the service's snapshot says: a run past its
        declared end is not freeing "now" (``frees_in``)."""
        return frees_in(*self._ends(job), now)

    def _seen_started(self, job: Job, now: float) -> None:
        """A task started at its arrival holds its GPUs in the ledger at once: the next
        arrival's view no longer has them free, and has them free when it ends. (A share on
        a GPU others already share is not counted again: its end may come later than theirs,
        which the next cycle's view counts.)"""
        if self._view is None:
            return
        taken = [g for g in job.gpus if self.on_gpu.get((job.row, g), set()) == {job.task.task_id}]
        if not taken:
            return
        pool = self._view[(self.node_site[job.row], self.node_model[job.row])]
        pool["free"] = max(pool["free"] - len(taken), 0)
        pool["completions"].extend([self._frees_in(job, now)] * len(taken))

    # -- the simulator's GPUs ------------------------------------------------------------------

    def _gpu_slot(self, gi: int) -> tuple[int, int]:
        """``(row of the policy's state, GPU index on that node)`` of the simulator's GPU ``gi``."""
        row = int(np.searchsorted(self.offset, gi, side="right") - 1)
        return row, gi - int(self.offset[row])


