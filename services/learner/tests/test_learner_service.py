"""The learner service over a real nats-server: placements joined to their outcomes, a model
learnt and promoted when it beats the policy's confidence, duplicates counted once, what it
stored kept across a restart, nothing published from too few outcomes; and its store's bounds."""

from __future__ import annotations

import asyncio
import logging
import random
import sqlite3

import msgspec
import numpy as np
import pytest
from fleetpilot.contracts import (
    DeadLetter,
    DecisionMade,
    FeedbackRecorded,
    Measured,
    ModelPublished,
    Placement,
    PolicyRef,
    TaskSubmitted,
    decode,
    encode,
    now,
)
from fleetpilot.learner import CANDIDATE_KEY, PROMOTED_KEY, OutcomeFeatures, OutcomeModel, train
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually
from fleetpilot_services.learner import service as learner_service
from fleetpilot_services.learner.service import LearnerSettings, build
from fleetpilot_services.learner.store import JOINED, ExampleStore, read_examples

ASK_MB = 20_000
TIGHT_MB = 16_000
ROOMY_MB = 40_000


@pytest.fixture
async def published(nats_client) -> list[ModelPublished]:
    """Every ``model.published`` announced, seen on a core subscription (duplicates too)."""
    seen: list[ModelPublished] = []

    async def on_model(msg) -> None:
        seen.append(decode(msg.data, ModelPublished))

    await nats_client.subscribe("model.published", cb=on_model)
    return seen


def settings_for(nats_url: str, tmp_path, **overrides) -> LearnerSettings:
    base = dict(nats_url=nats_url, metrics_port=-1, state_dir=str(tmp_path / "state"), instance="test-learner",
                check_interval_s=0.1)
    return LearnerSettings(**(base | overrides))


def is_tight(i: int) -> bool:
    """Two placements in five hold less memory than their task asked for."""
    return i % 5 in (0, 2)


def decision(i: int, *, tight: bool | None = None, action: str = "assign", at: float | None = None) -> DecisionMade:
    """A placement the policy is 90% sure of, whatever room it leaves."""
    tight = is_tight(i) if tight is None else tight
    task = TaskSubmitted(task_id=f"t{i}", kind="train", gpus=1, gpu_memory_mb=ASK_MB)
    return DecisionMade(
        decision_id=f"d{i}", task_id=f"t{i}", action=action,
        placement=[Placement(node="n1", gpu=0, milli=1000, memory_mb=TIGHT_MB if tight else ROOMY_MB)]
        if action in ("assign", "migrate") else [],
        confidence=0.9, policy=PolicyRef(name="best-fit"), decided_at=(now() - 3600 + i) if at is None else at,
        task=task)


def outcome(i: int, *, tight: bool | None = None, action: str = "assign", at: float | None = None
            ) -> FeedbackRecorded:
    """How it ended: a tight placement ran out of memory, a roomy one finished."""
    tight = is_tight(i) if tight is None else tight
    return FeedbackRecorded(
        action_id=f"act-d{i}", decision_id=f"d{i}", task_id=f"t{i}", outcome="oom" if tight else "success",
        latency_ms=Measured(value=12.0, uncertainty_score=0.05), unexpected_side_effect=[],
        policy=PolicyRef(name="best-fit"), confidence=0.9, task_kind="train", gpu_model="H100", action=action,
        recorded_at=(now() - 3000 + i) if at is None else at)


async def publish_placements(nats_client, ids: range) -> None:
    """Each placement's decision and outcome; every seventh outcome before its decision."""
    js = nats_client.jetstream()
    for i in ids:
        events = [decision(i), outcome(i)]
        for event in (reversed(events) if i % 7 == 0 else events):
            subject = "decision.made" if isinstance(event, DecisionMade) else "feedback.recorded"
            await js.publish(subject, encode(event))


async def models(nats_url: str) -> dict[str, bytes]:
    bus = await NatsBus.connect(nats_url, "test-models")
    try:
        bucket = await bus.kv("models")
        return {key: (await bucket.get(key)).value for key in await bucket.keys()}
    finally:
        await bus.drain()


async def test_a_model_that_beats_the_policy_is_promoted_and_predicts_the_failures_it_ignored(
        nats_url, tmp_path, nats_client, published):
    count = 160
    settings = settings_for(nats_url, tmp_path, min_examples=100, retrain_every=count)
    host = build(settings)
    await host.start()
    try:
        await publish_placements(nats_client, range(count))
        # Decisions the model does not learn from, and their outcomes: never counted.
        js = nats_client.jetstream()
        for i in range(1000, 1010):
            await js.publish("decision.made", encode(decision(i, action="queue")))
            await js.publish("feedback.recorded", encode(outcome(i, action="queue")))
        await eventually(lambda: published, what="model.published")
        stored = await models(nats_url)
    finally:
        await host.stop()

    [event] = published
    figures = event.figures
    assert (event.name, event.promoted, figures.examples, figures.held_out) == (PROMOTED_KEY, True, count, 40)
    assert figures.brier_model < figures.brier_prior * 0.5, event.reason
    assert figures.mean_prior == pytest.approx(0.9)
    assert figures.observed == pytest.approx(sum(not is_tight(i) for i in range(120, 160)) / 40)
    assert CANDIDATE_KEY not in stored  # it won: no candidate to look at
    assert set(stored) == {PROMOTED_KEY}
    model = msgspec.json.decode(stored[PROMOTED_KEY], type=OutcomeModel)
    model.check()
    tight, roomy = (model.predict(model.features.vector(decision(0, tight=t), "H100"))[0] for t in (True, False))
    assert tight < 0.5 < 0.9 < roomy, (tight, roomy)


async def publish_placements_the_policy_judges_right(js, count: int) -> None:
    """``count`` placements and their outcomes in a world where tight holds do as well as
    roomy ones and the policy's confidence is right (each succeeds with that probability)."""
    draw = random.Random(5)
    for i in range(count):
        sure = draw.choice([0.6, 0.8, 0.95, 0.99])
        made = msgspec.structs.replace(decision(i), confidence=sure)
        ended = msgspec.structs.replace(outcome(i), confidence=sure,
                                        outcome="success" if draw.random() < sure else "failure")
        await js.publish("decision.made", encode(made))
        await js.publish("feedback.recorded", encode(ended))


def tight_holds_fail_model() -> bytes:
    """A model that learnt, in some earlier world, that holds under the ask fail."""
    layout = OutcomeFeatures.for_models({"H100"})
    x = layout.matrix([(decision(i), "H100") for i in range(200)])
    met = np.array([0.0 if is_tight(i) else 1.0 for i in range(200)])
    return msgspec.json.encode(train(layout, x, met, np.ones(len(met)), seed=0))


async def test_a_serving_model_the_outcomes_no_longer_bear_out_is_withdrawn(
        nats_url, tmp_path, nats_client, published):
    js = nats_client.jetstream()
    bucket = await js.key_value("models")
    serving = await bucket.put(PROMOTED_KEY, tight_holds_fail_model())
    count = 160
    host = build(settings_for(nats_url, tmp_path, min_examples=100, retrain_every=count))
    await host.start()
    try:
        await publish_placements_the_policy_judges_right(js, count)
        await eventually(lambda: len(published) >= 2, what="the withdrawal and the round's model")
        stored = await models(nats_url)
    finally:
        await host.stop()
    withdrawal, candidate = published
    assert (withdrawal.name, withdrawal.version, withdrawal.withdrawn) == (PROMOTED_KEY, serving, True)
    assert withdrawal.reason.startswith("the model serving scores ")
    assert (candidate.name, candidate.promoted, candidate.withdrawn) == (CANDIDATE_KEY, False, False)
    assert {key for key, value in stored.items() if value} == {CANDIDATE_KEY}  # policies read no model now


async def test_a_withdrawal_leaves_a_model_another_replica_promoted_during_the_round(
        nats_url, tmp_path, nats_client, published, monkeypatch):
    js = nats_client.jetstream()
    bucket = await js.key_value("models")
    await bucket.put(PROMOTED_KEY, tight_holds_fail_model())
    newer = tight_holds_fail_model() + b" "  # another replica's model: a revision this round never judged
    loop = asyncio.get_running_loop()
    real_assess = learner_service.assess

    def assess_while_another_replica_promotes(*args, **kwargs):
        assessment = real_assess(*args, **kwargs)
        asyncio.run_coroutine_threadsafe(bucket.put(PROMOTED_KEY, newer), loop).result(timeout=10)
        return assessment

    monkeypatch.setattr(learner_service, "assess", assess_while_another_replica_promotes)
    count = 160
    host = build(settings_for(nats_url, tmp_path, min_examples=100, retrain_every=count))
    await host.start()
    try:
        await publish_placements_the_policy_judges_right(js, count)  # the serving model is stale
        await eventually(lambda: any(e.name == CANDIDATE_KEY for e in published), what="the round's model")
        stored = await models(nats_url)
    finally:
        await host.stop()
    # The stale model was judged, not the newer one: the newer one keeps serving.
    assert stored[PROMOTED_KEY] == newer
    assert not any(e.withdrawn for e in published)


UNREADABLE = b'{"features": "not a model"}'
"""What a policy refuses at ``outcome`` (and keeps serving the model it had): the learner can
judge it no more than the policies can use it."""


@pytest.mark.parametrize("count, trains", [(160, True), (30, False)], ids=["a-round-that-trains", "too-few"])
async def test_a_serving_value_that_does_not_read_is_withdrawn_at_the_next_round(
        nats_url, tmp_path, nats_client, published, count, trains):
    js = nats_client.jetstream()
    bucket = await js.key_value("models")
    unreadable = await bucket.put(PROMOTED_KEY, UNREADABLE)
    host = build(settings_for(nats_url, tmp_path, min_examples=100, retrain_every=count))
    await host.start()
    try:
        await publish_placements_the_policy_judges_right(js, count)  # nothing is promoted
        await eventually(lambda: any(e.withdrawn for e in published), what="the withdrawal")
        if trains:
            await eventually(lambda: any(e.name == CANDIDATE_KEY for e in published), what="the round's model")
        stored = await models(nats_url)
        withdrawn = host.metrics.registry.get_sample_value("fleetpilot_learner_models_withdrawn_total")
    finally:
        await host.stop()
    [withdrawal] = [e for e in published if e.withdrawn]
    assert (withdrawal.name, withdrawal.version, withdrawal.promoted) == (PROMOTED_KEY, unreadable, False)
    assert "does not read (not an outcome model" in withdrawal.reason
    assert not stored.get(PROMOTED_KEY)  # emptied: the policies drop the older model they kept
    assert withdrawn == 1


async def test_a_duplicated_outcome_is_counted_once(nats_url, tmp_path, nats_client, published):
    count = 40
    host = build(settings_for(nats_url, tmp_path, min_examples=20, retrain_every=count))
    await host.start()
    try:
        await publish_placements(nats_client, range(count))
        js = nats_client.jetstream()
        # The same outcomes again, under other message ids: the stream keeps both copies.
        for i in range(0, count, 3):
            await js.publish("feedback.recorded", encode(outcome(i)), headers={"Nats-Msg-Id": f"again-{i}"})
        await js.publish("decision.made", encode(decision(5)), headers={"Nats-Msg-Id": "again-d5"})
        await eventually(lambda: published, what="model.published")
        await asyncio.sleep(0.5)  # room for a round the duplicates would have started
    finally:
        await host.stop()
    assert [e.figures.examples for e in published] == [count]
    store = ExampleStore(tmp_path / "state" / "learner.db")
    try:
        assert (store.counter(JOINED), store.sizes()["joined"]) == (count, count)
    finally:
        store.close()


async def test_a_restarted_learner_keeps_what_it_stored(nats_url, tmp_path, nats_client, published):
    first = build(settings_for(nats_url, tmp_path, min_examples=20, retrain_every=40))
    await first.start()
    try:
        await publish_placements(nats_client, range(40))
        await eventually(lambda: published, what="the first model")
    finally:
        await first.stop()
    # Its consumers go on where they stopped: what came before is only in its store now.
    second = build(settings_for(nats_url, tmp_path, min_examples=20, retrain_every=20))
    await second.start()
    try:
        await publish_placements(nats_client, range(40, 60))
        await eventually(lambda: len(published) >= 2, what="the second model")
        await asyncio.sleep(0.3)
    finally:
        await second.stop()
    # One round each: the restart neither forgot the outcomes nor the round already made.
    assert [e.figures.examples for e in published] == [40, 60]
    assert published[1].version > published[0].version


async def test_too_few_outcomes_publish_no_model(nats_url, tmp_path, nats_client, published, caplog):
    caplog.set_level(logging.INFO, logger="fleetpilot.learner")
    host = build(settings_for(nats_url, tmp_path, min_examples=100, retrain_every=30))
    await host.start()
    try:
        await publish_placements(nats_client, range(30))
        await eventually(lambda: "30 judged placements, 100 needed" in caplog.text, what="the round of 30")
        await asyncio.sleep(0.3)
        stored = await models(nats_url)
    finally:
        await host.stop()
    assert stored == {}
    assert published == []
    # Said once, not once per check.
    assert caplog.text.count("100 needed") == 1


def test_the_store_keeps_the_latest_examples_and_waits_a_while_for_the_rest(tmp_path):
    store = ExampleStore(tmp_path / "learner.db")
    t = now()
    try:
        for i in range(5):
            assert store.add_decision(decision(i, at=t - 100 + i))
            assert store.add_outcome(outcome(i, at=t - 50 + i))
        assert not store.add_outcome(outcome(4, at=t))  # a redelivery: kept once
        assert not store.add_decision(decision(9, action="evict"))  # no placement: not kept
        store.add_decision(decision(10, at=t - 30 * 86400))  # its outcome never came: too old
        store.add_decision(decision(11, at=t - 60))  # its outcome may still come
        store.add_outcome(outcome(12, at=t - 30 * 86400))  # its decision never came: too old
        store.add_outcome(outcome(13, at=t - 60))  # its decision may still come
        assert store.counter(JOINED) == 5
        gone = store.prune(max_examples=3, unjoined_before=t - 14 * 86400)
        assert store.sizes() == {"joined": 3, "decisions_waiting": 1, "outcomes_waiting": 1}
        assert gone == 2 * 2 + 2
        assert sorted(e.decision.decision_id for e in read_examples(store.path, 10)) == ["d2", "d3", "d4"]
        # The late decision joins its waiting outcome; the count of joined outcomes only grows.
        assert store.add_decision(decision(13))
        assert store.counter(JOINED) == 6
        assert [e.decision.decision_id for e in read_examples(store.path, 1)] == ["d4"]
    finally:
        store.close()


def test_settings_that_could_never_learn_are_refused():
    with pytest.raises(ValueError, match="MAX_EXAMPLES"):
        LearnerSettings(min_examples=300, max_examples=200)


def test_outcomes_pruned_and_delivered_again_are_not_stored_or_counted_again(tmp_path):
    path = tmp_path / "learner.db"
    t = now()

    def deliver(store: ExampleStore, ids: range) -> None:
        for i in ids:
            store.add_decision(decision(i, at=t - 100 + i))
            store.add_outcome(outcome(i, at=t - 50 + i))

    store = ExampleStore(path)
    try:
        deliver(store, range(5))
        store.prune(max_examples=3, unjoined_before=t - 14 * 86400)  # d0 and d1 go
        # Everything again, as consumers made anew (a new instance name) replay 7 days: the
        # pruned outcomes joined their decisions once more and were counted a second time.
        deliver(store, range(5))
        assert store.counter(JOINED) == 5
        assert (store.sizes()["joined"], store.sizes()["outcomes_waiting"]) == (3, 0)
    finally:
        store.close()
    store = ExampleStore(path)  # the mark is kept across a restart
    try:
        deliver(store, range(5))
        assert store.counter(JOINED) == 5
        # A new outcome still joins and counts.
        assert store.add_decision(decision(5, at=t - 10)) and store.add_outcome(outcome(5, at=t))
        assert store.counter(JOINED) == 6
        assert sorted(e.decision.decision_id for e in read_examples(path, 10)) == ["d2", "d3", "d4", "d5"]
    finally:
        store.close()


def test_a_stored_decision_that_no_longer_decodes_is_left_out_not_fatal_to_the_round(tmp_path, caplog):
    path = tmp_path / "learner.db"
    store = ExampleStore(path)
    try:
        for i in range(3):
            store.add_decision(decision(i))
            store.add_outcome(outcome(i))
    finally:
        store.close()
    # A row an earlier version stored under a contract this one no longer reads.
    db = sqlite3.connect(path)
    with db:
        db.execute("UPDATE decisions SET event = ? WHERE decision_id = 'd1'", (b'{"type": "decision.made.v0"}',))
    db.close()
    caplog.set_level(logging.WARNING, logger="fleetpilot.learner")
    assert sorted(e.decision.decision_id for e in read_examples(path, 10)) == ["d0", "d2"]
    assert "1 of the 3 latest stored decisions no longer decode" in caplog.text


async def test_malformed_placements_and_outcomes_are_dead_lettered_with_their_reason(nats_url, tmp_path, nats_client):
    letters: list[DeadLetter] = []

    async def on_dead(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await nats_client.subscribe("dlq.>", cb=on_dead)
    host = build(settings_for(nats_url, tmp_path, min_examples=100, retrain_every=1000))
    await host.start()
    try:
        js = nats_client.jetstream()
        for bad in (msgspec.structs.replace(decision(1), confidence=1.7),
                    msgspec.structs.replace(decision(2), confidence=0.9, prior_confidence=-0.2),
                    msgspec.structs.replace(decision(3), decision_id="")):
            await js.publish("decision.made", encode(bad))
        await js.publish("feedback.recorded", encode(msgspec.structs.replace(outcome(4), action_id="")))
        # From a feedback replica whose clock runs a day ahead: the latest outcome for a day.
        await js.publish("feedback.recorded", encode(outcome(7, at=now() + 86_400)))
        await js.publish("feedback.recorded", encode(outcome(9, at=now() + 5)))  # seconds of skew: kept
        # A confidence that is no probability does not decode, whatever the action.
        await js.publish("decision.made", encode(msgspec.structs.replace(decision(5, action="queue"), confidence=3.0)))
        await js.publish("decision.made", encode(decision(6)))  # well-formed: kept
        await eventually(lambda: len(letters) >= 6, what="six dead letters")
        await asyncio.sleep(0.3)  # room for a seventh that must not come
    finally:
        await host.stop()
    assert sorted((e.subject, e.reason, e.error) for e in letters) == [
        ("decision.made", "rejected", "assign decision for task 't3' has no decision_id to join its outcome by"),
        ("decision.made", "undecodable", "Expected `float` <= 1.0 - at `$.confidence`"),  # d1: 1.7
        ("decision.made", "undecodable", "Expected `float` <= 1.0 - at `$.confidence`"),  # d5: 3.0
        ("decision.made", "undecodable", "Expected `float` >= 0.0 - at `$.prior_confidence`"),  # d2: -0.2
        ("feedback.recorded", "rejected", "outcome act-d7: recorded_at is 86400 s ahead of this learner's clock "
                                          "(at most 300 s allowed): a clock that is wrong"),
        ("feedback.recorded", "rejected", "outcome of decision d4 has no action_id to store it once by"),
    ]
    store = ExampleStore(tmp_path / "state" / "learner.db")
    try:
        assert store.sizes() == {"joined": 0, "decisions_waiting": 1, "outcomes_waiting": 1}
    finally:
        store.close()


def test_an_outcome_judged_from_the_task_s_end_alone_is_learnt_from_as_any_other(tmp_path):
    """A record judged from the task's end alone (its action's result handled after it: a
    task OOM-killed as it started) has an unknown latency (uncertainty 1). It weighed 0 and
    was dropped, so the model learnt from a sample leaning to success: the outcome is
    observed all the same, and counts as fully as one judged with its result."""
    path = tmp_path / "learner.db"
    store = ExampleStore(path)
    t = now()
    try:
        for i in range(6):
            store.add_decision(decision(i, at=t - 100 + i))
            ended = outcome(i, tight=i % 2 == 1, at=t - 50 + i)
            if i % 2 == 1:  # judged from the task's end alone: an OOM, latency unknown
                ended = msgspec.structs.replace(ended, latency_ms=Measured(value=0.0, uncertainty_score=1.0))
            assert store.add_outcome(ended)
        assert (store.counter(JOINED), store.sizes()["joined"]) == (6, 6)
        examples = read_examples(path, 6)
        assert [(e.decision.decision_id, e.success, e.weight) for e in examples] == [
            (f"d{i}", i % 2 == 0, 1.0) for i in reversed(range(6))]
    finally:
        store.close()
