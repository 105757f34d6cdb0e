"""The pure parts of preemption and rebalancing over plain tables: which best_effort tasks a
vip needs evicted, the ids of evictions, re-placements, migrations and resizes, when a
predicted peak becomes a resize, why a running task should move, and when its measured
growth would overflow its GPU."""

from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest
from fleetpilot.contracts import (
    Allocation,
    Contract,
    Fingerprint,
    GpuInfo,
    NodeLedger,
    NodeTopology,
    TaskAdmitted,
    TaskSubmitted,
)
from fleetpilot.policy import TaskRequest
from fleetpilot.policy.preempt import (
    EXACT_LIMIT,
    NoRoom,
    Requeue,
    Victim,
    cheapest_on_node,
    decode_pending,
    encode_pending,
    evict_confidence,
    evict_decision_id,
    eviction_cost,
    fits,
    no_room_of,
    preemptions,
    reassign_decision_id,
    spares_an_eviction,
    with_no_room,
)
from fleetpilot.policy.rebalance import (
    Running,
    bridge_overflow,
    climbs_within_its_gpu,
    could_take,
    envelope_bridge_mb,
    envelope_level_mb,
    envelope_overflow,
    envelope_progress_s,
    generation,
    growth_overflow,
    is_first_placement,
    migrate_decision_id,
    models_below,
    move_down_ask,
    move_reason,
    resize_decision_id,
    resize_plan,
    resize_target_mb,
    run_counted_from,
    run_progress_s,
    waits_for_its_envelope,
)


def node(name: str, gpus: int = 2, model: str = "H100", memory_mb: int = 81920,
         labels: dict[int, dict[str, str]] | None = None) -> NodeTopology:
    """A node of ``gpus`` GPUs of one model, ``labels`` per GPU index."""
    return NodeTopology(node=name, cpu_milli=64000, memory_mb=512000,
                        gpus=[GpuInfo(index=i, model=model, memory_mb=memory_mb, labels=(labels or {}).get(i, {}))
                              for i in range(gpus)])


def hold(
    task: str, gpu: int, milli: int = 1000, memory_mb: int = 1000, decision: str = "", at: float = 0.0
) -> Allocation:
    return Allocation(
        task_id=task,
        decision_id=decision or f"{task}.assign",
        gpu=gpu,
        milli=milli,
        memory_mb=memory_mb,
        state="confirmed",
        at=at,
    )


def victim(name: str, ledger: NodeLedger, cost: float) -> Victim:
    allocs = tuple(a for a in ledger.allocations if a.task_id == name)
    adm = TaskAdmitted(
        task=TaskSubmitted(task_id=name, kind="train"),
        contract=Contract(tier="best_effort"),
        tenant="t",
        admitted_at=0,
    )
    return Victim(Running(name, ledger.node, allocs), adm, cost)


def vip(gpus: int = 1, milli: int = 1000, memory_mb: int = 0, models: tuple[str, ...] = ()) -> TaskSubmitted:
    return TaskSubmitted(
        task_id="v",
        kind="train",
        gpus=gpus,
        gpu_milli=milli,
        gpu_memory_mb=memory_mb,
        gpu_models=list(models),
    )


# (vip request, holds on a 2-GPU H100 node as (task, gpu, milli), evictable costs, expected victims)
CASES = [
    # One whole GPU: the cheaper GPU's tasks, together, not the single expensive one.
    (vip(), [("a", 0, 600), ("b", 0, 400), ("c", 1, 1000)], {"a": 5, "b": 5, "c": 100}, ["a", "b"]),
    # A share of 500: evicting one of the two is enough; the cheaper one.
    (vip(milli=500), [("a", 0, 500), ("b", 0, 500), ("c", 1, 1000)], {"a": 9, "b": 3, "c": 1}, ["c"]),
    (vip(milli=500), [("a", 0, 500), ("b", 0, 500), ("c", 1, 1000)], {"a": 9, "b": 3, "c": 50}, ["b"]),
    # A standard task (not evictable) shares GPU 0: only GPU 1 can be freed.
    (vip(), [("std", 0, 100), ("a", 0, 100), ("c", 1, 1000)], {"a": 1, "c": 80}, ["c"]),
    # Two whole GPUs: everything evictable goes.
    (vip(gpus=2), [("a", 0, 1000), ("b", 1, 300)], {"a": 1, "b": 1}, ["a", "b"]),
    # Two whole GPUs beside a standard task: impossible here.
    (vip(gpus=2), [("std", 0, 100), ("b", 1, 300)], {"b": 1}, None),
    # The wrong model: nothing helps.
    (vip(models=("A100",)), [("a", 0, 1000)], {"a": 1}, None),
]


@pytest.mark.parametrize(("task", "table", "costs", "expected"), CASES)
def test_the_cheapest_set_of_best_effort_tasks_that_makes_room(task, table, costs, expected):
    ledger = NodeLedger(node="n", allocations=[hold(t, g, m) for t, g, m in table])
    victims = [victim(name, ledger, cost) for name, cost in costs.items()]
    plan = cheapest_on_node(task, node("n"), ledger, victims)
    if expected is None:
        assert plan is None
    else:
        assert plan is not None and sorted(v.task_id for v in plan.victims) == expected


def test_fit_respects_labels_memory_and_host_resources():
    topo = node("n", labels={1: {"maintenance_pending": "true"}})
    free_gpu0_only = [hold("x", 0, 0, memory_mb=0)]
    assert fits(vip(), topo, free_gpu0_only)
    assert not fits(vip(gpus=2), topo, [])  # GPU 1 is pending maintenance
    assert not fits(vip(memory_mb=90000), topo, [])  # more than an H100 has
    busy = [hold("x", 0, 200, memory_mb=80000)]
    assert not fits(vip(milli=500, memory_mb=4000), node("n", gpus=1), busy)
    assert fits(vip(milli=500, memory_mb=1000), node("n", gpus=1), busy)
    hungry = TaskSubmitted(task_id="v", kind="train", cpu_milli=999_999)
    assert not fits(hungry, topo, [])
    # Business rules: a reserved GPU, another driver, a kind the GPU does not take.
    ruled = node("n", gpus=3, labels={0: {"role": "reserved"}, 1: {"driver_pin": "535"},
                                      2: {"task_kinds": "infer"}})
    assert fits(vip(), ruled, []) and not fits(vip(gpus=2), ruled, [])  # only GPU 1 takes a train task
    needs = {v: msgspec.structs.replace(vip(), labels={"driver": v}) for v in ("535", "550")}
    assert fits(needs["535"], ruled, []) and not fits(needs["550"], ruled, [])
    assert fits(msgspec.structs.replace(needs["550"], kind="infer"), ruled, [])  # GPU 2: no driver known


def test_many_victims_take_the_greedy_path_and_keep_no_superfluous_one():
    # 16 small tasks on GPU 0, each 60 milli; a 500-milli share needs 9 of them (40 free).
    table = [hold(f"t{i:02d}", 0, 60) for i in range(16)]
    ledger = NodeLedger(node="n", allocations=table)
    victims = [victim(a.task_id, ledger, cost=1 + i) for i, a in enumerate(table)]
    assert len(victims) > EXACT_LIMIT
    plan = cheapest_on_node(vip(milli=500), node("n", gpus=1), ledger, victims)
    assert plan is not None
    assert [v.task_id for v in plan.victims] == [f"t{i:02d}" for i in range(8)]  # 40 + 8 x 60 = 520


def test_the_cheapest_node_wins():
    ledgers = {
        "n0": NodeLedger(node="n0", allocations=[hold("a", 0, 1000), hold("b", 1, 1000)]),
        "n1": NodeLedger(node="n1", allocations=[hold("c", 0, 1000), hold("d", 1, 1000)]),
    }
    nodes = {"n0": node("n0"), "n1": node("n1")}
    costs = {"a": 10, "b": 10, "c": 30, "d": 2}
    victims = [victim(t, ledgers[n], costs[t]) for n in ledgers for t in ("a", "b", "c", "d") if t in costs]
    victims = [v for v in victims if v.running.allocations]
    plans = preemptions(vip(), nodes, ledgers, victims)
    assert [(p.node, [v.task_id for v in p.victims]) for p in plans] == [("n1", ["d"]), ("n0", ["a"])]


def test_between_victims_that_lose_as_much_the_one_with_the_most_run_left_is_evicted():
    # Two nodes, each with one GPU held by a best_effort run that resumes (each loses one
    # restart): evicting the one with two hours left sends them back to the queue; the one
    # with ten minutes left would have freed its GPU soon anyway.
    ledgers = {"n0": NodeLedger(node="n0", allocations=[hold("near_end", 0)]),
               "n1": NodeLedger(node="n1", allocations=[hold("hours_left", 0)])}
    nodes = {"n0": node("n0", gpus=1), "n1": node("n1", gpus=1)}
    left = {"near_end": 600.0, "hours_left": 7200.0}
    victims = [dataclasses.replace(victim(t, ledgers[n], 60.0), left_s=left[t])
               for n, t in (("n0", "near_end"), ("n1", "hours_left"))]
    plans = preemptions(vip(), nodes, ledgers, victims)
    assert [(p.node, [v.task_id for v in p.victims]) for p in plans] == [("n1", ["hours_left"]), ("n0", ["near_end"])]
    # A lower cost still comes first, whatever is left.
    cheaper = [dataclasses.replace(v, cost=30.0) if v.task_id == "near_end" else v for v in victims]
    assert preemptions(vip(), nodes, ledgers, cheaper)[0].node == "n0"


@pytest.mark.parametrize(("resumes", "left_s", "deadline", "max_queue_s", "spared"), [
    (True, 3000.0, 1000.0 + 3000.0 + 60.0 + 300.0, 300.0, True),  # exactly room for pause and wait
    (True, 3000.0, 1000.0 + 3000.0 + 60.0 + 299.0, 300.0, False),  # a second short
    (False, 3000.0, 100000.0, 300.0, False),  # it would start over
    (True, None, 100000.0, 300.0, False),  # no declared run: its end is unknown
    (True, 3000.0, None, 300.0, False),  # no deadline to keep
    (True, 3000.0, 100000.0, None, False),  # no bound on how long it would wait again
])
def test_a_standard_run_is_spared_an_eviction_only_with_room_for_its_pause_and_a_whole_wait(
        resumes, left_s, deadline, max_queue_s, spared):
    assert spares_an_eviction(at=1000.0, resumes=resumes, left_s=left_s, pause_s=60.0, deadline=deadline,
                              max_queue_s=max_queue_s) is spared


def test_eviction_cost_is_lost_work_plus_a_restart():
    task = Running("t", "n", (hold("t", 0, 500, at=100.0), hold("t", 1, 1000, at=100.0)))
    assert eviction_cost(task, at=160.0, restart_s=60.0) == pytest.approx(0.5 * 120 + 1.0 * 120)
    # A task that resumes from its checkpoint loses its restart only, however long it ran.
    assert eviction_cost(task, at=3700.0, restart_s=60.0, resumes=True) == pytest.approx(0.5 * 60 + 1.0 * 60)
    assert evict_confidence(2, 0.97) == pytest.approx(0.9409)


@pytest.mark.parametrize(
    ("decision_id", "gen", "evict", "reassign", "migrate", "resize"),
    [
        ("t.assign", 1, "t.evict.1", "t.assign.2", "t.migrate.1", "t.resize.2048"),
        ("t.migrate.3", 1, "t.evict.1", "t.assign.2", "t.migrate.4", "t.resize.2048"),
        ("t.assign.2", 2, "t.evict.2", "t.assign.3", "t.assign.2.migrate.1", "t.assign.2.resize.2048"),
        (
            "t.assign.2.migrate.1",
            2,
            "t.evict.2",
            "t.assign.3",
            "t.assign.2.migrate.2",
            "t.assign.2.resize.2048",
        ),
    ],
)
def test_ids_never_repeat_across_evictions(decision_id, gen, evict, reassign, migrate, resize):
    task = Running("t", "n", (hold("t", 0, 1000, decision=decision_id),))
    assert generation("t", decision_id) == gen
    assert evict_decision_id(task) == evict
    assert reassign_decision_id(task) == reassign
    assert migrate_decision_id(task) == migrate
    assert resize_decision_id(task, 2048) == resize


def test_pending_entries_carry_the_requeue_note_and_stay_readable_as_admissions():
    adm = TaskAdmitted(
        task=TaskSubmitted(task_id="t", kind="train"),
        contract=Contract(tier="best_effort"),
        tenant="x",
        admitted_at=1,
    )
    note = Requeue(decision_id="t.assign.2", evict_id="t.evict.1", for_task="v")
    assert decode_pending(encode_pending(adm)) == (adm, None)
    assert decode_pending(encode_pending(adm, note)) == (adm, note)
    # What kept it off every node rides along, replaced by each refusal, leaving the rest.
    refused = with_no_room(encode_pending(adm, note), NoRoom(shortfall="0 of 2 nodes: 2 lack free GPUs", at=5.0))
    again = with_no_room(refused, NoRoom(shortfall="0 of 2 nodes: 1 lack free CPU", at=9.0))
    assert decode_pending(again) == (adm, note)
    assert (no_room_of(encode_pending(adm)), no_room_of(again)) == (None, NoRoom(shortfall="0 of 2 nodes: 1 lack free CPU",
                                                                                  at=9.0))


def alone_on_an_a100() -> tuple[NodeTopology, NodeLedger, Running]:
    """A node of one A100 of 40,960 MB, and task ``t`` holding all of it."""
    topo = node("x", gpus=1, model="A100-40GB", memory_mb=40960)
    ledger = NodeLedger(node="x", allocations=[hold("t", 0, memory_mb=40960)])
    return topo, ledger, Running("t", "x", (ledger.allocations[0],))


def fingerprint(peak_mb: float, spread_mb: float = 500) -> Fingerprint:
    return Fingerprint(
        signature="s",
        pattern="linear",
        pattern_confidence=0.9,
        growth_rate_mb_per_s=1.0,
        predicted_peak_mb=peak_mb,
        peak_low_mb=peak_mb - spread_mb,
        peak_high_mb=peak_mb + spread_mb,
    )


# (task hold MB, neighbour MB on the 40 GB GPU, peak MB, labels of GPU 0, expected new size or None)
RESIZES = [
    (5000, 10000, 20000, {}, 21012),  # room: 25960 free for 16012 more
    (5000, 30000, 20000, {}, None),  # 5960 free: migrate instead
    (21012, 10000, 20000, {}, None),  # the hold already covers the peak
    (5000, 10000, 20000, {"maintenance_pending": "true"}, None),  # the GPU goes away: migrate
    (5000, 0, 4000, {}, None),  # peak below the hold
]


@pytest.mark.parametrize(("held", "neighbour", "peak", "labels", "expected"), RESIZES)
def test_a_peak_above_the_hold_becomes_a_resize_only_with_room(held, neighbour, peak, labels, expected):
    topo = node("a", gpus=1, model="A100-40GB", memory_mb=40960, labels={0: labels})
    mine = hold("t", 0, 300, memory_mb=held)
    ledger = NodeLedger(node="a", allocations=[mine, hold("nb", 0, 300, memory_mb=neighbour)])
    plan = resize_plan(Running("t", "a", (mine,)), topo, ledger, fingerprint(peak), 0.5, 512)
    if expected is None:
        assert plan is None
    else:
        assert plan is not None and plan.memory_mb == expected
        assert plan.extra == {0: expected - held}
        assert 0.99 < plan.confidence <= 1.0


@pytest.mark.parametrize(("held", "peak", "expected"), [
    (5000, 20000, 21012),   # the interval's top (20,500) plus the 512-MB margin
    (21012, 20000, None),   # the hold covers it
    (19900, 20000, 21012),  # just under the peak: P(over) above a half
    (30000, 20000, None),   # a prediction that falls never shrinks a hold
])
def test_a_hold_grows_to_the_top_of_its_peak_s_interval_and_never_shrinks(held, peak, expected):
    assert resize_target_mb(fingerprint(peak), held) == expected
    # A peak that passes the hold with probability under the threshold leaves it.
    assert resize_target_mb(fingerprint(peak, spread_mb=4000), peak + 100, threshold=0.6) is None
    assert resize_target_mb(None, held) is None


def test_move_reasons_and_migration_ids():
    topo = node("x", labels={1: {"decommissioned": "true"}})
    ledger = NodeLedger(node="x", allocations=[hold("t", 0), hold("u", 1, decision="u.migrate.2")])
    stay = Running("t", "x", (ledger.allocations[0],))
    leave = Running("u", "x", (ledger.allocations[1],))
    assert move_reason(stay, topo, ledger, None, 0.5) is None
    assert move_reason(stay, topo, ledger, fingerprint(1000), 0.5) is None  # fits easily
    oom = move_reason(stay, topo, ledger, fingerprint(90000), 0.5)
    assert oom is not None and oom.p_stay_fails > 0.99
    gone = move_reason(leave, topo, ledger, None, 0.5)
    assert gone is not None and gone.p_stay_fails == 1.0 and "decommissioned" in gone.why
    assert migrate_decision_id(stay) == "t.migrate.1"
    assert migrate_decision_id(leave) == "u.migrate.3"
    assert migrate_decision_id(leave, tried=2) == "u.migrate.5"  # .3 and .4 failed


def test_a_waiter_could_take_a_gpu_of_a_model_it_accepts_with_room_at_a_site_it_may_use():
    need = TaskRequest(task_id="w", gpus=1, gpu_memory_mb=60_000, gpu_models=("H100",))
    assert could_take(need, "H100", 81_920)
    assert not could_take(need, "A100-40GB", 81_920) and not could_take(need, "H100", 40_960)
    assert could_take(need, "H100", 81_920, "b", ["a", "b"])
    assert not could_take(need, "H100", 81_920, "c", ["a", "b"])  # a site its contract does not bind it to
    assert could_take(need, "H100", 81_920, "c", [])  # bound to none: any site


def test_only_a_steady_climb_waits_on_its_measured_rate_and_only_while_it_fits():
    topo = node("x", gpus=1, model="A100-40GB", memory_mb=40960)
    ledger = NodeLedger(node="x", allocations=[hold("t", 0, memory_mb=20000)])
    run = Running("t", "x", tuple(ledger.allocations))
    line = msgspec.structs.replace(fingerprint(60_000), pattern="linear")
    slow = [(0.0, 10_000.0), (60.0, 10_500.0)]  # +500 MB a minute: 12.5 GB in four minutes
    fast = [(0.0, 10_000.0), (60.0, 20_000.0)]  # +10 GB a minute: 60 GB in four minutes
    assert climbs_within_its_gpu(run, topo, ledger, line, slow, 240.0)
    assert not climbs_within_its_gpu(run, topo, ledger, line, fast, 240.0)
    assert not climbs_within_its_gpu(run, topo, ledger, line, slow[-1:], 240.0)  # no rate yet
    for pattern in ("leak", "steps", "unknown"):  # a leak outruns its average rate; no rate announces a step
        assert not climbs_within_its_gpu(run, topo, ledger, msgspec.structs.replace(line, pattern=pattern), slow, 240.0)
    assert not climbs_within_its_gpu(run, topo, ledger, None, slow, 240.0)


def test_growth_overflow_carries_the_measured_slope_per_gpu_against_the_room_left_by_neighbours():
    topo = node("x", gpus=2, model="A100-40GB", memory_mb=40960)
    ledger = NodeLedger(node="x", allocations=[hold("t", 0, memory_mb=20000), hold("t", 1, memory_mb=20000),
                                               hold("n", 1, milli=0, memory_mb=10000)])
    two = Running("t", "x", tuple(ledger.allocations[:2]))
    # 20 GB over two GPUs, +2 GB a minute over both: +4 GB per GPU in four minutes -> 14 GB.
    slow = [(0.0, 18000.0), (60.0, 20000.0)]
    assert growth_overflow(two, topo, ledger, slow, 240.0) is None
    # +12 GB a minute over both: 10 + 24 GB per GPU in four minutes, within GPU 0's 40,960 MB
    # but past the 30,960 MB that GPU 1's neighbour leaves.
    fast = [(0.0, 8000.0), (60.0, 20000.0)]
    why = growth_overflow(two, topo, ledger, fast, 240.0)
    assert why is not None and "30960 MB it can have on GPU 1" in why
    assert growth_overflow(two, topo, ledger, fast[-1:], 240.0) is None  # one sample: no slope
    assert growth_overflow(two, topo, ledger, [(0.0, 5e4), (60.0, 2e4)], 240.0) is None  # shrinking


def test_envelope_bridge_asks_what_the_program_holds_for_its_stay_and_only_for_a_known_unsmooth_one():
    steps = msgspec.structs.replace(fingerprint(60_000), pattern="steps",
                                    envelope_mb=(30_000.0,) * 10 + (60_000.0,) * 10)
    # Stay 900 s + lookahead 240 s of a 2,400 s run: the tenth point (by 1,200 s), 30 GB.
    assert envelope_bridge_mb(steps, 2400.0, 240.0) == math.ceil(30_000 / 0.98)
    # A run of 1,800 s reaches the step (its half) within its stay: it needs its peak then.
    assert envelope_bridge_mb(steps, 1800.0, 240.0) == math.ceil(60_000 / 0.98)
    assert envelope_bridge_mb(steps, None, 240.0) == 0  # no declared duration: no schedule
    assert envelope_bridge_mb(msgspec.structs.replace(steps, envelope_mb=()), 2400.0, 240.0) == 0
    assert envelope_bridge_mb(msgspec.structs.replace(steps, pattern="leak"), 2400.0, 240.0) == 0
    assert envelope_bridge_mb(None, 2400.0, 240.0) == 0


def test_envelope_overflow_reads_the_envelope_ahead_of_the_progress_against_the_room_left_by_neighbours():
    topo = node("x", gpus=1, model="A100-40GB", memory_mb=40960)
    ledger = NodeLedger(node="x", allocations=[hold("t", 0, memory_mb=30000), hold("n", 0, milli=0, memory_mb=5000)])
    run = Running("t", "x", (ledger.allocations[0],))
    steps = msgspec.structs.replace(fingerprint(60_000), pattern="steps",
                                    envelope_mb=(30_000.0,) * 10 + (60_000.0,) * 10)
    assert envelope_overflow(run, topo, ledger, steps, 900.0, 2400.0, 240.0) is None  # 30 GB by 1,140 s
    why = envelope_overflow(run, topo, ledger, steps, 1000.0, 2400.0, 240.0)  # the step by 1,240 s
    assert why is not None and "60000 MB per GPU by 21 min" in why and "35960 MB it can have on GPU 0" in why
    # 30 GB fits 98% of the A100 alone, not beside a 12 GB neighbour.
    crowded = NodeLedger(node="x", allocations=[ledger.allocations[0], hold("n", 0, milli=0, memory_mb=12000)])
    assert envelope_overflow(run, topo, crowded, steps, 0.0, 2400.0, 240.0) is not None
    assert envelope_overflow(run, topo, ledger, msgspec.structs.replace(steps, envelope_mb=()), 1000.0, 2400.0,
                             240.0) is None


def test_a_program_whose_predicted_peak_is_above_its_envelope_is_read_at_that_height():
    # Its runs so far topped out at 40,000 MB, under the 40,141 MB a lone A100 holds at 98%; an
    # OOM since taught that its runs can need 44,000 MB (its floor, folded into the peak).
    topo, ledger, run = alone_on_an_a100()
    steps = msgspec.structs.replace(fingerprint(40_000), pattern="steps",
                                    envelope_mb=(20_000.0,) * 10 + (40_000.0,) * 10)
    assert envelope_level_mb(steps, 2000.0, 2400.0) == 40_000.0
    assert envelope_overflow(run, topo, ledger, steps, 1000.0, 2400.0, 240.0) is None
    higher = msgspec.structs.replace(steps, predicted_peak_mb=44_000.0)
    # The last step comes when the envelope says, to the height the peak says; before it, the
    # phases are read as they were seen.
    assert envelope_level_mb(higher, 2000.0, 2400.0) == 44_000.0
    assert envelope_level_mb(higher, 600.0, 2400.0) == 20_000.0
    why = envelope_overflow(run, topo, ledger, higher, 1000.0, 2400.0, 240.0)
    assert why is not None and "44000 MB per GPU by 21 min" in why
    assert envelope_overflow(run, topo, ledger, higher, 500.0, 2400.0, 240.0) is None
    assert envelope_bridge_mb(higher, 2400.0, 240.0) == math.ceil(20_000 / 0.98)
    assert envelope_bridge_mb(higher, 1800.0, 240.0) == math.ceil(44_000 / 0.98)
    # A peak below the envelope's top lowers nothing: the envelope is what runs were seen to hold.
    lower = msgspec.structs.replace(steps, predicted_peak_mb=30_000.0)
    assert envelope_level_mb(lower, 2000.0, 2400.0) == 40_000.0


def test_a_bridge_is_watched_by_its_envelope_whatever_pattern_was_voted_and_by_its_rate_when_smooth():
    topo = node("x", gpus=1, model="A100-40GB", memory_mb=40960)
    ledger = NodeLedger(node="x", allocations=[hold("t", 0, memory_mb=30000)])
    run = Running("t", "x", (ledger.allocations[0],))
    envelope = (30_000.0,) * 10 + (60_000.0,) * 10
    line = msgspec.structs.replace(fingerprint(60_000), pattern="linear", envelope_mb=envelope)
    flat_samples = ((0.0, 30_000.0), (60.0, 30_000.0))
    steep_samples = ((0.0, 20_000.0), (60.0, 30_000.0))  # 10 GB a minute: full within the lookahead
    # Voted a line, flat between its steps: its envelope sees the step its rate cannot.
    why = bridge_overflow(run, topo, ledger, line, flat_samples, 1000.0, 2400.0, 240.0)
    assert why is not None and "envelope" in why
    # Before the step, a smooth grower is still watched by its rate.
    assert bridge_overflow(run, topo, ledger, line, flat_samples, 0.0, 2400.0, 240.0) is None
    assert bridge_overflow(run, topo, ledger, line, steep_samples, 0.0, 2400.0, 240.0) is not None
    # A step schedule is not: a jump reads as a steep climb; only its envelope speaks.
    steps = msgspec.structs.replace(line, pattern="steps")
    assert bridge_overflow(run, topo, ledger, steps, steep_samples, 0.0, 2400.0, 240.0) is None
    # Its progress unknown (not its first placement), a run is watched by its rate alone.
    assert bridge_overflow(run, topo, ledger, line, flat_samples, None, 2400.0, 240.0) is None
    assert bridge_overflow(run, topo, ledger, steps, steep_samples, None, 2400.0, 240.0) is not None


def test_only_a_task_under_its_first_assign_counts_its_progress_from_its_hold():
    ledger = NodeLedger(node="x", allocations=[hold("t", 0), hold("u", 0, decision="u.assign.2"),
                                               hold("v", 0, decision="v.migrate.1")])
    first, again, moved = (Running(a.task_id, "x", (a,)) for a in ledger.allocations)
    assert is_first_placement(first)
    assert not is_first_placement(again) and not is_first_placement(moved)


def test_a_run_s_progress_is_read_from_its_first_hold_or_from_when_its_moves_say_it_began():
    first = Running("t", "x", (hold("t", 0, at=100.0),))
    moved = Running("t", "x", (msgspec.structs.replace(hold("t", 0, decision="t.migrate.1", at=900.0), run_at=100.0),))
    restored = Running("t", "x", (hold("t", 0, decision="t.assign.2", at=900.0),))
    assert run_progress_s(first, 1000.0) == 900.0
    assert run_progress_s(moved, 1000.0) == 900.0  # from when the run began, not the move
    assert run_progress_s(restored, 1000.0) is None  # its progress before the stop is unknown


def test_a_run_restored_from_its_checkpoint_ends_by_its_progress_but_its_envelope_is_not_read():
    # Checkpointed 600 s into its run and placed again at 900 s: its restored holds say it
    # began at 300 s, and its declared run is counted from there, not from its restore.
    note = Requeue(decision_id="t.assign.2", evict_id="t.evict.1", progress_s=600.0)
    assert note.run_began_at(900.0) == 300.0
    assert Requeue(decision_id="t.assign.2").run_began_at(900.0) == 0.0  # stopped, progress unknown
    restored = Running("t", "x", (msgspec.structs.replace(hold("t", 0, decision="t.assign.2", at=900.0),
                                                          run_at=note.run_began_at(900.0)),))
    moved = Running("t", "x", (msgspec.structs.replace(hold("t", 0, decision="t.assign.2.migrate.1", at=950.0),
                                                       run_at=300.0),))
    for run in (restored, moved):
        assert run_progress_s(run, 1000.0) == 700.0
        assert run_counted_from(run) == 300.0
        assert envelope_progress_s(run, 1000.0) is None
    first = Running("t", "x", (hold("t", 0, at=100.0),))
    assert envelope_progress_s(first, 1000.0) == 900.0


def test_a_tenant_moves_down_only_in_a_phase_its_envelope_holds_below_with_half_an_hour_left():
    steps = msgspec.structs.replace(fingerprint(60_000), pattern="steps",
                                    envelope_mb=(20_000.0,) * 10 + (60_000.0,) * 10)
    # 5 minutes into an 80-minute run: 20 GB over the next 19 minutes.
    assert move_down_ask(steps, 4800.0, 300.0, 240.0) == math.ceil(20_000 / 0.98)
    # 25 minutes in, its step comes within the quarter hour and lookahead: its peak.
    assert move_down_ask(steps, 4800.0, 1500.0, 240.0) == math.ceil(60_000 / 0.98)
    assert move_down_ask(steps, 4800.0, 3100.0, 240.0) == 0  # 28 minutes left
    assert move_down_ask(steps, 4800.0, None, 240.0) == 0  # progress unknown
    assert move_down_ask(steps, None, 300.0, 240.0) == 0
    assert move_down_ask(msgspec.structs.replace(steps, envelope_mb=()), 4800.0, 300.0, 240.0) == 0
    # Any pattern with an envelope: a step schedule may be voted a line.
    assert move_down_ask(msgspec.structs.replace(steps, pattern="linear"), 4800.0, 300.0, 240.0) > 0


def test_a_tenant_moves_down_only_to_models_that_hold_it_and_that_the_waiter_cannot_take():
    memory = {"A100-40GB": 40960, "H100": 81920, "T4": 15360}
    # The waiter needs 63 GB: only an H100 takes it.
    assert models_below((), 20_409, (), 63_000, memory) == ("A100-40GB",)  # a T4 is too small
    assert models_below((), 10_000, (), 63_000, memory) == ("A100-40GB", "T4")
    assert models_below(("H100", "T4"), 10_000, (), 63_000, memory) == ("T4",)  # what the tenant accepts
    # A waiter of 20 GB takes an A100 too: moving a tenant there makes it no room.
    assert models_below((), 10_000, (), 20_000, memory) == ("T4",)
    # A waiter that accepts only H100s cannot take an A100, however small it is.
    assert models_below((), 10_000, ("H100",), 5_000, memory) == ("A100-40GB", "T4")
    assert models_below((), 0, (), 63_000, memory) == ()  # no ask known


def test_a_bridged_run_watched_by_its_envelope_waits_for_it_and_any_other_moves_on_its_peak():
    topo, ledger, run = alone_on_an_a100()
    steps = msgspec.structs.replace(fingerprint(60_000), pattern="steps",
                                    envelope_mb=(30_000.0,) * 10 + (60_000.0,) * 10)
    assert waits_for_its_envelope(run, topo, ledger, steps, (), 300.0, 2400.0, 240.0)
    assert not waits_for_its_envelope(run, topo, ledger, steps, (), 1000.0, 2400.0, 240.0)  # its step is near
    assert not waits_for_its_envelope(run, topo, ledger, steps, (), None, 2400.0, 240.0)  # progress unknown
    assert not waits_for_its_envelope(run, topo, ledger, msgspec.structs.replace(steps, envelope_mb=()), (),
                                      300.0, 2400.0, 240.0)
    # It holds its peak: nothing to wait for, the usual rules apply.
    full = Running("t", "x", (hold("t", 0, memory_mb=63_000),))
    assert not waits_for_its_envelope(full, topo, ledger, steps, (), 300.0, 2400.0, 240.0)


@pytest.mark.parametrize("risk", ["nan", "NaN", "inf", "-inf", "soon"])
def test_a_maintenance_risk_label_that_is_no_probability_reads_as_the_default(risk: str) -> None:
    # ``float("nan")`` parses: the NaN went through the clamp into P(staying fails), and on
    # into the confidence a migrate decision published.
    topo = node("x", labels={0: {"maintenance_pending": "true", "maintenance_risk": risk}})
    ledger = NodeLedger(node="x", allocations=[hold("t", 0)])
    why = move_reason(Running("t", "x", (ledger.allocations[0],)), topo, ledger, None, 0.5)
    assert why is not None and why.p_stay_fails == pytest.approx(0.9)
    assert "0.90" in why.why
