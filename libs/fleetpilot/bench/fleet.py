"""The fleet benchmark: Fleetpilot's full loop against the Kubernetes default scheduler.

One workload (``fleet_workload``), one simulated fleet, one virtual clock, played twice.
In both runs a task is decided at the instant it arrives, as kube-scheduler schedules a pod
when it is created and the policy service places a task on ``task.admitted``; a task that
finds no room then waits in the queue, which is retried every cycle (``TICK_S``, a minute;
kube-scheduler retries on cluster events and the policy service every second, so the cycle
errs on the slow side for both).

**k8s-default** — the default scheduler with the NVIDIA device plugin: whole GPUs only (a
task asking for a share still holds a whole GPU), LeastAllocated node scoring, first free
device indices, no notion of GPU memory. Pending pods are retried every cycle in queue order
(kube-scheduler's PrioritySort: each tier is a PriorityClass, vip highest, then FIFO by the
time the pod was created) with backfill: a pod that does not fit does not block the ones
behind it. A pod killed by an OOM or by a failed GPU is recreated by its Job controller (a
new pod at the back of its priority's queue, from scratch) up to the Job's ``backoffLimit``
of 6; the device plugin takes a GPU that fell off the bus out of service. The PriorityClasses
preempt, as kube-scheduler's ``DefaultPreemption`` does by default (``default_preemption``): a
pod that fits nowhere evicts the lower-priority pods the scheduler's criteria pick on one node,
each a failed attempt of its Job (started again from scratch, counted toward its backoff
limit, as without a ``podFailurePolicy``), and starts there after their grace period of 30 s,
counted as its queue time. ``--baseline-never-preempts`` makes them non-preempting
(``preemptionPolicy: Never``): a vip pod waits for room as the others do. Preempting
shortens the baseline's mean queue on most of the table's workloads and its SLA misses on
three-site (the benchmark's log). (Before PriorityClasses, every pod had the same priority: a team
with tiers that had set none, and its vip work queued behind best-effort work, 264 SLA misses
against 53 on three-site seed 7.)

**fleetpilot** — the full loop:

- SLA negotiation (``sla.negotiate``) at submission against the fleet as it is, behind the
  admitted tasks still waiting that the queue serves first, as the sla service's snapshot
  counts them (``play_queue``): admitted, or counter-offered (the submitter is modelled as
  accepting the first option), or rejected; an admitted task then runs only on its
  contract's models, an accepted offer on its option's models, at the sites that keep its
  contract's terms where one depends on the site (``sla.bound_sites``, ``_bind``), as the
  sla service shapes the task for the policy; the queue is ordered by tier (vip first), then by expected completion
  (``backfill.completion_order``: arrival plus the declared run still to do), with backfill
  around a reservation (EASY, ``policy.backfill``, as the policy service does): the
  whole-GPU task first in that order among those that found no place gets the GPUs that
  free earliest by the running tasks' declared durations, and tasks expected to outlast
  that start may not use them (nor may a migration put a task there);
- clearing: when that start is further away than the tenants of some node cost to move
  (``backfill.clearing``: checkpoint pauses times GPUs against the wait times the GPUs it
  needs), they are migrated where the policy places them and the task starts there once
  their checkpoints are taken;
- fingerprints: a task whose signature (``fingerprint.task_signature``) is known gets the
  ``SignatureMemory`` prediction at submission; tasks of unknown or little-known signatures
  are fingerprinted online (``OnlineFingerprinter``) from the simulator's per-task memory
  samples, and their end-of-life fingerprint is remembered; until a run of a signature has
  ended, its tasks are given the trusted fingerprint of a run of it in progress (``_predict``,
  as the fingerprinter service tells them), while the SLA negotiator reads only what ended
  runs taught, as the SLA service reads the ``fingerprints`` bucket;
- the ``fleetpilot`` policy with GPU sharing (fractional GPUs) and OOM-risk awareness: the
  ledger holds per GPU the memory each task is predicted to reach (the ask when nothing
  is known; after an OOM on a GPU it had alone, more than that GPU: the signature's OOM
  floor, ``SignatureMemory.observe_oom``, as the fingerprinter service keeps it), and the request
  carries the predicted peak, its spread, and as GPU models those that can hold the peak
  (so the policy's model-demand pressure keeps flexible work off the big GPUs);
- rebalancing: when the memory predicted on a GPU exceeds it, the task that outgrew its
  plan is migrated to a GPU where its predicted peak fits, before the OOM, if the policy
  finds one (a run whose fingerprint names a steady climb only once its measured rate over
  the last four minutes, carried four minutes ahead, passes 98% of its room, as the policy
  service's ``rebalance.climbs_within_its_gpu`` has it: a line fitted to a long run's first
  minutes reads a warm-up ramp as a climb); a run's ledger hold grows as the service's
  rebalance round resizes it, when its fingerprint's peak likely passes it and its GPUs
  have the room (``rebalance.resize_target_mb``; looked at every cycle, as the round looks
  at every run), and never shrinks; the migration costs ``30 s + 2 s per GB`` held
  (checkpoint and restore), during which the task makes no progress; restored, it plays the rest of its memory curve
  (``MemoryGrowth.restored``: a step schedule comes back at the level it had reached and
  steps on at the same points of its progress, other growth starts over with the process); with no target it is checkpointed and queued again
  (progress kept) instead of being left to die, and asks no less than it held when stopped;
  bridged, it is bridged again only onto more room than it outgrew, unless the restores of
  its signature have come back low (the signature's statistics count its restores, as the
  fingerprinter service does; ``policy.restores.bridge_floor_mb``);
- bridging: a task predicted to grow smoothly (linear, leak) past every GPU free
  for it may start on a GPU that holds its ask; when its measured growth, carried four
  minutes ahead, would overflow that GPU it is moved up (or checkpointed) first (the policy
  service bridges the same way, and moves up earlier: on the predicted risk); a run from its
  start of any other pattern whose signature's envelope (``fingerprint.envelope``, learnt
  from the runs fingerprinted from their start) keeps it below its peak for a quarter hour
  (a step schedule before its big step) may start on GPUs that hold what the envelope says
  for that while, and is moved up (or checkpointed) when the envelope, read four minutes past
  its progress (its top lifted to the predicted peak where that is higher), would overflow
  them (``rebalance.envelope_bridge_mb``, ``envelope_overflow``, ``envelope_level_mb``);
  a smooth grower bridged from its start whose signature has an envelope is watched by both
  its rate and its envelope (``rebalance.bridge_overflow``: the fingerprinter's vote can name
  a line for a schedule of a few steps, which its rate alone lets die at its next step);
- moving down: for each blocked task of one whole GPU, a tenant of a GPU it could take,
  whose envelope read at its progress (kept across moves, as the policy service's holds carry
  when a run began) says it fits a GPU model the waiter cannot take for a quarter hour, with
  half an hour of its run left, moves there, bridged and watched by its envelope, and the
  waiter starts after the tenant's checkpoint pause (``_move_down``, the policy service's
  ``Moves.move_down``);
- making way: for each blocked task of one whole GPU still waiting, the running task alone on
  a GPU it could take with the most run left is checkpointed and queued again (progress
  kept), and the waiter starts after its pause, when the queue's order puts the waiter first
  and the tenant has at least three times the waiter's run and its pause left
  (``backfill.makes_way``: shortest remaining work first, made preemptive; the policy
  service's ``Moves.make_way``);
- making room: for each blocked task of a share of one GPU, the running task of one GPU
  whose going would leave room for the share on its GPU and node (``backfill.leaves_room``),
  with the most run left, is checkpointed and queued again on the same terms (the policy
  service's ``Moves.make_way``, which serves both);
- vip preemption: a vip task that fits nowhere evicts the cheapest set of best-effort tasks
  on one node (their work so far and a restart: ``policy.preempt``), once the policy
  confirms it then places the vip there, and starts there after their grace period (30 s,
  as the baseline's; the executor's default is 10 s), counted as its queue time; the evicted
  tasks are queued again and start over (they keep no checkpoint), as the policy service's
  ``evict`` decisions and the executor do; an eviction is no failure of the task and counts
  toward no backoff limit;
- calibration: the confidence of fleetpilot's placements is corrected by the outcomes of
  the placements judged so far (``policy.calibration``, read every ``FEEDBACK_EVERY`` ticks),
  as the policy service corrects it from the feedback store's totals;
- maintenance: a ``HealthModel`` watches GPUs that report any hardware signal; at 0.85 a GPU
  is marked ``maintenance_pending`` (no new work, out of the utilisation denominator) and
  its tasks migrate away.

Both runs see the same injected faults: GPUs that degrade and then fall off the bus (XID
79), and one that fails without warning.

Figures (printed side by side with the ratio Fleetpilot / baseline, and ``--json``):
utilisation = ``sum(memory used) / sum(memory total)`` over GPUs not failed nor in
maintenance, averaged over the ticks of the arrival window (and the part of it not held by
runs that were killed later: memory a doomed run holds is used, but not usefully); mean and p95 queue time (all
time a task spent waiting, over its restarts, and the checkpoint-and-restore pause of every
move of it, which stalls its work as much; a task still waiting at the end counts its wait
so far; a task Fleetpilot's negotiator rejected is left out of both runs' queue figures,
which compare the same tasks, and counts as a missed SLA); OOM events; tasks that missed
their asked SLA (max queue time or deadline;
counter-offers do not relax the measure; rejected and failed tasks count); fleet cost
(catalogue price of every GPU over the run) per useful GPU-hour (the GPU share times the
run time of completed work, plus the progress of tasks still running at the end; killed
runs and migration pauses are not useful); interventions: OOM restarts, jobs that hit the
backoff limit, tasks stuck in the queue over an hour, tasks lost to a failed GPU. Also
printed: how honest each policy's confidence was (the mean confidence of the decisions that
first started tasks, against the share of those that met their goal, i.e. ran to completion
without being killed; and the Brier score).

``--peaks-known`` plays Fleetpilot's loop a third time with each run asking for its true peak
(its own curve's, which no scheduler sees): not a scheduler, but how much of what is left
better memory prediction could give, and how much is the fleet's capacity.
``--estimate-spread`` and ``--peak-spread`` play the same workload with users' declared
durations further from the truth, or with each program's runs further apart in their peaks
(``fleet_workload.generate_workload``): sensitivity runs, for what Fleetpilot's figures owe
to good estimates and to programs that repeat. ``--resumable-share`` makes only that share of
the programs go on from a checkpoint: a task of the others loses its run when it is moved,
and Fleetpilot's loop, as its policy service, never bridges it, never pauses it for another
task and moves it only off a failing GPU (where it starts over). By default every task
resumes, and every move keeps its progress: what the figures owe to that.

Run: ``python -m fleetpilot.bench.fleet --fleet three-site --seed 7 --json out/fleet.json
--plot-dir out/``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NoReturn

import msgspec
import numpy as np

from fleetpilot.contracts import (
    Allocation,
    Contract,
    DecisionMade,
    Fingerprint,
    NodeLedger,
    Placement,
    PolicyRef,
    TaskAdmitted,
    TaskSubmitted,
)
from fleetpilot.contracts.task import SlaRequest
from fleetpilot.fingerprint import (
    TRUST_SAMPLES,
    OnlineFingerprinter,
    SignatureMemory,
    borrowed,
    changed_materially,
    keep_signature_knowledge,
    prediction_changed,
    predicts_nothing,
    restore_tells,
    restores_start_over,
    task_signature,
    trusted,
    within_its_programs_runs,
)
from fleetpilot.fleet.catalogue import gpu_model
from fleetpilot.fleet.inventory import Fleet, load_fleet_spec, load_openb_fleet
from fleetpilot.fleet.simulator import CONTEXT_MB, SimulatedFleet
from fleetpilot.learner import Example
from fleetpilot.maintenance import HealthModel
from fleetpilot.policy import ClusterState, Policy, TaskRequest, build_policy, typical_tasks
from fleetpilot.policy.backfill import (
    MAKE_WAY_PER_ROUND,
    TIER_RANK,
    Demand,
    Move,
    Reservation,
    Room,
    Tenant,
    clearing,
    delays_any,
    gpu_free_at,
    hidden,
    hidden_from,
    leaves_room,
    makes_way,
    queue_key,
    reserve_apart,
    reserve_earliest,
    wide_hosts,
)
from fleetpilot.policy.calibration import ConfidenceCalibration
from fleetpilot.policy.preempt import Victim, eviction_cost, preemptions, spares_an_eviction
from fleetpilot.policy.rebalance import (
    GROWTH_LOOKAHEAD_S,
    MAX_MIGRATIONS_PER_ROUND,
    MOVE_DOWN_TRIES,
    OVERFLOW_FILL,
    SMOOTH_GROWTH,
    Running,
    bridge_watches,
    could_take,
    envelope_bridge_mb,
    envelope_level_mb,
    measured_rate_mb_per_s,
    models_below,
    move_down_ask,
    resize_target_mb,
)
from fleetpilot.policy.restores import bridge_floor_mb
from fleetpilot.policy.spread import RecentWaits, spread_ask_mb
from fleetpilot.policy.state import MILLI, peak_sigma_mb
from fleetpilot.sla import Admit, CounterOffer, FleetView, GpuPool, bound_sites, contract_for, negotiate
from fleetpilot.sla.fleet import node_frontier
from fleetpilot.sla.snapshot import SnapshotKnobs, frees_in, play_queue, queued
from fleetpilot.workload.growth import MemoryGrowth

from .default_preemption import NO_POD, PRIORITY_CLASS, TERMINATION_GRACE_S, RunningPod, preempt
from .fleet_report import Comparison, RunResult, plot, report
from .fleet_workload import (
    PACKED_LOAD,
    BenchTask,
    Workload,
    generate_workload,
    largest_gpu_load,
    load_trace,
    only_largest_hold,
    sharing_bound,
    sm_use_bound,
)
from .openb import NODES_FILE, TRACES, find_data_dir
from .outputs import check_writable, code_digest, run_environment

MODES: tuple[str, ...] = ("k8s-default", "fleetpilot")
TICK_S = 60.0
"""Scheduling cycle and telemetry period of the virtual clock."""
HEALTH_EVERY = 2
"""Health samples are taken every this many ticks (2 minutes), as the collector does."""
FEEDBACK_EVERY = 10
"""The feedback totals that correct fleetpilot's confidence are read every this many ticks."""
HEALTH_WINDOW = 30
"""Samples in a health window (one hour)."""
BACKOFF_LIMIT = 6
"""Restarts a Job allows before it fails (Kubernetes' default ``backoffLimit``)."""
STUCK_S = 3600.0
"""A task waiting longer than this is a stuck queue: someone would have stepped in."""
ROUNDS_PER_CYCLE = 2
"""The policy service's rebalance rounds in a cycle of ``TICK_S``: one every 30 s (``rebalance_s``)."""
DECISIONS_PER_CYCLE = MAX_MIGRATIONS_PER_ROUND * ROUNDS_PER_CYCLE
"""The rebalance rounds' decisions in a cycle: resizes, moves, checkpoints, clearings, moves
down and making way all draw on ``MAX_MIGRATIONS_PER_ROUND`` a round (``decisions_left``)."""
MIGRATION_BASE_S = 30.0
MIGRATION_S_PER_GB = 2.0
CONFIDENT_COUNT = 4
"""A signature seen this many times is trusted; its tasks are no longer fingerprinted online."""
ROLE_OF_KIND = {"train": "train", "finetune": "train", "infer": "infer", "encode": "encode"}
SLA_KNOBS = SnapshotKnobs()
"""The sla service's default view settings: the benchmark's negotiator view keeps its headroom
for guaranteed tiers (``reserve_fraction``)."""


# ---- one job across its attempts ---------------------------------------------------------


@dataclass
class _Job:
    """One task through its submissions, runs, moves and restarts (what the loop tracks)."""

    task: BenchTask
    submitted: TaskSubmitted
    signature: str
    seq: int
    state: str = "new"  # new, pending, running, done, failed, rejected
    queued_since: float = 0.0
    queue_s: float = 0.0
    attempts: int = 0
    evictions: int = 0  # runs Fleetpilot's policy evicted for a vip: they count toward no backoff limit
    migrations: int = 0
    row: int = -1
    gpus: list[int] = field(default_factory=list)
    milli: int = 0
    reserved_mb: int = 0
    planned_mb: int = 0
    seg_start: float = 0.0
    seg_pause: float = 0.0
    progress_s: float = 0.0
    finished_at: float | None = None
    counter_offered: bool = False
    confidence: float | None = None  # of the decision that first started it
    fingerprinter: OnlineFingerprinter | None = None
    prediction: Fingerprint | None = None
    resume: tuple[MemoryGrowth, float] | None = None
    stopped_at_mb: int = 0  # what a checkpointed run held per GPU, context included: it asks no less
    bridge_floor_mb: int = 0  # one checkpointed for outgrowing its GPUs is bridged only onto more room
    restored_from: float | None = None  # what a checkpointed run held, if its restore can tell (``restore_tells``)
    curve: MemoryGrowth | None = None
    bridged: bool = False
    history: deque | None = None
    from_start: bool = False  # its run began with its first start (no restore since): its envelope applies
    run_at: float = 0.0  # when that run began, kept across moves (the policy service's ``Allocation.run_at``)
    run_peak_mb: float = 0.0  # the most its run held per GPU before its latest move or checkpoint
    died_alone: bool = False  # killed by an OOM alone on its GPUs: its program's spread does not cover it
    agreed_pool: tuple[str, str] | None = None  # (site, model) its admission or accepted offer was estimated on
    bound_sites: tuple[str, ...] = ()  # the sites its contract binds it to (``sla.bound_sites``); (): any

    def useful_until(self, now: float) -> float:
        """Seconds of the task's own run done by ``now`` (pauses excluded)."""
        if self.state == "done":
            return self.task.duration_s
        if self.state != "running":
            return self.progress_s
        return min(self.task.duration_s, self.progress_s + max(0.0, now - self.seg_start - self.seg_pause))


# ---- the run ------------------------------------------------------------------------------


class FleetRun:
    """One mode (``k8s-default`` or ``fleetpilot``) playing a workload on a fresh simulated fleet."""

    def __init__(self, fleet: Fleet, workload: Workload, mode: str, seed: int, *, knows_peaks: bool = False,
                 queue_aging: float = 1.0, preempts: bool | None = None, vip_evicts_standard: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
        if knows_peaks and mode != "fleetpilot":
            raise ValueError("only Fleetpilot's loop can be told each run's true peak")
        if preempts and mode != "k8s-default":
            raise ValueError("only the baseline plays kube-scheduler's DefaultPreemption")
        if vip_evicts_standard and mode != "fleetpilot":
            raise ValueError("only Fleetpilot's vips may evict standard work its contract spares")
        self.fleet, self.workload, self.mode, self.seed = fleet, workload, mode, seed
        self.smart = mode == "fleetpilot"
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
        self.preempts = mode == "k8s-default" if preempts is None else preempts
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
        self.pending: list[_Job] = []
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

    def _job(self, t: BenchTask, seq: int) -> _Job:
        sub = TaskSubmitted(
            task_id=t.task_id, tenant="bench", kind=t.kind, gpus=t.gpus, gpu_milli=t.gpu_milli,  # type: ignore[arg-type]
            gpu_memory_mb=int(t.request_mb), gpu_models=list(t.gpu_models), cpu_milli=t.cpu_milli,
            memory_mb=t.memory_mb, sla=SlaRequest(tier=t.tier, max_queue_s=t.max_queue_s, deadline=t.deadline_s),  # type: ignore[arg-type]
            labels={"model": t.program, "role": ROLE_OF_KIND[t.kind]}, image=f"registry.local/{t.program}:1",
            command=["python", "-m", t.program], expected_duration_s=t.declared_duration_s, submitted_at=t.arrival_s,
            resumable=t.resumable)
        return _Job(task=t, submitted=sub, signature=task_signature(sub), seq=seq)

    def _policy(self, seen: Sequence[TaskRequest]) -> Policy:
        # A refusal's reason is read by no one here: not working it out keeps a run about 15%
        # shorter on openb (``Policy``'s ``explain``).
        if not self.smart:
            return build_policy("k8s-default", seed=self.seed, explain=False)
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

    def _site(self, job: _Job) -> str:
        """The site a request of ``job`` names when none is given: where it runs, if its
        contract binds it there (a move stays at its site), else the first its contract names
        (the one it was estimated at); "" for any."""
        if not job.bound_sites:
            return ""
        if job.state == "running" and self.node_site[job.row] in job.bound_sites:
            return self.node_site[job.row]
        return job.bound_sites[0]

    def _request(self, job: _Job, *, bridge: bool = False, site: str | None = None) -> TaskRequest:
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
                               memory_mb=t.memory_mb, gpu_models=t.gpu_models)
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

    def _hold(self, job: _Job, row: int, gpus: list[int]) -> int:
        """The reservation, but never more than the GPUs a bridged task sits on."""
        reserve = self._reservation(job)
        if job.bridged:
            reserve = min(reserve, int(self.state.gpu_mem_total[row, np.asarray(gpus)].min()))
        return reserve

    def _reservation(self, job: _Job) -> int:
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

    def _arrivals_until(self, arrivals: deque[_Job], until: float) -> None:
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

    def _submit(self, job: _Job, now: float) -> None:
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
    def _bind(job: _Job, models: Sequence[str], sites: Sequence[str] = ()) -> None:
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

    def _enqueue(self, job: _Job, now: float) -> None:
        job.state = "pending"
        job.queued_since = now
        self.pending.append(job)

    def _key(self, job: _Job) -> tuple[float, ...]:
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
        keep: list[_Job] = []
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

    def _try_start(self, job: _Job, now: float, reservation: Reservation | None, failed: list[tuple[Demand, bool]],
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
            demand = Demand.of(req, whole_gpus=not self.smart)
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

    def _requests(self, job: _Job) -> list[tuple[bool, TaskRequest]]:
        """What the policy is asked for ``job``, in order, each with whether it is its bridge:
        as the policy service tries a contract bound to sites, the plain request at each of
        them in the contract's order, then the bridge at each (``ReplicaState.requests``)."""
        # Each is built once (its ask is worked out there) and named at every site.
        sites = job.bound_sites or ("",)
        built = [(bridge, self._request(job, bridge=bridge, site=sites[0]))
                 for bridge in ([False, True] if self._bridgeable(job) else [False])]
        return [(bridge, req if site == req.site else msgspec.structs.replace(req, site=site))
                for bridge, req in built for site in sites]

    def _preempt_for(self, job: _Job, now: float) -> bool:
        """A preemption for a waiting task that found no node; whether it started.

        The baseline plays kube-scheduler's ``DefaultPreemption`` (``default_preemption``):
        the lower-priority pods it picks are evicted (each a failed attempt of its Job, which
        counts toward the backoff limit and starts again from scratch), and the pod starts
        there after their grace period (counted as its queue time). Fleetpilot plays its
        policy service's vip preemption (``_vip_preempts``)."""
        if self.smart:
            return self._vip_preempts(job, now)
        priority = PRIORITY_CLASS.get(job.task.tier, 0)
        if not self.preempts or priority <= min(PRIORITY_CLASS.values()):
            return False
        plan = preempt(self.state, self._request(job), priority, self.holder_priority, self._pods_on)
        if plan is None:
            return False
        for pod in plan.victims:
            self._kill(self.by_id[pod.pod_id], now, "preempted")
        # The only node that changed is the one it fits now, so the policy places it there.
        return self._try_start(job, now, None, [], pause=TERMINATION_GRACE_S)

    def _vip_preempts(self, job: _Job, now: float) -> bool:
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

    def _spares_an_eviction(self, job: _Job, now: float) -> bool:
        """Whether a running standard task's contract lets a vip evict it now
        (``policy.preempt.spares_an_eviction``, as ``Evictions.victims`` reads it)."""
        t = job.task
        return spares_an_eviction(at=now, resumes=t.resumable,
                                  left_s=max(self._expected_end(job) - now, 0.0) if t.declared_duration_s else None,
                                  pause_s=self._pause(job, now), deadline=t.deadline_s, max_queue_s=t.max_queue_s)

    def _vip_preempts_among(self, job: _Job, victims: list[_Job], now: float) -> bool | None:
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

    def _evict_for_vip(self, victim: _Job, now: float) -> None:
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
    def _admitted(job: _Job) -> TaskAdmitted:
        """``job`` as the policy service knows a running task: its admission."""
        return TaskAdmitted(task=job.submitted, contract=Contract(tier=job.task.tier), tenant=job.submitted.tenant,
                            admitted_at=job.task.arrival_s)

    @contextmanager
    def _without(self, jobs: Sequence[_Job]) -> Iterator[None]:
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

    def _running_on(self, row: int) -> list[_Job]:
        """The tasks running on node ``row``, by task id."""
        ids = set().union(*(self.on_gpu.get((row, g), set()) for g in range(self.state.max_gpus)))
        return [j for j in (self.by_id[t] for t in sorted(ids)) if j.state == "running"]

    def _pods_on(self, row: int) -> list[RunningPod]:
        """The baseline's pods running on node ``row``, as preemption sees them."""
        return [RunningPod(pod_id=j.task.task_id, priority=PRIORITY_CLASS.get(j.task.tier, 0), started_s=j.seg_start,
                           gpus=tuple(j.gpus), cpu_milli=j.task.cpu_milli, memory_mb=j.task.memory_mb)
                for j in self._running_on(row)]

    def _may_pause(self, job: _Job, now: float) -> bool:
        """A running task may be paused for a checkpoint (to clear a node, move down, make
        way) if it resumes from one, unless the pause would make it miss the deadline it asked
        for (its expected end, by its declared duration, plus the pause); a queue-time SLA is
        not touched by a pause, whatever the tier."""
        if not job.task.resumable:
            return False
        deadline = job.task.deadline_s
        return deadline is None or max(self._expected_end(job), now) + self._pause(job, now) <= deadline

    def _note_blocked(self, job: _Job, k: int) -> None:
        if not self.smart or k != 0:
            return
        if job.task.gpu_milli >= MILLI:
            self.blocked.add(job.task.task_id)
        elif job.task.gpus == 1:
            self.blocked_shares.add(job.task.task_id)

    def _reserve(self, job: _Job, free_at: np.ndarray) -> Reservation | None:
        """The reservation for a blocked ``job``: the earliest of its plain requests at each
        site its contract binds it to (``backfill.reserve_earliest``), as the policy service
        reserves (``Moves.reservations_for``)."""
        made = reserve_earliest(self.state, self._plain_requests(job), free_at)
        return made[0] if made is not None else None

    def _plain_requests(self, job: _Job) -> list[TaskRequest]:
        """``job``'s plain request at each site its contract binds it to (one, anywhere, for
        a task bound to none)."""
        return [req for bridge, req in self._requests(job) if not bridge]

    def _first_blocked(self) -> _Job | None:
        """The reservation's owner: of the whole-GPU tasks that found no place since the last
        cycle, the first in the queue's order. Expected completion bounds how long anything
        is overtaken, the wide and the long included (``backfill.completion_order``)."""
        blocked = [j for j in self.pending if j.task.task_id in self.blocked]
        return min(blocked, key=self._key) if blocked else None

    def _clear_for(self, job: _Job, reservation: Reservation, now: float) -> None:
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

    def _blocked_single_gpu_waiters(self) -> list[_Job]:
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

        def room(need: TaskRequest, j: _Job) -> bool:
            row, g = j.row, j.gpus[0]
            free = Room(milli=int(state.gpu_free[row, g]), gpu_memory_mb=int(state.gpu_mem_free[row, g]),
                        cpu_milli=int(state.cpu_free[row]), memory_mb=int(state.mem_free[row]))
            held = Room(milli=j.milli, gpu_memory_mb=j.reserved_mb, cpu_milli=j.task.cpu_milli,
                        memory_mb=j.task.memory_mb)
            return leaves_room(free, held, need)

        self._give_way(waiters, self._way_tenants(now), now, reservation, made="made_room",
                       blocked=self.blocked_shares, room=room)

    def _way_tenants(self, now: float) -> list[tuple[_Job, float, tuple[int, float], float]]:
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

    def _give_way(self, waiters: list[_Job], tenants: list[tuple[_Job, float, tuple[int, float], float]], now: float,
                  reservation: Reservation | None, *, made: str, blocked: set[str],
                  room: Callable[[TaskRequest, _Job], bool] | None = None) -> None:
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

    def _remaining(self, job: _Job) -> float:
        """What is left of the run the user declared (a checkpointed task keeps its progress)."""
        return max(job.task.declared_duration_s - job.progress_s, 0.0)

    def _running_ends(self) -> list[tuple[int, list[int], float]]:
        """``(row, gpus, expected end)`` of every running task, by its declared duration."""
        return [(j.row, j.gpus, self._expected_end(j)) for j in self.jobs if j.state == "running"]

    def _expected_end(self, job: _Job) -> float:
        """When a running task is expected to end, by the duration it declared."""
        return job.seg_start + job.seg_pause + self._remaining(job)

    def _bridgeable(self, job: _Job) -> bool:
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

    def _envelope_ask(self, job: _Job) -> int:
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

    def _start(self, job: _Job, row: int, gpus: list[int], milli: int, now: float, *,
               growth: MemoryGrowth | None = None, pause: float = 0.0) -> None:
        """Start ``job`` on ``gpus`` of node ``row``. A waiting task given a ``pause`` (the
        checkpoints of the tenants it replaces, a preemption's grace period) begins its run
        only then; a moved one (``growth``: its restored curve) plays its ``pause`` in it."""
        t = job.task
        # A waiting task's run begins after the pause it was given, and after that its restore
        # (a checkpointed one's curve plays it).
        delay = pause if job.state == "pending" else 0.0
        reserve = self._hold(job, row, gpus) if self.smart else 0
        self.state.allocate(row, gpus, milli, cpu_milli=t.cpu_milli, memory_mb=t.memory_mb, gpu_memory_mb=reserve)
        if not self.smart:
            self.holder_priority[row, gpus] = PRIORITY_CLASS.get(t.tier, 0)
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

    def _stop(self, job: _Job) -> None:
        t = job.task
        self.state.release(job.row, job.gpus, job.milli, cpu_milli=t.cpu_milli, memory_mb=t.memory_mb,
                           gpu_memory_mb=job.reserved_mb)
        if not self.smart:
            self.holder_priority[job.row, job.gpus] = NO_POD
        for g in job.gpus:
            self.on_gpu.get((job.row, g), set()).discard(t.task_id)

    def _take_off(self, job: _Job) -> None:
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

    def _kill(self, job: _Job, now: float, cause: str) -> None:
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

    # -- Fleetpilot: fingerprints, rebalancing, maintenance -----------------------------------

    def _remember(self, job: _Job, now: float) -> None:
        """Fold a completed run's fingerprint into the signature memory. The run is over, so
        its length is known: the fit is told the real duration instead of the declared one
        (no extrapolation past the end). Killed runs are not remembered: their series stops
        before the peak (an OOM teaches a floor instead, ``_learn_from_oom``)."""
        fp = job.fingerprinter
        if fp is None or fp.samples < 6:
            return
        envelope = fp.envelope(job.task.declared_duration_s)
        fp.expected_duration_s = max(now - job.seg_start - job.seg_pause, 1.0)
        fp.refit()
        if fp.current is not None and fp.current.samples > 0:
            self.memory.observe(msgspec.structs.replace(fp.current, envelope_mb=envelope))
            self.learnt.add(job.signature)

    def _learn_from_oom(self, job: _Job, held_mb: float) -> None:
        """A task killed while alone on its GPUs needed more than the GPU: a floor for its
        signature, known even when the run was too short to fingerprint."""
        if not self.smart:
            return
        alone = all(self.on_gpu.get((job.row, g), set()) <= {job.task.task_id} for g in job.gpus)
        if alone:
            total = float(self.state.gpu_mem_total[job.row, job.gpus[0]])
            floor = max(total, held_mb + CONTEXT_MB) * 1.05
            self.memory.observe_oom(job.signature, floor)
            self.learnt.add(job.signature)
            job.died_alone = True

    def _predict(self, signature: str) -> Fingerprint | None:
        """What a task of ``signature`` should expect: what its ended runs taught, else the
        trusted fingerprint of a run of it still in progress (``_lent``)."""
        return self.memory.predict(signature) or self._lent(signature)

    def _lent(self, signature: str) -> Fingerprint | None:
        """What a run of ``signature`` in progress shows (``_learn_live``), as its other tasks
        are given it."""
        live = self.live.get(signature)
        return borrowed(live) if live is not None else None

    def _learn_live(self, signature: str, current: Fingerprint) -> None:
        """Keep ``current``, a trusted fingerprint of a run in progress, for the tasks of its
        signature while its statistics predict nothing (no run of it has ended), when it
        changed materially and no run seen longer is kept; its waiting tasks are told
        (``_tell_waiting``), as the fingerprinter service keeps and tells it."""
        known = self.live.get(signature)
        if known is not None and (current.samples < known.samples or not changed_materially(known, current)):
            return
        if not predicts_nothing(self.memory.stats(signature)):
            self.live.pop(signature, None)
            return
        self.live[signature] = current
        self.learnt.add(signature)

    def _tell_waiting(self) -> None:
        """Give each task still waiting for its first start its signature's new prediction,
        when what the runs that ended this cycle taught changes it (``prediction_changed``),
        as the fingerprinter service tells its waiting tasks."""
        if not self.learnt:
            return  # most cycles: no run ended, so no waiting task has anything new to learn
        learnt, self.learnt = self.learnt, set()
        fresh: dict[str, Fingerprint | None] = {}
        for job in self.pending:
            if job.attempts or job.signature not in learnt:
                continue
            if job.signature not in fresh:
                fresh[job.signature] = self._predict(job.signature)
            if prediction_changed(job.prediction, fresh[job.signature]):
                job.prediction = fresh[job.signature]

    def _observe_tasks(self, now: float) -> None:
        # Sorted: the order samples are read in decides the order of moves, and a run must
        # not depend on Python's string hashing.
        watched_nodes = sorted({self.state.node_names[j.row] for j in self.jobs
                                if j.state == "running" and j.fingerprinter is not None})
        changed: dict[str, float] = {}
        bridging: list[_Job] = []
        for node in watched_nodes:
            for s in self.sim.task_samples(node):
                job = self.by_id.get(s.task_id)
                if job is None or job.fingerprinter is None or job.state != "running":
                    continue
                online = job.fingerprinter
                held = s.memory_used_mb / max(len(s.gpus), 1)
                self._keep_usage(job, s.at, held)
                fresh = online.add(s.at, held)
                if job.bridged and job.history is not None and self._by_rate(job):
                    job.history.append((s.at, held))
                    if self._outgrowing(job):
                        bridging.append(job)
                        continue
                current = online.current
                # A handful of samples in a warm-up reads as a steep line: act on the online
                # fingerprint only once it is ``trusted`` (samples and a clear pattern).
                if current is None or not trusted(current):
                    continue
                if fresh is not None or job.prediction is None or job.prediction.samples < TRUST_SAMPLES:
                    # As the fingerprinter service publishes it: a step fit held to its program's runs.
                    own = within_its_programs_runs(current, self.memory.stats(job.signature), held)
                    job.prediction = keep_signature_knowledge(own, job.prediction)
                    changed[job.task.task_id] = s.memory_used_mb / max(len(s.gpus), 1)
                self._learn_live(job.signature, current)
        bridging.extend(j for j in self._enveloped(now) if j not in bridging)
        for job in bridging:
            # Past the rounds' budget, a bridge still outgrowing is seen again next cycle.
            if job.state == "running" and self.decisions_left > 0 and not self._migrate(job, now, reason="bridge"):
                self._checkpoint(job, now, outgrown=True)
        # As the service's rebalance round looks at every run each round: a hold that could not
        # grow when its fingerprint changed grows once a neighbour's leaving gives it the room.
        for job in self.jobs:
            self._reserve_again(job)  # a job not running is left
        # As the service's rebalance round checks every run each round: a climb held back
        # last cycle is looked at again whether or not its fingerprint changed.
        looked_at = [*changed.items(), *((t, self.usage[t][-1][1]) for t in sorted(self.climbing - changed.keys()))]
        self.climbing.clear()
        for task_id, held in looked_at:
            job = self.by_id[task_id]
            if job.state == "running" and not job.bridged and self._heading_for_oom(job, held):
                if self._climbs_within_its_gpu(job) or self.decisions_left <= 0:
                    self.climbing.add(task_id)  # looked at again next cycle
                    continue
                self._rebalance(job, now)

    def _keep_usage(self, job: _Job, at: float, held_mb: float) -> None:
        """Keep a running task's memory sample (per GPU), and only those of the last
        ``GROWTH_LOOKAHEAD_S``, as the policy service keeps them (``Replica.observe``)."""
        kept = self.usage.setdefault(job.task.task_id, deque())
        kept.append((at, held_mb))
        while kept[0][0] < at - GROWTH_LOOKAHEAD_S:
            kept.popleft()

    def _climbs_within_its_gpu(self, job: _Job) -> bool:
        """A run whose fingerprint names a steady climb stays where it is, though its predicted
        peak would not fit there, while its measured rate carried ``GROWTH_LOOKAHEAD_S`` ahead
        still fits its room (the policy service's ``rebalance.climbs_within_its_gpu``): a line
        fitted to a long run's first minutes cannot tell a warm-up ramp from a climb."""
        kept = self.usage.get(job.task.task_id, ())
        rate = measured_rate_mb_per_s(kept)
        if job.prediction is None or job.prediction.pattern != "linear" or rate is None:
            return False
        return kept[-1][1] + rate * GROWTH_LOOKAHEAD_S <= OVERFLOW_FILL * self._room_in_place(job)

    def _enveloped(self, now: float) -> list[_Job]:
        """Runs bridged by their envelope (``_envelope_ask``) that it, read
        ``GROWTH_LOOKAHEAD_S`` ahead of their progress, says will outgrow their GPUs (what the
        other tenants hold now, as NVML reports it, plus what the run will hold then)."""
        out = []
        g = self.sim.gpu
        for task_id in sorted(self.bridged_ids):
            job = self.by_id[task_id]
            if job.state != "running" or not job.bridged:
                self.bridged_ids.discard(task_id)  # moved up, stopped or ended: no longer bridged
                continue
            p = job.prediction
            if p is None or not self._by_envelope(job):
                continue
            # Its progress as the policy service reads it: the time since its run began.
            ahead = envelope_level_mb(p, now - job.run_at + GROWTH_LOOKAHEAD_S, job.task.declared_duration_s)
            glob = self.offset[job.row] + np.asarray(job.gpus)
            own = self._held(job, now) + CONTEXT_MB
            if bool(np.any(g.memory_used_mb[glob] - own + ahead > OVERFLOW_FILL * g.memory_total_mb[glob])):
                out.append(job)
        return out

    def _by_envelope(self, job: _Job) -> bool:
        """Whether the running job's bridge is watched by its signature's envelope: a run from
        its start of a program with one, whatever pattern its fingerprint names (a schedule of
        a few steps can be voted a line; ``rebalance.bridge_watches``)."""
        return bridge_watches(job.prediction, job.from_start)[0]

    def _by_rate(self, job: _Job) -> bool:
        """Whether the running job's bridge is watched by its measured rate (``bridge_watches``)."""
        return bridge_watches(job.prediction, job.from_start)[1]

    def _outgrowing(self, job: _Job) -> bool:
        """A bridged task whose recent growth, carried on for ``GROWTH_LOOKAHEAD_S``, would
        overflow its GPU (what the GPU holds now, as NVML reports it, plus that growth)."""
        h = job.history
        if h is None or len(h) < 2:
            return False
        slope = measured_rate_mb_per_s(h) or 0.0
        glob = self.offset[job.row] + np.asarray(job.gpus)
        g = self.sim.gpu
        return bool(np.any(g.memory_used_mb[glob] + slope * GROWTH_LOOKAHEAD_S
                           > OVERFLOW_FILL * g.memory_total_mb[glob]))

    def _reserve_again(self, job: _Job) -> None:
        """Grow the job's ledger hold as the policy service's rebalance round resizes it: to the
        top of its new predicted peak's interval plus a margin, when that peak passes the hold
        with probability ``OOM_MIGRATE_RISK`` or more (``rebalance.resize_target_mb``) and every
        GPU of the job has that much free (``resize_plan``); never down, and not on a GPU going
        out of service. Where it cannot grow, the predicted-OOM check decides (a move, or the
        run stays), and the next cycle tries again. Not the hold of a job stopped this cycle
        (moved up or checkpointed off its bridge): its holds went back with the stop."""
        if self.knows_peaks or job.state != "running" or any(self.excluded[self.offset[job.row] + g] for g in job.gpus):
            return  # told its true peak, a run holds it from its start
        target = resize_target_mb(job.prediction, job.reserved_mb)
        idx = np.asarray(job.gpus)
        if (target is None or self.decisions_left <= 0
                or int(self.state.gpu_mem_free[job.row, idx].min()) < target - job.reserved_mb):
            return
        self.state.gpu_mem_free[job.row, idx] -= target - job.reserved_mb
        self.state.version[job.row] += 1
        job.reserved_mb = target
        self.decisions_left -= 1

    def _heading_for_oom(self, job: _Job, held_mb: float) -> bool:
        """True when what the job's GPUs hold now (as NVML reports it) plus the growth still
        ahead of the job (its predicted peak minus what it holds) exceeds one of them.

        Neighbours are taken at their current use: a growing neighbour is judged when its
        own fingerprint moves, and one placed with a known signature was placed by its
        predicted peak. Summing every tenant's peak instead would move tasks whose peaks
        never coincide."""
        if job.prediction is None:
            return False
        ahead = max(job.prediction.predicted_peak_mb * 1.02 - held_mb, 0.0)
        glob = self.offset[job.row] + np.asarray(job.gpus)
        g = self.sim.gpu
        return bool(np.any(g.memory_used_mb[glob] + ahead > g.memory_total_mb[glob]))

    def _rebalance(self, job: _Job, now: float) -> None:
        # Move whoever on the GPU outgrew its plan the most: that is the allocation that fails.
        tenants = {tid for g in job.gpus for tid in self.on_gpu.get((job.row, g), set())}
        # One that cannot resume is not moved for memory: it would lose its run for sure, where
        # the OOM takes it only if it comes (the policy service's ``rebalance_round``).
        movable = (j for j in map(self.by_id.__getitem__, tenants) if j.task.resumable)
        victims = sorted(movable, key=lambda j: (j.planned_mb - j.reserved_mb, j.seq))
        for victim in victims[:1]:
            # Queued again, a run that has the most room any GPU it accepts gives would come
            # back to no more: it runs on (the policy service's ``checkpoint``).
            if not self._migrate(victim, now, reason="oom") and \
                    self._room_in_place(victim) < self._largest(victim.task.gpu_models):
                self._checkpoint(victim, now, outgrown=True)

    def _room_in_place(self, job: _Job) -> float:
        """The memory ``job`` can have on its GPUs: the smallest of them less what the other
        tasks on it hold (``rebalance.room_in_place``)."""
        return min(float(self.state.gpu_mem_total[job.row, g])
                   - sum(self.by_id[t].reserved_mb for t in self.on_gpu.get((job.row, g), set()) if t != job.task.task_id)
                   for g in job.gpus)

    def _migrate(self, job: _Job, now: float, *, reason: str, target: Move | None = None,
                 bridge: bool = False) -> bool:
        """Move a running job to ``target``, else to wherever the policy places it now (never
        onto GPUs reserved for a task it would delay); False if nowhere else. ``bridge``: it
        holds less than its peak there (moved down), watched as a bridge."""
        t = job.task
        self._stop(job)
        if target is not None:
            row, gpus, milli, found = target.row, list(target.gpus), target.milli, True
        else:
            held = self.reservation
            ends_in = max(self._expected_end(job) - now, 0.0)
            with hidden(self.state, held if held is not None and held.delayed_by(t.task_id, ends_in, now) else None):
                decision = self.policy.decide(self.state, self._request(job))
            row, gpus = decision.node_row, [p.gpu for p in decision.placement if p.gpu >= 0]
            found = decision.action == "assign" and bool(decision.placement)
            milli = decision.placement[0].milli if found else 0
        if not found or (row == job.row and sorted(gpus) == sorted(job.gpus)):
            self.state.allocate(job.row, job.gpus, job.milli, cpu_milli=t.cpu_milli, memory_mb=t.memory_mb,
                                gpu_memory_mb=job.reserved_mb)
            for g in job.gpus:
                self.on_gpu.setdefault((job.row, g), set()).add(t.task_id)
            self.counts["migrations_no_target"] += 1
            return False
        growth, pause = self._resumed(job, now)
        # The task's work stalls for its checkpoint and restore as it would waiting: the user
        # sees the same delay, so it counts as queue time.
        job.queue_s += pause
        job.bridged = bridge
        if bridge:
            self.bridged_ids.add(t.task_id)
        job.history = None
        self._take_off(job)
        # The restored task replays its curve: a series spanning the move would mislead the fit.
        job.fingerprinter = None
        job.migrations += 1
        self.counts["migrations_" + reason] += 1
        self.decisions_left -= 1
        self._start(job, row, gpus, milli, now, growth=growth, pause=pause)
        if not t.resumable:
            # Its run begins again there (the policy service's target holds say so).
            job.from_start, job.run_at = True, now
        return True

    def _pause(self, job: _Job, now: float) -> float:
        """Seconds a checkpoint and restore of ``job`` would take now (``_resumed``)."""
        return MIGRATION_BASE_S + MIGRATION_S_PER_GB * self._held(job, now) / 1024.0

    def _held(self, job: _Job, now: float) -> float:
        """GPU memory per GPU a running job holds now (its CUDA context aside), as NVML reads it."""
        return float((job.curve or job.task.growth).memory_at(now - job.seg_start))

    def _resumed(self, job: _Job, now: float) -> tuple[MemoryGrowth, float]:
        """The memory curve and pause of a task restored from a checkpoint taken now.

        Restored, the task plays what is left of its memory curve (``MemoryGrowth.restored``):
        a step schedule comes back at the level it reached, other growth starts over with the
        process; the true peak is the same, so a move never makes a task look smaller. The
        pause is the checkpoint and restore time (``MIGRATION_BASE_S`` plus
        ``MIGRATION_S_PER_GB`` per GB held). A task that cannot resume starts over: its whole
        curve, after a pause as long (its stop and its start, loading what it loads).
        """
        t = job.task
        pause = self._pause(job, now)
        if not t.resumable:
            job.progress_s = 0.0
            return msgspec.structs.replace(t.growth, duration_s=t.duration_s + pause), pause
        job.progress_s = job.useful_until(now)
        remaining = max(t.duration_s - job.progress_s, 1.0)
        return t.growth.restored(job.progress_s, remaining + pause), pause

    def _checkpoint(self, job: _Job, now: float, *, outgrown: bool = False, by_round: bool = True) -> None:
        """No GPU can take the task's predicted peak now: checkpoint it and queue it again
        (progress kept) rather than let it run into the OOM that would lose everything.

        Restored, it may come back with what it holds now (a step schedule does): until it
        starts again, it asks no less (``stopped_at_mb``, as NVML read it). Stopped because it
        was outgrowing its GPUs, it is bridged again only onto GPUs with more than they have
        (``bridge_floor_mb``): on no more room it would be stopped again at once, or, a step
        away from the end, die of OOM. A signature whose restores have come back low
        (``restores_start_over``), as a leak's do, needs neither, though a run of it that
        outgrew its GPUs sooner than ``GROWTH_LOOKAHEAD_S`` after being placed there is still bridged
        only onto more room. ``by_round``: a rebalance round's decision, drawn on
        ``decisions_left`` (a vip's eviction is the queue round's)."""
        self._stop(job)
        held = self._held(job, now)
        started = float((job.curve or job.task.growth).memory_at(0.0))  # what NVML showed as it started
        job.restored_from = held if restore_tells(started, held) else None
        stats = self.memory.stats(job.signature)
        if not restores_start_over(stats):
            job.stopped_at_mb = int(math.ceil(held + CONTEXT_MB))
        if outgrown:
            gpus_mb = float(self.state.gpu_mem_total[job.row, np.asarray(job.gpus)].min())
            job.bridge_floor_mb = bridge_floor_mb(stats, gpus_mb, now - job.seg_start, GROWTH_LOOKAHEAD_S)
        job.resume = self._resumed(job, now)
        job.bridged = False
        job.history = None
        self._take_off(job)
        job.fingerprinter = None
        self.counts["checkpointed"] += 1
        if by_round:
            self.decisions_left -= 1
        self._enqueue(job, now)

    def _watch_health(self, now: float) -> None:
        g = self.sim.gpu
        signal = ((g.ecc_corrected > 0) | (g.remapped_rows > 0) | (g.retired_pages > 0) | (g.pcie_replays > 0)
                  | (g.xid_count > 0) | (g.pcie_link_width < g.pcie_link_width_max) | (g.temperature_c > 85.0))
        suspects = [int(i) for i in np.flatnonzero(signal & ~self.excluded)]
        for gi in suspects:
            # A GPU with no hardware signal scores the model's bias alone: only suspects are sampled.
            row, local = self._gpu_slot(gi)
            sample = self.sim.sample(self.state.node_names[row])[local]
            window = self.windows.setdefault(gi, deque(maxlen=HEALTH_WINDOW))
            window.append(sample)
            if len(window) < 3:
                continue
            a = self.health.assess(list(window))
            if a.maintenance_pending and gi not in self.pending_maintenance:
                self.pending_maintenance[gi] = now
                self.excluded[gi] = True
                self.state.set_condition(row, [local], maintenance=True)
                for task_id in sorted(self.on_gpu.get((row, local), set())):
                    job = self.by_id[task_id]
                    if not self._migrate(job, now, reason="maintenance"):
                        self._checkpoint(job, now)

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

    def _ends(self, job: _Job) -> tuple[float, float]:
        """When a running task is expected to end, as the sla service's snapshot counts it
        (when its run began plus its declared run), with that declared run."""
        return job.seg_start + job.task.declared_duration_s - job.progress_s, job.task.declared_duration_s

    def _frees_in(self, job: _Job, now: float) -> float:
        """When a running task frees its GPUs, as the service's snapshot says: a run past its
        declared end is not freeing "now" (``frees_in``)."""
        return frees_in(*self._ends(job), now)

    def _seen_started(self, job: _Job, now: float) -> None:
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

    # -- figures ------------------------------------------------------------------------------

    def _result(self, now: float, times: list[float], utils: list[float], queue: list[int], wall: float) -> RunResult:
        w = self.workload
        missed = stuck = never = 0
        useful_h = 0.0
        self.waits_by_task.clear()
        for j in self.jobs:
            wait = j.queue_s + (now - j.queued_since if j.state == "pending" else 0.0)
            self.waits_by_task[j.task.task_id] = wait
            if j.state == "pending" and j.attempts == 0:
                never += 1
            stuck += wait > STUCK_S
            late = j.task.deadline_s is not None and (
                (j.finished_at is not None and j.finished_at > j.task.deadline_s)
                or (j.finished_at is None and now > j.task.deadline_s))
            missed += j.state in ("failed", "rejected") or wait > j.task.max_queue_s or late
            useful_h += j.task.gpu_work * j.useful_until(now) / 3600.0
        in_window = np.asarray(times) <= w.span_s / 3600.0
        util = np.asarray(utils)
        cost = self.price_per_h * now / 3600.0
        c = self.counts
        interventions = c["oom_restarts"] + c["backoff_failed"] + stuck + c["gpu_failure_kills"]
        utilisation = float(util[in_window].mean()) if in_window.any() else 0.0
        killed = self._killed_share(np.asarray(times) * 3600.0, in_window)
        figures = {
            "utilisation": utilisation,
            "useful_utilisation": utilisation - killed,
            **self.queue_figures(left_out=self.rejected_ids()),
            "oom_events": float(c["oom_events"]),
            "sla_missed": float(missed),
            "cost_per_useful_gpu_hour": cost / useful_h if useful_h > 0 else math.inf,
            "interventions": float(interventions),
        }
        seen, lead = self._maintenance_leads()
        predicted, observed, brier, judged, _, _ = self._judged()
        breakdown = {
            "utilisation_whole_run": float(util.mean()) if util.size else 0.0,
            "utilisation_of_killed_runs": killed,
            "useful_gpu_hours": useful_h,
            "fleet_cost_usd": cost,
            "completed": float(sum(j.state == "done" for j in self.jobs)),
            "never_started": float(never),
            "stuck_over_1h": float(stuck),
            "max_queue_length": float(max(queue, default=0)),
            "failures_seen_coming": float(seen),
            "failures": float(len(self.failed_gpus)),
            "median_warning_h": lead,
            "false_alarms": float(self._false_alarms()),
            "confidence_predicted": predicted,
            "confidence_observed": observed,
            "confidence_brier": brier,
            "confidence_judged": float(judged),
            **{k: float(v) for k, v in c.items()},
        }
        return RunResult(mode=self.mode, figures=figures, breakdown=breakdown, times_h=times, utilisation=utils,
                         queue_length=queue, wall_s=wall)

    def rejected_ids(self) -> frozenset[str]:
        """The tasks this run's negotiator rejected (none under ``k8s-default``)."""
        return frozenset(j.task.task_id for j in self.jobs if j.state == "rejected")

    def queue_figures(self, left_out: frozenset[str] = frozenset()) -> dict[str, float]:
        """Mean and p95 queue time of the finished run over its tasks but ``left_out``.

        A rejected task waited nothing: counted, it would lower the mean of the run that
        rejected it, and its wait in the other run would raise that one's. Both runs' figures
        leave out the tasks either rejected, so that they compare the same tasks."""
        waits = np.asarray([w for t, w in self.waits_by_task.items() if t not in left_out])
        if waits.size == 0:
            return {"mean_queue_s": 0.0, "p95_queue_s": 0.0}
        return {"mean_queue_s": float(waits.mean()), "p95_queue_s": float(np.percentile(waits, 95))}

    def queue_split(self, only_largest: frozenset[str], left_out: frozenset[str] = frozenset()) -> dict[str, float]:
        """The mean queue of the runs only the fleet's largest GPUs can hold (``only_largest``,
        from ``fleet_workload.only_largest_hold``) apart from the rest's, and how many of the
        former completed, over the tasks but ``left_out``. Where those GPUs are loaded past
        what they give, a run that holds such work back until one is free queues it, and one
        that starts it on smaller GPUs, where it is killed at its peak, does not."""
        tasks = frozenset(self.waits_by_task)
        largest = self.queue_figures(left_out=left_out | (tasks - only_largest))
        rest = self.queue_figures(left_out=left_out | only_largest)
        done = sum(j.state == "done" for j in self.jobs
                   if j.task.task_id in only_largest and j.task.task_id not in left_out)
        return {"mean_queue_s_only_largest": largest["mean_queue_s"], "mean_queue_s_rest": rest["mean_queue_s"],
                "completed_only_largest": float(done)}

    def _judged(self) -> tuple[float, float, float, int, float, float]:
        """How honest the confidence of first placements was so far: its mean, the share of
        those placements that met their goal (the task ran to completion without being
        killed), the Brier score, how many were judged (a task still running is not), and
        the two totals the feedback store would hold (sum of confidences, goals met)."""
        pairs = [(j.confidence, j.state == "done" and j.attempts == 1) for j in self.jobs
                 if j.confidence is not None and (j.state in ("done", "failed") or j.attempts > 1)]
        if not pairs:
            return 0.0, 0.0, 0.0, 0, 0.0, 0.0
        conf = np.array([p for p, _ in pairs])
        met = np.array([float(ok) for _, ok in pairs])
        return (float(conf.mean()), float(met.mean()), float(((conf - met) ** 2).mean()), len(pairs),
                float(conf.sum()), float(met.sum()))

    def _first_placement(self, job: _Job, row: int, gpus: list[int], milli: int, reserve_mb: int,
                         now: float) -> None:
        """Keep a task's first placement as a ``decision.made`` (its hold: what the loop
        reserved, or the whole GPU the device plugin gives)."""
        node = self.state.node_names[row]
        model = int(self.state.node_model[row])
        self.first_placements[job.task.task_id] = (DecisionMade(
            decision_id=f"{job.task.task_id}.assign", task_id=job.task.task_id, action="assign",
            placement=[Placement(node=node, gpu=g, milli=milli,
                                 memory_mb=reserve_mb or int(self.state.gpu_mem_total[row, g])) for g in gpus],
            confidence=job.confidence if job.confidence is not None else 0.5, policy=PolicyRef(name=self.mode),
            decided_at=now, task=job.submitted), self.state.models[model] if model >= 0 else "")

    def outcome_examples(self) -> list[Example]:
        """The judged first placements (as ``_judged`` judges them) as the learner's examples,
        each recorded when it was decided, every record fully trusted (the loop measures exactly)."""
        out = []
        for j in self.jobs:
            placed = self.first_placements.get(j.task.task_id)
            if placed is None or not (j.state in ("done", "failed") or j.attempts > 1):
                continue
            decision, model = placed
            out.append(Example(decision, model, j.state == "done" and j.attempts == 1, 1.0, decision.decided_at))
        return out

    def _killed_share(self, times_s: np.ndarray, in_window: np.ndarray) -> float:
        """The part of the window's utilisation held by runs that were later killed (OOM or a
        failed GPU): memory used, but by work thrown away."""
        denominators = np.asarray(self.denominators)[in_window]
        if denominators.size == 0:
            return 0.0
        ticks = times_s[in_window]
        held = 0.0
        for start, end, curve, gpus in self.killed_runs:
            alive = ticks[(ticks > start) & (ticks <= end)]
            if alive.size:
                held += gpus * float((curve.memory_at(alive - start) + CONTEXT_MB).sum())
        return held / float(denominators.sum())

    def _maintenance_leads(self) -> tuple[int, float]:
        """Failed GPUs flagged ``maintenance_pending`` before they failed, and the median warning (h)."""
        leads = [(self.failed_gpus[gi] - at) / 3600.0 for gi, at in self.pending_maintenance.items()
                 if gi in self.failed_gpus and at < self.failed_gpus[gi]]
        return len(leads), float(np.median(leads)) if leads else 0.0

    def _false_alarms(self) -> int:
        """GPUs flagged ``maintenance_pending`` that the workload never made fail: healthy GPUs
        taken out of service (they also leave the utilisation's denominator, so each one
        flatters it). A GPU planned to fail after the run ends is a warning, not an alarm."""
        planned = {(f.node, f.gpu) for f in self.workload.faults}
        flagged = {(self.state.node_names[row], local) for row, local in map(self._gpu_slot, self.pending_maintenance)}
        return len(flagged - planned)

    def _gpu_slot(self, gi: int) -> tuple[int, int]:
        """``(row of the policy's state, GPU index on that node)`` of the simulator's GPU ``gi``."""
        row = int(np.searchsorted(self.offset, gi, side="right") - 1)
        return row, gi - int(self.offset[row])


# ---- entry points -------------------------------------------------------------------------

DEFAULT_TASKS = {"three-site": 1500, "openb": 5000}
DEFAULT_HOURS = {"three-site": 8.0, "openb": 3.0}
DEFAULT_FRACTION = {"three-site": 1.0, "openb": 0.25}
"""openb has 6,212 GPUs: a load that queues needs tens of thousands of tasks there, more than
a few minutes of Python decisions allow, so by default a quarter of its nodes (every model in
proportion) is simulated; ``--fleet-fraction 1`` runs the whole fleet."""


def load_bench_fleet(name: str, nodes_csv: Path | None = None, *, fraction: float = 1.0, seed: int = 0) -> Fleet:
    """The three-site fleet, or the openb fleet from ``nodes_csv`` (``fraction`` < 1: a
    seeded sample of its nodes, the same share of every GPU model, so the mix of models is
    kept)."""
    if name == "three-site":
        return load_fleet_spec()
    if nodes_csv is None:
        raise ValueError("the openb fleet needs its node list")
    fleet = load_openb_fleet(nodes_csv)
    if fraction >= 1.0:
        return fleet
    rng = np.random.default_rng(seed)
    by_model: dict[str, list[int]] = {}
    for i, n in enumerate(fleet.nodes):
        by_model.setdefault(n.gpus[0].model if n.gpus else "", []).append(i)
    keep = sorted(int(i) for rows in by_model.values()
                  for i in rng.choice(rows, size=max(1, round(fraction * len(rows))), replace=False))
    return Fleet(name=fleet.name, sites=fleet.sites, nodes=[fleet.nodes[i] for i in keep], links=fleet.links)


def compare(fleet: Fleet, workload: Workload, *, fleet_name: str, seed: int, peaks_known: bool = False,
            queue_aging: float = 1.0, baseline_preempts: bool = True, vip_evicts_standard: bool = False) -> Comparison:
    """Play ``workload`` with both schedulers on fresh copies of the fleet (and, with
    ``peaks_known``, Fleetpilot's loop a second time told each run's true peak: a bound on
    what better memory prediction could give, not a scheduler). ``queue_aging``: Fleetpilot's
    queue order (``backfill.completion_order``); ``baseline_preempts``: whether the baseline's
    PriorityClasses preempt (``default_preemption``), as they do unless set not to;
    ``vip_evicts_standard``: whether Fleetpilot's vips may evict standard work its contract
    spares (the policy service's setting of that name)."""
    ours = {"queue_aging": queue_aging, "vip_evicts_standard": vip_evicts_standard}
    runs = [FleetRun(fleet, workload, "k8s-default", seed, preempts=baseline_preempts),
            FleetRun(fleet, workload, "fleetpilot", seed, **ours)]
    if peaks_known:
        runs.append(FleetRun(fleet, workload, "fleetpilot", seed, knows_peaks=True, **ours))
    results = [run.run() for run in runs]
    # Queue figures over the same tasks in every run: those no negotiator rejected.
    rejected = frozenset().union(*(run.rejected_ids() for run in runs))
    _, only_largest = only_largest_hold(fleet, workload.tasks)
    for run, result in zip(runs, results, strict=True):
        result.figures.update(run.queue_figures(left_out=rejected))
        result.breakdown.update(run.queue_split(only_largest, left_out=rejected))
    base, ours = results[0], results[1]
    known = results[2] if peaks_known else None
    return Comparison(fleet=fleet_name, seed=seed, workload=workload.describe(), baseline=base, fleetpilot=ours,
                      peaks_known=known,
                      span_h=workload.span_s / 3600.0, sharing_bound=workload_sharing_bound(workload),
                      sm_use_bound=workload_sm_use_bound(workload),
                      largest_load=largest_gpu_load(fleet, workload.tasks, workload.span_s), code=code_digest(),
                      environment=run_environment(), queue_aging=queue_aging, baseline_preempts=baseline_preempts,
                      vip_evicts_standard=vip_evicts_standard)


def workload_sharing_bound(workload: Workload) -> float:
    """``fleet_workload.sharing_bound`` of a workload's tasks."""
    t = workload.tasks
    return sharing_bound(np.array([x.gpus for x in t]), np.array([x.gpu_milli for x in t]),
                         np.array([x.duration_s for x in t]))


def workload_sm_use_bound(workload: Workload) -> float:
    """``fleet_workload.sm_use_bound`` of a workload's tasks."""
    t = workload.tasks
    return sm_use_bound(np.array([x.gpus for x in t]), np.array([x.util for x in t]),
                        np.array([x.duration_s for x in t]))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise SystemExit(f"fleet bench: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m fleetpilot.bench.fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--fleet", choices=("three-site", "openb"), default="three-site")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--tasks", type=int, default=None, help=f"tasks in the workload (default: {DEFAULT_TASKS['three-site']} three-site, {DEFAULT_TASKS['openb']} openb)")
    p.add_argument("--hours", type=float, default=None, help=f"arrival window in virtual hours (default {DEFAULT_HOURS['three-site']:g} / {DEFAULT_HOURS['openb']:g})")
    p.add_argument("--load", type=float, default=None,
                   help=f"whole-GPU load over the arrival window (default {PACKED_LOAD} x the workload's sharing bound)")
    p.add_argument("--fleet-fraction", type=float, default=None,
                   help="share of the openb nodes simulated, every model in proportion (default 0.25)")
    p.add_argument("--arrivals", choices=("trace", "generated"), default="trace")
    found = "the openb data found as the other benchmarks find it ($FLEETPILOT_DATA, else shared/data/openb above)"
    p.add_argument("--trace", type=Path, default=None, help=f"openb pod list: arrivals and durations (default: {found})")
    p.add_argument("--nodes", type=Path, default=None, help=f"openb node list, for --fleet openb (default: {found})")
    p.add_argument("--peaks-known", action="store_true",
                   help="also run Fleetpilot told each run's true peak: what better memory prediction could add")
    p.add_argument("--estimate-spread", type=float, default=None,
                   help="declared durations log-normal around x1.1 the true ones with this sigma, the rest of the "
                   "workload unchanged (default: x0.9-1.3): how much Fleetpilot leans on good estimates")
    p.add_argument("--peak-spread", type=float, default=None,
                   help="each run's peak within this fraction of its program's, either way, the rest of the workload "
                   "unchanged (default 0.05): how much Fleetpilot leans on programs that repeat")
    p.add_argument("--resumable-share", type=float, default=None,
                   help="the share of programs that go on from a checkpoint when started again, the rest of the "
                   "workload unchanged (default: all): how much Fleetpilot leans on every task resuming")
    p.add_argument("--queue-aging", type=float, default=1.0,
                   help="how much arrival weighs against the run left in Fleetpilot's queue order "
                   "(backfill.completion_order; default 1, above 0)")
    p.add_argument("--baseline-never-preempts", action="store_true",
                   help="the baseline's PriorityClasses are non-preempting (preemptionPolicy: Never; default: they "
                   "preempt lower ones, as kube-scheduler's DefaultPreemption does)")
    p.add_argument("--vip-evicts-standard", action="store_true",
                   help="a vip that no best-effort work makes room for may evict standard work whose contract "
                   "spares it (the policy service's FLEETPILOT_POLICY_VIP_EVICTS_STANDARD; default: off)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; bad arguments raise ``SystemExit`` with one line."""
    args = _parser().parse_args(argv)
    tasks = args.tasks if args.tasks is not None else DEFAULT_TASKS[args.fleet]
    hours = args.hours if args.hours is not None else DEFAULT_HOURS[args.fleet]
    fraction = args.fleet_fraction if args.fleet_fraction is not None else DEFAULT_FRACTION[args.fleet]
    # Written so that NaN fails each test (every comparison with it is false).
    if (tasks < 1 or not 0 < hours < math.inf or (args.load is not None and not 0 < args.load < math.inf)
            or not 0 < fraction <= 1):
        raise SystemExit("fleet bench: --tasks, --hours and --load must be positive and finite, "
                         "--fleet-fraction in (0, 1]")
    if not 0 < args.queue_aging < math.inf:
        raise SystemExit(f"fleet bench: --queue-aging must be above 0 and finite, got {args.queue_aging:g}")
    if args.estimate_spread is not None and not 0 < args.estimate_spread < math.inf:
        raise SystemExit(f"fleet bench: --estimate-spread must be above 0 and finite, got {args.estimate_spread:g}")
    if args.peak_spread is not None and not 0 < args.peak_spread < 1:
        raise SystemExit(f"fleet bench: --peak-spread must be above 0 and below 1, got {args.peak_spread:g}")
    if args.resumable_share is not None and not 0 <= args.resumable_share <= 1:
        raise SystemExit(f"fleet bench: --resumable-share must be within [0, 1], got {args.resumable_share:g}")
    data = find_data_dir() if args.trace is None or args.nodes is None else None
    trace_csv = args.trace or (data / TRACES["default"] if data else None)
    nodes_csv = args.nodes or (data / NODES_FILE if data else None)
    for path, needed in ((trace_csv, args.arrivals == "trace"), (nodes_csv, args.fleet == "openb")):
        if needed and path is None:
            raise SystemExit("fleet bench: no shared/data/openb found (set FLEETPILOT_DATA, or pass --trace and --nodes)")
        if needed and not path.is_file():
            raise SystemExit(f"fleet bench: no such file {path}")
    check_writable("fleet bench", files=(args.json,), dirs=(args.plot_dir,))
    fleet = load_bench_fleet(args.fleet, nodes_csv, fraction=fraction, seed=args.seed)
    trace = load_trace(trace_csv) if args.arrivals == "trace" else None
    try:
        workload = generate_workload(fleet, args.seed, n_tasks=tasks, load=args.load, span_s=hours * 3600.0,
                                     trace=trace, use_trace_shapes=args.fleet == "openb" and trace is not None,
                                     estimate_spread=args.estimate_spread, peak_spread=args.peak_spread,
                                     resumable_share=args.resumable_share)
    except ValueError as exc:
        raise SystemExit(f"fleet bench: {exc}") from None
    name = args.fleet if fraction >= 1 else f"{args.fleet} ({fraction:g} of its nodes)"
    print(f"fleet {name}: {len([n for n in fleet.nodes if n.gpus])} nodes, {fleet.gpu_count} GPUs; seed {args.seed}",
          flush=True)
    result = compare(fleet, workload, fleet_name=args.fleet, seed=args.seed, peaks_known=args.peaks_known,
                     queue_aging=args.queue_aging, baseline_preempts=not args.baseline_never_preempts,
                     vip_evicts_standard=args.vip_evicts_standard)
    print(report(result))
    if args.plot_dir is not None:
        for path in plot(result, args.plot_dir):
            print(f"plot: {path}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=2, default=float))
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
