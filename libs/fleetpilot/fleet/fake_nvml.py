"""A fake ``pynvml`` module for tests and demos without a driver.

``FakeNvml`` carries the same function names, constants (same values as nvidia-ml-py)
and error classes (``NVMLError`` with ``.value`` and the ``NVMLError_<Name>``
subclasses) that ``nvml_reader.NvmlReader`` uses, over a list of ``FakeGpu`` records a
test fills in. Any function named in ``FakeGpu.unsupported`` raises
``NVMLError_NotSupported`` for that GPU, which is how tests drive the reader's guards.
``FakeNvml.from_simulator`` mirrors one node of a ``SimulatedFleet``.

A GPU with ``mig_mode`` set models MIG: its ``mig_devices`` answer through MIG handles
(``nvmlDeviceGetMigDeviceHandleByIndex``; a ``None`` slot is an empty index, which raises
``NVMLError_NotFound`` as NVML does). While MIG is enabled the parent GPU answers as it
does for a caller without the MIG monitor capability (the collector's non-root container):
no utilisation (``NotSupported``), no aggregate memory (``NoPermission``) and its processes
without their memory (``usedGpuMemory`` not available) unless ``mig_privileged``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

# Constants, with nvidia-ml-py's values (a test holds them equal to the installed pynvml).
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
NVML_NVLINK_MAX_LINKS = 36
NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON = 90
NVML_FI_DEV_NVLINK_LINK_COUNT = 91
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_SYSTEM = 50
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
nvmlEventTypeXidCriticalError = 0x0000000000000008

CONSTANT_NAMES: tuple[str, ...] = tuple(name for name in dir() if name.startswith(("NVML_", "nvmlEventType")))


class NVMLError(Exception):
    """Same shape as pynvml's: ``NVMLError(value)`` builds the matching subclass."""

    _by_value: dict[int, type[NVMLError]] = {}
    value: int

    def __new__(cls, value: int = NVML_ERROR_UNKNOWN) -> NVMLError:  # noqa: D102 - mirrors pynvml
        if cls is NVMLError:
            cls = NVMLError._by_value.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int = NVML_ERROR_UNKNOWN) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        return f"NVML error {self.value}"


def _error_class(name: str, value: int) -> type[NVMLError]:
    def new(cls: type[NVMLError], *args: Any) -> NVMLError:
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    klass = type(name, (NVMLError,), {"__new__": new, "__init__": lambda self, *a: Exception.__init__(self, value)})
    NVMLError._by_value[value] = klass
    return klass


NVMLError_Uninitialized = _error_class("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _error_class("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _error_class("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _error_class("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_NotFound = _error_class("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_DriverNotLoaded = _error_class("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_Timeout = _error_class("NVMLError_Timeout", NVML_ERROR_TIMEOUT)
NVMLError_LibraryNotFound = _error_class("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_FunctionNotFound = _error_class("NVMLError_FunctionNotFound", NVML_ERROR_FUNCTION_NOT_FOUND)
NVMLError_GpuIsLost = _error_class("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)


class NVMLLibraryMismatchError(Exception):
    """pynvml's error for an unversioned call whose versioned entry point the driver lacks
    (``nvmlDeviceGetComputeRunningProcesses`` calls ``_v3``, absent before R510); like
    pynvml's, it is not an ``NVMLError``."""


@dataclass
class FakeMigDevice:
    """One MIG device (GPU instance + compute instance) of a ``FakeGpu``; units are NVML's."""

    uuid: str = "MIG-00000000-0000-0000-0000-000000000000"
    gpu_instance_id: int = 1
    compute_instance_id: int = 0
    gpu_slices: int = 1
    compute_slices: int = 1
    memory_size_mb: int = 9_728  # nvmlDeviceGetAttributes().memorySizeMB (an A100-80GB 1g.10gb)
    multiprocessors: int = 14
    memory_used: int = 0
    compute_procs: list[tuple[int, int | None]] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)


@dataclass
class FakeGpu:
    """What one fake GPU reports; units are NVML's (bytes, mW, KB/s, KiB counters)."""

    name: str = "NVIDIA A100-SXM4-40GB"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    pci_bus_id: str = "00000000:07:00.0"
    memory_total: int = 40 * 1024**3
    memory_used: int = 0
    util_gpu: int = 0
    util_memory: int = 0
    temperature: int = 35
    power_mw: int = 60_000
    power_limit_mw: int = 400_000
    sm_clock: int = 1410
    pcie_tx_kbs: int = 0
    pcie_rx_kbs: int = 0
    pcie_tx_bytes: int | None = None  # cumulative PCIe byte counters; None: the driver lacks them
    pcie_rx_bytes: int | None = None
    # Their width: an H200 on driver 580 reports 32 (valueType UNSIGNED_INT); 64 reads as
    # UNSIGNED_LONG_LONG. A counter is reported modulo 2**bits.
    pcie_counter_bits: int = 64
    # Traffic flowing in real time (time.monotonic) since the GPU was made: added to the
    # counters whenever they are read, as the hardware's would count it.
    pcie_bytes_per_s: tuple[float, float] = (0.0, 0.0)
    pcie_since: float = field(default_factory=time.monotonic)
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    retired_sbe: list[int] = field(default_factory=list)
    retired_dbe: list[int] = field(default_factory=list)
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)
    pcie_replays: int = 0
    link_width: int = 16
    link_width_max: int = 16
    link_gen_max: int = 4
    compute_procs: list[tuple[int, int]] = field(default_factory=list)
    graphics_procs: list[tuple[int, int]] = field(default_factory=list)
    proc_util: list[tuple[int, int, int]] = field(default_factory=list)  # (pid, timestamp_us, sm_util)
    nvlink_links: int = 0
    nvlink_speed_mbps: int = 25_000
    nvlink_remote_bus: list[str] = field(default_factory=list)
    nvlink_tx_kib: list[int] = field(default_factory=list)
    nvlink_rx_kib: list[int] = field(default_factory=list)
    numa_node: int = 0
    cpu_mask: tuple[int, ...] = (0xFFFF,)
    unsupported: set[str] = field(default_factory=set)
    # (current, pending) MIG mode; None: a GPU without MIG (nvmlDeviceGetMigMode: NotSupported).
    mig_mode: tuple[int, int] | None = None
    mig_max_devices: int = 7
    mig_devices: list[FakeMigDevice | None] = field(default_factory=list)
    mig_privileged: bool = False  # the caller holds the MIG monitor capability (root, CAP_SYS_ADMIN)
    # Fallen off the bus since NVML opened it (Xid 79): every call on its handle fails with
    # NVMLError_GpuIsLost, as the driver's do until the GPU is reset.
    lost: bool = False

    @property
    def mig_enabled(self) -> bool:
        """MIG mode is on now (whatever is pending)."""
        return self.mig_mode is not None and self.mig_mode[0] == NVML_DEVICE_MIG_ENABLE


class FakeNvml:
    """A stand-in for the ``pynvml`` module over ``FakeGpu`` records."""

    NVMLError = NVMLError
    NVMLLibraryMismatchError = NVMLLibraryMismatchError

    def __init__(self, gpus: list[FakeGpu], *, driver_version: str = "550.90.07", available: bool = True,
                 levels: dict[tuple[int, int], int] | None = None, driver_lacks: set[str] | None = None) -> None:
        for name in CONSTANT_NAMES:
            setattr(self, name, globals()[name])
        for name, value in globals().items():
            if name.startswith("NVMLError_"):
                setattr(self, name, value)
        self.gpus = gpus
        self.driver_version = driver_version
        self.available = available
        self.levels = dict(levels or {})
        # Versioned entry points the fake driver does not export (an old driver), e.g.
        # "nvmlDeviceGetComputeRunningProcesses_v3": the unversioned call then raises
        # NVMLLibraryMismatchError and the versioned one NVMLError_FunctionNotFound, as pynvml does.
        self.driver_lacks = set(driver_lacks or ())
        self.pending_xids: list[tuple[int, int]] = []
        self.initialised = False
        self.calls = 0
        self.calls_by_name: dict[str, int] = {}

    # -- helpers for tests -----------------------------------------------------------

    def push_xid(self, gpu: int, xid: int) -> None:
        """Queue an XID event as the driver would."""
        self.pending_xids.append((gpu, xid))

    def add_nvlink_traffic(self, gpu: int, tx_kib: int, rx_kib: int) -> None:
        """Add data to a GPU's cumulative NVLink counters, spread evenly over its links."""
        g = self.gpus[gpu]
        for link in range(g.nvlink_links):
            g.nvlink_tx_kib[link] += tx_kib // g.nvlink_links
            g.nvlink_rx_kib[link] += rx_kib // g.nvlink_links

    def _gpu(self, handle: Any, fn: str) -> FakeGpu:
        self.calls += 1
        self.calls_by_name[fn] = self.calls_by_name.get(fn, 0) + 1
        if not self.initialised:
            raise NVMLError_Uninitialized()
        if getattr(handle, "mig", None) is not None:
            raise NVMLError_NotSupported()  # a call NVML does not answer for a MIG device
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise NVMLError_GpuIsLost()
        if fn in gpu.unsupported:
            raise NVMLError_NotSupported()
        return gpu

    def _mig(self, handle: Any, fn: str) -> FakeMigDevice:
        self.calls += 1
        self.calls_by_name[fn] = self.calls_by_name.get(fn, 0) + 1
        if not self.initialised:
            raise NVMLError_Uninitialized()
        if self.gpus[handle.index].lost:
            raise NVMLError_GpuIsLost()  # its slices went with it
        slots = self.gpus[handle.index].mig_devices
        device = slots[handle.mig] if handle.mig < len(slots) else None
        if device is None:
            raise NVMLError_InvalidArgument()  # the MIG device was destroyed: a stale handle
        if fn in device.unsupported:
            raise NVMLError_NotSupported()
        return device

    @staticmethod
    def _is_mig(handle: Any) -> bool:
        return getattr(handle, "mig", None) is not None

    # -- library -----------------------------------------------------------------------

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        """Initialise; raises LibraryNotFound when the fake says no driver."""
        if not self.available:
            raise NVMLError_LibraryNotFound()
        self.initialised = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        """Shut down."""
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        """Driver version string."""
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        """Number of GPUs."""
        if not self.initialised:
            raise NVMLError_Uninitialized()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:  # noqa: N802
        """An opaque handle."""
        if not 0 <= index < len(self.gpus):
            raise NVMLError_InvalidArgument()
        return SimpleNamespace(index=index)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:  # noqa: N802
        """The handle's index."""
        return int(handle.index)

    # -- identity and basic readings -----------------------------------------------------

    def nvmlDeviceGetName(self, h: Any) -> str:  # noqa: N802
        """Product name."""
        return self._gpu(h, "nvmlDeviceGetName").name

    def nvmlDeviceGetUUID(self, h: Any) -> str:  # noqa: N802
        """GPU UUID, or the ``MIG-...`` UUID of a MIG handle."""
        if self._is_mig(h):
            return self._mig(h, "nvmlDeviceGetUUID").uuid
        return self._gpu(h, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:  # noqa: N802
        """PCI info with ``busId`` as bytes, like pynvml's struct."""
        return SimpleNamespace(busId=self._gpu(h, "nvmlDeviceGetPciInfo").pci_bus_id.encode())

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:  # noqa: N802
        """``.gpu`` and ``.memory`` in percent; NotSupported in MIG mode (and on a MIG handle)."""
        g = self._gpu(h, "nvmlDeviceGetUtilizationRates")
        if g.mig_enabled:
            raise NVMLError_NotSupported()
        return SimpleNamespace(gpu=g.util_gpu, memory=g.util_memory)

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: Any = None) -> Any:  # noqa: N802
        """``.total``, ``.used``, ``.free`` in bytes; of the slice for a MIG handle. In MIG
        mode the parent's aggregate needs the MIG monitor capability (else NoPermission)."""
        if self._is_mig(h):
            m = self._mig(h, "nvmlDeviceGetMemoryInfo")
            total = m.memory_size_mb * 1024**2
            return SimpleNamespace(total=total, used=m.memory_used, free=total - m.memory_used)
        g = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        if g.mig_enabled and not g.mig_privileged:
            raise NVMLError_NoPermission()
        return SimpleNamespace(total=g.memory_total, used=g.memory_used, free=g.memory_total - g.memory_used)

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:  # noqa: N802
        """Core temperature in C."""
        return self._gpu(h, "nvmlDeviceGetTemperature").temperature

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:  # noqa: N802
        """Board power in mW."""
        return self._gpu(h, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: Any) -> int:  # noqa: N802
        """Power limit in mW."""
        return self._gpu(h, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw

    def nvmlDeviceGetClockInfo(self, h: Any, clock: int) -> int:  # noqa: N802
        """Current clock in MHz."""
        return self._gpu(h, "nvmlDeviceGetClockInfo").sm_clock

    def nvmlDeviceGetPcieThroughput(self, h: Any, counter: int) -> int:  # noqa: N802
        """PCIe throughput in KB/s over the last 20 ms."""
        g = self._gpu(h, "nvmlDeviceGetPcieThroughput")
        return g.pcie_tx_kbs if counter == NVML_PCIE_UTIL_TX_BYTES else g.pcie_rx_kbs

    # -- health ------------------------------------------------------------------------

    def nvmlDeviceGetTotalEccErrors(self, h: Any, error_type: int, counter_type: int) -> int:  # noqa: N802
        """ECC error count of one type."""
        g = self._gpu(h, "nvmlDeviceGetTotalEccErrors")
        return g.ecc_corrected if error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED else g.ecc_uncorrected

    def nvmlDeviceGetRetiredPages(self, h: Any, cause: int) -> list[int]:  # noqa: N802
        """Addresses of pages retired for ``cause``."""
        g = self._gpu(h, "nvmlDeviceGetRetiredPages")
        return list(g.retired_sbe if cause == NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS else g.retired_dbe)

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, int, int, int]:  # noqa: N802
        """(correctable, uncorrectable, pending, failure)."""
        return self._gpu(h, "nvmlDeviceGetRemappedRows").remapped

    def nvmlDeviceGetPcieReplayCounter(self, h: Any) -> int:  # noqa: N802
        """PCIe replay count."""
        return self._gpu(h, "nvmlDeviceGetPcieReplayCounter").pcie_replays

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: Any) -> int:  # noqa: N802
        """Current PCIe lanes."""
        return self._gpu(h, "nvmlDeviceGetCurrPcieLinkWidth").link_width

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, h: Any) -> int:  # noqa: N802
        """The GPU's top PCIe generation."""
        return self._gpu(h, "nvmlDeviceGetGpuMaxPcieLinkGeneration").link_gen_max

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: Any) -> int:  # noqa: N802
        """Maximum PCIe lanes."""
        return self._gpu(h, "nvmlDeviceGetMaxPcieLinkWidth").link_width_max

    # -- processes ---------------------------------------------------------------------

    def _running(self, h: Any, kind: str, version: str) -> list[Any]:
        if f"nvmlDeviceGet{kind}RunningProcesses_{version}" in self.driver_lacks:
            raise NVMLError_FunctionNotFound()
        if self._is_mig(h):
            if kind != "Compute":
                raise NVMLError_NotSupported()  # no graphics on MIG
            m = self._mig(h, "nvmlDeviceGetComputeRunningProcesses")
            return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in m.compute_procs]
        g = self._gpu(h, f"nvmlDeviceGet{kind}RunningProcesses")
        if g.mig_enabled and kind == "Compute":
            # The parent lists every slice's processes; their memory only for a privileged caller.
            return [SimpleNamespace(pid=pid, usedGpuMemory=used if g.mig_privileged else None)
                    for m in g.mig_devices if m is not None for pid, used in m.compute_procs]
        procs = g.compute_procs if kind == "Compute" else g.graphics_procs
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in procs]

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:  # noqa: N802
        """Compute processes with ``pid`` and ``usedGpuMemory`` (bytes), through ``_v3`` as pynvml's."""
        try:
            return self._running(h, "Compute", "v3")
        except NVMLError_FunctionNotFound:
            raise NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match "
                                           "the NVML lib version") from None

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: Any) -> list[Any]:  # noqa: N802
        """Compute processes through the pre-R510 entry point."""
        return self._running(h, "Compute", "v2")

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: Any) -> list[Any]:  # noqa: N802
        """Graphics processes with ``pid`` and ``usedGpuMemory`` (bytes), through ``_v3`` as pynvml's."""
        try:
            return self._running(h, "Graphics", "v3")
        except NVMLError_FunctionNotFound:
            raise NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match "
                                           "the NVML lib version") from None

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, h: Any) -> list[Any]:  # noqa: N802
        """Graphics processes through the pre-R510 entry point."""
        return self._running(h, "Graphics", "v2")

    def nvmlDeviceGetProcessUtilization(self, h: Any, since: int) -> list[Any]:  # noqa: N802
        """Per-process utilisation samples newer than ``since`` (µs); NotFound when none."""
        g = self._gpu(h, "nvmlDeviceGetProcessUtilization")
        if g.mig_enabled:
            raise NVMLError_NotSupported()  # not supported on MIG-enabled GPUs
        rows = [SimpleNamespace(pid=pid, timeStamp=ts, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)
                for pid, ts, sm in g.proc_util if ts > since]
        if not rows:
            raise NVMLError_NotFound()
        return rows

    # -- MIG ---------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, h: Any) -> list[int]:  # noqa: N802
        """``[current, pending]`` MIG mode; NotSupported on a GPU without MIG."""
        g = self._gpu(h, "nvmlDeviceGetMigMode")
        if g.mig_mode is None:
            raise NVMLError_NotSupported()
        return list(g.mig_mode)

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> int:  # noqa: N802
        """How many MIG devices the GPU can hold; NotSupported on a GPU without MIG."""
        g = self._gpu(h, "nvmlDeviceGetMaxMigDeviceCount")
        if g.mig_mode is None:
            raise NVMLError_NotSupported()
        return g.mig_max_devices

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, index: int) -> Any:  # noqa: N802
        """The MIG handle at ``index``; NotFound for an empty index, InvalidArgument past the
        maximum, NotSupported with MIG off."""
        g = self._gpu(h, "nvmlDeviceGetMigDeviceHandleByIndex")
        if not g.mig_enabled:
            raise NVMLError_NotSupported()
        if not 0 <= index < g.mig_max_devices:
            raise NVMLError_InvalidArgument()
        if index >= len(g.mig_devices) or g.mig_devices[index] is None:
            raise NVMLError_NotFound()
        return SimpleNamespace(index=h.index, mig=index)

    def nvmlDeviceGetGpuInstanceId(self, h: Any) -> int:  # noqa: N802
        """The GPU instance id of a MIG handle."""
        if not self._is_mig(h):
            raise NVMLError_InvalidArgument()
        return self._mig(h, "nvmlDeviceGetGpuInstanceId").gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, h: Any) -> int:  # noqa: N802
        """The compute instance id of a MIG handle."""
        if not self._is_mig(h):
            raise NVMLError_InvalidArgument()
        return self._mig(h, "nvmlDeviceGetComputeInstanceId").compute_instance_id

    def nvmlDeviceGetAttributes(self, h: Any) -> Any:  # noqa: N802
        """Slice counts, memory size (MiB) and SM count of a MIG handle (the only handle
        NVML answers this for)."""
        if not self._is_mig(h):
            self._gpu(h, "nvmlDeviceGetAttributes")
            raise NVMLError_NotSupported()
        m = self._mig(h, "nvmlDeviceGetAttributes")
        return SimpleNamespace(multiprocessorCount=m.multiprocessors, sharedCopyEngineCount=0, sharedDecoderCount=0,
                               sharedEncoderCount=0, sharedJpegCount=0, sharedOfaCount=0,
                               gpuInstanceSliceCount=m.gpu_slices, computeInstanceSliceCount=m.compute_slices,
                               memorySizeMB=m.memory_size_mb)

    # -- events ------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> Any:  # noqa: N802
        """An event set."""
        return SimpleNamespace(registered=set())

    def nvmlDeviceRegisterEvents(self, h: Any, event_types: int, event_set: Any) -> None:  # noqa: N802
        """Register a GPU's events on a set."""
        self._gpu(h, "nvmlDeviceRegisterEvents")
        event_set.registered.add(h.index)

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:  # noqa: N802
        """Pop the next pending XID of a registered GPU, or raise Timeout. As a real driver
        after Xid 79, a set holding a lost GPU delivers that GPU's own pending XIDs (its 79),
        then answers GpuIsLost to every wait, whatever the other GPUs have pending."""
        lost = {index for index in event_set.registered if self.gpus[index].lost}
        for k, (gpu, xid) in enumerate(self.pending_xids):
            if gpu in event_set.registered and (not lost or gpu in lost):
                del self.pending_xids[k]
                return SimpleNamespace(device=SimpleNamespace(index=gpu), eventType=nvmlEventTypeXidCriticalError,
                                       eventData=xid)
        if lost:
            raise NVMLError_GpuIsLost()
        raise NVMLError_Timeout()

    def nvmlEventSetFree(self, event_set: Any) -> None:  # noqa: N802
        """Free an event set."""

    # -- NVLink and topology -------------------------------------------------------------

    def nvmlDeviceGetFieldValues(self, h: Any, field_ids: list[Any]) -> list[Any]:  # noqa: N802
        """Field values; ids are ints or ``(field, scope)`` tuples (scope = link)."""
        g = self._gpu(h, "nvmlDeviceGetFieldValues")
        out = []
        for item in field_ids:
            fid, scope = item if isinstance(item, tuple) else (item, 0)
            ret, ui, ull, value_type = NVML_SUCCESS, 0, 0, NVML_VALUE_TYPE_UNSIGNED_INT
            if f"field:{fid}" in g.unsupported:
                ret = NVML_ERROR_NOT_SUPPORTED
            elif fid == NVML_FI_DEV_NVLINK_LINK_COUNT:
                ui = g.nvlink_links
            elif fid == NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON:
                ui = g.nvlink_speed_mbps
            elif fid in (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX):
                if scope >= g.nvlink_links:
                    ret = NVML_ERROR_INVALID_ARGUMENT
                else:
                    ull = (g.nvlink_tx_kib if fid == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX else g.nvlink_rx_kib)[scope]
                    value_type = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            elif fid in (NVML_FI_DEV_PCIE_COUNT_TX_BYTES, NVML_FI_DEV_PCIE_COUNT_RX_BYTES):
                tx = fid == NVML_FI_DEV_PCIE_COUNT_TX_BYTES
                count = g.pcie_tx_bytes if tx else g.pcie_rx_bytes
                if count is None:
                    ret = NVML_ERROR_NOT_SUPPORTED
                else:
                    flowed = g.pcie_bytes_per_s[0 if tx else 1] * (time.monotonic() - g.pcie_since)
                    ull = (count + int(flowed)) % (1 << g.pcie_counter_bits)
                    ui = ull & 0xFFFFFFFF
                    value_type = NVML_VALUE_TYPE_UNSIGNED_INT if g.pcie_counter_bits <= 32 \
                        else NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            else:
                ret = NVML_ERROR_NOT_SUPPORTED
            if value_type == NVML_VALUE_TYPE_UNSIGNED_INT:
                ull = ui  # one union: the 32-bit member is the low half of the 64-bit one
            out.append(SimpleNamespace(fieldId=fid, scopeId=scope, nvmlReturn=ret, valueType=value_type,
                                       value=SimpleNamespace(uiVal=ui, ullVal=ull, dVal=float(ull))))
        return out

    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:  # noqa: N802
        """ENABLED for the GPU's links; InvalidArgument past them (as real NVML does)."""
        g = self._gpu(h, "nvmlDeviceGetNvLinkState")
        if link >= g.nvlink_links:
            raise NVMLError_InvalidArgument()
        return NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: Any, link: int) -> Any:  # noqa: N802
        """The PCI bus id at the far end of a link (a GPU or an NVSwitch)."""
        g = self._gpu(h, "nvmlDeviceGetNvLinkRemotePciInfo")
        return SimpleNamespace(busId=g.nvlink_remote_bus[link].encode())

    def nvmlDeviceGetTopologyCommonAncestor(self, h1: Any, h2: Any) -> int:  # noqa: N802
        """Level from ``levels`` (default: same NUMA node -> NODE, else SYSTEM)."""
        a, b = self._gpu(h1, "nvmlDeviceGetTopologyCommonAncestor"), self.gpus[h2.index]
        key = (min(h1.index, h2.index), max(h1.index, h2.index))
        if key in self.levels:
            return self.levels[key]
        return NVML_TOPOLOGY_NODE if a.numa_node == b.numa_node else NVML_TOPOLOGY_SYSTEM

    def nvmlDeviceGetNumaNodeId(self, h: Any) -> int:  # noqa: N802
        """NUMA node of the GPU."""
        return self._gpu(h, "nvmlDeviceGetNumaNodeId").numa_node

    def nvmlDeviceGetCpuAffinity(self, h: Any, words: int) -> list[int]:  # noqa: N802
        """CPU affinity bitmask as 64-bit words."""
        mask = list(self._gpu(h, "nvmlDeviceGetCpuAffinity").cpu_mask)
        return (mask + [0] * words)[:words]

    # -- building from the simulator -----------------------------------------------------

    @classmethod
    def from_simulator(cls, sim: Any, node: str) -> FakeNvml:
        """A fake whose GPUs report what ``sim.sample(node)`` reports (NVML units)."""
        topo = sim.topology(node)
        gpus = []
        for s, info in zip(sim.sample(node), topo.gpus, strict=True):
            gpus.append(FakeGpu(
                name=s.model, uuid=s.uuid, pci_bus_id=info.pci_bus_id, memory_total=int(s.memory_total_mb * 1024**2),
                memory_used=int(s.memory_used_mb * 1024**2), util_gpu=int(round(s.utilization_gpu_pct)),
                util_memory=int(round(s.utilization_memory_pct)), temperature=int(round(s.temperature_c)),
                power_mw=int(s.power_w * 1000), power_limit_mw=int(s.power_limit_w * 1000), sm_clock=int(s.sm_clock_mhz),
                pcie_tx_kbs=int(s.pcie_tx_kbps), pcie_rx_kbs=int(s.pcie_rx_kbps), ecc_corrected=s.ecc_corrected,
                ecc_uncorrected=s.ecc_uncorrected, retired_sbe=list(range(s.retired_pages)),
                remapped=(s.remapped_rows, 0, 0, 0), pcie_replays=s.pcie_replays, link_width=s.pcie_link_width,
                link_width_max=s.pcie_link_width_max,
                compute_procs=[(p.pid, int(p.used_mb * 1024**2)) for p in s.processes],
                numa_node=info.numa_node or 0,
            ))
        return cls(gpus, driver_version=topo.labels.get("driver_version", "550.90.07"))
