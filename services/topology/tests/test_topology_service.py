"""The topology service over a real nats-server: reports in, the ``topology`` bucket and
``topology.updated`` (with bandwidth estimates) out, nothing out for an unchanged node."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time

import msgspec
import pytest
from fleetpilot.contracts import NodeTopology, TopologyReport, TopologyUpdated, decode
from fleetpilot.fleet.bandwidth import SiteNetwork
from fleetpilot.fleet.inventory import load_fleet_spec
from fleetpilot.runtime import InMemoryBus, Retry
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually as wait_for
from fleetpilot_services.topology import service as topology_service
from fleetpilot_services.topology.service import (
    BadFleetConfig,
    ReportPlace,
    Sightings,
    TopologySettings,
    applied_report,
    bandwidth_estimates,
    build,
    mark_condition,
    node_condition,
    superseded,
    with_condition,
    write_keeping_operational_labels,
)

THREE_SITE = load_fleet_spec()
NODES = THREE_SITE.nodes[:3] + [THREE_SITE.node("h100-00"), THREE_SITE.node("orin-00")]




def settings(url: str, **overrides) -> TopologySettings:
    return TopologySettings(metrics_port=-1, nats_url=url, **{"fleet_spec": "", "openb_nodes": "", **overrides})


def report(node: NodeTopology, at: float) -> TopologyReport:
    return TopologyReport(node=node, source="sim", at=at)


@pytest.fixture
async def client(nats_server):
    bus = await NatsBus.connect(nats_server.url, "topology-test")
    await bus.ensure_topology()
    yield bus
    await bus.drain()


async def test_reports_fill_the_bucket_and_only_changes_are_announced(nats_server, client):
    updates: list[TopologyUpdated] = []

    async def on_update(msg) -> None:
        updates.append(decode(msg.data, TopologyUpdated))

    await client.subscribe("topology.updated", on_update)
    host = build(settings(nats_server.url))
    await host.start()
    try:
        for node in NODES:
            await client.publish(report(node, at=1.0))
        await wait_for(lambda: len(updates) == len(NODES))

        kv = await client.kv("topology")
        assert sorted(await kv.keys()) == sorted(n.node for n in NODES)
        stored = await kv.get("h100-00")
        assert stored is not None and msgspec.json.decode(stored.value, type=NodeTopology) == THREE_SITE.node("h100-00")

        assert sorted(n for u in updates for n in u.nodes) == sorted(n.node for n in NODES)
        assert len({u.revision for u in updates}) == len(updates)
        expected = SiteNetwork(THREE_SITE.links).estimates()
        assert expected and all(u.bandwidth == expected for u in updates)
        a_b = {e.strategy: e.effective_gbps for e in updates[0].bandwidth if {e.a_site, e.b_site} == {"site-a", "site-b"}}
        assert a_b["balanced"] > a_b["min_rtt"] > 0  # striping beats min-RTT over several links

        # Collectors re-send every node periodically: same content, later timestamp.
        await client.publish(report(NODES[0], at=2.0))
        await asyncio.sleep(0.5)
        assert len(updates) == len(NODES)

        changed = msgspec.structs.replace(NODES[0], labels={**NODES[0].labels, "cordoned": "yes"})
        await client.publish(report(changed, at=3.0))

        async def cordoned() -> bool:
            entry = await kv.get(NODES[0].node)
            return msgspec.json.decode(entry.value, type=NodeTopology).labels.get("cordoned") == "yes"

        # The change is stored after the unchanged report was handled: an update that report
        # wrongly made, however late, came before the change's own, so none may be left over.
        await wait_for(cordoned, what="the change stored")
        await wait_for(lambda: len(updates) >= len(NODES) + 1)
        await asyncio.sleep(0.3)
        assert len(updates) == len(NODES) + 1
        assert updates[-1].nodes == [NODES[0].node]
    finally:
        await host.stop()

    # A restarted service starts from the bucket and stays quiet for unchanged nodes.
    again = build(settings(nats_server.url))
    await again.start()
    try:
        await client.publish(report(NODES[1], at=4.0))
        await asyncio.sleep(0.5)
        assert len(updates) == len(NODES) + 1
        await client.publish(report(msgspec.structs.replace(NODES[1], site="site-z"), at=5.0))
        await wait_for(lambda: len(updates) == len(NODES) + 2)
    finally:
        await again.stop()


def test_estimates_follow_the_configured_fleet(tmp_path):
    spec = tmp_path / "two.yaml"
    spec.write_text("sites: [{name: x}, {name: y}]\n"
                    "links: [{a: x, b: y, rate_gbps: 40, rtt_ms: 5}, {a: x, b: y, rate_gbps: 10, rtt_ms: 20}]\n")
    got = {e.strategy: e.effective_gbps for e in bandwidth_estimates(TopologySettings(fleet_spec=str(spec)))}
    assert got == {"balanced": 50.0, "min_rtt": pytest.approx(40 / 0.9, abs=1e-3)}
    assert bandwidth_estimates(TopologySettings(fleet_spec="none")) == []
    csv = tmp_path / "nodes.csv"
    csv.write_text("sn,cpu_milli,memory_mib,gpu,model\nob-0,64000,262144,2,V100M16\n")
    assert bandwidth_estimates(TopologySettings(openb_nodes=str(csv))) == []  # one site: nothing to estimate


@pytest.mark.parametrize("path", ["/nonexistent/fleet.yaml", "/nonexistent/topology.json"])
def test_unreadable_spec_is_a_config_error(path):
    with pytest.raises(BadFleetConfig, match="cannot load the fleet spec"):
        build(TopologySettings(fleet_spec=path, openb_nodes="", metrics_port=-1))


def test_process_with_a_bad_spec_exits_with_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETPILOT_TOPOLOGY_")}
    env["FLEETPILOT_TOPOLOGY_FLEET_SPEC"] = "/nonexistent/fleet.yaml"
    proc = subprocess.run([sys.executable, "-m", "fleetpilot_services.topology"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("fleetpilot-topology: cannot load the fleet spec")


async def test_a_report_whose_links_name_devices_it_does_not_list_is_dead_lettered(nats_server, client):
    from fleetpilot.contracts import DeadLetter, Link
    from fleetpilot.ledger.store import node_key

    letters: list[DeadLetter] = []

    async def on_dlq(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await client.subscribe("dlq.>", on_dlq)
    good = NODES[0]
    # A collector of one's own names a GPU by its UUID where every consumer reads an index.
    bad = msgspec.structs.replace(NODES[1], links=[Link(a="GPU0", b="GPU-5d3c", kind="NV", nvlinks=4, cost=0.6)])
    host = build(settings(nats_server.url))
    await host.start()
    try:
        await client.publish(report(bad, at=1.0))
        await client.publish(report(good, at=1.0))
        await wait_for(lambda: letters, what="the bad report dead-lettered")
        kv = await client.kv("topology")

        async def good_stored() -> set[str]:
            keys = set(await kv.keys())
            return keys if node_key(good.node) in keys else set()

        stored = await wait_for(good_stored, what="the good report stored")
    finally:
        await host.stop()
    assert (letters[0].subject, letters[0].reason) == (f"topology.report.{bad.node}", "rejected")
    assert "names 'GPU-5d3c', which the node does not list" in letters[0].error
    assert node_key(bad.node) not in stored and node_key(good.node) in stored


async def test_a_re_reported_node_keeps_the_labels_operations_set(nats_server):
    from fleetpilot.contracts import GPU_LABEL_CORDONED, now
    from fleetpilot.ledger.store import node_key

    host = build(TopologySettings(nats_url=nats_server.url, metrics_port=-1))
    await host.start()
    bus = await NatsBus.connect(nats_server.url, "labels-test")
    try:
        node = load_fleet_spec().nodes[0]
        kv = await bus.kv("topology")
        await bus.publish(TopologyReport(node=node, source="sim", at=now()))
        for _ in range(100):
            if await kv.get(node_key(node.node)):
                break
            await asyncio.sleep(0.05)
        entry = await kv.get(node_key(node.node))
        stored = msgspec.json.decode(entry.value, type=NodeTopology)
        gpus = list(stored.gpus)
        gpus[1] = msgspec.structs.replace(gpus[1], labels={**gpus[1].labels, GPU_LABEL_CORDONED: "true"})
        # An operator pins GPU 0's driver and keeps it for inference: business labels.
        gpus[0] = msgspec.structs.replace(gpus[0], labels={**gpus[0].labels, "driver_pin": "535",
                                                           "task_kinds": "infer"})
        await kv.update(node_key(node.node), msgspec.json.encode(msgspec.structs.replace(stored, gpus=gpus)),
                        entry.revision)
        # The hardware changes (a driver upgrade), so the node is re-reported and rewritten.
        upgraded = msgspec.structs.replace(node, labels={**node.labels, "driver_version": "999.1"})
        await bus.publish(TopologyReport(node=upgraded, source="sim", at=now() + 1))
        for _ in range(100):
            current = msgspec.json.decode((await kv.get(node_key(node.node))).value, type=NodeTopology)
            if current.labels.get("driver_version") == "999.1":
                break
            await asyncio.sleep(0.05)
        assert current.labels.get("driver_version") == "999.1"
        assert current.gpus[1].labels.get(GPU_LABEL_CORDONED) == "true"
        assert GPU_LABEL_CORDONED not in current.gpus[0].labels
        assert (current.gpus[0].labels["driver_pin"], current.gpus[0].labels["task_kinds"]) == ("535", "infer")
    finally:
        await bus.drain()
        await host.stop()


def nodes_gauge(host) -> dict[str, float | None]:
    """``fleetpilot_topology_nodes`` by condition."""
    return {c: host.metrics.registry.get_sample_value("fleetpilot_topology_nodes", {"condition": c})
            for c in ("ready", "not_ready", "unreachable")}


async def condition_labels(kv, node: NodeTopology) -> set[str]:
    """The condition labels on the node's stored GPUs, each GPU's as one string."""
    entry = await kv.get(node.node)
    stored = msgspec.json.decode(entry.value, type=NodeTopology)
    return {",".join(sorted(k for k in g.labels if k in ("not_ready", "unreachable"))) for g in stored.gpus}


async def test_a_silent_node_is_first_not_ready_then_unreachable_until_it_reports_again(nats_server, client):
    updates: list[TopologyUpdated] = []

    async def on_update(msg) -> None:
        updates.append(decode(msg.data, TopologyUpdated))

    await client.subscribe("topology.updated", on_update)
    quiet, chatty = NODES[0], NODES[1]
    host = build(settings(nats_server.url, not_ready_after_s=0.8, silent_after_s=2.4, liveness_check_s=0.1))
    await host.start()
    kv = await client.kv("topology")

    async def conditions(node: NodeTopology) -> set[str]:
        return await condition_labels(kv, node)

    seen: list[set[str]] = []
    try:
        for node in (quiet, chatty):
            await client.publish(report(node, 1.0))
        await wait_for(lambda: len(updates) >= 2)
        # chatty keeps reporting every 0.2 s; quiet says nothing more.
        for i in range(18):
            await client.publish(report(chatty, 2.0 + i))  # its own time: not a duplicate
            await asyncio.sleep(0.2)
            seen.append(await conditions(quiet))
            assert await conditions(chatty) == {""}
        # Ready, then not ready (no new work, tasks kept), then given up; one label at a time.
        assert [c for i, c in enumerate(seen) if i == 0 or c != seen[i - 1]] == [{""}, {"not_ready"}, {"unreachable"}]
        assert [u.nodes for u in updates[2:]] == [[quiet.node]] * 2  # each step announced
        assert nodes_gauge(host) == {"ready": 1, "not_ready": 0, "unreachable": 1}  # for alerts
        await client.publish(report(quiet, 30.0))  # back: the label goes at the next check

        async def back() -> bool:
            return await conditions(quiet) == {""}

        await wait_for(back, timeout_s=5, what="the label gone once the node reports again")
        await wait_for(lambda: nodes_gauge(host)["ready"] == 2, timeout_s=5, what="the gauge to count it ready")
    finally:
        await host.stop()


async def test_a_reporting_node_whose_executor_went_quiet_takes_no_new_work_until_it_is_back(nats_server, client):
    """Its collector reports on, but the node's executor stopped rewriting its key (a crash
    loop): decisions went there and nobody carried them out. A node whose executor never
    wrote a key (the simulated fleet's single executor) is not judged by it."""
    from fleetpilot.contracts import ExecutorPresence, encode

    run_by_its_own, run_by_one_for_all = NODES[0], NODES[1]
    host = build(settings(nats_server.url, not_ready_after_s=1.0, silent_after_s=60, liveness_check_s=0.1,
                          executor_silent_after_s=0.6))
    await host.start()
    kv, executors = await client.kv("topology"), await client.kv("executors")
    presence = ExecutorPresence(node=run_by_its_own.node, replica="executor-0", at=1.0)
    seen: list[tuple[set[str], set[str]]] = []
    try:
        for i in range(20):  # both collectors report every 0.15 s; the executor stops after 0.6 s
            for node in (run_by_its_own, run_by_one_for_all):
                await client.publish(report(node, 10.0 + i))
            if i < 4:
                await executors.put(run_by_its_own.node, encode(msgspec.structs.replace(presence, at=1.0 + i)))
            await asyncio.sleep(0.15)
            if await kv.get(run_by_its_own.node) is not None and await kv.get(run_by_one_for_all.node) is not None:
                seen.append((await condition_labels(kv, run_by_its_own), await condition_labels(kv, run_by_one_for_all)))
        await executors.put(run_by_its_own.node, encode(presence))  # the executor is back

        async def back() -> bool:
            return await condition_labels(kv, run_by_its_own) == {""}

        await wait_for(back, timeout_s=5, what="the node back in service once its executor writes again")
    finally:
        await host.stop()
    own = [labels for labels, _ in seen]
    steps = [c for i, c in enumerate(own) if i == 0 or c != own[i - 1]]
    assert steps[-1] == {"not_ready"} and steps in ([{""}, {"not_ready"}], [{"not_ready"}]), steps
    assert all(other == {""} for _, other in seen)

async def test_a_replica_that_has_not_listened_through_the_silence_gives_no_node_up(nats_server, client):
    quiet = NODES[0]
    await client.publish(report(quiet, 1.0))
    await asyncio.sleep(1.0)  # quiet is silent for a second before the replica starts
    host = build(settings(nats_server.url, not_ready_after_s=0.3, silent_after_s=1.2, liveness_check_s=0.1))
    await host.start()
    kv = await client.kv("topology")
    seen: list[set[str]] = []
    try:
        # From 0.3 s of listening the node has been silent over 1.3 s, past ``silent_after_s``;
        # until 1.2 s this replica can vouch for less, so the node takes no new work but is
        # not given up. Followed reading after reading (not read once at a fixed 0.7 s, which
        # a loaded machine could land past 1.2 s), the labels must go through "not_ready".

        async def given_up() -> bool:
            if await kv.get(quiet.node) is not None:  # stored once the replica has read the report
                seen.append(await condition_labels(kv, quiet))
            return bool(seen) and seen[-1] == {"unreachable"}

        await wait_for(given_up, timeout_s=5, interval_s=0.02, what="the node given up once listened through its silence")
    finally:
        await host.stop()
    steps = [labels for i, labels in enumerate(seen) if i == 0 or labels != seen[i - 1]]
    assert steps[-2:] == [{"not_ready"}, {"unreachable"}], steps


async def test_a_replica_whose_clock_runs_ahead_of_the_server_s_does_not_silence_reporting_nodes(
        nats_server, client, monkeypatch):
    # Silence was the server's stamp aged on the replica's clock: two minutes ahead, every
    # node looked silent for two minutes more, and the whole fleet was marked not ready
    # (unreachable at five, its tasks given up) while every collector reported.
    monkeypatch.setattr(topology_service, "now", lambda: time.time() + 120.0)
    chatty = NODES[1]
    host = build(settings(nats_server.url, not_ready_after_s=0.8, silent_after_s=2.4, liveness_check_s=0.1))
    await host.start()
    kv = await client.kv("topology")
    seen: list[set[str]] = []
    try:
        for i in range(12):
            await client.publish(report(chatty, 1.0 + i))
            await asyncio.sleep(0.2)
            if await kv.get(chatty.node) is not None:
                seen.append(await condition_labels(kv, chatty))
    finally:
        await host.stop()
    assert len(seen) >= 8 and set().union(*seen) == {""}, seen


def test_a_stamp_reads_no_earlier_than_this_replica_first_saw_it():
    sightings = Sightings()
    # Stamped 100 by the server, first seen at 220 here (a clock 120 s ahead): read as 220,
    # and still 220 while the same report is the last one; a new report is seen anew.
    assert sightings.no_earlier_than_seen("n1", 100.0, now=220.0) == 220.0
    assert sightings.no_earlier_than_seen("n1", 100.0, now=400.0) == 220.0
    assert sightings.no_earlier_than_seen("n1", 130.0, now=251.0) == 251.0
    # A clock behind the server's: the stamp stands (a silence is then told late, as before).
    assert sightings.no_earlier_than_seen("n2", 500.0, now=450.0) == 500.0
    assert sightings.no_earlier_than_seen("n2", None, now=460.0) is None
    sightings.keep_only({"n2"})
    assert sightings.no_earlier_than_seen("n1", 130.0, now=900.0) == 900.0  # forgotten: seen anew


@pytest.mark.parametrize(("heard", "kept_since", "expected"), [
    (990.0, 0.0, "ready"),         # reported 10 s ago
    (850.0, 0.0, "not_ready"),     # reported 150 s ago: three reports missed, not given up
    (600.0, 0.0, "unreachable"),   # reported 400 s ago: lost
    (None, 0.0, "unreachable"),    # no report in the 1,000 s the stream keeps: lost
    (None, 800.0, "not_ready"),    # no report in the 200 s the stream keeps: at least not ready
    (None, 950.0, None),           # the stream keeps only 50 s (its byte limit): cannot tell
    (None, None, None),            # the stream keeps nothing
])
def test_a_node_condition_follows_its_silence_as_far_as_the_stream_tells_it(heard, kept_since, expected):
    assert node_condition(heard, kept_since, now=1000.0, not_ready_after_s=90.0, silent_after_s=300.0) == expected


def test_not_ready_never_lifts_unreachable_but_a_report_does():
    node = NODES[0]
    lost = with_condition(node, "unreachable")
    assert {k for g in lost.gpus for k in g.labels if k in ("not_ready", "unreachable")} == {"unreachable"}
    assert with_condition(lost, "not_ready") == lost
    back = with_condition(lost, "ready")
    assert not any(k in ("not_ready", "unreachable") for g in back.gpus for k in g.labels)
    assert with_condition(with_condition(node, "not_ready"), "unreachable") == lost


def test_not_ready_after_the_node_is_given_up_is_a_setting_error():
    with pytest.raises(ValueError, match="at most silent_after_s"):
        settings("nats://127.0.0.1:1", not_ready_after_s=400.0, silent_after_s=300.0)


async def test_a_report_that_undoes_another_replicas_change_is_stored_not_taken_as_unchanged(nats_server, client):
    """Two replicas share the reports. Both start knowing a node as v1; the other replica
    stores v2 (a GPU lost, say); the node's next report is v1 again (the GPU back) and reaches
    this replica, which must store it: the bucket says v2, whatever this replica saw last."""
    updates: list[TopologyUpdated] = []

    async def on_update(msg) -> None:
        updates.append(decode(msg.data, TopologyUpdated))

    await client.subscribe("topology.updated", on_update)
    v1 = NODES[0]
    v2 = msgspec.structs.replace(v1, gpus=v1.gpus[:-1])
    kv = await client.kv("topology")
    await kv.put(v1.node, msgspec.json.encode(v1))
    host = build(settings(nats_server.url))
    await host.start()
    try:
        await kv.put(v1.node, msgspec.json.encode(v2))  # the other replica's write
        await client.publish(report(v1, at=1.0))
        await wait_for(lambda: len(updates) == 1, what="the node's return announced")
        stored = msgspec.json.decode((await kv.get(v1.node)).value, type=NodeTopology)
    finally:
        await host.stop()
    assert updates[0].nodes == [v1.node] and stored == v1


async def test_a_report_no_consumer_can_read_right_is_dead_lettered(nats_server, client):
    from fleetpilot.contracts import DeadLetter, GpuInfo, encode

    letters: list[DeadLetter] = []

    async def on_dlq(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await client.subscribe("dlq.>", on_dlq)
    base = NODES[0]

    def named(name: str, **changes) -> NodeTopology:
        return msgspec.structs.replace(base, node=name, links=[], **changes)

    gpus = list(base.gpus)
    bad = [
        # A GPU gone from the middle: index 2 missing, so positions and indices part.
        (named("gap", gpus=[g for g in gpus if g.index != 2]), "missing [2]"),
        # GPU memory in bytes: above 2**31 it overflowed the policy's fleet arrays.
        (named("bytes", gpus=[msgspec.structs.replace(g, memory_mb=g.memory_mb * 1024 * 1024) for g in gpus]),
         "memory not in MB?"),
        (named("negative-cpu", cpu_milli=-1), "cpu_milli -1 is not between 0"),
        # Thousands of GPUs: every policy replica sizes a GPU-by-GPU matrix per node by the largest.
        (named("thousands", gpus=[GpuInfo(index=i, model="H100", memory_mb=81_559) for i in range(3000)]),
         "3000 GPUs, more than the 128"),
    ]
    host = build(settings(nats_server.url))
    await host.start()
    try:
        for node, _ in bad:
            await client.publish(report(node, at=1.0))
        # A collector of one's own that names the subject after the node its own way.
        await client.publish_raw("topology.report.other-name", encode(report(named("real-name"), at=1.0)))
        await client.publish(report(named("good"), at=1.0))
        await wait_for(lambda: len(letters) == len(bad) + 1, what="every bad report dead-lettered")
        kv = await client.kv("topology")
        await wait_for(lambda: kv.get("good"), what="the good report stored")
        stored = set(await kv.keys())
    finally:
        await host.stop()
    reasons = {letter.subject: letter.error for letter in letters}
    for node, reason in bad:
        assert reason in reasons[f"topology.report.{node.node}"]
    assert "came on topology.report.other-name, but the node it describes reports on topology.report.real-name" in (
        reasons["topology.report.other-name"])
    assert stored == {"good"}


async def test_a_report_decides_neither_its_gpus_order_nor_its_condition(nats_server, client):
    node = NODES[0]
    # A collector of one's own lists GPUs in bus order and sends back the ``unreachable`` it
    # read from the bucket: only the silence this service hears puts that label there.
    sent = msgspec.structs.replace(node, gpus=[msgspec.structs.replace(g, labels={**g.labels, "unreachable": "true"})
                                               for g in reversed(node.gpus)])
    host = build(settings(nats_server.url))
    await host.start()
    try:
        await client.publish(report(sent, at=1.0))
        kv = await client.kv("topology")
        entry = await wait_for(lambda: kv.get(node.node), what="the report stored")
    finally:
        await host.stop()
    stored = msgspec.json.decode(entry.value, type=NodeTopology)
    assert [g.index for g in stored.gpus] == sorted(g.index for g in node.gpus)
    assert not any("unreachable" in g.labels for g in stored.gpus)
    assert stored == node


async def test_updates_from_two_replicas_in_the_same_millisecond_are_both_kept(nats_server, client, monkeypatch):
    import fleetpilot_services.topology.service as topology_service
    import nats

    # Two replicas (here one, then its successor) announce a change each at the same instant.
    monkeypatch.setattr(topology_service, "now", lambda: 1_700_000_000.123)
    kv = await client.kv("topology")
    for node in NODES[:2]:
        host = build(settings(nats_server.url))
        await host.start()
        try:
            await client.publish(report(node, at=1.0))
            await wait_for(lambda node=node: kv.get(node.node), what=f"{node.node} stored")
        finally:
            await host.stop()
    nc = await nats.connect(nats_server.url)
    try:
        info = await nc.jetstream().stream_info("TOPOLOGY", subjects_filter="topology.updated")
    finally:
        await nc.close()
    assert (info.state.subjects or {}).get("topology.updated") == 2  # neither dropped as the other's duplicate


async def test_an_update_whose_publish_failed_goes_out_when_the_report_comes_again(nats_server, client):
    updates: list[TopologyUpdated] = []

    async def on_update(msg) -> None:
        updates.append(decode(msg.data, TopologyUpdated))

    await client.subscribe("topology.updated", on_update)
    bus = await NatsBus.connect(nats_server.url, "topology-cut-off")
    publish, cut = bus.publish, []

    async def cut_once(event, *, headers=None) -> None:
        if isinstance(event, TopologyUpdated) and not cut:
            cut.append(event)
            raise ConnectionError("cut off while publishing")
        await publish(event, headers=headers)

    bus.publish = cut_once  # type: ignore[method-assign]
    host = build(settings(nats_server.url))
    await host.start(bus)
    try:
        await client.publish(report(NODES[0], at=1.0))
        # The node was written before the publish failed; the redelivered report finds it
        # stored, and must still announce it.
        await wait_for(lambda: updates, timeout_s=10, what="the update announced after all")
    finally:
        await host.stop()
    assert len(cut) == 1 and updates[0].nodes == [NODES[0].node] and updates[0].revision == cut[0].revision


def test_a_liveness_check_of_zero_seconds_is_a_setting_error():
    with pytest.raises(ValueError, match="liveness_check_s"):
        settings("nats://127.0.0.1:1", liveness_check_s=0)


async def test_a_node_whose_executor_cannot_start_anything_takes_no_new_work_until_it_can(nats_server, client):
    """The executor is there (its key keeps changing) but every start fails for the node's
    fault (a full disk): it says so in its key, and the node is out of service at once, not
    after a silence, until the executor writes its key again without the trouble."""
    from fleetpilot.contracts import ExecutorPresence, encode

    node = NODES[0]
    host = build(settings(nats_server.url, not_ready_after_s=0.3, silent_after_s=60, liveness_check_s=0.1,
                          executor_silent_after_s=30))
    await host.start()
    kv, executors = await client.kv("topology"), await client.kv("executors")
    well = ExecutorPresence(node=node.node, replica="executor-0", at=1.0)
    troubled = msgspec.structs.replace(well, at=2.0, trouble="3 starts in a row failed: No space left on device")

    async def labels() -> set[str]:
        return await condition_labels(kv, node) if await kv.get(node.node) is not None else set()

    async def keep_reporting(presence: ExecutorPresence, rounds: int) -> list[set[str]]:
        seen = []
        for i in range(rounds):
            await client.publish(report(node, 10.0 + i + presence.at * 100))
            await executors.put(node.node, encode(msgspec.structs.replace(presence, at=presence.at + i / 100)))
            await asyncio.sleep(0.1)
            seen.append(await labels())
        return seen

    try:
        # Reporting and present, judged several times: in service throughout.
        assert (await keep_reporting(well, 15))[5:] == [{""}] * 10
        assert (await keep_reporting(troubled, 15))[-5:] == [{"not_ready"}] * 5
        assert (await keep_reporting(msgspec.structs.replace(well, at=3.0), 15))[-5:] == [{""}] * 5
    finally:
        await host.stop()


async def test_a_gpu_fallen_off_the_node_takes_its_labels_with_it_and_leaves_the_others_on_their_gpus(
        nats_server, client):
    """GPU 1 of four is gone (off the bus, pulled): the node comes back with three GPUs,
    numbered 0 to 2 again, so the GPU that was 3 is now 2. Labels follow the GPU (its UUID),
    not its number: the cordon set on the GPU that was 3 stays on it, and the driver pin of
    the GPU that is gone lands on no other."""
    from fleetpilot.contracts import GPU_LABEL_CORDONED

    node = NODES[0]
    before = msgspec.structs.replace(node, gpus=list(node.gpus[:4]), links=[])
    assert len({g.uuid for g in before.gpus}) == 4 and all(g.uuid for g in before.gpus)
    labelled = [dict(g.labels) for g in before.gpus]
    labelled[1]["driver_pin"] = "535"
    labelled[3][GPU_LABEL_CORDONED] = "true"
    kv = await client.kv("topology")
    await kv.put(node.node, msgspec.json.encode(msgspec.structs.replace(
        before, gpus=[msgspec.structs.replace(g, labels=labels) for g, labels in zip(before.gpus, labelled, strict=True)])))
    after = msgspec.structs.replace(before, gpus=[msgspec.structs.replace(g, index=i)
                                                  for i, g in enumerate(g for g in before.gpus if g.index != 1)])
    host = build(settings(nats_server.url))
    await host.start()
    try:
        await client.publish(report(after, at=1.0))

        async def three_gpus() -> NodeTopology | None:
            stored = msgspec.json.decode((await kv.get(node.node)).value, type=NodeTopology)
            return stored if len(stored.gpus) == 3 else None

        stored = await wait_for(three_gpus, what="the node stored with three GPUs")
    finally:
        await host.stop()
    by_uuid = {g.uuid: g.labels for g in stored.gpus}
    assert by_uuid[before.gpus[3].uuid].get(GPU_LABEL_CORDONED) == "true"
    assert [g.labels.get(GPU_LABEL_CORDONED) for g in stored.gpus] == [None, None, "true"]
    assert not any("driver_pin" in g.labels for g in stored.gpus)


async def test_a_node_that_reports_while_the_check_reads_the_fleet_is_not_marked_silent(
        nats_server, client, monkeypatch):
    """The check reads every node's last report first and writes the labels after: in a large
    fleet, seconds apart. A node silent so far whose report lands between the two was marked
    not ready (``unreachable`` at ``SILENT_AFTER_S``: its tasks given up) though it reported
    before the mark was written."""
    updates: list[TopologyUpdated] = []

    async def on_update(msg) -> None:
        updates.append(decode(msg.data, TopologyUpdated))

    await client.subscribe("topology.updated", on_update)
    clock = {"ahead": 0.0}
    monkeypatch.setattr(topology_service, "now", lambda: time.time() + clock["ahead"])
    node = NODES[0]
    subject = f"topology.report.{node.node}"
    bus = await NatsBus.connect(nats_server.url, "topology-racing")
    last_stored_at, read, raced, reads_after = bus.last_stored_at, [], [], []

    async def reported_meanwhile(on: str) -> float | None:
        stamp = await last_stored_at(on)
        if on == subject and stamp is not None and not clock["ahead"]:
            read.append(stamp)
        elif on == subject and clock["ahead"] and not raced:
            # The node reports right after its stamp was read, before the check judges it.
            raced.append(stamp)
            await client.publish(report(node, at=100.0))
            while await last_stored_at(on) == stamp:
                await asyncio.sleep(0.01)
        elif on == subject and raced:
            reads_after.append(stamp)
        return stamp

    bus.last_stored_at = reported_meanwhile  # type: ignore[method-assign]
    host = build(settings(nats_server.url, not_ready_after_s=1.0, silent_after_s=60, liveness_check_s=0.1))
    await host.start(bus)
    kv = await client.kv("topology")
    try:
        await client.publish(report(node, at=1.0))
        await wait_for(lambda: updates and read, what="the node stored and its report seen by a check")
        clock["ahead"] = 5.0  # five seconds on: the node has been silent past NOT_READY_AFTER_S

        async def keep_reporting() -> None:
            for i in range(200):
                await asyncio.sleep(0.2)
                await client.publish(report(node, at=200.0 + i))

        reporting = asyncio.create_task(keep_reporting())
        try:
            await wait_for(lambda: len(reads_after) >= 5, timeout_s=10, what="checks after the race")
        finally:
            reporting.cancel()
        labels = await condition_labels(kv, node)
    finally:
        await host.stop()
    assert raced
    assert [u.nodes for u in updates] == [[node.node]], updates  # its first store, no mark and no lifting
    assert labels == {""}


async def test_a_node_without_gpus_that_goes_silent_is_marked_on_the_node_and_back_when_it_reports(
    nats_server, client
):
    """A node's condition was written on its GPUs only: a CPU node (openb has them) could
    never be marked, and CPU work went on going to it while silent. The condition is on the
    node's own labels too, and a report never carries it in."""
    cpu_node = NodeTopology(node="cpu-00", cpu_milli=64_000, memory_mb=256_000, labels={"pool": "cpu"})
    host = build(settings(nats_server.url, not_ready_after_s=0.3, silent_after_s=60, liveness_check_s=0.1))
    await host.start()
    kv = await client.kv("topology")

    async def node_labels() -> dict[str, str]:
        entry = await kv.get(cpu_node.node)
        return msgspec.json.decode(entry.value, type=NodeTopology).labels if entry is not None else {}

    try:
        await client.publish(report(cpu_node, 1.0))
        await wait_for(lambda: kv.get(cpu_node.node), timeout_s=5, what="the node stored")

        async def marked() -> bool:
            return (await node_labels()).get("not_ready") == "true"

        await wait_for(marked, timeout_s=5, what="the silent CPU node marked not ready")
        assert nodes_gauge(host)["not_ready"] == 1
        # A collector sending back what the bucket held does not keep the mark on.
        echoed = msgspec.structs.replace(cpu_node, labels={"pool": "cpu", "not_ready": "true", "unreachable": "true"})
        await client.publish(report(echoed, 2.0))

        async def back() -> bool:
            return await node_labels() == {"pool": "cpu"}

        await wait_for(back, timeout_s=5, what="the mark lifted once it reports")
    finally:
        await host.stop()


async def test_a_replica_does_not_lift_an_executor_s_silence_before_it_can_judge_it(nats_server, client):
    """With the executor's limit set above the collector's, a replica started fresh judged
    the reports first and lifted the `not_ready` another replica had set for a silent
    executor, to set it again once it had listened long enough itself."""
    from fleetpilot.contracts import ExecutorPresence, encode

    node = NODES[0]
    kv, executors = await client.kv("topology"), await client.kv("executors")
    labelled = topology_service.with_condition(node, "not_ready")
    await kv.put(node.node, encode(labelled))  # as the replica before this one left it
    await executors.put(node.node, encode(ExecutorPresence(node=node.node, replica="executor-0", at=1.0)))
    host = build(settings(nats_server.url, not_ready_after_s=0.3, silent_after_s=60, liveness_check_s=0.1,
                          executor_silent_after_s=1.2))
    await host.start()
    seen = []
    try:
        for i in range(20):  # the collector reports on; the executor's key never changes
            await client.publish(report(node, 10.0 + i))
            await asyncio.sleep(0.1)
            seen.append(await condition_labels(kv, node))
    finally:
        await host.stop()
    assert seen == [{"not_ready"}] * len(seen), seen


async def test_a_node_unreachable_longer_than_forget_after_s_is_forgotten_and_seen_afresh_when_it_reports(
    nats_server, client
):
    """A node removed from the fleet for good kept its key, marked `unreachable`, for ever:
    every consumer (the policy's and the SLA's views, `fleetpilot fleet`) went on seeing it.
    Unreachable for `forget_after_s`, it is forgotten: its key is deleted (views following
    the bucket drop it), its labels with it, and its executor's key too, whose unchanged
    revision would have judged the node's return (`not_ready`) by a silence not its own."""
    from fleetpilot.contracts import ExecutorPresence, encode
    from fleetpilot.ledger import FleetView

    gone, staying = NODES[0], NODES[1]
    # An executor's silence judged quickly: its old key, left behind, would mark the node
    # `not_ready` soon after it is back.
    host = build(settings(nats_server.url, not_ready_after_s=0.2, silent_after_s=0.4, liveness_check_s=0.1,
                          executor_silent_after_s=0.3, forget_after_s=0.6))
    kv, executors = await client.kv("topology"), await client.kv("executors")
    view = await FleetView.open(client)
    following = asyncio.create_task(view.follow())
    await host.start()
    reporting = [staying]

    async def keep_reporting() -> None:
        for i in range(1000):
            for node in reporting:
                await client.publish(report(node, 10.0 + i))
            await asyncio.sleep(0.1)

    chatty = asyncio.create_task(keep_reporting())
    try:
        await client.publish(report(gone, 1.0))
        await wait_for(lambda: kv.get(gone.node), timeout_s=5, what="the node stored")
        await executors.put(gone.node, encode(ExecutorPresence(node=gone.node, replica="executor-0", at=1.0)))
        # An operator's cordon on GPU 0, then silence.
        entry = await kv.get(gone.node)
        stored = msgspec.json.decode(entry.value, type=NodeTopology)
        cordoned = msgspec.structs.replace(stored, gpus=[
            msgspec.structs.replace(g, labels={**g.labels, "cordoned": "true"}) if g.index == 0 else g
            for g in stored.gpus])
        await kv.update(gone.node, encode(cordoned), entry.revision)

        async def unreachable() -> bool:
            return await condition_labels(kv, gone) == {"unreachable"}

        await wait_for(unreachable, timeout_s=5, interval_s=0.02, what="the silent node given up")
        await wait_for(lambda: gone.node in view.nodes and view.nodes[gone.node].labels.get("unreachable"),
                       timeout_s=5, what="the view to see it given up")

        async def forgotten() -> bool:
            return await kv.get(gone.node) is None

        await wait_for(forgotten, timeout_s=5, interval_s=0.02, what="the node forgotten")
        assert await executors.get(gone.node) is None
        await wait_for(lambda: gone.node not in view.nodes, timeout_s=5, what="the view to drop the node")
        assert await kv.get(staying.node) is not None and staying.node in view.nodes
        assert await condition_labels(kv, staying) == {""}

        # Back (the same name on new hardware, run by the fleet's one executor): seen afresh,
        # no cordon, no mark, and not judged by the executor key of the node it was.
        reporting.append(gone)
        await wait_for(lambda: kv.get(gone.node), timeout_s=5, what="the node stored again")
        for _ in range(10):  # several checks
            back = msgspec.json.decode((await kv.get(gone.node)).value, type=NodeTopology)
            assert back == gone
            await asyncio.sleep(0.1)
    finally:
        chatty.cancel()
        following.cancel()
        await host.stop()


async def test_a_node_whose_tasks_the_ledger_still_holds_is_not_forgotten(nats_server, client):
    """The executor gives an unreachable node's tasks up only while the node is in the
    bucket: forgotten first, they would be held in the ledger for ever, never placed again."""
    from fleetpilot.contracts import Allocation, NodeLedger, encode

    node = NODES[0]
    ledger = await client.kv("ledger")
    await ledger.put(node.node, encode(NodeLedger(node=node.node, allocations=[
        Allocation(task_id="t", decision_id="t.assign", gpu=0, milli=1000, at=1.0, state="confirmed")])))
    host = build(settings(nats_server.url, not_ready_after_s=0.2, silent_after_s=0.4, liveness_check_s=0.1,
                          forget_after_s=0.3))
    await host.start()
    kv = await client.kv("topology")
    try:
        await client.publish(report(node, 1.0))
        await wait_for(lambda: kv.get(node.node), timeout_s=5, what="the node stored")

        async def unreachable() -> bool:
            return await condition_labels(kv, node) == {"unreachable"}

        await wait_for(unreachable, timeout_s=5, interval_s=0.02, what="the silent node given up")
        await asyncio.sleep(1.0)
        assert await kv.get(node.node) is not None  # its task still held
        await ledger.put(node.node, encode(NodeLedger(node=node.node, allocations=[])))  # the executor gave it up

        async def forgotten() -> bool:
            return await kv.get(node.node) is None

        await wait_for(forgotten, timeout_s=5, what="the node forgotten once its tasks are released")
    finally:
        await host.stop()


def test_forgetting_is_off_by_default_and_a_bad_forget_after_s_is_a_setting_error():
    assert settings("nats://127.0.0.1:1").forget_after_s == 0  # 0: never
    for bad in (-1, math.inf, math.nan):
        with pytest.raises(ValueError, match="forget_after_s"):
            settings("nats://127.0.0.1:1", forget_after_s=bad)


def test_unreachable_since_is_set_once_kept_while_given_up_and_goes_with_the_mark():
    node = NODES[0]
    given_up = with_condition(node, "unreachable", at=100.0)
    assert given_up.labels["unreachable_since"] == "100"
    assert with_condition(given_up, "unreachable", at=200.0).labels["unreachable_since"] == "100"
    assert with_condition(given_up, "not_ready", at=200.0) == given_up  # not_ready never lifts unreachable
    assert "unreachable_since" not in with_condition(given_up, "ready", at=200.0).labels
    # A report never carries it in; the stored one stays until the next check lifts the mark.
    echoed = msgspec.structs.replace(node, labels={**node.labels, "unreachable_since": "1"})
    assert topology_service.with_operational_labels(echoed, None).labels == node.labels
    assert topology_service.with_operational_labels(echoed, given_up).labels["unreachable_since"] == "100"


async def test_a_fresh_replica_does_not_lift_the_mark_of_a_node_silent_since_before_it_started(nats_server, client):
    """A replica's first check comes one ``liveness_check_s`` after its start, and a stamp older
    than the replica read as heard when that check first saw it: once listened through
    ``not_ready_after_s`` it took a node silent all along for heard within it, ``ready``, and
    lifted the `unreachable` the replica before it had set (or another replica's `not_ready`),
    with no report: the node was back in service, new work went to it, to be marked again
    at the next checks."""
    given_up, waiting = NODES[0], NODES[1]
    await client.publish(report(given_up, 1.0))
    await client.publish(report(waiting, 1.0))
    await asyncio.sleep(0.2)
    kv = await client.kv("topology")
    # As the replicas before this one left them: both silent since.
    await kv.put(given_up.node, topology_service.encode(with_condition(given_up, "unreachable", at=1.0)))
    await kv.put(waiting.node, topology_service.encode(with_condition(waiting, "not_ready")))
    host = build(settings(nats_server.url, not_ready_after_s=0.6, silent_after_s=60, liveness_check_s=0.3))
    await host.start()
    seen = []
    try:
        for _ in range(25):
            await asyncio.sleep(0.1)
            seen.append((await condition_labels(kv, given_up), await condition_labels(kv, waiting)))
    finally:
        await host.stop()
    assert seen == [({"unreachable"}, {"not_ready"})] * len(seen), seen


async def test_a_node_whose_ledger_entry_does_not_decode_is_not_forgotten(nats_server, client):
    """A ledger value that does not decode whole (a hold written by another version) read as
    holding nothing: the node was forgotten while its readable holds stayed in the ledger,
    and the executor, which gives a node's tasks up only while it is in the bucket, never
    released them: capacity held by nobody, the tasks never placed again."""
    node = NODES[0]
    ledger = await client.kv("ledger")
    await ledger.put(node.node, msgspec.json.encode({"node": node.node, "allocations": [
        {"task_id": "t", "decision_id": "t.assign", "gpu": 0, "milli": 1000, "at": 1.0, "state": "confirmed"},
        {"task_id": "u", "gpu": "zero", "future_field": True}]}))
    assert "t" in await topology_service.held_tasks(ledger, node.node)
    await ledger.put(node.node, b"not a ledger")
    assert await topology_service.held_tasks(ledger, node.node)  # cannot tell: kept, not taken as empty
    await ledger.put(node.node, msgspec.json.encode({"node": node.node, "allocations": []}))
    assert await topology_service.held_tasks(ledger, node.node) == []


def test_a_gpu_new_on_a_marked_node_is_marked_with_it():
    """A node's condition was carried GPU by GPU: a GPU new in a report (replaced, added)
    came into the bucket without the node's `not_ready` (an executor in a crash loop) or
    `unreachable`, and took new work, which is placed by the GPU's labels, until the next check."""
    node = NODES[3]
    for condition in ("not_ready", "unreachable"):
        stored = with_condition(node, condition, at=100.0)
        replaced = msgspec.structs.replace(node.gpus[0], uuid="GPU-new-0000")
        added = msgspec.structs.replace(node.gpus[-1], index=len(node.gpus), uuid="GPU-new-0001")
        reported = msgspec.structs.replace(node, gpus=[replaced, *node.gpus[1:], added])
        kept = topology_service.with_operational_labels(reported, stored)
        assert [g.labels.get(condition) for g in kept.gpus] == ["true"] * len(kept.gpus), condition
        assert kept.labels.get(condition) == "true"


def stored_version(entry) -> NodeTopology:
    return msgspec.json.decode(entry.value, type=NodeTopology)


async def test_a_late_report_never_replaces_a_newer_one_another_replica_applied(nats_server, client, monkeypatch):
    """Two replicas. An older report of a node is held up inside its handler (a slow KV, a
    paused process) while the other replica applies the node's next report; once it goes
    on, the bucket must keep the newer one: it held the older for a whole report period."""
    old = NODES[0]
    new = msgspec.structs.replace(old, memory_mb=old.memory_mb // 2)  # a memory module lost meanwhile
    original = topology_service.write_keeping_operational_labels
    entered, go_on = asyncio.Event(), asyncio.Event()

    async def held_for_the_old_report(kv, node, *args, **kwargs):
        if node == old:
            entered.set()
            await go_on.wait()  # its check of the stream is done: only the bucket can tell now
        return await original(kv, node, *args, **kwargs)

    monkeypatch.setattr(topology_service, "write_keeping_operational_labels", held_for_the_old_report)
    replicas = [build(settings(nats_server.url)) for _ in range(2)]
    for replica in replicas:
        await replica.start()
    kv = await client.kv("topology")
    try:
        await client.publish(report(old, at=1.0))
        await asyncio.wait_for(entered.wait(), 10)
        await client.publish(report(new, at=2.0))  # handled by the other replica

        async def newer_applied() -> bool:
            entry = await kv.get(old.node)
            return entry is not None and stored_version(entry) == new

        await wait_for(newer_applied, timeout_s=10, what="the newer report applied")
        go_on.set()
        await asyncio.sleep(1.0)
        assert stored_version(await kv.get(old.node)) == new
    finally:
        go_on.set()
        for replica in replicas:
            await replica.stop()


async def test_a_redelivered_old_report_does_not_undo_a_newer_one_that_changed_nothing(nats_server, client, monkeypatch):
    """The node is stored as ``current``. Its next report (half its memory lost) fails once
    and comes again a second later; meanwhile its collector reports ``current`` again, which
    changes nothing and so writes nothing. The redelivered report is the older: it must not
    write the loss back over what the node now reports."""
    current = NODES[1]
    lost_gpu = msgspec.structs.replace(current, memory_mb=current.memory_mb // 2)
    original = topology_service.report_problem
    failed: list[NodeTopology] = []

    def fails_once(sent: TopologyReport, subject: str) -> str | None:
        if sent.node == lost_gpu:  # counts each delivery, at the start of its handling
            failed.append(sent.node)
            if len(failed) == 1:
                raise Retry("the bucket timed out", delay_s=1.0)
        return original(sent, subject)

    monkeypatch.setattr(topology_service, "report_problem", fails_once)
    host = build(settings(nats_server.url))
    await host.start()
    kv = await client.kv("topology")
    try:
        await client.publish(report(current, at=1.0))
        await wait_for(lambda: kv.get(current.node), timeout_s=10, what="the node stored")
        await client.publish(report(lost_gpu, at=2.0))
        await wait_for(lambda: failed, timeout_s=10, what="the report's first delivery failed")
        await client.publish(report(current, at=3.0))
        await wait_for(lambda: len(failed) == 2, timeout_s=10, what="the failed report delivered again")
        await asyncio.sleep(0.3)
        assert stored_version(await kv.get(current.node)) == current
    finally:
        await host.stop()


def place(sequence: int | None, stored_at: float | None) -> ReportPlace:
    return ReportPlace(sequence=sequence, stored_at=stored_at)


@pytest.mark.parametrize(("report_at", "applied", "older"), [
    (place(5, 100.0), place(9, 130.0), True),  # late or redelivered
    (place(9, 130.0), place(9, 130.0), False),  # the same report again
    (place(12, 160.0), place(9, 130.0), False),  # newer
    (place(3, 500.0), place(9, 130.0), False),  # the stream made again: numbered from 1, stored later
    (place(None, 100.0), place(9, 130.0), True),  # no sequence: the stored time alone
    (place(None, 160.0), place(None, 130.0), False),
    (place(5, None), place(None, 130.0), False),  # nothing to compare: applied, as before
])
def test_which_of_two_reports_is_older(report_at, applied, older):
    assert superseded(report_at, applied) is older


async def test_the_bucket_keeps_the_newest_report_s_place_and_old_values_still_read():
    """What the bucket holds says which report wrote it, in a member every other reader
    ignores; a value written before (no member) takes any report, and a mark keeps it."""
    bus = InMemoryBus()
    await bus.ensure_topology()
    kv = await bus.kv("topology")
    node = NODES[2]
    await kv.put(node.node, msgspec.json.encode(node))  # written by an earlier version
    changed = msgspec.structs.replace(node, site="site-z")
    first = await write_keeping_operational_labels(kv, changed, place=place(7, 70.0))
    assert first.written and not first.superseded
    entry = await kv.get(node.node)
    assert stored_version(entry) == changed and applied_report(entry.value) == place(7, 70.0)
    assert msgspec.json.decode(entry.value) == {**msgspec.to_builtins(changed),
                                                "applied_report": {"sequence": 7, "stored_at": 70.0}}
    late = await write_keeping_operational_labels(kv, node, place=place(6, 60.0))
    assert late.superseded and not late.written and stored_version(await kv.get(node.node)) == changed
    assert await mark_condition(kv, node.node, "not_ready") is not None
    assert applied_report((await kv.get(node.node)).value) == place(7, 70.0)
    late = await write_keeping_operational_labels(kv, node, place=place(6, 60.0))
    assert late.superseded and stored_version(await kv.get(node.node)).site == "site-z"
