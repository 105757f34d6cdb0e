"""``fleetpilot topology FILE``: a saved ``nvidia-smi topo -m`` output as a JSON graph.

Prints the node's GPUs (NUMA node, CPU affinity), every pairwise link with its reported
and effective kind and cost (the PHB-across-NUMA correction applied), the NICs with their
closest GPUs, the GPU cost matrix and the co-location domains: ``render_nvidia_smi`` in
``fleetpilot.fleet.topology``. ``FILE`` may be ``-`` for standard input, so
``nvidia-smi topo -m | fleetpilot topology -`` works on a GPU node.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fleetpilot.fleet.topology import render_nvidia_smi

from .arguments import path_text


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot topology``."""
    parser.add_argument("file", type=path_text, help="saved output of `nvidia-smi topo -m` (- for stdin)")
    parser.add_argument("--node", default="local", help="node name to put in the graph")
    parser.add_argument("--site", default="default", help="site name to put in the graph")
    parser.add_argument("--compact", action="store_true", help="one line of JSON instead of indented")


def read_text(path: str) -> str:
    """The file's text (or stdin's for ``-``); undecodable bytes or a directory are a one-line
    ``ValueError`` that ``main`` prefixes with the path."""
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text()
    except UnicodeDecodeError:
        raise ValueError("not a text file") from None
    except IsADirectoryError:
        raise ValueError("is a directory") from None


def main(args, out=None) -> int:
    """Parse, render, print; a parse error names the file and the line."""
    out = out or sys.stdout
    try:
        graph = render_nvidia_smi(read_text(args.file), args.node, site=args.site)
    except ValueError as exc:  # TopoParseError is one: "line N: reason"
        raise ValueError(f"{args.file}: {exc}") from None
    print(json.dumps(graph, indent=None if args.compact else 2), file=out)
    return 0
