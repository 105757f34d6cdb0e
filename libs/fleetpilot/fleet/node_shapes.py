"""Node shapes: the recipe of a server (sockets, NUMA, PCIe switches, GPUs, NVLink, NICs)
and ``build_node`` that turns one into a ``contracts.topology.NodeTopology``.

A shape is what a fleet spec (YAML) or the openb CSV says about a node; the built
topology is what the rest of the system reads. PCIe layout follows common server designs:
GPUs are spread evenly over NUMA nodes, ``gpus_per_switch`` GPUs share a PCIe switch,
and NICs hang off the switches in order (as on DGX/HGX boards, one NIC per switch or per
GPU). Link kinds use ``nvidia-smi`` vocabulary so a built node and a parsed one compare.
"""

from __future__ import annotations

import uuid
from typing import Literal

import msgspec

from fleetpilot.contracts.topology import GpuInfo, Link, LinkKind, NicInfo, NicPort, NodeTopology

from .catalogue import gpu_model
from .topology import make_link

NvlinkLayout = Literal["none", "nvswitch", "pairs"]

_UUID_NAMESPACE = uuid.UUID("6f1c9a52-4b1e-4c39-9e3a-2f0c1d7a9b10")


class NicSpec(msgspec.Struct, frozen=True, kw_only=True):
    """``count`` identical NICs of ``ports`` ports at ``rate_gbps`` each."""

    count: int = 1
    rate_gbps: float = 100.0
    ports: int = 1
    link_layer: Literal["InfiniBand", "Ethernet"] = "InfiniBand"
    prefix: str = "mlx5_"


class NodeShape(msgspec.Struct, frozen=True, kw_only=True):
    """The recipe of one node; ``build_node`` lays it out."""

    gpu_model: str
    gpus: int
    sockets: int = 2
    numa_per_socket: int = 1
    gpus_per_switch: int = 2
    nvlink: NvlinkLayout = "none"
    nvlinks: int = 0
    nics: list[NicSpec] = msgspec.field(default_factory=list)
    cpu_milli: int = 64_000
    memory_mb: int = 262_144
    driver_version: str = "550.90.07"
    business_role: str = "train"
    labels: dict[str, str] = msgspec.field(default_factory=dict)


def _pcie_kind(numa_a: int, numa_b: int, switch_a: int, switch_b: int, numa_per_socket: int) -> LinkKind:
    if switch_a == switch_b:
        return "PIX"
    if numa_a == numa_b:
        return "PXB"
    if numa_a // numa_per_socket == numa_b // numa_per_socket:
        return "NODE"
    return "SYS"


def gpu_uuid(node: str, index: int) -> str:
    """A stable, NVML-looking UUID for a simulated GPU (same node and index, same UUID)."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/{index}')}"


def build_node(name: str, shape: NodeShape, *, site: str = "default", roles: list[str] | None = None) -> NodeTopology:
    """Lay out ``shape`` as a ``NodeTopology`` named ``name`` in ``site``.

    ``roles`` overrides the business role per GPU (cycled); otherwise every GPU carries
    ``shape.business_role``. Raises ``UnknownGpuModel`` for a model not in the catalogue.
    """
    model = gpu_model(shape.gpu_model)
    numa_nodes = max(shape.sockets * shape.numa_per_socket, 1)
    per_switch = max(shape.gpus_per_switch, 1)
    switches = max((shape.gpus + per_switch - 1) // per_switch, 1)
    cpus = max(shape.cpu_milli // 1000, numa_nodes)
    cpus_per_numa = cpus // numa_nodes
    nvlinks = shape.nvlinks or model.nvlink_links

    # Switches spread evenly over NUMA nodes and a GPU inherits its switch's node, so with
    # more NUMA nodes than switches (NPS4) GPU pairs share a node, as on a DGX A100.
    switch_numa = {s: s * numa_nodes // switches for s in range(switches)}
    gpu_switch = [i // per_switch for i in range(shape.gpus)]
    gpu_numa = [switch_numa[gpu_switch[i]] for i in range(shape.gpus)]

    gpus = []
    for i in range(shape.gpus):
        lo = gpu_numa[i] * cpus_per_numa
        role = roles[i % len(roles)] if roles else shape.business_role
        gpus.append(GpuInfo(
            index=i, model=model.name, uuid=gpu_uuid(name, i), memory_mb=model.memory_mb, numa_node=gpu_numa[i],
            cpu_affinity=f"{lo}-{lo + cpus_per_numa - 1}", pci_bus_id=f"00000000:{0x07 + 0x10 * i:02X}:00.0",
            labels={"business_role": role, "driver_version": shape.driver_version,
                    "pcie_switch": str(gpu_switch[i]), "nvlink_gen": str(model.nvlink_gen)},
        ))

    nics: list[NicInfo] = []
    nic_switch: list[int] = []
    total_nics = sum(spec.count for spec in shape.nics)
    for spec in shape.nics:
        for _ in range(spec.count):
            j = len(nics)
            switch = j * switches // max(total_nics, 1)
            nic_switch.append(switch)
            nics.append(NicInfo(
                name=f"{spec.prefix}{j}", numa_node=switch_numa[switch],
                ports=[NicPort(port=p + 1, rate_gbps=spec.rate_gbps, link_layer=spec.link_layer) for p in range(spec.ports)],
            ))

    links: list[Link] = []
    for i in range(shape.gpus):
        for k in range(i + 1, shape.gpus):
            if shape.nvlink == "nvswitch" or (shape.nvlink == "pairs" and i // 2 == k // 2):
                links.append(make_link(f"GPU{i}", f"GPU{k}", "NV", nvlinks))
            else:
                kind = _pcie_kind(gpu_numa[i], gpu_numa[k], gpu_switch[i], gpu_switch[k], shape.numa_per_socket)
                links.append(make_link(f"GPU{i}", f"GPU{k}", kind))
        for j in range(len(nics)):
            kind = _pcie_kind(gpu_numa[i], switch_numa[nic_switch[j]], gpu_switch[i], nic_switch[j], shape.numa_per_socket)
            links.append(make_link(f"GPU{i}", f"NIC{j}", kind))

    labels = {"gpu_model": model.name, "pcie_gen": str(model.pcie_gen), "driver_version": shape.driver_version,
              "nvlink": shape.nvlink, "pcie_switches": str(switches), **shape.labels}
    return NodeTopology(node=name, site=site, cpu_sockets=shape.sockets, numa_nodes=numa_nodes,
                        cpu_milli=shape.cpu_milli, memory_mb=shape.memory_mb, gpus=gpus, nics=nics,
                        links=links, labels=labels)
