"""How the executor's bookkeeping of each GPU sample grows with the fleet it covers.

An executor that covers many nodes (the one ``fleetpilot up`` runs for a simulated fleet, or
any executor run without ``FLEETPILOT_EXECUTOR_NODE``) hears every node's
``telemetry.gpu.<node>`` and feeds each GPU's sample to its health windows
(``HealthWindows.add``) and its pre-decommission hook (``PreDecommissionHook.observe``).
This times those two per sample, over the same number of one-second rounds, on the openb
fleet (6,212 GPUs; a synthetic fleet of its size without the node list) and, in the same
run, on the three-site fleet (112 GPUs), the baseline: the ratio of the costs per sample
says how much more a sample costs on the larger fleet. Each sample's board was once found
by scanning every GPU the executor knew (in the windows and in the hook): at c3bc2e2 an openb
sample cost 673 µs against a three-site one's 11 µs (ratio 59), 4.2 s of CPU for each second
of the openb fleet's telemetry, and ``fleetpilot up --fleet <openb>``'s executor fell behind
(the NATS server cut it off as a slow consumer, and most decisions were never carried out).

Run: ``python -m fleetpilot.bench.executor_telemetry [--rounds N] [--csv PATH]``. Prints::

    executor telemetry: X µs per GPU sample on the openb fleet (6212 GPUs), Y µs on three-site (112 GPUs): ratio X/Y
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from fleetpilot.contracts import GpuSample
from fleetpilot.executor import PreDecommissionHook
from fleetpilot.executor.locks import InMemoryHookLock
from fleetpilot.fleet.inventory import Fleet, load_fleet_spec
from fleetpilot.maintenance.faults import gpu_reading
from fleetpilot.maintenance.windows import HealthWindows

from .sim_tick import openb_or_synthetic

WINDOW_S = 7200.0
SAMPLE_EVERY_S = 30.0
"""The executor's defaults (``FLEETPILOT_EXECUTOR_HEALTH_WINDOW_S`` / ``_SAMPLE_EVERY_S``)."""


def rounds_of(fleet: Fleet, rounds: int) -> list[list[GpuSample]]:
    """``rounds`` one-second rounds of every GPU's reading, as the collectors send them."""
    gpus = [(node.node, gpu.index) for node in fleet.nodes for gpu in node.gpus]
    return [[gpu_reading(node, index, 1_000_000.0 + second) for node, index in gpus] for second in range(rounds)]


async def _feed(rounds: list[list[GpuSample]]) -> float:
    """Seconds to feed every sample of ``rounds`` to fresh windows and a fresh hook."""
    windows = HealthWindows(WINDOW_S, SAMPLE_EVERY_S)
    hook = PreDecommissionHook("bench", InMemoryHookLock())
    began = time.perf_counter()
    for samples in rounds:
        for sample in samples:
            windows.add(sample)
            await hook.observe(sample, ())
    return time.perf_counter() - began


def measure(large: Fleet, small: Fleet, rounds: int = 5) -> dict[str, float]:
    """Microseconds per sample on ``large`` and on ``small`` (the baseline), and their ratio.
    The small fleet is fed as many samples as the large one: more rounds of its own."""
    gpus = {name: sum(len(node.gpus) for node in fleet.nodes) for name, fleet in (("large", large), ("small", small))}
    out: dict[str, float] = {}
    for name, fleet in (("large", large), ("small", small)):
        samples = rounds_of(fleet, rounds * max(1, round(gpus["large"] / gpus[name])))
        seconds = min(asyncio.run(_feed(samples)) for _ in range(3))
        out[f"{name}_us"] = seconds / sum(len(r) for r in samples) * 1e6
        out[f"{name}_gpus"] = float(gpus[name])
    out["ratio"] = out["large_us"] / out["small_us"]
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark and print the figure; returns the measurements."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=None,
                        help="openb node list (default: found as the other benchmarks find the openb data)")
    parser.add_argument("--rounds", type=int, default=5, help="one-second rounds of every GPU's reading (default 5)")
    args = parser.parse_args(argv)
    large, name = openb_or_synthetic(args.csv)
    result = measure(large, load_fleet_spec(), rounds=args.rounds)
    print(f"executor telemetry: {result['large_us']:.1f} µs per GPU sample on the {name} ({int(result['large_gpus'])} "
          f"GPUs), {result['small_us']:.1f} µs on three-site ({int(result['small_gpus'])} GPUs): "
          f"ratio {result['ratio']:.2f}")
    return result


if __name__ == "__main__":
    main()
