"""GPU health: a failure probability per GPU from a window of telemetry samples (pure).

The model is a logistic regression with **hand-set, documented weights**: it was not fitted
on real fleet failures (we have none yet), only checked against the simulated fault
histories of :mod:`fleetpilot.maintenance.faults` (see :mod:`fleetpilot.maintenance.eval`).
Its output is a risk score in 0..1 ordered the right way, not a calibrated probability;
calibrating it needs real outcomes from the feedback store.

Features over a window of :class:`~fleetpilot.contracts.GpuSample`. Cumulative hardware
counters count their growth over the window (:func:`counter_increments`): a reading that dips
or jumps and comes back is no growth, and a counter that restarted from zero counts from there; a
field the collector could not read (named under the sample's ``nvml_unsupported`` label,
sent as 0; every field but the XID count of a GPU NVML could not open, ``nvml_error``) is left
out of that sample. Rates are per hour over the window's span, but over at least
:data:`MIN_RATE_SPAN_H`, so a burst in a window minutes long is not extrapolated to an hour:

========================  ==========================================================  ======
feature                   meaning (transform)                                         weight
========================  ==========================================================  ======
``xid``                   sum of XID severities in the window (capped at 5)           2.0
``ecc_corrected``         log1p(corrected ECC errors per hour)                        0.6
``ecc_uncorrected``       uncorrected ECC errors in the window (capped at 5)          2.5
``remap``                 log1p(new retired pages + remapped rows)                    1.2
``remap_level``           retired pages + remapped rows so far / 64 (capped at 1)     1.0
``pcie_replays``          log1p(PCIe replays per hour)                                0.6
``link_downtrain``        1 - worst link width / max width (0: full width)            6.0
``thermal_slope``         positive Theil-Sen slope in °C per hour / 5 (span >= 1 h)   1.5
``hot_fraction``          share of time (>= 1 h) read above the threshold (gaps*)     4.0
``overheat``              latest °C above ``temp_threshold_c`` / 5 (capped at 2)      1.5
(bias)                                                                                -5.0
========================  ==========================================================  ======

(*) A reading speaks for the time since the one before it, but for no longer than the
window's median sampling period (between distinct readings): a gap in reporting is time
nobody saw. A temperature that is no number is left out, as an unread one. The thermal slope is
the median of the pairwise slopes (Theil-Sen) so that one reading after a gap, with the
leverage of half the window in a least-squares fit, does not make a trend.

XID severities (:data:`XID_SEVERITY`): the hardware-fault codes weigh 0.5-1.0 (48 double-bit
ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 92/94/95 ECC rates and
containment, 119/120 GSP, 140 unrecovered ECC); codes that are usually the application's
fault (13, 31, 43) weigh 0.1 or less, so a buggy job does not send a healthy GPU to maintenance.

With the bias at -5 a quiet GPU scores ~0.007; one isolated DBE (an XID 48 and one
uncorrected ECC error) ~0.38; the :data:`MAINTENANCE_THRESHOLD` 0.85 needs several
independent signs of decay together.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Iterable, Mapping, Sequence

import msgspec
import numpy as np

from fleetpilot.contracts import GpuSample

MAINTENANCE_THRESHOLD = 0.85

XID_SEVERITY: Mapping[int, float] = {
    13: 0.1,  # graphics engine exception: usually the application
    31: 0.1,  # GPU memory page fault: usually the application
    43: 0.05,  # GPU stopped processing: usually the application
    45: 0.0,  # preemptive cleanup after another error
    48: 1.0,  # double-bit ECC error
    61: 0.6,  # internal micro-controller breakpoint
    62: 0.6,  # internal micro-controller halt
    63: 0.5,  # ECC page retirement / row remapping recorded
    64: 1.0,  # ECC page retirement / row remapping failure
    74: 0.6,  # NVLink error
    79: 1.0,  # GPU has fallen off the bus
    92: 0.6,  # high single-bit ECC error rate
    94: 0.5,  # contained ECC error
    95: 1.0,  # uncontained ECC error
    119: 0.7,  # GSP RPC timeout
    120: 0.7,  # GSP error
    140: 1.0,  # unrecovered ECC error: the page could not even be retired or remapped
}
UNKNOWN_XID_SEVERITY = 0.2
MIN_SLOPE_SPAN_H = 1.0
SLOPE_READINGS = 60  # at most this many readings, spread evenly, make the thermal slope
# Error rates are per hour over the window's span, but over at least this long: a burst seen
# in the first minutes of a window (a fresh executor, a board just replaced) is not an hourly
# rate, and extrapolated from a 2-minute span it would read 30x as alarming as the same burst
# in a full window.
MIN_RATE_SPAN_H = 1.0
REMAP_CAPACITY = 64  # rows an A100/H100 bank can remap before the GPU needs replacing


def xid_severity(code: int) -> float:
    """How much one XID event of ``code`` says about hardware decay (0..1)."""
    return XID_SEVERITY.get(code, UNKNOWN_XID_SEVERITY)


class HealthFeatures(msgspec.Struct, frozen=True, kw_only=True):
    """The transformed features of one GPU's window (see the module table)."""

    xid: float = 0.0
    ecc_corrected: float = 0.0
    ecc_uncorrected: float = 0.0
    remap: float = 0.0
    remap_level: float = 0.0
    pcie_replays: float = 0.0
    link_downtrain: float = 0.0
    thermal_slope: float = 0.0
    hot_fraction: float = 0.0
    overheat: float = 0.0


class LogisticWeights(msgspec.Struct, frozen=True, kw_only=True):
    """The logistic model's coefficients, one per :class:`HealthFeatures` field, plus a bias."""

    bias: float = -5.0
    xid: float = 2.0
    ecc_corrected: float = 0.6
    ecc_uncorrected: float = 2.5
    remap: float = 1.2
    remap_level: float = 1.0
    pcie_replays: float = 0.6
    link_downtrain: float = 6.0
    thermal_slope: float = 1.5
    hot_fraction: float = 4.0
    overheat: float = 1.5


class HealthAssessment(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU's failure risk at the end of a window, why, and what to move off it."""

    node: str
    gpu: int
    uuid: str
    at: float
    failure_probability: float
    maintenance_pending: bool
    features: HealthFeatures
    contributions: dict[str, float]
    tasks_to_migrate: list[str]


class MigrationRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A task to move away from a GPU that is about to go to maintenance."""

    task_id: str
    node: str
    gpu: int
    failure_probability: float
    reason: str


# The collector names a field NVML failed to read under this label and sends its default
# (0) instead: that reading says nothing about the GPU (``fleet/nvml_reader.py``).
UNREAD_LABEL = "nvml_unsupported"
_UNREAD_FIELDS: Mapping[str, tuple[str, ...]] = {
    "ecc": ("ecc_corrected", "ecc_uncorrected"),
    "retired_pages": ("retired_pages",),
    "remapped_rows": ("remapped_rows",),
    "pcie_replays": ("pcie_replays",),
    "pcie_link_width": ("pcie_link_width", "pcie_link_width_max"),
    "temperature": ("temperature_c",),
    "processes": ("processes",),
}
# Growth of a counter beyond this within one window is no more alarming, and a value that
# large (a garbage reading) would overflow the float arithmetic below.
_MAX_GROWTH = 10**12


# A GPU NVML could not open at all is sent with every field at its default and the reason
# under this label, with no ``nvml_unsupported`` (``NvmlReader._unopened_sample``); only its
# XID count, which the collector keeps itself, is still a reading.
UNOPENED_LABEL = "nvml_error"

_ALL_READ: frozenset[str] = frozenset()
_NONE_READ: frozenset[str] = frozenset(field for fields in _UNREAD_FIELDS.values() for field in fields)


def _unread(sample: GpuSample) -> frozenset[str]:
    """The fields of ``sample`` that its collector could not read (their value is a default)."""
    if UNOPENED_LABEL in sample.labels:
        return _NONE_READ
    names = sample.labels.get(UNREAD_LABEL)
    if not names:
        return _ALL_READ
    return frozenset(field for name in names.split(",") for field in _UNREAD_FIELDS.get(name.strip(), ()))


def counter_increments(values: Sequence[int]) -> list[int]:
    """How much a cumulative counter grew at each of its readings (oldest first; 0 at the first).

    Counters go down for two reasons that are no sign of decay, and neither may read as
    growth. A reading that dips and comes back (a field left out and decoded as 0, a garbage
    value) is skipped: only growth above the highest reading so far counts. A reading that
    jumps and comes back (a garbage value above the count) counts only as far as the
    readings after it allow: a counter that never goes down cannot have read more than a
    later reading that is still at or above where it rose from. A counter that
    restarted from zero (a driver reload, a collector restart) and never comes back up to
    its old high within the readings counts again from where it restarted; one that does
    come back counts only past its old high (an undercount, never a false alarm). The window
    starts from the median of its first three readings, so that one bad oldest reading does
    not become the baseline that everything after it grows from. The newest reading has no
    reading after it: a jump there counts until the next reading says otherwise.
    """
    if len(values) < 2:
        return [0] * len(values)
    if all(map(operator.le, values, values[1:])):
        # Never down (the common case): the median of the first three is the second.
        start = 1 if len(values) >= 3 else 0
        return [0] * (start + 1) + [b - a if b - a < _MAX_GROWTH else _MAX_GROWTH
                                    for a, b in zip(values[start:], values[start + 1:], strict=False)]
    grown = [0] * len(values)
    high = sorted(values[:3])[1] if len(values) >= 3 else values[0]
    later_high = list(values)
    for i in range(len(values) - 2, -1, -1):
        later_high[i] = max(values[i], later_high[i + 1])
    later = sorted(values[1:])  # the readings after the current one, in order of value
    for i in range(1, len(values)):
        value = values[i]
        del later[bisect.bisect_left(later, value)]
        if value > high:
            # The lowest later reading at or above where it rose from bounds the rise: one
            # jump that comes back is no growth, however high it read.
            bound = bisect.bisect_left(later, high)
            if bound < len(later) and later[bound] < value:
                value = later[bound]
        if value > high:
            grown[i] = min(value - high, _MAX_GROWTH)
            high = value
        elif value < high and later_high[i] < high:
            high = value  # restarted from zero: count from here
    return grown


def _growth(values: Sequence[int]) -> int:
    """The sum of :func:`counter_increments`, capped at ``_MAX_GROWTH``."""
    if len(values) >= 3 and all(map(operator.le, values, values[1:])):
        return min(values[-1] - values[1], _MAX_GROWTH)  # never down: from the median of the first three
    return min(sum(counter_increments(values)), _MAX_GROWTH)


def theil_sen_slope(x: np.ndarray, y: np.ndarray) -> float:
    """The median of the slopes between every two points with distinct ``x`` (Theil-Sen),
    of at most :data:`SLOPE_READINGS` points spread evenly over the series.

    The thermal trend is taken this way rather than by least squares because samples are not
    evenly spread: after a gap in reporting one reading has the leverage of half the window,
    and a least-squares line through it reads one warm reading as a climb of 15 °C/h. The
    median moves only once some 30% of the readings agree on a climb (its breakdown point).
    """
    if len(x) > SLOPE_READINGS:
        # Quadratic in the readings: an executor's 240-sample windows of a thousand GPUs held
        # its event loop a second a minute. Readings spread evenly over the window say the
        # same trend.
        keep = np.linspace(0, len(x) - 1, SLOPE_READINGS).round().astype(int)
        x, y = x[keep], y[keep]
    dx = np.subtract.outer(x, x)
    later = dx > 0  # each pair once, whichever way round it was sampled
    if not later.any():
        return 0.0
    return float(np.median(np.subtract.outer(y, y)[later] / dx[later]))


def features_of(window: Sequence[GpuSample], *, temp_threshold_c: float = 85.0) -> HealthFeatures:
    """Features of one GPU's samples (any order; sorted by time here). A field its collector
    names as unread (``nvml_unsupported``) is left out of that sample; counters that go down
    are handled as :func:`counter_increments` says."""
    if not window:
        return HealthFeatures()
    samples = sorted(window, key=lambda s: s.at)
    unread = [_unread(s) for s in samples]
    first, last = samples[0], samples[-1]
    span_h = max((last.at - first.at) / 3600.0, MIN_RATE_SPAN_H)

    all_read = not any(unread)

    def values(field: str) -> list[int]:
        if all_read:
            return list(map(operator.attrgetter(field), samples))
        return [getattr(s, field) for s, missing in zip(samples, unread, strict=True) if field not in missing]

    def growth(field: str) -> int:
        return _growth(values(field))

    def latest(field: str) -> int:
        for sample, missing in zip(reversed(samples), reversed(unread), strict=True):
            if field not in missing:
                return getattr(sample, field)
        return 0

    xid = 0.0
    if any(s.xid_codes for s in samples):
        # Counted code by code: a double-bit error and the cleanups of the contexts it killed,
        # in one interval, are scored as both, not as the last code (a cleanup, weighing nothing).
        codes = sorted(set().union(*(s.xid_codes for s in samples if s.xid_codes)))
        for code in codes:
            counts = [s.xid_codes.get(code, 0) if s.xid_codes else 0 for s in samples]
            xid += sum(min(new, 1000) for new in counter_increments(counts) if new > 0) * xid_severity(code)
    else:
        for sample, new in zip(samples, counter_increments(values("xid_count")), strict=True):
            if new > 0:
                # Only the last code of an interval is known: every event in it is scored as that code.
                xid += min(new, 1000) * xid_severity(sample.xid_last)
    remap_new = growth("retired_pages") + growth("remapped_rows")
    remap_so_far = max(latest("retired_pages"), 0) + max(latest("remapped_rows"), 0)
    # A width of 0 is a failed read, not a link trained down to nothing (a GPU that lost its
    # link falls off the bus: XID 79); a width above the maximum is not a negative down-training.
    widths = [min(s.pcie_link_width / s.pcie_link_width_max, 1.0)
              for s, missing in zip(samples, unread, strict=True)
              if "pcie_link_width" not in missing and s.pcie_link_width > 0 and s.pcie_link_width_max > 0]
    temps = samples if all_read else [s for s, missing in zip(samples, unread, strict=True)
                                      if "temperature_c" not in missing]
    at = np.fromiter(map(operator.attrgetter("at"), temps), dtype=np.float64, count=len(temps)) / 3600.0
    temp = np.fromiter(map(operator.attrgetter("temperature_c"), temps), dtype=np.float64, count=len(temps))
    finite = np.isfinite(temp)
    if not finite.all():
        # A temperature that is no number says nothing (as one NVML could not read); kept,
        # a NaN made the risk NaN, below every threshold however else the GPU decayed.
        at, temp = at[finite], temp[finite]
    # Over a short span sensor noise dominates the slope (1 °C of noise over 10 minutes reads
    # as 6 °C/h), so the trend counts only once the window covers MIN_SLOPE_SPAN_H.
    enough = len(temp) >= 3 and float(np.ptp(at)) >= MIN_SLOPE_SPAN_H
    slope = theil_sen_slope(at, temp) if enough else 0.0
    hot = 0.0  # one reading speaks for no stretch of time
    if len(temp) >= 2:
        # A reading speaks for the time since the one before it, but for no longer than the
        # window's usual sampling period: a gap (a collector restart) is time nobody saw, and
        # one hot reading after it is not an hour and a half spent hot. The share is of at
        # least MIN_RATE_SPAN_H, as the rates are: two minutes of a window two minutes long
        # (an executor restarted during a transient) is not a GPU that runs hot.
        dt = np.diff(at)
        # The usual period is that between distinct readings: with each reading delivered
        # twice, half the gaps are 0, their median was 0, and no time was ever spent hot.
        apart = dt[dt > 0]
        dt = np.minimum(dt, float(np.median(apart)) if apart.size else 0.0)
        hot = float(np.sum(dt[temp[1:] > temp_threshold_c]) / max(float(np.sum(dt)), MIN_RATE_SPAN_H))
    latest_temp = float(temp[-1]) if len(temp) else 0.0
    return HealthFeatures(
        xid=min(xid, 5.0),
        ecc_corrected=math.log1p(growth("ecc_corrected") / span_h),
        ecc_uncorrected=float(min(growth("ecc_uncorrected"), 5)),
        remap=math.log1p(remap_new),
        remap_level=min(remap_so_far, REMAP_CAPACITY) / REMAP_CAPACITY,
        pcie_replays=math.log1p(growth("pcie_replays") / span_h),
        link_downtrain=1.0 - min(widths) if widths else 0.0,
        thermal_slope=max(slope, 0.0) / 5.0,
        hot_fraction=hot,
        overheat=min(max(latest_temp - temp_threshold_c, 0.0) / 5.0, 2.0),
    )


class HealthModel(msgspec.Struct, frozen=True, kw_only=True):
    """The logistic health model: weights, the maintenance threshold, the thermal limit."""

    weights: LogisticWeights = msgspec.field(default_factory=LogisticWeights)
    threshold: float = MAINTENANCE_THRESHOLD
    temp_threshold_c: float = 85.0

    def contributions(self, features: HealthFeatures) -> dict[str, float]:
        """Each feature's share of the log-odds (weight x value), for explanations."""
        return {f: getattr(self.weights, f) * getattr(features, f) for f in HealthFeatures.__struct_fields__}

    def probability(self, features: HealthFeatures) -> float:
        """The failure risk in 0..1: the logistic of bias plus contributions."""
        z = self.weights.bias + sum(self.contributions(features).values())
        # exp() of a large positive argument overflows; take it only of a non-positive one.
        if z >= 0:
            return 1.0 / (1.0 + math.exp(-z))
        odds = math.exp(z)
        return odds / (1.0 + odds)

    def assess(self, window: Sequence[GpuSample]) -> HealthAssessment:
        """Assess one GPU from its window; the latest sample names the GPU and its tasks."""
        if not window:
            raise ValueError("cannot assess an empty window")
        latest = max(window, key=lambda s: s.at)
        features = features_of(window, temp_threshold_c=self.temp_threshold_c)
        probability = self.probability(features)
        pending = probability >= self.threshold
        tasks: list[str] = []
        if pending:
            # A GPU about to fail often can no longer be read at all (XID 79, off the bus):
            # its tasks are those of the newest sample whose processes were read.
            read = [s for s in window if "processes" not in _unread(s)]
            running = max(read, key=lambda s: s.at) if read else latest
            tasks = sorted({p.task_id for p in running.processes if p.task_id})
        return HealthAssessment(
            node=latest.node,
            gpu=latest.gpu,
            uuid=latest.uuid,
            at=latest.at,
            failure_probability=probability,
            maintenance_pending=pending,
            features=features,
            contributions=self.contributions(features),
            tasks_to_migrate=tasks,
        )

    def assess_fleet(self, windows: Mapping[str, Sequence[GpuSample]]) -> list[HealthAssessment]:
        """Assess every GPU (windows keyed by GPU uuid), riskiest first."""
        out = [self.assess(w) for w in windows.values() if w]
        return sorted(out, key=lambda a: (-a.failure_probability, a.node, a.gpu))


def migration_plan(assessments: Iterable[HealthAssessment]) -> list[MigrationRequest]:
    """The tasks to move off GPUs pending maintenance, riskiest GPU first."""
    plan = []
    for a in sorted(assessments, key=lambda a: -a.failure_probability):
        if not a.maintenance_pending:
            continue
        top = max(a.contributions, key=lambda k: a.contributions[k])
        for task_id in a.tasks_to_migrate:
            plan.append(
                MigrationRequest(
                    task_id=task_id,
                    node=a.node,
                    gpu=a.gpu,
                    failure_probability=a.failure_probability,
                    reason=f"maintenance_pending (p={a.failure_probability:.2f}, mostly {top})",
                )
            )
    return plan
