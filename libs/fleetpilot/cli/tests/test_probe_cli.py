"""``fleetpilot probe`` over the fake NVML: what it prints, its JSON, and its one-line errors."""

from __future__ import annotations

import io
import json

import pytest
from fleetpilot.cli import probe_cmd
from fleetpilot.cli.main import build_parser
from fleetpilot.cli.main import main as cli_main
from fleetpilot.fleet.fake_nvml import FakeGpu, FakeNvml

GIB = 1024**3


def two_gpus() -> FakeNvml:
    """GPU0 runs a task and refuses remapped rows; GPU1 is idle and healthy."""
    busy = FakeGpu(name="NVIDIA H200", uuid="GPU-aaaa", pci_bus_id="00000000:19:00.0", memory_total=141 * GIB,
                   memory_used=20 * GIB, util_gpu=97, temperature=61, power_mw=512_000, power_limit_mw=700_000,
                   compute_procs=[(4242, 19 * GIB)], proc_util=[(4242, 100, 95)], ecc_corrected=3,
                   unsupported={"nvmlDeviceGetRemappedRows"})
    idle = FakeGpu(name="NVIDIA H200", uuid="GPU-bbbb", pci_bus_id="00000000:3B:00.0", memory_total=141 * GIB,
                   numa_node=1, cpu_mask=(0xFF00,))
    return FakeNvml([busy, idle], driver_version="580.159.04", levels={(0, 1): 50})


def run(argv: list[str], nvml: FakeNvml) -> tuple[int, str]:
    args = build_parser().parse_args(["probe", *argv])
    out = io.StringIO()
    code = probe_cmd.main(args, out=out, nvml=nvml)
    return code, out.getvalue()


def test_text_names_every_gpu_its_readings_the_task_and_the_refused_fields() -> None:
    code, text = run(["--node", "h200-a", "--samples", "2", "--interval", "0"], two_gpus())
    assert code == 0
    assert text.splitlines()[0].startswith("node h200-a (site default): 2 GPU(s), driver 580.159.04, 2 NUMA node(s), "
                                           "2 reading(s)")
    assert "GPU0 NVIDIA H200 GPU-aaaa bus 00000000:19:00.0 NUMA 0 CPUs 0-15" in text
    assert "memory 20.0/141.0 GB, util 97%" in text
    assert "512/700 W" in text
    assert "ECC 3 corrected 0 uncorrected" in text
    assert "GPU1 NVIDIA H200 GPU-bbbb bus 00000000:3b:00.0 NUMA 1 CPUs 8-15" in text
    assert "link GPU0-GPU1 SYS" in text
    assert "task pid-4242: 19.0 GB on GPU 0, SM 95%, pids 4242" in text
    assert "GPU0 refuses: remapped_rows (published at their default)" in text
    assert "GPU1 refuses" not in text


def test_json_holds_every_round_and_decodes_as_the_collector_schema() -> None:
    code, text = run(["--samples", "3", "--interval", "0", "--json", "--node", "n"], two_gpus())
    assert code == 0
    doc = json.loads(text)
    assert len(doc["rounds"]) == 3 and all(len(r) == 2 for r in doc["rounds"])
    assert doc["rounds"][0][0]["memory_total_mb"] == 141 * 1024
    assert doc["unsupported"] == {"0": ["remapped_rows"]}
    assert [t["task_id"] for t in doc["tasks"]] == ["pid-4242"]
    assert doc["topology"]["gpus"][1]["numa_node"] == 1
    assert len(doc["read_ms"]) == 3


def test_xids_seen_while_probing_are_reported() -> None:
    nvml = two_gpus()
    nvml.push_xid(1, 79)
    code, text = run(["--interval", "0"], nvml)
    assert code == 0
    assert "XID 79 on GPU1" in text
    assert "XID last 79 count 1" in text


def test_without_a_driver_one_line_and_exit_2(capsys) -> None:
    code, text = run([], FakeNvml([], available=False))
    assert (code, text) == (2, "")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fleetpilot probe: NVML unavailable (")


@pytest.mark.parametrize("argv", [["--samples", "0"], ["--samples", "x"], ["--interval", "-1"],
                                  ["--interval", "nan"]])
def test_bad_arguments_are_one_line(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["probe", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fleetpilot probe: error: argument" in err


def test_32_bit_pcie_counters_are_said_to_be_polled_and_how_often() -> None:
    # As an H200 on driver 580 reports them: 32-bit, on a PCIe 5 x16 link (67 ms to wrap).
    nvml = FakeNvml([FakeGpu(name="NVIDIA H200", pcie_tx_bytes=0, pcie_rx_bytes=0, pcie_counter_bits=32,
                             link_gen_max=5)])
    code, text = run(["--samples", "2", "--interval", "0"], nvml)
    assert code == 0
    assert "PCIe byte counters read every 16.8 ms: they wrap sooner than a reading period" in text
    code, text = run(["--samples", "1", "--json"], nvml)
    assert json.loads(text)["pcie_poll_ms"] == 16.78
    wide = FakeNvml([FakeGpu(pcie_tx_bytes=0, pcie_rx_bytes=0, pcie_counter_bits=64)])
    assert "PCIe byte counters read" not in run(["--samples", "2", "--interval", "0"], wide)[1]


@pytest.mark.parametrize("interval", ["1e300", "86401"])
def test_an_interval_over_a_day_is_refused_before_any_reading(interval, capsys) -> None:
    # 1e300 read the GPUs once, then time.sleep's OverflowError came out as a traceback.
    # Parsed only: a day and a second was taken, and slept.
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["probe", "--samples", "2", "--interval", interval])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --interval: must be at most 86400 (a day)" in err
