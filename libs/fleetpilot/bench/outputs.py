"""What a benchmark writes: its output paths, checked before it runs (a typo in ``--json``
must not cost the result of a run of several minutes), and the digest of the code it
measured (``code_digest``) and the machine it ran on (``run_environment``), so that a figure
can be traced to what produced it."""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
"""The ``fleetpilot`` package this module was loaded from."""
CODE_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".csv", ".txt")
"""What can change a figure: the source and the data files it reads (not the docs)."""


def code_digest(package: Path = PACKAGE) -> str:
    """A short digest of ``package``'s code: every source and data file outside ``tests``, by
    path and content. Two runs with the same digest ran the same code, whether from a
    checkout, a snapshot of one, or an install; a working tree's uncommitted change shows."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package)
        if path.suffix not in CODE_SUFFIXES or "tests" in rel.parts or "__pycache__" in rel.parts:
            continue
        digest.update(rel.as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


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


def run_environment() -> dict[str, str]:
    """The machine and libraries a run measured on, so that a figure names both: the same code
    measured differently on two machines until its fits and pressures stopped going through
    OpenBLAS, whose kernels the CPU chooses (the fleet benchmark's log)."""
    import numpy

    cpu, flags = platform.processor() or platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        info = []  # not Linux: the platform's own name stands
    for line in info:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            cpu = value.strip()
        elif key.strip() == "flags" and not flags:
            # Which instruction sets the maths libraries may pick: a short digest of them.
            flags = hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:8]
    return {"python": platform.python_version(), "numpy": numpy.__version__, "machine": platform.machine(),
            "cpu": cpu, "cpu_flags": flags}


def describe_environment(env: dict[str, str]) -> str:
    """``run_environment``'s record in a few words (empty for a run that kept none)."""
    if not env:
        return ""
    flags = f" [{env['cpu_flags']}]" if env.get("cpu_flags") else ""
    return f"{env.get('cpu', '?')}{flags}, python {env.get('python', '?')}, numpy {env.get('numpy', '?')}"
