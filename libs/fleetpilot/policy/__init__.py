"""Fleetpilot's policy engine: pure placement policies over a vectorised fleet snapshot.

Entry points::

    from fleetpilot.policy import ClusterState, TaskRequest, build_policy
    policy = build_policy("fgd", seed=42, typical=typical_tasks(seen_tasks))
    decision = policy.decide(state, TaskRequest(task_id="t1", gpus=1, gpu_milli=500))

See ``README.md`` next to this file for the plugin framework, the built-in policies, how each
computes its confidence, traffic shaping, the fallback breaker and replay.
"""

from .builtin import BUILTIN_POLICIES, build_policy, builtin_profile
from .fallback import (
    BreakerConfig,
    CircuitBreaker,
    FallbackScheduler,
    GuardedPolicy,
    PolicyUnavailable,
    SuccessStat,
)
from .fragmentation import FragTable, TaskShape, fgd_score, typical_tasks
from .framework import (
    REGISTRY,
    Cycle,
    GpuShare,
    PluginConfigError,
    PluginSpec,
    Policy,
    PolicyDecision,
    ProfileConfig,
    register,
)
from .replay import DiffReport, Snapshot, record, replay
from .shaping import ConditionSyntaxError, Router, RouteRule, parse_condition
from .state import MILLI, ClusterState, ClusterStateRecord, TaskRequest

__all__ = [
    "BUILTIN_POLICIES",
    "BreakerConfig",
    "CircuitBreaker",
    "ConditionSyntaxError",
    "DiffReport",
    "FallbackScheduler",
    "GuardedPolicy",
    "PolicyUnavailable",
    "RouteRule",
    "Router",
    "Snapshot",
    "SuccessStat",
    "parse_condition",
    "record",
    "replay",
    "MILLI",
    "REGISTRY",
    "ClusterState",
    "ClusterStateRecord",
    "Cycle",
    "FragTable",
    "GpuShare",
    "PluginConfigError",
    "PluginSpec",
    "Policy",
    "PolicyDecision",
    "ProfileConfig",
    "TaskRequest",
    "TaskShape",
    "build_policy",
    "builtin_profile",
    "fgd_score",
    "register",
    "typical_tasks",
]
