"""EASY backfill in the policy service over a real nats-server: a blocked 2-GPU task gets a
reservation on the node whose GPUs free first (by the running tasks' declared durations); a
task expected to outlast that release is kept off the reserved GPU, a short one uses it, and
so is a migration. Waiters of one tier are decided by expected completion, and the first of
them that found no place owns the reservation; a rebalance round
clears a node for a blocked 4-GPU task when its tenants cost less to move than its wait."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from fleetpilot.contracts import Allocation, Contract, NodeLedger, TaskAdmitted, TaskSubmitted, encode, now
from fleetpilot.policy.backfill import Reservation
from fleetpilot_services.policy.admissions import Admissions
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, policy_state, settings, wait_for


def tenant(task_id: str, gpus: list[int], started_s_ago: float, declared_s: float, milli: int = 1000,
           memory_mb: int = 1000) -> tuple[list[Allocation], TaskAdmitted]:
    """Confirmed holds of ``milli`` and ``memory_mb`` on each of ``gpus``, and the contract of
    the task that holds them."""
    at = now() - started_s_ago
    holds = [Allocation(task_id=task_id, decision_id=f"{task_id}.assign", gpu=g, milli=milli, memory_mb=memory_mb,
                        state="confirmed", at=at) for g in gpus]
    task = TaskSubmitted(task_id=task_id, kind="train", gpus=len(gpus), gpu_milli=milli, expected_duration_s=declared_s)
    return holds, TaskAdmitted(task=task, contract=Contract(), tenant="t", admitted_at=at)


async def seed(observer, tenants: dict[str, list[tuple[list[Allocation], TaskAdmitted]]]) -> None:
    """Each node's ledger and the contracts of the tasks that hold capacity there."""
    for name, pairs in tenants.items():
        await observer.kv_put("ledger", name, encode(NodeLedger(node=name, allocations=[h for hs, _ in pairs for h in hs])))
        for _, adm in pairs:
            await observer.kv_put("contracts", f"contract.{adm.task.task_id}", encode(adm))


def whole(task_id: str, gpus: int, declared_s: float | None, gpu_milli: int = 1000, **fields) -> TaskAdmitted:
    adm = admitted(task_id, gpus=gpus, gpu_milli=gpu_milli, **fields)
    return msgspec.structs.replace(adm, task=msgspec.structs.replace(adm.task, expected_duration_s=declared_s))


async def test_a_blocked_wide_task_keeps_its_gpus_from_long_tasks_but_not_from_short_ones(
    observer, nats_url, tmp_path
):
    await observer.put_fleet([node("n0"), node("n1")])
    # n0 frees in ~20 min (b); n1's GPU 0 in ~1 min (c) and its GPU 1 is idle: the 2-GPU
    # task's earliest start is on n1, in about a minute.
    await seed(observer, {"n0": [tenant("a", [0], 100, 400), tenant("b", [1], 100, 1300)],
                          "n1": [tenant("c", [0], 540, 600)]})
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        await observer.admit(whole("wide", 2, 3600))
        await wait_for(lambda: any(d.task_id == "wide" for d in observer.decisions), what="wide queued")
        await asyncio.sleep(0.6)  # retry rounds: the reservation is made
        await observer.admit(whole("long", 1, 3600))  # would take n1's idle GPU for an hour
        await observer.admit(whole("undeclared", 1, None))  # no duration: assumed long
        await observer.admit(whole("short", 1, 30))  # done before c: may use it meanwhile
        await wait_for(lambda: len(observer.by_task()) == 4, what="a decision for every task")
        await asyncio.sleep(0.6)
    finally:
        await policy.stop()
    first = {task: ds[0] for task, ds in observer.by_task().items()}
    assert first["wide"].action == "queue"
    assert first["long"].action == "queue" and first["undeclared"].action == "queue"
    assert first["short"].action == "assign"
    assert [(p.node, p.gpu) for p in first["short"].placement] == [("n1", 1)]
    # Nothing but the short task was placed while the reservation stands.
    assert [d.task_id for d in observer.decisions if d.action == "assign"] == ["short"]


async def test_a_round_skips_waiters_that_need_no_less_than_one_that_found_no_node(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0", gpus=1)])
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.1, record_every=1))
    await policy.start()
    try:
        await observer.admit(whole("blocker", 1, 3600))
        await wait_for(lambda: len(observer.decisions) == 1, what="the blocker placed")
        waiters = [f"w{i}" for i in range(8)]
        for task_id in waiters:
            await observer.admit(whole(task_id, 1, 600))
        await wait_for(lambda: len(observer.decisions) == 1 + len(waiters), what="the waiters queued")
        await asyncio.sleep(1.0)  # several retry rounds
    finally:
        await policy.stop()
    tried = [json.loads(line)["task"]["task_id"] for line in (tmp_path / "policy-states.jsonl").read_text().splitlines()]
    # Each round tries the oldest waiter; the others need no less, so they are not tried
    # again after their admission.
    assert tried.count("w0") >= 3
    assert all(tried.count(t) == 1 for t in waiters[1:]), {t: tried.count(t) for t in waiters}


async def test_waiters_of_one_tier_are_decided_by_expected_completion(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0", gpus=1)])
    # A share held by a task the replica cannot name: it never ends, so no reservation (and
    # shares get none anyway); the two waiters differ only in arrival and declared run.
    blocker = Allocation(task_id="blocker", decision_id="blocker.assign", gpu=0, milli=600, memory_mb=1000,
                         state="confirmed", at=now())
    await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0", allocations=[blocker])))
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.1))
    await policy.start()
    try:
        await observer.admit(whole("long", 1, 7200, gpu_milli=600))
        await wait_for(lambda: len(observer.decisions) == 1, what="the long task queued")
        await observer.admit(whole("short", 1, 60, gpu_milli=600))  # later, but ends far sooner
        await wait_for(lambda: len(observer.decisions) == 2, what="the short task queued")
        await asyncio.sleep(0.3)
        await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0")))  # room for one of them
        await wait_for(lambda: any(d.action == "assign" for d in observer.decisions), what="an assign")
        await asyncio.sleep(0.5)  # more rounds: the other one still does not fit
    finally:
        await policy.stop()
    assert [d.action for d in observer.decisions[:2]] == ["queue", "queue"]
    assert [(d.task_id, d.placement[0].gpu) for d in observer.decisions if d.action == "assign"] == [("short", 0)]


async def test_the_reservation_goes_to_the_first_waiter_in_the_queue_not_the_first_admitted(
    observer, nats_url, tmp_path
):
    # One GPU, held by c for about another minute. long (two hours) is admitted before short
    # (five minutes); short is first in the queue, so it owns the reservation and gets the
    # GPU when c is gone. Owned by long, it would have kept short off the GPU.
    await observer.put_fleet([node("n0", gpus=1)])
    await seed(observer, {"n0": [tenant("c", [0], 540, 600)]})
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.1))
    await policy.start()
    try:
        await observer.admit(whole("long", 1, 7200))
        await wait_for(lambda: len(observer.decisions) == 1, what="long queued")
        await observer.admit(whole("short", 1, 300))
        await wait_for(lambda: len(observer.decisions) == 2, what="short queued")
        await asyncio.sleep(0.4)  # retry rounds: the reservation is made
        await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0")))  # c is gone
        await wait_for(lambda: any(d.action == "assign" for d in observer.decisions), what="an assign")
        await asyncio.sleep(0.4)  # more rounds: the GPU is taken
    finally:
        await policy.stop()
    assert [d.action for d in observer.decisions[:2]] == ["queue", "queue"]
    assert [d.task_id for d in observer.decisions if d.action == "assign"] == ["short"]


async def test_a_migration_does_not_land_on_gpus_reserved_for_a_waiting_task(observer, nats_url, tmp_path):
    # The 2-GPU task reserves n0 (its GPU 1 is idle, GPU 0 frees in ~20 s); n2's GPUs are
    # too small for it. m must leave h0's GPU 0 and runs for another hour: bestfit would pack
    # it onto n0's idle GPU, the reserved one, and must take n2 instead.
    fleet = [node("n0"), node("h0"), node("n2", gpus=4, memory_mb=40960)]
    await observer.put_fleet(fleet)
    await seed(observer, {"n0": [tenant("c", [0], 580, 600, memory_mb=30000)],
                          "h0": [tenant("m", [0], 100, 3600), tenant("b", [1], 100, 7200)]})
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.1, rebalance_s=0.2))
    await policy.start()
    try:
        await observer.admit(whole("wide", 2, 3600, gpu_memory_mb=60000))
        await wait_for(lambda: any(d.task_id == "wide" for d in observer.decisions), what="wide queued")
        await asyncio.sleep(0.5)  # retry rounds: the reservation is made
        # Only now does m have to move, so the rebalancer runs with the reservation in force.
        await observer.put_fleet([node("h0", labels={0: {"maintenance_pending": "true"}})])
        await wait_for(lambda: any(d.action == "migrate" for d in observer.decisions), what="m migrated")
        await asyncio.sleep(0.5)
    finally:
        await policy.stop()
    moves = [d for d in observer.decisions if d.action == "migrate"]
    assert [d.task_id for d in moves] == ["m"]
    assert [(p.node, p.gpu) for p in moves[0].source] == [("h0", 0)]
    assert moves[0].placement[0].node == "n2", moves[0].placement
    assert not any(d.action == "assign" for d in observer.decisions)  # wide still waits for n0


async def test_a_rebalance_round_clears_a_node_for_a_blocked_wide_task(observer, nats_url, tmp_path):
    # n0 is held by four small shares that will run two more hours, n1 by one 4-GPU task
    # with 80 minutes to go, so the 4-GPU task waits 80 minutes for n1 (its reservation).
    # Moving the shares to n2 (two GPUs, too small for it) costs four checkpoints of 2 GB:
    # ~10 GPU-s each, against 80 minutes of four GPUs. n1's task would cost ~430 GPU-s.
    fleet = [node("n0", gpus=4), node("n1", gpus=4), node("n2", gpus=2, memory_mb=40960)]
    await observer.put_fleet(fleet)
    small = [f"s{i}" for i in range(4)]
    await seed(observer, {"n0": [tenant(s, [i], 100, 7200, milli=300, memory_mb=2000) for i, s in enumerate(small)],
                          "n1": [tenant("big", [0, 1, 2, 3], 100, 5000, memory_mb=40000)]})
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.1, rebalance_s=0.2))
    await policy.start()
    try:
        await observer.admit(whole("wide", 4, 3600, gpu_memory_mb=60000))
        await wait_for(lambda: any(d.task_id == "wide" for d in observer.decisions), what="wide queued")
        # Admitted after wide and expected to end after it: wide is first in the queue and
        # owns the reservation; filler would take a GPU of n0 as soon as one frees, were it
        # not reserved for wide.
        await observer.admit(whole("filler", 1, 7200, gpu_memory_mb=60000))
        await wait_for(lambda: sum(d.action == "migrate" for d in observer.decisions) == 4, what="the clearing")
        await asyncio.sleep(0.5)  # more rounds: no second clearing, nothing placed yet
        moves = [d for d in observer.decisions if d.action == "migrate"]
        assert not any(d.action == "assign" for d in observer.decisions)
        # The executor moves the shares: their targets confirmed, n0's holds released.
        ledgers = await observer.ledgers()
        moved = [msgspec.structs.replace(a, state="confirmed") for a in ledgers["n2"].allocations]
        await observer.kv_put("ledger", "n2", encode(NodeLedger(node="n2", allocations=moved)))
        await observer.kv_put("ledger", "n0", encode(NodeLedger(node="n0")))
        await wait_for(lambda: any(d.action == "assign" for d in observer.decisions), what="wide placed")
        await asyncio.sleep(0.5)
    finally:
        await policy.stop()
    assert sorted(d.task_id for d in moves) == small
    for d in moves:
        assert [p.node for p in d.source] == ["n0"]
        assert {p.node for p in d.placement} == {"n2"}, d.placement
        assert d.reason.startswith("clearing n0 for wide"), d.reason
        # The policy's confidence in the target (the same for four alike shares), not 0.0.
        assert d.policy.name == "clearing" and 0.5 < d.confidence <= 1.0
    assert len({d.confidence for d in moves}) == 1
    assert {(a.task_id, a.decision_id) for a in ledgers["n2"].allocations} == {(s, f"{s}.migrate.1") for s in small}
    assert len([d for d in observer.decisions if d.action == "migrate"]) == 4
    # The queue round places wide on the cleared node; filler, which would outlast the
    # reservation's start, is kept off it, as the reservation followed the clearing.
    assert [(d.task_id, sorted((p.node, p.gpu) for p in d.placement)) for d in observer.decisions
            if d.action == "assign"] == [("wide", [("n0", g) for g in range(4)])]


@pytest.mark.parametrize("shares_on_n0", [True, False], ids=["n0-held", "n0-freed-since"])
async def test_a_clearing_weighs_the_wait_on_the_view_it_plans_on(tmp_path, shares_on_n0):
    # The scene of the test above, in memory. The queue round reserved n1 for the wide task
    # (a wait of 4,900 s) while n0 was held by four shares. With n0 still held, the clearing
    # moves the shares. Had n0 freed since (its shares ended, or moved and were released),
    # the wide task could start there now: the next queue round places it, and a clearing
    # planned against the old wait would move n1's tenant onto n0, the GPUs freed for it.
    ps = policy_state(tmp_path)
    for topo in (node("n0", gpus=4), node("n1", gpus=4), node("n2", gpus=2, memory_mb=40960)):
        ps.fleet._apply(topo.node, encode(topo))
    ps.admissions = Admissions(None)  # type: ignore[arg-type]
    scene = {"n1": [tenant("big", [0, 1, 2, 3], 100, 5000, memory_mb=40000)]}
    if shares_on_n0:
        scene["n0"] = [tenant(f"s{i}", [i], 100, 7200, milli=300, memory_mb=2000) for i in range(4)]
    for name, pairs in scene.items():
        ps.ledger._apply(name, encode(NodeLedger(node=name, allocations=[h for hs, _ in pairs for h in hs])))
        for _, adm in pairs:
            ps.admissions._apply(f"contract.{adm.task.task_id}", encode(adm))
    wide = whole("wide", 4, 3600, gpu_memory_mb=60000)
    ps.admissions._apply("contract.wide", encode(wide))
    ps.reservation = Reservation(task_id="wide", node="n1", gpus=(0, 1, 2, 3), start_s=now() + 4900)
    planned: list[tuple[str, str]] = []

    async def migrate(running, topo, fp, p_stay_fails, why, target=None, planned_confidence=0.0):
        planned.append((running.task_id, why))
        return None  # taken by a race: the clearing stops there

    ps.migrate = migrate  # type: ignore[method-assign]
    assert await ps.clear_for_reservation(budget=8, moved=set()) == []
    if shares_on_n0:
        assert [t for t, _ in planned] == ["s0"] and planned[0][1].startswith("clearing n0 for wide"), planned
    else:
        assert planned == []


async def test_a_clearing_never_pauses_a_task_past_its_deadline(observer, nats_url, tmp_path):
    # The scene of the test above, but the shares on n0 must end within 10 s of their
    # declared end: pausing them would pay off in GPU-seconds and make them late.
    fleet = [node("n0", gpus=4), node("n1", gpus=4), node("n2", gpus=2, memory_mb=40960)]
    await observer.put_fleet(fleet)
    tight = []
    for i in range(4):
        holds, adm = tenant(f"s{i}", [i], 100, 7200, milli=300, memory_mb=2000)
        deadline = now() - 100 + 7200 + 10
        tight.append((holds, msgspec.structs.replace(adm, contract=Contract(deadline=deadline))))
    await seed(observer, {"n0": tight, "n1": [tenant("big", [0, 1, 2, 3], 100, 5000, memory_mb=40000)]})
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.1, rebalance_s=0.2))
    await policy.start()
    try:
        await observer.admit(whole("wide", 4, 3600, gpu_memory_mb=60000))
        await wait_for(lambda: any(d.task_id == "wide" for d in observer.decisions), what="wide queued")
        await asyncio.sleep(1.5)  # several rebalance rounds
    finally:
        await policy.stop()
    assert not any(d.action == "migrate" for d in observer.decisions)


async def long_then_short_on_the_h100s(observer, decided: int) -> dict:
    """Once the reservations are made: an hour-long and a 30-second task that take H100s
    only, then each task's first decision, once ``decided`` tasks have one."""
    await asyncio.sleep(0.6)  # retry rounds: the reservations are made
    await observer.admit(whole("long", 1, 3600, gpu_models=["H100"]))  # would take b0's idle GPU for an hour
    await observer.admit(whole("short", 1, 30, gpu_models=["H100"]))  # done before b0's GPU 0 frees
    await wait_for(lambda: len(observer.by_task()) == decided, what="a decision for every task")
    await asyncio.sleep(0.6)
    return {task: ds[0] for task, ds in observer.by_task().items()}


async def test_a_wide_task_bound_to_two_sites_is_reserved_at_the_one_that_can_take_it(
    observer, nats_url, tmp_path
):
    """Its contract binds it to site-a, then site-b; only site-b has the H100s it accepts.
    Reserved at its contract's first site only, as before, it got no reservation at all, and
    a long task took the GPU that freed for it at site-b."""
    await observer.put_fleet([node("a0", site="site-a", model="A100-40GB", memory_mb=40960),
                              node("b0", site="site-b", model="H100")])
    # b0's GPU 0 frees in about a minute (c); its GPU 1 is idle.
    await seed(observer, {"b0": [tenant("c", [0], 540, 600)]})
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        wide = whole("wide", 2, 3600, gpu_models=["H100"])
        await observer.admit(msgspec.structs.replace(wide, contract=Contract(
            offer_id="o-1", site="site-a", sites=["site-a", "site-b"], warmup_ms=500.0)))
        await wait_for(lambda: any(d.task_id == "wide" for d in observer.decisions), what="wide queued")
        first = await long_then_short_on_the_h100s(observer, 3)
    finally:
        await policy.stop()
    assert first["wide"].action == "queue" and first["long"].action == "queue"
    assert first["short"].action == "assign" and [(p.node, p.gpu) for p in first["short"].placement] == [("b0", 1)]
    assert [d.task_id for d in observer.decisions if d.action == "assign"] == ["short"]


async def test_a_blocked_task_that_only_other_nodes_can_take_gets_a_reservation_of_its_own(
    observer, nats_url, tmp_path
):
    """"wide" (A100s only) owns the reservation on a0; "big" (H100s only) can use none of the
    nodes "wide" can, so it gets one apart, on b0, and an hour-long task is kept off b0's idle
    GPU. With one reservation, "big" waited without one and the long task took that GPU."""
    await observer.put_fleet([node("a0", model="A100-40GB", memory_mb=40960), node("b0", model="H100")])
    # Each node's GPU 0 frees in about a minute; its GPU 1 is idle.
    await seed(observer, {"a0": [tenant("c", [0], 540, 600)], "b0": [tenant("d", [0], 540, 600)]})
    policy = build(settings(nats_url, tmp_path, profile="bestfit", pending_retry_s=0.2))
    await policy.start()
    try:
        await observer.admit(whole("wide", 2, 3600, gpu_models=["A100-40GB"]))
        await observer.admit(whole("big", 2, 3600, gpu_models=["H100"]))
        await wait_for(lambda: {"wide", "big"} <= set(observer.by_task()), what="both queued")
        first = await long_then_short_on_the_h100s(observer, 4)
    finally:
        await policy.stop()
    assert first["wide"].action == first["big"].action == first["long"].action == "queue"
    assert first["short"].action == "assign" and [(p.node, p.gpu) for p in first["short"].placement] == [("b0", 1)]
    assert [d.task_id for d in observer.decisions if d.action == "assign"] == ["short"]
