"""Circuit breaker transitions and the historical-success fallback."""

from __future__ import annotations

import pytest
from fleetpilot.policy import ClusterState, PolicyDecision, TaskRequest, build_policy
from fleetpilot.policy.fallback import (
    BreakerConfig,
    CircuitBreaker,
    FallbackScheduler,
    GuardedPolicy,
    PolicyUnavailable,
    SuccessStat,
    posterior_success,
)


class Clock:
    """A hand-driven clock."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


CFG = BreakerConfig(failure_threshold=2, cooldown_s=10.0, probe_successes=1, time_budget_s=0.5, confidence_floor=0.3)

# (advance clock by, outcome recorded or None to only ask allow(), expected state after)
SCRIPT = [
    (0, "ok", "closed"),
    (0, "exception", "closed"),
    (0, "ok", "closed"),  # success resets the consecutive count
    (0, "timeout", "closed"),
    (0, "low_confidence", "open"),
    (5, None, "open"),  # still cooling down
    (5, None, "half_open"),  # cooldown over: probe allowed
    (0, "unavailable", "open"),  # a failed probe re-opens
    (10, None, "half_open"),
    (0, "ok", "closed"),
]


def test_breaker_transitions():
    clock = Clock()
    told: list[tuple[str, str]] = []
    b = CircuitBreaker(config=CFG, clock=clock, on_change=lambda state, outcome: told.append((state, outcome)))
    for advance, outcome, expected in SCRIPT:
        clock.t += advance
        allowed = b.allow()
        if outcome is not None:
            b.record(outcome)
        assert b.state == expected, (advance, outcome)
        assert allowed == (b.state != "open" or outcome is not None)
    # Each opening and closing is told once, with the outcome that caused it.
    assert told == [("open", "low_confidence"), ("open", "unavailable"), ("closed", "ok")]


@pytest.mark.parametrize(
    ("elapsed", "decision", "error", "outcome"),
    [
        (0.1, PolicyDecision(action="assign", confidence=0.9), None, "ok"),
        (0.9, PolicyDecision(action="assign", confidence=0.9), None, "timeout"),
        (0.1, PolicyDecision(action="assign", confidence=0.1), None, "low_confidence"),
        (0.1, PolicyDecision(action="queue", confidence=0.1), None, "ok"),
        (0.1, None, RuntimeError("x"), "exception"),
        (0.1, None, PolicyUnavailable("model"), "unavailable"),
    ],
)
def test_breaker_classifies_outcomes(elapsed, decision, error, outcome):
    assert CircuitBreaker(config=CFG).classify(elapsed_s=elapsed, decision=decision, error=error) == outcome


STATS = [SuccessStat(task_kind="train", gpu_model="A100", successes=8, failures=2),
         SuccessStat(task_kind="train", gpu_model="T4", successes=1, failures=9)]


def test_posterior_success_uses_beta_prior():
    assert posterior_success(STATS, "train", ["A100", "T4", "V100"]).tolist() == pytest.approx([9 / 12, 2 / 12, 0.5])


def fleet() -> ClusterState:
    return ClusterState.build(names=["t4", "a100"], cpu_milli=[8000, 8000], memory_mb=[8000, 8000], gpus=[2, 2],
                              models=["T4", "A100"])


def test_fallback_prefers_historically_successful_model():
    d = FallbackScheduler(STATS).decide(fleet(), TaskRequest(task_id="x", kind="train"))
    assert d.fallback and d.placement[0].node == "a100" and d.confidence == pytest.approx(0.75)
    assert d.reason.startswith("fallback: node a100") and d.reason.count("fallback") == 1


def test_guarded_policy_falls_back_and_recovers():
    clock = Clock()
    calls = {"n": 0}

    def flaky(state, task):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise PolicyUnavailable("model server down")
        return build_policy("bestfit").decide(state, task)

    guarded = GuardedPolicy(flaky, FallbackScheduler(STATS), CircuitBreaker(config=CFG, clock=clock), clock=clock)
    task = TaskRequest(task_id="x", kind="train")
    first = guarded.decide(fleet(), task)
    second = guarded.decide(fleet(), task)
    assert first.fallback and second.fallback and guarded.breaker.state == "open"
    assert first.reason.endswith("(primary: unavailable)"), first.reason
    third = guarded.decide(fleet(), task)
    assert third.fallback and "breaker open" in third.reason and calls["n"] == 2
    clock.t += 10
    fourth = guarded.decide(fleet(), task)
    assert not fourth.fallback and guarded.breaker.state == "closed"
