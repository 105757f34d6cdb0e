"""Reservations no executor took: a decision whose node's executor is not running.

The policy reserves capacity in the ``ledger`` and publishes the decision; the executor of
the node takes it from its own consumer and confirms the hold. A node whose collector still
reports (so it stays ``ready``) while its executor is down (a crash loop, a DaemonSet
rolled out with a bad image) gets decisions that nobody carries out: their tasks wait and
their holds keep the GPUs from everyone else, for as long as the executor stays down.

An untaken reservation older than ``untaken_expiry_s`` is expired here, and the race with an
executor coming back is settled in the executor's own journal (``executions``): the policy
*creates* the decision's entry with an ``action.failed`` (``retryable``), which an executor
can only do by claiming the decision first. Whoever creates the entry wins. An executor that
comes back later finds the recorded failure and carries nothing out (it republishes the
failure, which the stream drops as a duplicate within its window); one that claimed first is
left alone. The failure is then published, before the holds go back: a replica that dies
between the two leaves holds whose journal says failed, which ``release_settled_reservations``
gives back, and never a task that is neither queued nor held. The ``policy-failed``
consumer queues an assign again, as for any retryable failure, elsewhere than that node if
another can take it (the failure names its placement); a move or a resize leaves the task
where it runs.
"""

from __future__ import annotations

import logging

import msgspec
from fleetpilot.contracts import ActionFailed, DecisionMade, decode, encode, msg_id_for, now
from fleetpilot.executor import action_id_for
from fleetpilot.ledger import LedgerStore
from fleetpilot.ledger.accounting import without_decision
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import Bus, CasConflict, KeyValue

log = logging.getLogger(__name__)

DECISIONS_STREAM = "DECISIONS"

SCAN_LIMIT = 50_000
"""Decisions read from the stream, from a reservation's time on, looking for its decision:
a busy fleet's ten minutes. One not found within them is looked for again a while later."""

PUBLISH_SLACK_S = 5.0
"""How much earlier than its reservation's time a decision may be stored (clocks differ)."""


def untaken_since(ledger: LedgerStore, cutoff: float) -> dict[str, float]:
    """The decision ids of reserved holds made at or before ``cutoff``, with the earliest
    time each one's holds were reserved."""
    since: dict[str, float] = {}
    for held in ledger.nodes.values():
        for a in held.allocations:
            if a.state == "reserved" and 0 < a.at <= cutoff:
                since[a.decision_id] = min(a.at, since.get(a.decision_id, a.at))
    return since


async def published_decision(bus: Bus, decision_id: str, since: float) -> DecisionMade | None:
    """The ``decision.made`` of ``decision_id`` as the stream keeps it, read from ``since``
    on (at most ``SCAN_LIMIT`` messages); ``None`` when it is not there."""
    wanted = f"decision:{decision_id}"
    read = 0
    async for message in bus.stream_messages(DECISIONS_STREAM, "decision.made", since=since - PUBLISH_SLACK_S):
        read += 1
        if message.headers.get("Nats-Msg-Id") == wanted:
            try:
                decision = decode(message.data, DecisionMade)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return None
            if msg_id_for(decision) == wanted:
                return decision
        if read >= SCAN_LIMIT:
            break
    return None


def expiry(decision: DecisionMade, node: str, waited_s: float, at: float) -> ActionFailed:
    """The ``action.failed`` that ends ``decision``: no executor took it in ``waited_s``, which
    is how long the action took to fail (its ``latency_ms``; left at 0, the feedback store
    counted a measured 0 ms, and a node whose executor is down read as the fastest)."""
    return ActionFailed(
        action_id=action_id_for(decision.decision_id),
        decision_id=decision.decision_id,
        task_id=decision.task_id,
        action=decision.action,
        placement=decision.placement,
        backend="",
        error=f"expired: not taken by the executor of {node or 'its node'} within {waited_s:.0f} s "
        "(is it running?); its reservation was given back",
        retryable=True,
        policy=decision.policy,
        shard_id=decision.shard_id,
        confidence=decision.confidence,
        task_kind=decision.task.kind if decision.task else "",
        latency_ms=max(waited_s, 0.0) * 1000.0,
        failed_at=at,
    )


class UntakenReservations:
    """Expires the reservations whose decision no executor took (see the module)."""

    def __init__(self, bus: Bus, ledger: LedgerStore, executions: KeyValue, expiry_s: float) -> None:
        """Over the replica's ``ledger`` view and the executor's journal; ``expiry_s`` 0: off."""
        self.bus, self.ledger, self.executions, self.expiry_s = bus, ledger, executions, expiry_s
        # Decisions looked for in the stream and not found (a reservation whose replica died
        # before publishing: its pending entry's re-issue publishes it), by when: not read
        # for again on every round.
        self.not_found: dict[str, float] = {}

    async def expire(self) -> list[ActionFailed]:
        """Expire what is due; the failures it published."""
        if self.expiry_s <= 0:
            return []
        clock = now()
        due = untaken_since(self.ledger, clock - self.expiry_s)
        self.not_found = {d: t for d, t in self.not_found.items() if d in due}
        out = []
        for decision_id, since in sorted(due.items()):
            if clock - self.not_found.get(decision_id, -float("inf")) < self.expiry_s:
                continue
            entry = await self.executions.get(node_key(decision_id))
            if entry is not None and entry.value:
                continue  # taken (claimed or carried out); a leftover is for the settled round
            decision = await published_decision(self.bus, decision_id, since)
            if decision is None:
                self.not_found[decision_id] = clock
                continue
            node = next((p.node for p in decision.placement), "")
            failed = expiry(decision, node, clock - since, now())
            try:
                await self.executions.create(node_key(decision_id), encode(failed))
            except CasConflict:
                continue  # the executor claimed it just now: it carries it out
            await self.bus.publish(failed)
            for key, held in list(self.ledger.nodes.items()):
                if any(a.decision_id == decision_id for a in held.allocations):
                    await self.ledger.mutate(key, lambda cur, d=decision_id: without_decision(cur, d) if cur else None)
            log.warning("%s: %s", decision_id, failed.error)
            out.append(failed)
        return out

