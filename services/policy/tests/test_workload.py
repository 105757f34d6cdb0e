"""The built-in profiles learn the task shapes the service sees (FGD's typical tasks,
fleetpilot's demand), so the live policy weighs fragmentation like the benchmarked one."""

from __future__ import annotations

from fleetpilot.contracts import TaskSubmitted
from fleetpilot.policy import TaskRequest
from fleetpilot_services.policy.policy_set import ActivePolicies, PolicyConfig


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
