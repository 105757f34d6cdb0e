"""The safety net: a circuit breaker around a policy and a fallback scheduler.

``CircuitBreaker`` is a pure state machine with an injectable clock:

* **closed** — calls go to the primary policy; ``failure_threshold`` consecutive failures
  (an exception, the time budget exceeded, the model unavailable, or a confidence below the
  floor) open it;
* **open** — calls go to the fallback; after ``cooldown_s`` it turns half-open;
* **half-open** — calls probe the primary again; ``probe_successes`` successes close it, one
  failure opens it again (and restarts the cooldown).

``FallbackScheduler`` places a task where tasks of its kind have historically succeeded on
that GPU model: the posterior mean of a Beta prior updated with the success/failure counts
of (task kind, GPU model) from the feedback store; its decisions are marked ``fallback`` and
their confidence *is* that posterior mean (the only evidence it has).

``GuardedPolicy`` wires the two: ``decide(state, task)`` never raises for a policy failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec
import numpy as np

from .framework import (
    ConfidencePlugin,
    Cycle,
    PluginSpec,
    Policy,
    PolicyDecision,
    ProfileConfig,
    ScorePlugin,
    register,
)
from .state import ClusterState, TaskRequest

BreakerState = Literal["closed", "open", "half_open"]
Outcome = Literal["ok", "exception", "timeout", "unavailable", "low_confidence"]


class PolicyUnavailable(RuntimeError):
    """Raised by a policy whose model (or remote scorer) cannot be reached."""


class BreakerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Thresholds of the breaker."""

    failure_threshold: int = 3
    cooldown_s: float = 30.0
    probe_successes: int = 1
    time_budget_s: float = 0.05
    confidence_floor: float = 0.3


@dataclass
class CircuitBreaker:
    """See the module docstring; ``clock`` returns seconds (monotonic in production)."""

    config: BreakerConfig = field(default_factory=BreakerConfig)
    clock: Callable[[], float] = time.monotonic
    # Told ``(new state, the outcome that changed it)`` when an outcome opens or closes the
    # breaker: a breaker that opens sends every decision to the fallback, which operators
    # must hear of.
    on_change: Callable[[BreakerState, Outcome], None] | None = None
    state: BreakerState = "closed"
    failures: int = 0
    successes: int = 0
    opened_at: float = 0.0
    last_outcome: Outcome = "ok"

    def allow(self) -> bool:
        """Whether the primary may be called now (turns open into half-open after cooldown)."""
        if self.state == "open" and self.clock() - self.opened_at >= self.config.cooldown_s:
            self.state, self.successes = "half_open", 0
        return self.state != "open"

    def classify(self, *, elapsed_s: float, decision: PolicyDecision | None, error: BaseException | None) -> Outcome:
        """The outcome of one primary call."""
        if isinstance(error, PolicyUnavailable):
            return "unavailable"
        if isinstance(error, TimeoutError):
            # A primary that did not answer in time (its caller gave up on it, a remote scorer
            # timed out) is a timeout, not a fault of its code: operators read the difference.
            return "timeout"
        if error is not None:
            return "exception"
        if elapsed_s > self.config.time_budget_s:
            return "timeout"
        if decision is not None and decision.action == "assign" and decision.confidence < self.config.confidence_floor:
            return "low_confidence"
        return "ok"

    def record(self, outcome: Outcome) -> BreakerState:
        """Update the machine with one outcome; returns the new state."""
        before = self.state
        self._step(outcome)
        if self.state != before and self.on_change is not None:
            self.on_change(self.state, outcome)
        return self.state

    def _step(self, outcome: Outcome) -> None:
        self.last_outcome = outcome
        if outcome == "ok":
            if self.state == "half_open":
                self.successes += 1
                if self.successes >= self.config.probe_successes:
                    self.state, self.failures = "closed", 0
            else:
                self.failures = 0
        elif self.state == "half_open":
            self._open()
        else:
            self.failures += 1
            if self.failures >= self.config.failure_threshold:
                self._open()

    def _open(self) -> None:
        self.state, self.opened_at, self.failures, self.successes = "open", self.clock(), 0, 0


class SuccessStat(msgspec.Struct, frozen=True, kw_only=True):
    """Historical outcomes of one (task kind, GPU model) pair."""

    task_kind: str
    gpu_model: str
    successes: int = 0
    failures: int = 0


class HistoryArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The stats table and the Beta prior (``alpha``, ``beta``: above 0, else a (kind, model)
    without outcomes has no posterior mean)."""

    stats: list[SuccessStat] = msgspec.field(default_factory=list)
    alpha: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    beta: Annotated[float, msgspec.Meta(gt=0)] = 1.0


def posterior_success(stats: Sequence[SuccessStat], kind: str, models: Sequence[str], alpha: float = 1.0,
                      beta: float = 1.0) -> np.ndarray:
    """Posterior mean success rate per model for one task kind: ``(a + s) / (a + b + s + f)``."""
    table = {(s.task_kind, s.gpu_model): s for s in stats}
    out = np.empty(len(models))
    for i, m in enumerate(models):
        s = table.get((kind, m))
        ok, bad = (s.successes, s.failures) if s else (0, 0)
        out[i] = (alpha + ok) / (alpha + beta + ok + bad)
    return out


def _node_success(cycle: Cycle, args: HistoryArgs) -> np.ndarray:
    rate = posterior_success(args.stats, cycle.task.kind, cycle.state.models, args.alpha, args.beta)
    model = cycle.state.node_model[cycle.rows]
    prior = args.alpha / (args.alpha + args.beta)
    return np.where(model >= 0, rate[np.maximum(model, 0)] if rate.size else prior, prior)


@register
class HistoricalSuccess(ScorePlugin):
    """``100 * posterior success`` of (task kind, node GPU model)."""

    name = "historical-success"
    Args = HistoryArgs

    def score(self, cycle: Cycle) -> np.ndarray:
        """Scores in 0..100."""
        return 100.0 * _node_success(cycle, self.args)


@register
class HistoricalConfidence(ConfidencePlugin):
    """The chosen node's posterior success rate."""

    name = "historical"
    Args = HistoryArgs

    def confidence(self, cycle: Cycle, pos: int, gpus: list[int], total: np.ndarray) -> float:
        """Probability in 0..1."""
        return float(_node_success(cycle, self.args)[pos])


class FallbackScheduler:
    """Places by historical success per (task kind, GPU model); marks decisions fallback."""

    def __init__(self, stats: Sequence[SuccessStat] = (), *, alpha: float = 1.0, beta: float = 1.0) -> None:
        hist = {"stats": [msgspec.to_builtins(s) for s in stats], "alpha": alpha, "beta": beta}
        self.policy = Policy(ProfileConfig(
            name="fallback",
            filters=[PluginSpec(name="node-resources"), PluginSpec(name="gpu-model")],
            scores=[PluginSpec(name="historical-success", args=hist), PluginSpec(name="least-allocated", weight=0.01)],
            select=PluginSpec(name="first"),
            devices=PluginSpec(name="tightest"),
            confidence=PluginSpec(name="historical", args=hist),
        ))

    def decide(self, state: ClusterState, task: TaskRequest) -> PolicyDecision:
        """A fallback decision (``fallback=True``)."""
        # The profile is named "fallback": its reason already says so.
        return msgspec.structs.replace(self.policy.decide(state, task), fallback=True)


class GuardedPolicy:
    """A primary policy behind a breaker, with the fallback scheduler behind it."""

    def __init__(self, primary: Callable[[ClusterState, TaskRequest], PolicyDecision], fallback: FallbackScheduler,
                 breaker: CircuitBreaker | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.primary = primary
        self.fallback = fallback
        self.breaker = breaker or CircuitBreaker()
        self.timer = clock

    def decide(self, state: ClusterState, task: TaskRequest) -> PolicyDecision:
        """The primary's decision when the breaker allows it and it succeeds, else fallback's."""
        if self.breaker.allow():
            start = self.timer()
            decision: PolicyDecision | None = None
            error: BaseException | None = None
            try:
                decision = self.primary(state, task)
            except Exception as exc:  # noqa: BLE001 - any policy failure must fall back
                error = exc
            outcome = self.breaker.classify(elapsed_s=self.timer() - start, decision=decision, error=error)
            self.breaker.record(outcome)
            if outcome == "ok" and decision is not None:
                return decision
            fb = self.fallback.decide(state, task)
            return msgspec.structs.replace(fb, reason=f"{fb.reason} (primary: {outcome})")
        fb = self.fallback.decide(state, task)
        return msgspec.structs.replace(fb, reason=f"{fb.reason} (breaker open)")
