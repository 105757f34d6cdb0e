"""The executor's settings (``FLEETPILOT_EXECUTOR_*``)."""

from __future__ import annotations

from typing import Literal

from fleetpilot.contracts import BUCKETS, CONSUMERS, as_node_name
from fleetpilot.executor import DecommissionRules
from fleetpilot.maintenance import MAINTENANCE_THRESHOLD
from fleetpilot.runtime import ServiceSettings
from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from .backends import hand_over_wait_s

# How far back a node's own decisions consumer starts when it is first made (a node that
# joins, or comes back after its consumer was removed): within the journal's time-to-live,
# so a decision carried out before is found there and not run again.
DECISION_REPLAY_S = next(b.ttl_s for b in BUCKETS if b.name == "executions") - 3600.0


class ExecutorSettings(ServiceSettings):
    """``FLEETPILOT_EXECUTOR_*``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_EXECUTOR_", extra="ignore")

    backend: Literal["sim", "process"] = "sim"
    # The node this replica carries decisions out on (a DaemonSet's NODE_NAME); empty for
    # every node, as the simulated fleet's executor, or the process backend on one machine.
    node: str = ""
    grace_s: float = Field(default=10.0, ge=0.0, allow_inf_nan=False)
    # How long a task that moves has to save its checkpoint after the checkpoint signal
    # (SIGUSR1) before it is stopped as an eviction is (SIGTERM, then SIGKILL after
    # ``grace_s``). A task that saves and exits sooner ends the wait; a big model's
    # checkpoint can take tens of seconds, and one cut short restarts from nothing.
    checkpoint_s: float = Field(default=30.0, ge=0.0, allow_inf_nan=False)
    default_duration_s: float = Field(default=120.0, gt=0.0, allow_inf_nan=False)
    process_log_dir: str = ""
    # A task's stdout log past this size is cut, its latest part kept beside it (``<log>.1``):
    # a task that prints for days filled the node's disk. 0: no cap.
    process_log_max_mb: float = Field(default=256.0, ge=0.0, allow_inf_nan=False)
    decommission_threshold_c: float = Field(default=85.0, allow_inf_nan=False)
    decommission_hot_for_s: float = Field(default=300.0, ge=0.0, allow_inf_nan=False)
    decommission_drain_s: float = Field(default=1800.0, allow_inf_nan=False)
    health_interval_s: float = Field(default=60.0, gt=0.0, allow_inf_nan=False)
    health_window_s: float = Field(default=2 * 3600.0, gt=0.0, allow_inf_nan=False)
    health_sample_every_s: float = Field(default=30.0, gt=0.0, allow_inf_nan=False)
    health_threshold: float = Field(default=MAINTENANCE_THRESHOLD, gt=0.0, le=1.0)
    # How often the tasks of unreachable nodes are given up, and (with ``node``) this
    # node's processes checked against the ledger.
    silent_check_s: float = Field(default=30.0, gt=0.0, allow_inf_nan=False)
    # A task handed over for a move between nodes that no target took within this long (every
    # answer lost, or the target gave up after the task was stopped here), while its hold
    # here is still in the ledger, is restarted here from its checkpoint. Well past the
    # target's last try (three times the checkpoint, the grace and 10 s).
    hand_over_taken_within_s: float = Field(default=300.0, allow_inf_nan=False)
    # With ``node``: how often this node's key in the ``executors`` bucket is rewritten, which
    # keeps the node in service (the topology service labels a node ``not_ready`` once its
    # executor's key has not changed for ``FLEETPILOT_TOPOLOGY_EXECUTOR_SILENT_AFTER_S``).
    presence_every_s: float = Field(default=15.0, gt=0.0, allow_inf_nan=False)

    @property
    def decision_limit_s(self) -> float:
        """How long carrying out one decision may take before it is taken for hung
        (``ConsumerSpec.handler_limit_s``): the catalog's limit, or twice the longest wait
        these settings allow (a move's hand-over, its checkpoint window and the stop's grace)
        where that is longer."""
        longest = hand_over_wait_s(self.checkpoint_s, self.grace_s) + self.checkpoint_s + self.grace_s
        return max(CONSUMERS["executor-decisions"].handler_limit_s, 2.0 * longest)

    @model_validator(mode="after")
    def _take_back_after_the_targets_last_try(self) -> ExecutorSettings:
        # Taken back sooner, a task could restart here while its target still waits for it,
        # and run on both nodes.
        wait_s = hand_over_wait_s(self.checkpoint_s, self.grace_s)
        if self.hand_over_taken_within_s <= wait_s:
            raise ValueError(f"hand_over_taken_within_s ({self.hand_over_taken_within_s:g}) must exceed the "
                             f"{wait_s:g} s a target may wait for a hand-over (3 x (checkpoint_s + grace_s + 10))")
        return self

    @model_validator(mode="after")
    def _drain_within_the_hook_lock(self) -> ExecutorSettings:
        # The pre-decommission hook holds its GPU's lock for the drain, and the lock lives
        # at most its TTL (35 minutes, the hook_locks bucket's): a longer drain lost it
        # midway, and another replica took the hook over and cordoned again.
        most = DecommissionRules().lock_ttl_s - 60.0
        if not 0 <= self.decommission_drain_s <= most:
            raise ValueError(f"decommission_drain_s ({self.decommission_drain_s:g}) must be within 0..{most:g} s: "
                             f"the hook's lock lives {DecommissionRules().lock_ttl_s:g} s")
        return self

    @field_validator("node")
    @classmethod
    def _one_subject_token(cls, node: str) -> str:
        # Named as the node's collector names it (``as_node_name``), whatever the platform
        # calls it: a Kubernetes node name often has dots.
        return as_node_name(node)
