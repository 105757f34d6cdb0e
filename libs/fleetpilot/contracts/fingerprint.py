"""Fingerprint family: how a task grows its memory and what it will peak at."""

from __future__ import annotations

from typing import Literal

from .base import Event, Record

GrowthPattern = Literal["flat", "linear", "steps", "sawtooth", "leak", "unknown"]


class Fingerprint(Record, frozen=True, kw_only=True):
    """A task's behaviour, predicted from its memory series (or from its signature). Memory
    figures are per GPU: what each of a multi-GPU task's GPUs holds, as requests and holds are."""

    signature: str
    pattern: GrowthPattern
    pattern_confidence: float
    growth_rate_mb_per_s: float
    predicted_peak_mb: float
    peak_low_mb: float
    peak_high_mb: float
    time_to_peak_s: float | None = None
    warmup_s: float = 0.0
    burstiness: float = 0.0
    context_switch_sensitivity: float = 0.0
    samples: int = 0
    envelope_mb: tuple[float, ...] = ()
    """The most a run of the task's program held per GPU by each twentieth of the duration it
    declared (``fingerprint.envelope``), over the whole runs seen; empty when none was."""
    fit_peak_mb: float = 0.0
    """The least memory per GPU that held all but a small share (2.5%) of the program's known
    runs, a run killed by an OOM counted as one that needed more (``fingerprint.fit_peak``);
    0 until enough runs (20) are known. A policy may size a task's GPU by it rather than by
    its mean peak with a margin."""
    run_peaks_mb: tuple[float, ...] = ()
    """The peaks per GPU of the program's latest known runs (at most 200, in ascending order; a
    run killed by an OOM at its floor), from which ``fit_peak_mb`` is read; empty until 20
    are known. A policy may weigh the share of runs a smaller GPU did not hold against the
    wait for a bigger one (``policy.spread``)."""


class TaskFingerprinted(Event, frozen=True, kw_only=True, tag="task.fingerprinted.v1"):
    """A new or materially changed fingerprint for a task."""

    task_id: str
    fingerprint: Fingerprint
    source: Literal["observed", "signature"]
    """``observed``: fitted on this task's own samples. ``signature``: predicted for it from its
    signature, by what its program's ended runs taught or, while none has ended, by what a run
    of it in progress shows (``samples`` 0 either way: none of this task's own)."""
    at: float
