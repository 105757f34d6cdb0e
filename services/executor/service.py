"""The executor service: wiring.

Consumes ``decision.made`` and carries each decision out once (``execute_decision`` with a
journal in the ``executions`` bucket), then confirms the ledger reservation (or releases it
when the action failed) and publishes ``action.executed`` / ``action.failed``. Task life
(started, finished, OOM-killed) is published on ``task.lifecycle.<task>``, and a task that
ends gives its capacity back in the ledger.

Backends: ``sim`` drives the simulated fleet hosted by the collector; ``process`` runs the
task's ``command`` as a real process with ``CUDA_VISIBLE_DEVICES`` set. With ``node`` set
(one executor per GPU node), a replica carries out the decisions for its node only, on a
durable consumer of its own, and moves tasks between nodes through a hand-over
(``executor.handover.<node>``).

What a replica does is in ``replica.py`` (decisions, lifecycle, backend) and ``health.py``
(pre-decommission, predictive maintenance, unreachable nodes); this module binds it to the
bus.
"""

from __future__ import annotations

import logging

from fleetpilot.contracts import (
    DecisionMade,
    Event,
    ExecutorPresence,
    HandedOver,
    HandOver,
    NodeTelemetry,
    SimEvent,
    encode,
    now,
)
from fleetpilot.executor import carried_out_on
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import Bus, ServiceHost, serve

from .health import GpuHealth
from .metrics import ExecutorMetrics
from .settings import DECISION_REPLAY_S, ExecutorSettings

__all__ = ["ExecutorSettings", "build", "main"]

log = logging.getLogger("fleetpilot.executor")


def build(settings: ExecutorSettings | None = None) -> ServiceHost:
    """Wire the executor."""
    settings = settings or ExecutorSettings.from_environment()
    host = ServiceHost("executor", settings)
    replica = GpuHealth(settings, ExecutorMetrics(host.metrics.registry))

    async def open_replica(bus: Bus) -> None:
        await replica.open(bus, host.background)
        await say_present()

    told = {"trouble": ""}

    async def say_present() -> None:
        # One executor per node: its node's key, rewritten while it runs, keeps the node in
        # service (the topology service watches the key's revisions; ``contracts.presence``),
        # unless it says no task can start there.
        if settings.node and host.bus is not None:
            trouble = await replica.recheck_node()
            kv = await host.bus.kv("executors")
            await kv.put(node_key(settings.node), encode(
                ExecutorPresence(node=settings.node, replica=settings.replica, at=now(), trouble=trouble)))
            if trouble and not told["trouble"]:
                log.error("%s: no task can start here (%s); the node is out of service until one can",
                          settings.node, trouble)
            told["trouble"] = trouble

    host.on_startup(open_replica)
    host.every(settings.presence_every_s)(say_present)
    host.on_stopping(replica.give_up_tasks)
    host.on_shutdown(replica.stop_processes)

    # One node's replicas read every decision on a consumer of their own and keep those for
    # their node: on a consumer shared by all nodes, a decision for one node would be
    # carried out by whichever took it, with the process backend on the wrong machine.
    @host.on(DecisionMade, consumer="executor-decisions", instance=settings.node,
             instance_start_s_ago=DECISION_REPLAY_S, handler_limit_s=settings.decision_limit_s)
    async def on_decision(decision: DecisionMade) -> list[Event]:
        if settings.node and not carried_out_on(decision, settings.node):
            return []
        results = await replica.carry_out(decision)
        if bool(replica.node_trouble()) != bool(told["trouble"]):
            # At once: every decision sent here meanwhile would fail too (or, a start that
            # worked, the node may be given work again).
            await say_present()
        return results

    if settings.node:
        @host.endpoint("handover", f"executor.handover.{settings.node}", HandOver)
        async def on_hand_over(request: HandOver) -> HandedOver:
            return await replica.hand_over(request)

    @host.on_core("sim.event.*", SimEvent, queue="executor")
    async def on_sim_event(event: SimEvent) -> list[Event]:
        return await replica.sim_ended(event)

    # Every replica takes every sample of its nodes (no queue group): the hook's state
    # machine and the cordon check in ``before_assign`` need the whole stream on each
    # replica, and the hook lock makes sure one replica acts.
    @host.on_core(f"telemetry.gpu.{settings.node or '*'}", NodeTelemetry)
    async def on_telemetry(batch: NodeTelemetry) -> list[Event]:
        return await replica.observe(batch)

    host.every(1.0)(replica.backend_changes)
    host.every(settings.health_interval_s)(replica.assess_health)
    host.every(settings.silent_check_s)(replica.give_up_unreachable_nodes)
    host.every(settings.silent_check_s)(replica.stop_tasks_given_up)
    host.every(min(settings.silent_check_s, settings.hand_over_taken_within_s))(replica.take_back_stranded)
    return host


def main() -> None:
    """Console entry point ``fleetpilot-executor``."""
    serve("executor", build)
