"""The policy service corrects its confidences by the feedback store's totals per policy and
action, over a real nats-server (the feedback endpoint played by the test)."""

from __future__ import annotations

import pytest
from fleetpilot.contracts import FeedbackStats, StatsGroup, StatsQuery, decode, encode, now
from fleetpilot_services.policy.service import build, totals_by_policy_action

from .conftest import admitted, node, settings, wait_for


def group(policy: str, count: int, expected: float, successes: int, action: str = "assign") -> StatsGroup:
    return StatsGroup(key={"policy": policy, "action": action}, count=count, successes=successes,
                      success_rate=successes / count, expected_successes=expected)


def test_totals_are_summed_per_policy_name_and_action_and_the_fallback_and_unknown_actions_are_left_out() -> None:
    groups = [group("bestfit@1", 10, 9.0, 10), group("bestfit@2+ab", 10, 8.0, 9), group("fgd@1", 4, 3.0, 2),
              group("fgd@1", 3, 2.0, 1, action="migrate"), group("fgd@1", 9, 9.0, 9, action=""),
              group("fallback@7", 5, 4.0, 1), StatsGroup(key={"task_kind": "train"}, count=1, successes=1, success_rate=1.0)]
    assert totals_by_policy_action(groups) == {"bestfit:assign": (17.0, 19, 20), "fgd:assign": (3.0, 2, 4),
                                               "fgd:migrate": (2.0, 1, 3)}


async def test_an_underconfident_policy_publishes_corrected_confidences(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0")])
    asked: list[list[str]] = []

    async def stats(msg) -> None:  # bestfit said 0.9 on average and 99% of its assigns met their goal
        query = decode(msg.data, StatsQuery)
        asked.append(query.by)
        # Its moves did badly: that record must not touch its assigns.
        groups = ([group("bestfit@1", 100, 90.0, 99), group("bestfit@1", 100, 90.0, 10, action="migrate")]
                  if query.by == ["policy", "action"] else [])
        await msg.respond(encode(FeedbackStats(groups=groups, at=now())))

    await observer.nc.subscribe("feedback.stats", cb=stats)
    policy = build(settings(nats_url, tmp_path, profile="bestfit", stats_refresh_s=0.1))
    await policy.start()
    try:
        await wait_for(lambda: asked.count(["policy", "action"]) >= 3, what="feedback totals read")
        await observer.admit(admitted("t1", gpu_milli=500))
        await wait_for(lambda: len(observer.decisions) == 1, what="a decision")
    finally:
        await policy.stop()
    decision = observer.decisions[0]
    assert decision.action == "assign" and not decision.fallback
    # bestfit's own confidence here is its prior, 0.9; read three times, the same totals
    # correct it once: 0.9 * (99 + 50) / (90 + 50), under the record's 100 / 102.
    assert decision.confidence == pytest.approx(0.9 * 149 / 140)
    assert decision.confidence < 100 / 102
