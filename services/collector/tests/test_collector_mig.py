"""The collector on a node whose GPU is cut into MIG slices (a FakeNvml), through a real
nats-server: what a consumer decodes off the bus."""

from __future__ import annotations

from fleetpilot.contracts import NodeTelemetry, TaskTelemetry, TopologyReport, decode
from fleetpilot.fleet.fake_nvml import NVML_DEVICE_MIG_ENABLE, FakeGpu, FakeMigDevice, FakeNvml
from fleetpilot.fleet.nvml_reader import NvmlReader
from fleetpilot.runtime.testing import eventually as wait_for
from fleetpilot_services.collector.service import CollectorSettings, build

GIB = 1024**3


async def test_a_task_on_a_mig_slice_is_published_with_its_memory_and_the_slices_are_seen(nats_server, client):
    # Before, the GPU was read whole: without privileges NVML gave the task's process no
    # memory, so telemetry.task never carried the task and nothing showed the slices.
    gpu = FakeGpu(uuid="GPU-0", name="NVIDIA H100 80GB HBM3", memory_total=81_559 * 2**20,
                  mig_mode=(NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_ENABLE), mig_devices=[
                      FakeMigDevice(uuid="MIG-a", gpu_instance_id=1, gpu_slices=3, compute_slices=3,
                                    memory_size_mb=40_448, compute_procs=[(4242, 7 * GIB)], memory_used=8 * GIB),
                      FakeMigDevice(uuid="MIG-b", gpu_instance_id=5, gpu_slices=1, compute_slices=1,
                                    memory_size_mb=9_984)])
    reader = NvmlReader(FakeNvml([gpu]), node="mig-node", root="/nonexistent-root",
                        task_of_pid=lambda pid: "infer-7" if pid == 4242 else None)
    batches: list[NodeTelemetry] = []
    tasks: list[TaskTelemetry] = []
    reports: list[TopologyReport] = []

    async def on_gpu(msg) -> None:
        batches.append(decode(msg.data, NodeTelemetry))

    async def on_task(msg) -> None:
        tasks.append(decode(msg.data, TaskTelemetry))

    async def on_report(msg) -> None:
        reports.append(decode(msg.data, TopologyReport))

    await client.subscribe("telemetry.gpu.>", on_gpu)
    await client.subscribe("telemetry.task.*", on_task)
    await client.subscribe("topology.report.*", on_report)
    host = build(CollectorSettings(source="nvml", interval_s=0.2, metrics_port=-1, nats_url=nats_server.url,
                                   fleet_spec="", openb_nodes=""), reader=reader)
    await host.start()
    try:
        await wait_for(lambda: tasks and batches and reports, what="telemetry and the topology of the MIG node")
    finally:
        await host.stop()
    task = tasks[-1]
    assert (task.task_id, task.gpus, task.memory_used_mb, task.pids) == ("infer-7", [0], 7_168.0, [4242])
    mig = batches[-1].gpus[0].mig
    assert mig and mig.enabled
    assert [(d.uuid, d.profile, d.memory_total_mb, d.memory_used_mb, d.pids) for d in mig.devices] == [
        ("MIG-a", "3g.40gb", 40_448.0, 8_192.0, [4242]), ("MIG-b", "1g.10gb", 9_984.0, 0.0, [])]
    layout = reports[-1].node.gpus[0].mig
    assert layout and [(d.index, d.gpu_instance_id, d.profile) for d in layout.devices] == [
        (0, 1, "3g.40gb"), (1, 5, "1g.10gb")]
