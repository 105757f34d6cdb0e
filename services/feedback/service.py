"""The feedback service.

Every action gets exactly one feedback record (keyed by ``action_id``), judged by the pure
rules of ``fleetpilot.feedback.outcomes``:

- ``action.failed`` → ``failure`` (``timeout`` when the error says so) at once;
- an executed ``evict``/``resize``/``queue``/``reject`` → ``success`` at once;
- an executed placement (``assign`` or ``migrate``) is judged when the placement ends
  (``task.lifecycle``): ``finished`` → ``success``, ``oom_killed`` → ``oom``, ``failed`` →
  ``failure``, ``evicted`` → ``partial``; a ``migrated`` event ends the placement it
  replaces (``replaces_decision_id``) as ``success``: the task left it alive, and the move
  is judged in turn by how its own placement ends. Until then the executed action waits in
  the ``open_placements`` bucket, so every replica can judge it and a restart loses nothing.
  An end handled before its action's result is judged from the lifecycle alone, its latency
  and resource saving unknown; the late result then gives the stored record both, once
  (``FeedbackStore.amend_late_result``).

Records go to the store (SQLite by default, PostgreSQL when ``store_dsn`` is a
``postgresql://`` URL), then out as ``feedback.recorded``. Statistics are served on the
``feedback.stats`` request/reply endpoint, which the policy's fallback reads, and each
stored record is counted on ``/metrics`` (``metrics.FeedbackMetrics``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from fleetpilot.contracts import (
    ActionExecuted,
    ActionFailed,
    FeedbackRecorded,
    FeedbackStats,
    Measured,
    PolicyRef,
    StatsGroup,
    StatsQuery,
    TaskLifecycle,
    decode,
    encode,
    now,
)
from fleetpilot.executor.dispatch import action_id_for
from fleetpilot.feedback import (
    FeedbackStore,
    PostgresFeedbackStore,
    SqliteFeedbackStore,
    ending_outcome,
    feedback_for,
    resource_saving_of,
    side_effects_of,
)
from fleetpilot.feedback.aggregates import validate_by
from fleetpilot.feedback.postgres_store import COMMAND_TIMEOUT_S
from fleetpilot.feedback.store import store_target
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import (
    Bus,
    CasConflict,
    Delivery,
    KeyValue,
    Reject,
    ServiceHost,
    ServiceSettings,
    serve,
)
from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from .metrics import FeedbackMetrics

log = logging.getLogger("fleetpilot.feedback")

PLACEMENTS = frozenset({"assign", "migrate"})
"""Actions judged by how their placement ends rather than at once."""
ENDINGS = frozenset({"finished", "oom_killed", "failed", "evicted"})
"""Lifecycle states that end a task's placement (and its life there)."""
JUDGED = b"judged"
"""The ``open_placements`` value left when a placement's end was judged before its action's
result arrived (the record's latency unknown): the late result then gives the stored record
its latency and saving (``FeedbackStore.amend_late_result``) instead of waiting forever."""
LEFT = b"left"
"""The ``open_placements`` value left when a migration ended a placement whose result had
not arrived yet: the late result is then judged at once, as a placement left alive."""
EXECUTOR_LATENCY_UNCERTAINTY = 0.05
"""How far the executor's action latency can be trusted (it times the backend call)."""
MAX_REPLY_BYTES = 1024 * 1024
"""A NATS server's default ``max_payload``, for a bus that does not tell its own."""


class EndNotStoredYet(Exception):
    """A late result found its placement's end judged (``JUDGED``) but the record of that end
    not stored yet: the lifecycle's handler marks the end before it writes the record. The
    result is delivered again on the consumer's back-off, to give the record its latency."""


class FeedbackSettings(ServiceSettings):
    """``FLEETPILOT_FEEDBACK_*``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_FEEDBACK_", extra="ignore")

    store_dsn: str = ""
    store_schema: str = "fleetpilot_feedback"
    store_command_timeout_s: float = Field(default=COMMAND_TIMEOUT_S, gt=0.0, allow_inf_nan=False)

    # Refused with the settings, in one line naming the variable: found only when the store
    # opens, after the bus connected, it stopped the service with a traceback.
    @field_validator("store_dsn")
    @classmethod
    def _dsn_names_a_store(cls, dsn: str) -> str:
        if dsn:
            store_target(dsn)
        return dsn


async def open_store(settings: FeedbackSettings) -> FeedbackStore:
    """PostgreSQL in ``store_schema`` for a ``postgresql://`` DSN, else SQLite (default
    ``<state_dir>/feedback.db``; its folder is created). A DSN of any other scheme is
    refused (``ValueError``), not taken for a SQLite path (``store_target``)."""
    if not settings.store_dsn:
        kind, target = "sqlite", str(Path(settings.state_dir) / "feedback.db")
    else:
        kind, target = store_target(settings.store_dsn)
    if kind == "postgresql":
        return await PostgresFeedbackStore.open(target, schema=settings.store_schema,
                                                command_timeout_s=settings.store_command_timeout_s)
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    return SqliteFeedbackStore(path)


def build(settings: FeedbackSettings | None = None) -> ServiceHost:
    """Wire the feedback service."""
    settings = settings or FeedbackSettings.from_environment()
    host = ServiceHost("feedback", settings)
    metrics = FeedbackMetrics(host.metrics.registry)
    parts: dict = {}

    async def open_parts(bus: Bus) -> None:
        # Run again whole when the server goes away half-way (the host retries start-up
        # hooks): the store opened the first time is kept, not opened twice and leaked.
        if "store" not in parts:
            parts["store"] = await open_store(settings)
        parts["open"] = await bus.kv("open_placements")

    async def close_parts() -> None:
        if "store" in parts:
            await parts["store"].close()

    host.on_startup(open_parts)
    host.on_shutdown(close_parts)

    async def record(event: FeedbackRecorded) -> FeedbackRecorded | None:
        try:
            stored = await parts["store"].record(event)
        except ValueError as error:
            # The store refuses, before any write, a record it could never keep (a NUL in a
            # key, a number that would not read back): no redelivery can change that, so it
            # is dead-lettered at once with the store's reason instead of retried.
            raise Reject(str(error)) from None
        if not stored:
            return None  # a redelivery is stored once, counted once and announced once
        metrics.stored(event)
        return event

    async def judge(result: ActionExecuted | ActionFailed,
                    ending: TaskLifecycle | None = None) -> FeedbackRecorded | None:
        """Record the outcome of an action whose result the executor reported."""
        return await record(feedback_for(result, ending, recorded_at=now(),
                                         latency_uncertainty=EXECUTOR_LATENCY_UNCERTAINTY))

    async def amend(action: ActionExecuted) -> FeedbackRecorded | None:
        """Give the stored record of ``action``, judged without its result, the executor's
        latency and, if it was a success, the GPU memory its placement left to other work;
        the record as amended, ``None`` when it had them already (or none is stored)."""
        latency = Measured(value=action.latency_ms, uncertainty_score=EXECUTOR_LATENCY_UNCERTAINTY)
        try:
            amended = await parts["store"].amend_late_result(action.action_id, latency,
                                                             resource_saving_of(action, "success"))
        except ValueError as error:
            raise Reject(str(error)) from None  # a latency no store can keep: no redelivery helps
        if amended is not None:
            metrics.measured(amended)
        return amended

    async def open_placement(action: ActionExecuted, delivery: Delivery) -> FeedbackRecorded | None:
        """Keep an executed placement until its end is known (or judge it, if it came first)."""
        placements: KeyValue = parts["open"]
        key = node_key(action.decision_id)
        if (stored := await stored_before(action.action_id, delivery)) is not None:
            # Judged already, and this result delivered again: an earlier delivery may have
            # stopped before it gave the record its latency, or before it cleared the marker.
            amended = await amend(action)
            entry = await placements.get(key)
            if entry is not None and entry.value in (JUDGED, LEFT):
                await placements.delete(key)
            if entry is not None and entry.value == JUDGED:
                # The end's handler stored the record and announced it; this result only
                # amends it (its first delivery may have found the record not stored yet).
                return None
            return amended or stored
        try:
            await placements.create(key, encode(action))
            return None
        except CasConflict:
            entry = await placements.get(key)
        if entry is None or entry.value not in (JUDGED, LEFT):
            return None  # a redelivery of a result already waiting
        if entry.value == LEFT:
            # Left alive by a migration before its result arrived: judged now.
            out = await judge(action)
            await placements.delete(key)
            return out
        # Judged already from the lifecycle alone, its latency unknown: the result brings it
        # (once; a record that has one is left alone). Not announced again: the record was,
        # and its consumers key on ``action_id`` (the learner reads no latency).
        if await amend(action) is None and await parts["store"].get(action.action_id) is None:
            raise EndNotStoredYet(f"{action.action_id}: its end is judged but its record not stored yet")
        await placements.delete(key)
        return None

    async def close_placement(decision_id: str, ending: TaskLifecycle | None,
                              life: TaskLifecycle) -> FeedbackRecorded | None:
        """Judge the placement of ``decision_id``; ``ending`` None: the task moved on alive."""
        placements: KeyValue = parts["open"]
        key = node_key(decision_id)
        for _ in range(2):  # a second look when the result arrives while we mark its absence
            entry = await placements.get(key)
            if entry is not None and entry.value and entry.value not in (JUDGED, LEFT):
                executed = decode(entry.value, ActionExecuted)
                out = await judge(executed, ending)
                await placements.delete(key)
                return out
            try:
                # The result has not arrived (or is gone past the bucket's TTL): mark the end
                # so that a late result is judged (LEFT) or dropped (JUDGED), not kept.
                if entry is None:
                    await placements.create(key, LEFT if ending is None else JUDGED)
            except CasConflict:
                continue
            if ending is None:
                # The lifecycle describes the new placement, not the one left: nothing to
                # invent; the late result is judged when it comes.
                return None
            # Judged from the lifecycle's own fields, the latency marked as unknown (and the
            # policy's version, from an executor that does not say it: not taken for "1").
            return await record(
                FeedbackRecorded(
                    action_id=action_id_for(decision_id),
                    decision_id=decision_id,
                    task_id=life.task_id,
                    outcome=ending_outcome(ending),
                    latency_ms=Measured(value=0.0, uncertainty_score=1.0),
                    unexpected_side_effect=side_effects_of(ending),
                    policy=PolicyRef(name=life.policy or "unknown", version=life.policy_version or "unknown"),
                    action=life.decision_action,
                    shard_id=life.shard_id,
                    confidence=life.confidence,
                    task_kind=life.task_kind,
                    gpu_model=life.gpu_model,
                    recorded_at=now(),
                )
            )
        return None

    async def stored_before(action_id: str, delivery: Delivery) -> FeedbackRecorded | None:
        """On a redelivery, the record already stored for ``action_id``, to announce again.

        The bus publishes a handler's output after the handler returns, so an announcement
        can fail (a JetStream publish timeout) after the store committed its record; the
        message is then redelivered, and the store alone would call it a duplicate and
        announce nothing, ever. The stored record (not one rebuilt from this message) goes
        out again under the same ``Nats-Msg-Id`` (``feedback:<action_id>``), which the
        stream de-duplicates, and its consumers key on ``action_id``. A first delivery
        announces only what it stored, so a duplicate publish is still announced once.
        """
        if delivery.deliveries <= 1:
            return None
        return await parts["store"].get(action_id)

    @host.on(ActionExecuted, ActionFailed, consumer="feedback-executed")
    async def on_action(action: ActionExecuted | ActionFailed, delivery: Delivery) -> FeedbackRecorded | None:
        if isinstance(action, ActionExecuted) and action.action in PLACEMENTS:
            return await open_placement(action, delivery)
        if (stored := await stored_before(action.action_id, delivery)) is not None:
            return stored
        return await judge(action)

    @host.on(TaskLifecycle, consumer="feedback-lifecycle")
    async def on_lifecycle(life: TaskLifecycle, delivery: Delivery) -> FeedbackRecorded | None:
        if life.state == "migrated" and life.replaces_decision_id:
            ended = life.replaces_decision_id
        elif life.state in ENDINGS and life.decision_id:
            ended = life.decision_id
        else:
            return None
        if (stored := await stored_before(action_id_for(ended), delivery)) is not None:
            return stored
        return await close_placement(ended, None if life.state == "migrated" else life, life)

    @host.endpoint("stats", "feedback.stats", StatsQuery)
    async def stats(query: StatsQuery) -> FeedbackStats:
        try:
            fields = validate_by(query.by)
        except ValueError as error:
            # Answered as an error body naming the grouping; raised, nats.micro sent an
            # empty 500 reply that the client could only fail to decode. Cut short: echoed
            # whole, a grouping near the 1 MB request limit made a reply over the limit.
            message = str(error)
            raise Reject(message if len(message) <= 500 else f"{message[:500]}...") from None
        groups = await parts["store"].aggregates(by=fields)
        reply = FeedbackStats(
            groups=[
                StatsGroup(
                    key=g.key,
                    count=g.count,
                    successes=g.successes,
                    success_rate=g.success_rate,
                    weighted_success_rate=g.weighted_success_rate,
                    measured=g.measured,
                    p95_latency_ms=g.p95_latency_ms,
                    mean_resource_saving_mb=g.mean_resource_saving_mb,
                    expected_successes=g.expected_successes,
                    calibration_gap=g.calibration_gap,
                    brier_score=g.brier_score,
                )
                for g in groups
            ],
            at=now(),
        )
        # A reply over the server's max_payload cannot be sent: nats.micro answered an empty
        # 500 ("MaxPayloadError()") that said nothing of why, and nothing was logged here.
        size = len(encode(reply))
        limit = (host.bus.max_payload if host.bus is not None else None) or MAX_REPLY_BYTES
        if size > limit:
            raise Reject(f"{len(groups)} groups by {fields} make a reply of {size} bytes, over the "
                         f"{limit} a message may carry: group by fewer fields")
        return reply

    return host


def main() -> None:
    """Console entry point ``fleetpilot-feedback``."""
    serve("feedback", build)
