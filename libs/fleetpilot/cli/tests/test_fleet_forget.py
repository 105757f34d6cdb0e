"""``fleetpilot fleet forget NODE`` over a real nats-server: a node removed from the fleet for
good leaves the ``topology`` bucket (and its executor's key the ``executors`` one) only once
the topology service has given it up and its tasks are released, unless forced; anything
else is refused in one line, with nothing removed."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from fleetpilot.cli.main import main
from fleetpilot.contracts import Allocation, ExecutorPresence, NodeLedger, NodeTopology, encode
from fleetpilot.fleet.inventory import load_fleet_spec
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime.nats_bus import NatsBus

FLEET = load_fleet_spec()


@pytest.fixture(autouse=True)
def no_fleet_running(monkeypatch, tmp_path):
    # A developer's running fleet must not leak in through the environment or `up`'s state.
    monkeypatch.delenv("FLEETPILOT_NATS_URL", raising=False)
    monkeypatch.setenv("FLEETPILOT_STATE_DIR", str(tmp_path / "no-fleet-here"))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == 2 and out == "", (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def marked(node: NodeTopology, condition: str, **gpu_labels: dict[str, str]) -> NodeTopology:
    """``node`` as the topology service leaves it in ``condition`` ("" for in service), with
    operations' labels on some GPUs (``gpu_labels["gpu<i>"]``)."""
    own = {**node.labels, **({condition: "true"} if condition else {})}
    if condition == "unreachable":
        own["unreachable_since"] = "1000"
    return msgspec.structs.replace(node, labels=own, gpus=[
        msgspec.structs.replace(g, labels={**g.labels, **({condition: "true"} if condition else {}),
                                           **gpu_labels.get(f"gpu{g.index}", {})})
        for g in node.gpus])


async def put_fleet(url: str, nodes: list[NodeTopology], held: dict[str, list[str]] | None = None) -> None:
    bus = await NatsBus.connect(url, "forget-test")
    await bus.ensure_topology()
    topology, executors, ledger = await bus.kv("topology"), await bus.kv("executors"), await bus.kv("ledger")
    for node in nodes:
        await topology.put(node_key(node.node), encode(node))
        await executors.put(node_key(node.node), encode(ExecutorPresence(node=node.node, replica=f"exec-{node.node}",
                                                                         at=1000.0)))
    for node, tasks in (held or {}).items():
        await ledger.put(node_key(node), encode(NodeLedger(node=node, allocations=[
            Allocation(task_id=t, decision_id=f"{t}.assign", gpu=0, milli=1000, at=1000.0, state="confirmed")
            for t in tasks])))
    await bus.drain()


async def keys(url: str, bucket: str) -> set[str]:
    bus = await NatsBus.connect(url, "forget-test-read")
    try:
        return set(await (await bus.kv(bucket)).keys())
    finally:
        await bus.drain()


def test_an_unreachable_node_is_forgotten_with_its_labels_and_its_executor_s_key(capsys, nats_url):
    gone = marked(FLEET.node("a100-00"), "unreachable", gpu0={"cordoned": "true"},
                  gpu3={"driver_pin": "535.104"})
    others = [marked(FLEET.node("a100-01"), ""), marked(FLEET.node("orin-00"), "not_ready")]
    asyncio.run(put_fleet(nats_url, [gone, *others], held={"a100-01": ["runs-on"]}))

    code, out, err = run(capsys, "fleet", "forget", "a100-00", "--nats-url", nats_url)
    assert code == 0 and err == "", err
    assert out.startswith("forgot a100-00 (unreachable)")
    assert "cordoned on GPU 0" in out and "driver_pin=535.104 on GPU 3" in out  # what the operator loses
    assert "executor's key" in out
    assert asyncio.run(keys(nats_url, "topology")) == {"a100-01", "orin-00"}
    assert asyncio.run(keys(nats_url, "executors")) == {"a100-01", "orin-00"}
    assert asyncio.run(keys(nats_url, "ledger")) == {"a100-01"}  # not this command's to write

    # `fleetpilot fleet` no longer shows it.
    code, out, _ = run(capsys, "fleet", "--nats-url", nats_url, "--json")
    doc = json.loads(out)
    assert sorted(n["node"] for n in doc["fleet"]["nodes"]) == ["a100-01", "orin-00"]
    assert all(g["node"] != "a100-00" for g in doc["live"]["out_of_service"])
    assert all(e["node"] != "a100-00" for e in doc["live"]["silent_executors"])

    # Forgotten already: nothing to forget, said in one line.
    assert_refused(*run(capsys, "fleet", "forget", "a100-00", "--nats-url", nats_url), "no node 'a100-00'")


@pytest.mark.parametrize(("condition", "said"), [("", "ready"), ("not_ready", "not_ready")])
def test_a_node_not_given_up_is_refused_unless_forced(capsys, nats_url, condition, said):
    node = marked(FLEET.node("a100-00"), condition)
    asyncio.run(put_fleet(nats_url, [node]))
    assert_refused(*run(capsys, "fleet", "forget", "a100-00", "--nats-url", nats_url),
                   "a100-00", said, "not unreachable", "--force")
    assert asyncio.run(keys(nats_url, "topology")) == {"a100-00"}
    assert asyncio.run(keys(nats_url, "executors")) == {"a100-00"}

    code, out, err = run(capsys, "fleet", "forget", "a100-00", "--force", "--nats-url", nats_url)
    assert code == 0 and out.startswith(f"forgot a100-00 ({said}, forced)"), (out, err)
    assert "its next report" in out  # a node still reporting comes back, afresh
    assert asyncio.run(keys(nats_url, "topology")) == set()


def test_a_node_whose_tasks_the_ledger_still_holds_is_refused_unless_forced(capsys, nats_url):
    """The executor gives an unreachable node's tasks up only while the node is in the
    bucket: forgotten before, they would be held for ever, never placed again."""
    node = marked(FLEET.node("a100-00"), "unreachable")
    asyncio.run(put_fleet(nats_url, [node], held={"a100-00": ["t1", "t2"]}))
    assert_refused(*run(capsys, "fleet", "forget", "a100-00", "--nats-url", nats_url),
                   "a100-00", "ledger still holds 2 tasks", "t1, t2", "--force")
    assert asyncio.run(keys(nats_url, "topology")) == {"a100-00"}

    code, out, err = run(capsys, "fleet", "forget", "a100-00", "--force", "--nats-url", nats_url)
    assert code == 0 and "left held in the ledger: 2 tasks (t1, t2)" in out, (out, err)
    assert asyncio.run(keys(nats_url, "topology")) == set()


def test_a_name_with_characters_no_key_allows_is_forgotten_under_its_key(capsys, nats_url):
    node = marked(msgspec.structs.replace(FLEET.node("orin-00"), node="rack:7/orin"), "unreachable")
    asyncio.run(put_fleet(nats_url, [node]))
    code, out, _ = run(capsys, "fleet", "forget", "rack:7/orin", "--nats-url", nats_url)
    assert code == 0 and out.startswith("forgot rack:7/orin (unreachable)")
    assert asyncio.run(keys(nats_url, "topology")) == set()


def test_an_unknown_node_and_no_fleet_are_one_line(capsys, nats_url, monkeypatch):
    asyncio.run(put_fleet(nats_url, [marked(FLEET.node("a100-00"), "unreachable")]))
    assert_refused(*run(capsys, "fleet", "forget", "a100-0", "--nats-url", nats_url), "no node 'a100-0' ")
    from fleetpilot.runtime.embedded import free_port

    assert_refused(*run(capsys, "fleet", "forget", "a100-00", "--nats-url", f"nats://127.0.0.1:{free_port()}"),
                   "cannot connect to NATS")


def test_forget_needs_a_node(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["fleet", "forget"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1 and "node" in err


def test_a_node_that_reported_again_since_it_was_given_up_is_refused_unless_forced(capsys, nats_url):
    """Back, its key still says `unreachable` until the topology service's next check (an
    unchanged report writes nothing): forgotten then, it came back at its next report without
    the cordon of its faulty GPU, and took work there."""
    import time

    from fleetpilot.contracts import TopologyReport

    node = marked(FLEET.node("a100-00"), "unreachable", gpu2={"cordoned": "true"})
    node = msgspec.structs.replace(node, labels={**node.labels, "unreachable_since": f"{time.time() - 600:.0f}"})
    asyncio.run(put_fleet(nats_url, [node]))

    async def reports_again() -> None:
        bus = await NatsBus.connect(nats_url, "collector")
        await bus.publish(TopologyReport(node=FLEET.node("a100-00"), source="sim", at=time.time()))
        await bus.drain()

    asyncio.run(reports_again())
    assert_refused(*run(capsys, "fleet", "forget", "a100-00", "--nats-url", nats_url),
                   "a100-00", "reported again", "--force")
    assert asyncio.run(keys(nats_url, "topology")) == {"a100-00"}
    code, out, _ = run(capsys, "fleet", "forget", "a100-00", "--force", "--nats-url", nats_url)
    assert code == 0 and "cordoned on GPU 2" in out and "its next report" in out
