"""The built-in profiles learn the task shapes the service sees (FGD's typical tasks,
fleetpilot's demand), so the live policy weighs fragmentation like the benchmarked one."""

from __future__ import annotations

from fleetpilot.contracts import Fingerprint, TaskSubmitted, encode
from fleetpilot.policy import TaskRequest
from fleetpilot.policy.fragmentation import typical_tasks
from fleetpilot_services.policy.policy_set import ActivePolicies, PolicyConfig

from .conftest import admitted, node, policy_state


def requests(n: int, milli: int) -> list[TaskRequest]:
    return [TaskRequest.from_submitted(TaskSubmitted(task_id=f"t{milli}-{i}", gpu_milli=milli, cpu_milli=4000))
            for i in range(n)]


def score_args(active: ActivePolicies, policy: str, plugin: str) -> dict:
    profile = active.current.policies[policy].config
    return next(s.args for s in profile.scores if s.name == plugin)


def test_typical_tasks_and_demand_follow_what_was_admitted():
    active = ActivePolicies(PolicyConfig(profile="fleetpilot", shaping=[]), "settings")
    assert not score_args(active, "fleetpilot", "fleetpilot-frag").get("typical")
    generation = active.current.generation

    seen = requests(90, 500) + requests(10, 1000)
    assert active.apply_workload(seen) is True
    typical = score_args(active, "fleetpilot", "fleetpilot-frag")["typical"]
    assert {(t["gpu_milli"], round(t["weight"], 2)) for t in typical} == {(500, 0.9), (1000, 0.1)}
    assert active.current.generation == generation + 1

    # The same shapes again: nothing to rebuild.
    assert active.apply_workload(seen) is False
    assert active.current.generation == generation + 1


def test_the_demand_counts_each_task_on_the_models_its_fingerprint_says_can_hold_it(tmp_path):
    ps = policy_state(tmp_path)
    ps.fleet._apply("big", encode(node("big")))  # H100, 80 GB
    ps.fleet._apply("small", encode(node("small", model="V100-32GB", memory_mb=32_768)))
    seen = [admitted(f"ft-{i}", gpu_milli=1000, gpu_memory_mb=20_000, gpu_models=["H100", "V100-32GB"]).task
            for i in range(3)]
    assert {t.models for t in typical_tasks(ps.workload(seen), coverage=1.0)} == {("H100", "V100-32GB")}

    # Its program's runs grow to 40 GB: only the H100 holds them, and the demand says so, by
    # which the pressure keeps flexible work off the H100s they wait for.
    for task in seen[:2]:
        ps.fingerprints[task.task_id] = Fingerprint(signature="sig-ft", pattern="steps", pattern_confidence=0.9,
                                                    growth_rate_mb_per_s=0.0, predicted_peak_mb=40_000,
                                                    peak_low_mb=39_000, peak_high_mb=41_000)
    demand = typical_tasks(ps.workload(seen), coverage=1.0)
    assert {(t.models, round(t.weight, 2)) for t in demand} == {(("H100",), 0.67), (("H100", "V100-32GB"), 0.33)}
