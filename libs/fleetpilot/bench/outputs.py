"""Output paths of a benchmark, checked before it runs: a typo in ``--json`` must not cost
the result of a run of several minutes."""

from __future__ import annotations

import os
from pathlib import Path


def check_writable(prog: str, files: tuple[Path | None, ...] = (), dirs: tuple[Path | None, ...] = ()) -> None:
    """Create the folders ``files`` go in and ``dirs`` themselves, and check that each file
    can be written; raise ``SystemExit`` with one line naming the first that cannot."""
    for path in (p for p in files if p is not None):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"{prog}: cannot write {path}: {exc.strerror or exc}") from None
        if path.is_dir() or not os.access(path if path.exists() else path.parent, os.W_OK):
            raise SystemExit(f"{prog}: cannot write {path}")
    for folder in (d for d in dirs if d is not None):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"{prog}: cannot write to {folder}: {exc.strerror or exc}") from None
