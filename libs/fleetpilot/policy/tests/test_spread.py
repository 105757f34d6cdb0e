"""Asking by the runs' spread when the GPUs that hold them are contended: the share of runs a
smaller GPU did not hold, weighed against the recent wait for the GPU the spread asks."""

from __future__ import annotations

import pytest
from fleetpilot.policy.spread import RecentWaits, miss_share, risk_worth_taking, smaller_ask_mb

G2, G3 = 32_768.0, 81_920.0
# 20 runs of a program that straddles a 32 GB GPU: 3 of them (15%) went above it.
STRADDLING = tuple([30_000.0] * 17 + [33_500.0] * 3)


def test_the_share_of_runs_a_gpu_did_not_hold() -> None:
    assert miss_share(STRADDLING, G2) == pytest.approx(0.15)
    assert miss_share(STRADDLING, G3) == 0.0 and miss_share((), G2) == 0.0
    assert miss_share((32_768.0,), G2) == 0.0  # a run that exactly filled it fitted


def test_the_risk_worth_taking_grows_with_the_wait_against_the_run() -> None:
    assert risk_worth_taking(0.0, 3600.0) == 0.0  # nothing waits: no risk is worth it
    assert risk_worth_taking(3600.0, 3600.0) == pytest.approx(0.5)  # a wait as long as the run
    assert risk_worth_taking(600.0, 5400.0) == pytest.approx(0.1)


def test_a_smaller_gpu_is_asked_only_when_the_wait_makes_its_risk_worth_taking() -> None:
    sizes = (16_384.0, G2, G3)
    # 15% of runs did not fit the G2: worth it against a 20-minute wait for an hour's run (25%),
    # not against a 5-minute one (about 7.7%).
    assert smaller_ask_mb(sizes, STRADDLING, G3, wait_s=1200.0, run_s=3600.0) == G2
    assert smaller_ask_mb(sizes, STRADDLING, G3, wait_s=300.0, run_s=3600.0) == 0.0
    assert smaller_ask_mb(sizes, STRADDLING, G3, wait_s=0.0, run_s=3600.0) == 0.0
    # Never below what it must hold (a checkpointed run's last hold), never at or above the
    # size the spread asks, and not for a run whose length nobody knows.
    assert smaller_ask_mb(sizes, STRADDLING, G3, wait_s=1200.0, run_s=3600.0, at_least_mb=40_000.0) == 0.0
    assert smaller_ask_mb(sizes, STRADDLING, G2, wait_s=99_999.0, run_s=3600.0) == 0.0
    assert smaller_ask_mb(sizes, STRADDLING, G3, wait_s=1200.0, run_s=0.0) == 0.0
    # The smallest size within the risk: the 16 GB GPU held none of these runs.
    assert smaller_ask_mb(sizes, STRADDLING, G3, wait_s=10 * 3600.0, run_s=3600.0) == G2


def test_recent_waits_tell_the_wait_for_a_gpu_of_at_least_a_size() -> None:
    waits = RecentWaits(kept=3)
    assert waits.for_at_least(G3) == 0.0  # nothing started yet: nothing known to wait for
    for w in (100.0, 200.0, 300.0, 400.0):  # the first falls out of the latest three
        waits.started(G3, w)
    waits.started(G2, 10.0)
    assert waits.for_at_least(G3) == pytest.approx(300.0)
    assert waits.for_at_least(G2) == pytest.approx((200.0 + 300.0 + 400.0 + 10.0) / 4)
    waits.started(G3, -5.0)  # a clock step back is no negative wait
    assert waits.for_at_least(G3) == pytest.approx((300.0 + 400.0 + 0.0) / 3)
