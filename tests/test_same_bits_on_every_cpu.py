"""A fingerprint and a placement must not depend on the CPU they were computed on.

numpy hands ``@``, ``lstsq``, ``pinv`` and ``polyfit`` to OpenBLAS, whose kernels, chosen by
the CPU, add in different orders; the fleet benchmark measured openb seed 201's mean queue
at −70% with one kernel and −65% with another. ``OPENBLAS_CORETYPE`` makes OpenBLAS take the
kernel of an older CPU, so one machine can play several: the probe must print the same
bytes under each kernel this CPU can run.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

PROBE = Path(__file__).with_name("blas_kernel_probe.py")


def _kernels() -> list[str]:
    """OpenBLAS kernels this CPU can run: the SSE3 one always, then AVX2's and AVX-512's."""
    flags = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return ["Prescott"] + (["Haswell"] if "avx2" in flags else []) + (["SkylakeX"] if "avx512f" in flags else [])


def _uses_openblas() -> bool:
    blas = np.__config__.CONFIG.get("Build Dependencies", {}).get("blas", {})
    return "openblas" in str(blas.get("name", "")).lower()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not _uses_openblas(),
                    reason="OPENBLAS_CORETYPE names x86-64 kernels of an OpenBLAS numpy")
def test_fits_and_pressures_are_the_same_under_every_openblas_kernel():
    kernels = _kernels()
    if len(kernels) < 2:
        pytest.skip("this CPU runs one OpenBLAS kernel only")
    printed = {}
    for kernel in kernels:
        env = {**os.environ, "OPENBLAS_CORETYPE": kernel}
        done = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=120,
                              check=False)
        assert done.returncode == 0, done.stderr
        printed[kernel] = done.stdout.split()
    first, *others = kernels
    assert len(printed[first]) > 600
    for kernel in others:
        differ = [i for i, (a, b) in enumerate(zip(printed[first], printed[kernel], strict=True)) if a != b]
        assert not differ, f"{kernel} differs from {first} at {len(differ)} values, first at {differ[:5]}"
