"""Tasks the executor evicts on its own (its GPU was decommissioned, its node went silent)
are queued again by the policy and placed elsewhere under the next ``<task>.assign.<g>``,
exactly once however often the ``evicted`` event is delivered (an OOM-killed task is
started over the same way: ``test_oom_restarts``). Real nats-server."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
from fleetpilot.contracts import (
    ActionExecuted,
    Allocation,
    GpuSample,
    NodeLedger,
    NodeTelemetry,
    Placement,
    PolicyRef,
    SimAck,
    SimEvent,
    TaskLifecycle,
    TaskTelemetry,
    encode,
    now,
)
from fleetpilot.fingerprint import SignatureStats, task_signature
from fleetpilot.maintenance.faults import gpu_reading
from fleetpilot.policy.preempt import decode_pending
from fleetpilot.runtime.testing import eventually as wait_for_async
from fleetpilot_services.executor.service import ExecutorSettings
from fleetpilot_services.executor.service import build as build_executor
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


def hot_sample(node_name: str, gpu: int, at: float, temperature_c: float) -> GpuSample:
    return gpu_reading(node_name, gpu, at, temperature_c=temperature_c)


def executed(decision_id: str, at: float) -> ActionExecuted:
    """The executor's journal entry of a decision it carried out at ``at``."""
    return ActionExecuted(
        action_id=f"executed:{decision_id}",
        decision_id=decision_id,
        task_id=decision_id.split(".")[0],
        action="assign",
        backend="sim",
        latency_ms=1.0,
        policy=PolicyRef(name="bestfit"),
        executed_at=at,
    )


async def publish_lifecycle(observer, life: TaskLifecycle, copy: int) -> None:
    """Publish ``life`` as the executor does; each ``copy`` gets its own message id, so the
    stream keeps it and the policy's consumer gets it again, as after a redelivery."""
    await observer.js.publish(
        f"task.lifecycle.{life.task_id}",
        encode(life),
        headers={"Nats-Msg-Id": f"life:{life.task_id}:{life.state}:{life.at}:{copy}"},
    )


@contextlib.asynccontextmanager
async def loop_on_simulated_fleet(observer, nats_url, tmp_path, task_id: str, policy_settings: dict | None = None,
                                  **executor_settings):
    """The policy (bestfit, retry rounds of 0.2 s, and ``policy_settings``) and an executor
    over a stand-in for the collector's simulated fleet that acknowledges every command;
    yields the lifecycle events of ``task_id`` as they arrive."""

    async def answer(msg) -> None:
        await msg.respond(encode(SimAck(ok=True)))

    sim = await observer.nc.subscribe("sim.control", cb=answer)
    events: list[TaskLifecycle] = []

    async def on_life(msg) -> None:
        events.append(msgspec.json.decode(msg.data, type=TaskLifecycle))

    lives = await observer.nc.subscribe(f"task.lifecycle.{task_id}", cb=on_life)
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2, **(policy_settings or {})))
    execu = build_executor(ExecutorSettings(nats_url=nats_url, metrics_port=-1, replica="x",
                                            state_dir=str(tmp_path / "ex"), **executor_settings))
    await policy.start()
    await execu.start()
    try:
        yield events
    finally:
        await execu.stop()
        await policy.stop()
        await lives.unsubscribe()
        await sim.unsubscribe()


async def test_a_task_evicted_by_a_gpu_decommission_is_placed_again_once(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0", gpus=2)])
    adm = admitted("t1", gpu_milli=600, gpu_memory_mb=1000, gpu_models=["H100"])
    await observer.kv_put("contracts", "contract.t1", encode(adm))

    async with loop_on_simulated_fleet(observer, nats_url, tmp_path, "t1") as events:
        await observer.admit(adm)
        await wait_for(lambda: any(e.state == "started" for e in events), what="t1 started")
        first = next(d for d in observer.decisions if d.task_id == "t1")
        hot = first.placement[0].gpu

        # The GPU runs hot: cordoned after 5 minutes, decommissioned (t1 evicted) when the
        # 30-minute drain is over with t1 still on it. Sample times drive the hook.
        t0 = 1_000_000.0
        for at in (t0, t0 + 300, t0 + 2100):
            batch = NodeTelemetry(node="n0", at=at, source="sim", gpus=[hot_sample("n0", hot, at, 95.0)])
            await observer.nc.publish("telemetry.gpu.n0", encode(batch))
            await observer.nc.flush()
            await asyncio.sleep(0.2)
        await wait_for(lambda: any(e.state == "evicted" for e in events), what="t1 evicted")
        evicted = next(e for e in events if e.state == "evicted")
        await wait_for(
            lambda: any(d.decision_id == "t1.assign.2" for d in observer.decisions), what="t1 placed again"
        )

        async def confirmed_again() -> bool:
            holds = [a for ledger in (await observer.ledgers()).values() for a in ledger.allocations]
            return [(a.task_id, a.decision_id, a.state) for a in holds] == [
                ("t1", "t1.assign.2", "confirmed")
            ]

        await wait_for_async(confirmed_again, what="the executor started t1 again")
        # The same eviction delivered again while t1 runs again, and once more after it has
        # finished (no hold left, but the journal knows t1.assign.2): nothing changes.
        await publish_lifecycle(observer, evicted, 1)
        await asyncio.sleep(0.6)
        await observer.nc.publish(
            "sim.event.n0",
            encode(SimEvent(kind="finished", node="n0", gpu=1 - hot, task_id="t1", at=now())),
        )

        async def released() -> bool:
            return not any(ledger.allocations for ledger in (await observer.ledgers()).values())

        await wait_for_async(released, what="t1 finished")
        await publish_lifecycle(observer, evicted, 2)
        await asyncio.sleep(1.0)  # five retry rounds
        waiting = await observer.live_keys("pending")
        ledgers = await observer.ledgers()
    assert "decommissioned" in evicted.detail and evicted.gpus == [hot]
    again = [d for d in observer.decisions if d.task_id == "t1"]
    assert [(d.decision_id, d.action) for d in again] == [("t1.assign", "assign"), ("t1.assign.2", "assign")]
    assert [(p.node, p.gpu) for p in again[1].placement] == [("n0", 1 - hot)]
    assert again[1].contract == adm.contract and again[1].task == adm.task
    assert not any(ledger.allocations for ledger in ledgers.values())
    assert waiting == []
    assert [e.state for e in events if e.state != "evicted"] == ["started", "started", "finished"]


async def test_redelivered_evictions_on_two_replicas_queue_the_task_once_and_an_oom_past_its_restarts_is_not(
    observer, nats_url, tmp_path
):
    """Neither replica placed t2 or t5: their admissions come from ``contract.<task>``. The
    executor's journal shows both ran as ``<task>.assign.2`` before the eviction, which names
    no decision for t2 (the evicting replica did not carry its placement out) and an older
    one for t5 (that replica's memory of it); both come back as ``<task>.assign.3``."""
    dead = {"cordoned": "true", "decommissioned": "true"}
    await observer.put_fleet([node("n0", gpus=3, labels={0: dead})])
    for task_id in ("t2", "t3", "t4", "t5"):
        adm = admitted(task_id, gpu_milli=500, gpu_models=["H100"])
        await observer.kv_put("contracts", f"contract.{task_id}", encode(adm))
    for t in ("t2", "t5"):
        for decision_id, at in ((f"{t}.assign", now() - 600), (f"{t}.assign.2", now() - 60)):
            await observer.kv_put("executions", decision_id, encode(executed(decision_id, at)))
    # t4 still holds capacity: it was evicted, but it has been placed again already.
    await observer.kv_put(
        "ledger",
        "n0",
        encode(
            NodeLedger(
                node="n0",
                allocations=[
                    Allocation(task_id="t4", decision_id="t4.assign.2", gpu=1, milli=500, state="confirmed")
                ],
            )
        ),
    )
    hosts = [
        build(settings(nats_url, tmp_path, replica=r, profile="bestfit", pending_retry_s=0.2, oom_restarts=0))
        for r in "ab"
    ]
    for host in hosts:
        await host.start()
    try:
        at = now()
        evicted = {
            t: TaskLifecycle(
                task_id=t, state="evicted", node="n0", gpus=[0], detail="GPU n0/0 decommissioned: 95 C", at=at
            )
            for t in ("t2", "t4", "t5")
        }
        evicted["t5"] = msgspec.structs.replace(evicted["t5"], decision_id="t5.assign")
        oom = TaskLifecycle(task_id="t3", state="oom_killed", node="n0", gpus=[0], exit_code=137, at=at)
        await asyncio.gather(
            *(publish_lifecycle(observer, evicted["t2"], copy) for copy in range(4)),
            publish_lifecycle(observer, evicted["t4"], 0),
            publish_lifecycle(observer, evicted["t5"], 0),
            publish_lifecycle(observer, evicted["t5"], 1),
            publish_lifecycle(observer, oom, 0),
        )
        await wait_for(
            lambda: {"t2.assign.3", "t5.assign.3"} <= {d.decision_id for d in observer.decisions},
            what="t2 and t5 placed again",
        )
        await publish_lifecycle(observer, evicted["t2"], 9)  # after the placement
        await publish_lifecycle(observer, evicted["t5"], 9)
        await asyncio.sleep(1.0)
        waiting = await observer.live_keys("pending")
    finally:
        for host in hosts:
            await host.stop()
    assert sorted((d.decision_id, d.action) for d in observer.decisions) == [
        ("t2.assign.3", "assign"),
        ("t5.assign.3", "assign"),
    ]
    placed = [(p.node, p.gpu, p.milli) for d in observer.decisions for p in d.placement]
    assert len(placed) == 2 and all(gpu in (1, 2) and milli == 500 for _, gpu, milli in placed)  # not GPU 0
    assert waiting == []


async def test_a_task_on_a_node_gone_silent_is_placed_again_elsewhere(observer, nats_url, tmp_path):
    # The whole loop: the topology service labels the node of t1 unreachable (its collector
    # went silent), the executor gives t1 up, and the policy places it on the other node.
    await observer.put_fleet([node("n0", gpus=1), node("n1", gpus=1)])
    adm = admitted("t1", gpu_milli=1000, gpu_memory_mb=1000)
    await observer.kv_put("contracts", "contract.t1", encode(adm))

    async with loop_on_simulated_fleet(observer, nats_url, tmp_path, "t1", silent_check_s=0.2) as events:
        await observer.admit(adm)
        await wait_for(lambda: any(e.state == "started" for e in events), what="t1 started")
        first = next(d for d in observer.decisions if d.task_id == "t1").placement[0].node
        other = "n1" if first == "n0" else "n0"
        await observer.put_fleet([node(first, gpus=1, labels={0: {"unreachable": "true"}})])
        await wait_for(lambda: any(d.decision_id == "t1.assign.2" for d in observer.decisions),
                       what="t1 placed again")
        await wait_for(lambda: [e.state for e in events] == ["started", "evicted", "started"], what="t1 again")

        async def only_the_new_hold() -> bool:
            holds = [(n, a.decision_id, a.state) for n, ledger in (await observer.ledgers()).items()
                     for a in ledger.allocations]
            return holds == [(other, "t1.assign.2", "confirmed")]

        await wait_for_async(only_the_new_hold, what="t1's hold on the silent node released")
    evicted = events[1]
    assert evicted.node == first and "unreachable" in evicted.detail and evicted.decision_id == "t1.assign"
    again = next(d for d in observer.decisions if d.decision_id == "t1.assign.2")
    assert again.placement[0].node == other


async def test_a_task_evicted_by_the_executor_is_bridged_again_on_no_less_than_it_held(
    observer, nats_url, tmp_path
):
    """Restored from its checkpoint, a task comes back holding what it held when stopped (a
    step schedule does), unless its signature's restores have mostly started over (the
    fingerprinter's count): its requeue note's floor says which. The only GPU left is
    cordoned, so both wait in ``pending``, where the notes are read."""
    await observer.put_fleet([node("n0", gpus=1, labels={0: {"cordoned": "true"}})])
    steps = admitted("steps", gpu_milli=1000, gpu_memory_mb=20_000, gpu_models=["H100"])
    leak = admitted("leak", gpu_milli=1000, gpu_memory_mb=20_000, gpu_models=["H100"], image="leak:1")
    signature = task_signature(leak.task)
    await observer.kv_put("fingerprints", signature, encode(SignatureStats(signature=signature, restores_reset=3)))
    for adm in (steps, leak):
        await observer.kv_put("contracts", f"contract.{adm.task.task_id}", encode(adm))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        at = now()
        for task_id in ("steps", "leak"):
            for k, used_mb in enumerate((18_000.0, 24_000.0, 30_000.0)):
                sample = TaskTelemetry(task_id=task_id, node="n0", gpus=[0], at=at - 60 + 30 * k,
                                       memory_used_mb=used_mb)
                await observer.nc.publish(f"telemetry.task.{task_id}", encode(sample))
        await observer.nc.flush()
        await asyncio.sleep(0.3)
        for task_id in ("steps", "leak"):
            life = TaskLifecycle(task_id=task_id, state="evicted", node="n0", gpus=[0],
                                 detail="GPU n0/0 decommissioned: 95 C", at=at)
            await publish_lifecycle(observer, life, 0)
        pending = await observer.js.key_value("pending")

        async def both_queued():
            if sorted(await observer.live_keys("pending")) != ["leak", "steps"]:
                return None
            return [await pending.get(t) for t in ("steps", "leak")]

        entries = await wait_for_async(both_queued, what="both queued again")
    finally:
        await policy.stop()
    floors = {t: decode_pending(e.value)[1].bridge_floor_mb for t, e in zip(("steps", "leak"), entries, strict=True)}
    assert floors == {"steps": 30_000, "leak": 0}


async def test_a_move_reserved_on_two_nodes_gives_back_the_hold_the_executor_did_not_take(
    observer, nats_url, tmp_path
):
    # Two replicas' overlapping rounds reserved t1's move on n2 and on n3; the stream kept one
    # decision, and the executor carried it out on n2. The hold on n3 was held by nobody.
    await observer.put_fleet([node("n1"), node("n2"), node("n3")])
    long_ago = now() - 600

    def hold(node_name: str, decision_id: str, state: str) -> bytes:
        return encode(NodeLedger(node=node_name, allocations=[Allocation(
            task_id="t1", decision_id=decision_id, gpu=0, milli=1000, memory_mb=1000, state=state, at=long_ago)]))

    await observer.kv_put("ledger", "n1", hold("n1", "t1.assign", "confirmed"))
    await observer.kv_put("ledger", "n2", hold("n2", "t1.migrate.1", "reserved"))
    await observer.kv_put("ledger", "n3", hold("n3", "t1.migrate.1", "reserved"))
    moved = msgspec.structs.replace(executed("t1.migrate.1", long_ago + 5), action="migrate", placement=[
        Placement(node="n2", gpu=0, milli=1000, memory_mb=1000)])
    await observer.kv_put("executions", "t1.migrate.1", encode(moved))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", rebalance_s=0.2))
    await policy.start()
    try:
        async def n3_given_back() -> bool:
            return not (await observer.ledgers())["n3"].allocations

        await wait_for_async(n3_given_back, what="the hold on n3 given back")
        ledgers = await observer.ledgers()
    finally:
        await policy.stop()
    assert [(a.decision_id, a.state) for a in ledgers["n2"].allocations] == [("t1.migrate.1", "reserved")]
    assert [(a.decision_id, a.state) for a in ledgers["n1"].allocations] == [("t1.assign", "confirmed")]
