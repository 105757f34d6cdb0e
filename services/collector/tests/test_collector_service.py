"""The collector over a real nats-server: telemetry, task samples, simulated hardware events,
the ``gpu_state`` bucket and topology reports; and its start-up errors."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from collections import defaultdict

import msgspec
import pytest
from fleetpilot.contracts import (
    GpuSample,
    NodeTelemetry,
    SimAck,
    SimCommand,
    SimEvent,
    TaskTelemetry,
    TopologyReport,
    decode,
    encode,
)
from fleetpilot.fleet.inventory import load_fleet_spec
from fleetpilot.fleet.nvml_reader import nvml_available
from fleetpilot.fleet.simulator import SimulatedFleet
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually as wait_for
from fleetpilot_services.collector.service import CollectorSettings, NoGpuSource, build, open_reader

THREE_SITE = load_fleet_spec()
NODES = {n.node for n in THREE_SITE.nodes}




def settings(url: str, **overrides) -> CollectorSettings:
    return CollectorSettings(**{"source": "sim", "interval_s": 0.2, "metrics_port": -1, "nats_url": url,
                                "fleet_spec": "", "openb_nodes": "", **overrides})


def assert_valid_sample(s: GpuSample, node: str) -> None:
    """Every field of the resource schema within its physical range."""
    assert s.node == node and s.uuid and s.model and s.at > 0
    assert 0 <= s.gpu < 8
    assert 0.0 <= s.utilization_gpu_pct <= 100.0
    assert 0.0 <= s.utilization_memory_pct <= 100.0
    assert s.memory_total_mb > 0 and s.memory_used_mb >= 0 and s.memory_free_mb >= 0
    assert math.isclose(s.memory_used_mb + s.memory_free_mb, s.memory_total_mb, abs_tol=1.0)
    assert 0 < s.temperature_c < 120
    assert 0 < s.power_w <= s.power_limit_w
    assert s.sm_clock_mhz > 0
    assert s.pcie_tx_kbps >= 0 and s.pcie_rx_kbps >= 0
    for counter in (s.ecc_corrected, s.ecc_uncorrected, s.retired_pages, s.remapped_rows, s.pcie_replays,
                    s.xid_count):
        assert counter >= 0
    assert 0 < s.pcie_link_width <= s.pcie_link_width_max
    for reading in (s.cuda_context_switches_per_sec, s.nvlink_bandwidth_utilization_ratio):
        assert reading.value >= 0 and 0.0 <= reading.uncertainty_score <= 1.0
    assert 0.0 <= s.nvlink_bandwidth_utilization_ratio.value <= 1.0
    assert all(p.used_mb > 0 for p in s.processes)
    assert s.labels.get("site") in {"site-a", "site-b", "edge"}


class Recorder:
    """Core subscriptions on the test's own connection, made before the collector starts."""

    def __init__(self) -> None:
        self.telemetry: dict[str, list[NodeTelemetry]] = defaultdict(list)
        self.tasks: list[TaskTelemetry] = []
        self.reports: list[TopologyReport] = []
        self.sim_events: list[SimEvent] = []

    async def attach(self, bus: NatsBus) -> None:
        async def on_gpu(msg) -> None:
            t = decode(msg.data, NodeTelemetry)
            assert msg.subject == f"telemetry.gpu.{t.node}"
            self.telemetry[t.node].append(t)

        async def on_task(msg) -> None:
            self.tasks.append(decode(msg.data, TaskTelemetry))

        async def on_report(msg) -> None:
            self.reports.append(decode(msg.data, TopologyReport))

        async def on_sim(msg) -> None:
            self.sim_events.append(decode(msg.data, SimEvent))

        await bus.subscribe("telemetry.gpu.>", on_gpu)
        await bus.subscribe("telemetry.task.*", on_task)
        await bus.subscribe("topology.report.*", on_report)
        await bus.subscribe("sim.event.*", on_sim)


async def test_publishes_valid_telemetry_topology_and_gpu_state(nats_server, client):
    seen = Recorder()
    await seen.attach(client)
    host = build(settings(nats_server.url))
    await host.start()
    try:
        await wait_for(lambda: {r.node.node for r in seen.reports} == NODES)
        assert all(r.source == "sim" for r in seen.reports)
        assert next(r for r in seen.reports if r.node.node == "a100-00").node.site == "site-a"

        await wait_for(lambda: set(seen.telemetry) == NODES)
        for node, batches in seen.telemetry.items():
            batch = batches[-1]
            assert batch.source == "sim"
            assert [s.gpu for s in batch.gpus] == list(range(len(THREE_SITE.node(node).gpus)))
            for s in batch.gpus:
                assert_valid_sample(s, node)

        ack = decode(await client.request("sim.control", encode(SimCommand(
            verb="place", task_id="job-1", node="a100-03", gpus=[2, 3], peak_memory_mb=12_000.0,
            duration_s=600.0, utilization_pct=70.0))), SimAck)
        assert ack.ok, ack.detail
        await wait_for(lambda: any(t.task_id == "job-1" for t in seen.tasks))
        task = next(t for t in seen.tasks if t.task_id == "job-1")
        assert task.node == "a100-03" and task.gpus == [2, 3] and len(task.pids) == 2
        assert task.memory_used_mb > 0 and 0 < task.utilization_gpu_pct <= 70.0
        # The task shows up on its GPUs in the next batch of that node.
        await wait_for(lambda: any(p.task_id == "job-1" for s in seen.telemetry["a100-03"][-1].gpus
                                   for p in s.processes))
        busy = {s.gpu for s in seen.telemetry["a100-03"][-1].gpus if s.utilization_gpu_pct > 0}
        assert busy == {2, 3}

        refused = decode(await client.request("sim.control", encode(SimCommand(
            verb="place", task_id="job-2", node="no-such-node", gpus=[0]))), SimAck)
        assert not refused.ok and "no-such-node" in refused.detail

        kv = await client.kv("gpu_state")
        keys = await kv.keys()
        assert len(keys) == THREE_SITE.gpu_count
        entry = await kv.get("a100-03.2")
        assert entry is not None
        latest = msgspec.json.decode(entry.value, type=GpuSample)
        assert latest.node == "a100-03" and latest.gpu == 2
        assert_valid_sample(latest, "a100-03")
    finally:
        await host.stop()


async def test_fatal_xid_reaches_the_bus_as_task_failed(nats_server, client):
    seen = Recorder()
    await seen.attach(client)
    fleet = SimulatedFleet(THREE_SITE, seed=3)
    host = build(settings(nats_server.url), reader=fleet)
    await host.start()
    try:
        # The endpoint's subscription reaches the server asynchronously; a first telemetry
        # batch proves the collector's connection is through.
        await wait_for(lambda: "h100-01" in seen.telemetry)
        for task_id, duration in (("doomed", 600.0), ("short", 0.3)):
            ack = decode(await client.request("sim.control", encode(SimCommand(
                verb="place", task_id=task_id, node="h100-01", gpus=[0] if task_id == "doomed" else [5],
                peak_memory_mb=8_000.0, duration_s=duration))), SimAck)
            assert ack.ok, ack.detail
        fleet.inject_xid("h100-01", 0, 79)
        await wait_for(lambda: {e.task_id for e in seen.sim_events} >= {"doomed", "short"})
        await asyncio.sleep(0.5)  # two more ticks: nothing else may be reported for either task
        by_task = {tid: [e.kind for e in seen.sim_events if e.task_id == tid] for tid in ("doomed", "short")}
        assert by_task == {"doomed": ["task_failed"], "short": ["finished"]}
        failed = next(e for e in seen.sim_events if e.task_id == "doomed")
        assert failed.node == "h100-01" and failed.gpu == 0 and "Xid 79" in failed.detail
        assert [e.kind for e in seen.sim_events if e.task_id is None] == ["xid"]
        assert fleet.running() == []
    finally:
        await host.stop()


def test_openb_nodes_setting_loads_the_openb_fleet(tmp_path):
    csv = tmp_path / "nodes.csv"
    csv.write_text("sn,cpu_milli,memory_mib,gpu,model\nob-0,64000,262144,2,V100M16\nob-1,32000,131072,0,\n")
    reader, source = open_reader(CollectorSettings(source="auto", openb_nodes=str(csv), fleet_spec=""))
    if source == "nvml":
        pytest.skip("NVML present: auto prefers the real GPUs")
    assert source == "sim" and reader.node_names() == ["ob-0", "ob-1"]
    assert [s.model for s in reader.sample("ob-0")] == ["V100-16GB", "V100-16GB"]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"source": "sim", "openb_nodes": "/nonexistent/nodes.csv"}, "cannot load the simulated fleet"),
    ({"source": "sim", "fleet_spec": "/nonexistent/fleet.yaml"}, "cannot load the simulated fleet"),
])
def test_bad_fleet_configuration_is_a_one_line_error(overrides, message):
    with pytest.raises(NoGpuSource, match=message):
        open_reader(CollectorSettings(**{"fleet_spec": "", "openb_nodes": "", **overrides}))


@pytest.mark.parametrize("text", ["", "sites: 3\n", "sites: [{name: a, groups: [{prefix: x, shape: 5}]}]\n", "sites: [\n"])
def test_a_malformed_fleet_spec_is_a_one_line_error(tmp_path, text):
    # Before, an empty or mis-shaped spec raised AttributeError/TypeError (and bad YAML a
    # YAMLError) out of open_reader: a traceback instead of the one line and exit 2.
    spec = tmp_path / "fleet.yaml"
    spec.write_text(text)
    with pytest.raises(NoGpuSource, match="cannot load the simulated fleet") as caught:
        open_reader(CollectorSettings(source="sim", fleet_spec=str(spec), openb_nodes=""))
    assert "\n" not in str(caught.value)


@pytest.mark.skipif(nvml_available(), reason="a real GPU is present, so the collector would start")
def test_without_nvml_or_simulator_the_process_exits_with_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETPILOT_COLLECTOR_")}
    env["FLEETPILOT_COLLECTOR_SOURCE"] = "auto"
    proc = subprocess.run([sys.executable, "-m", "fleetpilot_services.collector"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("fleetpilot-collector: no GPU found")
    assert "FLEETPILOT_COLLECTOR_SOURCE=sim" in lines[0]
    assert proc.stdout == ""


async def test_nvml_source_publishes_the_same_schema(nats_server, client):
    """On a GPU node: NVML readings (a FakeNvml here) go out like simulated ones, XIDs drained."""
    from fleetpilot.fleet.fake_nvml import FakeGpu, FakeNvml
    from fleetpilot.fleet.nvml_reader import NvmlReader

    gpus = [FakeGpu(uuid=f"GPU-{i}", pci_bus_id=f"00000000:0{i}:00.0", memory_used=(i + 1) * 2**30, util_gpu=40 * i,
                    compute_procs=[(4242, 2**30)] if i == 0 else []) for i in range(2)]
    fake = FakeNvml(gpus)
    reader = NvmlReader(fake, node="gpu-node-1", site="site-a", root="/nonexistent-root")
    seen = Recorder()
    await seen.attach(client)
    host = build(settings(nats_server.url, source="nvml"), reader=reader)
    await host.start()
    try:
        await wait_for(lambda: "gpu-node-1" in seen.telemetry and seen.reports)
        assert seen.reports[0].source == "nvml" and seen.reports[0].node.site == "site-a"
        batch = seen.telemetry["gpu-node-1"][-1]
        assert batch.source == "nvml" and [s.uuid for s in batch.gpus] == ["GPU-0", "GPU-1"]
        for s in batch.gpus:
            assert s.labels["site"] == "site-a"
        assert [s.utilization_gpu_pct for s in batch.gpus] == [0.0, 40.0]
        assert batch.gpus[0].memory_used_mb == 1024.0 and batch.gpus[0].processes[0].pid == 4242
        fake.push_xid(1, 79)
        await wait_for(lambda: seen.telemetry["gpu-node-1"][-1].gpus[1].xid_last == 79)
        assert not reader.events()  # the collector drained the queue
        assert seen.sim_events == []  # real hardware events are not simulator events
        # No simulator, so no sim.control endpoint.
        with pytest.raises(TimeoutError):
            await client.request("sim.control", encode(SimCommand(verb="remove", task_id="x")), timeout_s=0.5)
    finally:
        await host.stop()


async def test_stopping_the_collector_stops_the_pcie_thread_and_shuts_nvml_down(nats_server, client):
    """A collector that stopped left NVML initialised and the PCIe counter thread polling
    (a daemon: it died only with the process, so a collector stopped in-process, as in
    ``fleetpilot up``, kept reading the GPUs every 17 ms)."""
    import threading

    from fleetpilot.fleet.fake_nvml import FakeGpu, FakeNvml
    from fleetpilot.fleet.nvml_reader import NvmlReader

    fake = FakeNvml([FakeGpu(uuid="GPU-0", pcie_tx_bytes=0, pcie_rx_bytes=0, pcie_counter_bits=32)])
    reader = NvmlReader(fake, node="gpu-node-1", root="/nonexistent-root")
    seen = Recorder()
    await seen.attach(client)
    host = build(settings(nats_server.url, source="nvml", interval_s=0.05), reader=reader)
    await host.start()
    try:
        await wait_for(lambda: len(seen.telemetry.get("gpu-node-1", [])) >= 2)
        pollers = [t for t in threading.enumerate() if t.name == "pcie-counters"]
        assert pollers and reader.pcie_poll_s is not None  # 32-bit counters: polled on a thread
    finally:
        await host.stop()
    assert not fake.initialised
    assert not any(t.is_alive() for t in pollers)


async def test_the_node_s_heartbeat_goes_on_while_every_sample_fails(nats_server, client):
    """The topology re-sent is the node's heartbeat: a reading that fails every tick must not
    make a node whose collector runs look silent (then unreachable, its tasks given up)."""
    from fleetpilot.fleet.fake_nvml import FakeGpu, FakeNvml
    from fleetpilot.fleet.nvml_reader import NvmlReader

    class FailingReads(NvmlReader):
        def sample(self, node: str) -> list[GpuSample]:
            raise RuntimeError("NVML: Unknown Error")

    reader = FailingReads(FakeNvml([FakeGpu(uuid="GPU-0")]), node="gpu-node-1", root="/nonexistent-root")
    seen = Recorder()
    await seen.attach(client)
    host = build(settings(nats_server.url, source="nvml", topology_every_s=0.3), reader=reader)
    await host.start()
    try:
        await wait_for(lambda: len(seen.reports) >= 4, what="the topology re-sent while sampling fails")
    finally:
        await host.stop()
    assert {r.node.node for r in seen.reports} == {"gpu-node-1"}
    assert "gpu-node-1" not in seen.telemetry


async def test_telemetry_goes_out_when_the_gpu_state_bucket_cannot_be_written(nats_server, client, monkeypatch):
    from fleetpilot.runtime.nats_bus import NatsKeyValue

    attempts: list[int] = []

    async def timing_out(kv, items) -> None:
        attempts.append(len(items))
        raise TimeoutError("nats: timeout")

    monkeypatch.setattr(NatsKeyValue, "put_many", timing_out)
    seen = Recorder()
    await seen.attach(client)
    host = build(settings(nats_server.url))
    await host.start()
    try:
        await wait_for(lambda: len(seen.telemetry) == len(NODES), what="every node's telemetry")
    finally:
        await host.stop()
    # The write was tried and failed before that telemetry went out: without this, a sample
    # that stopped writing the bucket (or wrote it another way) would pass untested.
    assert attempts and all(attempts), attempts


async def test_infiniband_port_rates_come_from_counter_deltas(nats_server, client, tmp_path):
    """On a real node the batch carries each IB/RoCE port's throughput from sysfs deltas."""
    from fleetpilot.fleet.fake_nvml import FakeGpu, FakeNvml
    from fleetpilot.fleet.nvml_reader import NvmlReader

    port = tmp_path / "sys/class/infiniband/mlx5_0/ports/1"
    (port / "counters").mkdir(parents=True)
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("InfiniBand\n")
    words = {"n": 0}

    def tick_counters() -> None:
        # 1.25e9 words = 5 GB more each time: tens of Gb/s over the 0.2 s interval.
        words["n"] += 1_250_000_000
        (port / "counters/port_xmit_data").write_text(str(words["n"]))
        (port / "counters/port_rcv_data").write_text(str(words["n"] // 2))

    tick_counters()
    reader = NvmlReader(FakeNvml([FakeGpu(uuid="GPU-0", pci_bus_id="00000000:01:00.0")]), node="ib-node",
                        root=str(tmp_path))
    seen = Recorder()
    await seen.attach(client)
    host = build(settings(nats_server.url, source="nvml", host_root=str(tmp_path)), reader=reader)
    await host.start()
    try:
        for _ in range(3):
            tick_counters()
            await asyncio.sleep(0.25)

        def measured():
            return [p for b in seen.telemetry.get("ib-node", []) for p in b.nic_ports
                    if p.uncertainty_score < 1.0 and p.tx_gbps > 0]

        rates = await wait_for(measured)
        assert rates[0].device == "mlx5_0" and rates[0].port == 1
        assert rates[0].rx_gbps == pytest.approx(rates[0].tx_gbps / 2, rel=0.01)
        assert 0 < rates[0].utilisation
    finally:
        await host.stop()


async def test_nvml_topology_and_events_are_read_off_the_event_loop(nats_server, client):
    """NVML's topology is hundreds of blocking calls (NVLinks, GPU pairs) and XIDs wait on its
    event set: read on the loop, they froze the service (NATS pings, the other jobs) at
    start and on every heartbeat. Samples already ran in a worker thread; these must too."""
    import threading

    from fleetpilot.fleet.fake_nvml import FakeGpu, FakeNvml
    from fleetpilot.fleet.nvml_reader import NvmlReader

    loop_thread = threading.get_ident()
    threads: dict[str, set[int]] = defaultdict(set)

    class Recording(NvmlReader):
        def topology(self, node: str):
            threads["topology"].add(threading.get_ident())
            return super().topology(node)

        def events(self):
            threads["events"].add(threading.get_ident())
            return super().events()

    reader = Recording(FakeNvml([FakeGpu(uuid="GPU-0")]), node="gpu-node-1", root="/nonexistent-root")
    seen = Recorder()
    await seen.attach(client)
    host = build(settings(nats_server.url, source="nvml", topology_every_s=0.3), reader=reader)
    await host.start()
    try:
        await wait_for(lambda: len(seen.reports) >= 2 and seen.telemetry["gpu-node-1"], what="reports and samples")
    finally:
        await host.stop()
    assert threads["topology"] and threads["events"]
    assert loop_thread not in threads["topology"] | threads["events"]


class HangingReads:
    """Wraps an ``NvmlReader``'s reads: the one named ``hang`` blocks until ``release`` is set,
    as an NVML call does on a GPU fallen off the bus; every read started is recorded, with the
    most that ever ran at once."""

    def __init__(self, reader, hang: str) -> None:
        import threading

        self.hang = hang
        self.release = threading.Event()
        self.started: list[str] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self._count = threading.Lock()
        for name in ("sample", "events", "topology"):
            setattr(reader, name, self._gated(name, getattr(reader, name)))

    def _gated(self, name: str, read):
        def gated(*args):
            with self._count:
                self.started.append(name)
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                if name == self.hang:
                    self.release.wait(30)
                return read(*args)
            finally:
                with self._count:
                    self.in_flight -= 1
        return gated


def http_get(port: int, path: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.parametrize("read", ["sample", "events", "topology"])
async def test_a_hung_nvml_read_is_told_never_piled_on_and_reading_resumes_when_it_returns(
        nats_server, client, caplog, read):
    """A GPU fallen off the bus hangs an NVML call. Awaited without a bound, it stopped the
    sampling job (or, for the topology, the start-up) for good, silently, and each heartbeat
    piled another thread onto NVML's lock. The read must time out, /healthz say so (503, which
    read), no other read start while it hangs, and all go on once it returns."""
    import json
    import logging

    from fleetpilot.fleet.fake_nvml import FakeGpu, FakeNvml
    from fleetpilot.fleet.nvml_reader import NvmlReader

    reader = NvmlReader(FakeNvml([FakeGpu(uuid="GPU-0")]), node="gpu-node-1", root="/nonexistent-root")
    gate = HangingReads(reader, hang=read)
    seen = Recorder()
    await seen.attach(client)
    caplog.set_level(logging.INFO, logger="fleetpilot.collector")
    host = build(settings(nats_server.url, source="nvml", interval_s=0.05, topology_every_s=0.1, nvml_timeout_s=0.5,
                          metrics_port=0), reader=reader)
    try:
        # A topology read that hangs at start must not hold up the start-up.
        await asyncio.wait_for(host.start(), 5)
        await wait_for(lambda: not host.health()["ok"], 5, what=f"/healthz not ok while the {read} read hangs")
        status, body = await asyncio.to_thread(http_get, host._ops.port, "/healthz")
        hung = json.loads(body)["nvml_hung"]
        assert status == 503 and hung["read"] == read and "has not returned" in hung["reason"], body
        assert hung["for_s"] >= 0.5
        started = len(gate.started)
        await asyncio.sleep(1.0)  # some 20 sampling ticks and 10 heartbeats
        assert gate.started[-1] == read and len(gate.started) == started, gate.started[started - 1:]
        assert "gpu-node-1" not in seen.telemetry
        metric = host.metrics.registry.get_sample_value
        assert metric("fleetpilot_collector_nvml_timeouts_total", {"read": read}) == 1
        assert sum(metric("fleetpilot_collector_nvml_skipped_total", {"read": r}) or 0
                   for r in ("sample", "events", "topology")) >= 10
        assert metric("fleetpilot_collector_nvml_hung_seconds") >= 1.0
        # Told once, and the reads skipped at a low rate, not once a tick.
        said = [r.getMessage() for r in caplog.records if r.name == "fleetpilot.collector"]
        assert len([m for m in said if f"NVML {read} read has not returned after 0.5 s" in m]) == 1, said
        assert len([m for m in said if "read skipped" in m]) == 1, said

        reports = len(seen.reports)
        gate.release.set()
        await wait_for(lambda: host.health()["ok"] and seen.telemetry.get("gpu-node-1"), 5,
                       what="sampling resumed and /healthz ok again")
        await wait_for(lambda: len(seen.reports) > reports, 5, what="the heartbeat's topology again")
        assert "nvml_hung" not in host.health()
        assert metric("fleetpilot_collector_nvml_hung_seconds") == 0
        assert any(f"NVML {read} read returned after" in r.getMessage() for r in caplog.records)
    finally:
        gate.release.set()
        await host.stop()
    assert gate.most_in_flight == 1


async def test_a_read_whose_caller_was_cancelled_still_holds_nvml():
    """A read runs on when its caller is cancelled (a stop, a start-up hook run again): the
    next read waits for it, up to the timeout, rather than start a second NVML call beside it."""
    import threading

    from fleetpilot_services.collector.watchdog import NvmlHung, NvmlWatchdog

    watchdog = NvmlWatchdog(0.3)
    release = threading.Event()
    calls: list[str] = []

    def blocked() -> str:
        calls.append("blocked")
        release.wait(5)
        return "late"

    first = asyncio.ensure_future(watchdog.call("topology", blocked))
    await asyncio.sleep(0.05)
    first.cancel()
    with pytest.raises(NvmlHung, match="topology read has not returned"):
        await watchdog.call("sample", calls.append, "sample")
    assert calls == ["blocked"] and watchdog.health()["nvml_hung"]["read"] == "topology"
    release.set()
    await wait_for(lambda: watchdog.health() is None, 5, what="the read returned")
    assert await watchdog.call("sample", lambda: "read") == "read"


@pytest.mark.parametrize("value", ["0", "-1", "nan", "1e6", "soon"])
def test_a_bad_nvml_timeout_is_a_one_line_error(monkeypatch, value):
    from fleetpilot.runtime.config import BadSettings

    monkeypatch.setenv("FLEETPILOT_COLLECTOR_NVML_TIMEOUT_S", "2.5")
    assert CollectorSettings.from_environment().nvml_timeout_s == 2.5
    monkeypatch.setenv("FLEETPILOT_COLLECTOR_NVML_TIMEOUT_S", value)
    with pytest.raises(BadSettings) as bad:
        CollectorSettings.from_environment()
    message = str(bad.value)
    assert message.startswith(f"FLEETPILOT_COLLECTOR_NVML_TIMEOUT_S={value!r}") and "\n" not in message, message


async def test_a_node_whose_reading_is_nan_sends_nothing_undecodable_and_the_others_go_on(nats_server, client, caplog):
    """JSON has no NaN: written as ``null``, the node's batch and its ``gpu_state`` values were
    sent and every consumer failed to decode them. Refused (``encode``), the batch must not take
    every other node's telemetry down with it: the simulator samples the whole fleet at once."""
    import dataclasses

    class NanPower(SimulatedFleet):
        def sample(self, node: str) -> list[GpuSample]:
            samples = super().sample(node)
            return [msgspec.structs.replace(samples[0], power_w=math.nan), *samples[1:]] if node == "a100-00" \
                else samples

    @dataclasses.dataclass
    class Raw:
        subject: str
        data: bytes

    sent: list[Raw] = []

    async def on_gpu(msg) -> None:
        sent.append(Raw(msg.subject, msg.data))

    await client.subscribe("telemetry.gpu.>", on_gpu)
    host = build(settings(nats_server.url), reader=NanPower(THREE_SITE, seed=3))
    await host.start()
    try:
        await wait_for(lambda: {r.subject.rsplit(".", 1)[-1] for r in sent} >= NODES - {"a100-00"},
                       what="the other nodes' telemetry")
        await asyncio.sleep(0.5)  # two more ticks
    finally:
        await host.stop()
    assert all(decode(r.data, NodeTelemetry).node != "a100-00" for r in sent)
    keys = await (await client.kv("gpu_state")).keys()
    assert keys and not any(k.startswith("a100-00.") for k in keys)
    assert any(k.startswith("a100-01.") for k in keys)
    told = [r.getMessage() for r in caplog.records if r.name == "fleetpilot.collector" and r.levelname == "ERROR"]
    # Told once, not at every tick.
    assert len(told) == 1 and "a100-00 GPU 0" in told[0] and "$.power_w is nan" in told[0]


@pytest.mark.parametrize(("variable", "value"), [
    ("INTERVAL_S", "0"), ("INTERVAL_S", "-1"), ("INTERVAL_S", "nan"), ("INTERVAL_S", "inf"),
    ("TOPOLOGY_EVERY_S", "0"), ("TOPOLOGY_EVERY_S", "-30"), ("TOPOLOGY_EVERY_S", "nan"),
    ("SPEED", "-1"), ("SPEED", "0"), ("SPEED", "inf"), ("SPEED", "nan"),
    ("SEED", "-1"),
])
def test_nonsense_timing_settings_are_a_one_line_error(monkeypatch, variable, value):
    """Before, these were taken: an interval of 0 (or below, or NaN) spun the sampling job in a
    busy loop over NVML; a negative speed raised "time only moves forward" every tick, so the
    simulator never ran; an infinite one made every reading NaN; a negative seed crashed the
    start with numpy's traceback instead of the one-line settings error."""
    from fleetpilot.runtime.config import BadSettings

    name = f"FLEETPILOT_COLLECTOR_{variable}"
    monkeypatch.setenv(name, value)
    with pytest.raises(BadSettings) as bad:
        CollectorSettings.from_environment()
    message = str(bad.value)
    assert message.startswith(f"{name}={value!r}") and "\n" not in message, message


def test_sensible_timing_settings_are_taken(monkeypatch):
    for variable, value in (("INTERVAL_S", "0.05"), ("TOPOLOGY_EVERY_S", "5"), ("SPEED", "60"), ("SEED", "7")):
        monkeypatch.setenv(f"FLEETPILOT_COLLECTOR_{variable}", value)
    got = CollectorSettings.from_environment()
    assert (got.interval_s, got.topology_every_s, got.speed, got.seed) == (0.05, 5.0, 60.0, 7)


async def test_a_sampling_round_gives_the_loop_back_between_groups_of_nodes(nats_server, monkeypatch):
    # Read at once, the openb fleet's 1,213 simulated nodes held the loop for 0.3 s of every
    # second, and the executor's sim.control requests waited behind them.
    from fleetpilot.runtime.testing import LoopTurns
    from fleetpilot_services.collector import service as collector

    monkeypatch.setattr(collector, "SIM_NODES_PER_TURN", 4)
    fleet = SimulatedFleet(THREE_SITE)
    turns = LoopTurns()
    turn_of_each_read: list[int] = []
    read_node = fleet.sample

    def sample_node(node: str) -> list[GpuSample]:
        turn_of_each_read.append(turns.count)
        return read_node(node)

    fleet.sample = sample_node  # type: ignore[method-assign]
    host = build(settings(nats_server.url, interval_s=3600.0), reader=fleet)
    await host.start()
    sample = next(p.job for p in host._periodic if p.job.__name__ == "sample")
    try:
        turn_of_each_read.clear()
        async with turns:
            events = await sample()
    finally:
        await host.stop()
    assert sum(isinstance(e, NodeTelemetry) for e in events) == len(NODES)
    # Four nodes read in each turn of the loop, then the loop's other work.
    assert len(turn_of_each_read) == len(NODES)
    assert len(set(turn_of_each_read)) == math.ceil(len(NODES) / 4), turn_of_each_read
