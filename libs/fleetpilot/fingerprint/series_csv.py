"""Reading a memory series from CSV, and the fingerprint behind ``fleetpilot fingerprint``.

The CSV has two columns, timestamp in seconds and used memory in bytes, one sample per
line; a header line is optional, blank lines and ``#`` comments are skipped. Memory is
converted to MB of 2^20 bytes (what NVML and ``nvidia-smi`` call MiB).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .analysis import analyse_series

BYTES_PER_MB = 1024 * 1024


def parse_series_csv(text: str) -> tuple[np.ndarray, np.ndarray]:
    """``(seconds since the first sample, used MB)`` from CSV text.

    Raises ``ValueError`` with a one-line message naming the line for a row that is not
    two numbers, a negative or non-finite value, or a timestamp that goes backwards. A
    leading byte order mark is skipped.
    """
    times: list[float] = []
    used: list[float] = []
    seen_data = False
    # A spreadsheet's "CSV UTF-8" starts with a byte order mark, which no number parses.
    for number, raw in enumerate(text.removeprefix("\ufeff").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        cells = [c.strip() for c in line.split(",")]
        try:
            if len(cells) != 2:
                raise ValueError
            ts, used_bytes = float(cells[0]), float(cells[1])
        except ValueError:
            if not seen_data and not times and _looks_like_header(cells):
                seen_data = True
                continue
            raise ValueError(f"line {number}: expected 'timestamp_s,used_bytes', got {line[:60]!r}") from None
        seen_data = True
        if not (math.isfinite(ts) and math.isfinite(used_bytes)) or used_bytes < 0:
            raise ValueError(f"line {number}: values must be finite and memory non-negative, got {line[:60]!r}")
        if times and ts < times[-1]:
            raise ValueError(f"line {number}: timestamp {ts:g} goes back before {times[-1]:g}")
        times.append(ts)
        used.append(used_bytes / BYTES_PER_MB)
    if not times:
        raise ValueError("no samples: expected lines of 'timestamp_s,used_bytes'")
    t = np.asarray(times)
    return t - t[0], np.asarray(used)


def _looks_like_header(cells: list[str]) -> bool:
    """A header has no numeric cell at all (``timestamp,used_bytes``)."""
    def numeric(cell: str) -> bool:
        try:
            float(cell)
        except ValueError:
            return False
        return True

    return not any(numeric(c) for c in cells)


def fingerprint_csv(path_or_text: str | Path, at: float = 0.25) -> dict[str, object]:
    """Fingerprint the first ``at`` of a CSV series, taking its full length as the task's life.

    ``path_or_text`` is a path to a CSV file or the CSV text itself (anything containing a
    newline or a comma is taken as text). Returns a plain dict for the CLI to print: the
    fingerprint's fields, the life and cut-off used, the naive "peak so far" baseline and,
    since the whole series is known, the actual peak and both errors. Raises ``ValueError``
    (one line) for a file that cannot be read as a series or values too large to fit.
    """
    if not 0.0 < at <= 1.0:
        raise ValueError(f"--at must be in (0, 1], got {at}")
    text = str(path_or_text)
    if isinstance(path_or_text, Path) or ("\n" not in text and "," not in text):
        text = Path(path_or_text).read_text()
    t, mb = parse_series_csv(text)
    life = float(t[-1])
    cut = at * life
    mask = t <= cut + 1e-9
    try:
        analysis = analyse_series(t[mask], mb[mask], expected_duration_s=life if life > 0 else None)
    except (OverflowError, FloatingPointError):
        # Values near float's limit (a unit mixed up) overflow the fits' sums.
        raise ValueError("values too large to fingerprint (the fit overflows); expected seconds and bytes") from None
    fp = analysis.fingerprint
    actual = float(mb.max())
    so_far = float(mb[mask].max())
    return {
        "samples_total": int(t.size),
        "samples_used": int(mask.sum()),
        "life_s": life,
        "at": at,
        "cutoff_s": cut,
        "pattern": fp.pattern,
        "pattern_confidence": fp.pattern_confidence,
        "growth_rate_mb_per_s": fp.growth_rate_mb_per_s,
        "predicted_peak_mb": fp.predicted_peak_mb,
        "peak_low_mb": fp.peak_low_mb,
        "peak_high_mb": fp.peak_high_mb,
        "time_to_peak_s": fp.time_to_peak_s,
        "warmup_s": fp.warmup_s,
        "peak_so_far_mb": so_far,
        "actual_peak_mb": actual,
        "error_mb": fp.predicted_peak_mb - actual,
        "baseline_error_mb": so_far - actual,
        "notes": list(analysis.notes),
    }
