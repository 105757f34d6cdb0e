"""Pure feedback aggregation: from raw feedback rows to per-key statistics.

Every sum is kept in **fixed-point integers** so that it is independent of the order in
which rows were added. That is what lets a store maintain aggregates incrementally (one
``UPSERT ... SET x = x + excluded.x`` per record, under concurrency, in any order) and
still be *exactly* equal to :func:`recompute` over the raw rows — float sums would differ in
the last bits depending on the order of additions.

Fixed-point units:

- weights, confidences and success indicators: ``1 / UNIT`` (``UNIT = 10_000``);
- latency: microseconds (``latency_us``);
- resource saving: ``1/1000`` MB (``saving_milli_mb``).

The sums are Python integers, with no bound; the stores keep them so too (PostgreSQL
``NUMERIC``, SQLite decimal ``TEXT``), since 64 bits run out within a busy key's lifetime
(``weighted_latency`` after about 1.5 million 10-minute latencies).

Weighting: a record's weight is ``1 - latency_ms.uncertainty_score`` clipped to 0..1 (a
record whose latency we could not measure says little about how the action went); a NaN
uncertainty, or a latency that is no measurement (NaN, infinite, negative, over
``MAX_LATENCY_US``), gives weight 0 and the latency is kept as 0. A record of weight 0 has no *measured*
latency: the latency statistics (mean, weighted mean, p95) are over measured records only,
so the placeholder 0 of an action judged without its result does not pull them down, and
they are ``None`` for a group with none. A success is ``outcome == "success"``; every other
outcome (``partial`` included) is a failure for the success rate.

Calibration: ``expected_successes`` is the sum of predicted confidences, ``successes`` the
observed count; the Brier score is ``mean((confidence - success)^2)``; the reliability
table splits records into ``CALIBRATION_BINS`` equal confidence bins.

p95 latency is the uncertainty-weighted nearest rank: the smallest measured latency ``L``
such that the records at or below ``L`` hold at least 95% of the group's weight, computed
from raw rows at query time in integers (so both stores agree to the microsecond). With
equal weights it is the classic nearest rank ``sorted[ceil(0.95 n) - 1]`` (PostgreSQL's
``percentile_disc(0.95)``); a latency measured with little confidence counts for little.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import msgspec

from fleetpilot.contracts import FeedbackRecorded, Measured

KeyField = Literal["policy", "shard_id", "task_kind", "gpu_model", "action"]
KEY_FIELDS: tuple[KeyField, ...] = ("policy", "shard_id", "task_kind", "gpu_model", "action")
UNIT = 10_000
CALIBRATION_BINS = 10
P95_PERCENT = 95
"""The latency percentile served, in whole percent (compared in integers)."""
INT64_MAX = 2**63 - 1
MAX_LATENCY_US = INT64_MAX // UNIT
"""The longest latency a row keeps (about 29 years); anything longer is no measurement (an
epoch taken for a duration, a unit slip). It was chosen so that one record's weighted
latency (``weight_units * latency_us``) fits 64 bits; the stored *sums* have had no 64-bit
bound since schema version 5, and the bound stays so the same records count as measured."""

BaseKey = tuple[str, str, str, str, str]


class FeedbackRow(msgspec.Struct, frozen=True, kw_only=True):
    """One feedback record reduced to the quantised columns a store keeps per raw row."""

    action_id: str
    policy: str
    shard_id: str
    task_kind: str
    gpu_model: str
    action: str = ""
    success: int
    weight_units: int
    latency_us: int
    saving_milli_mb: int
    confidence_units: int
    side_effects: int

    @property
    def key(self) -> BaseKey:
        """The full aggregation key (policy, shard_id, task_kind, gpu_model, action)."""
        return (self.policy, self.shard_id, self.task_kind, self.gpu_model, self.action)

    @property
    def calibration_bin(self) -> int:
        """Index of this row's confidence bin (0 .. CALIBRATION_BINS - 1)."""
        return calibration_bin(self.confidence_units)


def policy_label(name: str, version: str) -> str:
    """The ``policy`` key of a record: ``name@version`` so versions compare side by side."""
    return f"{name}@{version}"


def _clip01(value: float) -> float:
    return 0.0 if not math.isfinite(value) else min(max(value, 0.0), 1.0)


def calibration_bin(confidence_units: int) -> int:
    """The reliability bin of a confidence given in ``1/UNIT``; 1.0 falls in the top bin."""
    return min(confidence_units * CALIBRATION_BINS // UNIT, CALIBRATION_BINS - 1)


def _fixed_point(value: float, scale: float, limit: int) -> int | None:
    """``value * scale`` rounded, or ``None`` when it is no number or beyond ``limit``."""
    scaled = value * scale
    if not math.isfinite(scaled) or abs(scaled) > limit:
        return None
    return round(scaled)


def row_from_event(event: FeedbackRecorded) -> FeedbackRow:
    """Quantise one feedback event into the row a store keeps (the only rounding step).

    A latency that is no measurement (NaN, infinite, negative, longer than ``MAX_LATENCY_US``)
    is kept as unknown: 0 µs with no weight, as the feedback service writes a latency it never
    saw. An uncertainty that is NaN is no information either: no weight, not full weight.
    """
    latency_us = _fixed_point(event.latency_ms.value, 1000.0, MAX_LATENCY_US)
    if latency_us is not None and latency_us < 0:
        # A duration below zero (a clock that stepped back) was kept as a measured 0 µs at
        # full weight, pulling the mean and p95 down, while -inf weighed nothing.
        latency_us = None
    uncertainty = event.latency_ms.uncertainty_score
    trusted = latency_us is not None and not math.isnan(uncertainty)
    weight_units = round((1.0 - _clip01(uncertainty)) * UNIT) if trusted else 0
    saving_milli_mb = _fixed_point(event.resource_saving_mb, 1000.0, INT64_MAX)
    return FeedbackRow(
        action_id=event.action_id,
        policy=policy_label(event.policy.name, event.policy.version),
        shard_id=event.shard_id,
        task_kind=event.task_kind,
        gpu_model=event.gpu_model,
        action=event.action,
        success=1 if event.outcome == "success" else 0,
        weight_units=weight_units,
        latency_us=latency_us or 0,
        saving_milli_mb=saving_milli_mb or 0,
        confidence_units=round(_clip01(event.confidence) * UNIT),
        side_effects=1 if event.unexpected_side_effect else 0,
    )


class Totals(msgspec.Struct, kw_only=True):
    """Order-independent integer sums over a set of rows (the stored aggregate row)."""

    count: int = 0
    successes: int = 0
    weight_units: int = 0
    weighted_success_units: int = 0
    latency_us: int = 0
    weighted_latency: int = 0
    saving_milli_mb: int = 0
    confidence_units: int = 0
    brier_units2: int = 0
    side_effects: int = 0
    measured: int = 0
    """Records whose latency was measured (weight above 0); ``latency_us`` sums theirs only."""

    def add(self, other: Totals) -> None:
        """Add another set of sums into this one, in place."""
        for field in self.__struct_fields__:
            setattr(self, field, getattr(self, field) + getattr(other, field))


TOTALS_FIELDS: tuple[str, ...] = Totals.__struct_fields__


def totals_of(row: FeedbackRow) -> Totals:
    """The contribution of one row to its key's sums (what a store adds per record)."""
    error = row.confidence_units - row.success * UNIT
    measured = 1 if row.weight_units > 0 else 0
    return Totals(
        count=1,
        successes=row.success,
        weight_units=row.weight_units,
        weighted_success_units=row.weight_units * row.success,
        latency_us=row.latency_us * measured,
        weighted_latency=row.weight_units * row.latency_us,
        saving_milli_mb=row.saving_milli_mb,
        confidence_units=row.confidence_units,
        brier_units2=error * error,
        side_effects=row.side_effects,
        measured=measured,
    )


class LateResultAmendment(msgspec.Struct, frozen=True, kw_only=True):
    """A stored record given what the result it was judged without brings
    (``late_result_amendment``)."""

    event: FeedbackRecorded
    """The record as it is to be stored now: the stored one with the measured latency and,
    for a success, the memory its placement left to other work."""
    row: FeedbackRow
    """Its raw row (only ``weight_units``, ``latency_us`` and ``saving_milli_mb`` differ from
    the stored one)."""
    delta: Totals
    """What its key's sums gain: the new row's contribution less the stored row's."""


def late_result_amendment(stored: FeedbackRecorded, latency: Measured,
                          saving_if_success_mb: float) -> LateResultAmendment | None:
    """The amendment of ``stored`` by its action's result, come after it was judged: the
    result's ``latency`` and, where ``stored`` is a success, ``saving_if_success_mb`` (the
    GPU memory its placement left to other work, ``outcomes.resource_saving_of``); ``None``
    when there is nothing to amend: ``stored`` has a measured latency (weight above 0), or
    ``latency`` is no measurement either (weight 0).

    A placement whose end was handled before the executor's result is judged from the end
    alone: its latency unknown (weight 0), and its saving unknown (0), as the end names no
    GPU share. The result, when it comes, brings both. Neither changes the key, the outcome
    nor the calibration bin: the delta touches the latency and saving sums alone, and
    applying it once (only to a stored row that still weighs 0) keeps the sums equal to a
    recomputation from the amended raw rows.
    """
    old = row_from_event(stored)
    if old.weight_units > 0:
        return None
    saving = saving_if_success_mb if stored.outcome == "success" else stored.resource_saving_mb
    event = msgspec.structs.replace(stored, latency_ms=latency, resource_saving_mb=saving)
    row = row_from_event(event)
    if row.weight_units == 0:
        return None
    before, after = totals_of(old), totals_of(row)
    delta = Totals(**{f: getattr(after, f) - getattr(before, f) for f in TOTALS_FIELDS})
    return LateResultAmendment(event=event, row=row, delta=delta)


class BinTotals(msgspec.Struct, kw_only=True):
    """Sums of one confidence bin of one key (the stored calibration row)."""

    count: int = 0
    confidence_units: int = 0
    successes: int = 0

    def add(self, other: BinTotals) -> None:
        """Add another bin's sums into this one, in place."""
        self.count += other.count
        self.confidence_units += other.confidence_units
        self.successes += other.successes


class ReliabilityBin(msgspec.Struct, frozen=True, kw_only=True):
    """One row of a reliability table: predicted vs observed success in a confidence band."""

    lower: float
    upper: float
    count: int
    mean_confidence: float
    observed_rate: float


class Aggregate(msgspec.Struct, frozen=True, kw_only=True):
    """Statistics of one group of feedback records.

    ``key`` maps each grouping field to its value. The integer sums are exact; the float
    figures are derived from them deterministically, so two aggregates over the same rows
    compare equal with ``==`` whatever order the rows were added in.
    """

    key: dict[str, str]
    count: int
    successes: int
    success_rate: float
    weighted_success_rate: float | None
    measured: int
    mean_latency_ms: float | None
    weighted_mean_latency_ms: float | None
    p95_latency_ms: float | None
    mean_resource_saving_mb: float
    total_resource_saving_mb: float
    expected_successes: float
    calibration_gap: float
    brier_score: float
    side_effect_rate: float
    reliability: list[ReliabilityBin]
    totals: Totals


def weighted_nearest_rank(samples: Iterable[tuple[int, int]], percent: int = P95_PERCENT) -> int | None:
    """The ``percent`` quantile of ``(latency_us, weight_units)`` samples by weighted nearest
    rank: the smallest latency whose samples at or below it hold ``percent``% of the weight.
    Samples of weight 0 are not measurements; ``None`` when no sample has weight."""
    measured = sorted((latency, weight) for latency, weight in samples if weight > 0)
    total = sum(weight for _, weight in measured)
    below = 0
    for latency, weight in measured:
        below += weight
        if below * 100 >= total * percent:
            return latency
    return None


def _reliability(bins: Mapping[int, BinTotals]) -> list[ReliabilityBin]:
    table = []
    for index in sorted(bins):
        b = bins[index]
        if b.count == 0:
            continue
        table.append(
            ReliabilityBin(
                lower=index / CALIBRATION_BINS,
                upper=(index + 1) / CALIBRATION_BINS,
                count=b.count,
                mean_confidence=b.confidence_units / UNIT / b.count,
                observed_rate=b.successes / b.count,
            )
        )
    return table


def finish(key: dict[str, str], totals: Totals, bins: Mapping[int, BinTotals], p95_us: int | None) -> Aggregate:
    """Derive an :class:`Aggregate` from exact sums (shared by stores and :func:`recompute`)."""
    n = totals.count
    w = totals.weight_units
    m = totals.measured
    return Aggregate(
        key=key,
        count=n,
        successes=totals.successes,
        success_rate=totals.successes / n if n else 0.0,
        weighted_success_rate=totals.weighted_success_units / w if w else None,
        measured=m,
        mean_latency_ms=totals.latency_us / m / 1000.0 if m else None,
        weighted_mean_latency_ms=totals.weighted_latency / w / 1000.0 if w else None,
        p95_latency_ms=None if p95_us is None else p95_us / 1000.0,
        mean_resource_saving_mb=totals.saving_milli_mb / n / 1000.0 if n else 0.0,
        total_resource_saving_mb=totals.saving_milli_mb / 1000.0,
        expected_successes=totals.confidence_units / UNIT,
        calibration_gap=(totals.confidence_units / UNIT - totals.successes) / n if n else 0.0,
        brier_score=totals.brier_units2 / (UNIT * UNIT) / n if n else 0.0,
        side_effect_rate=totals.side_effects / n if n else 0.0,
        reliability=_reliability(bins),
        totals=totals,
    )


def validate_by(by: Sequence[str]) -> tuple[KeyField, ...]:
    """Check a grouping: a non-repeating subset of ``KEY_FIELDS`` (an empty one = overall)."""
    fields = tuple(by)
    unknown = [f for f in fields if f not in KEY_FIELDS]
    if unknown or len(set(fields)) != len(fields):
        raise ValueError(f"group by a subset of {KEY_FIELDS}, got {fields}")
    return fields  # type: ignore[return-value]


def project(key: BaseKey, by: Sequence[str]) -> tuple[str, ...]:
    """The values of ``by`` fields from a full key."""
    return tuple(key[KEY_FIELDS.index(f)] for f in by)  # type: ignore[arg-type]


def assemble(
    base: Mapping[BaseKey, Totals],
    bins: Mapping[tuple[BaseKey, int], BinTotals],
    p95_us: Mapping[tuple[str, ...], int],
    by: Sequence[str],
) -> list[Aggregate]:
    """Roll full-key sums up to the ``by`` grouping; ``p95_us`` is keyed by the projection
    (a group missing from it has no measured latency).

    Used by the stores over their stored aggregate rows and by :func:`recompute` over raw
    rows, so the two paths differ only in where the sums come from.
    """
    fields = validate_by(by)
    groups: dict[tuple[str, ...], Totals] = {}
    group_bins: dict[tuple[str, ...], dict[int, BinTotals]] = {}
    for key, totals in base.items():
        group = project(key, fields)
        groups.setdefault(group, Totals()).add(totals)
    for (key, index), b in bins.items():
        group = project(key, fields)
        group_bins.setdefault(group, {}).setdefault(index, BinTotals()).add(b)
    return [
        finish(
            dict(zip(fields, group, strict=True)),
            groups[group],
            group_bins.get(group, {}),
            p95_us.get(group),
        )
        for group in sorted(groups)
    ]


def p95_by_group(
    samples: Iterable[tuple[BaseKey, int, int]], by: Sequence[str]
) -> dict[tuple[str, ...], int]:
    """Weighted nearest-rank p95 of latency (µs) per ``by`` group from ``(full key,
    latency_us, weight_units)`` samples; groups without a measured latency are left out."""
    fields = validate_by(by)
    samples_of: dict[tuple[str, ...], list[tuple[int, int]]] = {}
    for key, latency, weight in samples:
        samples_of.setdefault(project(key, fields), []).append((latency, weight))
    p95 = {group: weighted_nearest_rank(values) for group, values in samples_of.items()}
    return {group: value for group, value in p95.items() if value is not None}


def recompute(rows: Iterable[FeedbackRow], by: Sequence[str] = KEY_FIELDS) -> list[Aggregate]:
    """Aggregates computed from scratch over raw rows: the reference the stores must match."""
    base: dict[BaseKey, Totals] = {}
    bins: dict[tuple[BaseKey, int], BinTotals] = {}
    latencies: list[tuple[BaseKey, int, int]] = []
    for row in rows:
        base.setdefault(row.key, Totals()).add(totals_of(row))
        bins.setdefault((row.key, row.calibration_bin), BinTotals()).add(
            BinTotals(count=1, confidence_units=row.confidence_units, successes=row.success)
        )
        latencies.append((row.key, row.latency_us, row.weight_units))
    return assemble(base, bins, p95_by_group(latencies, by), by)
