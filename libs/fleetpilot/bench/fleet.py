"""The fleet benchmark: Fleetpilot's full loop against the Kubernetes default scheduler (or a
scheduler that shares GPUs).

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

**kai-share** (``--baseline kai-share``; the issue's targets stay set against k8s-default) — a
scheduler that shares GPUs, as NVIDIA's KAI-Scheduler does with its GPU sharing: a task asking
for a share of one GPU holds that fraction of it and the GPU memory it declared (its ask plus
the CUDA context, KAI's ``gpu-memory``), on the GPU the binpack strategy picks (the reference
simulator's GPU packing: a partly used GPU first, ``packing``); nothing isolates the shares, and
nothing knows how a task grows, so a share that outgrows what it declared kills itself or a
neighbour (the simulator's OOM). Whole-GPU pods, the queue, the Jobs' restarts and the
PriorityClasses' preemption are k8s-default's, the preemption counting a GPU as what its free
compute and memory come to once its lower-priority shares have gone. It isolates what sharing
alone gives from what Fleetpilot's memory prediction, rebalancing and negotiation add.

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

The run itself is ``fleet_run.FleetRun``, with one mixin per concern (``fleet_preemption``,
``fleet_moves``, ``fleet_memory``, ``fleet_figures``); this module holds the entry points.

Run: ``python -m fleetpilot.bench.fleet --fleet three-site --seed 7 --json out/fleet.json
--plot-dir out/``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import numpy as np

from fleetpilot.fleet.inventory import Fleet, load_fleet_spec, load_openb_fleet

from .fleet_job import BASELINES
from .fleet_report import Comparison, plot, report
from .fleet_run import FleetRun
from .fleet_workload import (
    PACKED_LOAD,
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
            queue_aging: float = 1.0, baseline_preempts: bool = True, vip_evicts_standard: bool = False,
            baseline: str = "k8s-default") -> Comparison:
    """Play ``workload`` with both schedulers on fresh copies of the fleet (and, with
    ``peaks_known``, Fleetpilot's loop a second time told each run's true peak: a bound on
    what better memory prediction could give, not a scheduler). ``queue_aging``: Fleetpilot's
    queue order (``backfill.completion_order``); ``baseline_preempts``: whether the baseline's
    PriorityClasses preempt (``default_preemption``), as they do unless set not to;
    ``vip_evicts_standard``: whether Fleetpilot's vips may evict standard work its contract
    spares (the policy service's setting of that name); ``baseline``: which of ``BASELINES``
    Fleetpilot is measured against."""
    ours = {"queue_aging": queue_aging, "vip_evicts_standard": vip_evicts_standard}
    runs = [FleetRun(fleet, workload, baseline, seed, preempts=baseline_preempts),
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
    p.add_argument("--baseline", choices=BASELINES, default="k8s-default",
                   help="what Fleetpilot is measured against: the default scheduler with the NVIDIA device plugin "
                   "(whole GPUs; the targets are set against it), or kai-share: GPUs shared by declared memory, "
                   "binpacked, with no knowledge of growth (KAI-Scheduler's GPU sharing)")
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
                     vip_evicts_standard=args.vip_evicts_standard, baseline=args.baseline)
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
