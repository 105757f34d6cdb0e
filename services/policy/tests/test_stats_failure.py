"""A feedback statistics endpoint that fails (its store down) must not keep the policy from
starting: the fallback and confidences keep their last state, as when it does not answer."""

from __future__ import annotations

from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


async def test_a_replica_starts_and_decides_while_the_stats_endpoint_answers_with_an_error(
    observer, nats_url, tmp_path
):
    await observer.put_fleet([node("n0")])
    asked: list[bytes] = []

    async def failing(msg) -> None:
        # What nats.micro answers when the feedback service's handler raised (its database
        # is down): an empty body with the error headers. The bus turns it into a
        # RuntimeError, which the start-up hook let through: every replica failed to start.
        asked.append(msg.data)
        await observer.nc.publish(msg.reply, b"", headers={"Nats-Service-Error": "database unavailable",
                                                           "Nats-Service-Error-Code": "500"})

    await observer.nc.subscribe("feedback.stats", cb=failing)
    policy = build(settings(nats_url, tmp_path, profile="bestfit", stats_refresh_s=0.1))
    await policy.start()
    try:
        await wait_for(lambda: len(asked) >= 4, what="the stats asked again by the periodic refresh")
        await observer.admit(admitted("t1", gpu_milli=500))
        await wait_for(lambda: len(observer.decisions) == 1, what="a decision")
    finally:
        await policy.stop()
    assert observer.decisions[0].action == "assign"
