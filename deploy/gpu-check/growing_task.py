"""A real CUDA task for the node check: it grows its GPU memory in steps and keeps the GPU busy.

Every ``--step-s`` seconds it takes another ``--step-gb`` GiB (up to ``--grow-gb``), runs
matrix products in between so that the GPU's utilisation is real, prints one JSON line
per step with what PyTorch itself holds (``memory_reserved``), then holds its memory
until ``--hold-s`` passes (after ``--pcie-s`` seconds of host-to-GPU copies, if asked) or it receives SIGTERM (an eviction), and exits 0 either way.
``--oom`` instead asks for more memory than the GPU has at once: PyTorch raises
``OutOfMemoryError``, which the process backend reports as ``oom_killed``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import torch

GIB = 1 << 30


def main() -> int:
    """Grow, hold, exit; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grow-gb", type=int, default=16)
    parser.add_argument("--step-gb", type=int, default=1)
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--hold-s", type=float, default=60.0)
    parser.add_argument("--pcie-s", type=float, default=0.0, help="seconds of pinned host-to-GPU copies")
    parser.add_argument("--oom", action="store_true")
    args = parser.parse_args()

    stop = {"asked": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(asked=True))
    device = torch.device("cuda")
    if args.oom:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.empty(total + GIB, dtype=torch.uint8, device=device)  # raises OutOfMemoryError
        return 0

    a = torch.randn(4096, 4096, device=device)
    blocks: list[torch.Tensor] = []

    def busy(seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until and not stop["asked"]:
            (a @ a).sum().item()

    while len(blocks) * args.step_gb < args.grow_gb and not stop["asked"]:
        blocks.append(torch.ones(args.step_gb * GIB, dtype=torch.uint8, device=device))
        print(json.dumps({"t": time.time(), "blocks": len(blocks),
                          "reserved_mb": torch.cuda.memory_reserved(device) / (1 << 20)}), flush=True)
        busy(args.step_s)
    if args.pcie_s > 0 and not stop["asked"]:
        host = torch.ones(blocks[-1].numel(), dtype=torch.uint8).pin_memory()
        target = blocks[-1]  # an existing block, so the copies leave the memory curve as it was
        began, copied = time.time(), 0
        while time.time() - began < args.pcie_s and not stop["asked"]:
            target.copy_(host)
            torch.cuda.synchronize(device)
            copied += GIB
        ended = time.time()
        print(json.dumps({"pcie_from": began, "pcie_to": ended,
                          "pcie_copy_mb_per_s": copied / (1 << 20) / (ended - began)}), flush=True)
    busy(args.hold_s)
    print(json.dumps({"t": time.time(), "stopped_by_signal": stop["asked"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
