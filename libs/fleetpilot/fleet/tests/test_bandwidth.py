"""Port-counter rates and multipath-aware bandwidth between sites."""

from __future__ import annotations

import pytest
from fleetpilot.fleet.bandwidth import MIN_RTT_SHARE, IbPort, SiteNetwork, port_rates
from fleetpilot.fleet.inventory import SiteLink, load_fleet_spec


def port(xmit: int, rcv: int, rate: float = 200.0) -> IbPort:
    return IbPort(device="mlx5_0", port=1, rate_gbps=rate, link_layer="InfiniBand", state="ACTIVE",
                  xmit_bytes=xmit, rcv_bytes=rcv)


@pytest.mark.parametrize(("before", "after", "dt", "tx", "rx", "util", "doubt"), [
    (port(0, 0), port(25 * 10**9, 5 * 10**9), 2.0, 100.0, 20.0, 0.5, 0.05),
    (port(0, 0), port(0, 0), 1.0, 0.0, 0.0, 0.0, 0.05),
    (port(10**9, 0), port(0, 0), 1.0, 0.0, 0.0, 0.0, 1.0),       # counter reset: no rate
    (port(0, 0), port(10**9, 0), 0.0, 0.0, 0.0, 0.0, 1.0),       # no interval: no rate
])
def test_port_rates(before: IbPort, after: IbPort, dt: float, tx: float, rx: float, util: float, doubt: float) -> None:
    (rate,) = port_rates([before], [after], dt)
    assert rate.tx_gbps == pytest.approx(tx) and rate.rx_gbps == pytest.approx(rx)
    assert rate.utilisation == pytest.approx(util) and rate.uncertainty_score == doubt


LINKS = [
    SiteLink(a="a", b="b", rate_gbps=100, rtt_ms=10, name="fast"),
    SiteLink(a="a", b="b", rate_gbps=100, rtt_ms=30, name="slow"),
    SiteLink(a="b", b="c", rate_gbps=40, rtt_ms=5, name="bc"),
]


@pytest.mark.parametrize(("a", "b", "strategy", "gbps"), [
    ("a", "b", "balanced", 200.0),                        # striping by capacity adds up
    ("a", "b", "min_rtt", 100.0 / MIN_RTT_SHARE),         # min-RTT path carries 90 %: barely more than one link
    ("b", "c", "min_rtt", 40.0),                          # a single link is itself
    ("a", "c", "balanced", 40.0),                         # relay through b: bottleneck b-c
])
def test_effective_bandwidth_per_strategy(a: str, b: str, strategy: str, gbps: float) -> None:
    est = SiteNetwork(LINKS).estimate(a, b, strategy)  # type: ignore[arg-type]
    assert est.effective_gbps == pytest.approx(gbps, rel=1e-3)
    assert 0 < est.uncertainty_score <= 1


def test_min_rtt_is_limited_by_the_overflow_links_too() -> None:
    # 10 % of the bytes on a 1 Gbit/s side path take longer than 90 % on the main one.
    net = SiteNetwork([SiteLink(a="a", b="b", rate_gbps=100, rtt_ms=5), SiteLink(a="a", b="b", rate_gbps=1, rtt_ms=50)])
    assert net.estimate("a", "b", "min_rtt").effective_gbps == pytest.approx(10.0)


def test_measured_use_reduces_capacity() -> None:
    net = SiteNetwork(LINKS, used_gbps={"fast": 60.0})
    assert net.estimate("a", "b", "balanced").effective_gbps == pytest.approx(140.0)


def test_transfer_time_includes_one_rtt() -> None:
    net = SiteNetwork(LINKS)
    assert net.transfer_time_s(100, "a", "b", "balanced") == pytest.approx(800 / 200 + 0.030)
    assert net.transfer_time_s(100, "a", "b", "min_rtt") == pytest.approx(800 / (100 / 0.9) + 0.010)
    assert net.transfer_time_s(1, "a", "a") == 0.0
    assert net.transfer_time_s(1, "a", "zzz") == float("inf")
    assert net.estimate("a", "zzz", "min_rtt").uncertainty_score == 1.0


def test_three_site_estimates_cover_every_pair_and_strategy() -> None:
    net = SiteNetwork(load_fleet_spec().links)
    estimates = net.estimates()
    assert len(estimates) == 3 * 2
    ab = {e.strategy: e.effective_gbps for e in estimates if {e.a_site, e.b_site} == {"site-a", "site-b"}}
    assert ab["balanced"] == pytest.approx(240.0) and ab["min_rtt"] < ab["balanced"] / 2
