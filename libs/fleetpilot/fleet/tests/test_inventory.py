"""The fleet model: the three-site spec, the openb node list, topology.json round trips."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from fleetpilot.bench.openb import NODES_FILE, find_data_dir
from fleetpilot.fleet.catalogue import UnknownGpuModel
from fleetpilot.fleet.inventory import (
    build_fleet,
    fleet_from_json,
    fleet_to_json,
    load_fleet_spec,
    load_openb_fleet,
    read_fleet_json,
)
from fleetpilot.fleet.node_shapes import NodeShape, build_node, gpu_uuid
from fleetpilot.fleet.topology import colocation_domains

# Found as the benchmarks find it: $FLEETPILOT_DATA, else shared/data/openb above this file.
_DATA = find_data_dir(Path(__file__).parent)
OPENB = (_DATA / NODES_FILE) if _DATA else Path("shared/data/openb") / NODES_FILE


def test_three_site_spec_builds_the_agreed_fleet() -> None:
    fleet = load_fleet_spec()
    assert [s.name for s in fleet.sites] == ["site-a", "site-b", "edge"]
    per_site = Counter((n.site, n.gpus[0].model, len(n.gpus)) for n in fleet.nodes)
    assert per_site == {("site-a", "A100-40GB", 8): 8, ("site-b", "H100", 8): 4, ("edge", "Jetson-Orin", 1): 16}
    assert fleet.gpu_count == 8 * 8 + 4 * 8 + 16
    a100 = fleet.node("a100-00")
    assert {link.nvlinks for link in a100.links if link.kind == "NV"} == {12}
    assert {(p.rate_gbps, p.link_layer) for nic in a100.nics for p in nic.ports} == {(200.0, "InfiniBand")}
    h100 = fleet.node("h100-03")
    assert {link.nvlinks for link in h100.links if link.kind == "NV"} == {18}
    assert {(p.rate_gbps, p.link_layer) for nic in h100.nics for p in nic.ports} == {(400.0, "Ethernet")}
    assert len(fleet.links_between("site-a", "site-b")) == 3
    assert all(link.rtt_ms > 0 and link.rate_gbps > 0 for link in fleet.links)


def test_gpus_carry_business_labels() -> None:
    fleet = load_fleet_spec()
    roles = Counter(g.labels["business_role"] for n in fleet.nodes for g in n.gpus)
    assert set(roles) == {"train", "infer", "encode"}
    assert {n.gpus[0].labels["business_role"] for n in fleet.nodes_at("edge")} == {"infer", "encode"}
    assert fleet.node("h100-00").gpus[0].labels["driver_version"] == "550.127.05"
    assert fleet.node("a100-00").gpus[0].labels["driver_version"] == "550.90.07"


def test_dgx_like_layout_pairs_gpus_on_numa_nodes() -> None:
    node = load_fleet_spec().node("a100-00")
    assert node.cpu_sockets == 2 and node.numa_nodes == 8
    assert [g.numa_node for g in node.gpus] == [0, 0, 2, 2, 4, 4, 6, 6]
    assert [nic.numa_node for nic in node.nics] == [0, 0, 2, 2, 4, 4, 6, 6]
    assert len({g.uuid for g in node.gpus}) == 8 and node.gpus[0].uuid == gpu_uuid("a100-00", 0)


@pytest.mark.parametrize(("shape", "kinds"), [
    (NodeShape(gpu_model="T4", gpus=4, sockets=2, gpus_per_switch=2), {(0, 1): "PIX", (0, 2): "SYS", (2, 3): "PIX"}),
    (NodeShape(gpu_model="T4", gpus=4, sockets=1, gpus_per_switch=1), {(0, 1): "PXB", (0, 3): "PXB"}),
    (NodeShape(gpu_model="T4", gpus=4, sockets=1, numa_per_socket=2, gpus_per_switch=1), {(0, 1): "PXB", (0, 2): "NODE"}),
    (NodeShape(gpu_model="V100-32GB", gpus=4, nvlink="pairs"), {(0, 1): "NV", (0, 2): "SYS", (2, 3): "NV"}),
])
def test_pcie_layout_of_shapes(shape: NodeShape, kinds: dict[tuple[int, int], str]) -> None:
    node = build_node("n", shape)
    got = {(int(link.a[3:]), int(link.b[3:])): link.kind for link in node.links if link.b.startswith("GPU")}
    for pair, kind in kinds.items():
        assert got[pair] == kind


def test_topology_json_round_trip(tmp_path: Path) -> None:
    fleet = load_fleet_spec()
    path = tmp_path / "topology.json"
    path.write_bytes(fleet_to_json(fleet))
    assert read_fleet_json(path) == fleet
    assert fleet_from_json(path.read_text()) == fleet


@pytest.mark.parametrize(("spec", "error"), [
    ({"sites": [{"name": "x", "groups": [{"prefix": "n", "count": 1, "shape": {"gpu_model": "Z9", "gpus": 1}}]}]},
     UnknownGpuModel),
    ({"sites": [{"name": "x"}], "links": [{"a": "x", "b": "y", "rate_gbps": 1, "rtt_ms": 1}]}, ValueError),
])
def test_bad_specs_fail_clearly(spec: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        build_fleet(spec)


@pytest.mark.skipif(not OPENB.exists(), reason=f"openb node list not found at {OPENB}")
def test_openb_fleet_loads_every_node_and_gpu() -> None:
    fleet = load_openb_fleet(OPENB)
    assert len(fleet.nodes) == 1_213
    assert fleet.gpu_count == 6_212
    models = Counter(g.model for n in fleet.nodes for g in n.gpus)
    assert models["G2"] == 549 * 8 and models["T4"] == 387 * 2 + 17 * 4
    assert {"V100-16GB", "V100-32GB", "P100", "A10", "G3"} <= set(models)
    node = fleet.node("openb-node-0000")
    assert node.cpu_milli == 64_000 and node.memory_mb == 262_144 and node.labels["openb_model"] == "P100"
    assert all(g.labels["business_role"] in {"train", "infer", "encode"} for n in fleet.nodes for g in n.gpus)
    eight = next(n for n in fleet.nodes if len(n.gpus) == 8)
    assert {d.kind for d in colocation_domains(eight)} == {"pcie_switch", "numa"}


@pytest.mark.parametrize("text", [
    "sites: [\n",                                                    # not YAML
    "",                                                              # an empty file
    "- a\n- b\n",                                                    # a list, not a mapping
    "sites: 3\n",                                                    # sites not a list
    "sites: [{name: a, labels: [1]}]\n",                             # labels not a mapping
    "sites: [{name: a, groups: [{prefix: x, shape: 5}]}]\n",         # shape not a mapping
    "sites: [{name: a, groups: [{prefix: x, roles: 5, shape: {gpu_model: T4, gpus: 2}}]}]\n",
    "sites: [{name: a, groups: [{prefix: x}]}]\n",                   # a group without its shape
])
def test_a_malformed_spec_file_is_one_line_value_error(tmp_path: Path, text: str) -> None:
    # Every service that loads a spec (the collector's simulator, the topology service)
    # turns a ValueError into its one-line exit; anything else was a traceback.
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as caught:
        load_fleet_spec(path)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("text", [
    "sn,cpu_milli,memory_mib,gpu,model\nob-0,64000\n",              # a short row
    "sn,cpu_milli,memory_mib,gpu,model\nob-0,lots,262144,2,T4\n",    # not a number
    "sn,gpu,model\nob-0,2,T4\n",                                     # a column missing
])
def test_a_malformed_openb_node_list_is_one_line_value_error_naming_the_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / "nodes.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match="line 2") as caught:
        load_openb_fleet(path)
    assert "\n" not in str(caught.value)
