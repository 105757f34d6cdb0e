"""Asking by the runs' spread when the GPUs that hold them are contended.

A program's runs do not all peak alike. Once enough of them are known, a task asks for the
smallest GPU that held all but a few of them (``fingerprint.fit_peak``), not for its mean
plus a margin. When GPUs of that size are contended, the wait for one is a cost too. A run
that starts now on a smaller GPU that most of its program's runs fitted waits for nothing,
unless it is one of the runs that go higher: then it dies of OOM, loses up to its whole run,
and waits for the bigger GPU after all. With ``q`` the share of the program's runs that a
GPU did not hold, ``W`` the recent wait for a GPU of the size the spread asks and ``D`` the
run's declared duration, the smaller GPU costs ``q * (D + W)`` and the bigger one ``W``, so the
smaller one is asked when ``q <= W / (W + D)`` (``risk_worth_taking``). With nothing waiting
the rule asks nothing smaller; with a wait as long as the run, up to half the runs may not
fit. The OOM events it risks are the price, paid only where a queue makes them worth it.

``RecentWaits`` keeps the waits of the latest starts on each GPU size: what a task asking for
that size can expect now, measured, not modelled. The policy service and the fleet
benchmark use the same two pieces.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

RECENT_STARTS = 20
"""How many of the latest starts on GPUs of one size tell the wait for that size."""


def miss_share(run_peaks_mb: Sequence[float], memory_mb: float) -> float:
    """The share of runs whose peak a GPU of ``memory_mb`` did not hold (0 with no runs)."""
    if not run_peaks_mb:
        return 0.0
    return sum(peak > memory_mb for peak in run_peaks_mb) / len(run_peaks_mb)


def risk_worth_taking(wait_s: float, run_s: float) -> float:
    """The most a run may risk not fitting a GPU it can start on now rather than wait
    ``wait_s`` for a bigger one: ``W / (W + D)`` with ``D`` its run (0 when nothing waits)."""
    if wait_s <= 0:
        return 0.0
    return wait_s / (wait_s + max(run_s, 0.0))


def smaller_ask_mb(sizes_mb: Iterable[float], run_peaks_mb: Sequence[float], landing_mb: float, wait_s: float,
                   run_s: float, *, at_least_mb: float = 0.0) -> float:
    """The smallest GPU size below ``landing_mb`` (the size the spread asks) whose share of
    runs not held is within what the wait makes worth risking, and at least ``at_least_mb``;
    0 when none is, or when the run's length is not known (nothing to weigh the risk by)."""
    share = risk_worth_taking(wait_s, run_s)
    if share <= 0 or run_s <= 0 or not run_peaks_mb:
        return 0.0
    for size in sorted(set(sizes_mb)):
        if size >= landing_mb:
            break
        if size >= at_least_mb and miss_share(run_peaks_mb, size) <= share:
            return size
    return 0.0


def spread_ask_mb(want_mb: float, sizes_mb: Sequence[float], fit_peak_mb: float, run_peaks_mb: Sequence[float],
                  waits: RecentWaits, run_s: float, *, at_least_mb: float = 0.0) -> float:
    """What a task whose program's runs are known asks per GPU, from ``want_mb`` (its
    predicted peak with a margin) and ``sizes_mb`` (the GPU sizes of the models it accepts):
    no more than the smallest size that held all but a few of the runs (``fit_peak_mb``,
    ``fingerprint.fit_peak``), never below ``at_least_mb``; and where GPUs of that size have
    kept their latest starts waiting (``waits``), the smaller one ``smaller_ask_mb`` finds
    worth the risk (none without ``run_peaks_mb``). ``want_mb`` itself until the spread is
    known. The policy service's request and the fleet benchmark both ask this."""
    if fit_peak_mb <= 0:
        return want_mb
    holding = min((size for size in sizes_mb if size >= fit_peak_mb), default=want_mb)
    want = min(want_mb, max(holding, at_least_mb))
    if run_peaks_mb:
        landing = min((size for size in sizes_mb if size >= want), default=0.0)
        want = smaller_ask_mb(sizes_mb, run_peaks_mb, landing, waits.for_at_least(landing), run_s,
                              at_least_mb=at_least_mb) or want
    return want


class RecentWaits:
    """How long the latest starts on GPUs of each size waited, to tell a task what waiting for
    a GPU of at least some size costs now."""

    def __init__(self, kept: int = RECENT_STARTS) -> None:
        """Keep the latest ``kept`` waits per GPU size."""
        self.kept = kept
        self._waits: dict[float, deque[float]] = {}

    def started(self, gpu_mb: float, waited_s: float) -> None:
        """A task started on a GPU of ``gpu_mb`` after waiting ``waited_s``."""
        self._waits.setdefault(float(gpu_mb), deque(maxlen=self.kept)).append(max(0.0, waited_s))

    def for_at_least(self, gpu_mb: float) -> float:
        """The mean wait of the latest starts on GPUs of ``gpu_mb`` or more (0 when none)."""
        waits = [w for size, kept in self._waits.items() if size >= gpu_mb for w in kept]
        return sum(waits) / len(waits) if waits else 0.0
