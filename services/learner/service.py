"""The learner service.

Joins every placement decision (``decision.made`` with an action in
``fleetpilot.learner.LEARNED_ACTIONS``) to its outcome (``feedback.recorded``) in a SQLite
file of its own (``store.py``), and when ``retrain_every`` new outcomes have joined since the
last round, learns the outcome model from them (``fleetpilot.learner.learn``, in a worker
thread, on one core) and stores it in the ``models`` bucket:

- under ``outcome`` when it is promoted (it beat the policy's own confidence on the latest
  outcomes it was not trained on): the key policies read;
- under ``outcome-candidate`` when it is not, for an operator to look at: a policy never
  reads it, and ``outcome`` keeps the last promoted model.

Either way it announces ``model.published`` (``name`` = the key, ``version`` = its revision
there) with the held-out figures. A round with too few judged placements publishes nothing.

Every replica reads every message (a consumer of its own, named by ``instance``) and learns
from all of them, so any one of them is enough and a second publishes the same model.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
from fleetpilot.contracts import STREAMS, DecisionMade, FeedbackRecorded, ModelPublished, now
from fleetpilot.learner import (
    CANDIDATE_KEY,
    LEARNED_ACTIONS,
    PROMOTED_KEY,
    STORE_FILE,
    Assessment,
    OutcomeModel,
    learn,
)
from fleetpilot.learner.promotion import MIN_EXAMPLES
from fleetpilot.runtime import Bus, CasConflict, KeyValue, Reject, ServiceHost, ServiceSettings, serve
from prometheus_client import Counter, Gauge
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from .store import JOINED, TRAINED, ExampleStore, learns_from, read_examples

log = logging.getLogger("fleetpilot.learner")

REPLAY_S = max(s.max_age_s for s in STREAMS if s.name in ("DECISIONS", "FEEDBACK"))
"""How far back a replica's consumers start when first made: all the history the streams
still keep (7 days), so a new learner learns from it at once."""


class LearnerSettings(ServiceSettings):
    """``FLEETPILOT_LEARNER_*``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_LEARNER_", extra="ignore")

    instance: str = Field(default_factory=socket.gethostname, min_length=1)
    """Names this replica's own consumers (``learner-decisions-<instance>``): stable across
    restarts (the host name; a StatefulSet's pod name), so a restarted replica goes on where
    it stopped; two replicas running at once need two names."""
    retrain_every: int = Field(default=50, ge=1)
    """How many new outcomes joined to their decision start a round of learning."""
    check_interval_s: float = Field(default=10.0, gt=0)
    """How often the store is pruned and the count of new outcomes checked."""
    min_examples: int = Field(default=MIN_EXAMPLES, ge=2)
    """Fewer judged placements than this train nothing (the library's ``MIN_EXAMPLES``)."""
    max_examples: int = Field(default=50_000, ge=2)
    """How many joined outcomes are kept and learnt from (the latest); as many decisions
    waiting for their outcome, and outcomes waiting for their decision, are kept besides."""
    unjoined_ttl_s: float = Field(default=14 * 24 * 3600.0, gt=0)
    """A decision with no outcome (or an outcome with no decision) older than this is dropped."""
    seed: int = 0
    """The training seed: replicas with the same outcomes train the same model."""

    @model_validator(mode="after")
    def _room_to_learn(self) -> LearnerSettings:
        if self.max_examples < self.min_examples:
            raise ValueError(f"MAX_EXAMPLES={self.max_examples} is below MIN_EXAMPLES={self.min_examples}: "
                             "the learner would never have enough to learn from")
        return self


class LearnerMetrics:
    """The learner's own series, in the host's registry next to the handler metrics."""

    def __init__(self, registry) -> None:
        self.examples = Gauge("fleetpilot_learner_examples",
                              "Rows kept: joined (decision with its outcome: the training set), "
                              "decisions_waiting (no outcome yet), outcomes_waiting (no decision yet)",
                              ["state"], registry=registry)
        self.trainings = Counter("fleetpilot_learner_trainings_total",
                                 "Rounds that trained a model, by whether it was promoted",
                                 ["promoted"], registry=registry)
        self.promoted = Counter("fleetpilot_learner_models_promoted_total",
                                "Models stored under the key policies read", registry=registry)
        self.withdrawn = Counter("fleetpilot_learner_models_withdrawn_total",
                                 "Models taken from the key policies read: no better than the policy's own "
                                 "confidence on the latest outcomes, or no model the learner can read",
                                 registry=registry)
        self.brier = Gauge("fleetpilot_learner_held_out_brier",
                           "Weighted Brier score on the last round's held-out outcomes, of the model "
                           "and of the policy's own confidence", ["of"], registry=registry)
        self.seconds = Gauge("fleetpilot_learner_training_seconds", "Duration of the last round's training",
                             registry=registry)

    def stored(self, sizes: dict[str, int]) -> None:
        """Show what the store keeps."""
        for state, count in sizes.items():
            self.examples.labels(state).set(count)

    def trained(self, assessment: Assessment, seconds: float) -> None:
        """Count a round that trained a model and show its held-out figures."""
        self.trainings.labels("true" if assessment.promoted else "false").inc()
        if assessment.promoted:
            self.promoted.inc()
        self.brier.labels("model").set(assessment.figures.brier_model)
        self.brier.labels("policy").set(assessment.figures.brier_prior)
        self.seconds.set(seconds)


@functools.cache
def _train_on_one_core() -> None:
    # The learner trains beside the event loop that keeps consuming: torch's default of a
    # thread per core would take every core of the machine for a model of a few hundred
    # weights. Process-wide, so once.
    import torch

    torch.set_num_threads(1)


def malformed_decision(decision: DecisionMade) -> str | None:
    """Why a placement decision cannot be learnt from as it came (``None``: it can): it has
    no id to key it and join its outcome by. (A confidence that is no probability does not
    decode: the contract bounds it, and such a decision is dead-lettered as undecodable.)"""
    if decision.action in LEARNED_ACTIONS and not decision.decision_id:
        return f"{decision.action} decision for task {decision.task_id!r} has no decision_id to join its outcome by"
    return None


FUTURE_SKEW_S = 300.0
"""How far ahead of the learner's clock an outcome's ``recorded_at`` may be (clocks of
replicas on other hosts drift by seconds, not minutes)."""


def malformed_outcome(feedback: FeedbackRecorded, at: float) -> str | None:
    """Why an outcome of a placement cannot be kept as it came (``None``: it can): it has no
    action id to store it once by, or its time is more than ``FUTURE_SKEW_S`` ahead of
    ``at`` (this replica's clock)."""
    if not (feedback.decision_id and learns_from(feedback)):
        return None
    if not feedback.action_id:
        return f"outcome of decision {feedback.decision_id} has no action_id to store it once by"
    if feedback.recorded_at > at + FUTURE_SKEW_S:
        # Outcomes are ordered by this time: one from a feedback replica whose clock runs
        # hours ahead would be the latest for as long, marking every model trained on it as
        # having learnt every outcome recorded meanwhile (the serving model was then never
        # judged, nor withdrawn), and outliving every pruning of the store.
        return (f"outcome {feedback.action_id}: recorded_at is {feedback.recorded_at - at:.0f} s ahead of this "
                f"learner's clock (at most {FUTURE_SKEW_S:g} s allowed): a clock that is wrong")
    return None


def assess(path: Path, settings: LearnerSettings, serving: OutcomeModel | None = None) -> Assessment:
    """One round of learning on the latest ``max_examples`` outcomes kept in ``path``, the
    ``serving`` model judged with it (runs in a worker thread: it reads on a connection of
    its own and trains with torch)."""
    examples = read_examples(path, settings.max_examples)
    if len(examples) >= settings.min_examples:
        _train_on_one_core()
    return learn(examples, seed=settings.seed, min_examples=settings.min_examples, serving=serving)


class Serving(NamedTuple):
    """What the key policies read holds now: the promoted ``model`` at revision ``version``;
    ``unreadable`` (why, in one line) when it holds a value that is no model (``model`` is
    then ``None``); ``None``, 0, ``None`` when it holds nothing."""

    model: OutcomeModel | None
    version: int
    unreadable: str | None = None


async def serving_model(bucket: KeyValue) -> Serving:
    """What the policies read under ``outcome`` now (see ``Serving``)."""
    entry = await bucket.get(PROMOTED_KEY)
    if entry is None or not entry.value:
        return Serving(None, 0)
    try:
        return Serving(OutcomeModel.from_bytes(entry.value), entry.revision)
    except ValueError as exc:
        # Taken as "none serving", such a value could never be withdrawn: the policies refuse
        # it and keep the model they had, which sits at no key and was judged by no round, until
        # a model was promoted at last. Its revision lets the round withdraw it.
        return Serving(None, entry.revision, str(exc))


def build(settings: LearnerSettings | None = None) -> ServiceHost:
    """Wire the learner."""
    settings = settings or LearnerSettings.from_environment()
    host = ServiceHost("learner", settings)
    metrics = LearnerMetrics(host.metrics.registry)
    path = Path(settings.state_dir) / STORE_FILE
    parts: dict = {}

    async def open_store(bus: Bus) -> None:
        parts["store"] = ExampleStore(path)
        metrics.stored(parts["store"].sizes())

    async def close_store() -> None:
        training = parts.get("training")
        if training is not None and not training.done():
            # A worker thread cannot be cancelled: let the round end before the store closes.
            await asyncio.wait([training])
        if "store" in parts:
            parts["store"].close()

    host.on_startup(open_store)
    host.on_shutdown(close_store)

    # Each replica reads everything on consumers of its own: on a shared consumer, each
    # replica would see a share of the decisions and another share of the outcomes, and
    # join few of them.
    @host.on(DecisionMade, consumer="learner-decisions", instance=settings.instance, instance_start_s_ago=REPLAY_S)
    async def on_decision(decision: DecisionMade) -> None:
        # Kept as it came, a decision without id took the empty key (every later one was
        # ignored as its duplicate), and a confidence of 1.7 was learnt as 0.999: a dead
        # letter says what was wrong, and the producer's bug is seen.
        if (why := malformed_decision(decision)) is not None:
            raise Reject(why)
        parts["store"].add_decision(decision)  # committed before the message is acked

    @host.on(FeedbackRecorded, consumer="learner-feedback", instance=settings.instance,
             instance_start_s_ago=REPLAY_S)
    async def on_feedback(feedback: FeedbackRecorded) -> None:
        if (why := malformed_outcome(feedback, now())) is not None:
            raise Reject(why)
        parts["store"].add_outcome(feedback)

    async def withdraw(bucket: KeyValue, serving_version: int, assessment: Assessment, reason: str) -> None:
        """Take what the round found under the key policies read (``serving_version``) from it,
        announced with the round's figures and ``reason``."""
        try:
            # Compare-and-set on the revision the round judged, not a plain delete: another
            # replica may have promoted a newer model while this one trained, and that one
            # was never judged here. An empty value is "no model" to every reader (the
            # policies, ``fleetpilot model``, ``serving_model``), and the watch sees it.
            await bucket.update(PROMOTED_KEY, b"", serving_version)
        except CasConflict:
            log.info("learner: model %s version %d was replaced during the round: not withdrawn",
                     PROMOTED_KEY, serving_version)
            return
        metrics.withdrawn.inc()
        await host.bus.publish(ModelPublished(  # type: ignore[union-attr]
            name=PROMOTED_KEY, version=serving_version, figures=assessment.figures, promoted=False,
            reason=reason, published_at=now(), withdrawn=True))
        log.warning("learner: model %s version %d withdrawn: %s", PROMOTED_KEY, serving_version, reason)

    @host.every(settings.check_interval_s)
    async def learn_when_due() -> None:
        store: ExampleStore = parts["store"]
        # One count per check: counted again only when rows went.
        sizes = store.sizes()
        if store.prune(max_examples=settings.max_examples, unjoined_before=now() - settings.unjoined_ttl_s,
                       sizes=sizes):
            sizes = store.sizes()
        metrics.stored(sizes)
        joined = store.counter(JOINED)
        if joined - store.counter(TRAINED) < settings.retrain_every:
            return
        started = time.perf_counter()
        bucket = await host.bus.kv("models")  # type: ignore[union-attr]
        serving = await serving_model(bucket)
        # Shielded: a service stopping mid-round stops waiting, and the round (a thread,
        # which cannot be cancelled) ends on its own before the store closes.
        parts["training"] = asyncio.ensure_future(asyncio.to_thread(assess, path, settings, serving.model))
        try:
            assessment = await asyncio.shield(parts["training"])
        except Exception:
            # Retried only once more outcomes have come: the same ones would fail the same way.
            log.exception("learner: a round of learning on %d joined outcomes failed", joined)
            store.mark_trained(joined)
            return
        seconds = time.perf_counter() - started
        if serving.unreadable is not None and not assessment.promoted:
            # A value no model (written by hand, by a learner of another version, damaged): the
            # policies refuse it and keep serving the model they had, which no round can judge
            # now that it sits at no key. Withdrawn at the first round that does not replace it
            # (one that trained nothing too: no outcome is needed to find it unreadable), so
            # that nothing unjudged serves beyond a round; the policies go back to their own
            # confidence until a model is promoted. A promoted model simply overwrites it.
            await withdraw(bucket, serving.version, assessment,
                           f"the value under {PROMOTED_KEY!r} does not read ({serving.unreadable}): withdrawn, "
                           f"so that the policies keep no model the learner cannot judge; this round: "
                           f"{assessment.reason}")
        if assessment.model is None:
            if assessment.reason != parts.get("said"):
                log.info("learner: no model yet: %s", assessment.reason)
                parts["said"] = assessment.reason
            store.mark_trained(joined)
            return
        metrics.trained(assessment, seconds)
        if assessment.withdraw:
            await withdraw(bucket, serving.version, assessment, assessment.reason)
        key = PROMOTED_KEY if assessment.promoted else CANDIDATE_KEY
        version = await bucket.put(key, msgspec.json.encode(assessment.model))
        await host.bus.publish(ModelPublished(  # type: ignore[union-attr]
            name=key, version=version, figures=assessment.figures, promoted=assessment.promoted,
            reason=assessment.reason, published_at=now()))
        # Marked once published: a round whose model could not be stored is tried again.
        store.mark_trained(joined)
        log.info("learner: model %s version %d from %d outcomes in %.1f s: %s", key, version,
                 assessment.figures.examples, seconds, assessment.reason)

    return host


def main() -> None:
    """Console entry point ``fleetpilot-learner`` (``python -m fleetpilot_services.learner``)."""
    serve("learner", build)
