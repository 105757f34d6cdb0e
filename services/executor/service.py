"""The executor service.

Consumes ``decision.made`` and carries each decision out once (``execute_decision`` with a
journal in the ``executions`` bucket), then confirms the ledger reservation (or releases it
when the action failed) and publishes ``action.executed`` / ``action.failed``. Task life
(started, finished, OOM-killed) is published on ``task.lifecycle.<task>``, and a task that
ends gives its capacity back in the ledger.

Backends: ``sim`` drives the simulated fleet hosted by the collector; ``process`` runs the
task's ``command`` as a real process with ``CUDA_VISIBLE_DEVICES`` set.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic_settings import SettingsConfigDict

from fleetpilot.contracts import (
    ActionExecuted,
    DecisionMade,
    Event,
    SimEvent,
    TaskLifecycle,
    now,
)
from fleetpilot.executor import ProcessBackend, execute_decision
from fleetpilot.ledger import LedgerStore, without_task
from fleetpilot.ledger.accounting import confirmed
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import Bus, Retry, ServiceHost, ServiceSettings

from .backends import BusSimBackend, KvExecutionJournal

log = logging.getLogger("fleetpilot.executor")


class ExecutorSettings(ServiceSettings):
    """``FLEETPILOT_EXECUTOR_*``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_EXECUTOR_", extra="ignore")

    backend: Literal["sim", "process"] = "sim"
    grace_s: float = 10.0
    default_duration_s: float = 120.0


def build(settings: ExecutorSettings | None = None) -> ServiceHost:
    """Wire the executor."""
    settings = settings or ExecutorSettings()
    host = ServiceHost("executor", settings)
    parts: dict = {}
    # Who asked for what, so lifecycle events carry the decision they belong to.
    decisions: dict[str, DecisionMade] = {}

    async def open_parts(bus: Bus) -> None:
        parts["journal"] = KvExecutionJournal(await bus.kv("executions"))
        parts["ledger"] = await LedgerStore.open(bus)
        parts["backend"] = BusSimBackend(bus, settings.default_duration_s) if settings.backend == "sim" \
            else ProcessBackend()

    host.on_startup(open_parts)

    async def release(task_id: str, node: str) -> None:
        ledger: LedgerStore = parts["ledger"]
        await ledger.mutate(node_key(node), lambda cur: without_task(cur, task_id) if cur else None)

    def lifecycle(task_id: str, state, node: str, gpus: list[int], detail: str = "",
                  exit_code: int | None = None) -> TaskLifecycle:
        d = decisions.get(task_id)
        return TaskLifecycle(task_id=task_id, state=state, node=node, gpus=gpus, detail=detail, exit_code=exit_code,
                             decision_id=d.decision_id if d else "", policy=d.policy.name if d else "",
                             shard_id=d.shard_id if d else "primary", confidence=d.confidence if d else 0.0,
                             task_kind=d.task.kind if d and d.task else "", at=now())

    @host.on(DecisionMade, consumer="executor-decisions")
    async def on_decision(decision: DecisionMade) -> list[Event]:
        backend = parts["backend"]
        if isinstance(backend, BusSimBackend) and decision.task is not None:
            task = decision.task
            backend.describe(task.task_id, float(task.gpu_memory_mb or 1000), task.labels.get("growth", "flat"),
                             task.expected_duration_s)
        result = await execute_decision(decision, backend, parts["journal"], owner=settings.replica,
                                        grace_s=settings.grace_s)
        if result is None:
            raise Retry("another executor replica is carrying this decision out", 2.0)
        out: list[Event] = [result]
        node = decision.placement[0].node if decision.placement else ""
        if isinstance(result, ActionExecuted):
            if decision.action == "assign" and node:
                decisions[decision.task_id] = decision
                await parts["ledger"].mutate(node_key(node), lambda cur: confirmed(cur, decision.task_id) if cur else None)
                out.append(lifecycle(decision.task_id, "started", node, [p.gpu for p in decision.placement]))
            elif decision.action == "evict":
                for src in {p.node for p in decision.source}:
                    await release(decision.task_id, src)
                out.append(lifecycle(decision.task_id, "evicted", node, []))
        elif decision.action == "assign" and node:
            await release(decision.task_id, node)
        return out

    @host.on_core("sim.event.*", SimEvent, queue="executor")
    async def on_sim_event(event: SimEvent) -> list[Event]:
        if event.task_id is None or event.kind not in ("finished", "oom_killed"):
            return []
        if event.node:
            await release(event.task_id, event.node)
        state = "finished" if event.kind == "finished" else "oom_killed"
        out = [lifecycle(event.task_id, state, event.node, [event.gpu] if event.gpu >= 0 else [], event.detail,
                         0 if state == "finished" else 137)]
        decisions.pop(event.task_id, None)
        return out

    @host.every(1.0)
    async def poll_backend() -> list[Event]:
        backend = parts.get("backend")
        if backend is None:
            return []
        out: list[Event] = []
        for change in await backend.poll():
            if change.state in ("finished", "oom_killed", "failed") and change.node:
                await release(change.task_id, change.node)
            out.append(lifecycle(change.task_id, change.state, change.node, change.gpus, change.detail,
                                 change.exit_code))
        return out

    return host


def main() -> None:
    """Console entry point ``fleetpilot-executor``."""
    build().main()
