"""PCIe byte counters that wrap (32-bit on an H200 with driver 580) are counted exactly:
polled faster than their link can wrap them, a lost period said to be lost, never a rate
made of a count modulo 2**32."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from fleetpilot.fleet.fake_nvml import FakeGpu, FakeNvml
from fleetpilot.fleet.nvml_reader import NvmlReader
from fleetpilot.fleet.pcie_counters import (
    CounterPair,
    PcieCounterPoller,
    field_modulus,
    field_number,
    link_top_bytes_per_s,
)

WRAP32 = 1 << 32
GEN5_X16 = 64e9  # bytes per second, every bit on the wire


def test_a_fields_number_is_read_from_the_member_its_value_type_names() -> None:
    union = SimpleNamespace(dVal=2.5, uiVal=7, ulVal=8, ullVal=9, sllVal=-4, siVal=-5, usVal=6)
    assert [field_number(SimpleNamespace(valueType=t, value=union)) for t in range(7)] == [2.5, 7, 8, 9, -4, -5, 6]
    assert field_number(SimpleNamespace(value=union)) == 9  # no type given: the 64-bit member
    assert [field_modulus(SimpleNamespace(valueType=t)) for t in range(7)] == \
        [None, 1 << 32, 1 << 64, 1 << 64, None, None, 1 << 16]


def test_a_links_top_rate_comes_from_its_generation_and_width_and_unknowns_count_as_the_largest() -> None:
    assert link_top_bytes_per_s(5, 16) == GEN5_X16
    assert link_top_bytes_per_s(4, 8) == 16e9
    assert link_top_bytes_per_s(None, None) == link_top_bytes_per_s(6, 16) == 128e9
    assert link_top_bytes_per_s(0, 0) == 128e9


def test_a_32_bit_counter_is_counted_across_its_wraps_when_observed_often_enough() -> None:
    pair = CounterPair(WRAP32, GEN5_X16)
    assert pair.wrap_s == pytest.approx(WRAP32 / GEN5_X16)
    rate, true_tx, true_rx = 55e9, 3_000_000_000, 123
    pair.observe(0.0, true_tx % WRAP32, true_rx)
    assert pair.take() is None  # the first period starts here
    for step in range(1, 51):  # 0.5 s at 55 GB/s: 6.4 wraps, each step 0.55 GB
        pair.observe(step * 0.01, int(true_tx + rate * step * 0.01) % WRAP32, true_rx)
    tx, rx, seconds = pair.take()
    assert (tx, rx) == (int(rate * 0.5), 0) and seconds == pytest.approx(0.5)
    # What one reading per period would have made of it: the count modulo 2**32.
    assert tx % WRAP32 != tx


def test_a_gap_a_wrap_could_hide_in_loses_that_period_and_only_that_one() -> None:
    pair = CounterPair(WRAP32, GEN5_X16)
    pair.observe(0.0, 0, 0)
    pair.take()
    pair.observe(0.01, 1000, 1000)
    starved = 0.01 + pair.safe_gap_s * 1.01
    pair.observe(starved, 2000, 2000)  # the poller was starved of the CPU
    assert pair.take() is None
    pair.observe(starved + 0.02, 3000, 2500)
    assert pair.take() == (1000, 500, pytest.approx(0.02))


def test_a_counter_that_goes_back_is_a_reset_not_a_burst_of_traffic() -> None:
    pair = CounterPair(1 << 64, GEN5_X16)
    pair.observe(0.0, 10_000_000, 0)
    pair.take()
    pair.observe(1.0, 5, 0)  # the GPU was reset: the modular step would be 2**64 - 10 MB
    assert pair.take() is None
    pair.observe(2.0, 5 + 1024, 2048)
    assert pair.take() == (1024, 2048, 1.0)


def test_an_observation_older_than_the_last_is_dropped() -> None:
    pair = CounterPair(WRAP32, GEN5_X16)
    pair.observe(1.0, 100, 100)
    pair.take()
    pair.observe(1.01, 200, 200)
    pair.observe(1.005, 150, 150)  # read by another thread before the last one, stamped after
    pair.observe(1.02, 300, 300)
    assert pair.take() == (200, 200, pytest.approx(0.02))


def test_a_failed_read_loses_its_period() -> None:
    pair = CounterPair(WRAP32, GEN5_X16)
    pair.observe(0.0, 0, 0)
    pair.take()
    pair.lose()
    assert pair.take() is None
    pair.observe(1.0, 10, 10)
    assert pair.take() is None  # the first observation after the failure starts a period
    pair.observe(1.02, 20, 30)
    assert pair.take() == (10, 20, pytest.approx(0.02))


def test_the_reader_counts_a_32_bit_counter_that_wraps_several_times_between_readings() -> None:
    # As an H200 on driver 580 reads: 32-bit counters, a PCIe 5 x16 link, a pinned copy at
    # 30 GB/s (2.1 wraps in each 0.3 s between readings). The sampling call reads 0 here,
    # so a reading that fell back to it is told apart from a counted one.
    gpu = FakeGpu(pcie_tx_bytes=0, pcie_rx_bytes=WRAP32 - 1000, pcie_counter_bits=32,
                  pcie_bytes_per_s=(2e9, 30e9), link_gen_max=5, link_width_max=16)
    reader = NvmlReader(FakeNvml([gpu]), node="n1")
    try:
        reader.sample("n1")
        counted = []
        for _ in range(4):
            time.sleep(0.3)
            s = reader.sample("n1")[0]
            got = (s.pcie_tx_kbps * 1024, s.pcie_rx_kbps * 1024)
            # A period the poller could not count (its thread starved on a loaded machine)
            # falls back to the sampling call; any other reading is the exact rate.
            assert got == (0.0, 0.0) or got == (pytest.approx(2e9, rel=0.02), pytest.approx(30e9, rel=0.02)), got
            counted.append(got != (0.0, 0.0))
        assert any(counted)
    finally:
        reader.close()


def test_64_bit_counters_are_not_polled_by_a_thread() -> None:
    gpu = FakeGpu(pcie_tx_bytes=0, pcie_rx_bytes=0, pcie_counter_bits=64, link_gen_max=5)
    reader = NvmlReader(FakeNvml([gpu]), node="n1")
    try:
        reader.sample("n1")
        assert reader.pcie_poll_s is None
        gpu.pcie_counter_bits = 32
        narrow = NvmlReader(FakeNvml([gpu]), node="n1")
        try:
            narrow.sample("n1")
            # PCIe 5 x16 wraps 2**32 bytes in 67 ms: read every quarter of that.
            assert narrow.pcie_poll_s == pytest.approx(WRAP32 / GEN5_X16 / 4)
        finally:
            narrow.close()
    finally:
        reader.close()


def test_a_poller_stops_its_thread_when_closed() -> None:
    reads = []

    def read(handle: object) -> tuple[int, int, int]:
        reads.append(time.monotonic())
        return len(reads), len(reads), WRAP32

    poller = PcieCounterPoller(read, lambda handle: 1e12, time.monotonic)  # wraps in 4 ms: read every 2 ms
    assert poller.rate(0, "h") is None
    time.sleep(0.2)
    poller.close()
    done = len(reads)
    assert done > 10  # the thread read on its own, without being asked for a rate
    time.sleep(0.05)
    assert len(reads) == done


def test_without_polling_a_wrapping_counter_is_never_made_a_rate_and_the_sampling_call_is_used() -> None:
    gpu = FakeGpu(pcie_tx_bytes=0, pcie_rx_bytes=WRAP32 - 1000, pcie_counter_bits=32, pcie_tx_kbs=11,
                  pcie_rx_kbs=22, pcie_bytes_per_s=(2e9, 30e9), link_gen_max=5)
    reader = NvmlReader(FakeNvml([gpu]), node="n1", pcie_poll=False)
    try:
        readings = []
        for _ in range(3):
            s = reader.sample("n1")[0]
            readings.append((s.pcie_tx_kbps, s.pcie_rx_kbps))
            time.sleep(0.1)  # 3 GB at 30 GB/s: a 32-bit counter could wrap in any such gap
        assert readings == [(11.0, 22.0)] * 3
        assert reader.pcie_poll_s is None
    finally:
        reader.close()
