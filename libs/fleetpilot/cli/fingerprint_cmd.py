"""``fleetpilot fingerprint SERIES.csv --at 0.25``: fingerprint a memory series as JSON.

The CSV holds ``timestamp_s,used_bytes`` rows of one task: seconds and bytes, not MB (see
``fleetpilot.fingerprint.series_csv``).
Only the first ``--at`` fraction of the series is shown to the fingerprinter, as if the task
had been running that long; the rest is the ground truth the prediction is scored against.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np

from fleetpilot.fingerprint.series_csv import fingerprint_csv

from .arguments import path_text


def add_arguments(parser) -> None:
    """Flags of ``fleetpilot fingerprint``."""
    parser.add_argument("series", type=path_text, help="CSV of one task's memory over time: timestamp_s,used_bytes per line "
                                       "(seconds and bytes; a header line is optional)")
    parser.add_argument("--at", type=float, default=0.25,
                        help="fraction of the series the fingerprinter sees, in (0, 1] (default 0.25)")


def main(args, out=None) -> int:
    """Fingerprint and print the result as indented JSON."""
    out = out or sys.stdout
    if not 0.0 < args.at <= 1.0:
        raise ValueError(f"--at must be in (0, 1], got {args.at:g}")
    path = Path(args.series)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory")
    try:
        # Memory values near float's limit (1e300 bytes: a unit mixed up) overflow the fits:
        # numpy's RuntimeWarnings went to stderr and NaN into the JSON, which no parser reads.
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            result = fingerprint_csv(path, at=args.at)
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    try:
        text = json.dumps(result, indent=2, default=float, allow_nan=False)
    except ValueError:
        raise ValueError(f"{path}: memory values too large to fingerprint (the fit is not finite); "
                         "expected bytes") from None
    print(text, file=out)
    return 0
