"""The policy service's settings (``FLEETPILOT_POLICY_*``)."""

from __future__ import annotations

import socket
from pathlib import Path

from fleetpilot.policy import Router
from fleetpilot.policy.builtin import BUILTIN_POLICIES
from fleetpilot.policy.rebalance import (
    GROWTH_LOOKAHEAD_S,
    MAX_MIGRATIONS_PER_ROUND,
    OOM_MIGRATE_RISK,
    RESIZE_MARGIN_MB,
)
from fleetpilot.runtime import ServiceSettings
from fleetpilot.runtime.config import queue_aging_default
from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import SettingsConfigDict

from .plugin_dir import DEFAULT_IMPORT_TIMEOUT_S
from .policy_set import PolicyConfig, load_config


class PolicySettings(ServiceSettings):
    """``FLEETPILOT_POLICY_*``. The policy fields are the defaults used while the ``config``
    bucket has neither ``policies.<hostname>`` nor ``policies.default``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_POLICY_", extra="ignore")

    # Bounds are checked at start-up: a period of 0 spins its loop, NaN (``asyncio.sleep``)
    # never wakes it, so queued tasks were never retried; a claim timeout of 0 hands every
    # claim to another replica mid-placement (two holds for one task); a negative lookahead
    # failed every telemetry sample; a probability outside (0, 1] made no sense downstream.

    pending_retry_s: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    claim_timeout_s: float = Field(default=30.0, gt=0.0, allow_inf_nan=False, description="A pending entry claimed longer ago than this "
                                   "was left by a replica that died placing it: another replica takes it")
    no_room_refresh_s: float = Field(default=30.0, gt=0.0, allow_inf_nan=False, description="A waiting task the retry "
                                     "round skips (a task asking no more found no node) has what kept it off every "
                                     "node told again at most this often: each telling is a write to its pending entry")
    # Before ``profile`` and the rules: they are checked against it (pydantic validates in order).
    plugin_dir: str = Field(default="", description="Directory of hot-reloaded policy modules ('' = none)")
    profile: str = "fleetpilot"
    # Traffic shaping: a JSON list of {"condition", "weight", "policy"} rules.
    shaping_rules: list[dict] = []
    breaker: dict = Field(default_factory=dict, description="BreakerConfig fields as JSON")
    seed: int = 0
    hostname: str = Field(default_factory=socket.gethostname, description="Selects policies.<hostname>")
    plugin_poll_s: float = Field(default=0.5, gt=0.0, allow_inf_nan=False)
    plugin_import_timeout_s: float = Field(
        default=DEFAULT_IMPORT_TIMEOUT_S, gt=0.0, allow_inf_nan=False,
        description="A changed policy module is first run in a child interpreter: one that has not finished "
        "importing and compiling its profiles by then is refused as hanging (its previous version serves)",
    )
    stats_refresh_s: float = Field(default=30.0, gt=0.0, allow_inf_nan=False)
    stats_timeout_s: float = Field(default=2.0, gt=0.0, allow_inf_nan=False)
    rebalance_s: float = Field(default=30.0, gt=0.0, allow_inf_nan=False)
    # How often the built-in profiles are rebuilt on the task shapes seen (FGD's typical
    # tasks, fleetpilot's demand), and how many recent admissions count.
    workload_refresh_s: float = Field(default=60.0, gt=0.0, allow_inf_nan=False)
    workload_window: int = Field(default=5000, ge=1)
    oom_migrate_risk: float = Field(default=OOM_MIGRATE_RISK, gt=0.0, le=1.0, description="P(OOM in place) from which a task is moved")
    max_migrations_per_round: int = Field(default=MAX_MIGRATIONS_PER_ROUND, ge=0)
    wait_risk: bool = Field(
        default=True,
        description="Weigh a smaller GPU's share of a program's runs that did not fit against the recent wait "
        "for the GPU its spread asks (policy.spread); off: never ask below the spread",
    )
    queue_aging: float = Field(
        default_factory=queue_aging_default, validate_default=True, gt=0.0, allow_inf_nan=False,
        description="How much a task's admission time weighs in the queue's order against the run it has "
        "left (backfill.completion_order): 1, a later task goes first only if expected to end before the "
        "waiting one would have; below 1, short work goes first more often; must be above 0",
    )
    resize_margin_mb: float = Field(default=RESIZE_MARGIN_MB, ge=0.0, allow_inf_nan=False, description="Head room above the peak's 90% bound")
    # What moving a running task costs (checkpoint and restore): the pause a clearing prices
    # its moves with, and how soon a task being moved releases the GPUs it leaves.
    checkpoint_base_s: float = Field(default=30.0, ge=0.0, allow_inf_nan=False, description="Pause of a checkpoint and restore, fixed part")
    checkpoint_s_per_gb: float = Field(default=2.0, ge=0.0, allow_inf_nan=False, description="Pause of a checkpoint and restore per GB held")
    preempt_restart_s: float = Field(default=60.0, ge=0.0, allow_inf_nan=False, description="Work an evicted task loses on top of its age (all it loses, if it resumes from its checkpoint)")
    vip_evicts_standard: bool = Field(
        default=False,
        description="A vip that no best_effort work can make room for may also evict standard work that "
        "resumes from its checkpoint and whose contract's deadline holds after its pause and a whole "
        "queue-time SLA's wait (policy.preempt.spares_an_eviction): vip waits end sooner, the mean wait may "
        "not (the fleet benchmark's log)",
    )
    evict_success: float = Field(default=0.97, gt=0.0, le=1.0, description="P(one eviction is carried out), for confidence")
    evict_timeout_s: float = Field(
        default=60.0, gt=0.0, allow_inf_nan=False, description="An eviction not carried out by then is given up"
    )
    refused_replacements: int = Field(
        default=2, ge=0,
        description="How many times a task whose assign the executor refused (a business rule, a GPU "
        "cordoned meanwhile) is placed again before it is given up",
    )
    oom_restarts: int = Field(
        default=6, ge=0,
        description="How many times a task killed by an OOM is placed again from scratch (Kubernetes' "
        "backoffLimit, 6), killed alone on its GPUs asking more than they have; its kills are counted, not "
        "its placements (placement_failures): killed once more, it is given up with task.rejected "
        "(0 = an OOM ends the task)",
    )
    untaken_expiry_s: float = Field(
        default=600.0, ge=0.0, allow_inf_nan=False,
        description="A reservation whose decision no executor took this long (the node's executor is down) "
        "expires: its holds go back and the task is placed again (0 = never)",
    )
    growth_lookahead_s: float = Field(
        default=GROWTH_LOOKAHEAD_S, gt=0.0, allow_inf_nan=False,
        description="How far a task's measured memory growth is carried ahead: a task that would overflow its "
        "GPU within it, with nowhere to move, is checkpointed and queued again",
    )
    record_every: int = Field(default=0, ge=0, description="Record every Nth decision input for replay (0 = off)")
    # The replay record is bounded: on disk at most (record_keep + 1) x record_max_mb. Before,
    # it grew until the disk was full.
    record_max_mb: float = Field(
        default=256.0, gt=0.0, allow_inf_nan=False,
        description="The replay record (policy-states.jsonl) is rotated to .1 before a record would take it "
        "past this many MiB (a record larger than that alone takes a file of its own)",
    )
    record_keep: int = Field(
        default=3, ge=0,
        description="Rotated replay record files kept (.1 the newest; the oldest is dropped at the next "
        "rotation; 0 = the full file is dropped)",
    )

    # The rules and the breaker are checked as a config document's are (misspelt fields,
    # the breaker's bounds), and the rules' conditions and weights parsed. Before, a misspelt
    # rule weight was dropped for 1 (every matching task to the canary), NaN budgets taken,
    # and a bad condition or weight stopped the replica only once connected, with a traceback.
    @field_validator("shaping_rules")
    @classmethod
    def _rules_make_sense(cls, rules: list[dict], info: ValidationInfo) -> list[dict]:
        shaping = load_config({"shaping": rules}).shaping
        Router(shaping, default="")
        for i, rule in enumerate(shaping):
            _known_policy(rule.policy, info.data.get("plugin_dir", ""), f"rule {i}: ")
        return rules

    # A policy name that is no built-in, with no module directory to define it, was taken
    # here and stopped the replica only once connected, with a traceback.
    @field_validator("profile")
    @classmethod
    def _profile_exists(cls, profile: str, info: ValidationInfo) -> str:
        _known_policy(profile, info.data.get("plugin_dir", ""))
        return profile

    @field_validator("breaker")
    @classmethod
    def _breaker_makes_sense(cls, breaker: dict) -> dict:
        load_config({"breaker": breaker})
        return breaker

    def policy_config(self) -> PolicyConfig:
        """The settings as a configuration document."""
        return load_config(
            {
                "profile": self.profile,
                "shaping": self.shaping_rules,
                "breaker": self.breaker,
                "seed": self.seed,
            }
        )


def _known_policy(name: str, plugin_dir: str, where: str = "") -> None:
    """``ValueError`` unless ``name`` is a built-in policy or may be a profile of a module in
    ``plugin_dir`` (an existing directory: its modules are loaded only once connected)."""
    if name in BUILTIN_POLICIES or (plugin_dir and Path(plugin_dir).is_dir()):
        return
    modules = (f"and FLEETPILOT_POLICY_PLUGIN_DIR {plugin_dir!r} is no directory" if plugin_dir
               else "and no FLEETPILOT_POLICY_PLUGIN_DIR is set to define it")
    raise ValueError(f"{where}unknown policy {name!r}: not a built-in ({', '.join(sorted(BUILTIN_POLICIES))}) "
                     f"{modules}")
