"""The policy service.

For each ``task.admitted`` (a durable consumer shared by every replica) it decides a
placement over the live fleet and ledger, reserves it in the ledger with compare-and-set
and only then publishes ``decision.made``, so a published ``assign`` is final even with
several replicas. A task that fits nowhere gets a ``queue`` decision and waits in the
``pending`` bucket; it is retried whenever capacity may have freed.

Decision ids are derived from the task (``<task>.assign``), and a redelivered task that
already holds capacity gets the same decision again: a policy killed between reserving and
acknowledging loses nothing and doubles nothing.
"""

from __future__ import annotations

import logging

import msgspec
from pydantic_settings import SettingsConfigDict

from fleetpilot.contracts import (
    Allocation,
    DecisionMade,
    Placement,
    PolicyRef,
    TaskAdmitted,
    now,
)
from fleetpilot.ledger import FleetView, LedgerStore, with_allocations
from fleetpilot.ledger.first_fit import fits_on
from fleetpilot.ledger.store import node_key
from fleetpilot.policy import ClusterState, TaskRequest, build_policy
from fleetpilot.policy.fallback import BreakerConfig, CircuitBreaker, FallbackScheduler, GuardedPolicy
from fleetpilot.policy.shaping import Router, RouteRule
from fleetpilot.runtime import Bus, CasConflict, Retry, ServiceHost, ServiceSettings

log = logging.getLogger("fleetpilot.policy")

_ADMITTED = msgspec.json.Decoder(TaskAdmitted)


class PolicySettings(ServiceSettings):
    """``FLEETPILOT_POLICY_*``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_POLICY_", extra="ignore")

    pending_retry_s: float = 1.0
    profile: str = "fleetpilot"
    # Traffic shaping: a JSON list of {"condition", "weight", "policy"} rules.
    shaping_rules: list[dict] = []
    seed: int = 0


def decision_id_for(task_id: str, action: str) -> str:
    """Deterministic decision id: every replica and every redelivery agrees on it."""
    return f"{task_id}.{action}"


def allocations_for(adm: TaskAdmitted, decision_id: str, placement: list[Placement]) -> list[Allocation]:
    """The ledger holds of a placement; CPU and host memory are charged once."""
    task = adm.task
    return [Allocation(task_id=task.task_id, decision_id=decision_id, gpu=p.gpu, milli=p.milli,
                       memory_mb=p.memory_mb, cpu_milli=task.cpu_milli if i == 0 else 0,
                       host_memory_mb=task.memory_mb if i == 0 else 0, at=now())
            for i, p in enumerate(placement)]


class PolicyState:
    """The replica's live view (fleet + ledger) and its reserve-then-publish step."""

    def __init__(self, fleet: FleetView, ledger: LedgerStore, settings: PolicySettings) -> None:
        self.fleet = fleet
        self.ledger = ledger
        self.policy = PolicyRef(name=settings.profile, version="1")
        names = {settings.profile} | {rule["policy"] for rule in settings.shaping_rules}
        # Each named policy sits behind its own breaker, with the history-based fallback behind it.
        self.guarded = {name: GuardedPolicy(build_policy(name, seed=settings.seed).decide, FallbackScheduler(),
                                            CircuitBreaker(BreakerConfig()))
                        for name in names}
        self.router = Router([RouteRule(**rule) for rule in settings.shaping_rules], default=settings.profile)

    def assign_decision(self, adm: TaskAdmitted, placement: list[Placement], confidence: float,
                        reason: str, policy: PolicyRef | None = None, shard_id: str = "primary",
                        fallback: bool = False) -> DecisionMade:
        """The ``assign`` decision of a reserved placement."""
        return DecisionMade(decision_id=decision_id_for(adm.task.task_id, "assign"), task_id=adm.task.task_id,
                            action="assign", placement=placement, confidence=confidence,
                            policy=policy or self.policy, shard_id=shard_id, fallback=fallback,
                            reason=reason, decided_at=now(), task=adm.task, contract=adm.contract)

    def existing(self, adm: TaskAdmitted) -> DecisionMade | None:
        """The decision already reserved for this task, if a previous delivery got that far."""
        held = self.ledger.holds_of(adm.task.task_id)
        if held is None:
            return None
        node, allocs = held
        placement = [Placement(node=node, gpu=a.gpu, milli=a.milli, memory_mb=a.memory_mb) for a in allocs]
        return self.assign_decision(adm, placement, 0.9, "re-issued: capacity already reserved")

    async def place(self, adm: TaskAdmitted) -> DecisionMade | None:
        """Choose, reserve with CAS (re-choosing on conflict), and return the decision."""
        task = adm.task
        name, shard_id = self.router.route(task)
        for _ in range(10):
            state = ClusterState.from_topology(
                self.fleet.nodes.values(), {n: ledger.allocations for n, ledger in self.ledger.nodes.items()})
            choice = self.guarded[name].decide(state, TaskRequest.from_submitted(task))
            if choice.action != "assign" or not choice.placement:
                return None
            placement = choice.placements(memory_mb=task.gpu_memory_mb)
            node = placement[0].node
            decision_id = decision_id_for(task.task_id, "assign")

            def reserve(current, placement=placement, node=node):
                # Re-check on the ledger we are about to overwrite: the view may be stale.
                if fits_on(self.fleet.nodes[node], current, task) is None and not _holds(current, task.task_id):
                    return None
                return with_allocations(current, node, allocations_for(adm, decision_id, placement))

            try:
                written = await self.ledger.mutate(node_key(node), reserve)
            except CasConflict:
                continue
            if written is None:
                continue  # someone took the space between our view and the write: choose again
            return self.assign_decision(adm, placement, choice.confidence, choice.reason,
                                        PolicyRef(name=choice.policy or name, version="1"), shard_id,
                                        choice.fallback)
        raise Retry("ledger contention", 0.2)


def _holds(ledger, task_id: str) -> bool:
    return bool(ledger and any(a.task_id == task_id for a in ledger.allocations))


def build(settings: PolicySettings | None = None) -> ServiceHost:
    """Wire the policy service."""
    settings = settings or PolicySettings()
    host = ServiceHost("policy", settings)
    holder: dict[str, PolicyState] = {}

    async def open_state(bus: Bus) -> None:
        fleet = await FleetView.open(bus)
        ledger = await LedgerStore.open(bus)
        holder["state"] = PolicyState(fleet, ledger, settings)
        host.background(fleet.follow(), "fleet-watch")
        host.background(ledger.follow(), "ledger-watch")

    host.on_startup(open_state)

    @host.on(TaskAdmitted, consumer="policy-admitted")
    async def on_admitted(adm: TaskAdmitted) -> DecisionMade:
        state = holder["state"]
        again = state.existing(adm)
        if again is not None:
            return again
        if not state.fleet.nodes:
            raise Retry("no fleet topology known yet", 1.0)
        decision = await state.place(adm)
        if decision is not None:
            return decision
        pending = await host.bus.kv("pending")  # type: ignore[union-attr]
        await pending.put(node_key(adm.task.task_id), msgspec.json.encode(adm))
        return DecisionMade(decision_id=decision_id_for(adm.task.task_id, "queue"), task_id=adm.task.task_id,
                            action="queue", confidence=0.5, policy=state.policy,
                            reason="no node has room now; queued until capacity frees", decided_at=now(),
                            task=adm.task, contract=adm.contract)

    @host.every(settings.pending_retry_s)
    async def retry_pending() -> list[DecisionMade]:
        state = holder.get("state")
        if state is None:
            return []
        pending = await host.bus.kv("pending")  # type: ignore[union-attr]
        waiting = []
        for key in await pending.keys():
            entry = await pending.get(key)
            if entry and entry.value and entry.value != b"claimed":
                waiting.append((_ADMITTED.decode(entry.value), entry))
        # VIP first, then the longest waiting.
        tier_rank = {"vip": 0, "standard": 1, "best_effort": 2}
        waiting.sort(key=lambda p: (tier_rank[p[0].contract.tier], p[0].admitted_at))
        out = []
        for adm, entry in waiting:
            try:
                await pending.update(entry.key, b"claimed", entry.revision)  # one replica takes it
            except CasConflict:
                continue
            decision = await state.place(adm)
            if decision is None:
                await pending.put(entry.key, entry.value)  # type: ignore[arg-type]
                continue
            await pending.delete(entry.key)
            out.append(decision)
        return out

    return host


def main() -> None:
    """Console entry point ``fleetpilot-policy``."""
    build().main()
