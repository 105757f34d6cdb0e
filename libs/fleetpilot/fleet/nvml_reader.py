"""The NVML backend of ``reader.GpuReader``: real GPUs read through nvidia-ml-py.

The ``pynvml`` module is injected (``NvmlReader(nvml=pynvml)``), so tests drive the very
same code with ``fake_nvml.FakeNvml``. Every NVML call is guarded: a call that raises
``NVMLError`` (``NotSupported`` on a consumer card, ``NoPermission`` in a container ...)
yields the field's default, lists the field under the ``nvml_unsupported`` label of the
sample and, for derived readings, raises the ``uncertainty_score``. Nothing here crashes
because one GPU lacks one feature.

Besides NVML the reader looks at two kernel interfaces, under a ``root`` path so tests
can use a temporary directory: ``/proc/driver/nvidia/params`` (driver module parameters,
put on the node's labels as ``nvidia.<Param>``) and the InfiniBand/RoCE port counters
``/sys/class/infiniband/<dev>/ports/<n>/{rate,link_layer,state,counters/*}``.

A GPU in MIG mode is also read slice by slice, through the MIG device handles
(``nvmlDeviceGetMigDeviceHandleByIndex``): each slice's memory and processes, so that a task
on a slice is attributed and measured even where the GPU itself refuses its aggregate
memory and per-process memory to a collector without the MIG monitor capability. How
the slices are cut (profile, slice counts, GPU/compute instance ids) is read with the
topology and cached by MIG UUID, so a sampling tick costs one mode read per MIG GPU plus a
handle, UUID, memory and process read per slice; a GPU without MIG is asked about it once.

How each derived field is computed, and from which call, is in ``fleet/README.md``.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import msgspec

from fleetpilot.contracts.telemetry import (
    GpuSample,
    MigDeviceSample,
    MigState,
    ProcessMemory,
    Reading,
    TaskTelemetry,
)
from fleetpilot.contracts.topology import (
    GPU_LABEL_MIG,
    GpuInfo,
    Link,
    MigDeviceInfo,
    MigLayout,
    NicInfo,
    NicPort,
    NodeTopology,
    as_node_name,
)

from .bandwidth import IbPort
from .catalogue import gpu_model
from .pcie_counters import PcieCounterPoller, field_modulus, field_number, link_top_bytes_per_s
from .reader import FleetEvent
from .topology import make_link

log = logging.getLogger("fleetpilot.fleet.nvml")

MB = 1024 * 1024
GIB = 1024 * MB
SWITCH_RATE_PER_PEER = 400.0  # the same time-slice model the simulator plays out
TASK_ENV = "FLEETPILOT_TASK_ID"
NOT_AVAILABLE_ULL = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE as an unsigned long long

# NVML return codes (nvidia-ml-py's values) the MIG reads tell apart.
_NVML_ERROR_INVALID_ARGUMENT = 2
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_NOT_FOUND = 6
_NVML_ERROR_FUNCTION_NOT_FOUND = 13
# A GPU fallen off the bus (Xid 79) after NVML opened it: every call on its handle fails so
# until the GPU is reset, so the first read that says so ends that GPU's reading for the tick.
_NVML_ERROR_GPU_IS_LOST = 15
# nvmlDeviceGetMigMode refused with these: a GPU without MIG, or a driver without the call.
_NO_MIG = frozenset({_NVML_ERROR_NOT_SUPPORTED, _NVML_ERROR_FUNCTION_NOT_FOUND})
# nvmlDeviceGetMigDeviceHandleByIndex: NotFound is an index with no MIG device (indices are
# sparse once slices are destroyed), InvalidArgument one past what the GPU holds; both are
# skipped, as NVIDIA's go-nvlib does.
_EMPTY_MIG_INDEX = frozenset({_NVML_ERROR_NOT_FOUND, _NVML_ERROR_INVALID_ARGUMENT})
# The most MIG devices any MIG GPU holds today (A100/H100/H200/B200); only used where
# nvmlDeviceGetMaxMigDeviceCount is refused, with the indices past the real maximum skipped.
_MIG_DEVICES_FALLBACK = 7

# nvmlDeviceGetTopologyCommonAncestor levels -> nvidia-smi link kinds.
_LEVEL_KIND: dict[int, str] = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def nvml_available(nvml: Any = None) -> bool:
    """True when NVML can be initialised; False (never an exception) without a driver."""
    try:
        if nvml is None:
            import pynvml as nvml  # noqa: PLC0415 - optional at import time on purpose
        nvml.nvmlInit()
        nvml.nvmlDeviceGetCount()
        nvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001 - any failure (no lib, no driver, no device) means "no"
        return False


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default


def read_ib_ports(root: str | Path = "/") -> list[IbPort]:
    """Every port under ``<root>/sys/class/infiniband``.

    ``port_xmit_data`` / ``port_rcv_data`` count 4-byte words (per the IB spec, divided by
    the lane count), so they are multiplied by 4; one that cannot be read is ``None``. The
    rate file reads "200 Gb/sec (4X HDR)".
    """
    base = Path(root) / "sys/class/infiniband"
    ports: list[IbPort] = []
    if not base.is_dir():
        return ports
    for dev in sorted(p for p in base.iterdir() if (p / "ports").is_dir()):
        for port_dir in sorted((dev / "ports").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
            rate = re.match(r"([\d.]+)", _read(port_dir / "rate", "0"))
            layer = _read(port_dir / "link_layer", "InfiniBand")
            state = _read(port_dir / "state", "")
            ports.append(IbPort(
                device=dev.name, port=int(port_dir.name), rate_gbps=float(rate.group(1)) if rate else 0.0,
                link_layer="Ethernet" if layer == "Ethernet" else "InfiniBand",
                state=state.split(":", 1)[-1].strip() or "UNKNOWN",
                xmit_bytes=_words_as_bytes(port_dir / "counters/port_xmit_data"),
                rcv_bytes=_words_as_bytes(port_dir / "counters/port_rcv_data"),
            ))
    return ports


def _words_as_bytes(path: Path) -> int | None:
    # An unreadable counter (EIO while the HCA resets, a missing or garbled file) is None,
    # not 0: as 0 it made the next period's rate the port's whole lifetime of traffic.
    text = _read(path)
    return int(text) * 4 if text.isdigit() else None


def read_driver_params(root: str | Path = "/") -> dict[str, str]:
    """``/proc/driver/nvidia/params`` as a dict ("Key: Value" lines); empty when absent."""
    out: dict[str, str] = {}
    for line in _read(Path(root) / "proc/driver/nvidia/params").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def read_host_capacity(root: str | Path = "/") -> tuple[int, int]:
    """``(cpu_milli, memory_mb)`` of the host: its online CPUs x 1000
    (``<root>/sys/devices/system/cpu/online``, e.g. ``0-111,224-335``) and its ``MemTotal``
    (``<root>/proc/meminfo``, kB) in MiB. Where a file is missing, this machine's own count
    (the collector runs on the node it reports); 0 only where neither can be read."""
    cpus = 0
    for part in _read(Path(root) / "sys/devices/system/cpu/online").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            cpus += int(hi or lo) - int(lo) + 1
    memory_mb = 0
    for line in _read(Path(root) / "proc/meminfo").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "MemTotal" and value.split() and value.split()[0].isdigit():
            memory_mb = int(value.split()[0]) // 1024
    if not cpus:
        cpus = os.cpu_count() or 0
    if not memory_mb:
        try:
            memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MB
        except (AttributeError, ValueError, OSError):
            memory_mb = 0
    return cpus * 1000, memory_mb


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def mig_profile_name(gpu_slices: int, compute_slices: int, memory_mb: int, gpu_total_bytes: int) -> str:
    """NVIDIA's name of a MIG device's profile (``1g.10gb``, ``1c.3g.40gb``) from its
    attributes (``nvmlDeviceGetAttributes``: slice counts, ``memorySizeMB``).

    The memory part follows NVIDIA's go-nvlib (``getMigMemorySizeGB``): the share of the
    GPU's memory the slice holds, rounded up to eighths (memory is cut in eighths), times
    the GPU's memory in GiB rounded up, rounded; so a 7-slice A100-80GB of 80,896 MiB is
    ``7g.80gb``, not 79. Without the GPU's total (0) it is the slice's own GiB rounded up
    (which can be one low on a whole-GPU profile). ``""`` when the slice counts are unknown.
    Media-extension profiles are named without their ``+me``: the attributes do not tell.
    """
    if gpu_slices <= 0 or compute_slices <= 0 or memory_mb <= 0:
        return ""
    if gpu_total_bytes > 0:
        # Integer arithmetic: a float share of exactly k/8 must not round up to k+1.
        eighths = -(-(memory_mb * MB * 8) // gpu_total_bytes)
        total_gib = -(-gpu_total_bytes // GIB)
        gb = (2 * eighths * total_gib + 8) // 16  # eighths/8 * total, rounded half up
    else:
        gb = math.ceil(memory_mb / 1024)
    slices = f"{gpu_slices}g" if compute_slices == gpu_slices else f"{compute_slices}c.{gpu_slices}g"
    return f"{slices}.{gb}gb"


def _catalogue_total_bytes(name: str) -> int:
    # A MIG GPU refuses its aggregate memory to an unprivileged caller; its model's memory
    # still names the profiles right (the catalogue holds NVML's totals).
    try:
        return gpu_model(name).memory_mb * MB if name else 0
    except LookupError:
        return 0


def _read_mig_mode(nvml: Any, handle: Any) -> tuple[bool, bool] | None:
    """``(enabled now, a change pending)`` of a GPU; ``None`` for a GPU or driver without
    MIG. Any other refusal raises the ``NVMLError``."""
    get_mode = getattr(nvml, "nvmlDeviceGetMigMode", None)
    if get_mode is None:
        return None  # bindings older than MIG
    enable = getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
    try:
        current, pending = get_mode(handle)
    except nvml.NVMLError as exc:
        if getattr(exc, "value", None) in _NO_MIG:
            return None
        raise
    return current == enable, current != pending


def _mig_handles(nvml: Any, handle: Any, count: int, refused: Callable[[str], Any]) -> list[tuple[int, Any]]:
    """``(index, MIG handle)`` of every MIG device of a GPU in MIG mode, empty indices skipped."""
    found = []
    for index in range(count):
        try:
            found.append((index, nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)))
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) not in _EMPTY_MIG_INDEX:
                refused("mig_devices")
    return found


def _mig_device_info(nvml: Any, index: int, mig_handle: Any, uuid: str, gpu_total_bytes: int,
                     refused: Callable[[str], Any]) -> MigDeviceInfo:
    """What a MIG device is (instance ids, slice counts, memory, SMs): static while it lives."""

    def ask(fn: Callable[..., Any], field: str) -> Any:
        try:
            return fn(mig_handle)
        except nvml.NVMLError:
            refused(field)
            return None

    gpu_instance = ask(nvml.nvmlDeviceGetGpuInstanceId, "mig_instance_ids")
    compute_instance = ask(nvml.nvmlDeviceGetComputeInstanceId, "mig_instance_ids")
    attrs = ask(nvml.nvmlDeviceGetAttributes, "mig_attributes")
    g = int(attrs.gpuInstanceSliceCount) if attrs is not None else 0
    c = int(attrs.computeInstanceSliceCount) if attrs is not None else 0
    memory_mb = int(attrs.memorySizeMB) if attrs is not None else 0
    return MigDeviceInfo(index=index, uuid=uuid,
                         gpu_instance_id=int(gpu_instance) if gpu_instance is not None else None,
                         compute_instance_id=int(compute_instance) if compute_instance is not None else None,
                         profile=mig_profile_name(g, c, memory_mb, gpu_total_bytes), gpu_slices=g, compute_slices=c,
                         memory_mb=memory_mb, multiprocessors=int(attrs.multiprocessorCount) if attrs is not None else 0)


def _mig_layout(nvml: Any, handle: Any, gpu_total_bytes: int) -> MigLayout | msgspec.UnsetType:
    """A GPU's MIG layout for the topology; ``UNSET`` without MIG mode or a pending change."""

    def ignore(_field: str) -> None:
        return None  # the topology has no refusal labels: what is refused stays at its default

    try:
        mode = _read_mig_mode(nvml, handle)
    except nvml.NVMLError:
        return msgspec.UNSET  # unknown: said by the samples' nvml_unsupported (mig_mode)
    if mode is None or mode == (False, False):
        return msgspec.UNSET
    enabled, pending = mode
    if not enabled:
        return MigLayout(enabled=False, change_pending=True)
    try:
        count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except nvml.NVMLError:
        count = 0
    devices = []
    for index, mig_handle in _mig_handles(nvml, handle, count or _MIG_DEVICES_FALLBACK, ignore):
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(mig_handle))
        except nvml.NVMLError:
            uuid = ""
        devices.append(_mig_device_info(nvml, index, mig_handle, uuid, gpu_total_bytes, ignore))
    return MigLayout(enabled=True, change_pending=pending, max_devices=count, devices=devices)


class _GpuLost(Exception):
    """Raised inside ``NvmlReader.sample`` when a GPU's read says it is lost: the reason."""


def _cpu_ranges(mask_words: Any) -> str:
    cpus = [w * 64 + b for w, word in enumerate(mask_words) for b in range(64) if int(word) >> b & 1]
    ranges: list[str] = []
    for cpu in cpus:
        if ranges and cpu == int(ranges[-1].split("-")[-1]) + 1:
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


class NvmlReader:
    """Reads the local node's GPUs through a ``pynvml``-compatible module (default: pynvml).

    ``node`` names the node (default: the host name), ``root`` prefixes ``/proc`` and
    ``/sys`` paths, ``clock`` gives wall time (injected for tests), ``monotonic`` the
    seconds that counter rates are taken over (default: ``time.monotonic``, or ``clock``
    when only that is injected), ``task_of_pid`` maps a PID to a task id (default:
    ``FLEETPILOT_TASK_ID`` in ``<root>/proc/<pid>/environ``), ``pcie_poll`` whether PCIe byte
    counters that wrap within a reading period are read on a thread (``PcieCounterPoller``).
    """

    source: Literal["nvml"] = "nvml"

    def __init__(self, nvml: ModuleType | Any = None, *, node: str | None = None, site: str = "default",
                 root: str | Path = "/", clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] | None = None,
                 task_of_pid: Callable[[int], str | None] | None = None, pcie_poll: bool = True) -> None:
        if nvml is None:
            import pynvml as nvml  # noqa: PLC0415 - the real module only when none is injected
        self._nvml = nvml
        self.node = as_node_name(node or socket.gethostname())  # one subject token
        self.site = site
        self.root = Path(root)
        self._clock = clock
        # Rates are taken on a clock that only moves forward: the wall clock can be stepped
        # back (NTP, a VM restored), and a step of 0.9 s in a 1 s interval read as a 10x rate.
        self._monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self._task_of_pid = task_of_pid or self._task_from_environ
        nvml.nvmlInit()
        # nvmlDeviceGetCount counts GPUs that nvmlDeviceGetHandleByIndex then refuses: one
        # fallen off the bus (GpuIsLost), one a container may not open (NoPermission). Such
        # a GPU keeps its slot (``None``, the reason in ``_unopened``) so that GPU i stays
        # GPU i in samples and topology, and the node's other GPUs are read on.
        self._handles: list[Any] = []
        self._unopened: dict[int, str] = {}
        for i in range(nvml.nvmlDeviceGetCount()):
            try:
                self._handles.append(nvml.nvmlDeviceGetHandleByIndex(i))
            except nvml.NVMLError as exc:
                log.warning("GPU %d of %s cannot be opened through NVML (%s); it is reported empty", i,
                            self.node, exc)
                self._handles.append(None)
                self._unopened[i] = str(exc)
        self._events: list[FleetEvent] = []
        self._xid_last = [0] * len(self._handles)
        self._xid_count = [0] * len(self._handles)
        self._xid_codes: list[dict[int, int]] = [{} for _ in self._handles]
        # Last (monotonic time it was read, tx, rx) of each cumulative counter pair, per (counter, GPU).
        self._counters: dict[tuple[str, int], tuple[float, float, float]] = {}
        self._pcie = PcieCounterPoller(self._pcie_counts, self._pcie_top_rate, self._monotonic, poll=pcie_poll)
        self._proc_util_ts = [0] * len(self._handles)
        # MIG: GPUs found without it (never asked again), each MIG GPU's maximum of MIG
        # devices, its memory total (names the profiles) and what each MIG device is, by
        # MIG UUID (a handle may be reused for another device; a UUID is not). The device
        # table is rebuilt by every topology read; a device made since is read once.
        self._no_mig: set[int] = set()
        self._mig_max: dict[int, int] = {}
        self._gpu_total: dict[int, int] = {}
        self._mig_info: dict[str, MigDeviceInfo] = {}
        # GPUs found lost while read (index -> NVML's reason), and each GPU's uuid and name as
        # last read, so that a lost GPU is still reported under the uuid it had.
        self._lost: dict[int, str] = {}
        self._identity: dict[int, tuple[str, str]] = {}
        self._listened: set[int] = set()
        self._driver = _text(self._try(nvml.nvmlSystemGetDriverVersion, default=""))
        self._event_set = self._register_xid_events()

    # -- plumbing --------------------------------------------------------------------

    def _try(self, fn: Callable[..., Any], *args: Any, default: Any = None, missing: list[str] | None = None,
             field: str = "") -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            if missing is not None and field:
                missing.append(field)
            return default

    def _register_xid_events(self, lost: Iterable[int] = ()) -> Any:
        """A new XID event set holding every opened GPU but the ``lost`` ones and those
        sampling found lost (``_listened`` names them); ``None`` where NVML gives none."""
        nvml = self._nvml
        self._listened = set()
        event_set = self._try(nvml.nvmlEventSetCreate)
        if event_set is None:
            return None
        skip = set(lost) | set(self._lost)
        for index, handle in enumerate(self._handles):
            if handle is None or index in skip:
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
            except nvml.NVMLError:
                continue  # no XID events from it (unsupported, or lost: sampling says which)
            self._listened.add(index)
        return event_set

    def _listen_again(self, lost: Iterable[int] = ()) -> None:
        """Make the XID event set again: without the GPUs lost since, with those back."""
        if self._event_set is not None:
            self._try(self._nvml.nvmlEventSetFree, self._event_set)
        self._event_set = self._register_xid_events(lost)

    def _xid_codes_of(self, index: int) -> dict[int, int] | msgspec.UnsetType:
        """A copy of the GPU's XID counts by code (``UNSET`` before its first XID)."""
        return dict(self._xid_codes[index]) if self._xid_codes[index] else msgspec.UNSET

    def _drain_xids(self) -> None:
        if self._event_set is None:
            return
        nvml = self._nvml
        made_again = False
        for _ in range(1024):  # bounded: a storm of XIDs must not stall sampling
            try:
                data = nvml.nvmlEventSetWait(self._event_set, 0)
            except nvml.NVMLError as exc:
                # After Xid 79 the driver answers every wait on a set that holds the lost GPU
                # with GpuIsLost: taken for "nothing pending", the node's other GPUs' XIDs
                # were never read again while it stayed lost. The set is made again without
                # it (once a tick: a driver that fails the new set too costs no more).
                if getattr(exc, "value", None) == _NVML_ERROR_GPU_IS_LOST and not made_again:
                    made_again = True
                    self._listen_again(self._lost_listened())
                    if self._event_set is not None:
                        continue
                return  # Timeout: nothing pending (or events unsupported)
            # ctypes handles compare by identity, so ask NVML for the index of the device.
            index = self._try(nvml.nvmlDeviceGetIndex, data.device)
            if index is None or not 0 <= index < len(self._handles):
                continue
            xid = int(data.eventData)
            self._xid_last[index] = xid
            self._xid_count[index] += 1
            codes = self._xid_codes[index]
            codes[xid] = codes.get(xid, 0) + 1
            self._events.append(FleetEvent(kind="xid", node=self.node, gpu=index, at=self._clock(),
                                           value=xid, detail=f"Xid {xid}"))

    def _lost_listened(self) -> set[int]:
        """The listened GPUs that are lost (the wait does not say which): one call each."""
        lost = set()
        for index in sorted(self._listened):
            try:
                self._nvml.nvmlDeviceGetUUID(self._handles[index])
            except self._nvml.NVMLError as exc:
                if getattr(exc, "value", None) == _NVML_ERROR_GPU_IS_LOST:
                    lost.add(index)
        return lost

    def _task_from_environ(self, pid: int) -> str | None:
        try:
            env = (self.root / f"proc/{pid}/environ").read_bytes()
        except OSError:
            return None
        for item in env.split(b"\0"):
            if item.startswith(TASK_ENV.encode() + b"="):
                try:
                    return item.split(b"=", 1)[1].decode() or None
                except UnicodeDecodeError:
                    # Not an id the executor wrote (its ids are text): the process is no
                    # task's, and a stranger's environment must not stop the node's readings.
                    return None
        return None

    def _check_node(self, node: str) -> None:
        if node != self.node:
            raise KeyError(f"this NVML reader serves node {self.node!r}, not {node!r}")

    # -- GpuReader -------------------------------------------------------------------

    def node_names(self) -> list[str]:
        """The local node only."""
        return [self.node]

    def events(self) -> list[FleetEvent]:
        """XID events since the last call (polled from the NVML event set, 0 ms timeout)."""
        self._drain_xids()
        out, self._events = self._events, []
        return out

    def _running(self, name: str, handle: Any, missing: list[str]) -> list[Any]:
        nvml = self._nvml
        try:
            return list(getattr(nvml, name)(handle) or [])
        except nvml.NVMLError:
            missing.append("processes")
            return []
        except getattr(nvml, "NVMLLibraryMismatchError", ()):
            # pynvml's unversioned call goes to the _v3 entry point, which drivers before
            # R510 lack, and says so with an error that is no NVMLError; _v2 is theirs.
            return list(self._try(getattr(nvml, f"{name}_v2"), handle, default=[], missing=missing,
                                  field="processes") or [])

    def _processes(self, handle: Any, missing: list[str], unknown: set[int] | None = None,
                   rows: list[Any] | None = None) -> list[ProcessMemory]:
        """The GPU's processes (``rows``: already read, from its MIG devices); a PID whose
        memory NVML cannot tell goes into ``unknown`` (when given) and ``process_memory``
        into ``missing``, its ``used_mb`` left at 0."""
        if rows is None:
            rows = [proc for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")
                    for proc in self._running(name, handle, missing)]
        seen: dict[int, ProcessMemory] = {}
        for proc in rows:
            if proc.pid in seen:
                continue
            used = getattr(proc, "usedGpuMemory", None)
            # NVML_VALUE_NOT_AVAILABLE (pynvml turns it into None; an older binding passes
            # 2**64-1 through): WDDM, or a MIG GPU's own list read without privileges (its
            # slices' lists do tell). Neither is 0.
            if used is None or int(used) >= NOT_AVAILABLE_ULL:
                missing.append("process_memory")
                if unknown is not None:
                    unknown.add(int(proc.pid))
                used = 0
            seen[proc.pid] = ProcessMemory(pid=int(proc.pid), used_mb=round(int(used) / MB, 1),
                                           task_id=self._task_of_pid(int(proc.pid)))
        return sorted(seen.values(), key=lambda p: p.pid)

    def _mig(self, index: int, handle: Any, missing: list[str], *,
             readings: bool = True) -> tuple[MigState | msgspec.UnsetType, list[Any] | None]:
        """The GPU's MIG state (``UNSET``: no MIG mode, no change pending) and its MIG
        devices' processes (``None``: read the processes from the GPU itself, as for any GPU:
        no MIG, MIG not on yet, or its devices unlisted).

        ``readings=False`` (per-task samples) lists the processes only. What a device is
        comes from the table the topology read filled; a device not in it is read once.
        """
        if index in self._no_mig:
            return msgspec.UNSET, None
        nvml = self._nvml
        try:
            mode = _read_mig_mode(nvml, handle)
        except nvml.NVMLError:
            missing.append("mig_mode")
            return msgspec.UNSET, None
        if mode is None:
            self._no_mig.add(index)
            return msgspec.UNSET, None
        enabled, pending = mode
        if not enabled:  # a whole GPU still, maybe about to be cut
            return (MigState(enabled=False, change_pending=True) if pending else msgspec.UNSET), None
        count = self._mig_max.get(index)
        if count is None:
            count = self._try(nvml.nvmlDeviceGetMaxMigDeviceCount, handle, missing=missing, field="mig_devices")
            if count is None:
                return MigState(enabled=True, change_pending=pending), None
            self._mig_max[index] = count = int(count)
        devices: list[MigDeviceSample] = []
        rows: list[Any] = []
        for mig_index, mig_handle in _mig_handles(nvml, handle, count, missing.append):
            procs = self._running("nvmlDeviceGetComputeRunningProcesses", mig_handle, missing)
            rows.extend(procs)
            if not readings:
                continue
            uuid = _text(self._try(nvml.nvmlDeviceGetUUID, mig_handle, default="", missing=missing, field="mig_uuid"))
            mem = self._try(nvml.nvmlDeviceGetMemoryInfo, mig_handle, missing=missing, field="mig_memory")
            info = self._mig_info.get(uuid) if uuid else None
            if info is None:
                refused: list[str] = []
                total = self._gpu_total.get(index) or _catalogue_total_bytes(
                    _text(self._try(nvml.nvmlDeviceGetName, handle, default="")))
                info = _mig_device_info(nvml, mig_index, mig_handle, uuid, total, refused.append)
                missing.extend(refused)
                if uuid and not refused:
                    self._mig_info[uuid] = info
            devices.append(MigDeviceSample(
                index=mig_index, uuid=uuid, gpu_instance_id=info.gpu_instance_id,
                compute_instance_id=info.compute_instance_id, profile=info.profile, gpu_slices=info.gpu_slices,
                compute_slices=info.compute_slices, memory_total_mb=round(mem.total / MB, 1) if mem is not None else 0.0,
                memory_used_mb=round(mem.used / MB, 1) if mem is not None else 0.0,
                pids=sorted({int(p.pid) for p in procs})))
        return MigState(enabled=True, change_pending=pending, devices=devices), rows

    def _context_switches(self, index: int, handle: Any, util_gpu: float, processes: int) -> Reading:
        # NVML has no context-switch counter. The rate is modelled from the number of
        # processes that got SM time in the last window (nvmlDeviceGetProcessUtilization)
        # and how busy the GPU is: SWITCH_RATE_PER_PEER * (active - 1) * busy.
        nvml = self._nvml
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, self._proc_util_ts[index])
        except nvml.NVMLError as exc:
            # NotFound: supported, but no process got SM time since the last read.
            samples = [] if exc.value == nvml.NVML_ERROR_NOT_FOUND else None
        busy = min(max(util_gpu, 0.0), 100.0) / 100.0
        if samples is not None:
            if samples:
                self._proc_util_ts[index] = max(int(s.timeStamp) for s in samples)
            active = len({s.pid for s in samples if getattr(s, "smUtil", 0) > 0})
            return Reading(value=SWITCH_RATE_PER_PEER * max(active - 1, 0) * busy, uncertainty_score=0.6)
        if processes:
            # Fallback: every resident process is assumed to contend (over-estimates).
            return Reading(value=SWITCH_RATE_PER_PEER * max(processes - 1, 0) * busy, uncertainty_score=0.8)
        return Reading(value=0.0, uncertainty_score=1.0)

    def _deltas(self, counter: str, index: int, tx: float, rx: float) -> tuple[float, float, float] | None:
        """``(tx delta, rx delta, seconds)`` of a cumulative counter pair, just read, since the
        last read of it on this GPU; ``None`` on the first read (or a clock that did not advance).

        The seconds are those between the two reads of the counter itself, not between the
        samples' stamps: a GPU read late in a sample (behind another GPU's slow call, or the
        first sample's 20 ms PCIe sampling calls) had its counter count for longer."""
        now = self._monotonic()
        prev = self._counters.get((counter, index))
        self._counters[(counter, index)] = (now, tx, rx)
        if prev is None or now <= prev[0]:
            return None
        return tx - prev[1], rx - prev[2], now - prev[0]

    def _nvlink_ratio(self, index: int, handle: Any) -> Reading:
        # Cumulative TX/RX data counters (KiB) per link through nvmlDeviceGetFieldValues; the
        # ratio is the busier direction's rate over active links x common link speed.
        nvml = self._nvml
        head = self._try(nvml.nvmlDeviceGetFieldValues, handle,
                         [nvml.NVML_FI_DEV_NVLINK_LINK_COUNT, nvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON])
        if head is None or head[0].nvmlReturn != 0:
            return Reading(value=0.0, uncertainty_score=1.0)
        links = int(field_number(head[0]))
        if links == 0:
            return Reading(value=0.0, uncertainty_score=0.0)  # no NVLink: exactly zero
        # A common speed of 0 (no link trained: fabric manager down, links in reset) says
        # nothing about the links' capacity; it is taken as unread, not divided by.
        speed_known = head[1].nvmlReturn == 0 and int(field_number(head[1])) > 0
        speed_mbps = float(field_number(head[1])) if speed_known else 25_000.0
        ids = [(f, link) for link in range(links)
               for f in (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)]
        values = self._try(nvml.nvmlDeviceGetFieldValues, handle, ids)
        if values is None or any(v.nvmlReturn != 0 for v in values):
            return Reading(value=0.0, uncertainty_score=1.0)
        tx = float(sum(field_number(v) for v in values[0::2]))
        rx = float(sum(field_number(v) for v in values[1::2]))
        deltas = self._deltas("nvlink", index, tx, rx)
        if deltas is None:
            return Reading(value=0.0, uncertainty_score=1.0)  # first read: no rate yet
        d_tx, d_rx, dt = deltas
        if d_tx < 0 or d_rx < 0:
            # The counters went back (reset by a GPU reset or ``nvidia-smi nvlink -r``, or
            # wrapped): no rate this time, like a first read; not an exact 0.
            return Reading(value=0.0, uncertainty_score=1.0)
        kib_per_s = max(d_tx, d_rx) / dt
        peak_kib_per_s = links * speed_mbps * 1e6 / 1024
        return Reading(value=round(min(kib_per_s / peak_kib_per_s, 1.0), 4),
                       uncertainty_score=0.1 if speed_known else 0.3)

    def _pcie_counts(self, handle: Any) -> tuple[int, int, int] | None:
        """The GPU's cumulative PCIe byte counters and where they wrap; ``None`` where the
        driver lacks them (``PcieCounterPoller`` calls this, from its own thread too)."""
        nvml = self._nvml
        ids = [getattr(nvml, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", None), getattr(nvml, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", None)]
        counts = self._try(nvml.nvmlDeviceGetFieldValues, handle, ids) if None not in ids else None
        if counts is None or any(c.nvmlReturn != 0 for c in counts):
            return None
        modulus = field_modulus(counts[0])
        if modulus is None or field_modulus(counts[1]) != modulus:
            return None
        return int(field_number(counts[0])), int(field_number(counts[1])), modulus

    def _pcie_top_rate(self, handle: Any) -> float:
        """The most bytes per second the GPU's PCIe link can carry each way: its own top
        generation and lane count, where the link could train up to them."""
        nvml = self._nvml
        generations = [self._try(getattr(nvml, name), handle) for name in
                       ("nvmlDeviceGetGpuMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration")
                       if hasattr(nvml, name)]
        known = [int(g) for g in generations if g]
        width = self._try(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
        return link_top_bytes_per_s(max(known) if known else None, int(width) if width else None)

    def _pcie_kbps(self, index: int, handle: Any, missing: list[str]) -> tuple[float, float]:
        # nvmlDeviceGetPcieThroughput samples the bus for 20 ms per call (21 ms measured on
        # an H200, two calls per GPU per reading). Where the driver has the cumulative byte
        # counters, the rate is what they counted since the last reading instead, kept exact
        # across their wraps by ``PcieCounterPoller``: microseconds to read, and the average
        # over the whole period rather than a 20 ms glimpse.
        rates = self._pcie.rate(index, handle)
        if rates is not None:
            return rates[0] / 1024.0, rates[1] / 1024.0
        # The first reading, a period whose count was lost, or no counters: the sampling call.
        nvml = self._nvml
        return tuple(float(self._try(nvml.nvmlDeviceGetPcieThroughput, handle, counter, default=0, missing=missing,
                                     field="pcie_throughput"))
                     for counter in (nvml.NVML_PCIE_UTIL_TX_BYTES, nvml.NVML_PCIE_UTIL_RX_BYTES))  # type: ignore[return-value]

    def _unopened_sample(self, index: int, now: float, reason: str | None = None) -> GpuSample:
        # A GPU NVML could not open, or one that fell off the bus while read (``reason``):
        # nothing known, no memory, the reason under ``nvml_error``; a lost GPU keeps the
        # uuid and name it was last read with, so it is still known as the same GPU.
        uuid, model = self._identity.get(index, ("", ""))
        return GpuSample(node=self.node, gpu=index, uuid=uuid, model=model, at=now, utilization_gpu_pct=0.0,
                         utilization_memory_pct=0.0, memory_total_mb=0.0, memory_used_mb=0.0, memory_free_mb=0.0,
                         temperature_c=0.0, power_w=0.0, power_limit_w=0.0, sm_clock_mhz=0.0, pcie_tx_kbps=0.0,
                         pcie_rx_kbps=0.0, xid_last=self._xid_last[index], xid_count=self._xid_count[index],
                         xid_codes=self._xid_codes_of(index),
                         labels={"driver_version": self._driver, "site": self.site,
                                 "nvml_error": reason if reason is not None else self._unopened[index]})

    def sample(self, node: str) -> list[GpuSample]:
        """One reading of every local GPU; unsupported fields default and are labelled
        (``nvml_unsupported``); a GPU NVML could not open, or one lost since (``GpuIsLost``),
        reads empty with the reason under ``nvml_error``."""
        self._check_node(node)
        self._drain_xids()
        now = self._clock()
        out = []
        for index, handle in enumerate(self._handles):
            if handle is None:
                out.append(self._unopened_sample(index, now))
                continue
            try:
                out.append(self._sample_gpu(index, handle, now))
            except _GpuLost as lost:
                # Not "every field unsupported" on a healthy GPU: the GPU is gone. Its other
                # reads would each fail the same way (and can be slow on a dead device).
                reason = str(lost)
                if index not in self._lost:
                    log.error("GPU %d of %s is lost (%s): reported empty with nvml_error until it answers again",
                              index, self.node, reason)
                self._lost[index] = reason
                out.append(self._unopened_sample(index, now, reason))
                continue
            if self._lost.pop(index, None) is not None:
                log.warning("GPU %d of %s answers NVML again; read as before", index, self.node)
                if index not in self._listened:
                    self._listen_again()  # and its XIDs listened to again
        return out

    def _sample_gpu(self, index: int, handle: Any, now: float) -> GpuSample:
        """One GPU's reading; raises ``_GpuLost`` when a read of its own says it is lost."""
        nvml = self._nvml
        missing: list[str] = []

        def call(fn: Callable[..., Any], *args: Any, default: Any = None, field: str = "",
                 _missing: list[str] = missing) -> Any:
            try:
                return fn(*args)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) == _NVML_ERROR_GPU_IS_LOST:
                    raise _GpuLost(str(exc)) from None
                if field:
                    _missing.append(field)
                return default

        util = call(nvml.nvmlDeviceGetUtilizationRates, handle, field="utilization")
        mem = call(nvml.nvmlDeviceGetMemoryInfo, handle, field="memory")
        util_gpu = float(util.gpu) if util is not None else 0.0
        corrected = call(nvml.nvmlDeviceGetTotalEccErrors, handle, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                         nvml.NVML_AGGREGATE_ECC, default=0, field="ecc")
        uncorrected = call(nvml.nvmlDeviceGetTotalEccErrors, handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                           nvml.NVML_AGGREGATE_ECC, default=0, field="ecc")
        retired = sum(len(call(nvml.nvmlDeviceGetRetiredPages, handle, cause, default=[], field="retired_pages") or [])
                      for cause in (nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                                    nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
        remap = call(nvml.nvmlDeviceGetRemappedRows, handle, default=(0, 0, 0, 0), field="remapped_rows")
        if mem is not None:
            self._gpu_total[index] = int(mem.total)
        mig, mig_rows = self._mig(index, handle, missing)
        processes = self._processes(handle, missing, rows=mig_rows)
        pcie_tx, pcie_rx = self._pcie_kbps(index, handle, missing)
        total_mb = mem.total / MB if mem is not None else 0.0
        used_mb = mem.used / MB if mem is not None else 0.0
        sample = GpuSample(
            node=self.node, gpu=index,
            uuid=_text(call(nvml.nvmlDeviceGetUUID, handle, default="", field="uuid")),
            model=_text(call(nvml.nvmlDeviceGetName, handle, default="", field="name")),
            at=now,
            utilization_gpu_pct=util_gpu,
            utilization_memory_pct=float(util.memory) if util is not None else 0.0,
            memory_total_mb=round(total_mb, 1), memory_used_mb=round(used_mb, 1),
            memory_free_mb=round(mem.free / MB, 1) if mem is not None else 0.0,
            temperature_c=float(call(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU,
                                     default=0, field="temperature")),
            power_w=float(call(nvml.nvmlDeviceGetPowerUsage, handle, default=0, field="power")) / 1000.0,
            power_limit_w=float(call(nvml.nvmlDeviceGetEnforcedPowerLimit, handle, default=0,
                                     field="power_limit")) / 1000.0,
            sm_clock_mhz=float(call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM, default=0,
                                    field="sm_clock")),
            pcie_tx_kbps=pcie_tx, pcie_rx_kbps=pcie_rx,
            ecc_corrected=int(corrected), ecc_uncorrected=int(uncorrected),
            retired_pages=retired, remapped_rows=int(remap[0]) + int(remap[1]),
            pcie_replays=int(call(nvml.nvmlDeviceGetPcieReplayCounter, handle, default=0, field="pcie_replays")),
            pcie_link_width=int(call(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle, default=0, field="pcie_link_width")),
            pcie_link_width_max=int(call(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle, default=0,
                                         field="pcie_link_width")),
            xid_last=self._xid_last[index], xid_count=self._xid_count[index],
            xid_codes=self._xid_codes_of(index),
            cuda_context_switches_per_sec=self._context_switches(index, handle, util_gpu, len(processes)),
            nvlink_bandwidth_utilization_ratio=self._nvlink_ratio(index, handle),
            processes=processes,
            labels={"driver_version": self._driver, "site": self.site,
                    **({"nvml_unsupported": ",".join(sorted(set(missing)))} if missing else {})},
            mig=mig,
        )
        if sample.uuid:
            self._identity[index] = (sample.uuid, sample.model)
        return sample

    def task_samples(self, node: str) -> list[TaskTelemetry]:
        """Per task (or ``pid-<pid>`` for processes without a task id): memory over its GPUs.

        A task with a process whose memory NVML cannot report (``usedGpuMemory`` not
        available) gets no sample: its memory is unknown, not the sum of the rest."""
        self._check_node(node)
        now = self._clock()
        nvml = self._nvml
        grouped: dict[str, tuple[set[int], float, set[int]]] = {}
        sm_util: dict[str, list[float]] = {}
        # Tasks with a process whose memory NVML cannot tell: a sum that leaves it out (or
        # counts it as 0) would teach the fingerprinter and the policy a peak far too low,
        # so no sample is sent for them at all.
        blind: set[str] = set()
        for index, handle in enumerate(self._handles):
            if handle is None or index in self._lost:
                continue  # a GPU NVML could not open, or lost at this tick's sample: no process is known on it
            # Timestamp 0 asks for every sample NVML still buffers; keep each PID's latest.
            latest: dict[int, tuple[int, float]] = {}
            for s in self._try(nvml.nvmlDeviceGetProcessUtilization, handle, 0, default=[]) or []:
                if s.pid not in latest or s.timeStamp > latest[s.pid][0]:
                    latest[s.pid] = (int(s.timeStamp), float(s.smUtil))
            unknown: set[int] = set()
            # On a MIG GPU from its slices: the GPU's own list gives no memory without privileges.
            _, mig_rows = self._mig(index, handle, [], readings=False)
            for proc in self._processes(handle, [], unknown, rows=mig_rows):
                key = proc.task_id or f"pid-{proc.pid}"
                if proc.pid in unknown:
                    blind.add(key)
                gpus, used, pids = grouped.get(key, (set(), 0.0, set()))
                grouped[key] = (gpus | {index}, used + proc.used_mb, pids | {proc.pid})
                sm_util.setdefault(key, []).append(latest.get(proc.pid, (0, 0.0))[1])
        return [TaskTelemetry(task_id=key, node=self.node, gpus=sorted(gpus), at=now, memory_used_mb=round(used, 1),
                              utilization_gpu_pct=round(sum(sm_util[key]) / len(sm_util[key]), 2), pids=sorted(pids))
                for key, (gpus, used, pids) in sorted(grouped.items()) if key not in blind]

    def topology(self, node: str) -> NodeTopology:
        """The node's graph from NVML (see ``topology_from_nvml``) plus sysfs NICs and driver params."""
        self._check_node(node)
        params = read_driver_params(self.root)
        labels = {"driver_version": self._driver, **{f"nvidia.{k}": v for k, v in params.items()}}
        topo = topology_from_nvml(self._nvml, self._handles, self.node, site=self.site, root=self.root, labels=labels)
        # The samples describe MIG devices from this table: rebuilt here, so a slice that
        # was destroyed and made again differently is described right from now on.
        self._mig_info = {d.uuid: d for g in topo.gpus if g.mig for d in g.mig.devices
                          if d.uuid and d.profile and d.gpu_instance_id is not None and d.compute_instance_id is not None}
        self._mig_max.update({g.index: g.mig.max_devices for g in topo.gpus if g.mig and g.mig.max_devices})
        return topo

    @property
    def pcie_poll_s(self) -> float | None:
        """How often a thread reads this node's PCIe byte counters so that none of their
        wraps is missed; ``None`` while none is polled (64-bit counters, or none at all)."""
        return self._pcie.poll_s

    def close(self) -> None:
        """Stop reading the PCIe counters, free the event set and shut NVML down."""
        self._pcie.close()
        if self._event_set is not None:
            self._try(self._nvml.nvmlEventSetFree, self._event_set)
        self._try(self._nvml.nvmlShutdown)


def topology_from_nvml(nvml: Any, handles: list[Any], node: str, *, site: str = "default",
                       root: str | Path = "/", labels: dict[str, str] | None = None) -> NodeTopology:
    """Build a ``NodeTopology`` from NVML.

    PCIe kinds come from ``nvmlDeviceGetTopologyCommonAncestor``; NVLinks from
    ``nvmlDeviceGetNvLinkState`` + ``nvmlDeviceGetNvLinkRemotePciInfo`` (links to another
    GPU's bus id count towards that pair; links to an NVSwitch make every pair of
    switch-attached GPUs ``NV<min links>``, as ``nvidia-smi`` shows; the far end's kind comes
    from ``nvmlDeviceGetNvLinkRemoteDeviceType``, so a link to a GPU not in ``handles`` or
    to a CPU (IBM NPU) counts for nothing; where that call is missing, any far end that is
    not a known GPU is taken for a switch); NUMA from
    ``nvmlDeviceGetNumaNodeId`` (falling back to ``/sys/bus/pci/devices/<bus>/numa_node``);
    CPU affinity from ``nvmlDeviceGetCpuAffinity``; NICs from sysfs InfiniBand ports; the
    node's ``cpu_milli`` and ``memory_mb`` from ``read_host_capacity`` (the policy places a
    task only where both hold its request: left at 0, no task asking for CPU or host memory
    ever ran on a real node); the
    MIG layout (mode, MIG devices, their profiles) from ``nvmlDeviceGetMigMode`` and the MIG
    device handles.

    A ``None`` in ``handles`` is a GPU NVML could not open: it keeps its index, with nothing
    known about it, and ``SYS`` to every other GPU.
    """

    def attempt(fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        try:
            return fn(*args)
        except nvml.NVMLError:
            return default

    root = Path(root)
    # One 64-bit word per 64 logical CPUs; at least 4 so a test box still reads 256.
    cpu_words = max(4, -(-(os.cpu_count() or 1) // 64))
    gpus: list[GpuInfo] = []
    bus_ids: list[str] = []
    for i, h in enumerate(handles):
        if h is None:
            gpus.append(GpuInfo(index=i, model=""))
            bus_ids.append("")
            continue
        pci = attempt(nvml.nvmlDeviceGetPciInfo, h)
        bus = _text(pci.busId).lower() if pci is not None else ""
        bus_ids.append(bus)
        numa = attempt(nvml.nvmlDeviceGetNumaNodeId, h)
        if numa is None or numa < 0:
            text = _read(root / "sys/bus/pci/devices" / bus[-12:] / "numa_node", "-1") if bus else "-1"
            numa = int(text) if text.lstrip("-").isdigit() and int(text) >= 0 else None
        mem = attempt(nvml.nvmlDeviceGetMemoryInfo, h)
        affinity = attempt(nvml.nvmlDeviceGetCpuAffinity, h, cpu_words)
        model = _text(attempt(nvml.nvmlDeviceGetName, h, default=""))
        total = int(mem.total) if mem is not None else _catalogue_total_bytes(model)
        layout = _mig_layout(nvml, h, total)
        gpus.append(GpuInfo(index=i, model=model,
                            uuid=_text(attempt(nvml.nvmlDeviceGetUUID, h, default="")),
                            memory_mb=int(mem.total // MB) if mem is not None else 0, numa_node=numa,
                            cpu_affinity=_cpu_ranges(affinity) if affinity is not None else "", pci_bus_id=bus,
                            mig=layout, labels={GPU_LABEL_MIG: "true"} if layout and layout.enabled else {}))

    pair_links: dict[tuple[int, int], int] = {}
    switch_links = [0] * len(handles)
    remote_type = getattr(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
    for i, h in enumerate(handles):
        for link in range(nvml.NVML_NVLINK_MAX_LINKS if h is not None else 0):
            state = attempt(nvml.nvmlDeviceGetNvLinkState, h, link)
            if state is None:
                break  # NotSupported / InvalidArgument: no (more) links on this GPU
            if state != nvml.NVML_FEATURE_ENABLED:
                continue
            remote = attempt(nvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
            remote_bus = _text(remote.busId).lower() if remote is not None else ""
            # An unread far end ("") is no GPU: "" is also the bus id of a GPU NVML could
            # not open, which must not collect the links nobody could place.
            if remote_bus and remote_bus in bus_ids:
                j = bus_ids.index(remote_bus)
                if j > i:
                    pair_links[(i, j)] = pair_links.get((i, j), 0) + 1
            elif remote_bus:
                # Only a switch joins this GPU to the others; a peer GPU outside ``handles``
                # (a container given part of the node) or a CPU's NPU joins it to none.
                kind = attempt(remote_type, h, link) if remote_type is not None else None
                if kind is None or kind == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                    switch_links[i] += 1

    links: list[Link] = []
    for i in range(len(handles)):
        for j in range(i + 1, len(handles)):
            nv = pair_links.get((i, j), 0)
            if switch_links[i] and switch_links[j]:
                nv = max(nv, min(switch_links[i], switch_links[j]))
            if nv:
                links.append(make_link(f"GPU{i}", f"GPU{j}", "NV", nv))
                continue
            level = (attempt(nvml.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
                     if handles[i] is not None and handles[j] is not None else None)
            links.append(make_link(f"GPU{i}", f"GPU{j}", _LEVEL_KIND.get(level, "SYS")))  # type: ignore[arg-type]

    nics: dict[str, list[NicPort]] = {}
    for port in read_ib_ports(root):
        nics.setdefault(port.device, []).append(NicPort(port=port.port, rate_gbps=port.rate_gbps,
                                                        link_layer=port.link_layer, state=port.state))
    nic_infos = []
    for name, ports in nics.items():
        text = _read(root / "sys/class/infiniband" / name / "device/numa_node", "-1")
        numa = int(text) if text.lstrip("-").isdigit() and int(text) >= 0 else None
        nic_infos.append(NicInfo(name=name, numa_node=numa, ports=ports))
    # GPU<->NIC kinds are not in NVML; NUMA gives a floor: same node NODE, otherwise SYS.
    for i, g in enumerate(gpus):
        for j, nic in enumerate(nic_infos):
            same = g.numa_node is not None and g.numa_node == nic.numa_node
            links.append(make_link(f"GPU{i}", f"NIC{j}", "NODE" if same else "SYS"))
    numa_ids = {g.numa_node for g in gpus if g.numa_node is not None}
    cpu_milli, memory_mb = read_host_capacity(root)
    return NodeTopology(node=node, site=site, cpu_sockets=max(len(numa_ids), 1), numa_nodes=max(len(numa_ids), 1),
                        cpu_milli=cpu_milli, memory_mb=memory_mb, gpus=gpus, nics=nic_infos, links=links,
                        labels=dict(labels or {}))
