"""How fast the simulated fleet advances: one virtual second of the openb fleet.

Loads the openb node list (6,212 GPUs; a synthetic fleet of the same size when the CSV is
not there), places one task per GPU plus a co-located sharer on every fourth GPU, then
times ``SimulatedFleet.advance(1.0)``. The baseline, measured in the same run over the
same placements, is the naive way: a Python loop over every GPU that evaluates each
task's ``MemoryGrowth`` and updates utilisation, power and temperature one GPU at a time.

Run: ``python -m fleetpilot.bench.sim_tick [--ticks N] [--csv PATH]``. Prints::

    sim tick openb fleet: X ms per virtual second (baseline python loop: Y ms, ratio Y/X)
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleetpilot.fleet.catalogue import gpu_model
from fleetpilot.fleet.inventory import Fleet, build_fleet, load_openb_fleet
from fleetpilot.fleet.simulator import CONTEXT_MB, THERMAL_RISE_C, THERMAL_TAU_S, SimulatedFleet
from fleetpilot.workload.growth import MemoryGrowth, random_growth

from .openb import NODES_FILE, find_data_dir


@dataclass
class _LoopGpu:
    total_mb: float
    tdp_w: float
    idle_w: float
    temperature_c: float
    tasks: list[tuple[MemoryGrowth, float, float]]  # (growth, start_s, util)
    used_mb: float = 0.0
    util: float = 0.0
    power_w: float = 0.0


def synthetic_openb_fleet() -> Fleet:
    """A fleet of openb's GPU count (6,212), for when the trace is not available."""
    return build_fleet({"sites": [{"name": "openb", "groups": [
        {"prefix": "g2-", "count": 776, "shape": {"gpu_model": "G2", "gpus": 8}},
        {"prefix": "t4-", "count": 2, "shape": {"gpu_model": "T4", "gpus": 2}},
    ]}]})


def openb_or_synthetic(csv: Path | None) -> tuple[Fleet, str]:
    """The openb fleet from ``csv`` (default: found as the other benchmarks find the openb
    data), or one of its size when there is no node list; and what to call it."""
    data = find_data_dir() if csv is None else None
    csv = csv or (data / NODES_FILE if data else None)
    if csv is not None and csv.exists():
        return load_openb_fleet(csv), "openb fleet"
    return synthetic_openb_fleet(), "synthetic fleet of openb's size (no openb node list found)"


def populate(sim: SimulatedFleet, seed: int = 0) -> list[_LoopGpu]:
    """Place the benchmark workload on ``sim`` and return the same state for the loop baseline."""
    rng = np.random.default_rng(seed)
    loop: list[_LoopGpu] = []
    k = 0
    for node in sim.fleet.nodes:
        for info in node.gpus:
            model = gpu_model(info.model)
            state = _LoopGpu(total_mb=float(info.memory_mb), tdp_w=model.tdp_w, idle_w=model.idle_w,
                             temperature_c=sim.gpu.ambient_c + THERMAL_RISE_C * 0.1, tasks=[])
            sharers = 2 if len(loop) % 4 == 0 else 1
            for _ in range(sharers):
                growth = random_growth(rng, peak_mb=0.35 * info.memory_mb, duration_s=1e6)
                util = float(rng.uniform(20, 60))
                sim.place(f"task-{k}", node.node, [info.index], growth, util=util)
                state.tasks.append((growth, 0.0, util))
                k += 1
            loop.append(state)
    return loop


def python_loop_tick(gpus: list[_LoopGpu], now_s: float, dt_s: float) -> None:
    """The baseline: one GPU at a time, one task at a time, in plain Python."""
    decay = math.exp(-dt_s / THERMAL_TAU_S)
    for g in gpus:
        used = 0.0
        demand = 0.0
        for growth, start, util in g.tasks:
            used += float(growth.memory_at(now_s - start)) + CONTEXT_MB
            demand += util
        g.used_mb = used
        g.util = min(demand, 100.0)
        g.power_w = g.idle_w + (g.tdp_w - g.idle_w) * g.util / 100.0
        target = 28.0 + THERMAL_RISE_C * g.power_w / g.tdp_w
        g.temperature_c = target + (g.temperature_c - target) * decay


def measure(fleet: Fleet, ticks: int = 20, baseline_ticks: int = 2, seed: int = 0) -> dict[str, float]:
    """Median ms per virtual second for the simulator and the loop baseline, and their ratio."""
    sim = SimulatedFleet(fleet, seed=seed, start_at=0.0)
    loop = populate(sim, seed)
    sim.advance(1.0)  # first tick builds the task arrays; not part of the steady state
    sim_ms = []
    for _ in range(ticks):
        began = time.perf_counter()
        sim.advance(1.0)
        sim_ms.append((time.perf_counter() - began) * 1000)
    loop_ms = []
    for t in range(baseline_ticks):
        began = time.perf_counter()
        python_loop_tick(loop, float(t + 1), 1.0)
        loop_ms.append((time.perf_counter() - began) * 1000)
    x, y = statistics.median(sim_ms), statistics.median(loop_ms)
    return {"gpus": float(fleet.gpu_count), "tasks": float(len(sim.running())), "sim_ms": x, "baseline_ms": y,
            "ratio": y / x}


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark and print the figure; returns the measurements."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=None,
                        help="openb node list (default: found as the other benchmarks find the openb data)")
    parser.add_argument("--ticks", type=int, default=20)
    parser.add_argument("--baseline-ticks", type=int, default=2)
    args = parser.parse_args(argv)
    fleet, name = openb_or_synthetic(args.csv)
    result = measure(fleet, ticks=args.ticks, baseline_ticks=args.baseline_ticks)
    print(f"sim tick {name}: {result['sim_ms']:.2f} ms per virtual second "
          f"(baseline python loop: {result['baseline_ms']:.1f} ms, ratio {result['ratio']:.0f}x) "
          f"[{int(result['gpus'])} GPUs, {int(result['tasks'])} tasks]")
    return result


if __name__ == "__main__":
    main()
