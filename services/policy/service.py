"""The policy service.

For each ``task.admitted`` (a durable consumer shared by every replica) it decides a
placement with the policy engine over the live fleet and ledger, reserves it in the ledger
with compare-and-set and only then publishes ``decision.made``, so a published ``assign`` is
final even with several replicas. A task that fits nowhere gets a ``queue`` decision and
waits in the ``pending`` bucket; it is retried whenever capacity may have freed.

Around that core (see ``README.md``):

* the policies come from the ``config`` bucket (``policies.<hostname>``, else
  ``policies.default``, else the settings), watched and swapped live (``policy_set``);
* policy modules in ``FLEETPILOT_POLICY_PLUGIN_DIR`` are hot-reloaded (``plugin_dir``);
* every policy sits behind a circuit breaker with a fallback scheduler rebuilt from the
  feedback service's success rates per (task kind, GPU model);
* GPU labels in the topology keep new work off cordoned, decommissioned and
  maintenance-pending GPUs, and a periodic rebalancer grows the hold of a task whose
  fingerprint predicts a peak above it when its GPU has room (``resize``), else migrates
  tasks off GPUs that are going away or where their fingerprint predicts an OOM
  (``rebalance``);
* the queue is ordered by tier, then by expected completion, with backfill around a
  reservation for the longest-blocked wide task (``backfill``); no placement or migration
  that would delay it uses the reserved GPUs, and when moving the tenants of a node costs
  less than its wait, the rebalancer migrates them away (``clear_for_reservation``);
* a ``vip`` task waiting in ``pending`` preempts the cheapest set of ``best_effort`` tasks on
  one node that makes it fit (``evict``); the evicted tasks wait in ``pending`` for a new
  placement (``preempt``); a task the executor evicts on its own (a decommissioned GPU) is
  queued the same way, once, under its next ``<task>.assign.<g>`` (``requeue_evicted``);
* a task with a fingerprint waits for GPUs that hold its predicted peak (plus 5%, as the
  ledger then holds); one whose fingerprint predicts smooth growth (``linear``, ``leak``)
  past every GPU free now may instead start on GPUs that hold its ask (a *bridge*), and the
  rebalancer moves it up to a GPU that holds its peak once one has room; a task that should
  move but has nowhere to go, and whose measured growth (``telemetry.task``) would overflow its
  GPU soon, is checkpointed (``evict``) and queued again rather than left to the OOM kill;
* every Nth decision input is recorded for ``fleetpilot replay``.

Decision ids are derived from the task (``<task>.assign``, ``<task>.migrate.<n>``,
``<task>.resize.<mb>``, ``<task>.evict.<g>``, ``<task>.assign.<g>``), and a
redelivered task that already holds capacity gets the same decision again: a policy killed
between reserving and acknowledging loses nothing and doubles nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections import OrderedDict, deque
from pathlib import Path

import msgspec
from fleetpilot.contracts import (
    ActionFailed,
    Allocation,
    DecisionMade,
    FeedbackStats,
    Fingerprint,
    NodeLedger,
    NodeTopology,
    Placement,
    PolicyRef,
    StatsQuery,
    TaskAdmitted,
    TaskFingerprinted,
    TaskLifecycle,
    TaskRejected,
    TaskSubmitted,
    TaskTelemetry,
    decode,
    encode,
    now,
)
from fleetpilot.ledger import FleetView, LedgerStore, free_capacity, with_allocations
from fleetpilot.ledger.store import node_key
from fleetpilot.policy import ClusterState, PolicyDecision, TaskRequest, record
from fleetpilot.policy.backfill import (
    Demand,
    Reservation,
    Tenant,
    clearing,
    gpu_free_at,
    hidden,
    queue_key,
    reserve,
    wide_hosts,
)
from fleetpilot.policy.calibration import ConfidenceCalibration
from fleetpilot.policy.state import MILLI
from fleetpilot.policy.transformers import oom_risk
from fleetpilot.runtime import Bus, CasConflict, KeyValue, Retry, ServiceHost, ServiceSettings
from prometheus_client import Counter, Gauge, Histogram
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from .admissions import Admissions
from .plugin_dir import PluginDirectory
from .policy_set import (
    CONFIG_PREFIX,
    DEFAULT_CONFIG_KEY,
    ActivePolicies,
    PolicyConfig,
    PolicySet,
    config_key,
    parse_config,
    success_table,
)
from .preempt import (
    Preemption,
    Requeue,
    Victim,
    assign_id,
    decode_pending,
    encode_pending,
    evict_confidence,
    evict_decision_id,
    eviction_cost,
    preemptions,
    reassign_decision_id,
)
from .rebalance import (
    CORDONED,
    DECOMMISSIONED,
    MAINTENANCE_PENDING,
    MoveReason,
    ResizePlan,
    Running,
    generation,
    gpu_conditions,
    growth_overflow,
    is_set,
    migrate_decision_id,
    move_reason,
    resize_decision_id,
    resize_plan,
    running_tasks,
)

log = logging.getLogger("fleetpilot.policy")

def queue_position(adm: TaskAdmitted) -> tuple[int, float, float]:
    """Where a waiting task stands: ``backfill.queue_key`` (vip first; within a tier, the
    earliest expected completion had it started on admission, so short work does not queue
    behind long work that came about the same time and nothing starves), then admission."""
    return (*queue_key(adm.contract.tier, adm.admitted_at, adm.task.expected_duration_s), adm.admitted_at)


class PolicySettings(ServiceSettings):
    """``FLEETPILOT_POLICY_*``. The policy fields are the defaults used while the ``config``
    bucket has neither ``policies.<hostname>`` nor ``policies.default``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_POLICY_", extra="ignore")

    pending_retry_s: float = 1.0
    profile: str = "fleetpilot"
    # Traffic shaping: a JSON list of {"condition", "weight", "policy"} rules.
    shaping_rules: list[dict] = []
    breaker: dict = Field(default_factory=dict, description="BreakerConfig fields as JSON")
    seed: int = 0
    hostname: str = Field(default_factory=socket.gethostname, description="Selects policies.<hostname>")
    plugin_dir: str = Field(default="", description="Directory of hot-reloaded policy modules ('' = none)")
    plugin_poll_s: float = 0.5
    stats_refresh_s: float = 30.0
    stats_timeout_s: float = 2.0
    rebalance_s: float = 30.0
    # How often the built-in profiles are rebuilt on the task shapes seen (FGD's typical
    # tasks, fleetpilot's demand), and how many recent admissions count.
    workload_refresh_s: float = 60.0
    workload_window: int = 5000
    oom_migrate_risk: float = Field(default=0.5, description="P(OOM in place) from which a task is moved")
    max_migrations_per_round: int = 10
    resize_margin_mb: float = Field(default=512.0, description="Head room above the peak's 90% bound")
    # What moving a running task costs (checkpoint and restore): the pause a clearing prices
    # its moves with, and how soon a task being moved releases the GPUs it leaves.
    checkpoint_base_s: float = Field(default=30.0, description="Pause of a checkpoint and restore, fixed part")
    checkpoint_s_per_gb: float = Field(default=2.0, description="Pause of a checkpoint and restore per GB held")
    preempt_restart_s: float = Field(default=60.0, description="Work an evicted task loses on top of its age")
    evict_success: float = Field(default=0.97, description="P(one eviction is carried out), for confidence")
    evict_timeout_s: float = Field(
        default=60.0, description="An eviction not carried out by then is given up"
    )
    refused_replacements: int = Field(
        default=2,
        description="How many times a task whose assign the executor refused (a business rule, a GPU "
        "cordoned meanwhile) is placed again before it is given up",
    )
    growth_lookahead_s: float = Field(
        default=240.0,
        description="How far a task's measured memory growth is carried ahead: a task that would overflow its "
        "GPU within it, with nowhere to move, is checkpointed and queued again",
    )
    record_every: int = Field(default=0, description="Record every Nth decision input for replay (0 = off)")

    def policy_config(self) -> PolicyConfig:
        """The settings as a configuration document."""
        return msgspec.convert(
            {
                "profile": self.profile,
                "shaping": self.shaping_rules,
                "breaker": self.breaker,
                "seed": self.seed,
            },
            PolicyConfig,
        )


def decision_id_for(task_id: str, action: str) -> str:
    """Deterministic decision id: every replica and every redelivery agrees on it."""
    return f"{task_id}.{action}"


QUEUE_CONFIDENCE = 0.95
"""The confidence of a ``queue`` decision before calibration."""

PEAK_HEADROOM = 1.05
"""A task with a fingerprint asks for (and the ledger holds) its predicted peak times this,
as the fleet benchmark reserves (``bench.fleet``'s ``_reservation``)."""

BRIDGE_PATTERNS = frozenset({"linear", "leak"})
"""Growth patterns a task may be bridged for: memory that rises smoothly gives the rebalancer
rounds to move the task up before the peak; a step or a burst may come before the next one."""


def calibration_key(policy: str, action: str) -> str:
    """The ``ConfidenceCalibration`` key of a policy's decisions of one action: each action
    has its own goal (an assign runs its course, a move is followed by no OOM...), so each is
    corrected by its own record."""
    return f"{policy}:{action}"


def totals_by_policy_action(groups: list) -> dict[str, tuple[float, float, float]]:
    """Feedback groups keyed by ``policy`` (``name@version``) and ``action``, summed per
    policy name and action (``calibration_key``): the sum of published confidences, the
    successes and the records (what ``ConfidenceCalibration`` learns from; a profile rebuilt
    under a new version is still the same policy). Records of unknown action are left out."""
    out: dict[str, tuple[float, float, float]] = {}
    for g in groups:
        name = g.key.get("policy", "").rsplit("@", 1)[0]
        action = g.key.get("action", "")
        if not name or name == "fallback" or not action:
            continue
        key = calibration_key(name, action)
        expected, met, count = out.get(key, (0.0, 0.0, 0.0))
        out[key] = (expected + g.expected_successes, met + g.successes, count + g.count)
    return out


def allocations_for(
    task: TaskSubmitted | TaskRequest, decision_id: str, placement: list[Placement]
) -> list[Allocation]:
    """The ledger holds of a placement (of a new task, or the target of a move); CPU and
    host memory are charged once."""
    return [
        Allocation(
            task_id=task.task_id,
            decision_id=decision_id,
            gpu=p.gpu,
            milli=p.milli,
            memory_mb=p.memory_mb,
            cpu_milli=task.cpu_milli if i == 0 else 0,
            host_memory_mb=task.memory_mb if i == 0 else 0,
            at=now(),
        )
        for i, p in enumerate(placement)
    ]


def placement_fits(
    topo: NodeTopology, ledger: NodeLedger | None, placement: list[Placement], cpu_milli: int, memory_mb: int
) -> bool:
    """Whether exactly these GPU shares (not just some GPU of the node) are free on the
    ledger we are about to overwrite, and no GPU has been taken out of service meanwhile."""
    free = free_capacity(topo, ledger)
    if free.cpu_milli < cpu_milli or free.memory_mb < memory_mb:
        return False
    labels = {g.index: g.labels for g in topo.gpus}
    for p in placement:
        if p.gpu < 0:
            continue
        if (
            p.gpu >= len(free.gpu_milli)
            or free.gpu_milli[p.gpu] < p.milli
            or free.gpu_memory_mb[p.gpu] < p.memory_mb
        ):
            return False
        lab = labels.get(p.gpu, {})
        if any(is_set(lab, x) for x in (CORDONED, DECOMMISSIONED, MAINTENANCE_PENDING)):
            return False
    return True


class PolicyMetrics:
    """The service's own series, in the host's registry next to the handler metrics."""

    def __init__(self, registry) -> None:
        self.reload = Histogram(
            "fleetpilot_policy_reload_seconds",
            "Time to rebuild and swap the policies",
            ["kind"],
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )
        self.last_reload = Gauge(
            "fleetpilot_policy_last_reload_seconds", "Duration of the last swap", ["kind"], registry=registry
        )
        self.generation = Gauge(
            "fleetpilot_policy_generation", "Generation of the policies serving now", registry=registry
        )
        self.decisions = Counter(
            "fleetpilot_policy_decisions_total",
            "Decisions published",
            ["action", "policy", "shard", "fallback"],
            registry=registry,
        )
        self.config_errors = Counter(
            "fleetpilot_policy_config_errors_total", "Config documents refused", registry=registry
        )

    def swapped(self, kind: str, seconds: float, generation: int) -> None:
        """Record one swap."""
        self.reload.labels(kind).observe(seconds)
        self.last_reload.labels(kind).set(seconds)
        self.generation.set(generation)

    def decided(self, d: DecisionMade) -> DecisionMade:
        """Count a decision on its way out."""
        self.decisions.labels(d.action, d.policy.name, d.shard_id, str(d.fallback).lower()).inc()
        return d


class PolicyState:
    """The replica's live view (fleet + ledger + fingerprints), its policies, and the
    choose-reserve-publish steps."""

    def __init__(
        self,
        fleet: FleetView,
        ledger: LedgerStore,
        settings: PolicySettings,
        active: ActivePolicies,
        metrics: PolicyMetrics,
    ) -> None:
        self.fleet = fleet
        self.ledger = ledger
        self.settings = settings
        self.active = active
        self.metrics = metrics
        # Latest fingerprint per task; bounded so a long-lived replica does not grow forever.
        self.fingerprints: OrderedDict[str, Fingerprint] = OrderedDict()
        # Tasks this replica decided, so a migration keeps the task's own GPU model constraints.
        self.tasks: OrderedDict[str, TaskSubmitted] = OrderedDict()
        # Contracts (tiers) of the running tasks: set at start-up, before any decision.
        self.admissions: Admissions | None = None
        # Resizes this replica proposed: one that failed is not proposed again under its id.
        self.resizes: OrderedDict[str, float] = OrderedDict()
        # The executor's journal (``executions``): which decision ids it has already taken.
        self.executions: KeyValue | None = None
        # The queue of tasks waiting for a placement (``pending``).
        self.pending: KeyValue | None = None
        # Per running task, its memory samples (``telemetry.task``) over the last
        # ``growth_lookahead_s``: (time, MB over all its GPUs). Dropped when it stops or moves.
        self.usage: OrderedDict[str, deque[tuple[float, float]]] = OrderedDict()
        self.decided_inputs = 0
        self.record_path = Path(settings.state_dir) / f"policy-states-{settings.replica}.jsonl"
        # The kept snapshot (``snapshot``): the topology and ledger versions it reflects.
        self._view: ClusterState | None = None
        self._view_topology = self._view_ledger = -1
        self._view_rows: dict[str, int] = {}
        # EASY backfill: GPUs kept for the first blocked whole-GPU task of the last queue
        # round; a task expected to outlast their release is placed as if they were taken.
        self.reservation: Reservation | None = None
        # Per policy, the correction of its confidence learnt from the feedback totals.
        self.calibration = ConfidenceCalibration()
        # ``largest_gpu_mb`` per model set, valid for one topology version.
        self._largest: dict[tuple[str, ...], int] = {}
        self._largest_at = -1

    def observe(self, sample: TaskTelemetry) -> None:
        """Keep a task's memory sample, and only those of the last ``growth_lookahead_s``."""
        kept = self.usage.get(sample.task_id)
        if kept is None:
            kept = deque()
        if kept and sample.at <= kept[-1][0]:
            return  # a late or repeated sample
        kept.append((sample.at, sample.memory_used_mb))
        while kept[0][0] < sample.at - self.settings.growth_lookahead_s:
            kept.popleft()
        self.remember(self.usage, sample.task_id, kept, limit=50_000)

    async def taken_at(self, decision_id: str) -> float | None:
        """When the executor took ``decision_id`` (its journal entry in ``executions``: the
        claim, the result), ``None`` when it never did; 0 when the entry carries no time."""
        if self.executions is None:
            return None
        found = await self.executions.get(node_key(decision_id))
        if found is None or not found.value:
            return None
        try:
            doc = msgspec.json.decode(found.value)
        except msgspec.DecodeError:
            return 0.0
        times = [doc.get(f) for f in ("executed_at", "failed_at", "at")] if isinstance(doc, dict) else []
        return next((float(t) for t in times if isinstance(t, int | float)), 0.0)

    async def journaled(self, decision_id: str) -> bool:
        """Whether the executor has taken ``decision_id`` (claimed it, or recorded its result).
        A re-proposal under such an id would be dropped by the stream's duplicate window or
        the journal, and its fresh reservation would then be held until the task ends."""
        return await self.taken_at(decision_id) is not None

    # ---- views --------------------------------------------------------------------------
    def remember(self, cache: OrderedDict, key: str, value, limit: int = 100_000) -> None:
        """Keep ``value`` as the newest entry of a bounded cache."""
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > limit:
            cache.popitem(last=False)

    def snapshot(self, without: frozenset[str] = frozenset()) -> ClusterState:
        """The fleet as the policies see it: topology, ledger holds, GPU condition labels;
        ``without`` drops those tasks' holds (the fleet after evicting them).

        Building it from the records costs ~30 ms on a 1,200-node fleet, thirty times a
        decision, so the view is kept: rebuilt when the topology changes, and otherwise
        brought up to date row by row for the ledger keys changed since (``set_holds``).
        Each caller gets its own copy, free to mask or allocate on."""
        if without:
            return self.build_snapshot(without)
        if self._view is None or self._view_topology != self.fleet.version:
            self._view_topology, self._view_ledger = self.fleet.version, self.ledger.version
            self._view = self.build_snapshot()
            self._view_rows = {node_key(name): row for row, name in enumerate(self._view.node_names)}
        elif self._view_ledger != self.ledger.version:
            for key, at in self.ledger.changed_at.items():
                row = self._view_rows.get(key)
                if at > self._view_ledger and row is not None:
                    ledger = self.ledger.nodes.get(key)
                    self._view.set_holds(row, ledger.allocations if ledger is not None else ())
            self._view_ledger = self.ledger.version
        return self._view.copy()

    def build_snapshot(self, without: frozenset[str] = frozenset()) -> ClusterState:
        """``snapshot`` built from the records, every node."""
        nodes = list(self.fleet.nodes.values())
        unhealthy, maintenance = gpu_conditions(nodes)
        state = ClusterState.from_topology(
            nodes,
            {
                ledger.node: [a for a in ledger.allocations if a.task_id not in without]
                for ledger in self.ledger.nodes.values()
            },
            unhealthy=unhealthy,
        )
        # ``from_topology``'s ``maintenance`` takes whole nodes; a label is per GPU, so only
        # that GPU stops taking work.
        for node, gpu in maintenance:
            try:
                state.set_condition(state.node_index(node), [gpu], maintenance=True)
            except (KeyError, IndexError):
                continue
        return state

    def request(self, task: TaskSubmitted) -> TaskRequest:
        """The task as the policies see it, with its fingerprint when one has arrived.

        With a predicted peak, the GPU memory asked is the peak times ``PEAK_HEADROOM``
        (never less than the task's own ask), so the task waits for GPUs that hold it, and
        its models are those whose GPUs can (the model-demand pressure then keeps flexible
        work off the big GPUs). Nothing holds more than the largest GPU of a model the task
        accepts: a prediction above it needs a whole one of those rather than no GPU ever.
        """
        fp = self.fingerprints.get(task.task_id)
        req = TaskRequest.from_submitted(task, fp)
        if fp is None or fp.predicted_peak_mb <= 0 or req.gpus <= 0 or req.gpu_milli <= 0:
            return req
        want = int(math.ceil(fp.predicted_peak_mb * PEAK_HEADROOM))
        largest = self.largest_gpu_mb(req.gpu_models)
        memory_mb = max(min(want, largest) if largest > 0 else want, req.gpu_memory_mb)
        models = tuple(m for m in req.gpu_models if self.largest_gpu_mb((m,)) >= memory_mb) or req.gpu_models
        return msgspec.structs.replace(req, gpu_memory_mb=memory_mb, gpu_models=models)

    def bridge_request(self, task: TaskSubmitted, plain: TaskRequest) -> TaskRequest | None:
        """The request a task may start on when ``plain`` (its peak) finds no node: the task
        as submitted, its ask and no predicted peak, for a fingerprint that predicts smooth
        growth (``BRIDGE_PATTERNS``) beyond the ask; ``None`` for any other task.

        A task that asks no GPU memory is not bridged: nothing says what it needs at the start,
        so the bridge would put it anywhere. No OOM floor applies: the ``Fingerprint`` the
        service receives carries none (the fingerprinter folds the signature's floor into the
        predicted peak), and the ask is what the submitter says the task starts with.
        """
        fp = self.fingerprints.get(task.task_id)
        if fp is None or fp.pattern not in BRIDGE_PATTERNS or task.gpu_memory_mb <= 0:
            return None
        if task.gpus <= 0 or task.gpu_milli <= 0 or task.gpu_memory_mb >= plain.gpu_memory_mb:
            return None
        return TaskRequest.from_submitted(task)

    def requests(self, task: TaskSubmitted) -> list[TaskRequest]:
        """What ``place`` tries for the task, in order: its request, then its bridge if any."""
        plain = self.request(task)
        bridge = self.bridge_request(task, plain)
        return [plain] if bridge is None else [plain, bridge]

    def largest_gpu_mb(self, models: tuple[str, ...]) -> int:
        """The memory of the largest GPU in the fleet of one of ``models`` (any model when
        empty); 0 when the fleet has none."""
        if self._largest_at != self.fleet.version:
            self._largest, self._largest_at = {}, self.fleet.version
        if models not in self._largest:
            gpus = (g for topo in self.fleet.nodes.values() for g in topo.gpus)
            self._largest[models] = max((g.memory_mb for g in gpus if not models or g.model in models), default=0)
        return self._largest[models]

    def bridge_hold_mb(self, state: ClusterState, choice: PolicyDecision, plain: TaskRequest, ask_mb: int) -> int:
        """GPU memory a bridged task holds on each chosen GPU: what the least free of them has
        free, up to what its plain request wanted, never less than its ask. It grows there
        until it is moved up, so nothing else may be placed into that room meanwhile (the
        fleet benchmark holds the same)."""
        gpus = [p.gpu for p in choice.placement if p.gpu >= 0]
        if not gpus:
            return ask_mb
        free = int(state.gpu_mem_free[state.node_index(choice.placement[0].node), gpus].min())
        return max(ask_mb, min(plain.gpu_memory_mb, free))

    def record_input(self, state: ClusterState, req: TaskRequest) -> None:
        """Append every ``record_every``-th decision input to the replay file."""
        every = self.settings.record_every
        if every <= 0:
            return
        self.decided_inputs += 1
        if self.decided_inputs % every:
            return
        try:
            self.record_path.parent.mkdir(parents=True, exist_ok=True)
            with self.record_path.open("ab") as fh:
                fh.write(msgspec.json.encode(record(state, req)) + b"\n")
        except OSError as exc:  # recording is best effort: never lose a decision over it
            log.warning("cannot record a state for replay: %s", exc)

    # ---- decisions ----------------------------------------------------------------------
    def assign_decision(
        self,
        adm: TaskAdmitted,
        placement: list[Placement],
        confidence: float,
        reason: str,
        policy: PolicyRef,
        shard_id: str = "primary",
        fallback: bool = False,
        decision_id: str | None = None,
    ) -> DecisionMade:
        """The ``assign`` decision of a reserved placement (``<task>.assign`` unless this is
        the re-placement of an evicted task)."""
        return DecisionMade(
            decision_id=decision_id or decision_id_for(adm.task.task_id, "assign"),
            task_id=adm.task.task_id,
            action="assign",
            placement=placement,
            confidence=confidence,
            policy=policy,
            shard_id=shard_id,
            fallback=fallback,
            reason=reason,
            decided_at=now(),
            task=adm.task,
            contract=adm.contract,
        )

    def existing(self, adm: TaskAdmitted, decision_id: str | None = None) -> DecisionMade | None:
        """The decision already reserved for this task, if a previous delivery got that far."""
        held = self.ledger.holds_of(adm.task.task_id)
        if held is None:
            return None
        _, allocs = held
        node = self.ledger.nodes[held[0]].node
        placement = [Placement(node=node, gpu=a.gpu, milli=a.milli, memory_mb=a.memory_mb) for a in allocs]
        return self.assign_decision(
            adm,
            placement,
            0.9,
            "re-issued: capacity already reserved",
            PolicyRef(name=self.active.current.default),
            decision_id=decision_id,
        )

    def policy_ref(self, policies: PolicySet, name: str, choice: PolicyDecision) -> PolicyRef:
        """Who decided: the routed policy and its version, or the fallback scheduler."""
        if choice.fallback:
            return PolicyRef(name="fallback", version=str(policies.generation))
        return PolicyRef(name=name, version=policies.versions.get(name, "1"))

    async def place(
        self, adm: TaskAdmitted, decision_id: str | None = None
    ) -> tuple[DecisionMade | None, str, str]:
        """Choose, reserve with CAS (re-choosing on conflict); the decision (``None`` when
        nothing fits) and the policy name and shard the task was routed to. ``decision_id``
        names a re-placement (``<task>.assign.<g>``)."""
        task = adm.task
        self.remember(self.tasks, task.task_id, task)
        if self.admissions is not None:
            self.admissions.placed(adm)
        decision_id = decision_id or decision_id_for(task.task_id, "assign")
        for attempt in range(10):
            policies = self.active.current  # one set for the whole decision, swaps fall between
            name, shard_id = policies.route(task)
            state = self.snapshot()
            held = self.reservation
            if held is not None and not held.delayed_by(task.task_id, task.expected_duration_s, now()):
                held = None
            # The request with the predicted peak first; a smooth grower that finds no GPU for
            # its peak may then start on its ask (a bridge), under the same policy and rules.
            requests = self.requests(task)
            fp = self.fingerprints.get(task.task_id)  # the one the requests were built from
            for req in requests:
                with hidden(state, held):
                    choice = policies.guarded[name].decide(state, req)
                if attempt == 0:
                    self.record_input(state, req)
                if choice.action == "assign" and choice.placement:
                    break
            else:
                return None, name, shard_id
            plain = requests[0]
            bridged = req is not plain
            memory_mb = self.bridge_hold_mb(state, choice, plain, req.gpu_memory_mb) if bridged else req.gpu_memory_mb
            placement = choice.placements(memory_mb=memory_mb)
            node = placement[0].node
            topo = self.fleet.nodes.get(node_key(node))
            if topo is None:
                continue

            def reserve(
                current: NodeLedger | None, placement=placement, node=node, topo=topo
            ) -> NodeLedger | None:
                # Re-check on the ledger we are about to overwrite: the view may be stale.
                if current is not None and any(a.task_id == task.task_id for a in current.allocations):
                    return None  # another delivery of this task reserved meanwhile
                if not placement_fits(topo, current, placement, task.cpu_milli, task.memory_mb):
                    return None
                return with_allocations(current, node, allocations_for(task, decision_id, placement))

            try:
                written = await self.ledger.mutate(node_key(node), reserve)
            except CasConflict:
                continue
            if written is None:
                again = self.existing(adm, decision_id)
                if again is not None:
                    return again, name, shard_id
                continue  # someone took the space between our view and the write: choose again
            # The fallback's confidence is already its historical success rate.
            confidence = (choice.confidence if choice.fallback
                          else self.calibration.apply(calibration_key(name, "assign"), choice.confidence))
            reason = choice.reason
            if bridged and fp is not None:
                reason = (
                    f"bridge: starts on its ask of {req.gpu_memory_mb} MB (holds {memory_mb} MB); its fingerprint "
                    f"predicts {fp.pattern} growth to {fp.predicted_peak_mb:.0f} MB, which no free GPU holds now; "
                    f"moved up before it gets there; {choice.reason}"
                )
            return (
                self.assign_decision(
                    adm,
                    placement,
                    confidence,
                    reason,
                    self.policy_ref(policies, name, choice),
                    shard_id,
                    choice.fallback,
                    decision_id,
                ),
                name,
                shard_id,
            )
        raise Retry("ledger contention", 0.2)

    def reservation_for(self, adm: TaskAdmitted) -> Reservation | None:
        """Where and when a blocked whole-GPU task can start earliest (``backfill.reserve``),
        judged by the durations the running tasks declared: a hold whose task declared none,
        or that this replica cannot name, is taken never to end."""
        state = self.snapshot()
        return reserve(state, self.request(adm.task), gpu_free_at(state, self.running_ends(state), now()))

    def running_ends(self, state: ClusterState) -> list[tuple[int, list[int], float]]:
        """``(row, gpus, expected end)`` of every GPU hold in the ledger.

        A hold ends when its task is expected to (its first hold's time plus the duration it
        declared), except the hold a task is being migrated off: the executor releases it
        once the task is restored on the target, a checkpoint pause after the move was
        decided. So the GPUs a clearing empties are reserved for the task it cleared them
        for as soon as the moves are decided, and nothing that would delay it takes them
        when they free."""
        moving = self.moves_in_flight()
        out: list[tuple[int, list[int], float]] = []
        for ledger in self.ledger.nodes.values():
            try:
                row = state.node_index(ledger.node)
            except KeyError:
                continue
            holds: dict[tuple[str, bool], list[Allocation]] = {}
            for a in ledger.allocations:
                if a.gpu >= 0:
                    move = moving.get(a.task_id)
                    leaving = move is not None and a.decision_id != move[0]
                    holds.setdefault((a.task_id, leaving), []).append(a)
            for (task_id, leaving), allocs in holds.items():
                if leaving:
                    end = moving[task_id][1] + self.checkpoint_pause_s(max(a.memory_mb for a in allocs))
                else:
                    declared = self.declared_s(task_id)
                    end = min(a.at for a in allocs) + declared if declared else math.inf
                out.append((row, [a.gpu for a in allocs], end))
        return out

    def moves_in_flight(self) -> dict[str, tuple[str, float]]:
        """Tasks being migrated: task id -> (the move's decision id, when its target was
        reserved). The target hold stays ``reserved`` until the executor has moved the task."""
        out: dict[str, tuple[str, float]] = {}
        for ledger in self.ledger.nodes.values():
            for a in ledger.allocations:
                own = a.decision_id[len(a.task_id):] if a.decision_id.startswith(a.task_id) else ""
                if a.state == "reserved" and ".migrate." in own:
                    out[a.task_id] = (a.decision_id, a.at)
        return out

    def declared_s(self, task_id: str) -> float | None:
        """The run time the task declared (``expected_duration_s``), ``None`` when the task
        is unknown to this replica or declared none."""
        adm = self.admissions.of(task_id) if self.admissions is not None else None
        task = adm.task if adm is not None else self.tasks.get(task_id)
        return task.expected_duration_s if task is not None and task.expected_duration_s else None

    def remaining_s(self, running: Running) -> float | None:
        """What is left of the run a running task declared: its duration less the time
        since its first hold (``None`` when unknown, taken as long by ``delayed_by``)."""
        declared = self.declared_s(running.task_id)
        if declared is None:
            return None
        return max(declared - (now() - min(a.at for a in running.allocations)), 0.0)

    def may_pause(self, running: Running, pause_s: float) -> bool:
        """Whether a clearing may pause ``running`` for ``pause_s``: not when the pause would
        make it miss the deadline its contract carries (its expected end, by the duration it
        declared, plus the pause; an unknown end with a deadline counts as too late). A
        queue-time SLA is not touched by a pause, whatever the tier."""
        adm = self.admissions.of(running.task_id) if self.admissions is not None else None
        deadline = adm.contract.deadline if adm is not None else None
        if deadline is None:
            return True
        remaining = self.remaining_s(running)
        return remaining is not None and now() + remaining + pause_s <= deadline

    def checkpoint_pause_s(self, memory_mb: float) -> float:
        """Seconds a task holding ``memory_mb`` per GPU makes no progress when moved: its
        checkpoint and restore. Each GPU's state is written in parallel, so what one GPU
        holds sets the pause, not the sum over the task's GPUs."""
        return self.settings.checkpoint_base_s + self.settings.checkpoint_s_per_gb * memory_mb / 1024.0

    async def rebalance_round(self) -> list[DecisionMade]:
        """One rebalancing round (``rebalance``): a ``resize`` for a task whose predicted
        peak is above its hold where its GPU has room, else ``migrate`` for a task that should
        move; then, with what is left of the round's budget, the moves that clear a node for
        the task the reservation is for (``clear_for_reservation``). The extra memory or the
        target is reserved with CAS before the decision is returned. At most
        ``max_migrations_per_round`` decisions."""
        out: list[DecisionMade] = []
        for running in running_tasks(list(self.ledger.nodes.values())):
            if len(out) >= self.settings.max_migrations_per_round:
                break
            topo = self.fleet.nodes.get(node_key(running.node))
            ledger = self.ledger.nodes.get(node_key(running.node))
            if topo is None or ledger is None or not running.gpus:
                continue
            fp = self.fingerprints.get(running.task_id)
            plan = resize_plan(
                running, topo, ledger, fp, self.settings.oom_migrate_risk, self.settings.resize_margin_mb
            )
            resize_id = resize_decision_id(running, plan.memory_mb) if plan is not None else ""
            # A resize under an id already proposed (by this replica) or taken (by the
            # executor, which failed it: a done resize changes the hold) is not tried again.
            if plan is not None and resize_id not in self.resizes and not await self.journaled(resize_id):
                resized = await self.resize(running, topo, plan)
                if resized is not None:
                    out.append(resized)
                continue  # cheaper than a move; a lost race is tried again next round
            reason = move_reason(running, topo, ledger, fp, self.settings.oom_migrate_risk)
            if reason is None:
                continue
            decision = await self.migrate(running, topo, fp, reason.p_stay_fails, reason.why)
            if decision is None and fp is not None:
                decision = await self.checkpoint(running, topo, ledger, reason)
            if decision is not None:
                out.append(decision)
        budget = self.settings.max_migrations_per_round - len(out)
        if budget > 0:
            out.extend(await self.clear_for_reservation(budget, {d.task_id for d in out}))
        return out

    async def clear_for_reservation(self, budget: int, moved: set[str]) -> list[DecisionMade]:
        """``migrate`` decisions that empty a node for the task the reservation is for, when
        moving the node's tenants costs less than its wait (``backfill.clearing``); none when
        the plan needs more than ``budget`` moves. ``moved`` already have a decision.

        EASY backfill only waits for GPUs to free; when every node a wide task can use is
        held for hours, that is hours of its wait and of the GPUs kept idle for it, while the
        tenants of one node could run elsewhere at the price of a checkpoint. A tenant costs
        its checkpoint pause (``checkpoint_pause_s`` of its hold) times the GPUs it holds, as
        a share; the waiting task gains the wait it is spared (to the reservation's start,
        less the longest of those pauses) times the GPUs it needs. The targets are the
        default policy's, with the cleared GPUs hidden.

        The waiting task is not placed here: once the executor has moved the tenants and
        released their holds, the next queue round places it. Until then the reservation
        follows the cleared GPUs (``running_ends``: a hold being moved off ends after the
        pause), so nothing that would delay the task takes them. A move lost to a race
        stops the clearing (the rest would not make room); the next round plans again.
        """
        held = self.reservation
        if held is None or held.start_s <= now() or self.admissions is None:
            return []
        adm = self.admissions.of(held.task_id)
        if adm is None or self.ledger.holds_of(held.task_id) is not None:
            return []  # unknown, or no longer waiting: placed since the reservation was made
        state = self.snapshot()
        request = self.request(adm.task)
        # Only tasks on nodes the waiting task could use can be in its way.
        hosts = wide_hosts(state, request)
        tenants: dict[str, tuple[Tenant, Running, NodeTopology]] = {}
        for running in running_tasks(list(self.ledger.nodes.values())):
            topo = self.fleet.nodes.get(node_key(running.node))
            gpu_allocs = [a for a in running.allocations if a.gpu >= 0]
            if running.task_id in moved or topo is None or not gpu_allocs:
                continue
            try:
                row = state.node_index(running.node)
            except KeyError:
                continue
            if not hosts[row]:
                continue
            memory_mb = max(a.memory_mb for a in gpu_allocs)
            pause_s = self.checkpoint_pause_s(memory_mb)
            if not self.may_pause(running, pause_s):
                continue
            tenant = Tenant(
                request=self.move_request(running, topo, self.fingerprints.get(running.task_id)),
                row=row,
                gpus=tuple(running.gpus),
                milli=gpu_allocs[0].milli,
                gpu_memory_mb=memory_mb,
                pause_s=pause_s,
            )
            tenants[running.task_id] = (tenant, running, topo)
        policies = self.active.current
        wait_s = held.start_s - now()
        plan = clearing(state, request, [t for t, _, _ in tenants.values()],
                        policies.guarded[policies.default].decide, wait_s=wait_s)
        if plan is None or len(plan.moves) > budget:
            return []
        why = (f"clearing {state.node_names[plan.row]} for {held.task_id} (GPUs {list(plan.gpus)}), which would "
               f"wait {wait_s:.0f} s: moving {len(plan.moves)} tasks costs {plan.cost:.0f} GPU-s")
        log.info("%s", why)
        out: list[DecisionMade] = []
        for move in plan.moves:
            tenant, running, topo = tenants[move.task_id]
            target = [
                Placement(node=state.node_names[move.row], gpu=g, milli=move.milli,
                          memory_mb=tenant.request.gpu_memory_mb)
                for g in move.gpus
            ]
            decision = await self.migrate(running, topo, self.fingerprints.get(move.task_id), 0.0, why, target)
            if decision is None:
                break
            out.append(decision)
        return out

    async def checkpoint(
        self, running: Running, topo: NodeTopology, ledger: NodeLedger, reason: MoveReason
    ) -> DecisionMade | None:
        """An ``evict`` for a task that should move, has nowhere to go, and whose measured
        growth would overflow its GPU within ``growth_lookahead_s`` (``growth_overflow``):
        stopped now (the executor's SIGTERM, on which a trainer checkpoints) and queued again
        under its next ``<task>.assign.<g>``, it loses a restart; left alone, it would lose
        its run to the OOM kill. Its ``pending`` entry is written first, as a preemption's."""
        why = growth_overflow(running, topo, ledger, self.usage.get(running.task_id, ()),
                              self.settings.growth_lookahead_s)
        if why is None or self.pending is None:
            return None
        adm = self.admissions.of(running.task_id) if self.admissions else None
        if adm is None:
            log.warning("%s will outgrow its GPU with nowhere to go, but its admission is unknown: not "
                        "checkpointed (%s)", running.task_id, why)
            return None
        evict_id = evict_decision_id(running)
        if await self.journaled(evict_id):
            return None  # that eviction was tried: its outcome decides
        note = Requeue(decision_id=reassign_decision_id(running), evict_id=evict_id, at=now(),
                       reason=f"checkpointed: {why}")
        try:
            await self.pending.create(node_key(running.task_id), encode_pending(adm, note))
        except CasConflict:
            return None  # another replica (or an earlier round) queued it already
        return DecisionMade(
            decision_id=evict_id,
            task_id=running.task_id,
            action="evict",
            source=[Placement(node=running.node, gpu=a.gpu, milli=a.milli, memory_mb=a.memory_mb)
                    for a in running.allocations],
            confidence=float(reason.p_stay_fails * self.settings.evict_success),
            policy=PolicyRef(name="checkpoint"),
            reason=f"checkpoint and queue again: {reason.why}; no GPU can take it now, and {why}",
            decided_at=now(),
            task=adm.task,
            contract=adm.contract,
        )

    async def resize(self, running: Running, topo: NodeTopology, plan: ResizePlan) -> DecisionMade | None:
        """Reserve the extra GPU memory of a resize with CAS (a second hold under the resize's
        decision id, which the executor folds into the task's hold once done), then decide."""
        decision_id = resize_decision_id(running, plan.memory_mb)
        held = {a.gpu: a for a in running.allocations if a.gpu >= 0}
        extra = [
            Allocation(
                task_id=running.task_id,
                decision_id=decision_id,
                gpu=gpu,
                milli=0,
                memory_mb=more,
                at=now(),
            )
            for gpu, more in sorted(plan.extra.items())
        ]

        def reserve(current: NodeLedger | None) -> NodeLedger | None:
            if current is None or any(a.decision_id == decision_id for a in current.allocations):
                return None  # gone, or another replica reserved this very resize
            mine = {a.gpu: a for a in current.allocations if a.task_id == running.task_id}
            if set(mine) != set(held) or any(mine[g] != held[g] for g in held):
                return None  # the task changed since our view: next round decides again
            free = free_capacity(topo, current)
            if any(free.gpu_memory_mb[a.gpu] < a.memory_mb for a in extra):
                return None
            labels = {g.index: g.labels for g in topo.gpus}
            if any(
                is_set(labels.get(a.gpu, {}), x)
                for a in extra
                for x in (CORDONED, DECOMMISSIONED, MAINTENANCE_PENDING)
            ):
                return None
            return NodeLedger(node=current.node, allocations=[*current.allocations, *extra])

        try:
            written = await self.ledger.mutate(node_key(running.node), reserve)
        except CasConflict:
            return None
        if written is None:
            return None
        self.remember(self.resizes, decision_id, now(), limit=10_000)
        source = [
            Placement(node=running.node, gpu=a.gpu, milli=a.milli, memory_mb=a.memory_mb)
            for a in running.allocations
            if a.gpu >= 0
        ]
        adm = self.admissions.of(running.task_id) if self.admissions else None
        return DecisionMade(
            decision_id=decision_id,
            task_id=running.task_id,
            action="resize",
            placement=[msgspec.structs.replace(p, memory_mb=plan.memory_mb) for p in source],
            source=source,
            confidence=float(plan.confidence),
            policy=PolicyRef(name="resize"),
            reason=plan.why,
            decided_at=now(),
            task=self.tasks.get(running.task_id) or (adm.task if adm else None),
            contract=adm.contract if adm else None,
        )

    # ---- tasks the executor evicted on its own ----------------------------------------------
    async def requeue_evicted(
        self, life: TaskLifecycle, pending: KeyValue, ledger: KeyValue
    ) -> Requeue | None:
        """Queue a task the executor evicted without a decision of ours (its GPU was
        decommissioned) for a new placement (``requeue``)."""
        return await self.requeue(
            life.task_id, life.decision_id, life.at,
            life.detail or f"evicted by the executor from {life.node} {life.gpus}", pending, ledger,
        )

    async def requeue_failed(
        self, failed: ActionFailed, pending: KeyValue, ledger: KeyValue
    ) -> Requeue | None:
        """Queue again a task whose assign the executor could not carry out; it released the
        hold. A passing failure (``retryable``: the backend did not answer) is retried every
        time. A refusal (a business rule, a GPU cordoned or reserved since the decision) is
        retried ``refused_replacements`` times (``given_up`` says when no more)."""
        if failed.action != "assign" or self.given_up(failed) is not None:
            return None
        what = "failed" if failed.retryable else "refused"
        return await self.requeue(
            failed.task_id, failed.decision_id, failed.failed_at, f"assign {what}: {failed.error}",
            pending, ledger,
        )

    def given_up(self, failed: ActionFailed) -> TaskRejected | None:
        """The ``task.rejected`` that tells the submitter a task will not run: its assign was
        refused again after ``refused_replacements`` placements. The policy applies the same
        rules as the executor, from the topology's labels, so a placement made after the
        labels changed avoids the refusing GPU; a refusal that repeats beyond that comes from a
        rule the labels do not carry, and placing again would only be refused again."""
        if failed.action != "assign" or failed.retryable:
            return None
        if generation(failed.task_id, failed.decision_id) <= self.settings.refused_replacements:
            return None
        adm = self.admissions.of(failed.task_id) if self.admissions else None
        return TaskRejected(
            task_id=failed.task_id,
            tenant=adm.tenant if adm else "",
            code="infeasible",
            reason=f"refused by the executor {generation(failed.task_id, failed.decision_id)} times, last as "
            f"{failed.decision_id}: {failed.error}",
            rejected_at=failed.failed_at,
        )

    async def requeue(
        self, task_id: str, decision_id: str, at: float, reason: str,
        pending: KeyValue, ledger: KeyValue,
    ) -> Requeue | None:
        """Queue ``task_id``, whose placement ``decision_id`` ended at ``at``, for a new one:
        its admission goes to ``pending`` with a ``requeue`` note naming
        ``<task>.assign.<g+1>``, created only if the task has no entry (create-only: a
        redelivered event, or another replica, finds it and stops). The note, or ``None``
        when there is nothing to do:

        * the task already has an entry (the policy's own eviction, an earlier delivery of
          this event, a replica placing it right now);
        * it holds capacity somewhere (already placed again, or moving: a fresh read of the
          ledger, since the view may lag the executor's release);
        * the event is stale: the executor took the task's next assign after it;
        * its admission is unknown (no ``contract.<task>``, not placed by this replica).
        """
        key = node_key(task_id)
        entry = await pending.get(key)
        if entry is not None and entry.value:
            return None
        for node in await ledger.keys():
            held = await ledger.get(node)
            if held is None or not held.value:
                continue
            if any(
                a.task_id == task_id for a in msgspec.json.decode(held.value, type=NodeLedger).allocations
            ):
                log.info("%s (%s) holds capacity on %s: not queued again", task_id, reason, node)
                return None

        # g is the placement the executor ended. The event names its decision when the
        # evicting replica carried that placement out itself (else g starts at 1); the
        # executor's journal then says which later ``<task>.assign.<g>`` it has already taken
        # (a re-used id would be dropped by the stream's duplicate window and the journal).
        # One it took after this eviction means the eviction has been dealt with already (a
        # late redelivery, the task placed again since, perhaps finished): nothing to do.
        g = generation(task_id, decision_id) if decision_id else 1
        for _ in range(1000):
            taken = await self.taken_at(assign_id(task_id, g + 1))
            if taken is None:
                break
            if taken >= at:
                log.info("stale news of %s (%s): placed again as %s since", task_id, reason, assign_id(task_id, g + 1))
                return None
            g += 1
        adm = await self.admissions.fetch(task_id) if self.admissions is not None else None
        if adm is None:
            log.warning("%s (%s): its admission is unknown, not queued again", task_id, reason)
            return None
        note = Requeue(decision_id=assign_id(task_id, g + 1), at=now(), reason=reason)
        try:
            await pending.create(key, encode_pending(adm, note))
        except CasConflict:
            return None  # queued meanwhile: by another delivery, a replica, or a preemption
        log.warning("%s (%s): queued again as %s", task_id, note.reason, note.decision_id)
        return note

    # ---- preemption -------------------------------------------------------------------------
    def victims(self, exclude: set[str]) -> list[Victim]:
        """Running tasks that a vip may preempt: tier known to be ``best_effort``."""
        assert self.admissions is not None
        at = now()
        out = []
        for running in running_tasks(list(self.ledger.nodes.values())):
            if running.task_id in exclude:
                continue
            adm = self.admissions.of(running.task_id)
            if adm is None or adm.contract.tier != "best_effort":
                continue
            out.append(Victim(running, adm, eviction_cost(running, at, self.settings.preempt_restart_s)))
        return out

    def preemption_for(self, adm: TaskAdmitted) -> tuple[Preemption, PolicyDecision] | None:
        """The cheapest preemption after which the routed policy places the vip task."""
        policies = self.active.current
        name, _ = policies.route(adm.task)
        req = self.request(adm.task)
        plans = preemptions(adm.task, self.fleet.nodes, self.ledger.nodes, self.victims({adm.task.task_id}))
        for plan in plans[:3]:  # the pure fit check and the policy rarely disagree
            state = self.snapshot(without=frozenset(v.task_id for v in plan.victims))
            choice = policies.guarded[name].decide(state, req)
            if choice.action == "assign" and choice.placement and choice.placement[0].node == plan.node:
                return plan, choice
        return None

    async def preempt(self, adm: TaskAdmitted, pending) -> list[DecisionMade]:
        """``evict`` decisions for the cheapest preemption that lets the vip task fit, after
        the victims' ``pending`` entries are written (each with its re-placement id)."""
        found = self.preemption_for(adm)
        if found is None:
            return []
        plan, choice = found
        confidence = evict_confidence(len(plan.victims), self.settings.evict_success)
        out = []
        for v in plan.victims:
            evict_id = evict_decision_id(v.running)
            note = Requeue(
                decision_id=reassign_decision_id(v.running),
                evict_id=evict_id,
                for_task=adm.task.task_id,
                at=now(),
            )
            # Queued before the decision goes out: the entry waits until the executor has
            # released the victim's holds, so it can never be placed twice.
            await pending.put(node_key(v.task_id), encode_pending(v.admitted, note))
            out.append(
                DecisionMade(
                    decision_id=evict_id,
                    task_id=v.task_id,
                    action="evict",
                    source=[
                        Placement(node=v.running.node, gpu=a.gpu, milli=a.milli, memory_mb=a.memory_mb)
                        for a in v.running.allocations
                    ],
                    confidence=confidence,
                    policy=PolicyRef(name="preempt"),
                    reason=(
                        f"preempted for vip task {adm.task.task_id}, which fits nowhere now; evicting "
                        f"{', '.join(x.task_id for x in plan.victims)} on {plan.node} lets it fit "
                        f"({choice.reason})"
                    ),
                    decided_at=now(),
                    task=v.admitted.task,
                    contract=v.admitted.contract,
                )
            )
        log.info(
            "vip %s preempts %s on %s (cost %.0f)",
            adm.task.task_id,
            [v.task_id for v in plan.victims],
            plan.node,
            plan.cost,
        )
        return out

    def move_request(self, running: Running, source_topo: NodeTopology, fp: Fingerprint | None) -> TaskRequest:
        """A running task as the policies see it when it moves: the shape it holds, with the
        GPU memory its fingerprint predicts when more."""
        gpu_allocs = [a for a in running.allocations if a.gpu >= 0]
        known = self.tasks.get(running.task_id)
        memory_mb = gpu_allocs[0].memory_mb
        if fp is not None and fp.predicted_peak_mb > 0:
            # Moved for its peak or not, the target holds what the fingerprint predicts (as a
            # resize would), so the move is not followed by a resize or an OOM.
            peak = max(fp.predicted_peak_mb, fp.peak_high_mb) + self.settings.resize_margin_mb
            memory_mb = max(memory_mb, int(math.ceil(peak)))
        model = next((g.model for g in source_topo.gpus if g.index == running.gpus[0]), "")
        return TaskRequest(
            task_id=running.task_id,
            kind=known.kind if known else "batch",
            gpus=len(gpu_allocs),
            gpu_milli=gpu_allocs[0].milli,
            gpu_memory_mb=memory_mb,
            cpu_milli=sum(a.cpu_milli for a in running.allocations),
            memory_mb=sum(a.host_memory_mb for a in running.allocations),
            # A task decided elsewhere may have had model constraints we cannot see: stay on
            # its current model then rather than break them.
            gpu_models=tuple(known.gpu_models) if known else ((model,) if model else ()),
            predicted_peak_mb=fp.predicted_peak_mb if fp else 0.0,
            peak_sigma_mb=max(0.0, fp.peak_high_mb - fp.peak_low_mb) / 3.29 if fp else 0.0,
        )

    async def migrate(
        self,
        running: Running,
        source_topo: NodeTopology,
        fp: Fingerprint | None,
        p_stay_fails: float,
        why: str,
        target: list[Placement] | None = None,
    ) -> DecisionMade | None:
        """Choose a target for one task with the default policy (or take ``target``, a
        clearing's), reserve it, decide.

        The policy never chooses GPUs reserved for a waiting task that the move would delay
        (the task is expected to run past the reservation's start, or declared no duration):
        a move is a placement like any other, and backfill keeps those GPUs for the wide task.

        **Confidence of a clearing move** (``target`` given) is 0.0, under the ``clearing``
        policy name. A migrate's goal is that the moved task's latency improves by more than
        15% and no OOM follows; a clearing moves a task that was fine where it was, for
        another task's sake, and it only loses its checkpoint pause: the goal is not met,
        whatever the target. Published under its own name, these records never raise the
        calibration of the default policy's own moves (which feedback judges by their OOMs).
        """
        policies = self.active.current
        known = self.tasks.get(running.task_id)
        req = self.move_request(running, source_topo, fp)
        if target is None:
            state = self.snapshot()
            state.set_condition(state.node_index(running.node), running.gpus, maintenance=True)  # not where it is
            kept = self.reservation
            if kept is not None and not kept.delayed_by(running.task_id, self.remaining_s(running), now()):
                kept = None
            with hidden(state, kept):
                choice = policies.guarded[policies.default].decide(state, req)
            if choice.action != "assign" or not choice.placement:
                log.info("no target to migrate %s to (%s)", running.task_id, why)
                return None
            target = choice.placements(memory_mb=req.gpu_memory_mb)
            gpus = [p.gpu for p in choice.placement if p.gpu >= 0]
            risk_target = float(oom_risk(state, req)[choice.node_row, gpus].max()) if gpus and fp else 0.0
            if fp is not None and risk_target >= p_stay_fails:
                return None  # the move would not make an OOM less likely
            ref = self.policy_ref(policies, policies.default, choice)
            confidence = float(p_stay_fails * choice.confidence)
            if not choice.fallback:
                confidence = self.calibration.apply(calibration_key(ref.name, "migrate"), confidence)
            fallback, why = choice.fallback, f"{why}; target: {choice.reason}"
        else:
            ref, confidence, fallback = PolicyRef(name="clearing"), 0.0, False
        tried = 0
        while await self.journaled(migrate_decision_id(running, tried)):
            tried += 1  # that move failed (a done one would have changed the hold): a new id
        decision_id = migrate_decision_id(running, tried)
        node = target[0].node
        topo = self.fleet.nodes.get(node_key(node))
        if topo is None:
            return None
        holds = allocations_for(req, decision_id, target)

        def reserve(current: NodeLedger | None) -> NodeLedger | None:
            if current is not None and any(a.decision_id == decision_id for a in current.allocations):
                return None  # another replica reserved this very move
            if not placement_fits(topo, current, target, req.cpu_milli, req.memory_mb):
                return None
            # Both holds stay until the executor has moved the task and releases the source.
            return NodeLedger(node=node, allocations=[*(current.allocations if current else []), *holds])

        try:
            written = await self.ledger.mutate(node_key(node), reserve)
        except CasConflict:
            return None  # next round
        if written is None:
            return None
        source = [
            Placement(node=running.node, gpu=a.gpu, milli=a.milli, memory_mb=a.memory_mb)
            for a in running.allocations
        ]
        return DecisionMade(
            decision_id=decision_id,
            task_id=running.task_id,
            action="migrate",
            placement=target,
            source=source,
            confidence=confidence,
            policy=ref,
            fallback=fallback,
            reason=why,
            decided_at=now(),
            task=known,
        )


def build(settings: PolicySettings | None = None) -> ServiceHost:
    """Wire the policy service."""
    settings = settings or PolicySettings()
    host = ServiceHost("policy", settings)
    metrics = PolicyMetrics(host.metrics.registry)
    holder: dict[str, object] = {}
    host_key = config_key(settings.hostname)
    plugins = PluginDirectory(Path(settings.plugin_dir)) if settings.plugin_dir else None

    def state() -> PolicyState:
        return holder["state"]  # type: ignore[return-value]

    def effective(docs: dict[str, bytes]) -> tuple[PolicyConfig, str]:
        for key in (host_key, DEFAULT_CONFIG_KEY):
            if key in docs:
                return parse_config(docs[key]), key
        return settings.policy_config(), "settings"

    async def open_state(bus: Bus) -> None:
        fleet = await FleetView.open(bus)
        ledger = await LedgerStore.open(bus)
        config_kv = await bus.kv("config")
        docs = {}
        for key in (host_key, DEFAULT_CONFIG_KEY):
            entry = await config_kv.get(key)
            if entry and entry.value:
                docs[key] = entry.value
        try:
            config, source = effective(docs)
        except ValueError as exc:
            metrics.config_errors.inc()
            log.error("%s; starting from the settings", exc)
            config, source = settings.policy_config(), "settings"
        if plugins is not None:
            plugins.poll()
        active = ActivePolicies(config, source, plugins.profiles() if plugins else {})
        active.on_swap = lambda kind, s: metrics.swapped(kind, s, active.current.generation)
        metrics.generation.set(active.current.generation)
        holder["state"] = ps = PolicyState(fleet, ledger, settings, active, metrics)
        ps.admissions = admissions = await Admissions.open(bus)
        ps.executions = await bus.kv("executions")
        ps.pending = await bus.kv("pending")
        host.background(fleet.follow(), "fleet-watch")
        host.background(ledger.follow(), "ledger-watch")
        host.background(admissions.follow(), "contracts-watch")
        host.background(watch_config(bus, docs), "config-watch")
        if plugins is not None:
            host.background(watch_plugins(), "plugin-watch")
        await refresh_stats(bus)

    async def watch_config(bus: Bus, docs: dict[str, bytes]) -> None:
        kv = await bus.kv("config")
        async for entry in kv.watch(CONFIG_PREFIX + ">"):
            if entry.key not in (host_key, DEFAULT_CONFIG_KEY):
                continue
            if entry.value is None:
                if docs.pop(entry.key, None) is None:
                    continue
            elif docs.get(entry.key) == entry.value:
                continue  # the watch replays what we read at start-up
            else:
                docs[entry.key] = entry.value
            try:
                config, source = effective(docs)
            except ValueError as exc:
                metrics.config_errors.inc()
                log.error("%s (key %s); the previous policies keep serving", exc, entry.key)
                continue
            if not state().active.apply_config(
                config, f"{source} rev {entry.revision}" if source != "settings" else source
            ):
                metrics.config_errors.inc()

    async def watch_plugins() -> None:
        assert plugins is not None
        while True:
            await asyncio.sleep(settings.plugin_poll_s)
            # Import and compile run on the event loop between two decisions: the swap is
            # atomic without a lock, and a decision is delayed by at most one reload.
            started = time.perf_counter()
            if plugins.poll():
                state().active.apply_plugins(plugins.profiles(), started)

    async def refresh_stats(bus: Bus) -> None:
        try:
            by_kind, by_policy = [
                decode(
                    await bus.request("feedback.stats", encode(StatsQuery(by=by)), timeout_s=settings.stats_timeout_s),
                    FeedbackStats,
                )
                for by in (["task_kind", "gpu_model"], ["policy", "action"])
            ]
        except (TimeoutError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.info("feedback statistics unavailable (%s); the fallback and confidences keep their last state", exc)
            return
        state().active.apply_stats(success_table(by_kind.groups))
        for key, (expected, met, count) in totals_by_policy_action(by_policy.groups).items():
            factor = state().calibration.update(key, expected, met, count)
            log.debug("confidence of %s corrected by %.3f (feedback: %.1f expected, %.0f met)", key, factor, expected, met)

    host.on_startup(open_state)

    @host.on(TaskFingerprinted, consumer="policy-fingerprints")
    async def on_fingerprint(event: TaskFingerprinted) -> None:
        state().remember(state().fingerprints, event.task_id, event.fingerprint)

    seen: deque[TaskRequest] = deque(maxlen=settings.workload_window)

    @host.every(settings.workload_refresh_s)
    async def refresh_workload() -> None:
        if "state" in holder and seen:
            state().active.apply_workload(list(seen))

    @host.on(TaskAdmitted, consumer="policy-admitted")
    async def on_admitted(adm: TaskAdmitted) -> DecisionMade:
        ps = state()
        seen.append(TaskRequest.from_submitted(adm.task))
        again = ps.existing(adm)
        if again is not None:
            return again
        if not ps.fleet.nodes:
            raise Retry("no fleet topology known yet", 1.0)
        decision, name, shard_id = await ps.place(adm)
        if decision is not None:
            return metrics.decided(decision)
        pending = await host.bus.kv("pending")  # type: ignore[union-attr]
        await pending.put(node_key(adm.task.task_id), msgspec.json.encode(adm))
        return metrics.decided(
            DecisionMade(
                decision_id=decision_id_for(adm.task.task_id, "queue"),
                task_id=adm.task.task_id,
                action="queue",
                # What a queue is judged on is its acknowledgement, as the policies' own
                # queue decisions (0.95: the filters are exact on a fresh view); corrected by
                # the record of the policy's queue decisions.
                confidence=ps.calibration.apply(calibration_key(name, "queue"), QUEUE_CONFIDENCE),
                policy=PolicyRef(name=name, version=ps.active.current.versions.get(name, "1")),
                shard_id=shard_id,
                reason="no node has room now; queued until capacity frees",
                decided_at=now(),
                task=adm.task,
                contract=adm.contract,
            )
        )

    @host.every(settings.pending_retry_s)
    async def retry_pending() -> list[DecisionMade]:
        if "state" not in holder:
            return []
        ps = state()
        pending = await host.bus.kv("pending")  # type: ignore[union-attr]
        waiting = []
        evicting: set[str] = set()  # vip tasks whose preemption is still being carried out
        for key in await pending.keys():
            entry = await pending.get(key)
            if not entry or not entry.value or entry.value == b"claimed":
                continue
            adm, requeue = decode_pending(entry.value)
            if requeue is not None and ps.ledger.holds_of(adm.task.task_id) is not None:
                if now() - requeue.at > settings.evict_timeout_s:
                    # The eviction failed or never went out: the task still runs. Forget the
                    # entry (the vip may preempt again) rather than hold the queue up.
                    log.warning(
                        "eviction %s not carried out in time; %s keeps running",
                        requeue.evict_id or "by the executor",
                        adm.task.task_id,
                    )
                    await pending.delete(entry.key)
                    continue
                # Evicted, but the executor has not released its holds yet (or our view has
                # not seen the release): placing it now would book it twice (and the release
                # would take the new holds too). Only a preemption holds the queue for its vip.
                if requeue.for_task:
                    evicting.add(requeue.for_task)
                continue
            waiting.append((adm, requeue, entry))
        waiting.sort(key=lambda p: queue_position(p[0]))
        out: list[DecisionMade] = []
        # What found no node this round (and whether the reservation was hidden from it): a
        # task that needs no less is not tried again until the next round. A backlog of
        # hundreds then costs a few decisions a round, not hundreds of claims and decisions.
        failed: list[tuple[Demand, bool]] = []
        # The tasks that found no place this round, skipped ones included: the reservation's
        # owner is chosen among them once the round is over.
        blocked: list[TaskAdmitted] = []
        for adm, requeue, entry in waiting:
            if evicting and adm.contract.tier != "vip":
                # Space is being freed for a vip: nothing else may take it half-freed (an
                # evicted task would otherwise come straight back where it was).
                continue
            held = ps.reservation
            hide = held is not None and held.delayed_by(adm.task.task_id, adm.task.expected_duration_s, now())
            # A smooth grower is skipped only when its bridge (its ask) cannot fit either.
            demands = [Demand.of(r) for r in ps.requests(adm.task)]
            if adm.contract.tier != "vip" and all(
                any(d.cannot_fit_after(f) for f, masked in failed if hide or not masked) for d in demands
            ):
                blocked.append(adm)
                continue  # a vip still gets its turn: it may preempt
            try:
                await pending.update(entry.key, b"claimed", entry.revision)  # one replica takes it
            except CasConflict:
                continue
            try:
                decision, _, _ = await ps.place(adm, requeue.decision_id if requeue else None)
                if decision is None:
                    failed.extend((d, hide) for d in demands)
                    blocked.append(adm)
            except Retry:
                decision = None
            if decision is None:
                await pending.put(entry.key, entry.value)  # type: ignore[arg-type]
                # A vip that fits nowhere may preempt best_effort work (``preempt``), once
                # per round and not while its last preemption is still under way.
                if adm.contract.tier == "vip" and adm.task.task_id not in evicting:
                    evictions = await ps.preempt(adm, pending)
                    if evictions:
                        evicting.add(adm.task.task_id)
                        out.extend(metrics.decided(d) for d in evictions)
                continue
            await pending.delete(entry.key)
            out.append(metrics.decided(decision))
        # The reservation goes to the whole-GPU task first in the queue's order among those
        # that found no place (expected completion bounds how long anything is overtaken,
        # wide tasks included). Only the whole round says who that is, so this round (and
        # the arrivals decided while it awaits, which must not find the reserved GPUs
        # unguarded) ran against the last round's reservation, at most ``pending_retry_s`` old.
        wide = [a for a in blocked if a.task.gpus >= 1 and a.task.gpu_milli >= MILLI]
        owner = min(wide, key=queue_position, default=None)
        ps.reservation = ps.reservation_for(owner) if owner is not None else None
        return out

    def opened() -> Bus:
        """The bus, once the replica's state is open (a retry until then)."""
        if "state" not in holder or host.bus is None:
            raise Retry("policy state not open yet", 1.0)
        return host.bus

    @host.on(ActionFailed, consumer="policy-failed")
    async def on_action_failed(failed: ActionFailed) -> TaskRejected | None:
        bus = opened()
        given_up = state().given_up(failed)
        if given_up is not None:
            log.warning("%s will not run: %s", failed.task_id, given_up.reason)
            return given_up
        await state().requeue_failed(failed, await bus.kv("pending"), await bus.kv("ledger"))
        return None

    @host.on_core("telemetry.task.*", TaskTelemetry)
    async def on_task_sample(sample: TaskTelemetry) -> None:
        # Every replica sees every sample (no queue group): each may be the one to act.
        if "state" in holder:
            state().observe(sample)

    @host.on(TaskLifecycle, consumer="policy-lifecycle")
    async def on_lifecycle(life: TaskLifecycle) -> None:
        bus = opened()
        if life.state in ("finished", "oom_killed", "failed", "evicted", "migrated"):
            # Stopped, or restored elsewhere from a checkpoint: its growth starts over.
            state().usage.pop(life.task_id, None)
        pending = await bus.kv("pending")
        if life.state == "evicted":
            # Evicted without a decision of ours (a decommissioned GPU): queue it again. Our
            # own evictions already wait in ``pending`` with their requeue note.
            await state().requeue_evicted(life, pending, await bus.kv("ledger"))
            return
        # An evicted task waits in ``pending`` for its re-placement; if it ended on its own
        # instead (the eviction failed or never went out), it must not be started again. An
        # OOM kill is the task's outcome: it is not retried.
        if life.state not in ("finished", "oom_killed", "failed"):
            return
        entry = await pending.get(node_key(life.task_id))
        if entry is None or not entry.value or entry.value == b"claimed":
            return
        _, requeue = decode_pending(entry.value)
        if requeue is not None:
            await pending.delete(entry.key)

    @host.every(settings.stats_refresh_s)
    async def refresh_fallback() -> None:
        if "state" in holder:
            await refresh_stats(host.bus)  # type: ignore[arg-type]

    @host.every(settings.rebalance_s)
    async def rebalance() -> list[DecisionMade]:
        if "state" not in holder:
            return []
        return [metrics.decided(d) for d in await state().rebalance_round()]

    return host


def main() -> None:
    """Console entry point ``fleetpilot-policy``."""
    build().main()
