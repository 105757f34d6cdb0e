"""Parsing ``nvidia-smi topo -m`` in its variants, and rejecting what is not a matrix."""

from __future__ import annotations

from pathlib import Path

import pytest
from fleetpilot.fleet.topo_parser import TopoParseError, parse_topo_matrix

TOPO = Path(__file__).resolve().parents[1] / "data" / "topo"

# sample -> (gpus, nics, numa affinity of GPU0 and the last GPU, a cell, first NIC name)
SAMPLES = {
    "dgx_a100.txt": (8, 10, (3, 5), ("GPU0", "GPU7", "NV12"), "mlx5_0"),
    "hgx_h100.txt": (8, 10, (0, 1), ("GPU3", "NIC3", "PIX"), "mlx5_0"),
    "dual_socket_pcie.txt": (4, 2, (0, 1), ("GPU0", "GPU1", "PIX"), "mlx5_0"),
    "cloud_vm_phb.txt": (4, 0, (0, 1), ("GPU1", "GPU2", "PHB"), None),
}


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_every_shipped_sample_parses(sample: str) -> None:
    gpus, nics, (numa_first, numa_last), (a, b, kind), first_nic = SAMPLES[sample]
    m = parse_topo_matrix((TOPO / sample).read_text())
    assert len(m.gpus) == gpus and len(m.nics) == nics
    assert m.numa_affinity["GPU0"] == numa_first and m.numa_affinity[m.gpus[-1]] == numa_last
    assert m.cell(a, b) == kind and m.cell(b, a) == kind
    assert all(m.cell(d, d) == "X" for d in m.devices)
    assert all(m.cpu_affinity[g] for g in m.gpus)
    if first_nic:
        assert m.nic_names.get(m.nics[0], m.nics[0]) == first_nic


def test_all_samples_are_shipped() -> None:
    assert sorted(p.name for p in TOPO.glob("*.txt")) == sorted(SAMPLES)


def test_gpu_numa_id_column_reads_na_as_none() -> None:
    m = parse_topo_matrix((TOPO / "dgx_a100.txt").read_text())
    assert m.gpu_numa_id["GPU0"] is None
    assert m.nic_names["NIC9"] == "mlx5_9"


def test_ansi_header_and_tabs_and_spaces_give_the_same_matrix() -> None:
    text = (TOPO / "hgx_h100.txt").read_text()
    assert "\x1b[4m" in text
    spaced = text.replace("\x1b[4m", "").replace("\x1b[0m", "").replace("\t", "   ")
    assert parse_topo_matrix(spaced) == parse_topo_matrix(text)


def test_obsolete_soc_cell_reads_as_sys() -> None:
    text = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tSOC\t0-7\nGPU1\tSOC\t X \t8-15\n"
    m = parse_topo_matrix(text)
    assert m.cell("GPU0", "GPU1") == "SYS"
    assert m.cpu_affinity == {"GPU0": "0-7", "GPU1": "8-15"}


@pytest.mark.parametrize(("text", "line", "words"), [
    ("", 1, "empty"),
    ("hello world\n", 1, "GPU0"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \tbogus extra\n", 3, "affinity columns"),
    ("\tGPU0\tGPU1\nGPU0\t X \tFOO\nGPU1\tFOO\t X \n", 2, "unknown link kind"),
    ("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tNV4\t X \n", 2, "1 cells"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU7\tNV4\t X \n", 3, "GPU7"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\n\nLegend:\n", 3, "no row for GPU1"),
    ("\tGPU0\tGPU1\nGPU0\tNV4\tNV4\nGPU1\tNV4\t X \n", 2, "diagonal"),
    ("\tGPU0\tNUMA Affinity\nGPU0\t X \tzero\n", 2, "bad affinity"),
])
def test_unparseable_input_names_the_line(text: str, line: int, words: str) -> None:
    with pytest.raises(TopoParseError) as info:
        parse_topo_matrix(text)
    assert isinstance(info.value, ValueError)
    assert info.value.line == line
    assert str(info.value).startswith(f"line {line}:")
    assert words in str(info.value)


def test_a_numa_affinity_spanning_several_nodes_reads_as_no_single_node() -> None:
    # A100-PCIe servers with several NUMA nodes print "0-1" (HAMi issue 1363): a GPU tied to
    # no one NUMA node, which must not make the whole matrix unreadable.
    text = ("\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
            "GPU0\t X \tSYS\t0-63\t0-1\t\tN/A\n"
            "GPU1\tSYS\t X \t0-31\t0\t\tN/A\n")
    m = parse_topo_matrix(text)
    assert m.numa_affinity == {"GPU0": None, "GPU1": 0}
    assert m.cpu_affinity == {"GPU0": "0-63", "GPU1": "0-31"}
    with pytest.raises(TopoParseError, match="bad affinity"):
        parse_topo_matrix(text.replace("0-1", "0-x"))


def test_a_cpu_affinity_of_na_is_no_cpu_list() -> None:
    # VMs print "N/A" for CPU affinity; it went on as the GPU's CPU list ("CPUs N/A"),
    # where NVML's unknown affinity is "".
    from fleetpilot.fleet.topology import topology_from_matrix

    text = ("\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
            "GPU0\t X \tPHB\tN/A\tN/A\n"
            "GPU1\tPHB\t X \t0-7\t0\n")
    m = parse_topo_matrix(text)
    assert m.cpu_affinity == {"GPU1": "0-7"}
    assert [g.cpu_affinity for g in topology_from_matrix(m, "vm").gpus] == ["", "0-7"]
