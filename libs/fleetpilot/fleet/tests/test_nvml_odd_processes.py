"""A process on the node, whatever its environment holds, does not stop the node's readings."""

from __future__ import annotations

from pathlib import Path

from fleetpilot.fleet.fake_nvml import FakeGpu, FakeNvml
from fleetpilot.fleet.nvml_reader import NvmlReader

GIB = 1024**3


def test_a_task_id_that_is_not_utf8_is_no_task_and_the_node_is_read(tmp_path: Path) -> None:
    # Any user may start a process with FLEETPILOT_TASK_ID set to bytes that are not UTF-8;
    # the executor never writes such an id. Before, decoding it raised out of sample().
    for pid, env in ((4242, b"PATH=/bin\0FLEETPILOT_TASK_ID=train-\xff\xfe\0"),
                     (4343, b"FLEETPILOT_TASK_ID=serve-2\0")):
        (tmp_path / f"proc/{pid}").mkdir(parents=True)
        (tmp_path / f"proc/{pid}/environ").write_bytes(env)
    gpu = FakeGpu(compute_procs=[(4242, 2 * GIB), (4343, 1 * GIB)])
    reader = NvmlReader(FakeNvml([gpu]), node="n1", root=tmp_path)
    (sample,) = reader.sample("n1")
    assert [(p.pid, p.task_id) for p in sample.processes] == [(4242, None), (4343, "serve-2")]
    assert {t.task_id for t in reader.task_samples("n1")} == {"pid-4242", "serve-2"}
