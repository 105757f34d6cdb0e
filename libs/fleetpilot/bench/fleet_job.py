"""One task of the fleet benchmark through its attempts (``Job``), and the virtual clock's
constants the run and its parts share."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fleetpilot.contracts import Fingerprint, TaskSubmitted
from fleetpilot.fingerprint import OnlineFingerprinter
from fleetpilot.policy.rebalance import MAX_MIGRATIONS_PER_ROUND
from fleetpilot.sla.snapshot import SnapshotKnobs
from fleetpilot.workload.growth import MemoryGrowth

from .fleet_workload import BenchTask

MODES: tuple[str, ...] = ("k8s-default", "kai-share", "fleetpilot")
BASELINES: tuple[str, ...] = ("k8s-default", "kai-share")
"""What Fleetpilot's loop can be measured against: the default scheduler with the NVIDIA device
plugin (whole GPUs; the issue's targets are set against it), or a scheduler that shares GPUs by
their declared memory with no knowledge of growth (KAI-Scheduler's GPU sharing, binpack)."""
TICK_S = 60.0
"""Scheduling cycle and telemetry period of the virtual clock."""
HEALTH_EVERY = 2
"""Health samples are taken every this many ticks (2 minutes), as the collector does."""
FEEDBACK_EVERY = 10
"""The feedback totals that correct fleetpilot's confidence are read every this many ticks."""
HEALTH_WINDOW = 30
"""Samples in a health window (one hour)."""
BACKOFF_LIMIT = 6
"""Restarts a Job allows before it fails (Kubernetes' default ``backoffLimit``)."""
STUCK_S = 3600.0
"""A task waiting longer than this is a stuck queue: someone would have stepped in."""
ROUNDS_PER_CYCLE = 2
"""The policy service's rebalance rounds in a cycle of ``TICK_S``: one every 30 s
(``rebalance_s``)."""
DECISIONS_PER_CYCLE = MAX_MIGRATIONS_PER_ROUND * ROUNDS_PER_CYCLE
"""The rebalance rounds' decisions in a cycle: resizes, moves, checkpoints, clearings, moves
down and making way all draw on ``MAX_MIGRATIONS_PER_ROUND`` a round (``decisions_left``)."""
MIGRATION_BASE_S = 30.0
MIGRATION_S_PER_GB = 2.0
CONFIDENT_COUNT = 4
"""A signature seen this many times is trusted; its tasks are no longer fingerprinted online."""
ROLE_OF_KIND = {"train": "train", "finetune": "train", "infer": "infer", "encode": "encode"}
SLA_KNOBS = SnapshotKnobs()
"""The sla service's default view settings: the benchmark's negotiator view keeps its headroom
for guaranteed tiers (``reserve_fraction``)."""



# ---- one job across its attempts ---------------------------------------------------------


@dataclass
class Job:
    """One task through its submissions, runs, moves and restarts (what the loop tracks)."""

    task: BenchTask
    submitted: TaskSubmitted
    signature: str
    seq: int
    state: str = "new"  # new, pending, running, done, failed, rejected
    queued_since: float = 0.0
    queue_s: float = 0.0
    attempts: int = 0
    evictions: int = 0  # runs Fleetpilot's policy evicted for a vip: they count toward no backoff limit
    migrations: int = 0
    row: int = -1
    gpus: list[int] = field(default_factory=list)
    milli: int = 0
    reserved_mb: int = 0
    planned_mb: int = 0
    seg_start: float = 0.0
    seg_pause: float = 0.0
    progress_s: float = 0.0
    finished_at: float | None = None
    counter_offered: bool = False
    confidence: float | None = None  # of the decision that first started it
    fingerprinter: OnlineFingerprinter | None = None
    prediction: Fingerprint | None = None
    resume: tuple[MemoryGrowth, float] | None = None
    stopped_at_mb: int = 0  # what a checkpointed run held per GPU, context included: it asks no less
    bridge_floor_mb: int = 0  # one checkpointed for outgrowing its GPUs is bridged only onto more room
    restored_from: float | None = None  # what a checkpointed run held, if its restore can tell (``restore_tells``)
    curve: MemoryGrowth | None = None
    bridged: bool = False
    history: deque | None = None
    from_start: bool = False  # its run began with its first start (no restore since): its envelope applies
    run_at: float = 0.0  # when that run began, kept across moves (the policy service's ``Allocation.run_at``)
    run_peak_mb: float = 0.0  # the most its run held per GPU before its latest move or checkpoint
    died_alone: bool = False  # killed by an OOM alone on its GPUs: its program's spread does not cover it
    agreed_pool: tuple[str, str] | None = None  # (site, model) its admission or accepted offer was estimated on
    bound_sites: tuple[str, ...] = ()  # the sites its contract binds it to (``sla.bound_sites``); (): any

    def useful_until(self, now: float) -> float:
        """Seconds of the task's own run done by ``now`` (pauses excluded)."""
        if self.state == "done":
            return self.task.duration_s
        if self.state != "running":
            return self.progress_s
        return min(self.task.duration_s, self.progress_s + max(0.0, now - self.seg_start - self.seg_pause))


