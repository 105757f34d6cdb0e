"""The openb allocation benchmark (FGD, USENIX ATC'23), as ``shared/data/openb/PROTOCOL.md``.

One run (a seed): shuffle the trace's tasks with the seed, append uniform random copies
until the requested GPU reaches 1.3x the cluster's capacity, then place the tasks one at a
time into an empty cluster with a policy: no departures, no retries; a task that fits
nowhere fails for good and still counts as arrived. After each task, allocation = placed
milli-GPU / capacity and arrived = requested milli-GPU so far / capacity; "allocation at X%"
is the mean allocation over the tasks whose arrived percentage rounds to X.

Usage (also ``fleetpilot bench openb``)::

    python -m fleetpilot.bench.openb --policy fgd,fleetpilot --seeds 42-51 --json out.json

The pure pieces (``load_*``, ``inflate``, ``alloc_at``, ``make_variant``, ``run_trace``) take
and return plain data; only ``main`` touches files.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import numpy as np

from fleetpilot.policy import BUILTIN_POLICIES, ClusterState, Policy, TaskRequest, build_policy, typical_tasks
from fleetpilot.policy.state import MILLI

from .outputs import check_writable

INFLATION = 1.3
"""Arrived workload at the end of a run, as a multiple of the cluster's GPU capacity."""
REPORT_POINTS: tuple[int, ...] = (90, 100, 110, 130)
"""Arrived percentages reported in the table (the paper's columns)."""
TRACES: dict[str, str] = {"default": "openb_pod_list_default.csv", "gpuspec20": "openb_pod_list_gpuspec20.csv"}
NODES_FILE = "openb_node_list_gpu_node.csv"
PAPER_FILE = "paper_alloc.csv"
VARIANTS: tuple[str, ...] = ("spec-tight", "spec-loose", "multigpu", "gpushare", "multigpu-heavy", "cpu-heavy")
"""Synthetic held-out trace variants ``make_variant`` can build."""


# ---- plain data ------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeRow:
    """One row of the node list."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


def parse_nodes(rows: Iterable[dict[str, str]]) -> list[NodeRow]:
    """Node rows from CSV dicts (``sn, cpu_milli, memory_mib, gpu, model``)."""
    return [NodeRow(r["sn"], int(r["cpu_milli"]), int(r["memory_mib"]), int(r["gpu"]), r["model"].strip())
            for r in rows]


def parse_pods(rows: Iterable[dict[str, str]]) -> list[TaskRequest]:
    """Tasks from CSV dicts (``name, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec``)."""
    out = []
    for r in rows:
        gpus = int(r["num_gpu"])
        milli = int(r["gpu_milli"]) if gpus > 0 else 0
        spec = tuple(sorted({m for m in (r.get("gpu_spec") or "").split("|") if m}))
        out.append(TaskRequest(task_id=r["name"], gpus=gpus if milli > 0 else 0, gpu_milli=milli,
                               cpu_milli=int(r["cpu_milli"]), memory_mb=int(r["memory_mib"]),
                               gpu_models=spec))
    return out


def cluster_of(nodes: Sequence[NodeRow]) -> ClusterState:
    """An empty cluster from node rows."""
    return ClusterState.build(names=[n.name for n in nodes], cpu_milli=[n.cpu_milli for n in nodes],
                              memory_mb=[n.memory_mib for n in nodes], gpus=[n.gpus for n in nodes],
                              models=[n.model for n in nodes])


def inflate(tasks: Sequence[TaskRequest], seed: int, capacity_milli: int, ratio: float = INFLATION) -> list[TaskRequest]:
    """Shuffle with ``seed``, then append uniform random copies (with replacement) while the
    total requested milli-GPU is below ``ratio * capacity_milli``. Copies get ``#k`` ids."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(tasks))
    out = [tasks[i] for i in order]
    total = sum(t.total_milli for t in out)
    target = ratio * capacity_milli
    k = 0
    while total < target and tasks:
        src = tasks[int(rng.integers(len(tasks)))]
        k += 1
        out.append(TaskRequest(task_id=f"{src.task_id}#{k}", gpus=src.gpus, gpu_milli=src.gpu_milli,
                               cpu_milli=src.cpu_milli, memory_mb=src.memory_mb, gpu_models=src.gpu_models))
        total += src.total_milli
    return out


def alloc_at(arrived_pct: np.ndarray, alloc_pct: np.ndarray, points: Iterable[int]) -> dict[int, float]:
    """Mean allocation over the tasks whose arrived percentage rounds (half up) to each point;
    NaN where no task's arrived percentage rounds there."""
    rounded = np.floor(np.asarray(arrived_pct) + 0.5).astype(np.int64)
    out = {}
    for x in points:
        sel = rounded == x
        out[int(x)] = float(np.mean(np.asarray(alloc_pct)[sel])) if sel.any() else math.nan
    return out


@dataclass(frozen=True)
class PlacementRecord:
    """One placed task: where it went and what it holds (for independent checking)."""

    index: int
    pod: str
    node: str
    gpus: tuple[int, ...]
    milli: int


@dataclass
class OpenbResult:
    """One run: the curve (per task), alloc at the report points, failures and placements."""

    policy: str
    seed: int
    trace: str
    arrived_pct: np.ndarray
    alloc_pct: np.ndarray
    points: dict[int, float]
    tasks: int
    failed: int
    seconds: float
    placements: list[PlacementRecord] = field(default_factory=list)

    def curve(self, upto: int = 130) -> dict[int, float]:
        """Alloc at every integer arrived percentage 0..upto (NaN where none)."""
        return alloc_at(self.arrived_pct, self.alloc_pct, range(upto + 1))


def policy_for(name: str, seed: int, tasks: Sequence[TaskRequest]) -> Policy:
    """A built-in policy for a run: ties broken by ``seed``; fgd / fleetpilot get the typical
    tasks of the trace they are given (what the policy has seen); fleetpilot also gets every
    shape seen as the demand its pressure term prices capacity with."""
    typical = typical_tasks(tasks) if name in ("fgd", "fleetpilot") else None
    if name == "fleetpilot":
        return build_policy(name, seed=seed, typical=typical, no_fit_action="reject",
                            demand=typical_tasks(tasks, coverage=1.0))
    return build_policy(name, seed=seed, typical=typical, no_fit_action="reject")


def run_trace(nodes: Sequence[NodeRow], tasks: Sequence[TaskRequest], policy: Policy | str, seed: int,
              *, trace: str = "", keep_placements: bool = False) -> OpenbResult:
    """Run one seed of the protocol on parsed data (pure: no files)."""
    state = cluster_of(nodes)
    capacity = int(state.gpu_exists.sum()) * MILLI
    workload = inflate(tasks, seed, capacity)
    pol = policy_for(policy, seed, tasks) if isinstance(policy, str) else policy
    arrived = np.empty(len(workload))
    alloc = np.empty(len(workload))
    placed = requested = failed = 0
    records: list[PlacementRecord] = []
    t0 = time.perf_counter()
    for i, task in enumerate(workload):
        requested += task.total_milli
        d = pol.decide(state, task)
        if d.action == "assign":
            row = d.node_row
            gpus = [p.gpu for p in d.placement if p.gpu >= 0]
            milli = d.placement[0].milli if gpus else 0
            state.allocate(row, gpus, milli, cpu_milli=task.cpu_milli, memory_mb=task.memory_mb)
            placed += task.total_milli
            if keep_placements:
                records.append(PlacementRecord(i, task.task_id, state.node_names[row], tuple(gpus), milli))
        else:
            failed += 1
        arrived[i] = 100.0 * requested / capacity
        alloc[i] = 100.0 * placed / capacity
    seconds = time.perf_counter() - t0
    return OpenbResult(policy=pol.name, seed=seed, trace=trace, arrived_pct=arrived, alloc_pct=alloc,
                       points=alloc_at(arrived, alloc, REPORT_POINTS), tasks=len(workload), failed=failed,
                       seconds=seconds, placements=records)


def run_openb(nodes_csv: Path | str, pods_csv: Path | str, policy: Policy | str, seed: int, *,
              keep_placements: bool = False) -> OpenbResult:
    """One seed of the protocol from the CSV files (the only function here besides ``main``
    that reads files); the trace is named after the pod file (``default``, ``gpuspec20``)."""
    nodes = parse_nodes(_read_csv(Path(nodes_csv)))
    tasks = parse_pods(_read_csv(Path(pods_csv)))
    trace = Path(pods_csv).stem.replace("openb_pod_list_", "")
    return run_trace(nodes, tasks, policy, seed, trace=trace, keep_placements=keep_placements)


def make_variant(tasks: Sequence[TaskRequest], variant: str, seed: int) -> list[TaskRequest]:
    """A synthetic held-out variant of a trace, generated with ``seed`` from the original.

    * ``spec-tight``: twice as many GPU tasks carry a model constraint (new ones drawn from
      the trace's own constraints, or from single models weighted by the fleet's mix of
      constraints when the trace has none);
    * ``spec-loose``: half of the constrained tasks lose their constraint;
    * ``multigpu``: 20% of whole single-GPU tasks ask for 2, 4 or 8 GPUs instead;
    * ``gpushare``: 30% of whole single-GPU tasks become sharing tasks, with milli drawn from
      the trace's sharing tasks;
    * ``multigpu-heavy``: 40% of whole single-GPU tasks ask for 2, 4 or 8 GPUs (more of them
      8) with CPU and memory scaled by the GPU count (capped at the trace's largest task);
    * ``cpu-heavy``: every GPU task asks 1.5x its CPU (capped at the trace's largest ask).
    """
    rng = np.random.default_rng(seed)
    out = list(tasks)
    gpu_idx = [i for i, t in enumerate(out) if t.gpus > 0]
    specs = [t.gpu_models for t in out if t.gpu_models and t.gpus > 0]

    def replace(i: int, **kw: object) -> None:
        t = out[i]
        fields = {"task_id": t.task_id, "gpus": t.gpus, "gpu_milli": t.gpu_milli, "cpu_milli": t.cpu_milli,
                  "memory_mb": t.memory_mb, "gpu_models": t.gpu_models}
        fields.update(kw)
        out[i] = TaskRequest(**fields)  # type: ignore[arg-type]

    if variant == "spec-tight":
        free = [i for i in gpu_idx if not out[i].gpu_models]
        n_new = max(len(specs), len(gpu_idx) // 5)
        pool = specs or [("T4",), ("P100",), ("V100M16", "V100M32"), ("G3",)]
        for i in rng.choice(free, size=min(n_new, len(free)), replace=False):
            replace(int(i), gpu_models=tuple(pool[int(rng.integers(len(pool)))]))
    elif variant == "spec-loose":
        cons = [i for i in gpu_idx if out[i].gpu_models]
        for i in rng.choice(cons, size=len(cons) // 2, replace=False) if cons else []:
            replace(int(i), gpu_models=())
    elif variant == "multigpu":
        whole = [i for i in gpu_idx if out[i].gpus == 1 and out[i].gpu_milli == MILLI]
        for i in rng.choice(whole, size=len(whole) // 5, replace=False):
            replace(int(i), gpus=int(rng.choice([2, 4, 8], p=[0.5, 0.3, 0.2])))
    elif variant == "gpushare":
        whole = [i for i in gpu_idx if out[i].gpus == 1 and out[i].gpu_milli == MILLI]
        shares = [t.gpu_milli for t in out if t.shares_gpu] or [500]
        for i in rng.choice(whole, size=(len(whole) * 3) // 10, replace=False):
            replace(int(i), gpu_milli=int(shares[int(rng.integers(len(shares)))]))
    elif variant == "multigpu-heavy":
        whole = [i for i in gpu_idx if out[i].gpus == 1 and out[i].gpu_milli == MILLI]
        cpu_cap = max((t.cpu_milli for t in out), default=0)
        mem_cap = max((t.memory_mb for t in out), default=0)
        for i in rng.choice(whole, size=(len(whole) * 2) // 5, replace=False):
            n = int(rng.choice([2, 4, 8], p=[0.4, 0.3, 0.3]))
            t = out[int(i)]
            replace(int(i), gpus=n, cpu_milli=min(t.cpu_milli * n, cpu_cap), memory_mb=min(t.memory_mb * n, mem_cap))
    elif variant == "cpu-heavy":
        cpu_cap = max((t.cpu_milli for t in out), default=0)
        for i in gpu_idx:
            replace(i, cpu_milli=min((out[i].cpu_milli * 3) // 2, cpu_cap))
    else:
        raise ValueError(f"unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
    return out


# ---- paper figures ---------------------------------------------------------------------


def paper_means(rows: Iterable[dict[str, str]], seeds: Sequence[int]) -> dict[tuple[str, str], dict[int, float]]:
    """Mean of the paper's alloc at each report point per (trace, policy) over ``seeds``."""
    acc: dict[tuple[str, str], list[list[float]]] = {}
    for r in rows:
        if int(r["seed"]) not in seeds:
            continue
        acc.setdefault((r["trace"], r["policy"]), []).append([float(r[f"alloc_at_{x}"]) for x in REPORT_POINTS])
    return {k: dict(zip(REPORT_POINTS, np.mean(v, axis=0).tolist(), strict=True)) for k, v in acc.items()}


# ---- command line ----------------------------------------------------------------------


def find_data_dir(start: Path | None = None) -> Path | None:
    """``$FLEETPILOT_DATA`` (the openb folder or a folder holding ``openb/``), else the first
    ``shared/data/openb`` found walking up from ``start`` (default: the working directory)."""
    env = os.environ.get("FLEETPILOT_DATA")
    if env:
        p = Path(env)
        for cand in (p, p / "openb", p / "data" / "openb"):
            if (cand / NODES_FILE).is_file():
                return cand
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        for cand in (d / "shared" / "data" / "openb", d / "data" / "openb"):
            if (cand / NODES_FILE).is_file():
                return cand
    return None


def parse_seeds(text: str) -> list[int]:
    """``42-51`` or ``42,45,47`` (or a mix) to a list of seeds."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part[1:]:
                lo, hi = part.split("-", 1)
                if int(hi) < int(lo):
                    raise ValueError
                seeds.extend(range(int(lo), int(hi) + 1))
            elif part:
                seeds.append(int(part))
    except ValueError:
        raise SystemExit(f"openb: bad --seeds {text!r} (use e.g. 42-51 or 42,43)") from None
    if not seeds:
        raise SystemExit("openb: --seeds is empty")
    return seeds


def _read_csv(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as fh:
            return list(csv.DictReader(fh))
    except OSError as exc:
        raise SystemExit(f"openb: cannot read {path}: {exc.strerror}") from None


def _job(args: tuple[list[NodeRow], list[TaskRequest], str, int, str, bool]) -> OpenbResult:
    nodes, tasks, policy, seed, trace, keep = args
    return run_trace(nodes, tasks, policy, seed, trace=trace, keep_placements=keep)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (``SystemExit``), not usage text."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        """Exit with ``openb: <message>``."""
        raise SystemExit(f"openb: {message}")


def build_parser() -> argparse.ArgumentParser:
    """The ``fleetpilot bench openb`` argument parser."""
    p = _Parser(prog="fleetpilot bench openb", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=Path, help="node list CSV (default: the shared openb one)")
    p.add_argument("--pods", type=Path, action="append",
                   help="pod list CSV; repeat for several (default: the default and gpuspec20 traces)")
    p.add_argument("--policy", default="all", help=f"comma-separated, or 'all' ({','.join(BUILTIN_POLICIES)})")
    p.add_argument("--seeds", default="42-51", help="e.g. 42-51 or 42,43")
    p.add_argument("--variant", default="", help=f"comma-separated synthetic variants of each trace ({','.join(VARIANTS)})")
    p.add_argument("--variant-seed", type=int, default=7, help="seed that generates the variants")
    p.add_argument("--jobs", type=int, default=1, help="processes over runs (the machine is shared: keep it low)")
    p.add_argument("--json", type=Path, help="write results (points and full curves) here")
    p.add_argument("--placements", type=Path, help="write every placement here (CSV)")
    p.add_argument("--plot", type=Path, help="write a PNG of the curves here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table; bad arguments exit with a one-line message."""
    args = build_parser().parse_args(argv)
    data = find_data_dir()
    nodes_path = args.nodes or (data / NODES_FILE if data else None)
    if nodes_path is None:
        raise SystemExit("openb: no --nodes given and no shared/data/openb found (set FLEETPILOT_DATA)")
    if args.pods:
        pod_paths = {p.stem.replace("openb_pod_list_", ""): p for p in args.pods}
    elif data:
        pod_paths = {k: data / v for k, v in TRACES.items()}
    else:
        raise SystemExit("openb: no --pods given and no shared/data/openb found (set FLEETPILOT_DATA)")
    policies = list(BUILTIN_POLICIES) if args.policy == "all" else [p.strip() for p in args.policy.split(",") if p.strip()]
    for p in policies:
        if p not in BUILTIN_POLICIES:
            raise SystemExit(f"openb: unknown policy {p!r} (known: {', '.join(BUILTIN_POLICIES)})")
    variants = [v.strip() for v in args.variant.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"openb: unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    seeds = parse_seeds(args.seeds)
    if args.jobs < 1:
        raise SystemExit("openb: --jobs must be at least 1")
    check_writable("openb", files=(args.json, args.placements, args.plot))
    try:
        nodes = parse_nodes(_read_csv(nodes_path))
        traces = {name: parse_pods(_read_csv(path)) for name, path in pod_paths.items()}
    except (KeyError, ValueError) as exc:
        raise SystemExit(f"openb: malformed CSV ({exc})") from None
    if variants:
        traces = {f"{name}+{v}": make_variant(tasks, v, args.variant_seed) for name, tasks in traces.items() for v in variants}
    paper_path = (nodes_path.parent / PAPER_FILE)
    paper = paper_means(_read_csv(paper_path), seeds) if paper_path.is_file() else {}

    keep = args.placements is not None
    jobs = [(nodes, tasks, p, s, name, keep) for name, tasks in traces.items() for p in policies for s in seeds]
    if args.jobs > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(args.jobs) as pool:
            results = pool.map(_job, jobs, chunksize=1)
    else:
        results = [_job(j) for j in jobs]

    summary = summarise(results)
    print(format_table(summary, paper))
    if args.json:
        payload = {
            "seeds": seeds,
            "summary": [{"trace": t, "policy": p, **{f"alloc_at_{x}": v for x, v in pts.items()},
                         "paper": paper.get((t, p), {})} for (t, p), pts in summary.items()],
            "runs": [{"trace": r.trace, "policy": r.policy, "seed": r.seed, "tasks": r.tasks, "failed": r.failed,
                      "seconds": round(r.seconds, 2), "points": r.points,
                      "curve": {x: round(v, 4) for x, v in r.curve().items() if not math.isnan(v)}}
                     for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=1))
    if keep:
        with args.placements.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["trace", "policy", "seed", "index", "pod", "node", "gpus", "milli_per_gpu"])
            for r in results:
                for pl in r.placements:
                    w.writerow([r.trace, r.policy, r.seed, pl.index, pl.pod, pl.node,
                                "|".join(map(str, pl.gpus)), pl.milli])
    if args.plot:
        plot_curves(results, args.plot)
    return 0


def summarise(results: Sequence[OpenbResult]) -> dict[tuple[str, str], dict[int, float]]:
    """Mean alloc at the report points per (trace, policy) over the runs' seeds."""
    acc: dict[tuple[str, str], list[list[float]]] = {}
    for r in results:
        acc.setdefault((r.trace, r.policy), []).append([r.points[x] for x in REPORT_POINTS])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a point no run reached stays NaN
        return {k: dict(zip(REPORT_POINTS, np.nanmean(v, axis=0).tolist(), strict=True)) for k, v in acc.items()}


def format_table(summary: dict[tuple[str, str], dict[int, float]], paper: dict[tuple[str, str], dict[int, float]]) -> str:
    """A text table: ours, the paper's figure and the difference at each report point."""
    head = f"{'trace':<22} {'policy':<12}" + "".join(f" {'@' + str(x) + '% ours/paper/diff':>24}" for x in REPORT_POINTS)
    lines = [head, "-" * len(head)]
    for (trace, policy), pts in sorted(summary.items()):
        cells = []
        for x in REPORT_POINTS:
            ref = paper.get((trace, policy), {}).get(x)
            if ref is None:
                cells.append(f" {pts[x]:>8.2f} {'-':>7} {'':>7}")
            else:
                cells.append(f" {pts[x]:>8.2f} {ref:>7.2f} {pts[x] - ref:>+7.2f}")
        lines.append(f"{trace:<22} {policy:<12}" + "".join(cells))
    return "\n".join(lines)


def plot_curves(results: Sequence[OpenbResult], path: Path) -> None:
    """PNG of mean allocation vs arrived workload per (trace, policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = sorted({r.trace for r in results})
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.5), squeeze=False)
    xs = np.arange(0, 131)
    for ax, trace in zip(axes[0], traces, strict=True):
        for policy in sorted({r.policy for r in results if r.trace == trace}):
            curves = [list(r.curve().values()) for r in results if r.trace == trace and r.policy == policy]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                mean = np.nanmean(np.asarray(curves, dtype=float), axis=0)
            ax.plot(xs, mean, label=policy)
        ax.plot(xs, np.minimum(xs, 100), color="grey", linestyle=":", linewidth=0.8)
        ax.set(title=f"openb {trace}", xlabel="arrived workload (% of GPU capacity)",
               ylabel="GPU allocation (%)", xlim=(60, 130), ylim=(60, 100))
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cli() -> None:
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)


RunFn = Callable[..., OpenbResult]

if __name__ == "__main__":
    _cli()
