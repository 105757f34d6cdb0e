"""EASY backfill over plain tables: when GPUs free, which node a blocked task reserves, and
what a policy sees while the reservation is hidden."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from fleetpilot.contracts import GpuInfo, NodeTopology
from fleetpilot.policy import ClusterState, TaskRequest, build_policy
from fleetpilot.policy.backfill import (
    UNDECLARED_S,
    Demand,
    Reservation,
    Room,
    Tenant,
    clearing,
    completion_order,
    gpu_free_at,
    hidden,
    hidden_from,
    leaves_room,
    queue_key,
    reserve,
    reserve_apart,
    reserve_earliest,
)


def fleet() -> ClusterState:
    """n0: 4 x A100 (40 GB), n1: 4 x H100 (80 GB), n2: 2 x H100 with little CPU."""
    return ClusterState.build(names=["n0", "n1", "n2"], cpu_milli=[64000, 64000, 4000], memory_mb=[512000] * 3,
                              gpus=[4, 4, 2], models=["A100-40GB", "H100", "H100"],
                              gpu_memory_mb=[40960, 81920, 81920])


# Running tasks: (row, gpus, expected end). now = 100.
RUNNING = [(0, [0, 1], 500.0), (0, [2], 300.0), (1, [0], 200.0), (1, [1, 2], 900.0), (2, [0], 50.0)]


def test_free_at_is_the_last_tenants_end_never_before_now_and_never_for_a_missing_or_failed_gpu() -> None:
    state = fleet()
    state.gpu_healthy[0, 3] = False
    free_at = gpu_free_at(state, RUNNING + [(0, [2], 400.0)], now=100.0)
    expected = np.array([[500, 500, 400, math.inf], [200, 900, 900, 100], [100, 100, math.inf, math.inf]])
    assert np.array_equal(free_at, expected)


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        # Two GPUs: n0 at 500 (GPU 3 is idle, GPU 2 frees at 300 -> 300), n1 at 200, n2 at 100
        # (c's estimate is past: "any moment"). n2 is earliest.
        (TaskRequest(task_id="w", gpus=2), Reservation(task_id="w", node="n2", gpus=(0, 1), start_s=100.0)),
        # Too much CPU for n2: n1's GPUs 0 and 3 at 200 beat n0's 2 and 3 at 300.
        (TaskRequest(task_id="w", gpus=2, cpu_milli=8000), Reservation(task_id="w", node="n1", gpus=(0, 3), start_s=200.0)),
        # A100 only: n0, GPUs 3 (idle) and 2 (300); four of them only once all end (500).
        (TaskRequest(task_id="w", gpus=2, gpu_models=("A100-40GB",)), Reservation(task_id="w", node="n0", gpus=(2, 3), start_s=300.0)),
        (TaskRequest(task_id="w", gpus=4, gpu_models=("A100-40GB",)), Reservation(task_id="w", node="n0", gpus=(0, 1, 2, 3), start_s=500.0)),
        # 60 GB per GPU: only the H100s hold it.
        (TaskRequest(task_id="w", gpus=3, gpu_memory_mb=60000), Reservation(task_id="w", node="n1", gpus=(0, 1, 3), start_s=900.0)),
    ],
)
def test_reserve_takes_the_earliest_start_among_the_nodes_the_task_could_use(request_: TaskRequest,
                                                                            expected: Reservation) -> None:
    state = fleet()
    assert reserve(state, request_, gpu_free_at(state, RUNNING, now=100.0)) == expected


def test_a_task_bound_to_a_site_reserves_there_only() -> None:
    # n2 (site b) frees first, at 100; bound to site a, the task waits for n1 at 200.
    state = ClusterState.build(names=["n0", "n1", "n2"], cpu_milli=[64000, 64000, 4000], memory_mb=[512000] * 3,
                               gpus=[4, 4, 2], models=["A100-40GB", "H100", "H100"], sites=["a", "a", "b"],
                               gpu_memory_mb=[40960, 81920, 81920])
    free_at = gpu_free_at(state, RUNNING, now=100.0)
    assert reserve(state, TaskRequest(task_id="w", gpus=2), free_at).node == "n2"
    assert reserve(state, TaskRequest(task_id="w", gpus=2, site="a"), free_at) == Reservation(
        task_id="w", node="n1", gpus=(0, 3), start_s=200.0)
    assert reserve(state, TaskRequest(task_id="w", gpus=2, site="nowhere"), free_at) is None


def test_a_task_bound_to_several_sites_is_reserved_at_the_one_where_it_starts_first() -> None:
    # Sites in the contract's order "nowhere" (no node), "a" (n1 at 200), "b" (n2 at 100).
    state = ClusterState.build(names=["n0", "n1", "n2"], cpu_milli=[64000, 64000, 4000], memory_mb=[512000] * 3,
                               gpus=[4, 4, 2], models=["A100-40GB", "H100", "H100"], sites=["a", "a", "b"],
                               gpu_memory_mb=[40960, 81920, 81920])
    free_at = gpu_free_at(state, RUNNING, now=100.0)
    at = {site: TaskRequest(task_id="w", gpus=2, site=site) for site in ("nowhere", "a", "b")}
    assert reserve_earliest(state, [at["nowhere"], at["a"], at["b"]], free_at) == (
        Reservation(task_id="w", node="n2", gpus=(0, 1), start_s=100.0), at["b"])
    assert reserve_earliest(state, [at["nowhere"], at["a"]], free_at) == (
        Reservation(task_id="w", node="n1", gpus=(0, 3), start_s=200.0), at["a"])
    # On a tie the contract's order decides: both sites' requests reserve the same node.
    assert reserve_earliest(state, [at["a"], msgspec.structs.replace(at["a"], task_id="w")], free_at)[1] is at["a"]
    assert reserve_earliest(state, [at["nowhere"]], free_at) is None
    assert reserve_earliest(state, [], free_at) is None


def test_more_reservations_only_on_nodes_no_earlier_reserved_task_could_use() -> None:
    state = fleet()  # n0: A100s; n1 and n2: H100s (n2 with little CPU)
    free_at = gpu_free_at(state, RUNNING, now=100.0)
    a100 = TaskRequest(task_id="a", gpus=2, gpu_models=("A100-40GB",))
    h100 = [[TaskRequest(task_id="h", gpus=2, gpu_models=("H100",))]]
    anywhere = [[TaskRequest(task_id="any", gpus=2)]]
    # The H100 task shares no node with the A100 one: reserved apart, on n2 at 100.
    assert reserve_apart(state, [a100], h100, free_at) == [
        Reservation(task_id="h", node="n2", gpus=(0, 1), start_s=100.0)]
    # One that could use n0 too would wait on the first's GPUs: none; nor past the limit.
    assert reserve_apart(state, [a100], anywhere + h100, free_at) == [
        Reservation(task_id="h", node="n2", gpus=(0, 1), start_s=100.0)]
    assert reserve_apart(state, [a100], h100, free_at, limit=0) == []
    # A later task sharing nodes with an earlier one apart gets none either.
    assert len(reserve_apart(state, [a100], h100 + [[msgspec.structs.replace(h100[0][0], task_id="h2")]], free_at)) == 1


def test_a_task_is_kept_off_every_reservation_it_would_delay_and_only_those() -> None:
    state = fleet()
    early = Reservation(task_id="x", node="n0", gpus=(0,), start_s=150.0)
    late = Reservation(task_id="y", node="n1", gpus=(0,), start_s=1000.0)
    with hidden_from(state, [early, late, None], "t", 200.0, now=100.0):  # ends at 300
        assert state.gpu_maintenance[0, 0] and not state.gpu_maintenance[1, 0]
    assert not state.gpu_maintenance.any()
    with hidden_from(state, [early, late], "y", None, now=100.0):  # y owns late; runs for ever
        assert state.gpu_maintenance[0, 0] and not state.gpu_maintenance[1, 0]


@pytest.mark.parametrize("request_", [TaskRequest(task_id="s", gpus=1, gpu_milli=500),  # a share
                                      TaskRequest(task_id="w", gpus=8),  # wider than any node
                                      TaskRequest(task_id="w", gpus=1, gpu_models=("T4",))])  # no such model
def test_no_reservation_for_a_share_or_a_task_no_node_can_ever_hold(request_: TaskRequest) -> None:
    state = fleet()
    assert reserve(state, request_, gpu_free_at(state, RUNNING, now=100.0)) is None


def test_no_reservation_when_every_candidate_gpu_is_held_by_a_task_that_never_ends() -> None:
    state = fleet()
    forever = [(r, list(range(4)), math.inf) for r in range(3)]
    assert reserve(state, TaskRequest(task_id="w", gpus=1), gpu_free_at(state, forever, now=0.0)) is None


@pytest.mark.parametrize(("task_id", "duration", "now", "delayed"),
                         [("x", 50.0, 100.0, False), ("x", 150.0, 100.0, True), ("x", None, 100.0, True),
                          ("w", 10_000.0, 100.0, False)])
def test_only_a_task_that_outlasts_the_start_is_kept_off(task_id: str, duration: float | None, now: float,
                                                         delayed: bool) -> None:
    held = Reservation(task_id="w", node="n1", gpus=(0,), start_s=200.0)
    assert held.delayed_by(task_id, duration, now) is delayed


def test_a_policy_does_not_see_hidden_gpus_and_the_state_is_restored_after() -> None:
    state = fleet()
    for row, gpus, _ in RUNNING:
        state.allocate(row, gpus, 1000)
    policy = build_policy("bestfit", seed=0)
    task = TaskRequest(task_id="x", gpus=1, gpu_models=("H100",))
    before = policy.decide(state, task)
    assert (before.node_row, before.placement[0].gpu) == (2, 1)  # the tightest H100 node
    version = state.version.copy()
    with hidden(state, Reservation(task_id="w", node="n2", gpus=(1,), start_s=1e9)):
        decision = policy.decide(state, task)
    assert (decision.node_row, decision.placement[0].gpu) == (1, 3)
    assert not state.gpu_maintenance.any()
    assert state.version[2] == version[2] + 2 and state.version[1] == version[1]
    with hidden(state, Reservation(task_id="w", node="gone", gpus=(0,), start_s=0.0)):
        assert not state.gpu_maintenance.any()


BASE = TaskRequest(task_id="f", kind="train", gpus=1, gpu_milli=1000, gpu_memory_mb=8000, cpu_milli=4000,
                   memory_mb=16000, gpu_models=("A100-40GB", "H100"))


@pytest.mark.parametrize(("change", "skipped"), [
    ({}, True),                                                  # the same request
    ({"gpus": 2, "cpu_milli": 8000}, True),                      # more of everything
    ({"gpu_models": ("H100",)}, True),                           # fewer models accepted
    ({"gpu_models": ()}, False),                                 # any model: more places to try
    ({"gpu_models": ("A100-40GB", "T4")}, False),                # a model the failed one did not take
    ({"cpu_milli": 2000}, False),                                # less CPU
    ({"gpu_milli": 500}, False),                                 # a share fits where a whole GPU does not
    ({"kind": "infer"}, False),                                  # other kinds: other GPUs by business rules
    ({"labels": {"driver": "535"}}, False),                      # likewise a driver
])
def test_a_request_needing_no_less_than_a_failed_one_is_skipped(change: dict, skipped: bool) -> None:
    failed = Demand.of(BASE)
    assert Demand.of(msgspec.structs.replace(BASE, task_id="t", **change)).cannot_fit_after(failed) is skipped


def test_the_device_plugins_view_counts_a_share_as_a_whole_gpu() -> None:
    share = msgspec.structs.replace(BASE, gpu_milli=250)
    assert Demand.of(share).milli == 250 and Demand.of(share, whole_gpus=True).milli == 1000
    assert Demand.of(share, whole_gpus=True).cannot_fit_after(Demand.of(BASE))


# ---- completion order ----------------------------------------------------------------------

def test_completion_order_puts_short_work_first_but_never_lets_later_long_work_overtake() -> None:
    long_early = completion_order(0.0, 3600.0)
    short_later = completion_order(600.0, 300.0)
    long_later = completion_order(600.0, 3600.0)
    assert short_later < long_early < long_later
    # A task arriving after the long one would have ended cannot overtake it, however short.
    assert completion_order(3601.0, 0.0) > long_early
    assert completion_order(0.0, None) == UNDECLARED_S


def test_queue_aging_lets_later_short_work_overtake_by_more_but_still_bounds_it() -> None:
    # 10 minutes shorter, 20 minutes later: overtakes only if a wait ages at most half as fast.
    long_early, short_later = (0.0, 3600.0), (1200.0, 3000.0)
    assert completion_order(*long_early) < completion_order(*short_later)
    assert completion_order(*long_early, aging=0.25) > completion_order(*short_later, aging=0.25)
    assert queue_key("standard", *short_later, aging=0.25) < queue_key("standard", *long_early, aging=0.25)
    # Still bounded: nothing arriving more than run / aging later overtakes, however short.
    assert completion_order(3600.0 / 0.25 + 1.0, 0.0, aging=0.25) > completion_order(*long_early, aging=0.25)
    # A tier still comes first.
    assert queue_key("vip", 99_999.0, 86_400.0, aging=0.25) < queue_key("standard", *short_later, aging=0.25)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="queue aging must be above 0"):
            completion_order(0.0, 60.0, aging=bad)


# ---- clearing a node for a blocked wide task ------------------------------------------------

def two_nodes() -> ClusterState:
    """n0 and n1: 4 x H100 each, 64 CPUs; n2: 4 x T4 (16 GB)."""
    return ClusterState.build(names=["n0", "n1", "n2"], cpu_milli=[64000] * 3, memory_mb=[512000] * 3,
                              gpus=[4, 4, 4], models=["H100", "H100", "T4"], gpu_memory_mb=[81920, 81920, 16384])


def tenant(state: ClusterState, task_id: str, row: int, gpus: tuple[int, ...], *, cost: float, memory_mb: int = 8000,
           models: tuple[str, ...] = ()) -> Tenant:
    """Hold one running task in ``state`` and describe it as a tenant (whole GPUs: its cost
    is its pause)."""
    req = TaskRequest(task_id=task_id, gpus=len(gpus), gpu_memory_mb=memory_mb, cpu_milli=1000, gpu_models=models)
    state.allocate(row, gpus, 1000, cpu_milli=1000, gpu_memory_mb=memory_mb)
    return Tenant(request=req, row=row, gpus=gpus, milli=1000, gpu_memory_mb=memory_mb, pause_s=cost / len(gpus))


def held(state: ClusterState) -> tuple[np.ndarray, ...]:
    """Everything a clearing touches."""
    return state.gpu_free.copy(), state.cpu_free.copy(), state.gpu_mem_free.copy(), state.gpu_maintenance.copy()


def test_clearing_moves_the_cheapest_tenants_off_one_node_and_leaves_the_state_as_it_was() -> None:
    state = two_nodes()
    # n0: two small tasks that fit on a T4; n1: one that needs an H100 (40 GB), cheap but stuck.
    tenants = [tenant(state, "a", 0, (0,), cost=60.0), tenant(state, "b", 0, (1,), cost=90.0),
               tenant(state, "c", 1, (0,), cost=10.0, memory_mb=40000, models=("H100",)),
               tenant(state, "d", 1, (1,), cost=10.0, memory_mb=40000, models=("H100",)),
               tenant(state, "e", 1, (2,), cost=10.0, memory_mb=40000, models=("H100",))]
    wide = TaskRequest(task_id="w", gpus=4, gpu_memory_mb=30000, gpu_models=("H100",))
    before = held(state)
    plan = clearing(state, wide, tenants, build_policy("bestfit").decide, wait_s=1000.0)
    assert plan is not None
    # n1 is cheaper to empty (30) but its tenants can only go to n0's two free H100s: three
    # do not fit. n0's two go where bestfit puts them: anywhere but n0.
    assert (plan.row, plan.gpus, plan.cost) == (0, (0, 1, 2, 3), 150.0)
    assert {m.task_id for m in plan.moves} == {"a", "b"} and all(m.row != 0 for m in plan.moves)
    assert all(np.array_equal(x, y) for x, y in zip(held(state), before, strict=True))


def test_each_move_of_a_clearing_carries_the_policys_confidence_in_its_target() -> None:
    # The service publishes a clearing's moves with the confidence the policy gave each
    # target when the plan chose it (not 0.0, a goal no clearing meets).
    state = two_nodes()
    tenants = [tenant(state, "a", 0, (0,), cost=60.0), tenant(state, "b", 0, (1,), cost=90.0)]
    given = {"a": 0.71, "b": 0.83}
    policy = build_policy("bestfit")

    def decide(st: ClusterState, req: TaskRequest):
        return msgspec.structs.replace(policy.decide(st, req), confidence=given[req.task_id])

    plan = clearing(state, TaskRequest(task_id="w", gpus=4, gpu_models=("H100",)), tenants, decide, wait_s=1000.0)
    assert plan is not None and {m.task_id: m.confidence for m in plan.moves} == given


def test_no_clearing_when_it_costs_more_than_the_wait_it_saves_or_nothing_can_move() -> None:
    state = two_nodes()
    tenants = [tenant(state, "a", 0, (0,), cost=60.0), tenant(state, "b", 1, (0,), cost=90.0)]
    wide = TaskRequest(task_id="w", gpus=4, gpu_models=("H100",))
    # Emptying n0 costs a's 60 s on one GPU; the wide task still waits those 60 s: it gains
    # (wait - 60) x 4 GPU-seconds, more than 60 only for a wait over 75 s.
    assert clearing(state, wide, tenants, build_policy("bestfit").decide, wait_s=75.0) is None
    assert clearing(state, wide, tenants, build_policy("bestfit").decide, wait_s=76.0).moves[0].task_id == "a"
    # Every GPU full of tasks that need an H100: nowhere to move them.
    full = two_nodes()
    stuck = [tenant(full, f"t{r}{g}", r, (g,), cost=1.0, memory_mb=40000, models=("H100",))
             for r in (0, 1) for g in range(4)]
    assert clearing(full, wide, stuck, build_policy("bestfit").decide, wait_s=1e9) is None
    # Something that is not a tenant (not movable) holds a GPU of each node.
    pinned = two_nodes()
    pinned.allocate(0, [0], 1000)
    pinned.allocate(1, [3], 1000)
    assert clearing(pinned, wide, [tenant(pinned, "a", 0, (1,), cost=1.0)], build_policy("bestfit").decide,
                    wait_s=1e9) is None


def test_a_one_gpu_clearing_moves_a_costlier_tenant_when_the_cheapest_fits_nowhere_else() -> None:
    # Every H100 is held. On each H100 node the cheapest GPU holds a task that needs an H100
    # (nowhere else to go); another holds a task that fits a T4. A one-GPU task that needs
    # an H100 is cleared a GPU by moving the latter, though it costs more.
    state = two_nodes()
    tenants = [tenant(state, f"h{r}{g}", r, (g,), cost=10.0 + g, memory_mb=40000, models=("H100",))
               for r in (0, 1) for g in range(3)]
    tenants += [tenant(state, "small0", 0, (3,), cost=50.0), tenant(state, "small1", 1, (3,), cost=60.0)]
    one = TaskRequest(task_id="one", gpus=1, gpu_memory_mb=40000, gpu_models=("H100",))
    before = held(state)
    plan = clearing(state, one, tenants, build_policy("bestfit").decide, wait_s=1000.0)
    assert plan is not None
    assert (plan.row, plan.gpus, plan.cost) == (0, (3,), 50.0)
    assert [(m.task_id, m.row) for m in plan.moves] == [("small0", 2)]
    assert all(np.array_equal(x, y) for x, y in zip(held(state), before, strict=True))


def test_a_clearing_is_refused_when_a_tenant_moved_for_its_cpu_lands_back_on_the_node() -> None:
    # n0 has free H100s but 4 free CPUs; its tenants hold 30 CPUs each and can only go back
    # to n0 (n1 is full of tasks that need 5 CPUs, more than n0 has free). Moving one of them
    # "for its CPU" puts it on another GPU of n0: the node is no roomier, so no clearing.
    state = ClusterState.build(names=["n0", "n1"], cpu_milli=[64000, 64000], memory_mb=[512000] * 2, gpus=[4, 4],
                               models=["H100", "H100"], gpu_memory_mb=[81920, 81920])

    def hold(task_id: str, row: int, gpu: int, cpu: int, pause: float) -> Tenant:
        req = TaskRequest(task_id=task_id, gpus=1, gpu_memory_mb=8000, cpu_milli=cpu)
        state.allocate(row, (gpu,), 1000, cpu_milli=cpu, gpu_memory_mb=8000)
        return Tenant(request=req, row=row, gpus=(gpu,), milli=1000, gpu_memory_mb=8000, pause_s=pause)

    tenants = [hold("a", 0, 0, 30000, 10.0), hold("b", 0, 1, 30000, 20.0)]
    tenants += [hold(f"x{g}", 1, g, 5000, 1.0) for g in range(4)]
    one = TaskRequest(task_id="one", gpus=1, gpu_memory_mb=8000, cpu_milli=10000)
    assert clearing(state, one, tenants, build_policy("bestfit").decide, wait_s=1e6) is None


def reserved_first() -> ClusterState:
    """n0: 2 x H100 reserved for their role (business rule: no new work); n1: 2 x H100; n2:
    2 x T4."""

    def node(name: str, model: str, **labels: str) -> NodeTopology:
        return NodeTopology(node=name, cpu_milli=64000, memory_mb=512000,
                            gpus=[GpuInfo(index=i, model=model, memory_mb=81920, labels=labels) for i in range(2)])

    return ClusterState.from_topology([node("n0", "H100", role="reserved"), node("n1", "H100"), node("n2", "T4")])


def test_a_reservation_and_a_clearing_are_only_ever_on_gpus_the_task_may_use() -> None:
    # n0's GPUs free first and are cheaper to empty, but the business rules keep every task
    # off them: reserving them would hold back nothing the task can start on (and hide n1
    # from nobody), and checkpointing n0's tenant would throw its work away for a node the
    # task is never placed on.
    state = reserved_first()
    wide = TaskRequest(task_id="w", gpus=2, gpu_models=("H100",))
    tenants = [tenant(state, "a", 0, (0, 1), cost=1.0), tenant(state, "b", 1, (0, 1), cost=500.0)]
    free_at = gpu_free_at(state, [(0, [0, 1], 150.0), (1, [0, 1], 900.0)], now=100.0)
    assert reserve(state, wide, free_at) == Reservation(task_id="w", node="n1", gpus=(0, 1), start_s=900.0)
    plan = clearing(state, wide, tenants, build_policy("bestfit").decide, wait_s=1e6)
    assert plan is not None and (plan.row, [m.task_id for m in plan.moves]) == (1, ["b"])
    # A task the rules keep off every GPU gets no reservation at all.
    infer_only = ClusterState.from_topology([NodeTopology(
        node="n0", cpu_milli=64000, memory_mb=512000,
        gpus=[GpuInfo(index=0, model="H100", labels={"task_kinds": "infer"})])])
    assert reserve(infer_only, TaskRequest(task_id="t", kind="train", gpus=1),
                   gpu_free_at(infer_only, [], now=0.0)) is None


def test_a_failure_bound_to_one_site_skips_no_request_that_may_run_elsewhere() -> None:
    # A request bound to eu found no node: one that may run anywhere (or only in us) can still
    # start on another site's nodes. Skipped, it waited behind the eu task every round.
    eu = Demand.of(TaskRequest(task_id="eu", gpus=1, site="eu"))
    assert not Demand.of(TaskRequest(task_id="any", gpus=1, cpu_milli=100)).cannot_fit_after(eu)
    assert not Demand.of(TaskRequest(task_id="us", gpus=1, cpu_milli=100, site="us")).cannot_fit_after(eu)
    assert Demand.of(TaskRequest(task_id="eu2", gpus=1, cpu_milli=100, site="eu")).cannot_fit_after(eu)
    # A failure free to go anywhere bounds a request bound to one site: it has fewer nodes.
    anywhere = Demand.of(TaskRequest(task_id="any", gpus=1))
    assert Demand.of(TaskRequest(task_id="eu", gpus=1, cpu_milli=100, site="eu")).cannot_fit_after(anywhere)


def test_a_request_of_gpus_with_no_milli_needs_no_gpu_so_a_gpu_failure_does_not_skip_it() -> None:
    # gpus=1, gpu_milli=0 asks no GPU (the policies place it on CPU only): it was counted as
    # a whole GPU and skipped behind every whole-GPU request that found no node.
    whole = Demand.of(TaskRequest(task_id="w", gpus=1))
    no_gpu = TaskRequest(task_id="g0", gpus=1, gpu_milli=0, cpu_milli=100)
    assert not Demand.of(no_gpu).cannot_fit_after(whole)
    assert Demand.of(no_gpu) == Demand.of(msgspec.structs.replace(no_gpu, gpus=0))


def test_a_reservation_naming_gpus_the_snapshot_lacks_hides_those_it_has() -> None:
    # A reservation names its node, so it is read on later snapshots; one whose GPUs are past
    # the snapshot's slots (the fleet's widest node gone) crashed the round with an IndexError.
    state = ClusterState.build(names=["n0"], cpu_milli=[8000], memory_mb=[8000], gpus=[2], models=["H100"])
    with hidden(state, Reservation(task_id="w", node="n0", gpus=(1, 5), start_s=0.0)) as masked:
        assert masked.gpu_maintenance[0].tolist() == [False, True]
    assert not state.gpu_maintenance.any()


@pytest.mark.parametrize(
    ("free", "short"),
    [
        (Room(milli=300, gpu_memory_mb=20_000, cpu_milli=8000, memory_mb=65536), None),
        (Room(milli=0, gpu_memory_mb=20_000, cpu_milli=8000, memory_mb=65536), "SM"),
        (Room(milli=300, gpu_memory_mb=5_000, cpu_milli=8000, memory_mb=65536), "GPU memory"),
        (Room(milli=300, gpu_memory_mb=20_000, cpu_milli=0, memory_mb=65536), "CPU"),
        (Room(milli=300, gpu_memory_mb=20_000, cpu_milli=8000, memory_mb=0), "host memory"),
    ],
)
def test_a_tenants_going_leaves_room_for_a_share_only_when_every_resource_adds_up(free: Room, short: str | None) -> None:
    # The tenant holds 500 thousandths, 10 GB, 2 cores and 8 GB of host memory; the share asks
    # for 700, 16 GB, 4 cores and 16 GB.
    tenant = Room(milli=500, gpu_memory_mb=10_000, cpu_milli=2000, memory_mb=8192)
    share = TaskRequest(task_id="s", gpus=1, gpu_milli=700, gpu_memory_mb=16_000, cpu_milli=4000, memory_mb=16384)
    assert leaves_room(free, tenant, share) == (short is None), short
