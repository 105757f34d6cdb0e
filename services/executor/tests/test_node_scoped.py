"""Executors scoped to their node (``FLEETPILOT_EXECUTOR_NODE``, one per GPU node as the
DaemonSet runs them) over a real nats-server: each carries out the decisions for its own
node, with the process backend on its own machine; a decision that names no node is
acknowledged once; a node's executor started late carries out what was decided for it
meanwhile; a task moves between nodes through a hand-over from its node's executor."""

from __future__ import annotations

import asyncio
import sys

import msgspec
import pytest
from fleetpilot.contracts import (
    ActionExecuted,
    ActionFailed,
    Allocation,
    DecisionMade,
    NodeLedger,
    Placement,
    PolicyRef,
    TaskLifecycle,
    TaskSubmitted,
    encode,
    now,
)
from fleetpilot.runtime.testing import eventually as wait_for
from fleetpilot_services.executor.service import build

from .conftest import node_topology
from .test_decisions import settings

NODES = ("n1", "n2")


def run(decision_id: str, task_id: str, node: str, gpu: int, seconds: float = 0.0) -> DecisionMade:
    """An assign of a task that prints its GPUs, then sleeps ``seconds``."""
    code = f"import os, time; print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep({seconds})"
    return DecisionMade(decision_id=decision_id, task_id=task_id, action="assign",
                        placement=[Placement(node=node, gpu=gpu, milli=1000, memory_mb=1000)],
                        confidence=0.8, policy=PolicyRef(name="fleetpilot"), decided_at=now(),
                        task=TaskSubmitted(task_id=task_id, kind="train", command=[sys.executable, "-c", code]))


def holds(node: str, *tasks: tuple[str, str, int]) -> bytes:
    """The ledger of ``node`` with a reserved hold per ``(task, decision, gpu)``."""
    return encode(NodeLedger(node=node, allocations=[
        Allocation(task_id=t, decision_id=d, gpu=g, milli=1000, memory_mb=1000) for t, d, g in tasks]))


async def test_each_node_s_executor_carries_out_the_decisions_for_its_node(observer, nats_url, tmp_path):
    tasks = {"n1": [("a0", "a0.assign", 0), ("a1", "a1.assign", 1), ("a2", "a2.assign", 2)],
             "n2": [("b0", "b0.assign", 0), ("b1", "b1.assign", 1), ("b2", "b2.assign", 2)]}
    for node in NODES:
        await observer.kv_put("topology", node, encode(node_topology(node, gpus=4)))
        await observer.kv_put("ledger", node, holds(node, *tasks[node]))
    logs = {node: tmp_path / f"out-{node}" for node in NODES}
    # n2's executor starts after its first decision was made: it carries it out on start.
    await observer.js.publish("decision.made", encode(run("b0.assign", "b0", "n2", 0)))
    hosts = {node: build(settings(nats_url, tmp_path / node, replica=f"executor-{node}", backend="process",
                                  node=node, process_log_dir=str(logs[node])))
             for node in NODES}
    await hosts["n1"].start()
    try:
        await asyncio.sleep(0.3)
        await hosts["n2"].start()
        for t, d, g in tasks["n1"] + tasks["n2"][1:]:
            await observer.js.publish("decision.made", encode(run(d, t, "n1" if t[0] == "a" else "n2", g)))
        queued = DecisionMade(decision_id="q.queue", task_id="q", action="queue", confidence=0.9,
                              policy=PolicyRef(name="fleetpilot"), decided_at=now())
        await observer.js.publish("decision.made", encode(queued))
        executed = await observer.wait_stored("action.executed", ActionExecuted, 7)
        for node in NODES:
            for t, _, _ in tasks[node]:
                await wait_for(lambda n=node, t=t: (logs[n] / f"{t}.out").exists()
                               and (logs[n] / f"{t}.out").read_text().strip() != "")
        failed = await observer.stored("action.failed", ActionFailed)
    finally:
        for host in hosts.values():
            await host.stop()
    assert failed == []
    assert sorted(e.action_id for e in executed) == sorted(
        [f"act-{d}" for node in NODES for _, d, _ in tasks[node]] + ["act-q.queue"])
    for node in NODES:
        ran = sorted(p.stem for p in logs[node].glob("*.out"))
        assert ran == [t for t, _, _ in tasks[node]], (node, ran)
        for t, _, g in tasks[node]:
            assert (logs[node] / f"{t}.out").read_text().strip() == str(g)


def move(task_id: str, to: str, gpu: int, source: str = "n1", resumable: bool = True) -> DecisionMade:
    """The migrate decision of ``task_id`` (which resumes or not) from GPU 0 of ``source`` to
    ``to``'s GPU ``gpu``."""
    return DecisionMade(decision_id=f"{task_id}.migrate.1", task_id=task_id, action="migrate",
                        placement=[Placement(node=to, gpu=gpu, milli=1000, memory_mb=1000)],
                        source=[Placement(node=source, gpu=0, milli=1000, memory_mb=1000)], confidence=0.7,
                        policy=PolicyRef(name="fleetpilot"), decided_at=now(),
                        task=TaskSubmitted(task_id=task_id, kind="train", resumable=resumable))


def checkpointing(tmp_path) -> list[str]:
    """A task that notes each start's GPUs in ``starts``, saves ``step=42`` on SIGUSR1 and,
    restored, writes it and its GPUs."""
    ckpt, restored, starts = tmp_path / "ckpt", tmp_path / "restored", tmp_path / "starts"
    code = ("import os, signal, sys, time, pathlib\n"
            f"ckpt, restored = pathlib.Path({str(ckpt)!r}), pathlib.Path({str(restored)!r})\n"
            "def save(*_):\n"
            "    ckpt.write_text('step=42'); sys.exit(0)\n"
            "signal.signal(signal.SIGUSR1, save)\n"
            "if os.environ.get('FLEETPILOT_RESTORE') == '1':\n"
            "    restored.write_text(ckpt.read_text().strip() + ' gpus=' + os.environ['CUDA_VISIBLE_DEVICES'])\n"
            f"with open({str(starts)!r}, 'a') as f: f.write(os.environ['CUDA_VISIBLE_DEVICES'] + '\\n')\n"
            "time.sleep(60)\n")
    return [sys.executable, "-c", code]


async def node_executors(nats_url, tmp_path, unchecked: dict | None = None, **overrides) -> dict:
    """Started executors of n1 and n2 (process backend, one per node); ``unchecked`` settings
    skip validation (a take-back window shorter than a deployment may set)."""
    hosts = {node: build(settings(nats_url, tmp_path / node, replica=f"executor-{node}", backend="process",
                                  node=node, process_log_dir=str(tmp_path / f"out-{node}"), **overrides)
                         .model_copy(update=unchecked or {}))
             for node in NODES}
    for host in hosts.values():
        await host.start()
    return hosts


async def two_nodes_holding_t1_on_n1(observer) -> None:
    """n1 and n2, two GPUs each, with t1's assign reserved on n1's GPU 0."""
    for node in NODES:
        await observer.kv_put("topology", node, encode(node_topology(node, gpus=2)))
    await observer.kv_put("ledger", "n1", holds("n1", ("t1", "t1.assign", 0)))


async def start_t1_on_n1_then_move_it_to_n2(observer, tmp_path, resumable: bool = True) -> None:
    """t1 (a task that checkpoints, and resumes or not) started on n1, then decided to move to
    n2's GPU 1."""
    started = msgspec.structs.replace(run("t1.assign", "t1", "n1", 0), task=TaskSubmitted(
        task_id="t1", kind="train", command=checkpointing(tmp_path)))
    await observer.js.publish("decision.made", encode(started))
    await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 1)
    # Moved once it runs (its handler set): a move in its first instants would find no handler.
    await wait_for(lambda: (tmp_path / "starts").exists() and (tmp_path / "starts").read_text() == "0\n")
    await observer.kv_put("ledger", "n2", holds("n2", ("t1", "t1.migrate.1", 1)))
    await observer.js.publish("decision.made", encode(move("t1", "n2", 1, resumable=resumable)))


@pytest.mark.parametrize("resumable", [True, False])
async def test_a_task_moves_to_another_node_from_its_checkpoint_or_over_when_it_cannot_resume(
    observer, nats_url, tmp_path, resumable
):
    await two_nodes_holding_t1_on_n1(observer)
    hosts = await node_executors(nats_url, tmp_path)
    try:
        await start_t1_on_n1_then_move_it_to_n2(observer, tmp_path, resumable)
        executed = await observer.wait_stored("action.executed", ActionExecuted, 2)
        await wait_for(lambda: (tmp_path / "starts").exists() and (tmp_path / "starts").read_text() == "0\n1\n")
        await asyncio.sleep(1.5)  # a backend poll: its own copy of the move must not be republished
        life = await observer.stored("task.lifecycle.t1", TaskLifecycle)
        n1, n2 = await observer.ledger("n1"), await observer.ledger("n2")
    finally:
        for host in hosts.values():
            await host.stop()
    assert [e.action_id for e in executed] == ["act-t1.assign", "act-t1.migrate.1"]
    if resumable:
        assert (tmp_path / "restored").read_text() == "step=42 gpus=1"
    else:  # no checkpoint signal, no restore: it started over on n2
        assert not (tmp_path / "ckpt").exists() and not (tmp_path / "restored").exists()
    assert [(s.state, s.node, s.gpus) for s in life] == [("started", "n1", [0]), ("migrated", "n2", [1])]
    assert ("started over" in life[1].detail) is not resumable
    assert n1.allocations == []
    assert [(a.task_id, a.state, a.gpu) for a in n2.allocations] == [("t1", "confirmed", 1)]


async def test_a_task_handed_over_for_a_move_that_never_took_it_is_taken_back_from_its_checkpoint(
    observer, nats_url, tmp_path, monkeypatch
):
    from fleetpilot.executor import BackendError
    from fleetpilot_services.executor import backends

    real = backends.BusTakeOver.__call__

    async def answers_lost(self, node: str, task_id: str, grace_s: float, resumes: bool = True):
        await real(self, node, task_id, grace_s, resumes)  # the source checkpoints and stops the task
        raise BackendError(f"{node} did not hand {task_id} over: nats: timeout", retryable=True)

    monkeypatch.setattr(backends.BusTakeOver, "__call__", answers_lost)
    await two_nodes_holding_t1_on_n1(observer)
    hosts = await node_executors(nats_url, tmp_path, {"hand_over_taken_within_s": 1.0}, silent_check_s=0.5)
    try:
        await start_t1_on_n1_then_move_it_to_n2(observer, tmp_path)
        failed = await observer.wait_stored("action.failed", ActionFailed, 1)
        life = await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 2)
        await wait_for(lambda: (tmp_path / "restored").exists() and (tmp_path / "restored").read_text() != "")
        n1, n2 = await observer.ledger("n1"), await observer.ledger("n2")
    finally:
        for host in hosts.values():
            await host.stop()
    assert failed[0].retryable and "did not hand t1 over" in failed[0].error
    assert [(s.state, s.node, s.gpus) for s in life] == [("started", "n1", [0]), ("started", "n1", [0])]
    assert "taken back, its move never took it" in life[1].detail
    assert (tmp_path / "restored").read_text() == "step=42 gpus=0"
    assert [(a.task_id, a.gpu) for a in n1.allocations] == [("t1", 0)]
    assert n2.allocations == []


async def test_a_move_of_a_task_its_node_does_not_run_fails_and_gives_the_target_back(
    observer, nats_url, tmp_path
):
    for node in NODES:
        await observer.kv_put("topology", node, encode(node_topology(node, gpus=2)))
    await observer.kv_put("ledger", "n2", holds("n2", ("t9", "t9.migrate.1", 1)))
    hosts = await node_executors(nats_url, tmp_path)
    try:
        await observer.js.publish("decision.made", encode(move("t9", "n2", 1)))
        failed = await observer.wait_stored("action.failed", ActionFailed, 1)
        await asyncio.sleep(0.3)
        n2 = await observer.ledger("n2")
    finally:
        for host in hosts.values():
            await host.stop()
    assert [f.action_id for f in failed] == ["act-t9.migrate.1"]
    assert "n1 did not hand t9 over: task t9 is not running on n1" in failed[0].error, failed[0].error
    assert not failed[0].retryable
    assert n2.allocations == []


async def test_a_node_s_executor_keeps_saying_it_is_there_and_one_for_every_node_says_nothing(
    observer, nats_url, tmp_path
):
    # The topology service takes a reporting node out of service once its executor's key
    # stops changing (``contracts.presence``): with no key written, a node whose executor
    # was down took decisions nobody carried out.
    from fleetpilot.contracts import ExecutorPresence

    executors = await observer.js.key_value("executors")
    hosts = [build(settings(nats_url, tmp_path, "n1-exec", backend="process", node="n1", presence_every_s=0.2)),
             build(settings(nats_url, tmp_path / "all", "sim-exec", presence_every_s=0.2))]
    for host in hosts:
        await host.start()
    revisions: list[int] = []
    try:
        async def rewritten_twice() -> bool:
            try:
                entry = await executors.get("n1")
            except Exception:  # noqa: BLE001 - not written yet
                return False
            if not revisions or revisions[-1] != entry.revision:
                revisions.append(entry.revision)
            return len(revisions) >= 3

        await wait_for(rewritten_twice, timeout_s=10, what="n1's key written at start and rewritten")
        written = msgspec.json.decode((await executors.get("n1")).value, type=ExecutorPresence)
        keys = await executors.keys()
    finally:
        for host in hosts:
            await host.stop()
    assert (written.node, written.replica) == ("n1", "n1-exec")
    assert keys == ["n1"]  # the executor of every node (the simulated fleet's) writes none


async def test_a_node_where_nothing_can_start_says_so_and_its_decisions_are_placed_again(observer, nats_url, tmp_path):
    """n1's executor runs, but no process can start there (its log directory is gone bad, as
    a full disk would be): each start fails retryably (placed again elsewhere, not refused
    as if the command were wrong) and, from the third in a row, the node's key in the
    ``executors`` bucket says why, at once, so the topology service takes it out of service.
    Once a start works again, the key no longer says it."""
    from fleetpilot.contracts import ExecutorPresence
    from fleetpilot.executor.process import TROUBLE_AFTER_FAILURES

    logs = tmp_path / "out-n1"
    logs.write_text("a file where the log directory should be")
    tasks = [(f"t{i}", f"t{i}.assign", i) for i in range(TROUBLE_AFTER_FAILURES + 1)]
    await observer.kv_put("topology", "n1", encode(node_topology("n1", gpus=len(tasks))))
    await observer.kv_put("ledger", "n1", holds("n1", *tasks))
    executors = await observer.js.key_value("executors")
    # The periodic rewrite is a minute away: what the key says comes from the decisions.
    host = build(settings(nats_url, tmp_path / "n1", replica="executor-n1", backend="process", node="n1",
                          process_log_dir=str(logs), presence_every_s=60.0))
    await host.start()

    async def trouble() -> str:
        return msgspec.json.decode((await executors.get("n1")).value, type=ExecutorPresence).trouble

    try:
        for task_id, decision_id, gpu in tasks[:-1]:
            await observer.js.publish("decision.made", encode(run(decision_id, task_id, "n1", gpu)))
        failed = await observer.wait_stored("action.failed", ActionFailed, TROUBLE_AFTER_FAILURES)

        async def says_trouble() -> bool:
            return await trouble() != ""

        await wait_for(says_trouble, timeout_s=5, what="n1's key to say no task can start there")
        said = await trouble()
        logs.unlink()  # mended; a decision made before the node went out of service arrives
        task_id, decision_id, gpu = tasks[-1]
        await observer.js.publish("decision.made", encode(run(decision_id, task_id, "n1", gpu)))
        executed = await observer.wait_stored("action.executed", ActionExecuted, 1)

        async def well() -> bool:
            return await trouble() == ""

        await wait_for(well, timeout_s=5, what="n1's key rewritten without the trouble")
    finally:
        await host.stop()
    assert [f.retryable for f in failed] == [True] * TROUBLE_AFTER_FAILURES
    assert f"{TROUBLE_AFTER_FAILURES} starts in a row failed on n1" in said and "out-n1" in said
    assert [e.task_id for e in executed] == [task_id]
