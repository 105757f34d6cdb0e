"""Built-in policies, plugins and transformers over plain tables."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from fleetpilot.policy import (
    BUILTIN_POLICIES,
    REGISTRY,
    ClusterState,
    PluginConfigError,
    TaskRequest,
    TaskShape,
    build_policy,
    builtin_profile,
)
from fleetpilot.policy.transformers import (
    ModelPressure,
    erfc,
    memory_fragmentation,
    normal_cdf,
    numa_distance,
    oom_risk,
    role_affinity,
    thermal_headroom,
)


def cluster(rows: list[tuple[str, str, int, list[int]]]) -> ClusterState:
    """rows: (name, model, cpu_free, per-GPU free milli); CPU capacity 32000, memory 64 GB."""
    state = ClusterState.build(names=[r[0] for r in rows], cpu_milli=[32000] * len(rows),
                               memory_mb=[64000] * len(rows), gpus=[len(r[3]) for r in rows],
                               models=[r[1] for r in rows])
    for i, r in enumerate(rows):
        state.gpu_free[i, : len(r[3])] = r[3]
        state.cpu_free[i] = r[2]
    return state


FLEET = [
    ("idle8", "G2", 32000, [1000] * 8),
    ("half", "G2", 16000, [1000, 1000, 300, 0, 0, 0, 0, 0]),
    ("t4", "T4", 30000, [600, 1000]),
]
SHARE = TaskRequest(task_id="s", gpus=1, gpu_milli=250, cpu_milli=2000)
WHOLE = TaskRequest(task_id="w", gpus=1, gpu_milli=1000, cpu_milli=2000)
TWO = TaskRequest(task_id="two", gpus=2, gpu_milli=1000, cpu_milli=2000)
T4_ONLY = TaskRequest(task_id="t", gpus=1, gpu_milli=1000, gpu_models=("T4",))
CPU = TaskRequest(task_id="c", gpus=0, gpu_milli=0, cpu_milli=1000)
HUGE = TaskRequest(task_id="h", gpus=8, gpu_milli=1000, cpu_milli=40000)


@pytest.mark.parametrize(
    ("policy", "task", "node", "gpus", "milli"),
    [
        # k8s-default: least allocated node (CPU+memory), whole GPU even for a share, first index.
        ("k8s-default", SHARE, "idle8", [0], 1000),
        ("k8s-default", T4_ONLY, "t4", [1], 1000),
        # bestfit: least CPU+GPU left wins -> "half"; the tightest GPU (300 free) inside it.
        ("bestfit", SHARE, "half", [2], 250),
        ("bestfit", TWO, "half", [0, 1], 1000),
        # packing: a partly used GPU first; "half" GPU2 ratio 30 -> 100-3=97 beats t4's 60 -> 94.
        ("packing", SHARE, "half", [2], 250),
        ("packing", T4_ONLY, "t4", [1], 1000),
        # The only node with 8 GPUs and 40 CPUs... none: HUGE fits nowhere.
    ],
)
def test_builtin_placements(policy, task, node, gpus, milli):
    d = build_policy(policy, seed=0).decide(cluster(FLEET), task)
    assert d.action == "assign"
    assert (d.placement[0].node, [p.gpu for p in d.placement], d.placement[0].milli) == (node, gpus, milli)
    assert 0.0 <= d.confidence <= 1.0


@pytest.mark.parametrize("policy", ["k8s-default", "bestfit", "packing", "fgd", "fleetpilot"])
def test_no_fit_queues_or_rejects_and_state_untouched(policy):
    state = cluster(FLEET)
    before = state.gpu_free.copy()
    d = build_policy(policy).decide(state, HUGE)
    assert d.action == "queue" and d.placement == []
    assert build_policy(policy, no_fit_action="reject").decide(state, HUGE).action == "reject"
    np.testing.assert_array_equal(state.gpu_free, before)


def short_fleet() -> ClusterState:
    """Five G2 nodes of 4 GPUs (32 GB each) and two T4 nodes, each node short of something
    else for a task of one whole G2 GPU with 16 GB, 4 CPUs and 8 GB of memory."""
    names = ["cpu", "gpus", "gpu-mem", "down", "fits-but-down", "t4-a", "t4-b"]
    state = ClusterState.build(names=names, cpu_milli=[32000] * 7, memory_mb=[64000] * 7, gpus=[4] * 7,
                               models=["G2"] * 5 + ["T4"] * 2, gpu_memory_mb=[32768] * 5 + [16384] * 2)
    state.cpu_free[0] = 2000                    # cpu: too little CPU free
    state.gpu_free[1] = 300                     # gpus: every GPU partly held
    state.gpu_mem_free[2] = 8000                # gpu-mem: whole GPUs free, their memory held
    state.gpu_free[3], state.mem_free[3] = 0, 0  # down: out of service, its GPUs and memory held too
    state.node_ready[3] = state.node_ready[4] = False
    return state


ONE_G2 = TaskRequest(task_id="g2", gpus=1, gpu_milli=1000, gpu_memory_mb=16000, cpu_milli=4000, memory_mb=8000,
                     gpu_models=("G2",))


@pytest.mark.parametrize("policy", ["k8s-default", "bestfit", "packing", "fgd", "fleetpilot"])
def test_a_task_no_node_takes_is_told_what_each_node_lacks(policy):
    d = build_policy(policy).decide(short_fleet(), ONE_G2)
    # Most common first, then by name; a node lacking several things counts under each.
    expected = ("0 of 7 nodes: 2 lack free GPUs, 2 not of a GPU model it accepts, 2 out of service, "
                "1 lack free CPU, 1 lack free GPU memory, 1 lack free memory")
    assert (d.action, d.shortfall) == ("queue", expected)
    assert d.reason == f"no node passes the filters ({expected})"
    # A share is told of a GPU with its share free, not of a whole free GPU.
    share = build_policy(policy).decide(short_fleet(), msgspec.structs.replace(ONE_G2, gpu_milli=500))
    if policy != "k8s-default":  # which takes whole GPUs only
        assert share.shortfall == expected.replace("free GPUs", "a GPU with the share free")
    # A caller that reads no reason (the fleet benchmark) need not pay for it.
    quiet = build_policy(policy, explain=False).decide(short_fleet(), ONE_G2)
    assert (quiet.action, quiet.shortfall, quiet.reason) == ("queue", "", "no node passes the filters")


def test_a_placed_task_carries_no_shortfall_and_a_filter_of_its_own_is_named():
    from fleetpilot.policy.framework import Cycle, FilterPlugin

    assert build_policy("fleetpilot").decide(cluster(FLEET), WHOLE).shortfall == ""

    class EvenRows(FilterPlugin):
        name = "even-rows"

        def filter(self, cycle: Cycle) -> np.ndarray:
            return np.arange(cycle.state.n_nodes) % 2 == 0

    state = cluster(FLEET)
    [(what, lacking)] = EvenRows().shortfalls(Cycle(state=state, task=WHOLE, free=state.gpu_free))
    assert what == "even-rows" and lacking.tolist() == [False, True, False]


@pytest.mark.parametrize("policy", ["k8s-default", "bestfit", "packing", "fgd", "fleetpilot"])
def test_cpu_only_task_holds_no_gpu(policy):
    d = build_policy(policy).decide(cluster(FLEET), CPU)
    assert d.action == "assign" and [p.gpu for p in d.placement] == [-1]


def test_packing_scores_follow_reference_cases():
    from fleetpilot.policy.framework import Cycle
    from fleetpilot.policy.plugins import GpuPacking

    state = cluster(FLEET)
    cycle = Cycle(state=state, task=SHARE, free=state.usable_free(), rows=np.arange(3))
    # idle8 is idle: max(33-8, 8)=25; half: shared GPU 300 -> 100 - 30//10 = 97; t4: 600 -> 94.
    assert GpuPacking().score(cycle).tolist() == [25, 97, 94]
    cycle = Cycle(state=state, task=WHOLE, free=state.usable_free(), rows=np.arange(3))
    assert GpuPacking().score(cycle).tolist() == [25, 49, 49]


def test_ties_are_broken_by_seeded_priority():
    state = cluster([(f"n{i}", "G2", 32000, [1000, 1000]) for i in range(40)])
    picks = {build_policy("bestfit", seed=s).decide(state, WHOLE).placement[0].node for s in range(8)}
    assert len(picks) > 1  # a different priority order per seed
    again = build_policy("bestfit", seed=3).decide(state, WHOLE).placement[0].node
    assert again == build_policy("bestfit", seed=3).decide(state, WHOLE).placement[0].node


def test_fleetpilot_steers_flexible_task_away_from_scarce_model():
    # T4 is demanded by half of the typical tasks and offers 2 GPUs; G2 offers 8 and nobody
    # needs it exclusively. FGD alone sees the same fragmentation delta on both.
    state = cluster([("g2", "G2", 32000, [1000] * 8), ("t4", "T4", 32000, [1000] * 8)])
    shapes = [TaskShape(cpu_milli=0, gpu_milli=1000, gpus=1, weight=0.5),
              TaskShape(cpu_milli=0, gpu_milli=1000, gpus=1, models=("T4",), weight=0.5)]
    rho = ModelPressure(shapes, state.models)(state)
    assert rho[state.models.index("T4")] > 1.0 > rho[state.models.index("G2")]
    d = build_policy("fleetpilot", typical=shapes).decide(state, WHOLE)
    assert d.placement[0].node == "g2"
    # With no constrained class the pressure is flat: fleetpilot decides as fgd does.
    flat = [TaskShape(cpu_milli=0, gpu_milli=1000, gpus=1, weight=1.0)]
    assert ModelPressure(flat, state.models)(state).tolist() == pytest.approx([1.0, 1.0])


def test_profiles_validate_plugins_and_args():
    with pytest.raises(PluginConfigError, match="unknown score plugin"):
        build_policy({"name": "x", "scores": [{"name": "nope"}]})
    with pytest.raises(PluginConfigError, match="bestfit"):
        build_policy({"name": "x", "scores": [{"name": "bestfit", "args": {"max_cpu_milli": "lots"}}]})
    with pytest.raises(ValueError, match="invalid policy profile"):
        build_policy({"name": "x", "scores": "bestfit"})
    p = build_policy({"name": "mine", "filters": [{"name": "node-resources"}], "scores": [{"name": "packing"}]})
    assert p.decide(cluster(FLEET), SHARE).policy == "mine"
    assert {"filter", "score", "normalise", "select", "devices", "confidence"} <= set(REGISTRY)
    assert builtin_profile("fgd").scores[0].name == "fgd"


def test_transformers_are_smooth_and_bounded():
    state = cluster(FLEET)
    state.gpu_mem_total[:] = np.where(state.gpu_exists, 16000, 0)
    state.gpu_mem_free[:] = np.where(state.gpu_exists, [[16000] * 8, [8000] * 8, [4000] * 8], 0)
    task = TaskRequest(task_id="m", gpus=1, gpu_milli=500, predicted_peak_mb=6000, peak_sigma_mb=1000)
    risk = oom_risk(state, task)
    assert risk[0, 0] < 0.01 and 0.9 < risk[2, 0] < 1.0 and 0.01 < risk[1, 0] < 0.1  # smooth in free memory
    _, node_frag = memory_fragmentation(state)
    assert node_frag[0] == pytest.approx(7 / 8)
    state.gpu_temp_c[0, 0] = 85.0
    assert thermal_headroom(state)[0, 0] == 0.0 and thermal_headroom(state)[0, 1] == pytest.approx(0.9)
    assert numa_distance(state, 0, [0]) == 0.0 and numa_distance(state, 0, [0, 1]) == 0.0
    state.gpu_link[0, 0, 1] = state.gpu_link[0, 1, 0] = 6
    assert numa_distance(state, 0, [0, 1]) == 1.0
    state.roles = ["", "serving"]
    state.gpu_role[0, 0] = 1
    assert role_affinity(state, TaskRequest(task_id="r", role="serving"))[0, :2].tolist() == [1.0, 0.5]
    assert role_affinity(state, TaskRequest(task_id="r"))[0, :2].tolist() == [0.5, 1.0]


def test_erfc_and_normal_cdf_match_math_erf():
    xs = np.concatenate([np.linspace(-12.0, 12.0, 24001), [0.0, -0.0, 1e-12, -1e-12, 40.0, -40.0, 1e200, -1e200]])
    ref_erfc = np.array([math.erfc(x) for x in xs])
    assert np.abs(erfc(xs) - ref_erfc).max() < 1e-7
    pos = (xs >= 0) & (ref_erfc > 0)
    assert (np.abs(erfc(xs[pos]) - ref_erfc[pos]) / ref_erfc[pos]).max() < 1.2e-7   # relative in the tail
    ref_cdf = np.array([0.5 * (1.0 + math.erf(x / math.sqrt(2.0))) for x in xs])
    assert np.abs(normal_cdf(xs) - ref_cdf).max() < 1e-7
    assert normal_cdf(np.array([-np.inf, np.inf])).tolist() == [0.0, 1.0] and np.isnan(normal_cdf(np.nan))
    assert normal_cdf(np.zeros((3, 4))).shape == (3, 4) and normal_cdf(0.0) == pytest.approx(0.5, abs=1e-7)


def test_fleetpilot_confidence_drops_with_oom_risk():
    state = cluster(FLEET)
    state.gpu_mem_total[:] = np.where(state.gpu_exists, 16000, 0)
    state.gpu_mem_free[:] = np.where(state.gpu_exists, 16000, 0)
    policy = build_policy("fleetpilot", typical=[TaskShape(cpu_milli=0, gpu_milli=1000, gpus=1, weight=1.0)])
    safe = policy.decide(state, TaskRequest(task_id="a", gpus=1, gpu_milli=500, predicted_peak_mb=2000, peak_sigma_mb=500))
    risky = policy.decide(state, TaskRequest(task_id="b", gpus=1, gpu_milli=500, predicted_peak_mb=16000, peak_sigma_mb=2000))
    assert safe.confidence > 0.85 and risky.confidence < 0.6


@pytest.mark.parametrize(
    ("free", "cpu", "c", "stranded"),
    [(8000, 96000, 8.0, 0.0),  # needs 64000 CPU, has 96000
     (8000, 32000, 8.0, 4000.0),  # (64000 - 32000) / 8
     (0, 0, 8.0, 0.0),
     (2000, 0, 0.0, 0.0)],  # typical tasks ask no CPU: nothing stranded
)
def test_cpu_stranding_table(free, cpu, c, stranded):
    from fleetpilot.policy.transformers import cpu_stranding

    assert cpu_stranding(np.asarray([free]), np.asarray([cpu]), c)[0] == pytest.approx(stranded)


def test_fleetpilot_keeps_cpu_for_the_gpus_that_need_it():
    # Typical GPU tasks ask 10 CPU per GPU. "tight" has exactly the CPU its 4 GPUs need,
    # "roomy" far more: a CPU-only task (and a whole-GPU task asking 20 CPU) should not drain
    # "tight", although every typical task still fits both nodes afterwards (FGD sees no change).
    state = cluster([("tight", "G2", 40000, [1000] * 4), ("roomy", "G2", 200000, [1000] * 4)])
    state.cpu_total[:] = [40000, 200000]
    shapes = [TaskShape(cpu_milli=10000, gpu_milli=1000, gpus=1, weight=1.0)]
    fp = build_policy("fleetpilot", typical=shapes)
    assert fp.decide(state, TaskRequest(task_id="c", gpus=0, gpu_milli=0, cpu_milli=8000)).placement[0].node == "roomy"
    hungry = TaskRequest(task_id="h", gpus=1, gpu_milli=1000, cpu_milli=20000)
    assert fp.decide(state, hungry).placement[0].node == "roomy"
    fgd_nodes = {build_policy("fgd", seed=s, typical=shapes).decide(state, hungry).placement[0].node for s in range(6)}
    assert fgd_nodes == {"tight", "roomy"}  # FGD: a tie, left to the random priority


def _two_idle_eights() -> ClusterState:
    # "big" is the only node with the CPU an 8-GPU, 120-core class needs; "std" has less.
    state = ClusterState.build(names=["big", "std"], cpu_milli=[128000, 96000], memory_mb=[512000, 512000],
                               gpus=[8, 8], models=["G3", "G2"])
    return state


SHARES_ONLY = [TaskShape(cpu_milli=4000, gpu_milli=500, gpus=1, weight=1.0)]
WITH_EIGHTS = [TaskShape(cpu_milli=4000, gpu_milli=500, gpus=1, weight=0.95),
               TaskShape(cpu_milli=120000, gpu_milli=1000, gpus=8, weight=0.05)]


def test_demand_pressure_keeps_the_only_host_of_a_multi_gpu_class_whole():
    state = _two_idle_eights()
    hungry = TaskRequest(task_id="s", gpus=1, gpu_milli=500, cpu_milli=12000)
    # Without the 8-GPU class in the demand, CPU stranding prefers the CPU-rich node.
    fp = build_policy("fleetpilot", typical=SHARES_ONLY)
    assert fp.decide(state, hungry).placement[0].node == "big"
    # With it, breaking "big" would leave the 8-GPU class no host at all: it goes to "std".
    fp = build_policy("fleetpilot", typical=SHARES_ONLY, demand=WITH_EIGHTS)
    assert fp.decide(state, hungry).placement[0].node == "std"
    # A CPU-only task that would leave "big" short of 120 cores is kept off it as well.
    cpu_task = TaskRequest(task_id="c", gpus=0, gpu_milli=0, cpu_milli=16000)
    assert fp.decide(state, cpu_task).placement[0].node == "std"
    # ... and the 8-GPU task itself still goes where it fits: nothing is held back.
    eight = TaskRequest(task_id="e", gpus=8, gpu_milli=1000, cpu_milli=120000)
    assert fp.decide(state, eight).placement[0].node == "big"


def test_demand_pressure_is_flat_without_constraints_or_multi_gpu_classes():
    from fleetpilot.policy.transformers import DemandPressure

    state = cluster([("a", "G2", 32000, [1000] * 8), ("b", "T4", 32000, [1000, 500]), ("c", "G2", 8000, [300] * 4)])
    rows = np.arange(3)
    cost = DemandPressure(SHARES_ONLY, state.models).costs(state, state.usable_free(), rows, 500, 4000,
                                                            np.zeros(3, dtype=np.int64))
    assert cost.tolist() == pytest.approx([cost[0]] * 3)  # same everywhere: no node is scarcer
    # One class constrained to T4: consuming T4 costs more than consuming G2, in proportion.
    shapes = [TaskShape(cpu_milli=0, gpu_milli=500, gpus=1, weight=0.5),
              TaskShape(cpu_milli=0, gpu_milli=500, gpus=1, models=("T4",), weight=0.5)]
    cost = DemandPressure(shapes, state.models).costs(state, state.usable_free(), rows, 500, 0,
                                                       np.zeros(3, dtype=np.int64))
    assert cost[1] > cost[0] == pytest.approx(cost[2])


def test_demand_pressure_prices_breaking_idle_nodes_by_their_scarcity():
    from fleetpilot.policy.transformers import DemandPressure

    eights = [TaskShape(cpu_milli=1000, gpu_milli=1000, gpus=8, weight=0.1),
              TaskShape(cpu_milli=1000, gpu_milli=500, gpus=1, weight=0.9)]
    many = cluster([(f"n{i}", "G2", 32000, [1000] * 8) for i in range(10)])
    few = cluster([(f"n{i}", "G2", 32000, [1000] * 8 if i < 2 else [1000] * 7 + [0]) for i in range(10)])
    taken = np.ones(1, dtype=np.int64)
    cost_many = DemandPressure(eights, many.models).costs(many, many.usable_free(), np.arange(1), 500, 1000, taken)
    cost_few = DemandPressure(eights, few.models).costs(few, few.usable_free(), np.arange(1), 500, 1000, taken)
    assert cost_few[0] > 3 * cost_many[0] > 0  # the last idle nodes are dearer


def test_demand_pressure_prices_multi_gpu_capacity_against_usable_free():
    from fleetpilot.policy.framework import Cycle
    from fleetpilot.policy.plugins import FleetpilotFrag
    from fleetpilot.policy.transformers import DemandPressure

    # Demand: an 8-GPU class d8 = 0.1*8*1000 = 800 and a sharing class d1 = 0.9*500 = 450.
    shapes = [TaskShape(cpu_milli=1000, gpu_milli=1000, gpus=8, weight=0.1),
              TaskShape(cpu_milli=1000, gpu_milli=500, gpus=1, weight=0.9)]
    # "a": an idle 8-GPU node; "b": four GPUs with 300 free each, a fragment for both classes.
    state = cluster([("a", "G2", 32000, [1000] * 8), ("b", "G2", 32000, [300] * 4)])
    free = state.usable_free()                       # F = 8000 + 1200 = 9200
    rows, taken = np.arange(2), np.ones(2, dtype=np.int64)
    pm = DemandPressure(shapes, state.models)
    # The sharing class pays the same 500 milli on both nodes; breaking "a" also loses the
    # 8-GPU class its 8000 usable milli at price 800/8000 = 0.1. Against the raw average
    # 1250/9200 that is 800 * 9200/1250 = 5888 milli more on "a" than on "b" ...
    raw = pm.costs(state, free, rows, 500, 1000, taken)
    assert raw[0] - raw[1] == pytest.approx(5888.0)
    # ... against the average per usable milli, with FGD's fragmentation 0 on "a" and 1200
    # on "b" (no typical task fits a 300-milli GPU: all of it is a fragment), U = 8000:
    # 0.1 / (1250/8000) * 8000 = 5120. The single-GPU part is unchanged.
    usable = pm.costs(state, free, rows, 500, 1000, taken, usable_free=8000.0)
    assert usable[0] - usable[1] == pytest.approx(5120.0)
    assert usable[1] == pytest.approx(raw[1]) == pytest.approx(450 / 9200 * 500 / (1250 / 9200))
    # The plugin computes U from FGD's fragmentation, incrementally after the first pass.
    plugin = FleetpilotFrag(FleetpilotFrag.Args(typical=shapes))
    assert plugin._usable_free(Cycle(state=state, task=SHARE, free=free)) == pytest.approx(8000.0)
    state.allocate(0, [0], 1000, cpu_milli=1000, memory_mb=0)   # "a" keeps 7 free GPUs: 0 fit the 8s
    # frag(a) = 0.1 * 7000 (the 8-GPU class no longer fits) = 700; U = 8200 - 700 - 1200 = 6300.
    assert plugin._usable_free(Cycle(state=state, task=SHARE, free=state.usable_free())) == pytest.approx(6300.0)


@pytest.mark.parametrize("policy", ["fgd", "fleetpilot", "bestfit", "packing"])
def test_a_shared_gpu_is_chosen_only_where_the_task_memory_fits(policy):
    # One node: GPU 0 is the exact fit by compute (250 free) but has 2 GB of memory left;
    # GPU 1 is idle. A share asking 9 GB fits the node only on GPU 1. Found live on the
    # openb fleet: FGD's per-GPU choice looked at compute alone, picked GPU 0 (P(OOM) = 1),
    # and the confidence of 0 opened the breaker, so the fallback served for 30 s at a time.
    state = cluster([("n", "T4", 30000, [250, 1000])])
    state.gpu_mem_total[:] = np.where(state.gpu_exists, 16000, 0)
    state.gpu_mem_free[0, :2] = [2000, 16000]
    task = TaskRequest(task_id="m", gpus=1, gpu_milli=250, gpu_memory_mb=9000)
    decision = build_policy(policy, typical=[TaskShape(cpu_milli=0, gpu_milli=250, gpus=1, weight=1.0)]).decide(
        state, task)
    assert decision.action == "assign" and [p.gpu for p in decision.placement] == [1]
    assert decision.confidence > 0.8


@pytest.mark.parametrize("policy", ["k8s-default", "bestfit", "packing", "fgd", "fleetpilot"])
@pytest.mark.parametrize("task", [CPU, WHOLE, SHARE], ids=["cpu-only", "whole", "share"])
def test_a_task_bound_to_a_site_is_placed_on_it_even_when_it_asks_no_gpu(policy, task):
    # Whichever node each policy prefers (idle or busy), a task its contract binds to site
    # "b" goes to a node of "b", and a task bound to a site the fleet lacks goes nowhere. A
    # CPU-only task uses no GPU, so it never met the site mask laid over the GPUs' capacity.
    for cpu in ([32000, 8000], [8000, 32000]):
        state = ClusterState.build(names=["a0", "b0"], cpu_milli=[32000, 32000], memory_mb=[64000, 64000],
                                   gpus=[2, 2], models=["G2", "G2"], sites=["a", "b"])
        state.cpu_free[:] = cpu
        state.gpu_free[:] = [[1000, 500], [1000, 1000]] if cpu[0] > cpu[1] else [[1000, 1000], [1000, 500]]
        pinned = msgspec.structs.replace(task, site="b")
        d = build_policy(policy, seed=3).decide(state, pinned)
        assert d.action == "assign" and {p.node for p in d.placement} == {"b0"}, (cpu, d)
        d = build_policy(policy, seed=3).decide(state, msgspec.structs.replace(task, site="mars"))
        assert d.action != "assign" and d.placement == [], d


@pytest.mark.parametrize("policy", ["k8s-default", "bestfit", "packing", "fgd", "fleetpilot"])
@pytest.mark.parametrize(
    ("task", "why"),
    [
        (TaskRequest(task_id="x", gpus=1, gpu_milli=1500), "gpu_milli"),  # more than one GPU holds
        (TaskRequest(task_id="x", gpus=2, gpu_milli=2000), "gpu_milli"),
        (TaskRequest(task_id="x", gpus=1, gpu_milli=-200), "gpu_milli"),
        (TaskRequest(task_id="x", gpus=-1), "gpus"),
        (TaskRequest(task_id="x", gpus=0, gpu_milli=0, cpu_milli=-4000), "cpu_milli"),
        (TaskRequest(task_id="x", gpus=1, memory_mb=-1), "memory_mb"),
        (TaskRequest(task_id="x", gpus=1, gpu_memory_mb=-1), "gpu_memory_mb"),
    ],
)
def test_a_request_nothing_can_hold_as_asked_is_rejected_with_why_never_placed(policy, task, why):
    # A share over 1000 milli was proposed as is (bestfit, packing, fgd, fleetpilot) or cut
    # to one whole GPU (k8s-default); a negative count was taken for a CPU-only task and a
    # negative size handed capacity back to the node on allocate. Rejected, state untouched.
    state = cluster(FLEET)
    before = (state.gpu_free.copy(), state.cpu_free.copy())
    d = build_policy(policy, seed=0).decide(state, task)
    assert d.action == "reject" and d.placement == [] and why in d.reason, d
    assert 0.0 <= d.confidence <= 1.0
    np.testing.assert_array_equal(state.gpu_free, before[0])
    np.testing.assert_array_equal(state.cpu_free, before[1])


def test_a_score_or_confidence_that_is_not_a_number_is_one_clear_error_never_a_decision():
    # A GPU whose temperature reads NaN made the thermal score NaN: the priority selector
    # then found no best node ("attempt to get argmin of an empty sequence"), and the first
    # selector chose the NaN node and published a NaN confidence.
    state = cluster(FLEET)
    state.gpu_temp_c[1, 2] = np.nan
    with pytest.raises(ValueError, match="score plugin 'thermal'.*NaN.*half"):
        build_policy("fleetpilot").decide(state, SHARE)
    first = {"name": "first", "filters": [{"name": "node-resources"}],
             "scores": [{"name": "packing"}, {"name": "thermal"}], "select": {"name": "first"},
             "confidence": {"name": "fleetpilot"}}
    with pytest.raises(ValueError, match="NaN"):
        build_policy(first).decide(state, SHARE)
    # A Beta prior of no weight at all has no mean: refused when the profile is built.
    with pytest.raises(PluginConfigError, match="historical"):
        build_policy({"name": "h", "confidence": {"name": "historical", "args": {"alpha": 0.0, "beta": 0.0}}})


@pytest.mark.parametrize("name", sorted(BUILTIN_POLICIES))
def test_a_node_out_of_service_takes_no_task_not_even_one_that_asks_no_gpu(name):
    """A node whose collector went silent or whose executor is down (``not_ready``,
    ``unreachable``: labels on every GPU, so its GPUs took no GPU task) still took CPU-only
    tasks, which nobody there would start. Its GPUs' health alone (a failed GPU, a cordon)
    does not keep CPU work off the node."""
    from fleetpilot.contracts import GpuInfo, NodeTopology

    def node(name: str) -> NodeTopology:
        return NodeTopology(node=name, cpu_milli=64_000, memory_mb=256_000,
                            gpus=[GpuInfo(index=i, model="A100", memory_mb=40_000) for i in range(2)])

    topo = [node("down"), node("sick"), node("up")]
    state = ClusterState.from_topology(topo, {"up": []}, unhealthy=[("down", 0), ("down", 1), ("sick", 0), ("sick", 1)],
                                       not_ready=["down"])
    cpu_only = TaskRequest(task_id="c", gpus=0, gpu_milli=0, cpu_milli=1_000, memory_mb=1_000)
    policy = build_policy(name)
    nodes = set()
    for free_up in (60_000, 64_000):  # "up" nearly full, then empty: the others would win on score
        trial = state.copy()
        trial.cpu_free[trial.node_index("up")] = 64_000 - free_up + 1_000
        decision = policy.decide(trial, cpu_only)
        assert decision.action == "assign"
        nodes |= {p.node for p in decision.placement}
    assert "down" not in nodes
    gone = state.copy()
    gone.node_ready[gone.node_index("up")] = False
    gone.node_ready[gone.node_index("sick")] = False
    assert policy.decide(gone, cpu_only).action != "assign"


def test_a_node_out_of_service_round_trips_and_an_old_record_reads_every_node_in_service():
    from fleetpilot.policy.state import ClusterStateRecord

    state = ClusterState.build(names=["a", "b"], cpu_milli=[1000, 1000], memory_mb=[1000, 1000], gpus=[1, 1],
                               models=["A100", "A100"], gpu_memory_mb=[40_000, 40_000])
    state.node_ready[1] = False
    assert ClusterState.from_record(state.to_record()).node_ready.tolist() == [True, False]
    assert ClusterState.from_npz_bytes(state.to_npz_bytes()).node_ready.tolist() == [True, False]
    assert state.copy().node_ready.tolist() == [True, False]
    record = state.to_record()
    old = ClusterStateRecord(node_names=record.node_names, models=record.models, sites=record.sites,
                             roles=record.roles, arrays={k: v for k, v in record.arrays.items() if k != "node_ready"})
    assert ClusterState.from_record(old).node_ready.tolist() == [True, True]
