"""Seeded synthetic feedback streams, for store tests and benchmarks (pure)."""

from __future__ import annotations

import random

from fleetpilot.contracts import FeedbackRecorded, Measured, Outcome, PolicyRef

POLICIES: tuple[PolicyRef, ...] = (
    PolicyRef(name="fgd"),
    PolicyRef(name="learned", version="7"),
    PolicyRef(name="best-fit"),
)
SHARDS: tuple[str, ...] = ("primary", "candidate")
TASK_KINDS: tuple[str, ...] = ("train", "infer", "finetune")
GPU_MODELS: tuple[str, ...] = ("A100", "H100", "RTX4090")
ACTIONS: tuple[str, ...] = ("assign", "migrate")
"""Two actions only: keys must overlap between writers for the concurrency proof to bite."""
OUTCOMES: tuple[Outcome, ...] = (
    "success",
    "success",
    "success",
    "failure",
    "oom",
    "sla_missed",
    "timeout",
    "partial",
)


def feedback_event(action_id: str, rng: random.Random) -> FeedbackRecorded:
    """One random but plausible feedback event with the given ``action_id``."""
    confidence = rng.random()
    # Successes a bit likelier at high confidence, so calibration figures are not noise.
    outcome: Outcome = "success" if rng.random() < 0.3 + 0.6 * confidence else rng.choice(OUTCOMES[3:])
    return FeedbackRecorded(
        action_id=action_id,
        decision_id=f"d-{action_id}",
        task_id=f"t-{action_id}",
        outcome=outcome,
        latency_ms=Measured(
            value=rng.lognormvariate(3.0, 1.0), uncertainty_score=rng.choice((0.0, 0.1, 0.35, 0.8, 1.0))
        ),
        resource_saving_mb=rng.uniform(-512.0, 4096.0),
        unexpected_side_effect=["neighbour_slowdown"] if rng.random() < 0.05 else [],
        policy=rng.choice(POLICIES),
        shard_id=rng.choice(SHARDS),
        confidence=confidence,
        task_kind=rng.choice(TASK_KINDS),
        gpu_model=rng.choice(GPU_MODELS),
        action=rng.choice(ACTIONS),
        recorded_at=1_800_000_000.0 + rng.random() * 3600,
    )


def writer_stream(writer: int, n: int, *, seed: int = 0, shared_every: int = 10) -> list[FeedbackRecorded]:
    """The ``n`` events writer ``writer`` sends; every ``shared_every``-th one is shared.

    A shared event has an ``action_id`` (and content) identical across all writers — the
    redelivered message several replicas handle at once — so it must be stored once.
    """
    events = []
    for i in range(n):
        if shared_every and i % shared_every == 0:
            action_id = f"shared-{i:06d}"
            rng = random.Random(f"{seed}:{action_id}")
        else:
            action_id = f"w{writer}-{i:06d}"
            rng = random.Random(f"{seed}:{action_id}")
        events.append(feedback_event(action_id, rng))
    return events
