"""The feedback service.

Every action gets exactly one feedback record (keyed by ``action_id``):

- ``action.failed`` → ``failure`` at once;
- ``action.executed`` of ``migrate``/``evict``/``resize``/``queue``/``reject`` → ``success`` at once;
- an executed ``assign`` is judged by how the task's life ends (``task.lifecycle``):
  ``finished`` → ``success``, ``oom_killed`` → ``oom``, ``failed`` → ``failure``.

Records go to the store (SQLite by default, PostgreSQL when ``store_dsn`` is a
``postgresql://`` URL), then out as ``feedback.recorded``. Statistics are served on the
``feedback.stats`` request/reply endpoint, which the policy's fallback reads.
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
    now,
)
from fleetpilot.feedback import FeedbackStore, PostgresFeedbackStore, SqliteFeedbackStore
from fleetpilot.runtime import Bus, ServiceHost, ServiceSettings
from pydantic_settings import SettingsConfigDict

log = logging.getLogger("fleetpilot.feedback")

_OUTCOME = {"finished": "success", "oom_killed": "oom", "failed": "failure"}


class FeedbackSettings(ServiceSettings):
    """``FLEETPILOT_FEEDBACK_*``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_FEEDBACK_", extra="ignore")

    store_dsn: str = ""
    store_schema: str = "fleetpilot_feedback"


async def open_store(settings: FeedbackSettings) -> FeedbackStore:
    """PostgreSQL in ``store_schema`` for a ``postgresql://`` DSN, else SQLite (default
    ``<state_dir>/feedback.db``; its folder is created)."""
    dsn = settings.store_dsn
    if dsn.startswith(("postgresql://", "postgres://")):
        return await PostgresFeedbackStore.open(dsn, schema=settings.store_schema)
    path = Path(dsn.removeprefix("sqlite:///") if dsn else Path(settings.state_dir) / "feedback.db")
    path.parent.mkdir(parents=True, exist_ok=True)
    return SqliteFeedbackStore(path)


def build(settings: FeedbackSettings | None = None) -> ServiceHost:
    """Wire the feedback service."""
    settings = settings or FeedbackSettings()
    host = ServiceHost("feedback", settings)
    parts: dict = {}
    # Latency of executed assigns, waiting for the task's end to judge them.
    assign_latency: dict[str, float] = {}

    async def open_parts(bus: Bus) -> None:
        parts["store"] = await open_store(settings)

    async def close_parts() -> None:
        if "store" in parts:
            await parts["store"].close()

    host.on_startup(open_parts)
    host.on_shutdown(close_parts)

    async def record(event: FeedbackRecorded) -> FeedbackRecorded | None:
        stored = await parts["store"].record(event)
        return event if stored else None  # a redelivery is stored once and announced once

    @host.on(ActionExecuted, ActionFailed, consumer="feedback-executed")
    async def on_action(action: ActionExecuted | ActionFailed) -> FeedbackRecorded | None:
        if isinstance(action, ActionExecuted) and action.action == "assign":
            assign_latency[action.decision_id] = action.latency_ms
            return None
        failed = isinstance(action, ActionFailed)
        return await record(
            FeedbackRecorded(
                action_id=action.action_id,
                decision_id=action.decision_id,
                task_id=action.task_id,
                outcome="failure" if failed else "success",
                latency_ms=Measured(value=action.latency_ms, uncertainty_score=0.05),
                unexpected_side_effect=[],
                policy=action.policy,
                shard_id=action.shard_id,
                confidence=action.confidence,
                task_kind=action.task_kind,
                gpu_model=action.gpu_model,
                recorded_at=now(),
            )
        )

    @host.on(TaskLifecycle, consumer="feedback-lifecycle")
    async def on_lifecycle(life: TaskLifecycle) -> FeedbackRecorded | None:
        outcome = _OUTCOME.get(life.state)
        if outcome is None or not life.decision_id:
            return None
        latency = assign_latency.pop(life.decision_id, None)
        side_effects = ["oom_neighbour"] if life.state == "oom_killed" and "neighbour" in life.detail else []
        return await record(
            FeedbackRecorded(
                action_id=f"act-{life.decision_id}",
                decision_id=life.decision_id,
                task_id=life.task_id,
                outcome=outcome,  # type: ignore[arg-type]
                # Unknown latency (the executor replica restarted) is recorded as untrustworthy.
                latency_ms=Measured(
                    value=latency or 0.0, uncertainty_score=0.05 if latency is not None else 1.0
                ),
                unexpected_side_effect=side_effects,
                policy=PolicyRef(name=life.policy or "unknown"),
                shard_id=life.shard_id,
                confidence=life.confidence,
                task_kind=life.task_kind,
                gpu_model=life.gpu_model,
                recorded_at=now(),
            )
        )

    @host.endpoint("stats", "feedback.stats", StatsQuery)
    async def stats(query: StatsQuery) -> FeedbackStats:
        groups = await parts["store"].aggregates(by=tuple(query.by))
        return FeedbackStats(
            groups=[
                StatsGroup(
                    key=g.key,
                    count=g.count,
                    successes=g.successes,
                    success_rate=g.success_rate,
                    weighted_success_rate=g.weighted_success_rate,
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

    return host


def main() -> None:
    """Console entry point ``fleetpilot-feedback``."""
    build().main()
