"""A node gone silent (the topology service labels its GPUs ``unreachable``), over a real
nats-server: its tasks are given up once among the replicas and placed again (a move to it
only gives its reservation back); when the node is heard again, the decisions that waited
for it are void if their reservations were given back, and its processes that were given
up are stopped; a node's executor started after the last one was killed gives back what
that one left behind."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import msgspec
from fleetpilot.contracts import (
    ActionExecuted,
    ActionFailed,
    Allocation,
    DecisionMade,
    NodeLedger,
    Placement,
    TaskLifecycle,
    TaskSubmitted,
    encode,
)
from fleetpilot.runtime.testing import eventually as wait_for
from fleetpilot_services.executor.service import build

from .conftest import node_topology
from .test_decisions import alive, settings, sleeper
from .test_node_scoped import holds, run


def unreachable(node: str, gpus: int = 2):
    """The node as the topology service stores it once its collector went silent."""
    topo = node_topology(node, gpus=gpus)
    return msgspec.structs.replace(topo, gpus=[
        msgspec.structs.replace(g, labels={**g.labels, "unreachable": "true"}) for g in topo.gpus])


async def test_the_tasks_of_an_unreachable_node_without_gpus_are_given_up(observer, sim_fleet, nats_url, tmp_path):
    """A CPU node's condition is on the node itself (it has no GPU to carry it): its tasks
    were never given up, however long it was silent."""
    cpu_node = msgspec.structs.replace(node_topology("c1", gpus=0), labels={"unreachable": "true"})
    await observer.kv_put("topology", "c1", encode(cpu_node))
    await observer.kv_put("ledger", "c1", encode(NodeLedger(node="c1", allocations=[
        Allocation(task_id="c", decision_id="c.assign", gpu=-1, milli=0, memory_mb=0, cpu_milli=1000,
                   state="confirmed")])))
    host = build(settings(nats_url, tmp_path, "a", silent_check_s=0.2))
    await host.start()
    try:
        life = await observer.wait_stored("task.lifecycle.>", TaskLifecycle, 1)
        ledger = await observer.ledger("c1")
    finally:
        await host.stop()
    assert [(e.task_id, e.state, e.node) for e in life] == [("c", "evicted", "c1")]
    assert ledger.allocations == []


def confirmed(task_id: str, decision_id: str, gpu: int) -> Allocation:
    return Allocation(task_id=task_id, decision_id=decision_id, gpu=gpu, milli=1000, memory_mb=1000,
                      state="confirmed")


async def test_the_tasks_of_an_unreachable_node_are_given_up_once(observer, sim_fleet, nats_url, tmp_path):
    await observer.kv_put("topology", "n1", encode(unreachable("n1")))
    await observer.kv_put("topology", "n2", encode(node_topology("n2")))
    # t1 ran on n1; t3 runs on n2 and was about to move to n1; t2 runs on n2.
    await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1", allocations=[
        confirmed("t1", "t1.assign", 0),
        Allocation(task_id="t3", decision_id="t3.migrate.1", gpu=1, milli=1000, memory_mb=1000)])))
    await observer.kv_put("ledger", "n2", encode(NodeLedger(node="n2", allocations=[
        confirmed("t3", "t3.assign", 0), confirmed("t2", "t2.assign", 1)])))
    hosts = [build(settings(nats_url, tmp_path, replica, silent_check_s=0.2)) for replica in ("a", "b")]
    for host in hosts:
        await host.start()
    try:
        life = await observer.wait_stored("task.lifecycle.>", TaskLifecycle, 1)
        await asyncio.sleep(1.0)  # several rounds of both replicas
        life = await observer.stored("task.lifecycle.>", TaskLifecycle)
        n1, n2 = await observer.ledger("n1"), await observer.ledger("n2")
    finally:
        for host in hosts:
            await host.stop()
    assert [(e.task_id, e.state, e.node, e.gpus) for e in life] == [("t1", "evicted", "n1", [0])]
    assert "n1 unreachable" in life[0].detail
    assert n1.allocations == []
    assert [(a.task_id, a.state) for a in n2.allocations] == [("t3", "confirmed"), ("t2", "confirmed")]


async def test_a_node_heard_again_voids_what_waited_for_it_and_stops_what_was_given_up(
    observer, nats_url, tmp_path
):
    await observer.kv_put("topology", "n1", encode(node_topology("n1")))
    await observer.kv_put("ledger", "n1", holds("n1", ("t6", "t6.assign", 0)))
    marker = tmp_path / "child"
    host = build(settings(nats_url, tmp_path, backend="process", node="n1", grace_s=1.0, silent_check_s=0.2))
    await host.start()
    try:
        started = msgspec.structs.replace(run("t6.assign", "t6", "n1", 0), task=TaskSubmitted(
            task_id="t6", kind="train", command=sleeper(marker)))
        await observer.js.publish("decision.made", encode(started))
        await wait_for(lambda: marker.exists() and " " in marker.read_text())
        pid = int(marker.read_text().split()[1])
        # While n1 was silent its tasks were given up: t6's hold released, t6 placed
        # elsewhere. An assign of t7 decided before that, never carried out, arrives now.
        await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1")))
        await observer.js.publish("decision.made", encode(run("t7.assign", "t7", "n1", 1, seconds=30)))
        failed = await observer.wait_stored("action.failed", ActionFailed, 1)
        await wait_for(lambda: not alive(pid), timeout_s=5.0)
        await asyncio.sleep(0.5)
        life = await observer.stored("task.lifecycle.>", TaskLifecycle)
        executed = await observer.stored("action.executed", ActionExecuted)
    finally:
        await host.stop()
    assert [(f.action_id, f.retryable) for f in failed] == [("act-t7.assign", False)]
    assert [e.action_id for e in executed] == ["act-t6.assign"]
    assert "void" in failed[0].error
    # t6 was started; its stop says nothing (its eviction was told when its hold went); t7 never ran.
    assert [(e.task_id, e.state) for e in life] == [("t6", "started")]


def left_behind(tmp_path: Path, task_id: str) -> subprocess.Popen:
    """A process of ``task_id`` that n1's last executor left running, as its registry says."""
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    stat = Path(f"/proc/{orphan.pid}/stat").read_text()
    started = int(stat.rsplit(")", 1)[1].split()[19])
    (tmp_path / "executor-processes-n1.json").write_text(json.dumps({task_id: [orphan.pid, started]}))
    return orphan


async def test_a_node_s_executor_reclaims_what_the_last_one_left_behind(observer, nats_url, tmp_path):
    # The last executor of n1 was killed: t1 (confirmed on GPU 0) runs on untracked, as its
    # registry says; t0 (confirmed on GPU 2) died with it; t2's assign (reserved on GPU 1)
    # is still to be carried out.
    await observer.kv_put("topology", "n1", encode(node_topology("n1", gpus=4)))
    await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1", allocations=[
        confirmed("t1", "t1.assign", 0), confirmed("t0", "t0.assign", 2),
        Allocation(task_id="t2", decision_id="t2.assign", gpu=1, milli=1000, memory_mb=1000)])))
    orphan = left_behind(tmp_path, "t1")
    try:
        host = build(settings(nats_url, tmp_path, backend="process", node="n1", grace_s=1.0))
        await host.start()
        try:
            life = await observer.wait_stored("task.lifecycle.>", TaskLifecycle, 2)
            n1 = await observer.ledger("n1")
        finally:
            await host.stop()
        assert orphan.wait(timeout=5) is not None  # stopped by the new executor
    finally:
        if orphan.poll() is None:
            orphan.kill()
    assert sorted((e.task_id, e.state, e.gpus) for e in life) == [("t0", "evicted", [2]), ("t1", "evicted", [0])]
    how = {e.task_id: e.detail for e in life}
    assert how["t1"].endswith("its process was stopped now") and how["t0"].endswith("its process was gone with it")
    assert [(a.task_id, a.state) for a in n1.allocations] == [("t2", "reserved")]


def executed(decision: DecisionMade, at: float) -> bytes:
    """The journal's record of ``decision`` carried out at ``at`` (an ``executions`` value)."""
    return encode(ActionExecuted(action_id=f"act-{decision.decision_id}", decision_id=decision.decision_id,
                                 task_id=decision.task_id, action=decision.action,
                                 placement=decision.placement, backend="process", latency_ms=1.0,
                                 policy=decision.policy, executed_at=at))


async def test_a_node_s_executor_gives_back_a_start_the_last_one_recorded_and_never_confirmed(
    observer, nats_url, tmp_path
):
    # The last executor of n1 started t3, recorded it in its journal and was killed before it
    # confirmed t3's hold: the next one stopped the process and kept the hold as a decision
    # still to come; the redelivered decision got the recorded success, confirmed the hold
    # and told `started`. A confirmed hold, for ever, with no process. t2's assign, reserved
    # and not carried out yet, is still to come. t5 moved from n2 to n1 the same way: n2 gave
    # it up (its hold there stays until the move is folded, and n2 would take the task back).
    t3 = run("t3.assign", "t3", "n1", 1, seconds=60)
    t5 = msgspec.structs.replace(run("t5.migrate", "t5", "n1", 3), action="migrate",
                                 source=[Placement(node="n2", gpu=0, milli=1000, memory_mb=1000)])
    await observer.kv_put("topology", "n1", encode(node_topology("n1", gpus=4)))
    await observer.kv_put("ledger", "n1", holds("n1", ("t3", "t3.assign", 1), ("t2", "t2.assign", 2),
                                                ("t5", "t5.migrate", 3)))
    await observer.kv_put("ledger", "n2", encode(NodeLedger(node="n2", allocations=[
        confirmed("t5", "t5.assign", 0), confirmed("t6", "t6.assign", 1)])))
    await observer.kv_put("executions", "t3.assign", executed(t3, 1_000_000.0))
    await observer.kv_put("executions", "t5.migrate", executed(t5, 1_000_000.0))
    orphan = left_behind(tmp_path, "t3")
    try:
        host = build(settings(nats_url, tmp_path, backend="process", node="n1", grace_s=1.0))
        await host.start()
        try:
            life = await observer.wait_stored("task.lifecycle.>", TaskLifecycle, 2)
            await observer.js.publish("decision.made", encode(t3))  # its redelivery
            republished = await observer.wait_stored("action.executed", ActionExecuted, 1)
            await asyncio.sleep(0.5)
            life = await observer.stored("task.lifecycle.>", TaskLifecycle)
            n1, n2 = await observer.ledger("n1"), await observer.ledger("n2")
        finally:
            await host.stop()
        assert orphan.wait(timeout=5) is not None  # stopped by the new executor
    finally:
        if orphan.poll() is None:
            orphan.kill()
    assert sorted((e.task_id, e.state, e.gpus, e.decision_id) for e in life) == [
        ("t3", "evicted", [1], "t3.assign"), ("t5", "evicted", [3], "t5.migrate")]
    how = {e.task_id: e.detail for e in life}
    assert how["t3"].endswith("its process was stopped now")
    assert how["t5"].endswith("its process was gone with it")
    assert [e.decision_id for e in republished] == ["t3.assign"]
    assert [(a.task_id, a.state) for a in n1.allocations] == [("t2", "reserved")]
    assert [(a.task_id, a.state) for a in n2.allocations] == [("t6", "confirmed")]


async def test_an_assign_delivered_again_after_its_task_ended_tells_no_start(
    observer, sim_fleet, nats_url, tmp_path
):
    # t4 ran and finished, its holds went back; its assign comes again after the stream's
    # duplicate window (a redelivery, a replay): the recorded success is republished, and a
    # `started` told now would have the policy take the finished task as running.
    t4 = run("t4.assign", "t4", "n1", 0)
    await observer.kv_put("topology", "n1", encode(node_topology("n1")))
    await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1")))
    await observer.kv_put("executions", "t4.assign", executed(t4, 1_000_000.0))
    host = build(settings(nats_url, tmp_path, "a"))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(t4))
        republished = await observer.wait_stored("action.executed", ActionExecuted, 1)
        await asyncio.sleep(0.5)
        life = await observer.stored("task.lifecycle.>", TaskLifecycle)
    finally:
        await host.stop()
    assert [e.decision_id for e in republished] == ["t4.assign"]
    assert life == []
    assert sim_fleet.commands == []
