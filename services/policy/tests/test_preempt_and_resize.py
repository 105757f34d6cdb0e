"""The policy and executor services together over a real nats-server: a vip task that fits
nowhere preempts exactly the cheapest best_effort work (never vip work, never standard work
unless the operator allows it and its contract spares it, never for a best_effort waiter), is
then assigned, and the evicted tasks come back under new
assign ids; a predicted OOM with room on its GPU becomes a ``resize`` (the ledger shows the
new memory), without room a ``migrate``."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest
from fleetpilot.contracts import (
    Allocation,
    Contract,
    DecisionMade,
    Fingerprint,
    NodeLedger,
    SimAck,
    SimEvent,
    TaskAdmitted,
    TaskFingerprinted,
    TaskSubmitted,
    TaskTelemetry,
    decode,
    encode,
    now,
)
from fleetpilot.policy.preempt import decode_pending
from fleetpilot.runtime.testing import eventually as wait_for_async
from fleetpilot_services.executor.service import ExecutorSettings
from fleetpilot_services.executor.service import build as build_executor
from fleetpilot_services.policy.service import build

from .conftest import admitted, fingerprinted, node, settings, wait_for


def running(task_id: str, gpu: int, milli: int, age_s: float, memory_mb: int = 1000) -> Allocation:
    """A confirmed hold of a task that has run for ``age_s``."""
    return Allocation(
        task_id=task_id,
        decision_id=f"{task_id}.assign",
        gpu=gpu,
        milli=milli,
        memory_mb=memory_mb,
        state="confirmed",
        at=now() - age_s,
    )


def contract_of(task_id: str, tier: str, milli: int, age_s: float, resumable: bool = False) -> TaskAdmitted:
    """What the sla service stores under ``contract.<task>``: by default a task that does not
    resume, whose eviction costs the work it has done (its age) plus a restart."""
    task = TaskSubmitted(task_id=task_id, kind="train", gpu_milli=milli, gpu_models=["H100"], resumable=resumable)
    return TaskAdmitted(task=task, contract=Contract(tier=tier), tenant="t", admitted_at=now() - age_s)


async def serve_sim_fleet(observer) -> object:
    """Answer ``sim.control`` as the collector's simulated fleet would."""

    async def answer(msg) -> None:
        await msg.respond(encode(SimAck(ok=True)))

    return await observer.nc.subscribe("sim.control", cb=answer)


def executor(nats_url: str, tmp_path) -> object:
    return build_executor(
        ExecutorSettings(
            nats_url=nats_url, metrics_port=-1, replica="x", state_dir=str(tmp_path / "executor")
        )
    )


@contextlib.asynccontextmanager
async def policy_and_executor(observer, nats_url: str, tmp_path, **overrides):
    """The policy (``bestfit``, with ``overrides``) and an executor running, and the
    simulated fleet answered, for the duration of the block."""
    sim = await serve_sim_fleet(observer)
    policy = build(settings(nats_url, tmp_path, profile="bestfit", **overrides))
    execu = executor(nats_url, tmp_path)
    await policy.start()
    await execu.start()
    try:
        yield
    finally:
        await execu.stop()
        await policy.stop()
        await sim.unsubscribe()


def tiered(task_id: str, tier: str, **fields) -> TaskAdmitted:
    adm = admitted(task_id, **fields)
    return msgspec.structs.replace(adm, contract=Contract(tier=tier))


async def test_a_vip_waiter_preempts_exactly_the_cheapest_best_effort_tasks_and_is_then_assigned(
    observer, nats_url, tmp_path
):
    await observer.put_fleet([node("n0"), node("n1")])
    holds = {
        # If standard work could be preempted, std1 (young) would be the cheapest victim.
        "n0": [running("std1", 0, 1000, age_s=1)],
        "n1": [
            running("vip0", 0, 1000, age_s=1),
            running("be3", 1, 600, age_s=5),
            running("be4", 1, 400, age_s=5),
        ],
    }
    holds["n0"].append(running("be2", 1, 1000, age_s=3600))  # best_effort, but an hour of work
    for name, allocs in holds.items():
        await observer.kv_put("ledger", name, encode(NodeLedger(node=name, allocations=allocs)))
    tiers = {"std1": ("standard", 1000), "vip0": ("vip", 1000), "be2": ("best_effort", 1000)}
    tiers |= {"be3": ("best_effort", 600), "be4": ("best_effort", 400)}
    for task_id, (tier, milli) in tiers.items():
        await observer.kv_put(
            "contracts", f"contract.{task_id}", encode(contract_of(task_id, tier, milli, 1000))
        )
    async with policy_and_executor(observer, nats_url, tmp_path, pending_retry_s=0.2):
        # Waiters that are not vip never preempt, however long they wait.
        await observer.admit(tiered("bewait", "best_effort", gpu_milli=1000, gpu_models=["H100"]))
        # stdwait needs two whole GPUs: evicting be2 would give it n0 once std1 is done.
        await observer.admit(tiered("stdwait", "standard", gpus=2, gpu_milli=1000, gpu_models=["H100"]))
        await wait_for(lambda: sum(d.action == "queue" for d in observer.decisions) == 2, what="queued")
        await asyncio.sleep(1.0)  # five retry rounds
        assert [d.action for d in observer.decisions] == ["queue", "queue"]

        await observer.admit(tiered("vip1", "vip", gpu_milli=1000, gpu_models=["H100"]))
        await wait_for(
            lambda: any(d.task_id == "vip1" and d.action == "assign" for d in observer.decisions),
            what="the vip task placed after the evictions",
        )

        async def vip_started():
            ledger = (await observer.ledgers())["n1"]
            return [(a.task_id, a.state) for a in ledger.allocations if a.gpu == 1] == [("vip1", "confirmed")]

        await wait_for_async(vip_started, what="the executor confirmed the vip's hold")
        # std1 finishes: its GPU goes to the waiters, the evicted best_effort tasks first
        # (they were admitted long before bewait) under their new assign ids.
        await observer.nc.publish(
            "sim.event.n0", encode(SimEvent(kind="finished", node="n0", gpu=0, task_id="std1", at=now()))
        )
        await wait_for(
            lambda: {"be3.assign.2", "be4.assign.2"} <= {d.decision_id for d in observer.decisions},
            what="evicted tasks placed again",
        )
        await asyncio.sleep(0.6)  # more rounds: nothing else is evicted
        ledgers = await observer.ledgers()
        waiting = sorted(await observer.live_keys("pending"))
    evictions = [d for d in observer.decisions if d.action == "evict"]
    assert sorted(d.decision_id for d in evictions) == ["be3.evict.1", "be4.evict.1"]
    for d in evictions:
        assert [(p.node, p.gpu) for p in d.source] == [("n1", 1)]
        assert d.placement == []
        assert "vip task vip1" in d.reason
        assert abs(d.confidence - 0.97**2) < 1e-9
        assert d.contract is not None and d.contract.tier == "best_effort"
    assert {d.source[0].milli for d in evictions} == {600, 400}
    vip = next(d for d in observer.decisions if d.task_id == "vip1" and d.action == "assign")
    assert [(p.node, p.gpu, p.milli) for p in vip.placement] == [("n1", 1, 1000)]
    # The evicted tasks came back (executor-confirmed) where std1 finished; bewait and
    # stdwait still wait, and nobody else was evicted.
    back = {a.task_id: (a.decision_id, a.state) for a in ledgers["n0"].allocations if a.gpu == 0}
    assert back == {"be3": ("be3.assign.2", "confirmed"), "be4": ("be4.assign.2", "confirmed")}
    assert waiting == ["bewait", "stdwait"]
    assert len(evictions) == 2
    assert {d.task_id for d in observer.decisions if d.action == "assign"} == {"vip1", "be3", "be4"}


async def test_a_vip_stops_an_old_run_that_resumes_rather_than_a_young_one_that_starts_over(
    observer, nats_url, tmp_path
):
    # n0's GPU 1 holds a best_effort run an hour old that resumes from its checkpoint; n1's a
    # best_effort run five minutes old that starts over. Evicting the first loses its restart
    # (60 s of a GPU), the second its five minutes and a restart: the old one gives way.
    await observer.put_fleet([node("n0"), node("n1")])
    holds = {"n0": [running("std0", 0, 1000, age_s=1), running("be_old", 1, 1000, age_s=3600)],
             "n1": [running("std1", 0, 1000, age_s=1), running("be_young", 1, 1000, age_s=300)]}
    for name, allocs in holds.items():
        await observer.kv_put("ledger", name, encode(NodeLedger(node=name, allocations=allocs)))
    contracts = [contract_of("std0", "standard", 1000, 1000), contract_of("std1", "standard", 1000, 1000),
                 contract_of("be_old", "best_effort", 1000, 4000, resumable=True),
                 contract_of("be_young", "best_effort", 1000, 1000)]
    for adm in contracts:
        await observer.kv_put("contracts", f"contract.{adm.task.task_id}", encode(adm))
    async with policy_and_executor(observer, nats_url, tmp_path, pending_retry_s=0.2):
        await observer.admit(tiered("vip1", "vip", gpu_milli=1000, gpu_models=["H100"]))
        await wait_for(lambda: any(d.action == "evict" for d in observer.decisions), what="an eviction")
        await asyncio.sleep(0.6)  # more rounds: no other eviction
        pending = await observer.js.key_value("pending")
        _, requeue = decode_pending((await pending.get("be_old")).value)
    assert [d.decision_id for d in observer.decisions if d.action == "evict"] == ["be_old.evict.1"]
    assert requeue is not None and requeue.progress_s >= 3600.0  # it goes on from its checkpoint


def standard_contract(task_id: str, age_s: float, deadline_in_s: float | None, resumable: bool = True
                      ) -> TaskAdmitted:
    """A running standard task of one GPU, declared to run an hour and started ``age_s`` ago,
    whose contract bounds its wait to 300 s and its end to ``deadline_in_s`` from now."""
    task = TaskSubmitted(task_id=task_id, kind="train", gpu_milli=1000, gpu_models=["H100"], resumable=resumable,
                         expected_duration_s=3600.0)
    deadline = now() + deadline_in_s if deadline_in_s is not None else None
    return TaskAdmitted(task=task, contract=Contract(tier="standard", max_queue_s=300.0, deadline=deadline),
                        tenant="t", admitted_at=now() - age_s)


@pytest.mark.parametrize("with_best_effort", [False, True])
async def test_a_vip_may_evict_standard_work_only_when_allowed_and_only_work_its_contract_spares(
    observer, nats_url, tmp_path, with_best_effort
):
    # Each one-GPU node runs a standard task with 50 minutes of its hour left. std_roomy's
    # deadline is 2 hours away: its pause and a whole 300-s wait fit. std_tight's is 53
    # minutes away, std_open has none, std_restarts would start over. Allowed, the vip evicts
    # std_roomy alone; with a best_effort task running it evicts that one instead, though it
    # loses its hour (best_effort work first).
    nodes = ["n0", "n1", "n2", "n3"] + (["n4"] if with_best_effort else [])
    await observer.put_fleet([node(n, gpus=1) for n in nodes])
    contracts = [standard_contract("std_roomy", 600, 7200), standard_contract("std_tight", 600, 53 * 60),
                 standard_contract("std_open", 600, None), standard_contract("std_restarts", 600, 7200, resumable=False)]
    if with_best_effort:
        contracts.append(contract_of("be_old", "best_effort", 1000, 3600))
    for name, adm in zip(nodes, contracts, strict=True):
        allocs = [running(adm.task.task_id, 0, 1000, age_s=3600 if adm.contract.tier == "best_effort" else 600)]
        await observer.kv_put("ledger", name, encode(NodeLedger(node=name, allocations=allocs)))
        await observer.kv_put("contracts", f"contract.{adm.task.task_id}", encode(adm))
    async with policy_and_executor(observer, nats_url, tmp_path, pending_retry_s=0.2, vip_evicts_standard=True):
        await observer.admit(tiered("vip1", "vip", gpu_milli=1000, gpu_models=["H100"]))
        await wait_for(lambda: any(d.action == "evict" for d in observer.decisions), what="an eviction")
        await asyncio.sleep(0.6)  # more rounds: no other eviction
    evicted = "be_old" if with_best_effort else "std_roomy"
    assert [d.decision_id for d in observer.decisions if d.action == "evict"] == [f"{evicted}.evict.1"]


async def test_by_default_a_vip_evicts_no_standard_work_even_where_its_contract_spares_it(
    observer, nats_url, tmp_path
):
    await observer.put_fleet([node("n0", gpus=1)])
    adm = standard_contract("std_roomy", 600, 7200)
    await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[running("std_roomy", 0, 1000, 600)])))
    await observer.kv_put("contracts", "contract.std_roomy", encode(adm))
    async with policy_and_executor(observer, nats_url, tmp_path, pending_retry_s=0.2):
        await observer.admit(tiered("vip1", "vip", gpu_milli=1000, gpu_models=["H100"]))
        await wait_for(lambda: any(d.task_id == "vip1" and d.action == "queue" for d in observer.decisions),
                       what="the vip queued")
        await asyncio.sleep(1.0)  # five retry rounds
    assert [d.action for d in observer.decisions] == ["queue"]


async def test_a_fingerprinted_vip_preempts_for_its_predicted_peak_not_its_ask(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0", gpus=1)])
    # The GPU has 400 milli and 20 GB free. Evicting be_small (young, 10 GB) is the cheapest
    # way to room for the vip's ask (500 milli, 10 GB), but not for the 40 GB its fingerprint
    # predicts (42 GB held): only evicting be_big (50 GB, older) makes room for that.
    allocs = [running("be_small", 0, 300, age_s=1, memory_mb=10_000),
              running("be_big", 0, 300, age_s=100, memory_mb=51_920)]
    await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=allocs)))
    for task_id in ("be_small", "be_big"):
        await observer.kv_put("contracts", f"contract.{task_id}",
                              encode(contract_of(task_id, "best_effort", 300, 1000)))
    async with policy_and_executor(observer, nats_url, tmp_path, pending_retry_s=0.2):
        flat = msgspec.structs.replace(fingerprint(40_000), pattern="flat")  # no bridge on its ask
        await fingerprinted(observer, {"vip1": flat})
        await observer.admit(tiered("vip1", "vip", gpu_milli=500, gpu_memory_mb=10_000, gpu_models=["H100"]))
        await wait_for(lambda: any(d.task_id == "vip1" and d.action == "assign" for d in observer.decisions),
                       what="the vip task placed after the eviction")
    assert [d.decision_id for d in observer.decisions if d.action == "evict"] == ["be_big.evict.1"]
    vip = next(d for d in observer.decisions if d.task_id == "vip1" and d.action == "assign")
    assert [(p.node, p.gpu, p.milli, p.memory_mb) for p in vip.placement] == [("n0", 0, 500, 42_000)]


async def two_nodes_each_running_a_best_effort_task(observer) -> None:
    """n0 runs be1 (5 s old, resuming from its checkpoint: the cheaper victim) and n1 runs be2
    (50 s old, starting over), each on its one GPU."""
    await observer.put_fleet([node("n0", gpus=1), node("n1", gpus=1)])
    await observer.kv_put(
        "ledger", "n0", encode(NodeLedger(node="n0", allocations=[running("be1", 0, 1000, 5)]))
    )
    await observer.kv_put(
        "ledger", "n1", encode(NodeLedger(node="n1", allocations=[running("be2", 0, 1000, 50)]))
    )
    for task_id, resumable in (("be1", True), ("be2", False)):
        await observer.kv_put(
            "contracts", f"contract.{task_id}", encode(contract_of(task_id, "best_effort", 1000, 9, resumable))
        )


async def test_a_preempting_vip_waits_for_the_evictions_and_requeued_tasks_wait_for_their_release(
    observer, nats_url, tmp_path
):
    """Without an executor nothing is released: the vip preempts once, the victims' pending
    entries carry their re-placement ids and stay unplaced, and no second round evicts more."""
    await two_nodes_each_running_a_best_effort_task(observer)
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.1))
    await policy.start()
    try:
        # be1 holds 30 GB when it is stopped: restored, it comes back on that.
        sample = TaskTelemetry(task_id="be1", node="n0", gpus=[0], at=now(), memory_used_mb=30_000.0)
        await observer.nc.publish("telemetry.task.be1", encode(sample))
        await observer.nc.flush()
        await asyncio.sleep(0.2)
        await observer.admit(tiered("vip1", "vip", gpu_milli=1000))
        await wait_for(lambda: any(d.action == "evict" for d in observer.decisions), what="an eviction")
        await asyncio.sleep(1.0)  # ten rounds
        pending = await observer.js.key_value("pending")
        entry = await pending.get("be1")
        adm, requeue = decode_pending(entry.value)
    finally:
        await policy.stop()
    assert [(d.decision_id, d.action) for d in observer.decisions] == [
        ("vip1.queue", "queue"),
        ("be1.evict.1", "evict"),
    ]
    assert adm.task.task_id == "be1" and adm.contract.tier == "best_effort"
    assert (requeue.decision_id, requeue.evict_id, requeue.for_task) == (
        "be1.assign.2",
        "be1.evict.1",
        "vip1",
    )
    assert requeue.bridge_floor_mb == 30_000  # a bridge for it asks no less than it held
    assert 5.0 <= requeue.progress_s < 8.0  # it resumes: the 5 s it had run count (0 before)


async def test_two_waiting_vips_preempt_different_tasks_and_each_eviction_goes_out_once(
    observer, nats_url, tmp_path
):
    """Without an executor nothing is released. One best_effort task frees room for one vip:
    the second vip must choose another victim, not the first's again, and a victim already
    leaving is not evicted anew in later rounds (each re-publication was a second evict on
    ``decision.made`` for every watcher, and overwrote which vip the room was freed for)."""
    await two_nodes_each_running_a_best_effort_task(observer)
    published: list[str] = []  # every publication, as a core subscriber (`fleetpilot watch`) sees it

    async def on_decision(msg) -> None:
        published.append(decode(msg.data, DecisionMade).decision_id)

    heard = await observer.nc.subscribe("decision.made", cb=on_decision)
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.1))
    await policy.start()
    try:
        await observer.admit(tiered("vip1", "vip", gpu_milli=1000))
        await observer.admit(tiered("vip2", "vip", gpu_milli=1000))
        await wait_for(lambda: sum(d.action == "evict" for d in observer.decisions) == 2, what="two evictions")
        await asyncio.sleep(1.0)  # ten rounds
        pending = await observer.js.key_value("pending")
        freed_for = {victim: decode_pending((await pending.get(victim)).value)[1].for_task
                     for victim in ("be1", "be2")}
    finally:
        await policy.stop()
        await heard.unsubscribe()
    assert sorted(d.decision_id for d in observer.decisions if d.action == "evict") == ["be1.evict.1", "be2.evict.1"]
    assert sorted(freed_for.values()) == ["vip1", "vip2"]
    assert sorted(i for i in published if ".evict." in i) == ["be1.evict.1", "be2.evict.1"]


def fingerprint(peak_mb: float) -> Fingerprint:
    return Fingerprint(
        signature="s",
        pattern="linear",
        pattern_confidence=0.9,
        growth_rate_mb_per_s=10.0,
        predicted_peak_mb=peak_mb,
        peak_low_mb=peak_mb - 500,
        peak_high_mb=peak_mb + 500,
    )


async def test_a_predicted_oom_with_room_is_resized_and_without_room_migrated(observer, nats_url, tmp_path):
    a100 = dict(model="A100-40GB", memory_mb=40960)
    await observer.put_fleet([node("a0", gpus=2, **a100), node("a1", gpus=1, **a100)])
    # r1 and m1 both hold 5 GB and will peak at 20 GB (90% up to 20.5 GB). Beside r1 the GPU
    # has 25 GB free: room for the extra; beside m1 only 6 GB: it has to move.
    await observer.kv_put(
        "ledger",
        "a0",
        encode(
            NodeLedger(
                node="a0", allocations=[running("r1", 0, 300, 5, 5000), running("small", 0, 700, 5, 10000)]
            )
        ),
    )
    await observer.kv_put(
        "ledger",
        "a1",
        encode(
            NodeLedger(
                node="a1", allocations=[running("m1", 0, 300, 5, 5000), running("big", 0, 500, 5, 30000)]
            )
        ),
    )
    for task_id in ("r1", "m1"):
        await observer.js.publish(
            "task.fingerprinted",
            encode(
                TaskFingerprinted(
                    task_id=task_id, fingerprint=fingerprint(20000), source="observed", at=now()
                )
            ),
        )
    async with policy_and_executor(observer, nats_url, tmp_path, rebalance_s=0.3):

        async def settled() -> bool:
            ledgers = await observer.ledgers()
            return all(
                a.state == "confirmed" for ledger in ledgers.values() for a in ledger.allocations
            ) and any(d.action == "migrate" for d in observer.decisions)

        await wait_for(
            lambda: sum(d.action in ("resize", "migrate") for d in observer.decisions) >= 2, what="rebalance"
        )
        for _ in range(100):
            if await settled():
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # three more rounds: nothing is resized or moved again
        ledgers = await observer.ledgers()
    by_task = observer.by_task()
    assert [d.action for d in by_task["r1"]] == ["resize"]
    assert [d.action for d in by_task["m1"]] == ["migrate"]
    assert "small" not in by_task and "big" not in by_task
    resize = by_task["r1"][0]
    assert resize.decision_id == "r1.resize.21012"  # peak_high 20500 + the 512 MB margin
    assert [(p.node, p.gpu, p.milli, p.memory_mb) for p in resize.placement] == [("a0", 0, 300, 21012)]
    assert [(p.node, p.gpu, p.memory_mb) for p in resize.source] == [("a0", 0, 5000)]
    assert resize.confidence > 0.99 and "room" in resize.reason
    # The executor folded the reserved extra into r1's hold: one hold, the new size.
    r1 = [a for a in ledgers["a0"].allocations if a.task_id == "r1"]
    assert [(a.gpu, a.memory_mb, a.state, a.decision_id) for a in r1] == [
        (0, 21012, "confirmed", "r1.assign")
    ]
    move = by_task["m1"][0]
    assert move.decision_id == "m1.migrate.1"
    assert [(p.node, p.gpu) for p in move.placement] == [("a0", 1)]
    assert [a.task_id for a in ledgers["a1"].allocations] == ["big"]
