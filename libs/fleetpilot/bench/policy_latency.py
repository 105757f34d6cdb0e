"""Decision latency of every built-in policy on the openb fleet (1,213 nodes, 6,212 GPUs).

The fleet is first filled to about 70% by placing the trace's tasks with bestfit (a realistic,
fragmented state), then each policy decides the same sample of tasks on that frozen state.
The baseline, measured in the same run on the same state and tasks, is a plain-Python loop
implementation of bestfit (node by node, GPU by GPU), i.e. what the vectorised code replaces.

    python -m fleetpilot.bench.policy_latency [--tasks 300] [--fill 0.7]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from fleetpilot.policy import BUILTIN_POLICIES, ClusterState, TaskRequest, build_policy, typical_tasks
from fleetpilot.policy.state import MILLI

from .openb import NODES_FILE, TRACES, cluster_of, find_data_dir, parse_nodes, parse_pods


def loop_bestfit(state: ClusterState, task: TaskRequest) -> tuple[int, int]:
    """Reference bestfit in plain Python: returns (node row, GPU) or (-1, -1)."""
    models = set(task.gpu_models)
    best, best_row, best_gpu = -1.0, -1, -1
    for i in range(state.n_nodes):
        if state.cpu_free[i] < task.cpu_milli or state.mem_free[i] < task.memory_mb:
            continue
        if models and state.models[state.node_model[i]] not in models:
            continue
        free = [int(state.gpu_free[i, j]) for j in range(state.max_gpus) if state.gpu_exists[i, j]]
        gpu = -1
        if task.shares_gpu:
            fits = [(f, j) for j, f in enumerate(free) if f >= task.gpu_milli]
            if not fits:
                continue
            gpu = min(fits)[1]
        elif task.gpus > 0:
            whole = [j for j, f in enumerate(free) if f >= MILLI]
            if len(whole) < task.gpus:
                continue
            gpu = whole[0]
        x = (int(state.cpu_free[i]) - task.cpu_milli) / 128000 * 0.5 + (sum(free) - task.total_milli) / 8000 * 0.5
        score = int((1 - x) * 100)
        if score > best:
            best, best_row, best_gpu = score, i, gpu
    return best_row, best_gpu


def filled_state(nodes_csv: Path, pods_csv: Path, fill: float, seed: int = 42) -> tuple[ClusterState, list[TaskRequest]]:
    """The openb fleet filled to ``fill`` of its GPU capacity with bestfit, and the tasks."""
    with nodes_csv.open(newline="") as fh:
        state = cluster_of(parse_nodes(csv.DictReader(fh)))
    with pods_csv.open(newline="") as fh:
        tasks = parse_pods(csv.DictReader(fh))
    policy = build_policy("bestfit", seed=seed)
    capacity = int(state.gpu_exists.sum()) * MILLI
    placed = 0
    order = np.random.default_rng(seed).permutation(len(tasks))
    for k in order:
        if placed >= fill * capacity:
            break
        d = policy.decide(state, tasks[k])
        if d.action == "assign":
            gpus = [p.gpu for p in d.placement if p.gpu >= 0]
            state.allocate(d.node_row, gpus, d.placement[0].milli if gpus else 0,
                           cpu_milli=tasks[k].cpu_milli, memory_mb=tasks[k].memory_mb)
            placed += tasks[k].total_milli
    return state, tasks


def time_calls(fn: Callable[[ClusterState, TaskRequest], object], state: ClusterState,
               tasks: Sequence[TaskRequest]) -> list[float]:
    """Wall time in milliseconds of ``fn(state, task)`` for each task (one warm-up call first)."""
    fn(state, tasks[0])
    out = []
    for t in tasks:
        t0 = time.perf_counter()
        fn(state, t)
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print median / p95 latency per policy and the ratio to the plain-Python baseline."""
    p = argparse.ArgumentParser(prog="fleetpilot bench policy-latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=300, help="decisions timed per policy")
    p.add_argument("--fill", type=float, default=0.7, help="fleet GPU fill before timing (0..1)")
    p.add_argument("--trace", default="gpuspec20", choices=sorted(TRACES))
    args = p.parse_args(argv)
    if args.tasks < 1 or not 0.0 <= args.fill < 1.0:
        raise SystemExit("policy-latency: --tasks must be >= 1 and --fill in [0, 1)")
    data = find_data_dir()
    if data is None:
        raise SystemExit("policy-latency: no shared/data/openb found (set FLEETPILOT_DATA)")
    state, tasks = filled_state(data / NODES_FILE, data / TRACES[args.trace], args.fill)
    rng = np.random.default_rng(0)
    sample = [tasks[int(i)] for i in rng.choice(len(tasks), size=args.tasks, replace=True)]
    typical = typical_tasks(tasks)
    base = time_calls(loop_bestfit, state, sample)
    base_med = statistics.median(base)
    print(f"openb fleet: {state.n_nodes} nodes, {int(state.gpu_exists.sum())} GPUs, "
          f"{100 * (1 - state.gpu_free.sum() / (state.gpu_exists.sum() * MILLI)):.0f}% allocated; "
          f"{args.tasks} decisions each, one core")
    print(f"{'policy':<22}{'median ms':>10}{'p95 ms':>10}{'vs baseline':>13}")
    rows = [("baseline (python loop)", base)]
    for name in BUILTIN_POLICIES:
        pol = build_policy(name, seed=42, typical=typical)
        rows.append((name, time_calls(pol.decide, state, sample)))
    for name, ms in rows:
        med = statistics.median(ms)
        p95 = float(np.percentile(ms, 95))
        print(f"{name:<22}{med:>10.3f}{p95:>10.3f}{base_med / med:>12.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
