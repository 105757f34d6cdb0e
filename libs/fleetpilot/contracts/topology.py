"""Topology family: what a node is made of and how its parts and the sites connect."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Literal

import msgspec

from .base import Event, Record

# nvidia-smi topo -m link kinds, closest first ("NV" is NVLink with a link count).
LinkKind = Literal["X", "NV", "PIX", "PXB", "PHB", "NODE", "SYS", "PSB"]


class MigDeviceInfo(Record, frozen=True, kw_only=True):
    """One MIG device in a GPU's MIG layout: which slice it is and how big.

    ``index`` is its index under the GPU (``nvmlDeviceGetMigDeviceHandleByIndex``), ``uuid``
    the ``MIG-...`` id, ``gpu_instance_id``/``compute_instance_id`` the GI/CI ids that
    ``nvidia-smi mig -lgi``/``-lci`` show (``None`` where NVML refused them). ``profile`` is
    named as NVIDIA names it (``1g.10gb``; ``1c.3g.40gb`` for a compute instance smaller than
    its GPU instance), from ``gpu_slices``, ``compute_slices`` and ``memory_mb`` (MiB);
    ``multiprocessors`` is its SM count.
    """

    index: int
    uuid: str = ""
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    profile: str = ""
    gpu_slices: int = 0
    compute_slices: int = 0
    memory_mb: int = 0
    multiprocessors: int = 0


class MigLayout(Record, frozen=True, kw_only=True):
    """How a MIG-capable GPU is cut: its mode and its MIG devices.

    ``enabled`` is the current MIG mode, ``change_pending`` that a changed mode waits for a
    GPU reset; ``max_devices`` how many MIG devices the GPU can hold (7 on A100/H100/H200).
    Reported for information and operations; placement onto slices is not modelled: the
    policies keep placing on whole GPUs and shares.
    """

    enabled: bool
    change_pending: bool = False
    max_devices: int = 0
    devices: list[MigDeviceInfo] = msgspec.field(default_factory=list)


class GpuInfo(Record, frozen=True, kw_only=True):
    """One GPU as the topology sees it. ``mig`` is its MIG layout, left out
    (``msgspec.UNSET``, falsy) for a GPU that is not in MIG mode and has no MIG change
    pending, every GPU without MIG among them, whose report encodes as before."""

    index: int
    model: str
    uuid: str = ""
    memory_mb: int = 0
    numa_node: int | None = None
    cpu_affinity: str = ""
    pci_bus_id: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    mig: MigLayout | msgspec.UnsetType = msgspec.UNSET


class NicPort(Record, frozen=True, kw_only=True):
    """One port of a NIC: rate and link layer (InfiniBand or Ethernet for RoCE)."""

    port: int
    rate_gbps: float
    link_layer: Literal["InfiniBand", "Ethernet"] = "InfiniBand"
    state: str = "ACTIVE"


class NicInfo(Record, frozen=True, kw_only=True):
    """A network interface card and its ports."""

    name: str
    numa_node: int | None = None
    ports: list[NicPort] = msgspec.field(default_factory=list)


class Link(Record, frozen=True, kw_only=True):
    """The path between two devices (``GPU0``, ``NIC1``) with its kind and relative cost."""

    a: str
    b: str
    kind: LinkKind
    nvlinks: int = 0
    cost: float = 0.0


class NodeTopology(Record, frozen=True, kw_only=True):
    """A node's devices, their links and its place in the fleet."""

    node: str
    site: str = "default"
    cpu_sockets: int = 1
    numa_nodes: int = 1
    cpu_milli: int = 0
    memory_mb: int = 0
    gpus: list[GpuInfo] = msgspec.field(default_factory=list)
    nics: list[NicInfo] = msgspec.field(default_factory=list)
    links: list[Link] = msgspec.field(default_factory=list)
    labels: dict[str, str] = msgspec.field(default_factory=dict)


class TopologyReport(Event, frozen=True, kw_only=True, tag="topology.report.v1"):
    """A collector's raw view of one node's topology."""

    node: NodeTopology
    source: Literal["nvml", "nvidia-smi", "sim"]
    at: float


class BandwidthEstimate(Record, frozen=True, kw_only=True):
    """Effective bandwidth between two sites under one multipath strategy."""

    a_site: str
    b_site: str
    strategy: Literal["min_rtt", "balanced"]
    effective_gbps: float
    uncertainty_score: float = 0.5


class TopologyUpdated(Event, frozen=True, kw_only=True, tag="topology.updated.v1"):
    """The topology service's merged view changed; full nodes live in the topology bucket."""

    revision: int
    nodes: list[str]
    bandwidth: list[BandwidthEstimate] = msgspec.field(default_factory=list)
    at: float


# GPU labels that operations set on the topology (the executor's health hooks) rather than
# the hardware reports: collectors never send them, the topology service keeps them when a
# node is re-reported, and policies read them to keep work off the GPU.
GPU_LABEL_CORDONED = "cordoned"
GPU_LABEL_DECOMMISSIONED = "decommissioned"
GPU_LABEL_MAINTENANCE_PENDING = "maintenance_pending"
GPU_LABEL_MAINTENANCE_RISK = "maintenance_risk"
# Set by the topology service on every GPU of a node whose collector missed its last reports
# (``not_ready``: no new work, its tasks still taken as running, for a collector restarting or
# a short network cut is no lost node) and, if the silence lasts, lost (``unreachable``: its
# tasks are taken as lost with it). Cleared when it reports again; a node has one at most.
GPU_LABEL_NOT_READY = "not_ready"
GPU_LABEL_UNREACHABLE = "unreachable"
# Set by the topology service on the node (not its GPUs) with ``unreachable``: when it gave the
# node up (epoch seconds, the marking replica's clock). Forgetting a node counts from it: the
# stream's stamps cannot tell a silence of days, for it keeps a day of reports.
NODE_LABEL_UNREACHABLE_SINCE = "unreachable_since"
# Set by the collector on a GPU in MIG mode: its CUDA devices are its slices, which placement
# does not model (a task given the GPU's index sees no device), so it takes no new work.
GPU_LABEL_MIG = "mig"
# Business labels: what a GPU is for, set in the fleet spec or by an operator. ``role`` is the
# short form of ``business_role`` (an operator's override); ``reserved`` takes no new work.
# ``driver_pin``: the driver the GPU is held at (else the ``driver_version`` it reports);
# ``task_kinds``: the comma-separated kinds it may take (absent: all). A task's ``driver``
# label names the driver it needs: a version, or a prefix of one ("550" for "550.54.15").
GPU_LABEL_BUSINESS_ROLE = "business_role"
GPU_LABEL_ROLE = "role"
GPU_LABEL_DRIVER_PIN = "driver_pin"
GPU_LABEL_DRIVER_VERSION = "driver_version"
GPU_LABEL_TASK_KINDS = "task_kinds"
TASK_LABEL_DRIVER = "driver"
ROLE_RESERVED = "reserved"
# Under any of these a GPU takes no new work: no placement, move, resize or promise of it.
OUT_OF_SERVICE_GPU_LABELS = (GPU_LABEL_CORDONED, GPU_LABEL_DECOMMISSIONED, GPU_LABEL_MAINTENANCE_PENDING,
                             GPU_LABEL_NOT_READY, GPU_LABEL_UNREACHABLE, GPU_LABEL_MIG)
OPERATIONAL_GPU_LABELS = frozenset({GPU_LABEL_CORDONED, GPU_LABEL_DECOMMISSIONED, GPU_LABEL_MAINTENANCE_PENDING,
                                    GPU_LABEL_MAINTENANCE_RISK, GPU_LABEL_ROLE, GPU_LABEL_DRIVER_PIN,
                                    GPU_LABEL_TASK_KINDS, GPU_LABEL_NOT_READY, GPU_LABEL_UNREACHABLE})


class GpuRules(msgspec.Struct, frozen=True, kw_only=True):
    """The business rules a GPU's labels carry (``gpu_rules``), checked the same way by the
    policies (which never propose a placement they break) and by the executor (which
    refuses one)."""

    role: str = "general"
    driver: str = ""
    task_kinds: tuple[str, ...] = ()

    def refusal(self, kind: str, driver: str | None) -> str | None:
        """Why a task of ``kind`` that needs ``driver`` (``None``/empty: any) may not start
        here, or ``None`` when it may."""
        if self.role == ROLE_RESERVED:
            return "reserved"
        if driver and self.driver and not (self.driver == driver or self.driver.startswith(driver + ".")):
            return f"on driver {self.driver}, the task needs {driver}"
        if self.task_kinds and kind not in self.task_kinds:
            return f"takes {', '.join(self.task_kinds)}, not {kind}"
        return None


def marked_condition(node: NodeTopology) -> str:
    """The condition the topology service marked ``node`` with: ``unreachable``,
    ``not_ready``, or ``""`` when in service. Read from the node's own labels (a node without
    GPUs has nowhere else), or from every GPU's (a node stored before the node carried it)."""
    for condition in (GPU_LABEL_UNREACHABLE, GPU_LABEL_NOT_READY):
        if node.labels.get(condition) == "true" or (node.gpus and all(g.labels.get(condition) == "true"
                                                                       for g in node.gpus)):
            return condition
    return ""


def gpu_rules(labels: dict[str, str]) -> GpuRules:
    """The rules of a GPU from its topology labels (see the label names above)."""
    kinds = tuple(sorted(k.strip() for k in labels.get(GPU_LABEL_TASK_KINDS, "").split(",") if k.strip()))
    return GpuRules(role=labels.get(GPU_LABEL_ROLE) or labels.get(GPU_LABEL_BUSINESS_ROLE) or "general",
                    driver=labels.get(GPU_LABEL_DRIVER_PIN) or labels.get(GPU_LABEL_DRIVER_VERSION) or "",
                    task_kinds=kinds)


def in_service(labels: Mapping[str, str]) -> bool:
    """Whether a GPU with these labels takes new work: none of ``OUT_OF_SERVICE_GPU_LABELS``
    is ``"true"`` (labels are strings; an operator clears one with ``"false"``)."""
    return not any(labels.get(label, "").lower() == "true" for label in OUT_OF_SERVICE_GPU_LABELS)


def as_node_name(raw: str) -> str:
    """A host's name as a node is named on the bus: one subject token (``telemetry.gpu.<node>``,
    ``executor.handover.<node>``), so dots, spaces, ``*`` and ``>`` become ``_``. A
    Kubernetes node is often named like ``ip-10-0-3-7.ec2.internal``: reported as is, its
    telemetry went to subjects no ``telemetry.gpu.*`` subscriber hears."""
    return re.sub(r"[.\s*>]", "_", raw)


def unreachable_since(node: NodeTopology) -> float | None:
    """When the topology service gave ``node`` up, as its ``NODE_LABEL_UNREACHABLE_SINCE``
    label says (``None``: no label, or one that is no time, a hand edit)."""
    try:
        since = float(node.labels.get(NODE_LABEL_UNREACHABLE_SINCE, ""))
    except ValueError:
        return None
    return since if math.isfinite(since) else None
