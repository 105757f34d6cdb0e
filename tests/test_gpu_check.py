"""``deploy/gpu-check/node_check.py`` on a node whose GPU cannot run CUDA (the fake NVML).

The real run is on a GPU node (README: "Running on real GPUs"). Here the check must read
the fake GPU through the real collector process and bus, and report the CUDA steps as
FAIL lines and exit 1, not crash or pass, while the whole loop (``fleetpilot up`` on NVML
and the process backend) still places, runs and judges its task.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE_PYNVML = '''
import sys
from fleetpilot.fleet.fake_nvml import FakeGpu, FakeNvml
sys.modules[__name__] = FakeNvml([FakeGpu(name="NVIDIA H200", memory_total=141 << 30, memory_used=600 << 20)])
'''


def test_without_cuda_the_node_check_fails_its_cuda_steps_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "pynvml.py").write_text(FAKE_PYNVML)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    # A log left by an earlier run into the same folder (the process backend appends):
    # its lines must not be read as this run's.
    stale = tmp_path / "out" / "tasks" / "gpu-check-grow.out"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"t": 0, "blocks": 16, "reserved_mb": 16384}\n')
    proc = subprocess.run([sys.executable, str(ROOT / "deploy/gpu-check/node_check.py"), "--out", str(tmp_path / "out"),
                           "--grow-gb", "2"], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("PASS nvml: 1 GPU(s): NVIDIA H200, driver 550.90.07")
    assert lines[1].startswith("PASS collector: 1 topology report(s)")
    verdicts = {line.split()[1].rstrip(":"): line.split()[0] for line in lines if line.startswith(("PASS", "FAIL"))}
    assert verdicts == {"nvml": "PASS", "collector": "PASS", "attribution": "FAIL", "fingerprint": "FAIL",
                        "pcie": "FAIL", "evict": "FAIL", "oom": "FAIL", "fleet": "FAIL", "envelope": "FAIL"}
    assert lines[-1].startswith("some checks FAILED")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["checks"]["oom"]["lifecycle"][-1]["state"] == "failed"  # not mistaken for an OOM
    assert report["collector_exit_code"] == 0
    assert report["task_series"]["task_view"] == []  # the stale log's line is gone with it
    # The whole loop still ran: placed on the fake GPU, started, failed, judged a failure.
    fleet = report["checks"]["fleet"]
    assert [e["action"] for e in fleet["events"]["decision.made.v1"]] == ["assign"]
    assert [e["state"] for e in fleet["events"]["task.lifecycle.v1"]] == ["started", "failed"]
    assert [e["outcome"] for e in fleet["events"]["feedback.recorded.v1"]] == ["failure"]
    assert report["checks"]["envelope"]["envelope_mb"] == []  # a failed run teaches no envelope
