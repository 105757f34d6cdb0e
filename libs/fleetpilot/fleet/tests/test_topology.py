"""Topology graph: costs, the PHB-across-NUMA correction, co-location domains, rendering."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fleetpilot.contracts.topology import GpuInfo, Link, NicInfo, NodeTopology
from fleetpilot.fleet.topo_parser import parse_topo_matrix
from fleetpilot.fleet.topology import (
    KIND_COST,
    colocation_domains,
    corrected_links,
    gpu_cost_matrix,
    gpu_nic_costs,
    link_cost,
    make_link,
    render_nvidia_smi,
    render_topology,
    split_cell,
    topology_from_matrix,
    topology_problem,
)

TOPO = Path(__file__).resolve().parents[1] / "data" / "topo"


def load(sample: str) -> NodeTopology:
    return topology_from_matrix(parse_topo_matrix((TOPO / sample).read_text()), sample.removesuffix(".txt"))


@pytest.mark.parametrize(("cell", "kind", "links"), [
    ("NV12", "NV", 12), ("NV1", "NV", 1), ("PHB", "PHB", 0), ("SOC", "SYS", 0), ("PSB", "PSB", 0),
])
def test_split_cell(cell: str, kind: str, links: int) -> None:
    assert split_cell(cell) == (kind, links)


def test_costs_follow_nvidia_smi_order_and_more_nvlinks_cost_less() -> None:
    order = [link_cost("NV", 1), KIND_COST["PIX"], KIND_COST["PSB"], KIND_COST["PXB"], KIND_COST["PHB"],
             KIND_COST["NODE"], KIND_COST["SYS"]]
    assert order == sorted(order) and len(set(order)) == len(order)
    assert link_cost("NV", 18) < link_cost("NV", 12) < link_cost("NV", 4) < link_cost("NV", 1)


def two_gpus(kind: str, numa: tuple[int | None, int | None]) -> NodeTopology:
    return NodeTopology(node="n", gpus=[GpuInfo(index=0, model="T4", numa_node=numa[0]),
                                        GpuInfo(index=1, model="T4", numa_node=numa[1])],
                        links=[make_link("GPU0", "GPU1", kind)])  # type: ignore[arg-type]


# The trap: a PCIe kind that claims "below one host bridge" across NUMA nodes costs SYS.
@pytest.mark.parametrize(("kind", "numa", "effective"), [
    ("PHB", (0, 1), "SYS"),
    ("PXB", (0, 1), "SYS"),
    ("PIX", (0, 1), "SYS"),
    ("PHB", (0, 0), "PHB"),
    ("PHB", (None, 1), "PHB"),   # unknown NUMA: keep what nvidia-smi said
    ("NODE", (0, 1), "NODE"),    # NPS4 sockets span NUMA nodes legitimately
    ("NV", (0, 1), "NV"),        # NVLink never touches the CPU
])
def test_phb_across_numa_is_costed_as_sys(kind: str, numa: tuple[int | None, int | None], effective: str) -> None:
    node = two_gpus(kind, numa)
    (link,) = corrected_links(node)
    assert link.reported == kind and link.kind == effective
    assert link.corrected == (kind != effective)
    assert gpu_cost_matrix(node)[0, 1] == pytest.approx(link_cost(effective, 0 if effective != "NV" else 0))


def test_cloud_vm_sample_phb_pairs_across_sockets_are_far() -> None:
    node = load("cloud_vm_phb.txt")
    cost = gpu_cost_matrix(node)
    assert cost[0, 1] == KIND_COST["PHB"] and cost[2, 3] == KIND_COST["PHB"]
    assert cost[0, 2] == KIND_COST["SYS"] and cost[1, 3] == KIND_COST["SYS"]
    assert node.cpu_sockets == 2
    rendered = render_topology(node)
    assert sum(link["numa_corrected"] for link in rendered["links"]) == 4


# sample -> (sockets, numa nodes, domains as (kind, gpus))
DOMAINS = {
    "dgx_a100.txt": (2, 4, {("nvlink", (0, 1, 2, 3, 4, 5, 6, 7)), ("numa", (0, 1)), ("numa", (2, 3)),
                            ("numa", (4, 5)), ("numa", (6, 7))}),
    "hgx_h100.txt": (2, 2, {("nvlink", (0, 1, 2, 3, 4, 5, 6, 7)), ("numa", (0, 1, 2, 3)), ("numa", (4, 5, 6, 7))}),
    "dual_socket_pcie.txt": (2, 2, {("pcie_switch", (0, 1)), ("numa", (0, 1)), ("numa", (2, 3))}),
    "cloud_vm_phb.txt": (2, 2, {("numa", (0, 1)), ("numa", (2, 3))}),
}


@pytest.mark.parametrize("sample", sorted(DOMAINS))
def test_sockets_numa_and_domains_of_each_sample(sample: str) -> None:
    sockets, numa, expected = DOMAINS[sample]
    node = load(sample)
    assert (node.cpu_sockets, node.numa_nodes) == (sockets, numa)
    assert {(d.kind, d.gpus) for d in colocation_domains(node)} == expected


def test_hybrid_cube_mesh_gives_overlapping_nvlink_cliques() -> None:
    # DGX-1 (V100) style: two quads fully linked, plus GPUi <-> GPUi+4.
    nv = {(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (4, 5), (4, 6), (4, 7), (5, 6), (5, 7), (6, 7),
          (0, 4), (1, 5), (2, 6), (3, 7)}
    links = [make_link(f"GPU{i}", f"GPU{j}", "NV" if (i, j) in nv else "SYS", 1 if (i, j) in nv else 0)
             for i in range(8) for j in range(i + 1, 8)]
    node = NodeTopology(node="dgx1", gpus=[GpuInfo(index=i, model="V100") for i in range(8)], links=links)
    cliques = {d.gpus for d in colocation_domains(node) if d.kind == "nvlink"}
    assert (0, 1, 2, 3) in cliques and (4, 5, 6, 7) in cliques and (0, 4) in cliques
    assert all(len(c) >= 2 for c in cliques)


def test_gpu_nic_costs_pick_the_switch_neighbour() -> None:
    node = load("hgx_h100.txt")
    costs = gpu_nic_costs(node)
    assert costs[(3, "mlx5_3")] == KIND_COST["PIX"]
    assert costs[(3, "mlx5_4")] == KIND_COST["SYS"]
    assert costs[(3, "mlx5_0")] == KIND_COST["NODE"]


def test_missing_links_are_costed_by_numa() -> None:
    node = NodeTopology(node="n", gpus=[GpuInfo(index=i, model="T4", numa_node=i // 2) for i in range(4)])
    cost = gpu_cost_matrix(node)
    assert cost[0, 1] == KIND_COST["NODE"] and cost[0, 2] == KIND_COST["SYS"]
    assert np.allclose(cost, cost.T) and np.all(np.diag(cost) == 0)


def test_render_is_json_ready_and_complete() -> None:
    node = load("dgx_a100.txt")
    rendered = json.loads(json.dumps(render_topology(node)))
    assert [g["numa_node"] for g in rendered["gpus"]] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert rendered["gpus"][0]["cpu_affinity"] == "48-63,176-191"
    assert len(rendered["links"]) == 18 * 17 // 2
    assert {link["kind"] for link in rendered["links"]} >= {"NV", "PXB", "NODE", "SYS"}
    assert rendered["nics"][0] == {"name": "mlx5_0", "numa_node": 3, "ports": [], "closest_gpus": [0, 1]}
    assert len(rendered["gpu_cost_matrix"]) == 8
    assert rendered["domains"][0] == {"kind": "nvlink", "gpus": list(range(8))}


def test_render_nvidia_smi_text_for_the_cli() -> None:
    rendered = render_nvidia_smi((TOPO / "dual_socket_pcie.txt").read_text(), "srv1")
    assert rendered["node"] == "srv1" and [n["name"] for n in rendered["nics"]] == ["mlx5_0", "mlx5_1"]
    assert rendered["nics"][1]["closest_gpus"] == [2]
    with pytest.raises(ValueError, match="line 1"):
        render_nvidia_smi("not a matrix")


def _reported(gpus=(0, 1), links=(), nics=1, name="n0", memory_mb=1000) -> NodeTopology:
    return NodeTopology(node=name, gpus=[GpuInfo(index=i, model="A100", memory_mb=memory_mb) for i in gpus],
                        nics=[NicInfo(name=f"mlx5_{j}") for j in range(nics)], links=list(links))


@pytest.mark.parametrize(("node", "problem"), [
    (_reported(links=[make_link("GPU0", "GPU1", "NV", 4), make_link("GPU1", "NIC0", "PIX")]), None),
    (_reported(links=[Link(a="CPU0", b="GPU0", kind="SYS")]), None),  # a device kind nobody reads
    (_reported(name=""), "the node has no name"),
    (_reported(gpus=(0, -1)), "GPU index below 0: [-1]"),
    (_reported(gpus=(0, 1, 1)), "GPU index listed twice: [1]"),
    (_reported(memory_mb=-5), "a GPU with negative memory"),
    (_reported(links=[make_link("GPU0", "GPU7", "NV", 2)]), "link GPU0-GPU7 names 'GPU7', which the node does not list"),
    (_reported(links=[make_link("GPU0", "NIC1", "PIX")]), "link GPU0-NIC1 names 'NIC1', which the node does not list"),
    (_reported(links=[Link(a="GPU0", b="GPU1", kind="NV", nvlinks=-2)]), "link GPU0-GPU1 has nvlinks -2 and cost 0.0"),
    (_reported(links=[Link(a="GPU0", b="GPU1", kind="PIX", cost=float("nan"))]), "link GPU0-GPU1 has nvlinks 0 and cost nan"),
])
def test_a_reported_node_consumers_could_not_read_says_why(node, problem):
    assert topology_problem(node) == problem

