"""Pure aggregation: quantisation, percentiles, calibration and order independence."""

from __future__ import annotations

import random

import pytest
from fleetpilot.contracts import FeedbackRecorded, Measured, PolicyRef
from fleetpilot.feedback import recompute, row_from_event, weighted_nearest_rank
from fleetpilot.feedback.aggregates import calibration_bin, validate_by
from fleetpilot.feedback.migrations import POSTGRES_MIGRATIONS, SQLITE_MIGRATIONS, Migration, pending
from fleetpilot.feedback.retry import backoff_delay, is_retryable
from fleetpilot.feedback.synthetic import writer_stream


def event(
    action_id: str,
    outcome: str = "success",
    latency: float = 10.0,
    uncertainty: float = 0.0,
    confidence: float = 0.5,
    gpu: str = "A100",
    policy: str = "fgd",
    saving: float = 0.0,
) -> FeedbackRecorded:
    return FeedbackRecorded(
        action_id=action_id,
        outcome=outcome,  # type: ignore[arg-type]
        latency_ms=Measured(value=latency, uncertainty_score=uncertainty),
        resource_saving_mb=saving,
        unexpected_side_effect=[],
        policy=PolicyRef(name=policy),
        confidence=confidence,
        task_kind="train",
        gpu_model=gpu,
        recorded_at=0.0,
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], None),
        ([7], 7),
        ([1, 2], 2),
        (list(range(1, 21)), 19),
        (list(range(1, 101)), 95),
        (list(range(100, 0, -1)), 95),
    ],
)
def test_equal_weights_match_percentile_disc(values: list[int], expected: int | None) -> None:
    assert weighted_nearest_rank([(v, 1) for v in values]) == expected
    assert weighted_nearest_rank([(v, 7_500) for v in values]) == expected  # the scale of weights is irrelevant


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        # 90 sure fast records and 10 slow ones measured with 90% uncertainty: the slow ones
        # hold 10 / 910 of the weight, under the 5% tail, where unweighted they would be the p95.
        ([(10, 10_000)] * 90 + [(500, 1_000)] * 10, 10),
        ([(10, 10_000)] * 90 + [(500, 10_000)] * 10, 500),
        # Weight 0 is no measurement at all: not a sample, whatever its latency.
        ([(0, 0)] * 19 + [(40, 10_000)], 40),
        ([(3, 0), (9, 0)], None),
    ],
)
def test_weighted_nearest_rank(samples: list[tuple[int, int]], expected: int | None) -> None:
    assert weighted_nearest_rank(samples) == expected


@pytest.mark.parametrize(
    ("confidence", "uncertainty", "latency", "weight", "conf_units", "latency_us", "bin"),
    [
        (0.0, 0.0, 1.0, 10_000, 0, 1000, 0),
        (1.0, 1.0, 0.0005, 0, 10_000, 0, 9),  # 1.0 falls in the top bin; 0.5 µs rounds to 0
        (0.73, 0.25, 12.3456, 7_500, 7_300, 12_346, 7),
        (1.7, -0.5, 3.0, 10_000, 10_000, 3000, 9),  # out-of-range inputs are clipped
        (0.5, 0.0, float("nan"), 0, 5_000, 0, 5),  # no latency measured: no weight
    ],
)
def test_row_quantisation(
    confidence: float,
    uncertainty: float,
    latency: float,
    weight: int,
    conf_units: int,
    latency_us: int,
    bin: int,
) -> None:
    row = row_from_event(event("a", latency=latency, uncertainty=uncertainty, confidence=confidence))
    assert (row.weight_units, row.confidence_units, row.latency_us, row.calibration_bin) == (
        weight,
        conf_units,
        latency_us,
        bin,
    )
    assert calibration_bin(row.confidence_units) == bin


def test_hand_computed_aggregate() -> None:
    rows = [
        row_from_event(event("a", "success", latency=10, uncertainty=0.0, confidence=0.9, saving=100)),
        row_from_event(event("b", "oom", latency=30, uncertainty=0.5, confidence=0.9, saving=-50)),
        row_from_event(event("c", "success", latency=20, uncertainty=1.0, confidence=0.2)),
    ]
    [agg] = recompute(rows)
    assert agg.key == {"policy": "fgd@1", "shard_id": "primary", "task_kind": "train", "gpu_model": "A100",
                       "action": ""}
    assert agg.count == 3 and agg.successes == 2
    assert agg.success_rate == pytest.approx(2 / 3)
    # weights 1, 0.5, 0: weighted success = 1 / 1.5
    assert agg.weighted_success_rate == pytest.approx(1 / 1.5)
    assert agg.weighted_mean_latency_ms == pytest.approx((10 * 1 + 30 * 0.5) / 1.5)
    # c's latency comes with no confidence at all: not a measurement.
    assert agg.measured == 2
    assert agg.mean_latency_ms == pytest.approx((10 + 30) / 2)
    assert agg.p95_latency_ms == 30.0
    assert agg.total_resource_saving_mb == pytest.approx(50.0)
    assert agg.expected_successes == pytest.approx(2.0)
    assert agg.calibration_gap == pytest.approx(0.0)
    assert agg.brier_score == pytest.approx((0.1**2 + 0.9**2 + 0.8**2) / 3)
    assert [(b.lower, b.count, b.observed_rate) for b in agg.reliability] == [
        (pytest.approx(0.2), 1, 1.0),
        (pytest.approx(0.9), 2, 0.5),
    ]


def test_no_weight_means_no_weighted_rate() -> None:
    [agg] = recompute([row_from_event(event("a", uncertainty=1.0))])
    assert agg.weighted_success_rate is None and agg.weighted_mean_latency_ms is None
    assert (agg.measured, agg.mean_latency_ms, agg.p95_latency_ms) == (0, None, None)


def test_unmeasured_records_do_not_pull_the_latency_down() -> None:
    """Actions judged without their result (the feedback service writes latency 0, uncertainty
    1) count for the success rate but say nothing of latency."""
    judged_blind = [row_from_event(event(f"blind-{i}", latency=0.0, uncertainty=1.0)) for i in range(19)]
    [agg] = recompute([*judged_blind, row_from_event(event("timed", latency=40.0))])
    assert agg.count == 20 and agg.measured == 1
    assert agg.mean_latency_ms == pytest.approx(40.0)
    assert agg.p95_latency_ms == pytest.approx(40.0)


@pytest.mark.parametrize(
    "by", [("policy", "shard_id", "task_kind", "gpu_model"), ("policy",), ("gpu_model", "policy"), ()]
)
def test_recompute_is_order_independent_and_rolls_up(by: tuple[str, ...]) -> None:
    rows = [row_from_event(e) for e in writer_stream(0, 600, seed=3)]
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    assert recompute(rows, by) == recompute(shuffled, by)
    groups = recompute(rows, by)
    assert sum(g.count for g in groups) == len(rows)
    assert sum(g.totals.latency_us for g in groups) == sum(r.latency_us for r in rows if r.weight_units)
    assert sum(g.measured for g in groups) == sum(1 for r in rows if r.weight_units)
    assert all(list(g.key) == list(by) for g in groups)


@pytest.mark.parametrize("by", [("nope",), ("policy", "policy")])
def test_bad_grouping_rejected(by: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="group by a subset of"):
        validate_by(by)


@pytest.mark.parametrize(
    ("applied", "expected"),
    [([], [1, 2, 3, 4, 5]), ([1], [2, 3, 4, 5]), ([1, 2], [3, 4, 5]), ([1, 2, 3, 4], [5]), ([1, 2, 3, 4, 5], [])],
)
def test_pending_migrations(applied: list[int], expected: list[int]) -> None:
    assert [m.version for m in pending(SQLITE_MIGRATIONS, applied)] == expected
    assert [m.version for m in pending(POSTGRES_MIGRATIONS, applied)] == expected


@pytest.mark.parametrize(
    ("migrations", "applied", "message"),
    [
        ((Migration(version=2, name="x", statements=()),), [], "must be 1..n in order"),  # gap
        ((Migration(version=1, name="x", statements=()),), [1, 2], "migrations this code does not know"),  # newer
    ],
)
def test_malformed_migrations_rejected(migrations: tuple[Migration, ...], applied: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pending(migrations, applied)


def test_backoff_grows_with_jitter_and_caps() -> None:
    rng = random.Random(0)
    for attempt in range(12):
        ceiling = min(0.25, 0.002 * 2**attempt)
        delays = {backoff_delay(attempt, rng=rng) for _ in range(20)}
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(delays) > 1  # jittered


@pytest.mark.parametrize(
    ("sqlstate", "retry"), [("40001", True), ("40P01", True), ("23505", False), (None, False)]
)
def test_retryable_sqlstates(sqlstate: str | None, retry: bool) -> None:
    error = Exception()
    error.sqlstate = sqlstate  # type: ignore[attr-defined]
    assert is_retryable(error) is retry


@pytest.mark.parametrize("attempt", [1023, 1024, 5_000, 10**6])
def test_a_late_attempt_waits_within_the_cap(attempt: int) -> None:
    # 0.002 * 2**1024 is no float: the 1024th retry of a store opened with max_attempts above
    # that raised OverflowError instead of waiting (and hid the conflict it was retrying).
    assert 0.125 <= backoff_delay(attempt, rng=random.Random(1)) <= 0.25
