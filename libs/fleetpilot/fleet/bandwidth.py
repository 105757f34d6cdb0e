"""Network bandwidth: per-port rates from InfiniBand/RoCE counters, and effective
bandwidth between sites under multipath routing.

Per port: ``port_rates`` turns two ``IbPort`` snapshots (sysfs counters, read by
``nvml_reader.read_ib_ports``) into transmit/receive Gbit/s and utilisation.

Between sites, several links rarely add up. ``SiteNetwork`` models two strategies:

- ``min_rtt`` (the default MPTCP scheduler, and what most multipath stacks do): the
  lowest-RTT link is filled first and the others only take what overflows its window. We
  model it as the min-RTT link carrying ``MIN_RTT_SHARE`` = 90 % of the bytes and the
  other links the remaining 10 %, split by capacity. A transfer ends when its slowest
  share ends, so the effective rate is ``min(c_best / 0.9, c_rest / 0.1)`` — typically
  barely more than the best link alone.
- ``balanced`` (weighted ECMP / capacity-proportional striping): each link carries bytes
  in proportion to its capacity, all shares finish together, effective = sum of
  capacities.

Capacities can be reduced by measured use (``used_gbps`` per link name, e.g. from port
counters). Sites without any direct link are reached through the best single
intermediate site (bottleneck bandwidth, summed RTT, higher uncertainty). ``transfer_time_s`` adds one RTT of the path used
(the handshake) to ``size * 8 / effective``.
"""

from __future__ import annotations

import itertools
from typing import Literal

import msgspec

from fleetpilot.contracts.telemetry import NicPortRate
from fleetpilot.contracts.topology import BandwidthEstimate

from .inventory import SiteLink

Strategy = Literal["min_rtt", "balanced"]
STRATEGIES: tuple[Strategy, ...] = ("min_rtt", "balanced")
MIN_RTT_SHARE = 0.9
# How much to trust each model: the 90 % share is a rule of thumb, striping is predictable.
UNCERTAINTY: dict[Strategy, float] = {"min_rtt": 0.5, "balanced": 0.3}
RELAY_UNCERTAINTY = 0.2  # added when the path goes through another site


class IbPort(msgspec.Struct, frozen=True, kw_only=True):
    """One InfiniBand/RoCE port as sysfs shows it; byte counters already converted from
    words, ``None`` where a counter could not be read (not 0: that is a count)."""

    device: str
    port: int
    rate_gbps: float
    link_layer: Literal["InfiniBand", "Ethernet"]
    state: str
    xmit_bytes: int | None
    rcv_bytes: int | None


# A port's measured rates are published as they are computed: the wire record is the type.
PortRate = NicPortRate


def port_rates(before: list[IbPort], after: list[IbPort], dt_s: float) -> list[PortRate]:
    """Rates per port from two counter snapshots ``dt_s`` apart.

    A counter that went backwards (reset, or a driver reload) gives no rate (value 0,
    uncertainty 1) rather than a huge negative or wrapped one; so does one unread at either
    end (``None``): read as 0, the period after it counted the port's whole lifetime.
    """
    earlier = {(p.device, p.port): p for p in before}
    out = []
    for p in after:
        prev = earlier.get((p.device, p.port))
        if (prev is None or dt_s <= 0 or p.xmit_bytes is None or p.rcv_bytes is None or prev.xmit_bytes is None
                or prev.rcv_bytes is None or p.xmit_bytes < prev.xmit_bytes or p.rcv_bytes < prev.rcv_bytes):
            out.append(PortRate(device=p.device, port=p.port, tx_gbps=0.0, rx_gbps=0.0, utilisation=0.0,
                                uncertainty_score=1.0))
            continue
        tx = (p.xmit_bytes - prev.xmit_bytes) * 8 / dt_s / 1e9
        rx = (p.rcv_bytes - prev.rcv_bytes) * 8 / dt_s / 1e9
        util = max(tx, rx) / p.rate_gbps if p.rate_gbps > 0 else 0.0
        # Counters are exact; the residual doubt is the sampling interval's jitter.
        out.append(PortRate(device=p.device, port=p.port, tx_gbps=tx, rx_gbps=rx, utilisation=min(util, 1.0),
                            uncertainty_score=0.05))
    return out


def _combine(links: list[tuple[float, float]], strategy: Strategy) -> tuple[float, float]:
    """(effective Gbit/s, RTT ms of the path that starts the transfer) of parallel links."""
    usable = [(c, r) for c, r in links if c > 0]
    if not usable:
        return 0.0, 0.0
    best = min(usable, key=lambda cr: (cr[1], -cr[0]))
    if strategy == "balanced" or len(usable) == 1:
        total = sum(c for c, _ in usable) if strategy == "balanced" else best[0]
        return total, best[1] if strategy == "min_rtt" else max(r for _, r in usable)
    rest = sum(c for c, _ in usable) - best[0]
    return min(best[0] / MIN_RTT_SHARE, rest / (1.0 - MIN_RTT_SHARE)), best[1]


class SiteNetwork:
    """Effective bandwidth and transfer time between sites over ``SiteLink``s.

    ``used_gbps`` maps a link name to the bandwidth already in use on it (measured), which
    is taken off the link's capacity.
    """

    def __init__(self, links: list[SiteLink], used_gbps: dict[str, float] | None = None) -> None:
        self.links = list(links)
        self.used_gbps = dict(used_gbps or {})
        self.sites = sorted({s for link in self.links for s in (link.a, link.b)})

    def _direct(self, a: str, b: str) -> list[tuple[float, float]]:
        return [(max(link.rate_gbps - self.used_gbps.get(link.name, 0.0), 0.0), link.rtt_ms)
                for link in self.links if link.joins(a, b)]

    def path(self, a: str, b: str, strategy: Strategy) -> tuple[float, float, list[str]]:
        """(effective Gbit/s, RTT ms, sites on the path) for the best route from ``a`` to ``b``."""
        if a == b:
            return float("inf"), 0.0, [a]
        direct = self._direct(a, b)
        if direct:
            # Routing prefers the direct links; a relay is only the fallback when none exist.
            return (*_combine(direct, strategy), [a, b])
        best: tuple[float, float, list[str]] = (0.0, 0.0, [a, b])
        for via in self.sites:
            if via in (a, b):
                continue
            first, second = self._direct(a, via), self._direct(via, b)
            if not first or not second:
                continue
            (g1, r1), (g2, r2) = _combine(first, strategy), _combine(second, strategy)
            if min(g1, g2) > best[0]:
                best = (min(g1, g2), r1 + r2, [a, via, b])
        return best

    def estimate(self, a: str, b: str, strategy: Strategy) -> BandwidthEstimate:
        """The effective bandwidth between two sites as a contract record."""
        gbps, _, hops = self.path(a, b, strategy)
        doubt = UNCERTAINTY[strategy] + (RELAY_UNCERTAINTY if len(hops) > 2 else 0.0)
        return BandwidthEstimate(a_site=a, b_site=b, strategy=strategy,
                                 effective_gbps=round(gbps, 3) if gbps != float("inf") else 0.0,
                                 uncertainty_score=min(doubt if gbps > 0 else 1.0, 1.0))

    def estimates(self) -> list[BandwidthEstimate]:
        """Every site pair under every strategy (for ``topology.updated``)."""
        return [self.estimate(a, b, s) for a, b in itertools.combinations(self.sites, 2) for s in STRATEGIES]

    def transfer_time_s(self, size_gb: float, a_site: str, b_site: str, strategy: Strategy = "min_rtt") -> float:
        """Seconds to move ``size_gb`` gigabytes from ``a_site`` to ``b_site`` (inf when unreachable)."""
        gbps, rtt_ms, _ = self.path(a_site, b_site, strategy)
        if a_site == b_site:
            return 0.0
        if gbps <= 0:
            return float("inf")
        return size_gb * 8.0 / gbps + rtt_ms / 1000.0
