"""What the SLA negotiator knows about the fleet: free capacity, queues, links, prices.

A :class:`FleetView` is a snapshot the sla service assembles from the ledger, telemetry and
topology; the negotiator only reads it, so one snapshot gives one answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuPool:
    """The GPUs of one model at one site, as capacity the negotiator can promise.

    ``reserved_gpus`` of the ``free_gpus`` are held back for guaranteed tiers (vip and
    standard): best_effort requests never see them. ``preemptible_gpus`` are busy running
    best_effort work that a vip request may preempt. ``completions`` lists running tasks'
    expected completions as ``(seconds from now, GPUs freed)``. ``free_milli`` is spare
    compute on GPUs already shared, for fractional requests.
    """

    site: str
    gpu_model: str
    memory_mb_per_gpu: int
    price_per_gpu_hour: float
    free_gpus: int = 0
    free_milli: int = 0
    reserved_gpus: int = 0
    preemptible_gpus: int = 0
    completions: tuple[tuple[float, int], ...] = ()
    relative_compute: float = 1.0
    most_gpus_on_a_node: int | None = None
    """The most GPUs of the pool any one node has (a task's GPUs are all on one node);
    ``None`` when not known, and then no request is refused for its count."""
    most_clearable_on_a_node: int | None = None
    """The most GPUs one node of the pool has free or running only best_effort work: what a
    vip's preemption can clear for it on one node (a task's GPUs are all on one node);
    ``None`` when not known, and then the pool's ``free_gpus + preemptible_gpus``."""
    node_shapes: tuple[tuple[int, int, int], ...] = ()
    """``(GPUs, CPU milli, host memory MB)`` of the pool's nodes (``node_frontier``: those no
    other node outdoes in all three), in service or not: a task's GPUs, CPU and memory are
    all on one node. Empty when not known, and then only ``most_gpus_on_a_node`` is checked."""
    gaps: tuple[tuple[float, float], ...] = ()
    """``(from_s, until_s)`` spans, seconds from now, in which one GPU stands idle until a
    task waiting for it starts (``snapshot.play_queue``): a request whose run ends within
    one may start there, as the policy backfills it."""

    def holds(self, gpus: int, cpu_milli: int = 0, memory_mb: int = 0) -> bool:
        """Whether one node of the pool has ``gpus`` GPUs and the CPU and host memory asked
        besides: where none does, a task admitted to the pool would wait for ever."""
        if self.most_gpus_on_a_node is not None and self.most_gpus_on_a_node < gpus:
            return False
        return not self.node_shapes or any(g >= gpus and c >= cpu_milli and m >= memory_mb
                                           for g, c, m in self.node_shapes)


@dataclass(frozen=True)
class FleetView:
    """A snapshot of the fleet for negotiation.

    ``bandwidth_gbps[(data_site, site)]`` is the measured GB/s for moving a task's data to
    a site; unknown pairs use ``local_bandwidth_gbps`` within a site and
    ``default_bandwidth_gbps`` across sites. ``reference_p95_ms`` is the p95 latency of an
    inference task on a GPU of ``relative_compute`` 1.0 (a task may override it with the
    label ``p95_ref_ms``); a pool's estimate is that divided by its relative compute.
    """

    pools: tuple[GpuPool, ...]
    bandwidth_gbps: dict[tuple[str, str], float] = field(default_factory=dict)
    local_bandwidth_gbps: float = 5.0
    default_bandwidth_gbps: float = 1.0
    reference_p95_ms: float = 50.0

    def bandwidth(self, data_site: str | None, site: str) -> float:
        """GB/s from ``data_site`` to ``site`` (local when the data site is unknown)."""
        if data_site is None or data_site == site:
            return self.bandwidth_gbps.get((site, site), self.local_bandwidth_gbps)
        return self.bandwidth_gbps.get((data_site, site), self.default_bandwidth_gbps)


def earliest_in_windows(windows: Sequence[tuple[float, float]], need: int, hold_s: float,
                        before: float) -> tuple[float, list[int]] | None:
    """The earliest start before ``before`` at which ``need`` of ``windows`` (each ``(from_s,
    until_s)`` a GPU is idle) are all idle for ``hold_s`` seconds, and which (their indices,
    the tightest first: a window that closes soonest is of least use to anyone else);
    ``None`` when no start before ``before`` has that many."""
    for at in sorted({w[0] for w in windows if w[0] < before and w[1] - w[0] >= hold_s}):
        fitting = [i for i, (since, until) in enumerate(windows) if since <= at and until >= at + hold_s]
        if len(fitting) >= need:
            return at, sorted(fitting, key=lambda i: (windows[i][1], i))[:need]
    return None


def node_frontier(shapes: Iterable[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    """The ``(GPUs, CPU milli, host memory MB)`` node shapes no other outdoes in all three,
    sorted: what ``GpuPool.holds`` needs to know of a pool of thousands of nodes."""
    unique = sorted(set(shapes), reverse=True)
    kept: list[tuple[int, int, int]] = []
    for shape in unique:
        if not any(all(k >= v for k, v in zip(other, shape, strict=True)) for other in kept):
            kept.append(shape)
    return tuple(sorted(kept))
