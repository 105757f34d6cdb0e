"""kube-scheduler's DefaultPreemption as the baseline plays it: which node, which victims."""

from __future__ import annotations

import numpy as np
from fleetpilot.bench.default_preemption import NO_POD, PRIORITY_CLASS, RunningPod, preempt
from fleetpilot.fleet.inventory import build_fleet
from fleetpilot.policy.state import MILLI, ClusterState, TaskRequest

VIP, STANDARD, BEST_EFFORT = (PRIORITY_CLASS[t] for t in ("vip", "standard", "best_effort"))


class Fleet:
    """A fleet of ``nodes`` nodes of ``gpus`` A100s with pods placed on it, as the baseline holds them."""

    def __init__(self, nodes: int = 1, gpus: int = 4, cpu_milli: int = 64000) -> None:
        shape = {"gpu_model": "A100-40GB", "gpus": gpus, "cpu_milli": cpu_milli, "memory_mb": 262144}
        fleet = build_fleet({"name": "t", "sites": [{"name": "s", "groups": [{"prefix": "n", "count": nodes,
                                                                             "shape": shape}]}]})
        self.state = ClusterState.from_topology([n for n in fleet.nodes if n.gpus])
        self.holders = np.full(self.state.gpu_free.shape, NO_POD, dtype=np.int64)
        self.pods: dict[int, list[RunningPod]] = {}

    def run(self, pod_id: str, row: int, gpus: tuple[int, ...], priority: int, started_s: float = 0.0,
            cpu_milli: int = 1000) -> None:
        """Place a pod holding whole ``gpus`` of node ``row``."""
        self.state.allocate(row, list(gpus), MILLI, cpu_milli=cpu_milli, memory_mb=1024)
        self.holders[row, list(gpus)] = priority
        self.pods.setdefault(row, []).append(RunningPod(pod_id, priority, started_s, gpus, cpu_milli, 1024))

    def preempt_for(self, gpus: int, priority: int, cpu_milli: int = 1000):
        """Where a pod of ``priority`` asking ``gpus`` whole GPUs gets in, and by evicting whom."""
        request = TaskRequest(task_id="p", gpus=gpus, cpu_milli=cpu_milli, memory_mb=1024)
        return preempt(self.state, request, priority, self.holders, lambda row: self.pods.get(row, []))


def victims(plan) -> set[str]:
    return {p.pod_id for p in plan.victims}


def test_a_vip_evicts_the_lowest_priority_pod_that_frees_enough_and_keeps_the_rest() -> None:
    fleet = Fleet(gpus=4)
    fleet.run("be", 0, (0,), BEST_EFFORT)
    fleet.run("std", 0, (1,), STANDARD)
    fleet.run("be2", 0, (2, 3), BEST_EFFORT, started_s=50.0)
    plan = fleet.preempt_for(2, VIP)
    # Every lower pod removed, then reprieved most important first: the standard pod and the
    # earlier best_effort one go back, the later two-GPU one is evicted.
    assert plan is not None and plan.row == 0 and victims(plan) == {"be2"}


def test_a_pod_never_evicts_pods_of_its_own_priority_or_higher() -> None:
    fleet = Fleet(gpus=2)
    fleet.run("std", 0, (0,), STANDARD)
    fleet.run("vip", 0, (1,), VIP)
    assert fleet.preempt_for(1, STANDARD) is None
    assert fleet.preempt_for(1, BEST_EFFORT) is None
    assert victims(fleet.preempt_for(1, VIP)) == {"std"}


def test_the_node_whose_most_important_victim_matters_least_is_chosen() -> None:
    fleet = Fleet(nodes=2, gpus=1)
    fleet.run("std", 0, (0,), STANDARD)
    fleet.run("be", 1, (0,), BEST_EFFORT)
    plan = fleet.preempt_for(1, VIP)
    assert plan.row == 1 and victims(plan) == {"be"}


def test_fewer_victims_win_then_the_work_that_started_last() -> None:
    fleet = Fleet(nodes=3, gpus=2)
    fleet.run("a", 0, (0,), BEST_EFFORT, started_s=100.0)
    fleet.run("b", 0, (1,), BEST_EFFORT, started_s=100.0)
    fleet.run("old", 1, (0, 1), BEST_EFFORT, started_s=10.0)
    fleet.run("new", 2, (0, 1), BEST_EFFORT, started_s=20.0)
    plan = fleet.preempt_for(2, VIP)
    assert plan.row == 2 and victims(plan) == {"new"}


def test_a_pod_short_of_cpu_evicts_enough_to_free_it_too() -> None:
    fleet = Fleet(gpus=4, cpu_milli=8000)
    fleet.run("gpu-light", 0, (0,), BEST_EFFORT, cpu_milli=1000)
    fleet.run("cpu-heavy", 0, (1,), BEST_EFFORT, cpu_milli=6000)
    # Two GPUs are free, but 1,000 of the node's 8,000 CPU milli: only evicting the heavy pod frees enough.
    plan = fleet.preempt_for(1, VIP, cpu_milli=4000)
    assert victims(plan) == {"cpu-heavy"}


def test_no_node_when_even_every_lower_pod_gone_is_not_enough() -> None:
    fleet = Fleet(gpus=2)
    fleet.run("vip", 0, (0,), VIP)
    fleet.run("be", 0, (1,), BEST_EFFORT)
    assert fleet.preempt_for(2, STANDARD) is None


def test_where_pods_share_gpus_a_vip_share_evicts_only_the_lower_share_whose_going_leaves_it_room() -> None:
    # KAI-Scheduler's GPU sharing: GPU 0 holds a best_effort share of 500 milli and 20 GB and a
    # standard one of 250 milli and 10 GB; GPU 1 a standard whole-GPU pod. A vip share of 500
    # milli and 16 GB gets in by evicting the best_effort share alone (the standard one stays).
    fleet = Fleet(gpus=2)
    for pod_id, gpu, milli, memory, priority in (("be", 0, 500, 20_000, BEST_EFFORT), ("std", 0, 250, 10_000, STANDARD),
                                                 ("whole", 1, MILLI, 0, STANDARD)):
        fleet.state.allocate(0, [gpu], milli, cpu_milli=1000, memory_mb=1024, gpu_memory_mb=memory)
        fleet.holders[0, gpu] = min(fleet.holders[0, gpu], priority)
        fleet.pods.setdefault(0, []).append(RunningPod(pod_id, priority, 0.0, (gpu,), 1000, 1024, milli=milli,
                                                       gpu_memory_mb=memory))
    share = TaskRequest(task_id="v", gpus=1, gpu_milli=500, gpu_memory_mb=16_000, cpu_milli=1000, memory_mb=1024)
    plan = preempt(fleet.state, share, VIP, fleet.holders, lambda row: fleet.pods.get(row, []), shared=True)
    assert plan is not None and victims(plan) == {"be"}
    # The memory counts too: 32 GB is more than the best_effort share frees on GPU 0, so the
    # vip takes GPU 1 from the whole-GPU pod; a standard share, which may evict only the
    # best_effort one, gets nowhere.
    roomy = TaskRequest(task_id="v", gpus=1, gpu_milli=500, gpu_memory_mb=32_000, cpu_milli=1000, memory_mb=1024)
    plan = preempt(fleet.state, roomy, VIP, fleet.holders, lambda row: fleet.pods.get(row, []), shared=True)
    assert plan is not None and victims(plan) == {"whole"}
    assert preempt(fleet.state, roomy, STANDARD, fleet.holders, lambda row: fleet.pods.get(row, []),
                   shared=True) is None
