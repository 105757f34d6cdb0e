"""``fleetpilot topology``, ``fleetpilot fleet`` and ``fleetpilot fingerprint`` through
``fleetpilot.cli.main.main``: their output, and one line on stderr with exit 2 for bad input."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec
import pytest
from fleetpilot.cli.fleet_cmd import service_state
from fleetpilot.cli.local import NATS_URL_FILE
from fleetpilot.cli.main import main
from fleetpilot.cli.up import announce, hold_state_dir
from fleetpilot.contracts import Allocation, ExecutorPresence, GpuSample, NodeLedger, TopologyUpdated, encode
from fleetpilot.fleet.bandwidth import SiteNetwork
from fleetpilot.fleet.inventory import load_fleet_spec
from fleetpilot.fleet.simulator import SimulatedFleet
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.workload import MemoryGrowth

TOPO = Path(__file__).resolve().parents[2] / "fleet" / "data" / "topo"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture(autouse=True)
def no_fleet_running(monkeypatch, tmp_path):
    # `--nats-url` defaults to the environment, then to the bus a `fleetpilot up` announced
    # in the state directory: a developer's running fleet must not leak in.
    monkeypatch.delenv("FLEETPILOT_NATS_URL", raising=False)
    monkeypatch.setenv("FLEETPILOT_STATE_DIR", str(tmp_path / "no-fleet-here"))


# -- fleetpilot topology ------------------------------------------------------------------

def test_topology_prints_the_graph_of_a_dual_socket_server(capsys):
    code, out, err = run(capsys, "topology", str(TOPO / "dual_socket_pcie.txt"), "--node", "gpu-7")
    assert code == 0 and err == ""
    graph = json.loads(out)
    assert graph["node"] == "gpu-7" and graph["cpu_sockets"] == 2
    assert [(g["index"], g["numa_node"], g["cpu_affinity"]) for g in graph["gpus"]] == [
        (0, 0, "0-19,40-59"), (1, 0, "0-19,40-59"), (2, 1, "20-39,60-79"), (3, 1, "20-39,60-79")]
    links = {(link["a"], link["b"]): (link["kind"], link["cost"]) for link in graph["links"]}
    assert links[("GPU0", "GPU1")] == ("PIX", 2.0)
    assert links[("GPU0", "GPU2")] == ("SYS", 8.0)
    assert links[("GPU2", "GPU3")] == ("PHB", 4.0)
    assert [(n["name"], n["numa_node"]) for n in graph["nics"]] == [("mlx5_0", 0), ("mlx5_1", 1)]
    assert len(graph["gpu_cost_matrix"]) == 4


def test_topology_of_nvlink_machine_has_nvlink_links(capsys):
    code, out, _ = run(capsys, "topology", str(TOPO / "dgx_a100.txt"), "--compact")
    assert code == 0 and len(out.strip().splitlines()) == 1
    graph = json.loads(out)
    gpu_pairs = [link for link in graph["links"] if link["a"].startswith("GPU") and link["b"].startswith("GPU")]
    assert gpu_pairs and all(link["kind"] == "NV" and link["nvlinks"] == 12 for link in gpu_pairs)


def test_topology_corrects_phb_across_numa_nodes(capsys):
    code, out, _ = run(capsys, "topology", str(TOPO / "cloud_vm_phb.txt"))
    assert code == 0
    assert any(link["numa_corrected"] and link["reported"] == "PHB" and link["kind"] == "SYS"
               for link in json.loads(out)["links"])


@pytest.mark.parametrize(("content", "fragments"), [
    ("", ("line 1", "empty")),
    ("this is not a matrix\n", ("line 1", "GPU0")),
    ("\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tZZ\t0-7\t0\nGPU1\tZZ\t X \t0-7\t0\n", ("line 2",)),
    (b"\xff\xfe\x00garbage", ("not a text file",)),
])
def test_topology_bad_input_is_one_line_naming_the_line(capsys, tmp_path, content, fragments):
    path = tmp_path / "topo.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert_one_line_error(*run(capsys, "topology", str(path)), "fleetpilot topology", str(path), *fragments)


def test_topology_missing_file_is_one_line(capsys, tmp_path):
    assert_one_line_error(*run(capsys, "topology", str(tmp_path / "absent.txt")), "absent.txt")



def test_topology_reads_standard_input(capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO((TOPO / "hgx_h100.txt").read_text()))
    code, out, _ = run(capsys, "topology", "-")
    assert code == 0 and len(json.loads(out)["gpus"]) == 8

# -- fleetpilot fingerprint ---------------------------------------------------------------

def series_csv(tmp_path: Path) -> Path:
    # A linear leak: 1 GiB growing by 64 MiB every 10 s for 1000 s.
    rows = ["timestamp_s,used_bytes"] + [f"{t},{(1024 + 6.4 * t) * 2**20:.0f}" for t in range(0, 1001, 10)]
    path = tmp_path / "series.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_fingerprint_prints_json_with_the_prediction(capsys, tmp_path):
    code, out, err = run(capsys, "fingerprint", str(series_csv(tmp_path)), "--at", "0.25")
    assert code == 0 and err == ""
    result = json.loads(out)
    assert result["at"] == 0.25 and result["samples_total"] == 101 and result["samples_used"] == 26
    assert result["actual_peak_mb"] == pytest.approx(1024 + 6400, rel=1e-6)
    assert result["peak_so_far_mb"] == pytest.approx(1024 + 1600, rel=1e-6)
    # Seeing a quarter of a linear growth, the prediction must beat "peak so far".
    assert abs(result["error_mb"]) < abs(result["baseline_error_mb"])


@pytest.mark.parametrize(("content", "args", "fragments"), [
    ("0,100\n5,200\nten,300\n", (), ("line 3",)),
    ("0,100\n5,-1\n", (), ("line 2",)),
    ("", (), ("no samples",)),
    ("0,100\n5,200\n", ("--at", "1.5"), ("--at",)),
    # Finite, but past what the fits can square: NaN in the JSON and RuntimeWarnings on stderr.
    ("0,1e300\n1,1.5e300\n2,1.7e308\n3,1.7e308\n4,1e308\n", ("--at", "1"), ("too large to fingerprint",)),
])
def test_fingerprint_bad_input_is_one_line(capsys, tmp_path, content, args, fragments):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    assert_one_line_error(*run(capsys, "fingerprint", str(path), *args), "fleetpilot fingerprint", *fragments)


def test_fingerprint_missing_file_is_one_line(capsys, tmp_path):
    assert_one_line_error(*run(capsys, "fingerprint", str(tmp_path / "nope.csv")), "nope.csv")


# -- fleetpilot fleet ---------------------------------------------------------------------

def test_fleet_from_the_shipped_spec(capsys):
    code, out, err = run(capsys, "fleet")
    assert code == 0 and err == ""
    assert out.splitlines()[0] == "fleet three-site (shipped three-site spec): 3 sites, 28 nodes, 112 GPUs"
    assert "site-a (datacenter, eu-west): 8 nodes [a100-00 .. a100-07], 64 GPUs: 64x A100-40GB" in out
    assert "site-a <-> site-b a-b-dark-fibre: 100 Gbit/s, 9 ms RTT" in out
    assert "live:" not in out


def test_fleet_json_has_sites_models_links_and_estimates(capsys):
    code, out, _ = run(capsys, "fleet", "--json")
    doc = json.loads(out)
    assert code == 0 and "live" not in doc
    fleet = load_fleet_spec()
    summary = doc["fleet"]
    assert {s["name"]: s["gpus"] for s in summary["sites"]} == {"site-a": 64, "site-b": 32, "edge": 16}
    assert summary["gpu_models"] == {"A100-40GB": 64, "H100": 32, "Jetson-Orin": 16}
    assert len(summary["nodes"]) == len(fleet.nodes) and len(summary["links"]) == len(fleet.links)
    expected = {(e.a_site, e.b_site, e.strategy): e.effective_gbps for e in SiteNetwork(fleet.links).estimates()}
    assert {(b["a_site"], b["b_site"], b["strategy"]): b["effective_gbps"] for b in summary["bandwidth"]} == expected


def test_fleet_from_an_openb_node_list(capsys, tmp_path):
    csv = tmp_path / "nodes.csv"
    csv.write_text("sn,cpu_milli,memory_mib,gpu,model\nob-0,64000,262144,2,V100M16\nob-1,96000,393216,8,T4\n"
                   "ob-2,32000,131072,0,\n")
    code, out, _ = run(capsys, "fleet", "--openb", str(csv), "--json")
    summary = json.loads(out)["fleet"]
    assert code == 0 and summary["fleet"] == "openb"
    assert summary["gpu_models"] == {"T4": 8, "V100-16GB": 2}
    assert summary["sites"][0]["nodes"] == 3 and summary["bandwidth"] == []


@pytest.mark.parametrize(("flag", "content", "fragments"), [
    ("--spec", "sites: [{name: x}]\nlinks: [{a: x, b: nowhere, rate_gbps: 1, rtt_ms: 1}]\n", ("unknown site",)),
    ("--spec", "sites: [{name: x, groups: [{prefix: n, shape: {gpu_model: NoSuchGPU, gpus: 1}}]}]\n", ("NoSuchGPU",)),
    ("--spec", "sites: [\n  - {name: x\n", ("not a valid fleet",)),
    ("--openb", "sn,cpu_milli\nob-0,abc\n", ("not a valid fleet",)),
    # A GPU count no machine has built that many GPUs for ever; a negative one read as 0.
    ("--openb", "sn,cpu_milli,memory_mib,gpu,model\nob-0,64000,262144,99999999999,T4\n",
     ("node 'ob-0': gpu must be within 0..256, got 99999999999",)),
    ("--openb", "sn,cpu_milli,memory_mib,gpu,model\nob-0,64000,262144,-2,T4\n", ("gpu must be within 0..256",)),
    ("--spec", "sites: [{name: x, groups: [{prefix: n, count: 1e9, shape: {gpu_model: T4, gpus: 1}}]}]\n",
     ("group 'n': count must be a whole number",)),
    ("--spec", "sites: [{name: x, groups: [{prefix: n, count: 10000000, shape: {gpu_model: T4, gpus: 1}}]}]\n",
     ("group 'n': count must be within 0..100000",)),
])
def test_fleet_bad_spec_is_one_line(capsys, tmp_path, flag, content, fragments):
    path = tmp_path / "fleet.in"
    path.write_text(content)
    assert_one_line_error(*run(capsys, "fleet", flag, str(path)), "fleetpilot fleet", str(path), *fragments)


def test_fleet_spec_and_openb_together_is_a_usage_error(capsys):
    assert_one_line_error(*_exit_code(capsys, "fleet", "--spec", "a.yaml", "--openb", "b.csv"), "not allowed")


def _exit_code(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def test_fleet_missing_spec_is_one_line(capsys, tmp_path):
    assert_one_line_error(*run(capsys, "fleet", "--spec", str(tmp_path / "none.yaml")), "none.yaml")


def test_fleet_with_unreachable_nats_falls_back_to_the_spec(capsys, monkeypatch):
    from fleetpilot.runtime.embedded import free_port

    monkeypatch.setenv("FLEETPILOT_NATS_URL", f"nats://127.0.0.1:{free_port()}")
    code, out, err = run(capsys, "fleet")
    assert code == 0 and out.startswith("fleet three-site")
    assert len(err.strip().splitlines()) == 1 and "cannot connect to NATS" in err and "spec only" in err


NO_START = "3 starts in a row failed on orin-04, the last: cannot start t: [Errno 28] No space left on device"

async def _populate(url: str) -> list[GpuSample]:
    """What a collector and the topology service leave behind, written directly."""
    fleet = load_fleet_spec()
    sim = SimulatedFleet(fleet, seed=5)
    sim.place("job", "a100-01", [0, 1], MemoryGrowth(pattern="flat", base_mb=9000, peak_mb=9000, duration_s=999),
              util=65.0)
    sim.place("peer", "a100-01", [1], MemoryGrowth(pattern="flat", base_mb=2000, peak_mb=2000, duration_s=999),
              util=20.0)
    sim.advance(5.0)
    nodes = [fleet.node("a100-01"), fleet.node("orin-03")]
    samples = [s for n in nodes for s in sim.sample(n.node)]
    bus = await NatsBus.connect(url, "cli-test")
    await bus.ensure_topology()
    topology, state = await bus.kv("topology"), await bus.kv("gpu_state")
    # Operations' labels: a100-01's GPU 2 cordoned, GPU 3 pending maintenance; orin-04's
    # collector went silent (unreachable, and no samples of it are left).
    a100 = nodes[0]
    labelled = {2: {"cordoned": "true"}, 3: {"maintenance_pending": "true", "maintenance_risk": "0.91"}}
    nodes[0] = msgspec.structs.replace(a100, gpus=[
        msgspec.structs.replace(g, labels={**g.labels, **labelled.get(g.index, {})}) for g in a100.gpus])
    silent = fleet.node("orin-04")
    silent = msgspec.structs.replace(silent, gpus=[
        msgspec.structs.replace(g, labels={**g.labels, "unreachable": "true"}) for g in silent.gpus])
    await topology.put(node_key(silent.node), encode(silent))
    for n in nodes:
        await topology.put(node_key(n.node), encode(n))
    # orin-03's executor is down: two assigns reserved there 20 and 7 minutes ago wait for it;
    # a100-01 has one confirmed long ago and one reserved a second ago (on its way).
    ledger = await bus.kv("ledger")
    at = time.time()
    await ledger.put("orin-03", encode(NodeLedger(node="orin-03", allocations=[
        Allocation(task_id="x", decision_id="x.assign", gpu=0, milli=300, at=at - 1200),
        Allocation(task_id="y", decision_id="y.assign", gpu=0, milli=300, at=at - 420)])))
    await ledger.put("a100-01", encode(NodeLedger(node="a100-01", allocations=[
        Allocation(task_id="z", decision_id="z.assign", gpu=4, milli=1000, at=at - 3600, state="confirmed"),
        Allocation(task_id="w", decision_id="w.assign", gpu=5, milli=1000, at=at - 1)])))
    for s in samples:
        await state.put(f"{node_key(s.node)}.{s.gpu}", encode(s))
    # orin-03's executor last said it was there 20 minutes ago; a100-01's a second ago.
    executors = await bus.kv("executors")
    await executors.put("orin-03", encode(ExecutorPresence(node="orin-03", replica="exec-orin-03", at=at - 1200)))
    await executors.put("a100-01", encode(ExecutorPresence(node="a100-01", replica="exec-a100-01", at=at - 1)))
    await executors.put("orin-04", encode(ExecutorPresence(node="orin-04", replica="exec-orin-04", at=at - 2,
                                                           trouble=NO_START)))
    live_estimate = SiteNetwork(fleet.links, used_gbps={"a-b-dark-fibre": 60.0}).estimates()
    await bus.publish(TopologyUpdated(revision=1, nodes=["a100-01"], bandwidth=live_estimate, at=1.0))
    await bus.drain()
    return samples


@pytest.mark.parametrize(("labels", "state"), [
    ({}, "ok"),
    ({"not_ready": "true"}, "not_ready"),
    ({"not_ready": "true", "cordoned": "true"}, "not_ready"),  # the node's silence says more
    ({"unreachable": "true", "cordoned": "true"}, "unreachable"),
    ({"cordoned": "false"}, "ok"),  # an operator clears a label with "false"
    ({"maintenance_pending": "true"}, "maintenance"),
    ({"mig": "true"}, "mig"),
])
def test_a_gpu_state_names_the_strongest_reason_it_takes_no_work(labels, state):
    assert service_state(labels) == state


def test_fleet_with_a_running_fleet_shows_live_gpus(capsys, nats_url):
    samples = asyncio.run(_populate(nats_url))
    code, out, err = run(capsys, "fleet", "--nats-url", nats_url, "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["fleet"]["source"] == f"topology bucket at {nats_url}"
    assert [n["node"] for n in doc["fleet"]["nodes"]] == ["a100-01", "orin-03", "orin-04"]
    assert doc["fleet"]["bandwidth_source"] == "latest topology.updated"
    a_b = next(b for b in doc["fleet"]["bandwidth"] if b["strategy"] == "balanced" and b["b_site"] == "site-b"
               and b["a_site"] == "site-a")
    assert a_b["effective_gbps"] == pytest.approx(240.0 - 60.0)
    rows = doc["live"]["gpus"]
    assert [(r["node"], r["gpu"]) for r in rows] == sorted((s.node, s.gpu) for s in samples)
    shared = next(r for r in rows if r["node"] == "a100-01" and r["gpu"] == 1)
    truth = next(s for s in samples if s.node == "a100-01" and s.gpu == 1)
    assert shared["util_pct"] == truth.utilization_gpu_pct == 85.0
    assert shared["mem_used_mb"] == truth.memory_used_mb and shared["mem_total_mb"] == 40960.0
    assert shared["ctx_switches_per_s"] == truth.cuda_context_switches_per_sec.value > 0
    assert {(r["node"], r["gpu"]): r["state"] for r in rows if r["state"] != "ok"} == {
        ("a100-01", 2): "cordoned", ("a100-01", 3): "maintenance (risk 0.91)"}
    assert [(g["node"], g["gpu"], g["state"]) for g in doc["live"]["out_of_service"]] == [
        ("a100-01", 2, "cordoned"), ("a100-01", 3, "maintenance (risk 0.91)"), ("orin-04", 0, "unreachable")]
    (stale,) = doc["live"]["not_carried_out"]
    assert stale["node"] == "orin-03" and stale["decisions"] == ["x.assign", "y.assign"]
    assert 1190 <= stale["oldest_s"] <= 1300
    assert doc["live"]["troubled_executors"] == [{"node": "orin-04", "replica": "exec-orin-04", "trouble": NO_START}]
    (quiet,) = doc["live"]["silent_executors"]
    assert (quiet["node"], quiet["replica"]) == ("orin-03", "exec-orin-03") and 1190 <= quiet["silent_s"] <= 1300

    code, text, _ = run(capsys, "fleet", "--nats-url", nats_url)
    assert code == 0
    header = next(line for line in text.splitlines() if line.startswith("NODE"))
    assert header.split() == ["NODE", "GPU", "MODEL", "UTIL%", "MEM", "USED/TOTAL", "MiB", "TEMP", "C", "POWER",
                              "W", "CTXSW/S", "STATE"]
    line = next(line for line in text.splitlines() if line.startswith("a100-01") and line.split()[1] == "1")
    assert line.split()[2:5] == ["A100-40GB", "85.0", f"{truth.memory_used_mb:.0f}/40960"]
    assert line.split()[-1] == "ok"
    assert "live: 9 GPUs" in text
    assert "out of service: 3 GPUs" in text and "  orin-04/0 (Jetson-Orin): unreachable" in text
    assert "  orin-03: 2 decisions, oldest 20 min: x.assign, y.assign" in text
    assert "  orin-03: exec-orin-03, 20 min ago" in text
    assert f"executors that cannot start tasks (their nodes take no new work): 1 node\n  orin-04: exec-orin-04: {NO_START}" in text


def test_fleet_finds_the_bus_a_running_fleetpilot_up_announced(capsys, nats_url, tmp_path):
    asyncio.run(_populate(nats_url))
    state = tmp_path / "up-state"
    state.mkdir()
    with hold_state_dir(state):  # what `fleetpilot up` holds and leaves while it runs
        announce(state / NATS_URL_FILE, nats_url)
        code, out, err = run(capsys, "fleet", "--state-dir", str(state))
    assert code == 0 and err == ""
    assert out.startswith(f"fleet three-site (topology bucket at {nats_url})") and "live: 9 GPUs" in out


def test_fleet_with_an_empty_running_fleet_says_so(capsys, nats_url):
    code, out, err = run(capsys, "fleet", "--nats-url", nats_url)
    assert code == 0 and err == ""
    assert out.startswith("fleet three-site (shipped three-site spec)")
    assert "live: no GPU samples in the gpu_state bucket" in out



async def _put_openb_nodes(url: str) -> None:
    from fleetpilot.fleet.inventory import openb_node  # noqa: PLC0415

    bus = await NatsBus.connect(url, "cli-test")
    await bus.ensure_topology()
    topology = await bus.kv("topology")
    for i in range(2):
        node = openb_node(f"openb-node-{i:04d}", 96_000, 786_432, 8, "V100M32")
        await topology.put(node_key(node.node), encode(node))
    await bus.drain()


def test_a_running_fleet_from_another_spec_is_not_shown_as_the_spec(capsys, nats_url):
    # `up --fleet openb.csv`, then a plain `fleetpilot fleet`: it said "fleet three-site ...:
    # 4 sites", site-a, site-b and edge at 0 nodes, and three-site's links and bandwidth.
    asyncio.run(_put_openb_nodes(nats_url))
    code, out, err = run(capsys, "fleet", "--nats-url", nats_url, "--json")
    assert code == 0 and err == ""
    summary = json.loads(out)["fleet"]
    assert summary["fleet"] == "running"
    assert [(s["name"], s["nodes"], s["gpus"]) for s in summary["sites"]] == [("openb", 2, 16)]
    assert summary["links"] == [] and summary["bandwidth"] == []
    code, out, _ = run(capsys, "fleet", "--nats-url", nats_url)
    assert out.splitlines()[0] == f"fleet running (topology bucket at {nats_url}): 1 site, 2 nodes, 16 GPUs"
    assert "inter-site links" not in out and "site-a" not in out


@pytest.mark.parametrize("command", ["fingerprint", "topology"])
def test_a_missing_input_file_is_named_plainly(capsys, tmp_path, command):
    missing = str(tmp_path / "nope.csv")
    code, out, err = run(capsys, command, missing)
    # Before: "[Errno 2] No such file or directory: '...'", Python's own wording.
    assert_one_line_error(code, out, err, f"fleetpilot {command}: no such file or directory: {missing}")
    assert "Errno" not in err
