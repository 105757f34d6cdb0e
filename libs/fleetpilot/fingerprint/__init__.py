"""Task fingerprints: memory-growth pattern, predicted peak with uncertainty, warm-up, behaviour.

Offline: :func:`fingerprint_series` / :func:`analyse_series` on a whole series.
Online: :class:`OnlineFingerprinter` with :func:`changed_materially`.
Memory across runs: :func:`task_signature` and :class:`SignatureMemory` (peaks, patterns, OOM
floors, how far runs spread: :func:`fit_peak`, and how runs come back from a checkpoint:
:func:`merge_restore`).
CLI: :func:`fingerprint_csv` behind ``fleetpilot fingerprint SERIES.csv --at 0.25``.
"""

from .analysis import (
    LevelPrior,
    SeriesAnalysis,
    analyse_series,
    burstiness,
    context_switch_sensitivity,
    fingerprint_series,
)
from .envelope import ENVELOPE_POINTS, envelope_at, merge_envelopes, run_envelope
from .online import (
    MAX_HELD_SAMPLES,
    TRUST_CONFIDENCE,
    TRUST_SAMPLES,
    OnlineFingerprinter,
    changed_materially,
    trusted,
)
from .series_csv import fingerprint_csv, parse_series_csv
from .signature import (
    FIT_MIN_RUNS,
    FIT_MISS_SHARE,
    LEARNT_RUNS_KEPT,
    MODEL_LABEL,
    RESTORE_KEPT_SHARE,
    RUN_PEAKS_KEPT,
    SignatureMemory,
    SignatureStats,
    borrowed,
    fit_peak,
    keep_signature_knowledge,
    known_run_peaks,
    learnt,
    load_stats,
    mark_learnt,
    merge,
    merge_oom,
    merge_restore,
    merge_run_peak,
    predict,
    prediction_changed,
    predicts_nothing,
    restore_tells,
    restores_start_over,
    run_key,
    stored_stats,
    task_signature,
)

__all__ = [
    "ENVELOPE_POINTS",
    "LevelPrior",
    "FIT_MIN_RUNS",
    "FIT_MISS_SHARE",
    "LEARNT_RUNS_KEPT",
    "MAX_HELD_SAMPLES",
    "MODEL_LABEL",
    "RESTORE_KEPT_SHARE",
    "RUN_PEAKS_KEPT",
    "OnlineFingerprinter",
    "SeriesAnalysis",
    "SignatureMemory",
    "SignatureStats",
    "borrowed",
    "TRUST_CONFIDENCE",
    "TRUST_SAMPLES",
    "analyse_series",
    "burstiness",
    "changed_materially",
    "context_switch_sensitivity",
    "envelope_at",
    "fingerprint_csv",
    "fingerprint_series",
    "fit_peak",
    "known_run_peaks",
    "learnt",
    "mark_learnt",
    "keep_signature_knowledge",
    "load_stats",
    "merge",
    "merge_envelopes",
    "merge_oom",
    "merge_restore",
    "merge_run_peak",
    "parse_series_csv",
    "predict",
    "prediction_changed",
    "predicts_nothing",
    "restore_tells",
    "run_envelope",
    "run_key",
    "stored_stats",
    "restores_start_over",
    "task_signature",
    "trusted",
]
