"""What a topology change costs the policy's view of the fleet, on the openb fleet.

The policy keeps its ``ClusterState`` and, for each topology key that changed (a label, a GPU
gone), redoes that node's row (``ClusterState.set_topology``) instead of building the view
from every node's record (``ClusterState.from_topology``), which it did until 691e2a7. This
times both on the openb fleet (1,213 nodes, 6,212 GPUs; a synthetic fleet of its size without
the node list): a row redone after one GPU's label changed, over many nodes, against a build
of the whole fleet in the same run, the baseline.

Run: ``python -m fleetpilot.bench.fleet_view [--changes N] [--csv PATH]``. Prints::

    fleet view: one node's row redone in X ms, the openb fleet built in Y ms: ratio X/Y
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import msgspec

from fleetpilot.contracts import NodeTopology
from fleetpilot.fleet.simulator import SimulatedFleet
from fleetpilot.policy import ClusterState

from .sim_tick import openb_or_synthetic

BUILDS = 5


def relabelled(node: NodeTopology, label: str, value: str) -> NodeTopology:
    """``node`` with ``label`` set to ``value`` on its first GPU."""
    first = node.gpus[0]
    return msgspec.structs.replace(node, gpus=[msgspec.structs.replace(first, labels={**first.labels, label: value}),
                                               *node.gpus[1:]])


def measure(nodes: list[NodeTopology], changes: int = 300, seed: int = 0) -> dict[str, float]:
    """Median milliseconds to redo one changed node's row, best of ``BUILDS`` to build the
    whole fleet, and their ratio."""
    builds = []
    for _ in range(BUILDS):
        began = time.perf_counter()
        state = ClusterState.from_topology(nodes)
        builds.append(time.perf_counter() - began)
    rng = random.Random(seed)
    gpus = [i for i, node in enumerate(nodes) if node.gpus]
    redone = []
    for change in range(changes):
        row = rng.choice(gpus)
        changed = relabelled(nodes[row], "cordoned", "true" if change % 2 == 0 else "false")
        began = time.perf_counter()
        if not state.set_topology(row, changed):
            raise RuntimeError(f"{changed.node}: its row could not be redone in place")
        redone.append(time.perf_counter() - began)
    out = {"row_ms": statistics.median(redone) * 1e3, "build_ms": min(builds) * 1e3, "nodes": float(len(nodes))}
    out["ratio"] = out["row_ms"] / out["build_ms"]
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark and print the figures; returns the measurements."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=None,
                        help="openb node list (default: found as the other benchmarks find the openb data)")
    parser.add_argument("--changes", type=int, default=300, help="label changes timed (default 300)")
    args = parser.parse_args(argv)
    if args.changes < 1:
        parser.error("--changes must be at least 1")
    fleet, name = openb_or_synthetic(args.csv)
    simulated = SimulatedFleet(fleet)
    result = measure([simulated.topology(node) for node in simulated.node_names()], args.changes)
    print(f"fleet view: one node's row redone in {result['row_ms']:.2f} ms, the {name} "
          f"({int(result['nodes'])} nodes) built in {result['build_ms']:.1f} ms: ratio {result['ratio']:.4f}")
    return result


if __name__ == "__main__":
    main()
