"""The negotiator's fleet snapshot from plain topology, ledger and contract records."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest
from fleetpilot.contracts import (
    Allocation,
    BandwidthEstimate,
    Contract,
    GpuInfo,
    NodeLedger,
    NodeTopology,
    SlaOffer,
    SlaRequest,
    TaskAdmitted,
    TaskSubmitted,
)
from fleetpilot.sla import Admit, CounterOffer, NegotiationPolicy, OfferBook, Reject, contract_for, negotiate
from fleetpilot.sla.snapshot import (
    SnapshotKnobs,
    as_named_by_fleet,
    bandwidth_table,
    fleet_view,
    offers_hold_until,
)

NOW = 10_000.0


def admitted(task_id: str, tier: str, duration: float | None) -> TaskAdmitted:
    task = TaskSubmitted(task_id=task_id, expected_duration_s=duration)
    return TaskAdmitted(task=task, contract=Contract(tier=tier), tenant="t", admitted_at=0.0)  # type: ignore[arg-type]


def hold(task_id: str, gpu: int, milli: int = 1000, at: float = NOW - 40) -> Allocation:
    return Allocation(task_id=task_id, decision_id=f"{task_id}.assign", gpu=gpu, milli=milli, at=at)


NODE = NodeTopology(node="n1", site="s1", gpus=[GpuInfo(index=i, model="A100-40GB", memory_mb=40_960)
                                               for i in range(5)])
LEDGER = NodeLedger(node="n1", allocations=[
    hold("be", 1),                                  # best_effort, ends in 60 s
    hold("std", 2, milli=500),                      # standard, duration unknown: shared, never frees
    hold("ghost", 3),                               # no contract known: not preemptible, no completion
    hold("be", 4, milli=400), hold("be2", 4, milli=600, at=NOW - 10),  # frees when the later ends
])
CONTRACTS = {"be": admitted("be", "best_effort", 100.0), "be2": admitted("be2", "best_effort", 200.0),
             "std": admitted("std", "standard", None)}


def test_a_vip_is_promised_a_preemption_only_where_one_node_can_be_cleared():
    """Two 4-GPU nodes, each running best_effort work on three GPUs and something else on
    the fourth: the pool has 6 preemptible GPUs, and a vip asking 4 now was admitted to
    preempt, though no node has more than 3 to clear. Where one node runs best_effort work
    alone, a vip asking 4 is admitted to preempt it."""
    from fleetpilot.sla import Admit, negotiate  # noqa: PLC0415

    nodes = [NodeTopology(node=n, site="s1", gpus=[GpuInfo(index=i, model="A100-40GB", memory_mb=40_960)
                                                   for i in range(4)]) for n in ("n1", "n2")]
    vip = TaskSubmitted(task_id="vip", gpus=4, sla=SlaRequest(tier="vip", max_queue_s=0))
    contracts = {"be": admitted("be", "best_effort", None), "std": admitted("std", "standard", None)}
    split = [NodeLedger(node=n, allocations=[*(hold("be", g) for g in range(3)), hold("std", 3)])
             for n in ("n1", "n2")]
    (pool,) = fleet_view(nodes, split, contracts, now=NOW).pools
    assert (pool.free_gpus, pool.preemptible_gpus, pool.most_clearable_on_a_node) == (0, 6, 3)
    assert not isinstance(negotiate(vip, fleet_view(nodes, split, contracts, now=NOW), now=NOW), Admit)
    apart = [NodeLedger(node="n1", allocations=[hold("be", g) for g in range(4)]),
             NodeLedger(node="n2", allocations=[hold("std", g) for g in range(4)])]
    decision = negotiate(vip, fleet_view(nodes, apart, contracts, now=NOW), now=NOW)
    assert isinstance(decision, Admit) and decision.may_preempt, decision


def test_pool_counts_free_shared_preemptible_and_completions():
    (pool,) = fleet_view([NODE], [LEDGER], CONTRACTS, now=NOW).pools
    assert (pool.site, pool.gpu_model, pool.memory_mb_per_gpu) == ("s1", "A100-40GB", 40_960)
    assert pool.free_gpus == 1
    assert pool.free_milli == 500
    assert pool.preemptible_gpus == 2  # GPU 1 and GPU 4: every holder is best_effort
    assert pool.completions == ((60.0, 1), (190.0, 1))
    assert pool.reserved_gpus == 1  # ceil(5 * 0.1), at most the one free GPU
    assert pool.price_per_gpu_hour == pytest.approx(3.67) and pool.relative_compute == pytest.approx(1.0)


def test_a_moved_run_frees_its_gpu_by_when_its_run_began_not_by_its_move():
    moved = Allocation(task_id="be", decision_id="be.migrate.1", gpu=0, milli=1000, at=NOW - 10, run_at=NOW - 70)
    (pool,) = fleet_view([NODE], [NodeLedger(node="n1", allocations=[moved])], CONTRACTS, now=NOW).pools
    assert pool.completions == ((30.0, 1),)  # began 70 s ago, declared 100 s


@pytest.mark.parametrize(("fraction", "reserved"), [(0.0, 0), (0.1, 1), (1.0, 1)])
def test_reserve_is_a_share_of_the_pool_capped_by_the_free_gpus(fraction, reserved):
    (pool,) = fleet_view([NODE], [LEDGER], CONTRACTS, now=NOW, knobs=SnapshotKnobs(reserve_fraction=fraction)).pools
    assert pool.reserved_gpus == reserved


def test_pools_split_by_site_and_model_and_unknown_models_get_defaults():
    other = NodeTopology(node="n2", site="s2", gpus=[GpuInfo(index=0, model="H100"),
                                                     GpuInfo(index=1, model="Mystery-9", memory_mb=12_000)])
    view = fleet_view([NODE, other], [], {}, now=NOW, knobs=SnapshotKnobs(default_price_per_gpu_hour=0.5))
    pools = {(p.site, p.gpu_model): p for p in view.pools}
    assert set(pools) == {("s1", "A100-40GB"), ("s2", "H100"), ("s2", "Mystery-9")}
    h100 = pools[("s2", "H100")]
    assert h100.memory_mb_per_gpu == 81_559  # from the catalogue when the node does not say
    assert h100.relative_compute == pytest.approx(989 / 312)
    mystery = pools[("s2", "Mystery-9")]
    assert (mystery.price_per_gpu_hour, mystery.relative_compute, mystery.memory_mb_per_gpu) == (0.5, 1.0, 12_000)
    assert pools[("s1", "A100-40GB")].free_gpus == 5  # no ledger: everything free


def test_bandwidth_table_is_gbytes_both_ways_for_one_strategy():
    estimates = [BandwidthEstimate(a_site="a", b_site="b", strategy="min_rtt", effective_gbps=80.0),
                 BandwidthEstimate(a_site="a", b_site="b", strategy="balanced", effective_gbps=240.0),
                 BandwidthEstimate(a_site="a", b_site="c", strategy="min_rtt", effective_gbps=0.0)]
    assert bandwidth_table(estimates) == {("a", "b"): 10.0, ("b", "a"): 10.0}
    assert bandwidth_table(estimates, "balanced") == {("a", "b"): 30.0, ("b", "a"): 30.0}


@pytest.mark.parametrize(("asked", "fleet", "expected"), [
    (["A100"], ["A100-40GB", "A100-80GB", "H100"], ["A100", "A100-40GB"]),
    (["H100-SXM"], ["H100"], ["H100-SXM", "H100"]),
    (["H100"], ["H100"], ["H100"]),
    (["Mystery-9"], ["Mystery-9", "H100"], ["Mystery-9"]),
    ([], ["H100"], []),
])
def test_asked_models_are_widened_to_the_fleets_spelling(asked, fleet, expected):
    assert as_named_by_fleet(asked, fleet) == expected


def admitted_on(task_id: str, gpus: int, site: str | None, duration_s: float | None = None) -> TaskAdmitted:
    task = TaskSubmitted(task_id=task_id, gpus=gpus, gpu_models=["A100-40GB"], expected_duration_s=duration_s)
    return TaskAdmitted(task=task, contract=Contract(gpu_models=["A100-40GB"], site=site), tenant="t",
                        admitted_at=NOW - 5)


def test_admissions_without_holds_take_their_pinned_gpus():
    free = NodeTopology(node="n3", site="s1", gpus=[GpuInfo(index=i, model="A100-40GB") for i in range(5)])
    admissions = {
        "new": admitted_on("new", 2, "s1"),      # on its way to the policy, or queued: ahead of us
        "else": admitted_on("else", 1, "s9"),    # another site
        "held": admitted_on("held", 1, "s1"),    # already in the ledger: counted there
    }
    ledger = NodeLedger(node="n3", allocations=[hold("held", 3)])
    (pool,) = fleet_view([free], [ledger], admissions, now=NOW).pools
    assert pool.free_gpus == 2  # 5 GPUs, one held, two waiting


def test_an_admission_that_may_run_on_several_models_waits_where_it_was_estimated():
    """A contract lists every model that keeps its terms, the estimated one first: it is
    counted in that pool's queue. Skipped for listing more than one, it was in no queue,
    and the GPUs it will take were promised again."""
    a100 = NodeTopology(node="n3", site="s1", gpus=[GpuInfo(index=i, model="A100-40GB") for i in range(3)])
    h100 = NodeTopology(node="n4", site="s1", gpus=[GpuInfo(index=i, model="H100") for i in range(3)])
    task = TaskSubmitted(task_id="two", gpus=2, gpu_models=["A100-40GB", "H100"])
    admissions = {"two": TaskAdmitted(task=task, contract=Contract(gpu_models=["A100-40GB", "H100"], site="s1"),
                                      tenant="t", admitted_at=NOW - 5)}
    pools = {p.gpu_model: p.free_gpus for p in fleet_view([a100, h100], [], admissions, now=NOW).pools}
    assert pools == {"A100-40GB": 1, "H100": 3}


def test_a_queue_longer_than_the_free_gpus_takes_the_earliest_completions():
    busy = NodeTopology(node="n1", site="s1", gpus=[GpuInfo(index=i, model="A100-40GB") for i in range(3)])
    admissions = {f"run{i}": admitted_on(f"run{i}", 1, "s1", duration_s=600 * (i + 1)) for i in range(3)}
    admissions |= {f"wait{i}": admitted_on(f"wait{i}", 1, "s1") for i in range(2)}
    ledger = NodeLedger(node="n1", allocations=[
        Allocation(task_id=f"run{i}", decision_id="d", gpu=i, milli=1000, at=NOW) for i in range(3)])
    (pool,) = fleet_view([busy], [ledger], admissions, now=NOW).pools
    # Two tasks wait for this pool: the GPUs freeing at 600 s and 1200 s are theirs; a new
    # request's first chance is the one freeing at 1800 s.
    assert pool.free_gpus == 0
    assert pool.completions == ((1800.0, 1),)


def test_a_backlog_deeper_than_the_running_completions_is_a_longer_wait_not_a_refusal():
    """Two GPUs busy for 100 s more, three one-GPU tasks of 100 s queued for them: each
    waiting task took a GPU and never gave it back, so the third found no completion left,
    every pool read "never frees enough GPUs" and a fleet with a backlog refused new work."""
    busy = NodeTopology(node="n1", site="s1", gpus=[GpuInfo(index=i, model="A100-40GB") for i in range(2)])
    admissions = {f"run{i}": admitted_on(f"run{i}", 1, "s1", duration_s=100) for i in range(2)}
    admissions |= {f"wait{i}": admitted_on(f"wait{i}", 1, "s1", duration_s=100) for i in range(3)}
    ledger = NodeLedger(node="n1", allocations=[
        Allocation(task_id=f"run{i}", decision_id="d", gpu=i, milli=1000, at=NOW) for i in range(2)])
    view = fleet_view([busy], [ledger], admissions, now=NOW)
    # The waiting run at 100 s on both GPUs, the third at 200 s: they free at 200 s and 300 s.
    assert (view.pools[0].free_gpus, view.pools[0].completions) == (0, ((200.0, 1), (300.0, 1)))
    late = TaskSubmitted(task_id="late", gpus=1, gpu_models=["A100-40GB"], expected_duration_s=60,
                         sla=SlaRequest(tier="standard", max_queue_s=600))
    decision = negotiate(late, view, now=NOW)
    assert not isinstance(decision, Reject), decision
    assert decision.contract.not_before == NOW + 200


def test_a_short_deadline_behind_a_waiting_wide_task_is_admitted_into_its_gap():
    """A 4-GPU node with three GPUs free and one busy for an hour more; a 4-GPU task of two
    hours waits for it. A 20-minute run with a deadline in 40 minutes fits on the idle GPUs
    before the wide task starts, where the policy backfills it: the view shows those gaps,
    and the negotiator admits it to start now. Played behind the wide task, it was refused."""
    node = NodeTopology(node="n1", site="s1", gpus=[GpuInfo(index=i, model="A100-40GB") for i in range(4)])
    ledger = NodeLedger(node="n1", allocations=[Allocation(task_id="run", decision_id="d", gpu=3, milli=1000,
                                                           at=NOW)])
    admissions = {"run": admitted_on("run", 1, "s1", duration_s=3_600),
                  "wide": admitted_on("wide", 4, "s1", duration_s=7_200)}
    pool = fleet_view([node], [ledger], admissions, now=NOW).pools[0]
    assert (pool.free_gpus, pool.completions, pool.gaps) == (0, ((10_800.0, 4),), ((0.0, 3_600.0),) * 3)
    short = TaskSubmitted(task_id="short", gpus=1, gpu_models=["A100-40GB"], expected_duration_s=1_200,
                          sla=SlaRequest(tier="standard", deadline=NOW + 2_400))
    decision = negotiate(short, fleet_view([node], [ledger], admissions, now=NOW), now=NOW)
    assert isinstance(decision, Admit) and decision.contract.not_before is None, decision


def test_a_request_waits_only_behind_the_tasks_the_policy_serves_before_it():
    """The policy's queue serves a short run before a long one that came a little earlier
    (expected completion, ``queue_key``), and a vip before both. A short task with a
    deadline was estimated behind every waiting admission and refused though the policy
    would have started it first."""
    from fleetpilot.policy.backfill import queue_key

    busy = NodeTopology(node="n1", site="s1", gpus=[GpuInfo(index=0, model="A100-40GB")])
    ledger = NodeLedger(node="n1", allocations=[Allocation(task_id="run", decision_id="d", gpu=0, milli=1000,
                                                           at=NOW)])
    admissions = {"run": admitted_on("run", 1, "s1", duration_s=600),
                  "long": admitted_on("long", 1, "s1", duration_s=36_000)}  # admitted 5 s ago
    everyone = fleet_view([busy], [ledger], admissions, now=NOW).pools[0]
    assert everyone.completions == ((36_600.0, 1),)
    short = fleet_view([busy], [ledger], admissions, now=NOW, ahead_of=queue_key("standard", NOW, 600)).pools[0]
    assert short.completions == ((600.0, 1),)  # served before the long one
    longer = fleet_view([busy], [ledger], admissions, now=NOW, ahead_of=queue_key("standard", NOW, 72_000)).pools[0]
    assert longer.completions == ((36_600.0, 1),)
    vip = fleet_view([busy], [ledger], admissions, now=NOW, ahead_of=queue_key("vip", NOW, 72_000)).pools[0]
    assert vip.completions == ((600.0, 1),)


def test_play_queue_seats_each_waiting_task_on_the_gpus_that_free_first():
    from fleetpilot.sla.snapshot import play_queue

    # Two free, two freeing at 50 s and 80 s. A 3-GPU task of 100 s starts at 50 s (its
    # third GPU) and frees all three at 150 s, the two free ones idle until it starts; a
    # 1-GPU task of unknown length fits no gap and keeps the GPU freeing at 80 s; a new
    # request is left the three at 150 s and the two gaps.
    played = play_queue(2, [80.0, 50.0], [(3, 1000, 100.0), (1, 1000, None)])
    assert played == (0, [150.0, 150.0, 150.0], [(0.0, 50.0), (0.0, 50.0)])
    assert play_queue(3, [10.0], []) == (3, [10.0], [])
    # A task the pool cannot seat (5 GPUs of 4) waits for ever: it holds what there is.
    assert play_queue(2, [10.0, 20.0], [(5, 1000, 30.0)]) == (0, [], [])


def test_play_queue_backfills_short_tasks_before_a_wide_one_starts():
    from fleetpilot.sla.snapshot import play_queue

    # An 8-GPU task of 2 h waits for its eighth GPU (free at 3,600 s): five are free now and
    # two free at 600 s and 1,200 s, idle until it starts. A 1-GPU task of 10 minutes and a
    # 2-GPU task of 15 run in those gaps now, as the policy backfills them, ending before the
    # wide task starts; they delay nothing, so the GPUs still free for good at 10,800 s.
    # Played in turn instead, both waited for the wide task's end, three hours away.
    played = play_queue(5, [600.0, 1200.0, 3600.0], [(8, 1000, 7200.0), (1, 1000, 600.0), (2, 1000, 900.0)])
    assert played.free == 0
    assert played.frees == [10_800.0] * 8
    assert played.gaps == [(0.0, 3600.0)] * 2 + [(600.0, 3600.0)] * 2 + [(900.0, 3600.0)] * 2 + [(1200.0, 3600.0)]
    # A task too long for every gap waits for the wide task's end, and delays it not.
    longer = play_queue(5, [600.0, 1200.0, 3600.0], [(8, 1000, 7200.0), (1, 1000, 4000.0)])
    assert longer.frees == [10_800.0] * 7 + [14_800.0]
    assert len(longer.gaps) == 7


def test_play_queue_packs_shares_of_one_gpu_as_the_policy_does():
    from fleetpilot.sla.snapshot import play_queue

    # Three tasks of 0.3 GPU share the one free GPU (it frees when the longest ends, at
    # 90 s); the fourth does not fit beside them and takes the GPU freeing at 40 s. Counted a
    # whole GPU each, they left a new request nothing before 70 s.
    shares = [(1, 300, 60.0), (1, 300, 90.0), (1, 300, 30.0), (1, 300, 30.0)]
    assert play_queue(1, [40.0, 200.0], shares) == (0, [70.0, 90.0, 200.0], [])
    # One of unknown duration keeps the GPU it shares; a whole-GPU task between two shares
    # closes the shared GPU (the policy places in order): the third share waits for the
    # first's GPU, free at 10 s, and ends at 20 s with the whole-GPU task.
    assert play_queue(2, [], [(1, 500, None), (1, 500, 10.0)]) == (1, [], [])
    assert play_queue(2, [], [(1, 500, 10.0), (1, 1000, 20.0), (1, 500, 10.0)]) == (0, [20.0, 20.0], [])


def test_gpus_out_of_service_are_no_capacity_to_promise():
    # Of five GPUs: one cordoned, one pending maintenance, one whose label was cleared
    # ("false"); a second node gone silent (every GPU unreachable), nothing held on either.
    labels = {0: {"cordoned": "true"}, 1: {"maintenance_pending": "true"}, 2: {"cordoned": "false"}}
    partly = NodeTopology(node="n1", site="s1", gpus=[
        GpuInfo(index=i, model="A100-40GB", memory_mb=40_960, labels=labels.get(i, {})) for i in range(5)])
    silent = NodeTopology(node="n2", site="s1", gpus=[
        GpuInfo(index=i, model="A100-40GB", memory_mb=40_960, labels={"unreachable": "true"}) for i in range(4)])
    busy = NodeLedger(node="n1", allocations=[hold("be", 0)])  # draining off the cordoned GPU
    view = fleet_view([partly, silent], [busy], {"be": admitted("be", "best_effort", 100.0)}, now=NOW,
                      knobs=SnapshotKnobs(reserve_fraction=0.0))
    (pool,) = view.pools
    assert pool.free_gpus == 3 and pool.memory_mb_per_gpu == 40_960
    # Its task ends, but the cordoned GPU will take nothing new: no completion, no preemption.
    assert pool.completions == () and pool.preemptible_gpus == 0


def test_a_cached_view_equals_one_built_afresh_through_every_kind_of_change():
    import msgspec
    from fleetpilot.sla.snapshot import SnapshotCache

    other = NodeTopology(node="n2", site="s2", gpus=[GpuInfo(index=0, model="H100", memory_mb=81_920)])
    nodes = {"n1": NODE, "n2": other}
    ledgers = {"n1": LEDGER}
    contracts = dict(CONTRACTS)
    cache = SnapshotCache()
    cordoned = msgspec.structs.replace(NODE, gpus=[msgspec.structs.replace(g, labels={"cordoned": "true"})
                                                   if g.index == 0 else g for g in NODE.gpus])
    steps = [
        lambda: None,                                                           # nothing changed
        lambda: ledgers.update(n2=NodeLedger(node="n2", allocations=[hold("new", 0)])),  # a hold, no contract
        lambda: contracts.update(new=admitted("new", "best_effort", 30.0)),     # its contract arrives
        lambda: contracts.update(be=admitted("be", "standard", 100.0)),         # a holder's contract replaced
        lambda: nodes.update(n1=cordoned),                                      # a label on a GPU
        lambda: ledgers.pop("n1"),                                              # every hold of n1 gone
        lambda: nodes.pop("n2"),                                                # a node leaves
    ]
    for step in steps:
        step()
        args = (nodes.values(), ledgers.values(), contracts)
        assert fleet_view(*args, now=NOW, cache=cache) == fleet_view(*args, now=NOW), step
    assert fleet_view(nodes.values(), ledgers.values(), contracts, now=NOW, cache=cache).pools[0].free_gpus == 4


def test_a_cached_view_of_many_blocks_equals_one_built_afresh_as_nodes_change_come_and_go():
    # The cache folds the nodes block by block (``BLOCK_NODES``): a change to one node folds its
    # block again; a node that comes or goes shifts every block after it.
    import random

    from fleetpilot.sla.snapshot import BLOCK_NODES, SnapshotCache

    rng = random.Random(5)

    def node(i: int) -> NodeTopology:
        model, site = ("A100-40GB", "s1") if i % 3 else ("H100", "s2")
        return NodeTopology(node=f"n{i:03d}", site=site, cpu_milli=64_000 + 1000 * (i % 4),
                            gpus=[GpuInfo(index=g, model=model, memory_mb=40_960 + 1024 * (i % 5))
                                  for g in range(1 + i % 8)])

    nodes = {f"n{i:03d}": node(i) for i in range(3 * BLOCK_NODES + 7)}
    ledgers: dict[str, NodeLedger] = {}
    contracts: dict[str, TaskAdmitted] = {}
    cache = SnapshotCache()
    for step in range(60):
        name = rng.choice(sorted(nodes))
        change = rng.randrange(5)
        if change == 0:  # a task starts there
            task = f"t{step}"
            contracts[task] = admitted(task, rng.choice(["best_effort", "standard"]), rng.choice([None, 50.0, 500.0]))
            held = ledgers.get(name, NodeLedger(node=name)).allocations
            ledgers[name] = NodeLedger(node=name, allocations=[*held, hold(task, rng.randrange(len(nodes[name].gpus)),
                                                                            milli=rng.choice([250, 1000]))])
        elif change == 1:  # every task there ends
            ledgers.pop(name, None)
        elif change == 2:  # a node leaves
            nodes.pop(name)
            ledgers.pop(name, None)
        elif change == 3:  # a node joins
            i = 1000 + step
            nodes[f"n{i:03d}"] = node(i)
        else:  # a holder's contract is replaced
            if contracts:
                task = rng.choice(sorted(contracts))
                contracts[task] = admitted(task, "standard", 80.0)
        ordered = [nodes[n] for n in sorted(nodes)]
        args = (ordered, list(ledgers.values()), contracts)
        assert fleet_view(*args, now=NOW, cache=cache) == fleet_view(*args, now=NOW), step


def test_a_task_asking_more_gpus_than_any_node_has_is_refused_not_queued_for_ever():
    # Two idle 4-GPU nodes: 8 free GPUs in the pool, and a 6-GPU task was admitted on them,
    # then queued by the policy ("no node has room now") for as long as it waited.
    from fleetpilot.sla import Admit, Reject, negotiate  # noqa: PLC0415

    nodes = [NodeTopology(node=n, site="s1", gpus=[GpuInfo(index=i, model="A100-40GB", memory_mb=40_960)
                                                   for i in range(4)]) for n in ("n1", "n2")]
    cordoned = NodeTopology(node="n2", site="s1", gpus=[GpuInfo(index=i, model="A100-40GB", memory_mb=40_960,
                                                                labels={"cordoned": "true"}) for i in range(4)])
    view = fleet_view(nodes, [], {}, now=NOW)
    (pool,) = view.pools
    assert (pool.free_gpus, pool.most_gpus_on_a_node) == (8, 4)
    verdict = negotiate(TaskSubmitted(task_id="big", gpus=6, gpu_memory_mb=1000), view, now=NOW)
    assert verdict == Reject("infeasible", "no node has 6 GPUs of 1000 MB or more", "big")
    assert isinstance(negotiate(TaskSubmitted(task_id="four", gpus=4, gpu_memory_mb=1000), view, now=NOW), Admit)
    # A node's GPUs out of service for now still count: they may be back.
    (pool,) = fleet_view([nodes[0], cordoned], [], {}, now=NOW).pools
    assert pool.most_gpus_on_a_node == 4


def test_a_task_no_node_has_the_cpu_or_memory_for_is_not_admitted_to_its_pool():
    """A task's CPU and host memory are on the node of its GPUs. On openb a vip asking 8
    GPUs, 120 cores and 640 GB was admitted to the G2 pool, whose 8-GPU nodes have 96 cores:
    the policy found it no node for three hours, to the end of the run. Now only a pool
    with a node that has all three is estimated on; where none has, the task is refused."""
    from fleetpilot.sla import Admit, Reject, negotiate  # noqa: PLC0415
    from fleetpilot.sla.fleet import node_frontier  # noqa: PLC0415

    def eight(name: str, model: str, cpu_milli: int, memory_mb: int) -> NodeTopology:
        return NodeTopology(node=name, site="s1", cpu_milli=cpu_milli, memory_mb=memory_mb,
                            gpus=[GpuInfo(index=i, model=model, memory_mb=32_768) for i in range(8)])

    nodes = [eight("g2a", "G2", 96_000, 393_216), eight("g2b", "G2", 64_000, 524_288),
             eight("g3", "G3", 128_000, 786_432)]
    pools = {p.gpu_model: p for p in fleet_view(nodes, [], {}, now=NOW).pools}
    assert pools["G2"].node_shapes == ((8, 64_000, 524_288), (8, 96_000, 393_216))
    assert pools["G2"].holds(8, 90_000, 300_000) and not pools["G2"].holds(8, 90_000, 400_000)
    big = TaskSubmitted(task_id="big", gpus=8, gpu_models=["G2", "G3"], cpu_milli=120_200, memory_mb=640_000)
    verdict = negotiate(big, fleet_view(nodes, [], {}, now=NOW), now=NOW)
    assert isinstance(verdict, Admit) and verdict.contract.gpu_models == ["G3"], verdict
    only_g2 = fleet_view(nodes[:2], [], {}, now=NOW)
    assert negotiate(big, only_g2, now=NOW) == Reject(
        "infeasible", "no node with 8 GPUs of 0 MB or more also has 120200 CPU milli and 640000 MB of memory", "big")
    # A node outdone in all three by another says nothing more.
    assert node_frontier([(8, 96_000, 393_216), (4, 48_000, 196_608), (8, 96_000, 393_216)]) == ((8, 96_000, 393_216),)


def test_a_run_past_its_expected_end_is_not_promised_as_freeing_now():
    # "be" began 40 s ago for 100 s: on time. "late" began 130 s ago for 100 s: 30 s over,
    # so as long again; "just" is 1 s over a 100 s run: a tenth of its duration at least.
    ledger = NodeLedger(node="n1", allocations=[hold("be", 0), hold("late", 1, at=NOW - 130),
                                                hold("just", 2, at=NOW - 101)])
    contracts = {**CONTRACTS, "late": admitted("late", "standard", 100.0), "just": admitted("just", "standard", 100.0)}
    (pool,) = fleet_view([NODE], [ledger], contracts, now=NOW).pools
    assert pool.completions == ((10.0, 1), (30.0, 1), (60.0, 1))


# Open counter-offers ------------------------------------------------------------------------
# Two A100-40GB at s1, one of them busy for 300 s more; two H100 at s2, both busy for 120 s
# more. A task asking one H100 within 5 s cannot have it: it is offered the free A100 now
# (one relaxed term, no wait) first, then the H100 in 120 s.

BURST_NODES = [
    NodeTopology(node="a", site="s1", gpus=[GpuInfo(index=i, model="A100-40GB", memory_mb=40_960) for i in range(2)]),
    NodeTopology(node="h", site="s2", gpus=[GpuInfo(index=i, model="H100", memory_mb=81_920) for i in range(2)]),
]
BURST_LEDGERS = [NodeLedger(node="a", allocations=[hold("a-run", 0, at=NOW)]),
                 NodeLedger(node="h", allocations=[hold("h-run", 0, at=NOW), hold("h-run", 1, at=NOW)])]
BURST_CONTRACTS = {"a-run": admitted("a-run", "standard", 300.0), "h-run": admitted("h-run", "standard", 120.0)}


@dataclass(frozen=True)
class Offered:
    """A counter-offer as the sla service stores it (``OfferRecord``), as a plain record."""

    offer: SlaOffer
    task: TaskSubmitted
    state: str = "open"


def h100_soon(task_id: str) -> TaskSubmitted:
    return TaskSubmitted(task_id=task_id, gpus=1, gpu_memory_mb=20_000, gpu_models=["H100"],
                         sla=SlaRequest(tier="standard", max_queue_s=5))


def burst_view(offers=(), contracts=BURST_CONTRACTS, now=NOW):
    return fleet_view(BURST_NODES, BURST_LEDGERS, contracts, now=now, offers=offers)


def offered(task: TaskSubmitted, offers=(), now=NOW) -> Offered:
    """Negotiate ``task`` against the burst fleet with ``offers`` open; its offer, as stored."""
    counter = negotiate(task, burst_view(offers, now=now), now=now, policy=NegotiationPolicy(offer_ttl_s=30))
    assert isinstance(counter, CounterOffer), counter
    return Offered(offer=OfferBook(clock=lambda: now).open(task, counter), task=task)


def pools(view) -> dict[str, object]:
    return {p.gpu_model: p for p in view.pools}


def test_a_burst_is_not_offered_the_gpu_an_open_offer_holds():
    first = offered(h100_soon("first"))
    assert [(o.gpu_model, o.expected_queue_s) for o in first.offer.options] == [("A100-40GB", 0), ("H100", 120)]
    # The second, a moment later while the first's client thinks: the free A100 is held for
    # the first; its next chance there is when the busy A100 frees, in 300 s.
    second = offered(h100_soon("second"), [first], now=NOW + 1)
    assert [(o.gpu_model, o.expected_queue_s) for o in second.offer.options] == [("H100", 119), ("A100-40GB", 299)]
    # Its first option, a wait, holds the earliest completion: a third has the other H100
    # then, and nothing of the A100 pool before the busy one frees.
    view = burst_view([first, second], now=NOW + 2)
    assert pools(view)["H100"].completions == ((118.0, 1),)
    assert (pools(view)["A100-40GB"].free_gpus, pools(view)["A100-40GB"].completions) == (0, ((298.0, 1),))


def test_an_offer_holds_its_first_option_only():
    first = offered(h100_soon("first"))
    view = burst_view([first])
    assert pools(view)["A100-40GB"].free_gpus == 0
    assert pools(view)["H100"].completions == ((120.0, 2),)  # its second option holds nothing


@pytest.mark.parametrize("how", ["declined", "expired", "past_valid_until"])
def test_a_declined_or_expired_offer_holds_nothing(how):
    first = offered(h100_soon("first"))
    now = NOW
    if how == "past_valid_until":  # not closed yet by the expiry job, but a reply would be refused
        now = first.offer.valid_until + 0.001
    else:
        first = Offered(offer=first.offer, task=first.task, state=how)
    view = burst_view([first], now=now)
    assert pools(view)["A100-40GB"].free_gpus == 1
    again = negotiate(h100_soon("next"), view, now=now)
    assert isinstance(again, CounterOffer) and (again.options[0].gpu_model, again.options[0].expected_queue_s) == (
        "A100-40GB", 0)


def test_an_open_offer_holds_until_its_valid_until():
    first = offered(h100_soon("first"))
    assert pools(burst_view([first], now=first.offer.valid_until))["A100-40GB"].free_gpus == 0


def test_an_accepted_offer_is_counted_once_as_the_admission_it_became():
    first = offered(h100_soon("first"))
    # The admission the acceptance of o1 makes, pinned to the option's model and site.
    option = first.offer.options[0]
    contract = contract_for(first.task, option, first.offer.offer_id)
    accepted = TaskAdmitted(task=msgspec.structs.replace(first.task, gpu_models=[option.gpu_model]),
                            contract=contract, tenant="t", admitted_at=NOW)
    contracts = {**BURST_CONTRACTS, "first": accepted}
    # Whether a replica's view still has the offer open (the contract seen first) or closed.
    for record in (first, Offered(offer=first.offer, task=first.task, state="accepted")):
        a100 = pools(burst_view([record], contracts))["A100-40GB"]
        assert (a100.free_gpus, a100.completions) == (0, ((300.0, 1),)), record.state


def test_when_the_holds_lapse_is_the_last_holding_offers_valid_until():
    first = offered(h100_soon("first"))
    second = offered(h100_soon("second"), [first], now=NOW + 1)
    assert offers_hold_until([first, second], BURST_CONTRACTS, NOW + 2) == second.offer.valid_until == NOW + 31
    declined = Offered(offer=second.offer, task=second.task, state="declined")
    assert offers_hold_until([first, declined], BURST_CONTRACTS, NOW + 2) == first.offer.valid_until
    assert offers_hold_until([first, second], BURST_CONTRACTS, NOW + 40) is None  # both past valid_until
