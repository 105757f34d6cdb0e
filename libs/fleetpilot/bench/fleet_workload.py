"""The mixed workload of the fleet benchmark: tasks, their true memory curves, SLAs and faults.

A workload is plain data, built once per (fleet, seed) and played identically by every
scheduler the benchmark compares. It is made of:

- **programs** (task signatures): a kind (train, finetune, infer, encode), a GPU shape
  (whole GPUs, or a share of one GPU), the memory a user *asks* per GPU, and the memory-growth
  pattern the program really follows. Growing patterns (``linear``, ``steps``, ``leak``)
  often end above what was asked (a peak of 0.95-1.8x the ask), as happens with real
  fine-tunes and leaking notebooks; ``flat`` and ``sawtooth`` programs usually over-ask.
  Tasks are draws of programs, so the same signature recurs, as nightly re-runs do;
- **tasks**: a program, a jittered true peak, a duration, an arrival time, an SLA tier
  (vip / standard / best_effort with a maximum queue time and, for guaranteed tiers, a
  deadline) and the duration the user declares: the true one x0.9-1.3 by default, or, with
  ``estimate_spread``, log-normal around x1.1 (users' estimates are often far off: a
  sensitivity run, with everything else of the workload unchanged); and whether its program
  goes on from a checkpoint when started again: every one does by default, or, with
  ``resumable_share``, that share of the programs (another sensitivity run: a task that does
  not resume loses its run when it is moved, and Fleetpilot's policy moves it only off a
  failing GPU);
- **faults**: a few GPUs that degrade (rising corrected ECC, remapped rows, PCIe replays)
  and then fall off the bus (XID 79) at a known time, and one that fails without warning.

Arrivals and durations come from the openb trace's creation and deletion times when it is
given (a seeded sample of its GPU pods, creation times mapped linearly onto the arrival
window, durations scaled by one factor), else from a seeded Poisson process with log-normal
durations. Either way the durations are scaled so that the **whole-GPU load** (what the
tasks hold under the device plugin, where a share holds a whole GPU, times their duration,
over the window's GPU-seconds) equals ``load``: the load is a stated input, never fitted to
a result.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleetpilot.fleet.catalogue import gpu_model
from fleetpilot.fleet.inventory import Fleet
from fleetpilot.fleet.simulator import CONTEXT_MB
from fleetpilot.workload.growth import MemoryGrowth, PatternName

KINDS: tuple[str, ...] = ("train", "finetune", "infer", "encode")
KIND_SHARE: tuple[float, ...] = (0.2, 0.25, 0.35, 0.2)
GROWING: frozenset[str] = frozenset({"linear", "steps", "leak"})
TIERS: tuple[str, ...] = ("vip", "standard", "best_effort")
TIER_SHARE: tuple[float, ...] = (0.1, 0.6, 0.3)
MAX_QUEUE_S: dict[str, float] = {"vip": 300.0, "standard": 1800.0, "best_effort": 4 * 3600.0}
"""The maximum queue time each tier asks for (the SLA a task misses when it waits longer)."""
DEADLINE_SLACK: dict[str, float] = {"vip": 1.5, "standard": 2.0}
"""Guaranteed tiers also ask to finish by ``arrival + max queue + slack x declared duration``."""
MIN_DURATION_S = 300.0
ESTIMATE_BIAS = 1.1
"""With ``estimate_spread``, the median declared duration over the true one (users pad)."""
EDGE_MODELS: frozenset[str] = frozenset({"Jetson-Orin"})
"""Models too weak for training: train and finetune programs never list them."""

_PATTERNS: dict[str, tuple[tuple[PatternName, ...], tuple[float, ...]]] = {
    "train": (("steps", "linear", "flat"), (0.4, 0.3, 0.3)),
    "finetune": (("steps", "leak", "linear", "flat"), (0.35, 0.3, 0.2, 0.15)),
    "infer": (("flat", "sawtooth", "leak"), (0.6, 0.25, 0.15)),
    "encode": (("sawtooth", "flat", "leak"), (0.4, 0.3, 0.3)),
}


@dataclass(frozen=True)
class Program:
    """One task signature: what its tasks ask for and how their memory really grows."""

    name: str
    kind: str
    gpus: int
    gpu_milli: int
    request_mb: float
    pattern: PatternName
    peak_ratio: float
    util: float
    cpu_milli: int
    memory_mb: int
    gpu_models: tuple[str, ...]


@dataclass(frozen=True)
class BenchTask:
    """One submission. ``growth`` is the ground truth the simulator plays (per GPU, without
    the CUDA context); nothing but the simulator may read it. ``request_mb`` is what the user
    asked per GPU; ``declared_duration_s`` what the user said the run takes."""

    task_id: str
    program: str
    kind: str
    gpus: int
    gpu_milli: int
    request_mb: float
    cpu_milli: int
    memory_mb: int
    gpu_models: tuple[str, ...]
    growth: MemoryGrowth
    util: float
    arrival_s: float
    tier: str
    max_queue_s: float
    deadline_s: float | None
    declared_duration_s: float
    resumable: bool = True  # its program goes on from a checkpoint when started again

    @property
    def duration_s(self) -> float:
        """The true run time."""
        return self.growth.duration_s

    @property
    def shares_gpu(self) -> bool:
        """True for a fraction of one GPU."""
        return self.gpus == 1 and self.gpu_milli < 1000

    @property
    def gpu_work(self) -> float:
        """GPUs' worth of work it does while running (0.25 for a quarter share)."""
        return self.gpus * self.gpu_milli / 1000.0


@dataclass(frozen=True)
class FaultPlan:
    """A GPU that fails at ``fails_s``; a ``degrading`` one shows signs from ``onset_s``."""

    node: str
    gpu: int
    kind: str
    onset_s: float
    fails_s: float


@dataclass(frozen=True)
class Workload:
    """Everything both runs play: tasks by arrival, faults, the windows, how it was built."""

    tasks: tuple[BenchTask, ...]  # by arrival
    faults: tuple[FaultPlan, ...]
    span_s: float
    horizon_s: float
    load: float
    source: str
    programs: int
    estimate_spread: float | None = None  # the declared durations' log-normal sigma; None: x0.9-1.3
    peak_spread: float | None = None  # how far a run's peak is from its program's, either way; None: 5%
    resumable_share: float | None = None  # the share of programs that resume from a checkpoint; None: all

    def describe(self) -> str:
        """One line for the report."""
        share = sum(t.shares_gpu for t in self.tasks) / max(len(self.tasks), 1)
        declared = ("x0.9-1.3 the true ones" if self.estimate_spread is None
                    else f"log-normal around x{ESTIMATE_BIAS:g} the true ones, sigma {self.estimate_spread:g}")
        return (f"{len(self.tasks)} tasks from {self.programs} programs ({share:.0%} GPU shares), "
                f"arrivals over {self.span_s / 3600:.1f} h from {self.source}, run {self.horizon_s / 3600:.1f} h, "
                f"whole-GPU load {self.load:.2f}, {len(self.faults)} GPU faults, declared durations {declared}, "
                f"peaks within {self.peak_spread if self.peak_spread is not None else 0.05:.0%} of their program's"
                + ("" if self.resumable_share is None else
                   f", {self.resumable_share:.0%} of the programs resuming from a checkpoint (the others start over)"))


@dataclass(frozen=True)
class TracePod:
    """The parts of an openb pod row the workload uses."""

    gpus: int
    gpu_milli: int
    cpu_milli: int
    memory_mb: int
    gpu_spec: tuple[str, ...]
    created_s: float
    duration_s: float


def load_trace(path: str | Path) -> list[TracePod]:
    """GPU pods of an openb pod list with both times (CPU-only and undeleted pods skipped)."""
    out = []
    with Path(path).open(newline="") as handle:
        for r in csv.DictReader(handle):
            gpus, milli = int(r["num_gpu"]), int(r["gpu_milli"])
            if gpus <= 0 or milli <= 0 or not r.get("deletion_time") or not r.get("creation_time"):
                continue
            created, deleted = float(r["creation_time"]), float(r["deletion_time"])
            if deleted <= created:
                continue
            spec = tuple(sorted({m for m in (r.get("gpu_spec") or "").split("|") if m}))
            out.append(TracePod(gpus=gpus, gpu_milli=milli, cpu_milli=int(r["cpu_milli"]),
                                memory_mb=int(r["memory_mib"]), gpu_spec=spec, created_s=created,
                                duration_s=deleted - created))
    return out


def fleet_models(fleet: Fleet) -> dict[str, float]:
    """GPU model -> memory (MB) of the fleet's GPUs."""
    return {g.model: float(g.memory_mb or gpu_model(g.model).memory_mb) for n in fleet.nodes for g in n.gpus}


def _acceptable(models: dict[str, float], kind: str, need_mb: float, spec: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The models a user would list: enough memory for the ask, no edge boards for training."""
    ok = [m for m, mem in models.items() if mem >= need_mb and not (kind in ("train", "finetune") and m in EDGE_MODELS)]
    if spec:
        ok = [m for m in ok if m in spec] or [m for m in spec if m in models and models[m] >= need_mb]
    return tuple(sorted(ok))


def make_programs(fleet: Fleet, rng: np.random.Generator, count: int) -> list[Program]:
    """``count`` programs fitted to what the fleet offers (every program fits some model)."""
    models = fleet_models(fleet)
    # Asks are sized on the fleet's typical training GPU (the median over its GPUs), as
    # teams size jobs for the GPUs they usually get; growth then pushes some past it.
    typical = float(np.median([float(g.memory_mb or gpu_model(g.model).memory_mb) for n in fleet.nodes
                               for g in n.gpus if g.model not in EDGE_MODELS]))
    programs = []
    for i in range(count):
        kind = KINDS[int(rng.choice(len(KINDS), p=KIND_SHARE))]
        names, probs = _PATTERNS[kind]
        pattern = names[int(rng.choice(len(names), p=probs))]
        if kind == "train":
            gpus, milli = int(rng.choice([1, 2, 4, 8], p=[0.4, 0.3, 0.2, 0.1])), 1000
            request = rng.uniform(0.3, 0.85) * typical
            util = rng.uniform(85, 100)
        elif kind == "finetune":
            gpus = int(rng.choice([1, 2], p=[0.8, 0.2]))
            milli = 1000 if gpus > 1 or rng.random() < 0.7 else 500
            request = rng.uniform(0.3, 0.9) * typical if milli == 1000 else rng.uniform(4_000, 10_000)
            util = rng.uniform(60, 95)
        elif kind == "infer":
            gpus, milli = 1, int(rng.choice([250, 500, 1000], p=[0.45, 0.35, 0.2]))
            request = rng.uniform(1_500, 6_000) * milli / 250 if milli < 1000 else rng.uniform(0.2, 0.5) * typical
            util = milli / 10 * rng.uniform(0.5, 0.9)
        else:
            gpus, milli = 1, int(rng.choice([250, 500, 1000], p=[0.4, 0.4, 0.2]))
            request = rng.uniform(1_000, 4_000) * milli / 250 if milli < 1000 else rng.uniform(0.15, 0.4) * typical
            util = milli / 10 * rng.uniform(0.6, 0.95)
        ratio = rng.uniform(0.95, 1.8) if pattern in GROWING else rng.uniform(0.6, 1.0)
        accept = _acceptable(models, kind, request + CONTEXT_MB)
        # The true peak must fit the largest acceptable GPU: a task that can run nowhere
        # proves nothing about scheduling.
        cap = 0.95 * max(models[m] for m in accept) - CONTEXT_MB
        ratio = min(ratio, cap / request)
        cpu = int(rng.choice([2000, 4000, 8000])) * gpus if milli == 1000 else int(rng.choice([1000, 2000, 4000]))
        mem = int(rng.choice([8192, 16384, 32768])) * gpus if milli == 1000 else int(rng.choice([4096, 8192]))
        programs.append(Program(name=f"{kind}-{i:02d}", kind=kind, gpus=gpus, gpu_milli=milli,
                                request_mb=float(request), pattern=pattern, peak_ratio=float(ratio),
                                util=float(util), cpu_milli=cpu, memory_mb=mem, gpu_models=accept))
    return programs


def _growth(p: Program, rng: np.random.Generator, duration: float,
            spread: tuple[np.random.Generator, float, float] | None = None) -> MemoryGrowth:
    """A task's true memory curve: its program's, its peak within 5% of the program's
    (``spread``: a generator of its own, the half-width of the peak's variation, and the most
    the largest GPU the program accepts holds, which no peak goes past)."""
    peak = p.request_mb * p.peak_ratio * float(rng.uniform(0.95, 1.05))  # drawn either way: the seed's other draws stay put
    if spread is not None:
        draws, half_width, ceiling = spread
        peak = min(p.request_mb * p.peak_ratio * float(draws.uniform(1.0 - half_width, 1.0 + half_width)), ceiling)
    base = peak * float(rng.uniform(0.2, 0.5))
    return MemoryGrowth(pattern=p.pattern, base_mb=base, peak_mb=peak, duration_s=duration,
                        warmup_s=duration * float(rng.uniform(0.02, 0.08)), n_steps=int(rng.integers(3, 6)),
                        period_s=duration / float(rng.uniform(4, 10)), noise_mb=peak * 0.004)


def _program_for_pod(programs: list[Program], pod: TracePod, rng: np.random.Generator) -> Program:
    """A program whose shape class matches the pod's (multi-GPU, whole, share)."""
    if pod.gpus > 1:
        pool = [p for p in programs if p.gpus > 1] or [p for p in programs if p.kind == "train"]
    elif pod.gpu_milli >= 1000:
        pool = [p for p in programs if p.gpus == 1 and p.gpu_milli == 1000]
    else:
        pool = [p for p in programs if p.gpu_milli < 1000]
    return (pool or programs)[int(rng.integers(len(pool or programs)))]


def _fit_pod(p: Program, pod: TracePod, models: dict[str, float]) -> Program:
    """The program with the pod's shape, CPU, memory and GPU-model constraint."""
    gpus = pod.gpus
    milli = 1000 if gpus > 1 else pod.gpu_milli
    # Memory is the program's (its model and batch), whatever compute share the pod asks:
    # one signature, one footprint.
    request = p.request_mb
    accept = _acceptable(models, p.kind, request + CONTEXT_MB, pod.gpu_spec)
    if not accept:  # the pod's models are too small for the program: shrink the ask to them
        accept = tuple(sorted(pod.gpu_spec if pod.gpu_spec else models))
        request = min(request, 0.5 * min(models[m] for m in accept if m in models))
    cap = 0.95 * max(models[m] for m in accept if m in models) - CONTEXT_MB
    return Program(name=p.name, kind=p.kind, gpus=gpus, gpu_milli=milli, request_mb=request, pattern=p.pattern,
                   peak_ratio=min(p.peak_ratio, cap / request), util=p.util, cpu_milli=pod.cpu_milli,
                   memory_mb=pod.memory_mb, gpu_models=accept)


def _whole_gpus(p: Program) -> int:
    return p.gpus  # the device plugin gives a share a whole GPU


def _capacity(fleet: Fleet) -> int:
    return sum(len(n.gpus) for n in fleet.nodes)


PACKED_LOAD = 0.95
"""Default load: the fleet is sized for its work as if it were packed, at 95% (see ``generate_workload``)."""


def sharing_bound(gpus: np.ndarray, milli: np.ndarray, durations: np.ndarray) -> float:
    """How many times more work the same GPUs hold when shares are packed instead of each
    holding a whole GPU: ``1 / (1 - f (1 - s))``, with ``f`` the shares' part of the whole-GPU
    time and ``s`` their mean fraction weighted by time. It bounds the utilisation ratio that
    sharing can buy when both schedulers are saturated, whatever the policy."""
    gpus, milli, durations = (np.asarray(x, dtype=float) for x in (gpus, milli, durations))
    whole = float((gpus * durations).sum())
    share = (gpus == 1) & (milli < 1000)
    if whole <= 0 or not share.any():
        return 1.0
    f = float(durations[share].sum()) / whole
    s = float((milli[share] / 1000.0 * durations[share]).sum() / durations[share].sum())
    return 1.0 / (1.0 - f * (1.0 - s))


def sm_use_bound(gpus: np.ndarray, util_pct: np.ndarray, durations: np.ndarray) -> float:
    """How many times more work the same GPUs would hold if every task, whole or share, were
    packed by the SM time it really uses (time-slicing with no slowdown at all), instead of
    holding whole GPUs: whole-GPU time over ``sum(gpus * util * duration)``. No scheduler
    that keeps tasks at full speed can do better; it bounds the utilisation ratio that any
    co-location can buy on a saturated fleet (``sharing_bound`` is the tighter bound of
    packing by the compute the tasks ask)."""
    gpus, util, durations = (np.asarray(x, dtype=float) for x in (gpus, util_pct, durations))
    used = float((gpus * np.clip(util, 0.0, 100.0) / 100.0 * durations).sum())
    return float((gpus * durations).sum()) / used if used > 0 else 1.0


@dataclass(frozen=True)
class LargestGpuLoad:
    """The work that only a fleet's largest GPUs can hold, against what those GPUs give."""

    models: tuple[str, ...]  # the models with the most memory (several when they tie)
    memory_mb: float
    gpus: int
    tasks: int  # how many runs no other model they accept can hold
    work_gpu_h: float  # those runs' GPU-hours
    load: float  # that work over the largest GPUs' hours in the arrival window
    # Of those GPU-hours, the ones spent above what a smaller GPU they accept holds
    # (``hours_above``): all the largest GPUs would carry if every low phase ran elsewhere.
    above_smaller_gpu_h: float = 0.0
    above_load: float = 0.0  # those hours over the largest GPUs' hours in the arrival window

    def describe(self) -> str:
        """One line for the report."""
        return (f"work only the largest GPUs ({', '.join(self.models)}, {self.memory_mb / 1024:.0f} GB) can hold: "
                f"{self.tasks} runs, {self.work_gpu_h:.0f} GPU-h, x{self.load:.2f} what their {self.gpus} GPUs give "
                f"over the arrival window ({self.above_smaller_gpu_h:.0f} GPU-h above what a smaller GPU holds, "
                f"x{self.above_load:.2f})")


def only_largest_hold(fleet: Fleet, tasks: Sequence[BenchTask]) -> tuple[tuple[str, ...], frozenset[str]]:
    """The models with the most memory (several when they tie), and the tasks that need one of
    them to reach their peak: a task whose true peak (its curve's, plus the CUDA context) is
    above every other model it accepts. The ground truth is read, as the other workload
    figures do; no scheduler sees it."""
    models = fleet_models(fleet)
    if not models:
        return (), frozenset()
    top = max(models.values())
    largest = tuple(sorted(m for m, mb in models.items() if mb == top))
    needing = set()
    for t in tasks:
        need = t.growth.peak_mb + CONTEXT_MB
        accepted = [m for m in (t.gpu_models or tuple(models)) if m in models]
        if any(m in largest for m in accepted) and not any(models[m] >= need for m in accepted if m not in largest):
            needing.add(t.task_id)
    return largest, frozenset(needing)


def hours_above(task: BenchTask, room_mb: float, samples: int = 2001) -> float:
    """GPU-hours ``task``'s noiseless curve, plus the CUDA context, spends above ``room_mb``
    per GPU, read at ``samples`` evenly spaced instants of its run; a ``sawtooth``'s whole run
    once it goes above at all (it comes back to its peak every period, too often to move)."""
    used = task.growth.memory_at(np.linspace(0.0, task.duration_s, samples)) + CONTEXT_MB
    share = float((used > room_mb).mean())
    if task.growth.pattern == "sawtooth" and share > 0:
        share = 1.0
    return task.gpus * task.duration_s * share / 3600.0


def largest_gpu_load(fleet: Fleet, tasks: Sequence[BenchTask], span_s: float) -> LargestGpuLoad:
    """How loaded a fleet's largest GPUs are by the runs that fit nothing smaller
    (``only_largest_hold``): those need one of them to reach their peak, whoever schedules
    them. Counted for its whole run: a run may spend its low start on a smaller GPU, so this
    is the demand, not a bound. Well above 1, more of that work arrives than those GPUs can
    run in the window, and it queues by the window's end unless most of it runs elsewhere."""
    largest, needing = only_largest_hold(fleet, tasks)
    if not largest:
        return LargestGpuLoad(models=(), memory_mb=0.0, gpus=0, tasks=0, work_gpu_h=0.0, load=0.0)
    models = fleet_models(fleet)
    count = sum(1 for n in fleet.nodes for g in n.gpus if g.model in largest)
    work_s = sum(t.gpus * t.duration_s for t in tasks if t.task_id in needing)
    above_h = 0.0
    for t in tasks:
        if t.task_id in needing:
            smaller = [models[m] for m in (t.gpu_models or tuple(models)) if m in models and m not in largest]
            above_h += hours_above(t, max(smaller, default=0.0))
    capacity_s = count * span_s
    return LargestGpuLoad(models=largest, memory_mb=models[largest[0]], gpus=count, tasks=len(needing),
                          work_gpu_h=work_s / 3600.0, load=work_s / capacity_s if capacity_s > 0 else 0.0,
                          above_smaller_gpu_h=above_h, above_load=above_h * 3600.0 / capacity_s if capacity_s > 0 else 0.0)


def generate_workload(fleet: Fleet, seed: int, *, n_tasks: int, load: float | None = None, span_s: float = 8 * 3600.0,
                      drain: float = 0.5, trace: list[TracePod] | None = None, use_trace_shapes: bool = False,
                      n_programs: int = 48, n_faults: int = 4, estimate_spread: float | None = None,
                      peak_spread: float | None = None, resumable_share: float | None = None) -> Workload:
    """A seeded workload for ``fleet`` (see the module docstring).

    ``load`` is the whole-GPU load over the arrival window ``span_s``. By default it is
    ``PACKED_LOAD`` times ``sharing_bound`` of the tasks: a fleet bought for its work as if
    every share were packed, at 95% of its GPUs. Under the device plugin that demand exceeds
    the fleet (the baseline queues); a scheduler that packs perfectly would just keep up. The
    rule depends on the tasks' shapes only, never on a result. The run lasts
    ``span_s * (1 + drain)``. With ``trace``, arrival times and relative durations come from
    a seeded sample of its pods; ``use_trace_shapes`` also takes their GPU shapes, CPU,
    memory and model constraints (for the fleet the trace was recorded on).

    ``estimate_spread``: each declared duration is the true one times a log-normal factor of
    median ``ESTIMATE_BIAS`` and this sigma (1.0: a fifth of users off by more than x2.6),
    drawn from a generator of its own, so that the tasks, arrivals, curves and faults stay
    those of the same seed without it. Deadlines follow the declared durations, as a user
    sets them by what they believe.

    ``peak_spread``: each run's peak is its program's within this fraction either way
    (uniform; 0.05 without it), from a generator of its own, never past what the largest GPU
    its program accepts holds (less the CUDA context): runs of one signature differ more, as
    the same program on other data or batch sizes does, and are harder to predict.

    ``resumable_share``: each program goes on from a checkpoint with this probability (every
    task of it alike, as a program either saves its state or not), from a generator of its
    own; without it every program does.
    """
    if n_tasks <= 0 or (load is not None and load <= 0) or span_s <= 0:
        raise ValueError("n_tasks, load and span_s must be positive")
    if estimate_spread is not None and not 0 < estimate_spread < math.inf:
        raise ValueError(f"the estimates' spread must be above 0 and finite, got {estimate_spread:g}")
    rng = np.random.default_rng(seed)
    if peak_spread is not None and not 0 < peak_spread < 1:
        raise ValueError(f"the peaks' spread must be above 0 and below 1, got {peak_spread:g}")
    if resumable_share is not None and not 0 <= resumable_share <= 1:
        raise ValueError(f"the resumable share must be within [0, 1], got {resumable_share:g}")
    estimates = np.random.default_rng([seed, 1]) if estimate_spread is not None else None
    peaks = np.random.default_rng([seed, 2]) if peak_spread is not None else None
    models = fleet_models(fleet)
    programs = make_programs(fleet, rng, n_programs)
    # Popular programs run far more often than rare ones (Zipf-like), as in real clusters.
    popularity = 1.0 / np.arange(1, len(programs) + 1) ** 0.8
    popularity /= popularity.sum()
    if trace:
        pods = [trace[int(i)] for i in rng.integers(len(trace), size=n_tasks)]
        created = np.array([p.created_s for p in pods])
        # The trace's first weeks hold a few long-lived pods only: use its dense part.
        lo, hi = np.percentile([p.created_s for p in trace], [2, 100])
        arrivals = np.clip((created - lo) / max(hi - lo, 1.0), 0.0, 1.0) * span_s
        raw = np.array([p.duration_s for p in pods])
        chosen = [(_fit_pod(_program_for_pod(programs, p, rng), p, models) if use_trace_shapes
                   else programs[int(rng.choice(len(programs), p=popularity))]) for p in pods]
        source = "the openb trace (creation/deletion times" + (", shapes)" if use_trace_shapes else ")")
    else:
        arrivals = np.sort(rng.uniform(0.0, span_s, n_tasks))
        raw = rng.lognormal(math.log(2400.0), 0.9, n_tasks)
        chosen = [programs[int(rng.choice(len(programs), p=popularity))] for _ in range(n_tasks)]
        source = "a seeded Poisson process"
    # One duration scale so that the whole-GPU load is `load`; clipping changes the sum, so
    # the scale is refined a few times (a fixed point, independent of any result).
    whole = np.array([_whole_gpus(p) for p in chosen], dtype=float)

    def scaled(to_load: float) -> np.ndarray:
        target = to_load * _capacity(fleet) * span_s
        scale = target / max(float((whole * raw).sum()), 1.0)
        for _ in range(30):
            durations = np.clip(raw * scale, MIN_DURATION_S, span_s)
            scale *= target / max(float((whole * durations).sum()), 1.0)
        return np.clip(raw * scale, MIN_DURATION_S, span_s)

    if load is None:
        milli = np.array([p.gpu_milli for p in chosen], dtype=float)
        load = PACKED_LOAD * sharing_bound(whole, milli, scaled(1.0))
    durations = scaled(load)
    reached = float((whole * durations).sum()) / (_capacity(fleet) * span_s)
    if reached < 0.98 * load:
        raise ValueError(f"{n_tasks} tasks cannot make a whole-GPU load of {load:.2f} on {_capacity(fleet)} GPUs "
                         f"over {span_s / 3600:.1f} h (at most {reached:.2f}): use more tasks or a smaller fleet")
    order = np.argsort(arrivals, kind="stable")
    names = sorted({p.name for p in chosen})
    if resumable_share is None:
        resumes = dict.fromkeys(names, True)
    else:
        draws = np.random.default_rng([seed, 3]).random(len(names))
        resumes = {name: bool(u < resumable_share) for name, u in zip(names, draws, strict=True)}
    tasks = []
    for k, i in enumerate(order):
        p = chosen[int(i)]
        duration = float(durations[i])
        tier = TIERS[int(rng.choice(len(TIERS), p=TIER_SHARE))]
        declared = duration * float(rng.uniform(0.9, 1.3))  # drawn either way: the seed's other draws stay put
        if estimates is not None:
            declared = duration * ESTIMATE_BIAS * math.exp(float(estimates.normal(0.0, estimate_spread)))
        spread = None
        if peaks is not None and peak_spread is not None:
            # The most the ±5% of the default lets a peak reach: the largest GPU still holds it.
            ceiling = 1.05 * (0.95 * max(models[m] for m in (p.gpu_models or models) if m in models) - CONTEXT_MB)
            spread = (peaks, peak_spread, ceiling)
        arrival = float(arrivals[i])
        deadline = (arrival + MAX_QUEUE_S[tier] + DEADLINE_SLACK[tier] * declared) if tier in DEADLINE_SLACK else None
        tasks.append(BenchTask(task_id=f"t{k:05d}", program=p.name, kind=p.kind, gpus=p.gpus, gpu_milli=p.gpu_milli,
                               request_mb=p.request_mb, cpu_milli=p.cpu_milli, memory_mb=p.memory_mb,
                               gpu_models=p.gpu_models, growth=_growth(p, rng, duration, spread), util=p.util,
                               arrival_s=arrival, tier=tier, max_queue_s=MAX_QUEUE_S[tier], deadline_s=deadline,
                               declared_duration_s=declared, resumable=resumes[p.name]))
    horizon = span_s * (1.0 + drain)
    return Workload(tasks=tuple(tasks), faults=tuple(plan_faults(fleet, rng, n_faults, span_s)), span_s=span_s,
                    horizon_s=horizon, load=load, source=source, programs=len({t.program for t in tasks}),
                    estimate_spread=estimate_spread, peak_spread=peak_spread, resumable_share=resumable_share)


def plan_faults(fleet: Fleet, rng: np.random.Generator, count: int, span_s: float) -> list[FaultPlan]:
    """``count`` GPU failures in the arrival window: all but the last degrade for 1.5-3 h
    first; the last fails without warning (what no model can see coming)."""
    gpus = [(n.node, g.index) for n in fleet.nodes for g in n.gpus if g.model not in EDGE_MODELS]
    if count <= 0 or not gpus:
        return []
    picks = rng.choice(len(gpus), size=min(count, len(gpus)), replace=False)
    out = []
    for k, i in enumerate(picks):
        node, gpu = gpus[int(i)]
        fails = float(rng.uniform(0.45, 0.9)) * span_s
        sudden = k == len(picks) - 1
        lead = 0.0 if sudden else float(rng.uniform(1.5, 3.0)) * 3600.0
        out.append(FaultPlan(node=node, gpu=gpu, kind="sudden" if sudden else "degrading",
                             onset_s=max(fails - lead, 0.0), fails_s=fails))
    return out
