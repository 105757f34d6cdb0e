"""Telemetry family: per-GPU samples (the resource schema) and per-task process samples.

Fields that ``nvidia-smi`` does not show are ``Reading``s: a value plus an
``uncertainty_score`` in 0..1 (0 = an exact hardware counter, 1 = a guess). How each is
derived is documented in ``libs/fleetpilot/fleet/README.md``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .base import INT_KEYS, Event, Record


class Reading(Record, frozen=True, kw_only=True):
    """A derived value and how much to trust it (0 = exact counter, 1 = no information)."""

    value: float
    uncertainty_score: float


class ProcessMemory(Record, frozen=True, kw_only=True):
    """GPU memory held by one process, with the task it belongs to when known."""

    pid: int
    used_mb: float
    task_id: str | None = None


class MigDeviceSample(Record, frozen=True, kw_only=True):
    """One MIG device of a GPU in MIG mode (a compute instance inside a GPU instance: what
    ``nvidia-smi -L`` lists as ``MIG 1g.10gb Device 0``), read through its own MIG handle.

    ``index`` is the MIG device's index under its GPU (``nvmlDeviceGetMigDeviceHandleByIndex``);
    ``uuid`` the ``MIG-...`` id that ``CUDA_VISIBLE_DEVICES`` takes. ``profile`` (``1g.10gb``,
    ``1c.3g.40gb``), ``gpu_slices`` and ``compute_slices`` describe how big the slice is;
    ``None``/``0``/``""`` where NVML refused to say (then listed in the GPU sample's
    ``nvml_unsupported``). Memory is the slice's own, in MiB; ``pids`` are the processes
    running on the slice, whose memory is in the GPU sample's ``processes``.
    """

    index: int
    uuid: str = ""
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    profile: str = ""
    gpu_slices: int = 0
    compute_slices: int = 0
    memory_total_mb: float = 0.0
    memory_used_mb: float = 0.0
    pids: list[int] = msgspec.field(default_factory=list)


class MigState(Record, frozen=True, kw_only=True):
    """The MIG (Multi-Instance GPU) state of one GPU at the time of a sample.

    ``enabled`` is the current mode; ``change_pending`` says the mode was changed
    (``nvidia-smi -mig 0|1``) but takes effect only at the next GPU reset, so a GPU can be
    read whole while it is about to be cut, or cut while it is about to be whole again.
    ``devices`` lists the MIG devices of an enabled GPU (empty: enabled but not yet cut).
    Read-only: Fleetpilot's policies still place work on whole GPUs and shares, not slices.
    """

    enabled: bool
    change_pending: bool = False
    devices: list[MigDeviceSample] = msgspec.field(default_factory=list)


class GpuSample(Record, frozen=True, kw_only=True):
    """One reading of one GPU: the resource schema published by the collector.

    ``mig`` is left out (``msgspec.UNSET``, which is falsy: test it with ``if sample.mig``)
    for a GPU that is not in MIG mode and has no MIG change pending, every GPU without MIG
    among them: their samples encode exactly as before MIG was read.

    ``xid_codes`` counts the GPU's XIDs code by code (cumulative, as ``xid_count``): an
    interval holds several codes at once (a double-bit error, 48, then the cleanups of the
    contexts it killed, 45), and ``xid_last`` names only one. Left out (``UNSET``) until the
    GPU raises one, and by collectors that do not count codes.
    """

    node: str
    gpu: int
    uuid: str
    model: str
    at: float
    utilization_gpu_pct: float
    utilization_memory_pct: float
    memory_total_mb: float
    memory_used_mb: float
    memory_free_mb: float
    temperature_c: float
    power_w: float
    power_limit_w: float
    sm_clock_mhz: float
    pcie_tx_kbps: float
    pcie_rx_kbps: float
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    retired_pages: int = 0
    remapped_rows: int = 0
    pcie_replays: int = 0
    pcie_link_width: int = 0
    pcie_link_width_max: int = 0
    xid_last: int = 0
    xid_count: int = 0
    xid_codes: Annotated[dict[int, int], INT_KEYS] | msgspec.UnsetType = msgspec.UNSET
    cuda_context_switches_per_sec: Reading = msgspec.field(default_factory=lambda: Reading(value=0.0, uncertainty_score=1.0))
    nvlink_bandwidth_utilization_ratio: Reading = msgspec.field(default_factory=lambda: Reading(value=0.0, uncertainty_score=1.0))
    processes: list[ProcessMemory] = msgspec.field(default_factory=list)
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    mig: MigState | msgspec.UnsetType = msgspec.UNSET


class NicPortRate(Record, frozen=True, kw_only=True):
    """Throughput of one InfiniBand/RoCE port over the last interval, from its sysfs counter
    deltas (``port_xmit_data``/``port_rcv_data``, 4-byte words); ``uncertainty_score`` is 1
    for the first interval or after a counter reset."""

    device: str
    port: int
    tx_gbps: float
    rx_gbps: float
    utilisation: float
    uncertainty_score: float


class NodeTelemetry(Event, frozen=True, kw_only=True, tag="telemetry.gpu.v1"):
    """A batch of GPU samples from one node, taken together, with its network ports."""

    node: str
    at: float
    source: Literal["nvml", "sim"]
    gpus: list[GpuSample]
    nic_ports: list[NicPortRate] = msgspec.field(default_factory=list)


class TaskTelemetry(Event, frozen=True, kw_only=True, tag="telemetry.task.v1"):
    """Memory and utilisation of one task's processes at one instant."""

    task_id: str
    node: str
    gpus: list[int]
    at: float
    memory_used_mb: float
    utilization_gpu_pct: float = 0.0
    pids: list[int] = msgspec.field(default_factory=list)
