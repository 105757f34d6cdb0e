"""The NVML backend against the fake NVML module: every field, every guard, sysfs inputs."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pynvml
import pytest
from fleetpilot.contracts.telemetry import GpuSample
from fleetpilot.fleet import fake_nvml
from fleetpilot.fleet.fake_nvml import CONSTANT_NAMES, FakeGpu, FakeNvml
from fleetpilot.fleet.inventory import load_fleet_spec
from fleetpilot.fleet.nvml_reader import (
    SWITCH_RATE_PER_PEER,
    NvmlReader,
    mig_profile_name,
    nvml_available,
    read_driver_params,
    read_ib_ports,
    topology_from_nvml,
)
from fleetpilot.fleet.reader import GpuReader
from fleetpilot.fleet.simulator import SimulatedFleet
from fleetpilot.workload.growth import MemoryGrowth

GIB = 1024**3
SWITCH_BUS = "00000000:C0:00.0"


def rich_gpu(i: int) -> FakeGpu:
    """A GPU on which every reading is non-default."""
    return FakeGpu(
        name="NVIDIA A100-SXM4-80GB", uuid=f"GPU-{i:08d}-aaaa", pci_bus_id=f"00000000:{0x07 + 0x10 * i:02X}:00.0",
        memory_total=80 * GIB, memory_used=30 * GIB, util_gpu=90, util_memory=45, temperature=66, power_mw=350_500,
        power_limit_mw=400_000, sm_clock=1_380, pcie_tx_kbs=1_200, pcie_rx_kbs=3_400, ecc_corrected=12,
        ecc_uncorrected=1, retired_sbe=[0x1000, 0x2000], retired_dbe=[0x3000], remapped=(2, 1, 0, 0), pcie_replays=7,
        link_width=8, link_width_max=16, compute_procs=[(4242, 20 * GIB)], graphics_procs=[(4343, 1 * GIB)],
        proc_util=[(4242, 100, 60), (4343, 100, 25), (4444, 100, 10)], nvlink_links=12,
        nvlink_remote_bus=[SWITCH_BUS] * 12, nvlink_tx_kib=[0] * 12, nvlink_rx_kib=[0] * 12,
        numa_node=i // 4, cpu_mask=(0xFF << (8 * (i // 4)),),
    )


class Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


def make_reader(gpus: list[FakeGpu], tmp_path: Path | None = None, **kw) -> tuple[NvmlReader, FakeNvml, Clock]:
    fake, clock = FakeNvml(gpus), Clock()
    reader = NvmlReader(fake, node="n1", root=tmp_path or "/nonexistent-root", clock=clock, **kw)
    return reader, fake, clock


def test_fake_constants_and_errors_match_the_real_module() -> None:
    for name in CONSTANT_NAMES:
        assert getattr(pynvml, name) == getattr(fake_nvml, name), name
    for name in ("NVMLError_NotSupported", "NVMLError_Timeout", "NVMLError_NotFound", "NVMLError_LibraryNotFound",
                 "NVMLError_FunctionNotFound", "NVMLError_GpuIsLost"):
        real, fake = getattr(pynvml, name), getattr(fake_nvml, name)
        assert real().value == fake().value
        assert issubclass(fake, fake_nvml.NVMLError)
    assert type(fake_nvml.NVMLError(3)) is fake_nvml.NVMLError_NotSupported
    for fn in [n for n in dir(FakeNvml) if n.startswith("nvml")]:
        assert hasattr(pynvml, fn), fn


def test_nvml_available_is_false_cleanly_without_a_driver() -> None:
    assert isinstance(nvml_available(), bool)
    assert nvml_available(FakeNvml([], available=False)) is False
    assert nvml_available(FakeNvml([FakeGpu()])) is True


def test_every_schema_field_is_filled() -> None:
    reader, fake, clock = make_reader([rich_gpu(0), rich_gpu(1)], task_of_pid=lambda pid: f"task-{pid}")
    fake.push_xid(0, 31)
    reader.sample("n1")
    fake.add_nvlink_traffic(0, 2 * 10**6 * 12, 10**6 * 12)
    fake.gpus[0].proc_util.extend([(4242, 200, 55), (4343, 200, 20)])  # only samples newer than the last read count
    clock.t += 10
    s = reader.sample("n1")[0]
    defaults = GpuSample(node="", gpu=0, uuid="", model="", at=0, utilization_gpu_pct=0, utilization_memory_pct=0,
                         memory_total_mb=0, memory_used_mb=0, memory_free_mb=0, temperature_c=0, power_w=0,
                         power_limit_w=0, sm_clock_mhz=0, pcie_tx_kbps=0, pcie_rx_kbps=0)
    for field in msgspec.structs.fields(GpuSample):
        if field.name in ("gpu", "mig"):  # mig: None on a GPU without MIG (the MIG tests below fill it)
            continue
        assert getattr(s, field.name) != getattr(defaults, field.name), field.name
    assert (s.memory_total_mb, s.memory_used_mb, s.memory_free_mb) == (81_920, 30_720, 51_200)
    assert (s.power_w, s.power_limit_w, s.sm_clock_mhz, s.temperature_c) == (350.5, 400.0, 1_380, 66)
    assert (s.ecc_corrected, s.ecc_uncorrected, s.retired_pages, s.remapped_rows, s.pcie_replays) == (12, 1, 3, 3, 7)
    assert (s.pcie_link_width, s.pcie_link_width_max, s.xid_last, s.xid_count) == (8, 16, 31, 1)
    assert [(p.pid, p.used_mb, p.task_id) for p in s.processes] == [(4242, 20_480, "task-4242"), (4343, 1_024, "task-4343")]
    assert s.cuda_context_switches_per_sec.value == pytest.approx(SWITCH_RATE_PER_PEER * 1 * 0.9)
    # 2e6 KiB/link-set over 10 s vs 12 links x 25,000 MB/s.
    expected = (2 * 10**6 * 12 / 12 * 12) / 10 / (12 * 25_000 * 1e6 / 1024)
    assert s.nvlink_bandwidth_utilization_ratio.value == pytest.approx(expected, rel=1e-3)
    assert s.nvlink_bandwidth_utilization_ratio.uncertainty_score == 0.1
    assert s.labels == {"driver_version": "550.90.07", "site": "default"}
    assert isinstance(reader, GpuReader) and reader.source == "nvml" and reader.node_names() == ["n1"]


GUARDED = [
    ("nvmlDeviceGetUtilizationRates", "utilization"), ("nvmlDeviceGetMemoryInfo", "memory"),
    ("nvmlDeviceGetTemperature", "temperature"), ("nvmlDeviceGetPowerUsage", "power"),
    ("nvmlDeviceGetEnforcedPowerLimit", "power_limit"), ("nvmlDeviceGetClockInfo", "sm_clock"),
    ("nvmlDeviceGetPcieThroughput", "pcie_throughput"), ("nvmlDeviceGetTotalEccErrors", "ecc"),
    ("nvmlDeviceGetRetiredPages", "retired_pages"), ("nvmlDeviceGetRemappedRows", "remapped_rows"),
    ("nvmlDeviceGetPcieReplayCounter", "pcie_replays"), ("nvmlDeviceGetCurrPcieLinkWidth", "pcie_link_width"),
    ("nvmlDeviceGetMaxPcieLinkWidth", "pcie_link_width"), ("nvmlDeviceGetComputeRunningProcesses", "processes"),
    ("nvmlDeviceGetGraphicsRunningProcesses", "processes"), ("nvmlDeviceGetUUID", "uuid"),
    ("nvmlDeviceGetName", "name"), ("nvmlDeviceGetProcessUtilization", None),
    ("nvmlDeviceGetFieldValues", None), ("nvmlDeviceRegisterEvents", None),
]


@pytest.mark.parametrize(("function", "label"), GUARDED)
def test_not_supported_yields_defaults_not_a_crash(function: str, label: str | None) -> None:
    broken = rich_gpu(1)
    broken.unsupported = {function}
    reader, fake, clock = make_reader([rich_gpu(0), broken])
    fake.push_xid(1, 79)
    reader.sample("n1")
    clock.t += 5
    good, bad = reader.sample("n1")
    assert "nvml_unsupported" not in good.labels
    if label is not None:
        assert label in bad.labels["nvml_unsupported"].split(",")
    else:
        assert "nvml_unsupported" not in bad.labels
    if function == "nvmlDeviceGetFieldValues":
        assert bad.nvlink_bandwidth_utilization_ratio.uncertainty_score == 1.0
    if function == "nvmlDeviceGetProcessUtilization":
        # Falls back to resident processes: a rougher guess, so more doubt.
        assert bad.cuda_context_switches_per_sec.uncertainty_score > good.cuda_context_switches_per_sec.uncertainty_score
    if function == "nvmlDeviceRegisterEvents":
        assert bad.xid_count == 0
    else:
        assert bad.xid_last == 79


def test_no_nvlink_is_an_exact_zero_and_unsupported_fields_are_unknown() -> None:
    plain = FakeGpu(nvlink_links=0)
    hidden = FakeGpu(nvlink_links=4, nvlink_tx_kib=[0] * 4, nvlink_rx_kib=[0] * 4, nvlink_remote_bus=[SWITCH_BUS] * 4,
                     unsupported={"field:138"})
    reader, _, clock = make_reader([plain, hidden])
    reader.sample("n1")
    clock.t += 1
    a, b = reader.sample("n1")
    assert (a.nvlink_bandwidth_utilization_ratio.value, a.nvlink_bandwidth_utilization_ratio.uncertainty_score) == (0.0, 0.0)
    assert b.nvlink_bandwidth_utilization_ratio.uncertainty_score == 1.0


@pytest.mark.parametrize(("proc_util", "unsupported", "value", "doubt"), [
    ([(1, 10, 50), (2, 10, 40), (3, 10, 0)], set(), SWITCH_RATE_PER_PEER * 1 * 0.8, 0.6),   # 2 active of 3
    ([], set(), 0.0, 0.6),                                                                   # NotFound: none active
    ([], {"nvmlDeviceGetProcessUtilization"}, SWITCH_RATE_PER_PEER * 2 * 0.8, 0.8),          # 3 resident
    ([], {"nvmlDeviceGetProcessUtilization", "nvmlDeviceGetComputeRunningProcesses",
          "nvmlDeviceGetGraphicsRunningProcesses"}, 0.0, 1.0),                               # nothing known
])
def test_context_switch_rate_derivation(proc_util, unsupported, value: float, doubt: float) -> None:
    gpu = FakeGpu(util_gpu=80, proc_util=proc_util, compute_procs=[(1, GIB), (2, GIB), (3, GIB)], unsupported=unsupported)
    reader, _, _ = make_reader([gpu])
    (s,) = reader.sample("n1")
    assert s.cuda_context_switches_per_sec.value == pytest.approx(value)
    assert s.cuda_context_switches_per_sec.uncertainty_score == doubt


def test_xid_events_are_drained_once() -> None:
    reader, fake, _ = make_reader([FakeGpu(), FakeGpu()])
    fake.push_xid(1, 48)
    fake.push_xid(1, 63)
    events = reader.events()
    assert [(e.kind, e.gpu, e.value) for e in events] == [("xid", 1, 48), ("xid", 1, 63)]
    assert reader.events() == []
    assert reader.sample("n1")[1].xid_count == 2 and reader.sample("n1")[1].xid_last == 63


def test_xids_are_counted_code_by_code() -> None:
    """A double-bit error is followed by cleanups of the contexts it killed (XID 45): the
    last code alone would say only "cleanup". Each code keeps its own count, as the total."""
    reader, fake, _ = make_reader([FakeGpu(), FakeGpu()])
    for code in (48, 45, 45):
        fake.push_xid(1, code)
    first = reader.sample("n1")[1]
    fake.push_xid(1, 45)
    second = reader.sample("n1")[1]
    assert (first.xid_last, first.xid_count, first.xid_codes) == (45, 3, {48: 1, 45: 2})
    assert (second.xid_count, second.xid_codes) == (4, {48: 1, 45: 3})
    assert not reader.sample("n1")[0].xid_codes  # none raised: left out of the sample


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def sysfs(root: Path) -> None:
    write(root, "proc/driver/nvidia/params", "ResmanDebugLevel: 4294967295\nEnableMSI: 1\nNVreg_EnableGpuFirmware: 18\n")
    for dev, numa, layer, rate in (("mlx5_0", 0, "InfiniBand", "200 Gb/sec (4X HDR)"),
                                   ("mlx5_1", 1, "Ethernet", "400 Gb/sec (4X NDR)")):
        write(root, f"sys/class/infiniband/{dev}/device/numa_node", f"{numa}\n")
        write(root, f"sys/class/infiniband/{dev}/ports/1/rate", rate)
        write(root, f"sys/class/infiniband/{dev}/ports/1/link_layer", layer)
        write(root, f"sys/class/infiniband/{dev}/ports/1/state", "4: ACTIVE")
        write(root, f"sys/class/infiniband/{dev}/ports/1/counters/port_xmit_data", "1000")
        write(root, f"sys/class/infiniband/{dev}/ports/1/counters/port_rcv_data", "250\n")
    write(root, "proc/4242/environ", "PATH=/usr/bin\0FLEETPILOT_TASK_ID=train-17\0HOME=/root\0")


def test_sysfs_ports_and_driver_params(tmp_path: Path) -> None:
    sysfs(tmp_path)
    ports = read_ib_ports(tmp_path)
    assert [(p.device, p.port, p.rate_gbps, p.link_layer, p.state, p.xmit_bytes, p.rcv_bytes) for p in ports] == [
        ("mlx5_0", 1, 200.0, "InfiniBand", "ACTIVE", 4000, 1000), ("mlx5_1", 1, 400.0, "Ethernet", "ACTIVE", 4000, 1000)]
    assert read_driver_params(tmp_path)["EnableMSI"] == "1"
    assert read_ib_ports(tmp_path / "missing") == [] and read_driver_params(tmp_path / "missing") == {}


def test_task_ids_come_from_process_environment(tmp_path: Path) -> None:
    sysfs(tmp_path)
    reader, _, _ = make_reader([rich_gpu(0)], tmp_path)
    assert [p.task_id for p in reader.sample("n1")[0].processes] == ["train-17", None]
    tasks = {t.task_id: t for t in reader.task_samples("n1")}
    assert set(tasks) == {"train-17", "pid-4343"}
    assert tasks["train-17"].memory_used_mb == 20_480 and tasks["train-17"].utilization_gpu_pct == 60


def test_topology_from_nvml_with_nvswitch_and_sysfs(tmp_path: Path) -> None:
    sysfs(tmp_path)
    gpus = [rich_gpu(i) for i in range(8)]
    gpus[7].unsupported = {"nvmlDeviceGetNumaNodeId"}
    write(tmp_path, "sys/bus/pci/devices/0000:77:00.0/numa_node", "1\n")
    reader, _, _ = make_reader(gpus, tmp_path)
    topo = reader.topology("n1")
    assert {(link.kind, link.nvlinks) for link in topo.links if link.b.startswith("GPU")} == {("NV", 12)}
    assert [g.numa_node for g in topo.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.gpus[0].cpu_affinity == "0-7" and topo.gpus[4].cpu_affinity == "8-15"
    assert [(n.name, n.numa_node, n.ports[0].rate_gbps) for n in topo.nics] == [("mlx5_0", 0, 200.0), ("mlx5_1", 1, 400.0)]
    assert topo.labels["nvidia.EnableMSI"] == "1" and topo.labels["driver_version"] == "550.90.07"
    kinds = {(link.a, link.b): link.kind for link in topo.links}
    assert kinds[("GPU0", "NIC0")] == "NODE" and kinds[("GPU0", "NIC1")] == "SYS"


def test_topology_from_nvml_pcie_levels_and_direct_links() -> None:
    gpus = [FakeGpu(pci_bus_id=f"00000000:{i + 1:02X}:00.0", numa_node=i // 2) for i in range(4)]
    gpus[0].nvlink_links = gpus[1].nvlink_links = 2
    gpus[0].nvlink_remote_bus = [gpus[1].pci_bus_id] * 2
    gpus[1].nvlink_remote_bus = [gpus[0].pci_bus_id] * 2
    fake = FakeNvml(gpus, levels={(0, 2): 10, (0, 3): 20, (1, 2): 30, (2, 3): 40})
    fake.nvmlInit()
    handles = [fake.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
    topo = topology_from_nvml(fake, handles, "n")
    kinds = {(link.a, link.b): (link.kind, link.nvlinks) for link in topo.links}
    assert kinds == {("GPU0", "GPU1"): ("NV", 2), ("GPU0", "GPU2"): ("PIX", 0), ("GPU0", "GPU3"): ("PXB", 0),
                     ("GPU1", "GPU2"): ("PHB", 0), ("GPU1", "GPU3"): ("SYS", 0), ("GPU2", "GPU3"): ("NODE", 0)}


def test_reader_serves_only_its_node() -> None:
    reader, _, _ = make_reader([FakeGpu()])
    with pytest.raises(KeyError):
        reader.sample("other")


def test_nvml_reader_over_a_simulated_node_reads_what_the_simulator_reads() -> None:
    sim = SimulatedFleet(load_fleet_spec(), seed=1, start_at=0.0)
    sim.place("job", "a100-00", [0, 1], MemoryGrowth(pattern="linear", base_mb=1_000, peak_mb=9_000, duration_s=100), util=75)
    sim.inject_ecc("a100-00", 1, corrected=3)
    sim.advance(50)
    reader = NvmlReader(FakeNvml.from_simulator(sim, "a100-00"), node="a100-00", root="/nonexistent-root",
                        task_of_pid=lambda pid: "job" if pid >= 10_000 else None)
    for mine, theirs in zip(reader.sample("a100-00"), sim.sample("a100-00"), strict=True):
        assert (mine.uuid, mine.memory_total_mb, mine.ecc_corrected, mine.pcie_link_width) == \
            (theirs.uuid, theirs.memory_total_mb, theirs.ecc_corrected, theirs.pcie_link_width)
        assert mine.memory_used_mb == pytest.approx(theirs.memory_used_mb, abs=0.1)
        assert mine.utilization_gpu_pct == pytest.approx(theirs.utilization_gpu_pct, abs=0.5)
        assert [(p.pid, p.task_id) for p in mine.processes] == [(p.pid, p.task_id) for p in theirs.processes]
    (task,) = reader.task_samples("a100-00")
    assert task.memory_used_mb == pytest.approx(sim.task_samples("a100-00")[0].memory_used_mb, abs=0.2)


def test_pcie_rate_comes_from_the_byte_counters_where_the_driver_has_them() -> None:
    gpu = FakeGpu(pcie_tx_kbs=500, pcie_rx_kbs=700, pcie_tx_bytes=10_000_000, pcie_rx_bytes=0)
    reader, _, clock = make_reader([gpu])
    first = reader.sample("n1")[0]
    assert (first.pcie_tx_kbps, first.pcie_rx_kbps) == (500, 700)  # no delta yet: the 20 ms sampling call
    gpu.unsupported.add("nvmlDeviceGetPcieThroughput")  # from now on it must not be needed
    gpu.pcie_tx_bytes += 2 * 1024 * 1000
    gpu.pcie_rx_bytes += 4 * 1024 * 1000
    clock.t += 2.0
    second = reader.sample("n1")[0]
    assert (second.pcie_tx_kbps, second.pcie_rx_kbps) == (1000.0, 2000.0)
    assert "nvml_unsupported" not in second.labels
    gpu.unsupported.discard("nvmlDeviceGetPcieThroughput")
    gpu.pcie_tx_bytes = 5  # the counter wrapped: that reading falls back to the sampling call
    clock.t += 1.0
    assert reader.sample("n1")[0].pcie_tx_kbps == 500


def test_without_byte_counters_every_reading_uses_the_sampling_call() -> None:
    gpu = FakeGpu(pcie_tx_kbs=500, pcie_rx_kbs=700)
    reader, _, clock = make_reader([gpu])
    for _ in range(3):
        s = reader.sample("n1")[0]
        assert (s.pcie_tx_kbps, s.pcie_rx_kbps) == (500, 700)
        clock.t += 1.0


def test_a_node_named_with_dots_is_reported_as_one_subject_token() -> None:
    # A Kubernetes node name such as ip-10-0-3-7.ec2.internal: its telemetry would go to
    # telemetry.gpu.ip-10-0-3-7.ec2.internal, which no telemetry.gpu.* subscriber hears.
    reader = NvmlReader(FakeNvml([rich_gpu(0)]), node="ip-10-0-3-7.ec2.internal", root="/nonexistent-root")
    assert reader.node_names() == ["ip-10-0-3-7_ec2_internal"]
    assert {s.node for s in reader.sample("ip-10-0-3-7_ec2_internal")} == {"ip-10-0-3-7_ec2_internal"}


class LostGpuNvml(FakeNvml):
    """A node where NVML counts a GPU it cannot open: fallen off the bus (GpuIsLost, 15)
    or, in a container, a device it may not talk to (NoPermission): ``nvmlDeviceGetCount``
    counts such a GPU and ``nvmlDeviceGetHandleByIndex`` refuses it."""

    def __init__(self, gpus: list[FakeGpu], lost: int, error: int = 15) -> None:
        super().__init__(gpus)
        self.lost, self.error = lost, error

    def nvmlDeviceGetHandleByIndex(self, index: int):  # noqa: N802 - pynvml's name
        if index == self.lost:
            raise fake_nvml.NVMLError(self.error)
        return super().nvmlDeviceGetHandleByIndex(index)


@pytest.mark.parametrize("error", [15, fake_nvml.NVML_ERROR_NO_PERMISSION])
def test_a_gpu_nvml_cannot_open_leaves_the_others_read_under_their_own_index(error: int) -> None:
    # Before, the reader died in its constructor and the collector with it: the node sent
    # nothing, went unreachable, and every task on its healthy GPUs was given up.
    gpus = [rich_gpu(i) for i in range(3)]
    reader = NvmlReader(LostGpuNvml(gpus, lost=1, error=error), node="n1", root="/nonexistent-root")
    samples = reader.sample("n1")
    assert [s.gpu for s in samples] == [0, 1, 2]
    assert [s.uuid for s in samples] == [gpus[0].uuid, "", gpus[2].uuid]
    assert samples[1].memory_total_mb == 0 and samples[1].processes == []
    assert "nvml_error" in samples[1].labels and "nvml_error" not in samples[0].labels
    assert set().union(*(t.gpus for t in reader.task_samples("n1"))) == {0, 2}
    topo = reader.topology("n1")
    assert [(g.index, g.uuid) for g in topo.gpus] == [(0, gpus[0].uuid), (1, ""), (2, gpus[2].uuid)]
    assert {(link.a, link.b) for link in topo.links} == {("GPU0", "GPU1"), ("GPU0", "GPU2"), ("GPU1", "GPU2")}
    assert reader.events() == []
    reader.close()


class RemoteTypeNvml(FakeNvml):
    """A fake that also answers ``nvmlDeviceGetNvLinkRemoteDeviceType`` from ``remote_types``
    (GPU index -> type per link), with pynvml's constants."""

    NVML_NVLINK_DEVICE_TYPE_GPU = 0x00
    NVML_NVLINK_DEVICE_TYPE_IBMNPU = 0x01
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02

    def __init__(self, gpus: list[FakeGpu], remote_types: dict[int, list[int]]) -> None:
        super().__init__(gpus)
        self.remote_types = remote_types

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link: int) -> int:  # noqa: N802 - pynvml's name
        self._gpu(h, "nvmlDeviceGetNvLinkRemoteDeviceType")
        return self.remote_types[h.index][link]


def test_nvlinks_to_gpus_this_reader_cannot_see_are_not_taken_for_an_nvswitch() -> None:
    # Two NVLink-bridged pairs (0-2, 1-3) where this reader sees GPUs 0 and 1 only (a
    # container given half the node), and a POWER9 GPU whose links go to the CPU (IBM NPU):
    # none of these is a switch, so GPU0-GPU1 is PCIe, not NV2.
    assert pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH == RemoteTypeNvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    assert pynvml.NVML_NVLINK_DEVICE_TYPE_IBMNPU == RemoteTypeNvml.NVML_NVLINK_DEVICE_TYPE_IBMNPU
    gpus = [FakeGpu(pci_bus_id=f"00000000:{i + 1:02X}:00.0", nvlink_links=2, nvlink_remote_bus=[f"00000000:{i + 0x81:02X}:00.0"] * 2)
            for i in range(3)]
    fake = RemoteTypeNvml(gpus, {0: [0, 0], 1: [0, 0], 2: [1, 1]})
    fake.nvmlInit()
    handles = [fake.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
    kinds = {(link.a, link.b): link.kind for link in topology_from_nvml(fake, handles, "n").links}
    assert "NV" not in kinds.values()
    # Real switches still make every switch-attached pair NV<links>.
    fake.remote_types = {i: [2, 2] for i in range(3)}
    kinds = {(link.a, link.b): (link.kind, link.nvlinks) for link in topology_from_nvml(fake, handles, "n").links}
    assert set(kinds.values()) == {("NV", 2)}


@pytest.mark.parametrize("not_available", [None, 2**64 - 1])
def test_a_process_whose_memory_nvml_cannot_report_is_neither_zero_nor_huge(not_available) -> None:
    # A MIG GPU read without privileges (and WDDM) gives NVML_VALUE_NOT_AVAILABLE per
    # process: pynvml turns it into None, an older binding passes 2**64-1 through. Before,
    # None was summed as 0 (the fingerprinter learnt a task of 0 MB, the policy packed over
    # it) and 2**64-1 became a process of 17 million TB.
    tasks = {1: "train-a", 2: "train-b", 3: "train-b"}
    gpus = [FakeGpu(compute_procs=[(1, 4 * GIB), (2, not_available)]), FakeGpu(compute_procs=[(3, 2 * GIB)])]
    reader, _, _ = make_reader(gpus, task_of_pid=tasks.get)
    first, second = reader.sample("n1")
    assert [(p.pid, p.used_mb, p.task_id) for p in first.processes] == [(1, 4096.0, "train-a"), (2, 0.0, "train-b")]
    assert "process_memory" in first.labels["nvml_unsupported"].split(",")
    assert "nvml_unsupported" not in second.labels
    # train-b's memory is unknown on GPU 0: no sample at all rather than the 2 GB of GPU 1.
    assert [(t.task_id, t.memory_used_mb) for t in reader.task_samples("n1")] == [("train-a", 4096.0)]


def test_an_nvlink_common_speed_of_zero_leaves_the_node_sampled() -> None:
    # NVLink fields read but no link trained (fabric manager down on an HGX): the common
    # speed reads 0. Before, the ratio divided by it and the whole node's sample failed.
    gpu = rich_gpu(0)
    gpu.nvlink_speed_mbps = 0
    reader, fake, clock = make_reader([gpu, rich_gpu(1)])
    reader.sample("n1")
    fake.add_nvlink_traffic(0, 12 * 10**6, 12 * 10**6)
    clock.t += 10
    first, second = reader.sample("n1")
    assert first.nvlink_bandwidth_utilization_ratio.uncertainty_score == 0.3  # the speed is a guess
    assert first.nvlink_bandwidth_utilization_ratio.value > 0
    assert second.uuid == rich_gpu(1).uuid


def test_nvlink_counters_that_went_back_give_no_rate_rather_than_an_exact_zero() -> None:
    # A GPU reset (or ``nvidia-smi nvlink -r``) restarts the data counters: the next delta
    # is negative. Before, it was clamped to 0 and sent as a measured idle link (0.1).
    gpu = rich_gpu(0)
    reader, fake, clock = make_reader([gpu])
    fake.add_nvlink_traffic(0, 12 * 10**9, 12 * 10**9)
    reader.sample("n1")
    gpu.nvlink_tx_kib, gpu.nvlink_rx_kib = [0] * 12, [0] * 12
    clock.t += 10
    (s,) = reader.sample("n1")
    assert (s.nvlink_bandwidth_utilization_ratio.value, s.nvlink_bandwidth_utilization_ratio.uncertainty_score) == (0.0, 1.0)
    fake.add_nvlink_traffic(0, 12 * 10**6, 0)
    clock.t += 10
    (s,) = reader.sample("n1")  # counting again from the reset
    assert s.nvlink_bandwidth_utilization_ratio.uncertainty_score == 0.1 and s.nvlink_bandwidth_utilization_ratio.value > 0


def test_nvlinks_whose_far_end_cannot_be_read_are_not_given_to_a_gpu_nvml_could_not_open() -> None:
    # A VM whose NVML refuses the NVLink far end, with GPU 2 fallen off the bus: the unread
    # far end ("") matched the lost GPU's empty bus id, and GPUs 0 and 1 were NV12 to it.
    gpus = [rich_gpu(i) for i in range(3)]
    for g in gpus:
        g.unsupported.add("nvmlDeviceGetNvLinkRemotePciInfo")
    reader = NvmlReader(LostGpuNvml(gpus, lost=2), node="n1", root="/nonexistent-root")
    kinds = {(link.a, link.b): link.kind for link in reader.topology("n1").links}
    assert kinds[("GPU0", "GPU2")] == kinds[("GPU1", "GPU2")] == "SYS"
    assert "NV" not in kinds.values()


@pytest.mark.parametrize(("lacks", "read"), [
    ({"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3"}, True),   # R470
    ({"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3",
      "nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetGraphicsRunningProcesses_v2"}, False),  # older
])
def test_a_driver_older_than_the_bindings_still_has_its_gpus_sampled(lacks: set[str], read: bool) -> None:
    # pynvml's process calls go to the _v3 entry point (R510+); on an older driver they raise
    # NVMLLibraryMismatchError, which is no NVMLError: it went through every guard and the
    # node sent no sample, on every tick. The _v2 entry point is what such a driver has.
    assert not issubclass(pynvml.NVMLLibraryMismatchError, pynvml.NVMLError)
    fake, clock = FakeNvml([rich_gpu(0)], driver_lacks=lacks), Clock()
    reader = NvmlReader(fake, node="n1", root="/nonexistent-root", clock=clock, task_of_pid=lambda pid: f"task-{pid}")
    (s,) = reader.sample("n1")
    assert s.memory_used_mb == 30_720 and s.temperature_c == 66
    if read:
        assert [(p.pid, p.used_mb) for p in s.processes] == [(4242, 20_480), (4343, 1_024)]
        assert "nvml_unsupported" not in s.labels
        assert [t.task_id for t in reader.task_samples("n1")] == ["task-4242", "task-4343"]
    else:
        assert s.processes == [] and s.labels["nvml_unsupported"] == "processes"
        assert reader.task_samples("n1") == []


# -- MIG ---------------------------------------------------------------------------------

ENABLE, DISABLE = fake_nvml.NVML_DEVICE_MIG_ENABLE, fake_nvml.NVML_DEVICE_MIG_DISABLE


def mig_gpu(i: int = 0, **kw) -> FakeGpu:
    """An A100-80GB cut 3g.40gb + 2g.20gb + 1g.10gb, with a task's process on the 2g slice
    and MIG index 2 left empty (the 1g device sits at index 3)."""
    gpu = rich_gpu(i)
    gpu.compute_procs, gpu.graphics_procs, gpu.proc_util = [], [], []
    gpu.mig_mode = (ENABLE, ENABLE)
    gpu.mig_devices = [
        fake_nvml.FakeMigDevice(uuid=f"MIG-{i}-a", gpu_instance_id=2, compute_instance_id=0, gpu_slices=3,
                                compute_slices=3, memory_size_mb=40_192, multiprocessors=42, memory_used=12 * 1024**2),
        fake_nvml.FakeMigDevice(uuid=f"MIG-{i}-b", gpu_instance_id=3, compute_instance_id=0, gpu_slices=2,
                                compute_slices=2, memory_size_mb=19_968, multiprocessors=28,
                                memory_used=6 * GIB, compute_procs=[(4242, 5 * GIB)]),
        None,
        fake_nvml.FakeMigDevice(uuid=f"MIG-{i}-c", gpu_instance_id=9, compute_instance_id=0, gpu_slices=1,
                                compute_slices=1, memory_size_mb=9_728, multiprocessors=14),
    ]
    for key, value in kw.items():
        setattr(gpu, key, value)
    return gpu


def test_fake_mig_constants_match_the_real_module() -> None:
    assert (pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE) == (ENABLE, DISABLE)
    for fn in ("nvmlDeviceGetMigMode", "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex",
               "nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId", "nvmlDeviceGetAttributes"):
        assert hasattr(FakeNvml, fn) and hasattr(pynvml, fn), fn
    fields = {name for name, _ in pynvml.c_nvmlDeviceAttributes._fields_}
    assert {"gpuInstanceSliceCount", "computeInstanceSliceCount", "memorySizeMB", "multiprocessorCount"} <= fields


def test_a_mig_gpu_reports_its_slices_and_the_task_on_one_gets_its_memory(tmp_path: Path) -> None:
    # Before, a GPU in MIG mode was read as one GPU: the parent refuses utilisation and
    # aggregate memory to a non-root collector and lists processes without their memory,
    # so the task on the 2g slice got no telemetry.task sample and the slices were unseen.
    sysfs(tmp_path)  # pid 4242 is task train-17
    reader, _, _ = make_reader([mig_gpu(0), rich_gpu(1)], tmp_path)
    mig_sample, whole = reader.sample("n1")
    assert whole.mig is msgspec.UNSET and "nvml_unsupported" not in whole.labels
    assert b'"mig"' not in msgspec.json.encode(whole)  # a GPU without MIG: the wire as before
    state = mig_sample.mig
    assert state and state.enabled and not state.change_pending
    assert [(d.index, d.uuid, d.gpu_instance_id, d.compute_instance_id, d.profile, d.gpu_slices, d.compute_slices)
            for d in state.devices] == [(0, "MIG-0-a", 2, 0, "3g.40gb", 3, 3), (1, "MIG-0-b", 3, 0, "2g.20gb", 2, 2),
                                        (3, "MIG-0-c", 9, 0, "1g.10gb", 1, 1)]
    assert [(d.memory_total_mb, d.memory_used_mb, d.pids) for d in state.devices] == [
        (40_192.0, 12.0, []), (19_968.0, 6_144.0, [4242]), (9_728.0, 0.0, [])]
    assert [(p.pid, p.used_mb, p.task_id) for p in mig_sample.processes] == [(4242, 5_120.0, "train-17")]
    # What NVML refuses on a MIG GPU is labelled as any refusal; the process memory is not.
    refused = set(mig_sample.labels["nvml_unsupported"].split(","))
    assert {"utilization", "memory"} <= refused
    assert not refused & {"process_memory", "processes", "mig_uuid", "mig_memory", "mig_attributes"}
    tasks = {t.task_id: t for t in reader.task_samples("n1")}
    assert tasks["train-17"].memory_used_mb == 5_120.0 + 20_480.0  # its 2g slice + GPU 1
    assert tasks["train-17"].gpus == [0, 1]


def test_the_mig_layout_is_in_the_topology_and_read_there_not_every_tick() -> None:
    reader, fake, _ = make_reader([mig_gpu(0), rich_gpu(1)])
    topo = reader.topology("n1")
    layout, whole = topo.gpus[0].mig, topo.gpus[1].mig
    assert whole is msgspec.UNSET and b'"mig"' not in msgspec.json.encode(topo.gpus[1])
    assert layout and layout.enabled and layout.max_devices == 7
    assert [(d.index, d.uuid, d.gpu_instance_id, d.profile, d.memory_mb, d.multiprocessors) for d in layout.devices] == [
        (0, "MIG-0-a", 2, "3g.40gb", 40_192, 42), (1, "MIG-0-b", 3, "2g.20gb", 19_968, 28),
        (3, "MIG-0-c", 9, "1g.10gb", 9_728, 14)]
    static = ("nvmlDeviceGetAttributes", "nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId",
              "nvmlDeviceGetMaxMigDeviceCount")
    fake.calls_by_name.clear()
    for _ in range(3):
        reader.sample("n1")
    assert {name: fake.calls_by_name.get(name, 0) for name in static} == dict.fromkeys(static, 0)
    # The MIG GPU's mode is read each tick; GPU 1, without MIG, on the first tick only.
    assert fake.calls_by_name["nvmlDeviceGetMigMode"] == 3 + 1


def test_a_slice_created_after_the_topology_read_is_described_once() -> None:
    gpu = mig_gpu(0)
    reader, fake, _ = make_reader([gpu])
    reader.topology("n1")
    gpu.mig_devices[2] = fake_nvml.FakeMigDevice(uuid="MIG-new", gpu_instance_id=10, gpu_slices=1, compute_slices=1,
                                                 memory_size_mb=9_728)
    fake.calls_by_name.clear()
    first = reader.sample("n1")[0].mig
    reader.sample("n1")
    assert first and [(d.index, d.uuid, d.profile) for d in first.devices][2] == (2, "MIG-new", "1g.10gb")
    assert fake.calls_by_name["nvmlDeviceGetAttributes"] == 1


@pytest.mark.parametrize(("mode", "enabled"), [((DISABLE, ENABLE), False), ((ENABLE, DISABLE), True)])
def test_a_pending_mig_mode_change_is_reported(mode: tuple[int, int], enabled: bool) -> None:
    # nvidia-smi -mig 1 (or 0) waits for a GPU reset: until then the current mode holds.
    gpu = mig_gpu(0, mig_mode=mode)
    if not enabled:
        gpu.compute_procs = [(4242, 3 * GIB)]
    reader, _, _ = make_reader([gpu], task_of_pid=lambda pid: "job")
    (s,) = reader.sample("n1")
    assert s.mig and s.mig.change_pending and s.mig.enabled is enabled
    assert len(s.mig.devices) == (3 if enabled else 0)
    layout = reader.topology("n1").gpus[0].mig
    assert layout and layout.change_pending and layout.enabled is enabled
    if not enabled:  # still a whole GPU: read as before
        assert s.memory_total_mb == 81_920 and [(p.pid, p.used_mb) for p in s.processes] == [(4242, 3_072.0)]
        assert [(t.task_id, t.memory_used_mb) for t in reader.task_samples("n1")] == [("job", 3_072.0)]


def test_a_mig_capable_gpu_with_mig_off_reads_as_before() -> None:
    reader, _, _ = make_reader([mig_gpu(0, mig_mode=(DISABLE, DISABLE), compute_procs=[(7, GIB)])])
    (s,) = reader.sample("n1")
    assert s.mig is msgspec.UNSET and reader.topology("n1").gpus[0].mig is msgspec.UNSET
    assert s.utilization_gpu_pct == 90 and [p.pid for p in s.processes] == [7]


def test_an_empty_mig_index_is_skipped_and_a_stale_or_refused_one_is_labelled() -> None:
    gpu = mig_gpu(0)
    gpu.mig_devices.append(None)  # index 4 empty too, then nothing up to the maximum
    gpu.mig_devices[3].unsupported = {"nvmlDeviceGetMemoryInfo", "nvmlDeviceGetAttributes"}
    reader, _, _ = make_reader([gpu])
    (s,) = reader.sample("n1")
    assert s.mig and [d.index for d in s.mig.devices] == [0, 1, 3]
    refused = set(s.labels["nvml_unsupported"].split(","))
    assert {"mig_memory", "mig_attributes"} <= refused and "mig_devices" not in refused
    assert (s.mig.devices[2].memory_total_mb, s.mig.devices[2].profile, s.mig.devices[2].gpu_instance_id) == (0.0, "", 9)


def test_a_slice_whose_processes_nvml_refuses_leaves_the_others_attributed() -> None:
    gpu = mig_gpu(0)
    gpu.mig_devices[0].compute_procs = [(11, 2 * GIB)]
    gpu.mig_devices[1].unsupported = {"nvmlDeviceGetComputeRunningProcesses"}
    reader, _, _ = make_reader([gpu], task_of_pid=lambda pid: f"t{pid}")
    (s,) = reader.sample("n1")
    assert [(p.pid, p.used_mb) for p in s.processes] == [(11, 2_048.0)]
    assert "processes" in s.labels["nvml_unsupported"].split(",")
    assert [(t.task_id, t.memory_used_mb) for t in reader.task_samples("n1")] == [("t11", 2_048.0)]


def test_a_privileged_reader_on_a_mig_gpu_still_reads_memory_per_slice() -> None:
    # With the MIG monitor capability the parent answers too; the slices' figures are the same.
    reader, _, _ = make_reader([mig_gpu(0, mig_privileged=True)], task_of_pid=lambda pid: "job")
    (s,) = reader.sample("n1")
    assert s.memory_used_mb == 30_720 and [(p.pid, p.used_mb) for p in s.processes] == [(4242, 5_120.0)]
    assert "memory" not in s.labels["nvml_unsupported"].split(",")


def test_a_driver_or_binding_without_mig_calls_reads_every_gpu_whole() -> None:
    class NoMigNvml(FakeNvml):
        def nvmlDeviceGetMigMode(self, h):  # noqa: N802 - pynvml's name
            raise fake_nvml.NVMLError_FunctionNotFound()

    fake = NoMigNvml([rich_gpu(0)])
    reader = NvmlReader(fake, node="n1", root="/nonexistent-root")
    (s,) = reader.sample("n1")
    assert s.mig is msgspec.UNSET and "nvml_unsupported" not in s.labels and s.processes


@pytest.mark.parametrize(("g", "c", "memory_mb", "total_mb", "name"), [
    (1, 1, 4_864, 40_960, "1g.5gb"),        # A100-40GB
    (3, 3, 19_968, 40_960, "3g.20gb"),
    (7, 7, 40_192, 40_960, "7g.40gb"),
    (1, 1, 9_728, 81_920, "1g.10gb"),       # A100-80GB
    (1, 1, 19_968, 81_920, "1g.20gb"),
    (7, 7, 80_896, 81_920, "7g.80gb"),      # 79 GiB: named after the 8ths of the GPU it holds
    (3, 1, 40_192, 81_920, "1c.3g.40gb"),   # a compute instance smaller than its GPU instance
    (1, 1, 9_984, 81_559, "1g.10gb"),       # H100 80GB
    (3, 3, 40_448, 81_559, "3g.40gb"),
    (1, 1, 16_896, 143_771, "1g.18gb"),     # H200
    (7, 7, 142_336, 143_771, "7g.141gb"),
])
def test_mig_profile_names_follow_nvidias(g: int, c: int, memory_mb: int, total_mb: int, name: str) -> None:
    assert mig_profile_name(g, c, memory_mb, total_mb * 1024**2) == name


def test_a_mig_profile_without_the_gpus_total_is_named_from_its_own_memory() -> None:
    assert mig_profile_name(1, 1, 9_728, 0) == "1g.10gb"
    assert mig_profile_name(0, 0, 9_728, 81_920 * 1024**2) == ""  # slices unknown: no name


def test_a_gpu_in_mig_mode_takes_no_whole_gpu_work() -> None:
    # Its CUDA devices are its slices, which placement does not model: a task given the
    # GPU's index saw no device at all. Labelled ``mig``, it is out of service for placement.
    from fleetpilot.contracts import GPU_LABEL_MIG, in_service

    reader, _, _ = make_reader([mig_gpu(0), rich_gpu(1)])
    topo = reader.topology("n1")
    assert topo.gpus[0].labels.get(GPU_LABEL_MIG) == "true" and not in_service(topo.gpus[0].labels)
    assert GPU_LABEL_MIG not in topo.gpus[1].labels and in_service(topo.gpus[1].labels)


def test_topology_reports_the_hosts_cpus_and_memory(tmp_path: Path) -> None:
    # The policy places a task only on a node whose reported cpu_milli / memory_mb hold its
    # cpu_milli / memory_mb: a real node reported 0 and 0, so a task asking for any CPU or
    # host memory could never run on real hardware (the simulator's nodes carry both).
    write(tmp_path, "sys/devices/system/cpu/online", "0-111,224-335\n")
    write(tmp_path, "proc/meminfo", "MemTotal:       2113432576 kB\nMemFree:        2000000000 kB\n")
    reader, _, _ = make_reader([rich_gpu(0)], tmp_path)
    topo = reader.topology("n1")
    assert topo.cpu_milli == 224 * 1000
    assert topo.memory_mb == 2113432576 // 1024


def test_topology_without_host_files_reports_this_machines_cpus_and_memory(tmp_path: Path) -> None:
    # A collector without the host's /proc and /sys mounted still runs on the node it reports.
    reader, _, _ = make_reader([rich_gpu(0)], tmp_path)
    topo = reader.topology("n1")
    assert topo.cpu_milli == (os.cpu_count() or 0) * 1000 > 0
    assert topo.memory_mb > 0


def test_a_gpu_lost_while_read_is_reported_lost_under_its_uuid_and_asked_once_per_tick() -> None:
    """A GPU that falls off the bus after NVML opened it (Xid 79) answers every call with
    GpuIsLost. Before, its sample went out with every field at 0 and all of them listed as
    ``nvml_unsupported`` (as if a healthy GPU merely lacked the features), no uuid, and ~25
    calls a tick into a dead device; it must read as lost (``nvml_error``), keep the uuid it
    had, cost one call, leave the other GPUs read, and read normally again once it answers."""
    gpus = [rich_gpu(i) for i in range(3)]
    reader, fake, _ = make_reader(gpus)
    reader.sample("n1")
    gpus[1].lost = True
    before = fake.calls
    samples = reader.sample("n1")
    assert [s.gpu for s in samples] == [0, 1, 2]
    lost = samples[1]
    assert lost.labels.get("nvml_error") == str(fake_nvml.NVMLError_GpuIsLost())
    assert "nvml_unsupported" not in lost.labels
    assert lost.uuid == gpus[1].uuid and lost.model == gpus[1].name
    assert lost.memory_total_mb == 0 and lost.processes == []
    assert "nvml_error" not in samples[0].labels and samples[2].memory_total_mb > 0
    # Only one call reached the lost GPU (the first read told it was lost).
    calls_per_healthy = (fake.calls - before - 1) / 2
    assert fake.calls - before < 2 * calls_per_healthy + 3
    assert set().union(*(t.gpus for t in reader.task_samples("n1"))) == {0, 2}
    gpus[1].lost = False  # reset (nvidia-smi -r) brought it back on the same handle
    again = reader.sample("n1")[1]
    assert "nvml_error" not in again.labels and again.memory_total_mb > 0
    reader.close()


def test_an_ib_counter_that_cannot_be_read_once_makes_no_rate_and_no_spike_after(tmp_path: Path) -> None:
    """A counter file that cannot be read (EIO while the HCA resets its firmware, a missing
    or garbled file) was read as 0: that period looked like a counter reset, and the next one,
    back at the real count, as the port's whole lifetime of traffic in one interval (here
    ~3,200 Gbit/s on a 200 Gbit/s port, with the 0.05 uncertainty of an exact counter)."""
    from fleetpilot.fleet.bandwidth import port_rates

    sysfs(tmp_path)
    counters = tmp_path / "sys/class/infiniband/mlx5_0/ports/1/counters"
    (counters / "port_xmit_data").write_text(f"{100 * 10**9}\n")
    first = read_ib_ports(tmp_path)
    (counters / "port_xmit_data").write_text("")  # unreadable this once
    blind = read_ib_ports(tmp_path)
    (counters / "port_xmit_data").write_text(f"{100 * 10**9 + 1000}\n")
    back = read_ib_ports(tmp_path)
    during = {r.device: r for r in port_rates(first, blind, 1.0)}["mlx5_0"]
    after = {r.device: r for r in port_rates(blind, back, 1.0)}["mlx5_0"]
    assert during.uncertainty_score == 1.0 and during.tx_gbps == 0.0
    assert after.uncertainty_score == 1.0 and after.tx_gbps == 0.0, after
    # The other port, and the next interval of this one, are measured as before.
    assert {r.device: r for r in port_rates(blind, back, 1.0)}["mlx5_1"].uncertainty_score == 0.05
    again = {r.device: r for r in port_rates(back, read_ib_ports(tmp_path), 1.0)}["mlx5_0"]
    assert again.uncertainty_score == 0.05 and again.tx_gbps == 0.0


def test_the_other_gpus_xids_are_still_read_while_one_gpu_is_lost() -> None:
    """After Xid 79 a driver answers every wait on an event set that holds the lost GPU with
    GpuIsLost. Read as "nothing pending", the node's other GPUs' XIDs were never read again
    for as long as the lost GPU stayed (until a reboot): their health model went blind. The
    set is made again without it, and with it once it answers again."""
    gpus = [rich_gpu(i) for i in range(3)]
    reader, fake, _ = make_reader(gpus)
    reader.sample("n1")
    gpus[1].lost = True
    fake.push_xid(1, 79)
    reader.sample("n1")
    fake.push_xid(2, 48)
    fake.push_xid(0, 94)
    for _ in range(2):
        samples = reader.sample("n1")
    assert [(s.xid_count, s.xid_last) for s in samples] == [(1, 94), (1, 79), (1, 48)]
    gpus[1].lost = False  # reset: it answers again, and is listened to again
    reader.sample("n1")
    fake.push_xid(1, 31)
    assert [(s.xid_count, s.xid_last) for s in reader.sample("n1")][1] == (2, 31)
    reader.close()
