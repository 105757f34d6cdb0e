"""A node's device graph: pairwise costs, co-location domains and a JSON-ready rendering.

The graph is a ``contracts.topology.NodeTopology`` (GPUs with NUMA node and CPU
affinity, NICs, and ``Link``s between devices named ``GPU<i>`` / ``NIC<j>``). It is built
from ``nvidia-smi topo -m`` (``topology_from_matrix``), from NVML
(``nvml_reader.topology_from_nvml``) or from the simulator, and every consumer reads the
same type.

Costs are relative (lower is closer), ordered as ``nvidia-smi`` orders link kinds::

    X 0 < NV# 0.5 + 0.5/# < PIX 2 < PSB 2.5 < PXB 3 < PHB 4 < NODE 5 < SYS 8

The trap this module corrects: ``nvidia-smi`` inside many virtual machines (and on some
boards whose root ports hang off one host bridge in the firmware tables) prints ``PHB``,
``PXB`` or even ``PIX`` between GPUs that sit under different CPU sockets. Traffic between
them still crosses the socket interconnect, so whenever both ends have a known NUMA node
and the NUMA nodes differ, a PCIe kind is costed as ``SYS``. NVLink is exempt: it never
touches the CPU.
"""

from __future__ import annotations

import itertools
from typing import Any, Literal

import msgspec
import numpy as np

from fleetpilot.contracts.topology import GpuInfo, Link, LinkKind, NicInfo, NodeTopology

from .topo_parser import TopoMatrix, parse_topo_matrix

KIND_COST: dict[str, float] = {
    "X": 0.0,
    "NV": 0.5,
    "PIX": 2.0,
    "PSB": 2.5,
    "PXB": 3.0,
    "PHB": 4.0,
    "NODE": 5.0,
    "SYS": 8.0,
}
# Kinds that claim "below one host bridge": impossible across NUMA nodes. NODE is left
# alone because NPS2/NPS4 sockets legitimately span several NUMA nodes.
_PCIE_KINDS = frozenset({"PIX", "PSB", "PXB", "PHB"})

DomainKind = Literal["nvlink", "pcie_switch", "numa"]


def link_cost(kind: str, nvlinks: int = 0) -> float:
    """Relative cost of one link kind; more bonded NVLinks cost less."""
    if kind == "NV":
        return KIND_COST["NV"] + 0.5 / max(nvlinks, 1)
    return KIND_COST[kind]


def split_cell(cell: str) -> tuple[LinkKind, int]:
    """``"NV12"`` -> ``("NV", 12)``; ``"PHB"`` -> ``("PHB", 0)``; ``"SOC"`` -> ``("SYS", 0)``."""
    if cell.startswith("NV"):
        return "NV", int(cell[2:])
    if cell == "SOC":
        return "SYS", 0
    return cell, 0  # type: ignore[return-value]


def make_link(a: str, b: str, kind: LinkKind, nvlinks: int = 0) -> Link:
    """A ``Link`` with its cost filled from ``link_cost``."""
    return Link(a=a, b=b, kind=kind, nvlinks=nvlinks, cost=link_cost(kind, nvlinks))


class Domain(msgspec.Struct, frozen=True, kw_only=True):
    """A set of GPUs that are mutually close at one level (every pair within ``kind``)."""

    kind: DomainKind
    gpus: tuple[int, ...]


class CorrectedLink(msgspec.Struct, frozen=True, kw_only=True):
    """A link with the kind ``nvidia-smi`` reported and the kind its NUMA nodes imply."""

    a: str
    b: str
    reported: LinkKind
    kind: LinkKind
    nvlinks: int
    cost: float

    @property
    def corrected(self) -> bool:
        """True when the NUMA rule overrode the reported kind."""
        return self.reported != self.kind


def topology_problem(node: NodeTopology) -> str | None:
    """What makes a reported node unusable, or ``None``: no name, a GPU index below 0 or
    listed twice, negative memory, a link end ``GPU<i>`` that names no listed GPU or
    ``NIC<j>`` no listed NIC, a link's negative NVLink count or cost. Every consumer reads
    link ends as indices (``GPU3`` is the GPU of index 3): a report from a collector of
    one's own that breaks this would crash them, or cost the wrong GPUs."""
    if not node.node:
        return "the node has no name"
    indices = [g.index for g in node.gpus]
    if any(i < 0 for i in indices):
        return f"GPU index below 0: {sorted(i for i in indices if i < 0)}"
    if len(set(indices)) != len(indices):
        return f"GPU index listed twice: {sorted(i for i in set(indices) if indices.count(i) > 1)}"
    if any(g.memory_mb < 0 for g in node.gpus):
        return "a GPU with negative memory"
    ends = {f"GPU{i}" for i in indices} | {f"NIC{j}" for j in range(len(node.nics))}
    for link in node.links:
        for end in (link.a, link.b):
            if end.startswith(("GPU", "NIC")) and end not in ends:
                return f"link {link.a}-{link.b} names {end!r}, which the node does not list"
        if link.nvlinks < 0 or not link.cost >= 0:
            return f"link {link.a}-{link.b} has nvlinks {link.nvlinks} and cost {link.cost}"
    return None


def _numa_of(node: NodeTopology) -> dict[str, int | None]:
    numa: dict[str, int | None] = {f"GPU{g.index}": g.numa_node for g in node.gpus}
    for j, nic in enumerate(node.nics):
        numa[f"NIC{j}"] = nic.numa_node
    return numa


def corrected_links(node: NodeTopology) -> list[CorrectedLink]:
    """Every link of the node with the PCIe-across-NUMA trap corrected to ``SYS``."""
    numa = _numa_of(node)
    out: list[CorrectedLink] = []
    for link in node.links:
        kind = link.kind
        na, nb = numa.get(link.a), numa.get(link.b)
        if kind in _PCIE_KINDS and na is not None and nb is not None and na != nb:
            kind = "SYS"
        out.append(CorrectedLink(a=link.a, b=link.b, reported=link.kind, kind=kind,
                                 nvlinks=link.nvlinks, cost=link_cost(kind, link.nvlinks)))
    return out


def gpu_cost_matrix(node: NodeTopology) -> np.ndarray:
    """Symmetric GPU x GPU cost matrix (row/column ``i`` is ``node.gpus[i]``).

    A pair with no recorded link is costed by NUMA alone: ``NODE`` on the same NUMA node,
    ``SYS`` otherwise (the conservative reading of missing data).
    """
    pos = {f"GPU{g.index}": i for i, g in enumerate(node.gpus)}
    n = len(node.gpus)
    cost = np.full((n, n), np.nan)
    np.fill_diagonal(cost, 0.0)
    for link in corrected_links(node):
        if link.a in pos and link.b in pos and link.a != link.b:
            i, j = pos[link.a], pos[link.b]
            cost[i, j] = cost[j, i] = link.cost if np.isnan(cost[i, j]) else min(cost[i, j], link.cost)
    for i, j in zip(*np.where(np.isnan(cost)), strict=True):
        gi, gj = node.gpus[i], node.gpus[j]
        same = gi.numa_node is not None and gi.numa_node == gj.numa_node
        cost[i, j] = KIND_COST["NODE"] if same else KIND_COST["SYS"]
    return cost


def gpu_nic_costs(node: NodeTopology) -> dict[tuple[int, str], float]:
    """Cost from each GPU index to each NIC name (missing links costed ``SYS``)."""
    by_label = {f"NIC{j}": nic.name for j, nic in enumerate(node.nics)}
    out = {(g.index, nic.name): KIND_COST["SYS"] for g in node.gpus for nic in node.nics}
    for link in corrected_links(node):
        for gpu_end, nic_end in ((link.a, link.b), (link.b, link.a)):
            if gpu_end.startswith("GPU") and nic_end in by_label:
                out[(int(gpu_end[3:]), by_label[nic_end])] = link.cost
    return out


def _maximal_cliques(n: int, adjacent: np.ndarray) -> list[tuple[int, ...]]:
    # Bron-Kerbosch with pivoting; nodes have at most a few dozen GPUs, so this is instant.
    cliques: list[tuple[int, ...]] = []

    def expand(r: set[int], p: set[int], x: set[int]) -> None:
        if not p and not x:
            cliques.append(tuple(sorted(r)))
            return
        pivot = max(p | x, key=lambda v: int(adjacent[v][list(p)].sum()) if p else 0)
        for v in list(p - set(np.flatnonzero(adjacent[pivot]))):
            neighbours = set(np.flatnonzero(adjacent[v]))
            expand(r | {v}, p & neighbours, x & neighbours)
            p.discard(v)
            x.add(v)

    expand(set(), set(range(n)), set())
    return sorted(cliques)


def colocation_domains(node: NodeTopology) -> list[Domain]:
    """Sets of GPUs that are mutually close: NVLink cliques, PCIe-switch cliques, NUMA nodes.

    NVLink and PCIe-switch domains are maximal cliques (every pair linked at that level;
    a hybrid cube-mesh yields several overlapping NVLink domains). NUMA domains group GPUs
    by NUMA node; single-GPU NVLink/switch groups are omitted.
    """
    n = len(node.gpus)
    pos = {f"GPU{g.index}": i for i, g in enumerate(node.gpus)}
    domains: list[Domain] = []
    # Each level is judged on its own link kinds: NVLink pairs hide their PCIe path in
    # ``topo -m``, so a cost threshold would wrongly merge NVLink islands into switches.
    for kind, kinds in (("nvlink", {"NV"}), ("pcie_switch", {"PIX", "PSB"})):
        adjacent = np.zeros((n, n), dtype=bool)
        for link in corrected_links(node):
            if link.kind in kinds and link.a in pos and link.b in pos:
                adjacent[pos[link.a], pos[link.b]] = adjacent[pos[link.b], pos[link.a]] = True
        for clique in _maximal_cliques(n, adjacent):
            if len(clique) > 1:
                domains.append(Domain(kind=kind, gpus=tuple(node.gpus[i].index for i in clique)))  # type: ignore[arg-type]
    by_numa: dict[int, list[int]] = {}
    for g in node.gpus:
        if g.numa_node is not None:
            by_numa.setdefault(g.numa_node, []).append(g.index)
    domains.extend(Domain(kind="numa", gpus=tuple(gs)) for _, gs in sorted(by_numa.items()))
    return domains


def _cpu_set(affinity: str) -> set[int]:
    cpus: set[int] = set()
    for part in affinity.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.update(range(int(lo), int(hi) + 1))
        elif part.strip().isdigit():
            cpus.add(int(part))
    return cpus


def _socket_count(matrix: TopoMatrix, numa_of: dict[str, int | None]) -> int:
    # NUMA nodes joined by a NODE path share a socket (NPS4 EPYC boards show several NUMA
    # nodes per socket, linked by NODE); the components are the sockets. PHB and below are
    # not trusted across NUMA nodes (the trap in the module doc).
    parent = {n: n for n in numa_of.values() if n is not None}

    def root(n: int) -> int:
        while parent[n] != n:
            n = parent[n]
        return n

    for a, b in itertools.combinations(matrix.devices, 2):
        na, nb = numa_of.get(a), numa_of.get(b)
        if na is not None and nb is not None and split_cell(matrix.cell(a, b))[0] == "NODE":
            parent[root(na)] = root(nb)
    return max(len({root(n) for n in parent}), 1)


def topology_from_matrix(matrix: TopoMatrix, node: str, *, site: str = "default", gpu_model: str = "",
                         labels: dict[str, str] | None = None) -> NodeTopology:
    """Build a ``NodeTopology`` from a parsed ``nvidia-smi topo -m`` matrix.

    A NIC's NUMA node is taken from the closest GPU (NIC rows carry no affinity columns);
    sockets are the groups of NUMA nodes joined by ``NODE`` paths (a ``PHB`` or closer
    kind across NUMA nodes is the trap in the module doc, not a shared socket);
    ``cpu_milli`` counts the CPUs named in GPU affinities (a lower bound).
    """
    gpus = [
        GpuInfo(index=int(name[3:]), model=gpu_model, numa_node=matrix.numa_affinity.get(name),
                cpu_affinity=matrix.cpu_affinity.get(name, ""))
        for name in matrix.gpus
    ]
    numa_of = {f"GPU{g.index}": g.numa_node for g in gpus}
    nics: list[NicInfo] = []
    nic_label: dict[str, str] = {}
    for j, dev in enumerate(matrix.nics):
        nic_label[dev] = f"NIC{j}"
        closest = min(matrix.gpus, key=lambda gname, dev=dev: link_cost(*split_cell(matrix.cell(dev, gname))),
                      default=None)
        numa = None
        if closest is not None and split_cell(matrix.cell(dev, closest))[0] != "SYS":
            numa = numa_of[closest]
        nics.append(NicInfo(name=matrix.nic_names.get(dev, dev), numa_node=numa))
    numa_of.update({dev: nic.numa_node for dev, nic in zip(matrix.nics, nics, strict=True)})
    label_of = {**{g: g for g in matrix.gpus}, **nic_label}
    links: list[Link] = []
    for a, b in itertools.combinations(matrix.devices, 2):
        kind, nvlinks = split_cell(matrix.cell(a, b))
        links.append(make_link(label_of[a], label_of[b], kind, nvlinks))
    numa_ids = {g.numa_node for g in gpus if g.numa_node is not None}
    # Only CPUs named in some GPU's affinity are visible: a lower bound on the node's CPUs.
    cpus = set().union(*(_cpu_set(g.cpu_affinity) for g in gpus)) if gpus else set()
    return NodeTopology(node=node, site=site, cpu_sockets=_socket_count(matrix, numa_of),
                        numa_nodes=max(len(numa_ids), 1), cpu_milli=len(cpus) * 1000, gpus=gpus, nics=nics,
                        links=links, labels=dict(labels or {}))


def render_topology(node: NodeTopology) -> dict[str, Any]:
    """A JSON-ready view: GPUs (NUMA, CPU affinity), pairwise links with reported and
    effective kind and cost, NICs with their closest GPUs, and co-location domains."""
    links = corrected_links(node)
    nic_costs = gpu_nic_costs(node)
    return {
        "node": node.node,
        "site": node.site,
        "cpu_sockets": node.cpu_sockets,
        "numa_nodes": node.numa_nodes,
        "gpus": [
            {"index": g.index, "model": g.model, "uuid": g.uuid, "memory_mb": g.memory_mb,
             "numa_node": g.numa_node, "cpu_affinity": g.cpu_affinity, "labels": dict(g.labels)}
            for g in node.gpus
        ],
        "nics": [
            {"name": nic.name, "numa_node": nic.numa_node,
             "ports": [{"port": p.port, "rate_gbps": p.rate_gbps, "link_layer": p.link_layer} for p in nic.ports],
             "closest_gpus": sorted(g.index for g in node.gpus
                                    if nic_costs[(g.index, nic.name)] == min(nic_costs[(h.index, nic.name)] for h in node.gpus))
             if node.gpus else []}
            for nic in node.nics
        ],
        "links": [
            {"a": link.a, "b": link.b, "reported": link.reported, "kind": link.kind,
             "nvlinks": link.nvlinks, "cost": link.cost, "numa_corrected": link.corrected}
            for link in links
        ],
        "gpu_cost_matrix": gpu_cost_matrix(node).round(3).tolist(),
        "domains": [{"kind": d.kind, "gpus": list(d.gpus)} for d in colocation_domains(node)],
    }


def render_nvidia_smi(text: str, node: str = "local", *, site: str = "default") -> dict[str, Any]:
    """Parse ``nvidia-smi topo -m`` text and render it (what ``fleetpilot topology FILE`` prints).

    Raises ``TopoParseError`` (a ``ValueError``) naming the offending line.
    """
    return render_topology(topology_from_matrix(parse_topo_matrix(text), node, site=site))
