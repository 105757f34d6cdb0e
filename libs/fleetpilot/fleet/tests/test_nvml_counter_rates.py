"""Rates from NVML's cumulative counters are the traffic over the time between two reads of
the counter itself, on a clock that only moves forward: no spike from a slow GPU read or a
wall clock stepped back."""

from __future__ import annotations

from fleetpilot.fleet.fake_nvml import FakeGpu, FakeNvml
from fleetpilot.fleet.nvml_reader import NvmlReader

MIB = 1024 * 1024


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _gpus() -> list[FakeGpu]:
    return [FakeGpu(uuid=f"GPU-{i}", pcie_tx_kbs=7, pcie_rx_kbs=7, pcie_tx_bytes=0, pcie_rx_bytes=0) for i in range(2)]


def test_a_slow_read_of_one_gpu_does_not_spike_the_next_gpus_rate() -> None:
    gpus = _gpus()
    fake, clock = FakeNvml(gpus), Clock(1_700_000_000.0)

    def elapse(seconds: float) -> None:  # both GPUs move 1 MiB/s each way, all the time
        clock.t += seconds
        for g in gpus:
            g.pcie_tx_bytes += int(MIB * seconds)
            g.pcie_rx_bytes += int(MIB * seconds)

    reader = NvmlReader(fake, node="n1", root="/nonexistent-root", clock=clock)
    reader.sample("n1")
    elapse(1.0)
    read_temperature = fake.nvmlDeviceGetTemperature
    stalled = []

    def slow_temperature(handle, sensor):  # GPU 0's read stalls 5 s this tick (a busy driver)
        if fake.nvmlDeviceGetIndex(handle) == 0 and not stalled:
            stalled.append(True)
            elapse(5.0)
        return read_temperature(handle, sensor)

    fake.nvmlDeviceGetTemperature = slow_temperature
    second = reader.sample("n1")
    # GPU 1's counter was read 6 s after the last time; its traffic is still 1 MiB/s (1,024 KiB/s).
    assert second[1].pcie_tx_kbps == 1024.0 and second[1].pcie_rx_kbps == 1024.0
    elapse(1.0)
    third = reader.sample("n1")
    assert [s.pcie_tx_kbps for s in third] == [1024.0, 1024.0]  # not 1 s of traffic over 6 s, nor 0


def test_a_wall_clock_stepped_back_does_not_spike_the_rate() -> None:
    gpus = _gpus()
    wall, mono = Clock(1_700_000_000.0), Clock(500.0)
    reader = NvmlReader(FakeNvml(gpus), node="n1", root="/nonexistent-root", clock=wall, monotonic=mono)
    reader.sample("n1")
    # One second passes, and NTP steps the wall clock back by 0.9 s in it.
    wall.t += 0.1
    mono.t += 1.0
    for g in gpus:
        g.pcie_tx_bytes += MIB
        g.pcie_rx_bytes += MIB
    (s, _) = reader.sample("n1")
    assert s.at == 1_700_000_000.1  # samples are stamped with the wall clock all the same
    assert (s.pcie_tx_kbps, s.pcie_rx_kbps) == (1024.0, 1024.0)  # not 10x
