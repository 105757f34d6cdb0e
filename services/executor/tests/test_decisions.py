"""The executor service over a real nats-server: each decision once, the process backend."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

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
    SimEvent,
    TaskLifecycle,
    TaskSubmitted,
    encode,
    now,
)
from fleetpilot.runtime.testing import eventually as wait_for
from fleetpilot_services.executor.service import ExecutorSettings, build

from .conftest import node_topology


def settings(nats_url: str, tmp_path: Path, replica: str = "a", **overrides) -> ExecutorSettings:
    return ExecutorSettings(
        nats_url=nats_url, metrics_port=-1, replica=replica, state_dir=str(tmp_path), **overrides
    )


def assign(decision_id: str, task_id: str, gpu: int = 0, command: list[str] | None = None) -> DecisionMade:
    return DecisionMade(
        decision_id=decision_id,
        task_id=task_id,
        action="assign",
        placement=[Placement(node="n1", gpu=gpu, milli=1000, memory_mb=1000)],
        confidence=0.8,
        policy=PolicyRef(name="best-fit"),
        decided_at=now(),
        task=TaskSubmitted(task_id=task_id, kind="train", command=command),
    )


def evict(decision_id: str, task_id: str, gpu: int = 0) -> DecisionMade:
    return DecisionMade(
        decision_id=decision_id,
        task_id=task_id,
        action="evict",
        source=[Placement(node="n1", gpu=gpu, milli=1000, memory_mb=1000)],
        confidence=0.8,
        policy=PolicyRef(name="best-fit"),
        decided_at=now(),
    )


def reserved(task_id: str, decision_id: str, gpu: int = 0) -> bytes:
    return encode(
        NodeLedger(
            node="n1",
            allocations=[
                Allocation(task_id=task_id, decision_id=decision_id, gpu=gpu, milli=1000, memory_mb=1000)
            ],
        )
    )


async def test_a_decision_delivered_twice_is_executed_once(observer, sim_fleet, nats_url, tmp_path):
    await observer.kv_put("ledger", "n1", reserved("t1", "d1"))
    host = build(settings(nats_url, tmp_path))
    await host.start()
    try:
        decision = assign("d1", "t1")
        # Two publishes the stream cannot tell apart as duplicates: the consumer hands the
        # decision to the service twice, as after a redelivery.
        for msg_id in ("first", "second"):
            await observer.js.publish("decision.made", encode(decision), headers={"Nats-Msg-Id": msg_id})
        executed = await observer.wait_stored("action.executed", ActionExecuted, 1)
        started = await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 1)
        await wait_for(lambda: len(sim_fleet.commands) >= 1)
        await asyncio.sleep(0.5)  # room for a second execution to show up
    finally:
        await host.stop()
    assert [e.action_id for e in executed] == ["act-d1"]
    # The decision the task runs under, to the policy's version and the action: the feedback
    # service judges it from this when the task ends before the result is read.
    assert [(s.state, s.decision_id, s.policy, s.policy_version, s.decision_action) for s in started] == [
        ("started", "d1", "best-fit", "1", "assign")]
    assert len(sim_fleet.verbs("place")) == 1
    assert await observer.stored("action.failed", ActionFailed) == []
    ledger = await observer.ledger("n1")
    assert [a.state for a in ledger.allocations] == ["confirmed"]


@pytest.mark.parametrize("resumable", [True, False])
async def test_the_simulated_fleet_is_told_whether_the_task_resumes(observer, sim_fleet, nats_url, tmp_path,
                                                                   resumable):
    await observer.kv_put("ledger", "n1", reserved("t1", "d1"))
    host = build(settings(nats_url, tmp_path))
    await host.start()
    try:
        decision = msgspec.structs.replace(assign("d1", "t1"),
                                           task=TaskSubmitted(task_id="t1", kind="train", resumable=resumable))
        await observer.js.publish("decision.made", encode(decision))
        await wait_for(lambda: len(sim_fleet.commands) >= 1)
    finally:
        await host.stop()
    assert [c.resumable for c in sim_fleet.verbs("place")] == [resumable]


async def test_two_replicas_given_the_same_decision_start_it_once(observer, sim_fleet, nats_url, tmp_path):
    await observer.kv_put("ledger", "n1", reserved("t1", "d1"))
    hosts = [build(settings(nats_url, tmp_path, replica)) for replica in ("a", "b")]
    for host in hosts:
        await host.start()
    try:
        # Several copies in flight at once, shared by two replicas: whichever loses the
        # claim in the ``executions`` bucket waits for a redelivery and republishes the
        # recorded result.
        decision = encode(assign("d1", "t1"))
        await asyncio.gather(
            *(
                observer.js.publish("decision.made", decision, headers={"Nats-Msg-Id": f"copy-{i}"})
                for i in range(6)
            )
        )
        executed = await observer.wait_stored("action.executed", ActionExecuted, 1)
        await asyncio.sleep(2.5)  # past the 2 s retry of a replica that lost the claim
        executed = await observer.stored("action.executed", ActionExecuted)
        started = await observer.stored("task.lifecycle.t1", TaskLifecycle)
    finally:
        for host in hosts:
            await host.stop()
    assert [e.action_id for e in executed] == ["act-d1"]
    assert [s.state for s in started] == ["started"]
    assert len(sim_fleet.verbs("place")) == 1


def sleeper(marker: Path) -> list[str]:
    script = (
        "import os, sys, time\n"
        f"open({str(marker)!r}, 'w').write(os.environ['CUDA_VISIBLE_DEVICES'] + ' ' + str(os.getpid()))\n"
        "time.sleep(30)\n"
    )
    return [sys.executable, "-c", script]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_process_backend_runs_the_command_on_its_gpus_and_evicts_it(
    observer, nats_url, tmp_path, monkeypatch
):
    # Chosen the way a deployment chooses it.
    monkeypatch.setenv("FLEETPILOT_EXECUTOR_BACKEND", "process")
    await observer.kv_put("topology", "n1", encode(node_topology("n1", gpus=4)))
    await observer.kv_put("ledger", "n1", reserved("t1", "d1", gpu=3))
    marker = tmp_path / "child"
    host = build(settings(nats_url, tmp_path, grace_s=2.0))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(assign("d1", "t1", gpu=3, command=sleeper(marker))))
        executed = await observer.wait_stored("action.executed", ActionExecuted, 1)
        await wait_for(lambda: marker.exists() and " " in marker.read_text())
        visible, pid = marker.read_text().split()
        assert alive(int(pid))
        assert (await observer.ledger("n1")).allocations[0].state == "confirmed"

        await observer.js.publish("decision.made", encode(evict("d2", "t1", gpu=3)))
        executed = await observer.wait_stored("action.executed", ActionExecuted, 2)
        await wait_for(lambda: not alive(int(pid)), timeout_s=5)
        await asyncio.sleep(1.5)  # one backend poll: its own copy of the eviction must not be republished
        life = await observer.stored("task.lifecycle.t1", TaskLifecycle)
    finally:
        await host.stop()
    assert visible == "3"
    assert [(e.action, e.backend, e.gpu_model) for e in executed] == [
        ("assign", "process", "H100"),
        ("evict", "process", "H100"),
    ]
    assert [(s.state, s.gpus) for s in life] == [("started", [3]), ("evicted", [3])]
    assert life[0].gpu_model == "H100"
    assert (await observer.ledger("n1")).allocations == []


@contextlib.asynccontextmanager
async def a_task_that_exits_at_once(observer, nats_url: str, tmp_path: Path):
    """The process backend running t2 (``d5``), a command that exits at once; the block
    starts once its ``started`` and ``finished`` are stored."""
    await observer.kv_put("ledger", "n1", reserved("t2", "d5"))
    host = build(settings(nats_url, tmp_path, backend="process"))
    await host.start()
    try:
        await observer.js.publish(
            "decision.made", encode(assign("d5", "t2", command=[sys.executable, "-c", "pass"]))
        )
        await observer.wait_stored("task.lifecycle.t2", TaskLifecycle, 2)
        yield
    finally:
        await host.stop()


async def test_process_that_exits_is_reported_finished_and_its_hold_released(observer, nats_url, tmp_path):
    async with a_task_that_exits_at_once(observer, nats_url, tmp_path):
        life = await observer.stored("task.lifecycle.t2", TaskLifecycle)
    assert [(s.state, s.exit_code, s.decision_id) for s in life] == [
        ("started", None, "d5"),
        ("finished", 0, "d5"),
    ]
    assert (await observer.ledger("n1")).allocations == []


async def test_an_eviction_that_reaches_a_task_already_finished_tells_no_eviction(observer, nats_url, tmp_path):
    """A preemption races with the task's own end: the end was told (and its hold given
    back) first. An ``evicted`` after it would have the policy queue and run the finished
    task again; the eviction is carried out (there is nothing to stop) and says nothing more."""
    async with a_task_that_exits_at_once(observer, nats_url, tmp_path):
        await observer.js.publish("decision.made", encode(evict("t2.evict.1", "t2")))
        executed = await observer.wait_stored("action.executed", ActionExecuted, 2)
        await asyncio.sleep(1.5)  # one backend poll and more: room for an eviction to be told
        life = await observer.stored("task.lifecycle.t2", TaskLifecycle)
    assert [e.decision_id for e in executed] == ["d5", "t2.evict.1"]
    assert [s.state for s in life] == ["started", "finished"]


@pytest.mark.parametrize("command", [None, ["/nonexistent/binary"]])
async def test_process_that_cannot_start_fails_the_action_and_releases_the_hold(
    observer, nats_url, tmp_path, command
):
    await observer.kv_put("ledger", "n1", reserved("t3", "d6"))
    host = build(settings(nats_url, tmp_path, backend="process"))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(assign("d6", "t3", command=command)))
        failed = await observer.wait_stored("action.failed", ActionFailed, 1)
        await asyncio.sleep(0.3)
    finally:
        await host.stop()
    assert [f.action_id for f in failed] == ["act-d6"]
    assert (await observer.ledger("n1")).allocations == []


async def test_a_failed_assign_delivered_again_leaves_the_task_s_next_placement_alone(observer, nats_url, tmp_path):
    """``d6`` failed and gave its hold back; the policy placed t3 again on the same node
    (``t3.assign.2``). ``d6`` then comes again (a redelivery, a replayed consumer): its
    recorded failure is the answer, and only ``d6``'s holds may go. Before, every hold of t3
    on the node went, the new placement's too, and its GPU share was booked twice."""
    await observer.kv_put("ledger", "n1", reserved("t3", "d6"))
    host = build(settings(nats_url, tmp_path, backend="process"))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(assign("d6", "t3")))
        await observer.wait_stored("action.failed", ActionFailed, 1)

        async def given_back():
            ledger = await observer.ledger("n1")
            return ledger is not None and ledger.allocations == []

        await wait_for(given_back)
        await observer.kv_put("ledger", "n1", reserved("t3", "t3.assign.2"))
        await observer.js.publish("decision.made", encode(assign("d6", "t3")), headers={"Nats-Msg-Id": "again"})
        await asyncio.sleep(0.5)
        failed = await observer.wait_stored("action.failed", ActionFailed, 1)
    finally:
        await host.stop()
    assert [f.action_id for f in failed] == ["act-d6"]  # told once: the stream dropped the repeat
    assert [a.decision_id for a in (await observer.ledger("n1")).allocations] == ["t3.assign.2"]


async def reserve_a_move_of_t1_to_n2(observer) -> None:
    """t1 holds n1's GPU 0 (``d1``); the policy has reserved n2's GPU 1 for its move."""
    await observer.kv_put("ledger", "n1", reserved("t1", "d1"))
    await observer.kv_put("ledger", "n2", encode(NodeLedger(node="n2", allocations=[
        Allocation(task_id="t1", decision_id="t1.migrate.1", gpu=1, milli=1000, memory_mb=1000)])))


def move_t1(to: str = "n2") -> DecisionMade:
    """The migrate decision of t1 from n1's GPU 0 to GPU 1 of node ``to``."""
    return DecisionMade(decision_id="t1.migrate.1", task_id="t1", action="migrate",
                        placement=[Placement(node=to, gpu=1, milli=1000, memory_mb=1000)],
                        source=[Placement(node="n1", gpu=0, milli=1000, memory_mb=1000)], confidence=0.7,
                        policy=PolicyRef(name="fleetpilot"), decided_at=now(),
                        task=TaskSubmitted(task_id="t1", kind="train"))


async def test_a_migration_moves_the_task_s_holds_to_the_target(observer, sim_fleet, nats_url, tmp_path):
    await reserve_a_move_of_t1_to_n2(observer)
    host = build(settings(nats_url, tmp_path))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(move_t1()), headers={"Nats-Msg-Id": "move-1"})
        moved = await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 1)
        await wait_for(lambda: len(sim_fleet.verbs("move")) == 1)
    finally:
        await host.stop()
    assert [(m.state, m.node, m.gpus) for m in moved] == [("migrated", "n2", [1])]
    assert (await observer.ledger("n1")).allocations == []
    assert [(a.task_id, a.state) for a in (await observer.ledger("n2")).allocations] == [("t1", "confirmed")]


@pytest.mark.parametrize("replaced", [False, True], ids=["same-replica", "replica-replaced-between"])
async def test_a_migration_names_the_placement_the_task_left(observer, sim_fleet, nats_url, tmp_path, replaced):
    # Replaced: the replica that moves the task is not the one that placed it, and reads
    # the placement it ends from the ledger and the journal.
    await reserve_a_move_of_t1_to_n2(observer)
    host = build(settings(nats_url, tmp_path))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(assign("d1", "t1")))
        await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 1)
        if replaced:
            await host.stop()
            host = build(settings(nats_url, tmp_path, "b"))
            await host.start()
        await observer.js.publish("decision.made", encode(move_t1()), headers={"Nats-Msg-Id": "move-1"})
        events = await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 2)
    finally:
        await host.stop()
    assert [(e.state, e.decision_id, e.replaces_decision_id) for e in events] == [
        ("started", "d1", ""), ("migrated", "t1.migrate.1", "d1")]


async def test_a_migration_within_a_node_keeps_only_the_new_hold(observer, sim_fleet, nats_url, tmp_path):
    await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1", allocations=[
        Allocation(task_id="t1", decision_id="t1.assign", gpu=0, milli=1000, memory_mb=1000, state="confirmed"),
        Allocation(task_id="t1", decision_id="t1.migrate.1", gpu=1, milli=1000, memory_mb=1000),
        Allocation(task_id="other", decision_id="other.assign", gpu=0, milli=0, memory_mb=0)])))
    host = build(settings(nats_url, tmp_path))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(move_t1(to="n1")), headers={"Nats-Msg-Id": "move-2"})
        await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 1)
    finally:
        await host.stop()
    holds = [(a.task_id, a.gpu, a.state) for a in (await observer.ledger("n1")).allocations]
    assert holds == [("t1", 1, "confirmed"), ("other", 0, "reserved")]


async def test_a_failed_migration_within_a_node_gives_the_target_back_and_keeps_the_source(
    observer, nats_url, tmp_path
):
    # The process backend runs nothing called t1: its move fails, and t1 (as far as the
    # ledger knows) still runs on GPU 0. The hold reserved on GPU 1 must not outlive the move.
    await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1", allocations=[
        Allocation(task_id="t1", decision_id="t1.assign", gpu=0, milli=1000, memory_mb=1000, state="confirmed"),
        Allocation(task_id="t1", decision_id="t1.migrate.1", gpu=1, milli=1000, memory_mb=1000)])))
    host = build(settings(nats_url, tmp_path, backend="process"))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(move_t1(to="n1")))
        failed = await observer.wait_stored("action.failed", ActionFailed, 1)

        async def target_given_back():
            ledger = await observer.ledger("n1")
            return ledger if ledger and len(ledger.allocations) == 1 else None

        ledger = await wait_for(target_given_back)
    finally:
        await host.stop()
    assert [f.action for f in failed] == ["migrate"]
    assert [(a.task_id, a.decision_id, a.gpu, a.state) for a in ledger.allocations] == [
        ("t1", "t1.assign", 0, "confirmed")]


async def test_a_stopping_executor_gives_its_tasks_back_to_be_placed_again(observer, nats_url, tmp_path):
    # A rolling update of the executor, say: its processes end with it. The policy hears
    # of each (evicted, its hold released) and places it again; before, the hold stayed
    # and nothing was said, so the task was lost and its GPU share leaked.
    await observer.kv_put("ledger", "n1", reserved("t1", "d1", gpu=1))
    marker = tmp_path / "child"
    host = build(settings(nats_url, tmp_path, backend="process", grace_s=2.0, node="n1"))
    await host.start()
    stopped = False
    try:
        await observer.js.publish("decision.made", encode(assign("d1", "t1", gpu=1, command=sleeper(marker))))
        await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 1)
        await wait_for(lambda: marker.exists() and " " in marker.read_text())
        pid = int(marker.read_text().split()[1])
        await host.stop()
        stopped = True
    finally:
        if not stopped:
            await host.stop()
    life = await observer.stored("task.lifecycle.t1", TaskLifecycle)
    assert [(s.state, s.node, s.gpus, s.decision_id) for s in life] == [
        ("started", "n1", [1], "d1"), ("evicted", "n1", [1], "d1")]
    assert "the executor on n1 stopped" in life[1].detail, life[1].detail
    assert (await observer.ledger("n1")).allocations == []
    assert not alive(pid)


async def test_a_replica_that_did_not_place_a_task_still_names_its_decision_when_it_ends(
    observer, sim_fleet, nats_url, tmp_path
):
    # Replica a carries out the assign, then is replaced (a rolling update); replica b hears
    # the simulated fleet say the task finished. Its "finished" must name the assign, for
    # the feedback service to judge it: b reads it from the ledger's hold and the journal.
    await observer.kv_put("ledger", "n1", reserved("t1", "d1"))
    first = build(settings(nats_url, tmp_path, "a"))
    await first.start()
    try:
        await observer.js.publish("decision.made", encode(assign("d1", "t1")))
        await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 1)
    finally:
        await first.stop()
    second = build(settings(nats_url, tmp_path, "b"))
    await second.start()
    try:
        ended = SimEvent(kind="finished", node="n1", gpu=0, task_id="t1", at=now())
        await observer.nc.publish("sim.event.n1", encode(ended))
        life = await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 2)
    finally:
        await second.stop()
    assert [(s.state, s.decision_id, s.policy, s.confidence, s.task_kind) for s in life] == [
        ("started", "d1", "best-fit", 0.8, "train"), ("finished", "d1", "best-fit", 0.8, "train")]
    assert (await observer.ledger("n1")).allocations == []


async def test_an_eviction_that_reaches_a_task_ended_but_not_yet_told_tells_no_eviction(tmp_path):
    """The task's process exited a moment before the eviction reached it, and the backend's
    next poll (once a second) has not told its end yet. The eviction has nothing to stop and
    must not take the task's hold and tell ``evicted``: the policy would queue and run the
    finished task again. Its end is told as ``finished``, and the hold goes back then."""
    from fleetpilot.runtime.memory import InMemoryBus
    from fleetpilot_services.executor.health import GpuHealth

    bus = InMemoryBus()
    await bus.ensure_topology()
    await (await bus.kv("ledger")).put("n1", reserved("t9", "t9.assign"))
    running: list[asyncio.Task] = []
    replica = GpuHealth(settings("nats://unused", tmp_path, backend="process", node="n1"))
    await replica.open(bus, lambda follow, _name: running.append(asyncio.create_task(follow())))
    try:
        out = await replica.carry_out(assign("t9.assign", "t9", command=[sys.executable, "-c", "pass"]))
        assert isinstance(out[0], ActionExecuted)
        await wait_for(lambda: replica.backend.running() == [])  # ended; not polled yet
        out = await replica.carry_out(evict("t9.evict", "t9"))
        told = [e.state for e in out if isinstance(e, TaskLifecycle)]
        told += [e.state for e in await replica.backend_changes() if isinstance(e, TaskLifecycle)]
    finally:
        for task in running:
            task.cancel()
        await bus.drain()
    assert told == ["finished"]


def slow_saver(marker: Path) -> list[str]:
    """A task that takes 2.5 s to save its checkpoint when told to (SIGUSR1), then exits;
    restarted from it (``FLEETPILOT_RESTORE=1``), it writes what it found."""
    script = (
        "import os, signal, sys, time\n"
        f"marker = {str(marker)!r}\n"
        "if os.environ.get('FLEETPILOT_RESTORE') == '1':\n"
        "    found = open(marker).read() if os.path.exists(marker) else 'no checkpoint'\n"
        "    open(marker + '.restored', 'w').write(found)\n"
        "    time.sleep(30)\n"
        "def save(*_):\n"
        "    time.sleep(2.5)\n"
        "    open(marker, 'w').write('saved')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGUSR1, save)\n"
        "open(marker + '.up', 'w').write('up')\n"
        "while True:\n"
        "    time.sleep(0.1)\n"
    )
    return [sys.executable, "-c", script]


async def test_a_migration_gives_the_task_the_configured_time_to_save_its_checkpoint(observer, nats_url, tmp_path):
    """``FLEETPILOT_EXECUTOR_CHECKPOINT_S``: a task that takes 2.5 s to save is not stopped
    before its checkpoint is written (the window was a fixed second, then SIGTERM: the task
    died mid-save and restarted from nothing)."""
    await observer.kv_put("topology", "n1", encode(node_topology("n1", gpus=2)))
    await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1", allocations=[
        Allocation(task_id="t1", decision_id="d1", gpu=0, milli=1000, memory_mb=1000),
        Allocation(task_id="t1", decision_id="t1.migrate.1", gpu=1, milli=1000, memory_mb=1000)])))
    marker = tmp_path / "checkpoint"
    host = build(settings(nats_url, tmp_path, backend="process", checkpoint_s=6.0, grace_s=2.0))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(assign("d1", "t1", command=slow_saver(marker))))
        await wait_for(lambda: Path(f"{marker}.up").exists(), what="the task up")
        await observer.js.publish("decision.made", encode(move_t1(to="n1")))
        await wait_for(lambda: Path(f"{marker}.restored").exists(), timeout_s=20, what="the task restarted")
    finally:
        await host.stop()
    assert Path(f"{marker}.restored").read_text() == "saved"


def test_a_take_back_sooner_than_a_targets_last_try_is_a_setting_error(tmp_path):
    """A source that takes a handed-over task back while its target may still be waiting
    for it could run it on both nodes: the settings refuse that, naming the bound."""
    with pytest.raises(ValueError, match=r"must exceed the 360 s a target may wait"):
        settings("nats://127.0.0.1:1", tmp_path, checkpoint_s=100.0)
    assert settings("nats://127.0.0.1:1", tmp_path, checkpoint_s=100.0, hand_over_taken_within_s=400).checkpoint_s == 100


def test_a_drain_longer_than_the_hook_s_lock_lives_is_a_setting_error(tmp_path):
    """The pre-decommission hook holds its GPU's lock through the drain; the lock lives 35
    minutes at most (the hook_locks bucket's TTL). A longer drain lost it midway, and another
    replica took the hook over and cordoned again."""
    with pytest.raises(ValueError, match=r"decommission_drain_s \(3600\) must be within 0..2040 s"):
        settings("nats://127.0.0.1:1", tmp_path, decommission_drain_s=3600.0)
    assert settings("nats://127.0.0.1:1", tmp_path, decommission_drain_s=2000.0).decommission_drain_s == 2000


def move_t1_back() -> DecisionMade:
    """t1's second move: from n2's GPU 1 back to n1's GPU 0."""
    return DecisionMade(decision_id="t1.migrate.2", task_id="t1", action="migrate",
                        placement=[Placement(node="n1", gpu=0, milli=1000, memory_mb=1000)],
                        source=[Placement(node="n2", gpu=1, milli=1000, memory_mb=1000)], confidence=0.7,
                        policy=PolicyRef(name="fleetpilot"), decided_at=now(),
                        task=TaskSubmitted(task_id="t1", kind="train"))


async def test_a_move_redelivered_after_the_task_moved_back_leaves_its_holds_alone(
    observer, sim_fleet, nats_url, tmp_path
):
    """t1 moves n1 → n2, then back n2 → n1; the first move comes again past the stream's
    de-duplication window. Its recorded result is the answer; its ledger writes must not
    run again: they released t1's live hold on n1 (its "source") and left nothing."""
    await reserve_a_move_of_t1_to_n2(observer)
    host = build(settings(nats_url, tmp_path))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(move_t1()), headers={"Nats-Msg-Id": "move-1"})
        await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 1)
        n1 = await observer.ledger("n1")
        await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1", allocations=[
            *n1.allocations,
            Allocation(task_id="t1", decision_id="t1.migrate.2", gpu=0, milli=1000, memory_mb=1000)])))
        await observer.js.publish("decision.made", encode(move_t1_back()), headers={"Nats-Msg-Id": "move-2"})
        await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 2)
        await observer.js.publish("decision.made", encode(move_t1()), headers={"Nats-Msg-Id": "move-1-late"})
        await observer.wait_stored("action.executed", ActionExecuted, 3)
        await asyncio.sleep(0.5)
        life = await observer.stored("task.lifecycle.t1", TaskLifecycle)
    finally:
        await host.stop()
    assert [(a.task_id, a.decision_id, a.state) for a in (await observer.ledger("n1")).allocations] == [
        ("t1", "t1.migrate.2", "confirmed")]
    assert (await observer.ledger("n2")).allocations == []
    assert [(e.state, e.node) for e in life] == [("migrated", "n2"), ("migrated", "n1")]


async def test_a_move_redelivered_while_the_next_move_back_is_reserved_leaves_that_reservation(
    observer, sim_fleet, nats_url, tmp_path
):
    """t1 moved n1 → n2 (recorded); the policy has reserved its move back to n1 but the
    executor has not taken it yet; the first move comes again. Its source release took t1's
    holds on n1, the reservation of the move back among them: carried out then, the task ran
    on n1 with no hold, its share free for another."""
    await reserve_a_move_of_t1_to_n2(observer)
    host = build(settings(nats_url, tmp_path))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(move_t1()), headers={"Nats-Msg-Id": "move-1"})
        await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 1)
        await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1", allocations=[
            Allocation(task_id="t1", decision_id="t1.migrate.2", gpu=0, milli=1000, memory_mb=1000)])))
        await observer.js.publish("decision.made", encode(move_t1()), headers={"Nats-Msg-Id": "move-1-late"})
        await observer.wait_stored("action.executed", ActionExecuted, 2)
        await asyncio.sleep(0.5)
    finally:
        await host.stop()
    assert [(a.decision_id, a.state) for a in (await observer.ledger("n1")).allocations] == [
        ("t1.migrate.2", "reserved")]
    assert [(a.decision_id, a.state) for a in (await observer.ledger("n2")).allocations] == [
        ("t1.migrate.1", "confirmed")]


async def test_an_assign_redelivered_while_a_move_within_its_node_is_reserved_confirms_only_its_own_hold(
    observer, sim_fleet, nats_url, tmp_path
):
    """The policy reserved GPU 1 for t1's move within n1 while t1's assign came again: only
    the assign's hold is confirmed, the move's stays reserved (so it is given back if the move
    never comes, which the leftover round does for reserved holds only)."""
    await observer.kv_put("ledger", "n1", reserved("t1", "d1"))
    host = build(settings(nats_url, tmp_path))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(assign("d1", "t1")), headers={"Nats-Msg-Id": "a-1"})
        await observer.wait_stored("task.lifecycle.t1", TaskLifecycle, 1)
        n1 = await observer.ledger("n1")
        await observer.kv_put("ledger", "n1", encode(NodeLedger(node="n1", allocations=[
            *n1.allocations,
            Allocation(task_id="t1", decision_id="t1.migrate.1", gpu=1, milli=1000, memory_mb=1000)])))
        await observer.js.publish("decision.made", encode(assign("d1", "t1")), headers={"Nats-Msg-Id": "a-1-late"})
        await wait_for(lambda: sim_fleet.verbs("place"), what="placed")
        await asyncio.sleep(1.0)
    finally:
        await host.stop()
    assert [(a.decision_id, a.state) for a in (await observer.ledger("n1")).allocations] == [
        ("d1", "confirmed"), ("t1.migrate.1", "reserved")]
