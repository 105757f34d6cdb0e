"""The policy publishes the learner's promoted outcome model's confidence, keeps its own as
``prior_confidence``, and keeps deciding with its own when the model is bad or fails: over a
real nats-server, and on the pure part."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
from fleetpilot.contracts import DecisionMade, Placement, PolicyRef, TaskSubmitted
from fleetpilot.learner import OutcomeFeatures, OutcomeModel, train
from fleetpilot_services.policy.learned import FAILURES_TO_DISABLE, LearnedConfidence
from fleetpilot_services.policy.service import build

from .conftest import admitted, node, settings, wait_for


def tight_holds_fail() -> OutcomeModel:
    """A model taught that placements holding less than the task asked for fail, whatever the
    policy said (0.9 everywhere)."""
    rng = np.random.default_rng(3)
    layout = OutcomeFeatures.for_models({"H100"})
    rows, met = [], []
    for i in range(300):
        ask = int(rng.choice([8000, 16000, 32000]))
        held = int(ask * rng.choice([0.6, 1.0, 1.5]))
        d = DecisionMade(decision_id=f"d{i}", task_id=f"t{i}", action="assign", confidence=0.9,
                         placement=[Placement(node="n0", gpu=0, milli=1000, memory_mb=held)],
                         policy=PolicyRef(name="bestfit"), decided_at=0.0,
                         task=TaskSubmitted(task_id=f"t{i}", gpu_memory_mb=ask))
        rows.append(layout.vector(d, "H100"))
        met.append(float(rng.random() < (0.2 if held < ask else 0.98)))
    return train(layout, np.stack(rows), np.array(met), np.ones(len(met)), seed=1)


async def decide_one(observer, nats_url, tmp_path) -> DecisionMade:
    await observer.put_fleet([node("n0")])
    policy = build(settings(nats_url, tmp_path, profile="bestfit"))
    await policy.start()
    try:
        await observer.admit(admitted("t1", gpu_milli=500))
        await wait_for(lambda: len(observer.decisions) == 1, what="a decision")
    finally:
        await policy.stop()
    return observer.decisions[0]


async def test_a_promoted_model_gives_the_published_confidence_and_the_policys_own_is_kept(
        observer, nats_url, tmp_path):
    model = tight_holds_fail()
    await observer.kv_put("models", "outcome", msgspec.json.encode(model))
    decision = await decide_one(observer, nats_url, tmp_path)
    assert decision.action == "assign"
    assert decision.prior_confidence == pytest.approx(0.9)  # bestfit's prior
    # The same event, read back, gives the same prediction: what the learner will train on.
    as_decided = msgspec.structs.replace(decision, confidence=decision.prior_confidence, prior_confidence=None)
    expected = float(model.predict(model.features.vector(as_decided, "H100"))[0])  # the GPU of node("n0")
    assert decision.confidence == pytest.approx(expected)
    assert decision.confidence != pytest.approx(0.9, abs=0.01)


async def test_a_model_withdrawn_from_the_bucket_gives_the_policy_its_own_confidence_back(observer, nats_url, tmp_path):
    await observer.put_fleet([node("n0")])
    await observer.kv_put("models", "outcome", msgspec.json.encode(tight_holds_fail()))
    policy = build(settings(nats_url, tmp_path, profile="bestfit"))
    await policy.start()
    try:
        await observer.admit(admitted("t1", gpu_milli=500))
        await wait_for(lambda: len(observer.decisions) == 1, what="a decision")
        assert observer.decisions[0].prior_confidence is not None
        kv = await observer.js.key_value("models")
        await kv.delete("outcome")  # what an operator does to take the model out of service
        in_use = lambda: policy.metrics.registry.get_sample_value("fleetpilot_policy_learned_model_version")  # noqa: E731
        await wait_for(lambda: in_use() == 0, what="the model set aside")
        await observer.admit(admitted("t2", gpu_milli=500))
        await wait_for(lambda: len(observer.decisions) == 2, what="a second decision")
    finally:
        await policy.stop()
    assert observer.decisions[1].prior_confidence is None
    assert observer.decisions[1].confidence == pytest.approx(0.9)


async def test_a_model_that_does_not_decode_leaves_the_policys_own_confidence(observer, nats_url, tmp_path):
    await observer.kv_put("models", "outcome", b'{"features": "not a model"}')
    decision = await decide_one(observer, nats_url, tmp_path)
    assert decision.action == "assign"
    assert decision.confidence == pytest.approx(0.9) and decision.prior_confidence is None


def a_placement(held_mb: int = 16000, action: str = "assign", fallback: bool = False) -> DecisionMade:
    return DecisionMade(decision_id="t.assign", task_id="t", action=action, confidence=0.9,  # type: ignore[arg-type]
                        placement=[Placement(node="n0", gpu=0, milli=1000, memory_mb=held_mb)],
                        policy=PolicyRef(name="fgd"), decided_at=0.0, fallback=fallback,
                        task=TaskSubmitted(task_id="t", gpu_memory_mb=16000))


def test_the_model_lowers_a_tight_placement_below_a_roomy_one_and_leaves_what_it_does_not_predict():
    learned = LearnedConfidence(None)
    learned.load(msgspec.json.encode(tight_holds_fail()), 4)
    tight, roomy = learned.apply(a_placement(9600)), learned.apply(a_placement(24000))
    assert tight.confidence < 0.5 < 0.9 < roomy.confidence
    assert tight.prior_confidence == roomy.prior_confidence == 0.9
    for untouched in (a_placement(action="evict"), a_placement(fallback=True), tight):
        assert learned.apply(untouched) is untouched  # not a placement, the fallback's, already learned


def test_a_model_that_fails_to_predict_is_set_aside_until_the_next_version():
    learned = LearnedConfidence(None)
    learned.load(msgspec.json.encode(tight_holds_fail()), 4)
    # A layout that no longer matches the weights (as a model of another feature version
    # would be): every prediction fails, and the decision goes out as the policy made it.
    assert learned.model is not None
    learned.model = msgspec.structs.replace(learned.model, features=OutcomeFeatures.for_models({"a", "b"}))
    for _ in range(FAILURES_TO_DISABLE):
        d = a_placement()
        assert learned.apply(d) is d
    assert learned.model is None
    learned.load(msgspec.json.encode(tight_holds_fail()), 5)
    assert learned.apply(a_placement()).prior_confidence == 0.9


async def test_a_refused_model_seen_again_by_a_watch_that_starts_again_is_not_refused_again():
    from fleetpilot.runtime import InMemoryBus
    from prometheus_client import CollectorRegistry

    bus = InMemoryBus()
    await bus.ensure_topology()
    await (await bus.kv("models")).put("outcome", b'{"features": "not a model"}')
    registry = CollectorRegistry()
    learned = LearnedConfidence(None, registry)
    for _ in range(3):  # the view's watcher started again twice (a reconnect, a restart of the job)
        follow = asyncio.ensure_future(learned.follow(bus))
        await asyncio.sleep(0.05)
        follow.cancel()
    assert learned.model is None
    assert registry.get_sample_value("fleetpilot_policy_learned_confidence_total", {"outcome": "refused"}) == 1



async def test_a_bad_new_version_keeps_the_model_serving_and_an_emptied_key_takes_it_away():
    from fleetpilot.runtime import InMemoryBus
    from prometheus_client import CollectorRegistry

    bus = InMemoryBus()
    await bus.ensure_topology()
    kv = await bus.kv("models")
    good = await kv.put("outcome", msgspec.json.encode(tight_holds_fail()))
    registry = CollectorRegistry()
    learned = LearnedConfidence(None, registry)
    sample = registry.get_sample_value
    follow = asyncio.ensure_future(learned.follow(bus))
    try:
        await asyncio.sleep(0.05)
        serving = learned.model
        assert serving is not None and learned.version == good
        # A new version that does not check (a learner of another version, a hand-written
        # value): the old one goes on serving, and the refusal shows.
        bad = await kv.put("outcome", b'{"features": "not a model"}')
        await asyncio.sleep(0.05)
        assert learned.model is serving and learned.version == good
        assert learned.apply(a_placement(9600)).prior_confidence == 0.9
        assert (learned.refused_version, "not an outcome model" in learned.refused_reason) == (bad, True)
        assert sample("fleetpilot_policy_learned_model_version") == good
        assert sample("fleetpilot_policy_learned_model_refused_version") == bad
        assert sample("fleetpilot_policy_learned_confidence_total", {"outcome": "refused"}) == 1
        # The learner's withdrawal (an empty value) takes the model away all the same.
        await kv.put("outcome", b"")
        await asyncio.sleep(0.05)
    finally:
        follow.cancel()
    assert learned.model is None and learned.version == 0
    assert learned.apply(a_placement()).prior_confidence is None
    assert sample("fleetpilot_policy_learned_model_version") == 0
    assert sample("fleetpilot_policy_learned_model_refused_version") == 0


def test_a_bad_version_after_the_model_was_set_aside_leaves_none_in_use():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    learned = LearnedConfidence(None, registry)
    learned.load(msgspec.json.encode(tight_holds_fail()), 4)
    learned.model = None  # set aside after failed predictions
    learned.load(b"[]", 5)
    assert learned.model is None and learned.refused_version == 5
    assert registry.get_sample_value("fleetpilot_policy_learned_model_version") == 0  # none in use


def test_the_gpu_model_is_that_of_the_first_gpu_placed_on_as_the_executor_tells_it():
    # A placement whose first entry is CPU-only was scored as "other", while the executor
    # (and so the learner's training row) names the model of its first GPU.
    from types import SimpleNamespace

    from fleetpilot.contracts import GpuInfo, NodeTopology
    from fleetpilot.ledger.store import node_key

    fleet = SimpleNamespace(nodes={node_key("n0"): NodeTopology(node="n0", gpus=[GpuInfo(index=0, model="H100")])})
    learned = LearnedConfidence(fleet)  # type: ignore[arg-type]
    d = msgspec.structs.replace(a_placement(), placement=[Placement(node="n0", gpu=-1, milli=0, memory_mb=0),
                                                          Placement(node="n0", gpu=0, milli=1000, memory_mb=8000)])
    assert learned.gpu_model(d) == "H100"
    assert learned.gpu_model(msgspec.structs.replace(d, placement=d.placement[:1])) == ""
