"""The learned confidence: the learner's promoted outcome model, read from the ``models``
bucket, gives the confidence of the placements this replica publishes.

The policy's own (calibrated) confidence stays on the decision as ``prior_confidence`` and
is the model's main input, so the learner never trains on its own output. The model is the
one learned part of the decision path, and it must never take it down: a new version that does
not decode or check is refused and the model in use (if any) goes on serving, a prediction
that fails or is not a probability leaves the policy's confidence in place, and after
``FAILURES_TO_DISABLE`` failures in a row the model is set aside until the learner publishes
another version. An emptied key (the learner's withdrawal, or an operator's delete) takes the
model away.
"""

from __future__ import annotations

import logging
import math

import msgspec
from fleetpilot.contracts import DecisionMade
from fleetpilot.learner import LEARNED_ACTIONS, PROMOTED_KEY, OutcomeModel
from fleetpilot.ledger.store import FleetView, node_key
from fleetpilot.runtime import Bus
from prometheus_client import Counter, Gauge

log = logging.getLogger("fleetpilot.policy")

FAILURES_TO_DISABLE = 3
"""Failed predictions in a row after which the model waits for the learner's next version."""


class LearnedConfidence:
    """The promoted outcome model this replica uses, if any, and its use on decisions."""

    def __init__(self, fleet: FleetView | None, registry=None) -> None:
        self.fleet = fleet
        self.model: OutcomeModel | None = None
        self.version = 0
        # The revision of the last model refused, and why: a watch that starts again delivers
        # it again, and it was refused, counted and logged again each time.
        self.refused_version = 0
        self.refused_reason = ""
        self.failures_in_a_row = 0
        self.used = Counter("fleetpilot_policy_learned_confidence_total",
                            "Placements published with the learned model's confidence, or left with the "
                            "policy's own because the model failed", ["outcome"], registry=registry)
        self.model_version = Gauge("fleetpilot_policy_learned_model_version",
                                   "Version of the outcome model in use (0: none, the policy's own confidence)",
                                   registry=registry)
        self.refused_gauge = Gauge("fleetpilot_policy_learned_model_refused_version",
                                   "Version of the outcome model last refused, while no later one was taken "
                                   "(0: none); the model in use, if any, is older", registry=registry)

    def load(self, value: bytes | None, version: int) -> None:
        """Take the model stored at ``version`` (``None`` or empty: the model was withdrawn);
        one that does not decode or check is refused, and the model in use stays."""
        if not value:
            self.model, self.version, self.refused_version, self.refused_reason = None, 0, 0, ""
            self.failures_in_a_row = 0
            log.info("learned confidence: no outcome model; the policy's own confidence is published")
        else:
            try:
                model = OutcomeModel.from_bytes(value)
            except ValueError as exc:
                # Hot reload keeps what serves when the new version is bad: dropping it swapped a
                # model the learner had judged for no model at all, on every replica at once.
                # The model kept goes unjudged meanwhile (the learner judges only what sits at
                # the key): a learner that cannot read the value either withdraws it, or
                # replaces it, at its next round, and the emptied key takes this one away too.
                # One that reads it (a learner newer than this replica) judges that value, not
                # this one, until it promotes or withdraws. A replica started meanwhile has none
                # to keep: replicas may differ until then, each saying so in its gauges.
                self.refused_version, self.refused_reason = version, str(exc)
                self.used.labels("refused").inc()
                log.error("learned confidence: outcome model version %d refused (%s); %s", version, exc,
                          f"version {self.version} stays in use" if self.model is not None
                          else "the policy's own confidence is published")
            else:
                self.model, self.version, self.refused_version, self.refused_reason = model, version, 0, ""
                self.failures_in_a_row = 0
                log.info("learned confidence: outcome model version %d in use", version)
        self.model_version.set(self.version if self.model is not None else 0)  # 0: set aside, or none
        self.refused_gauge.set(self.refused_version)

    async def follow(self, bus: Bus) -> None:
        """Load the promoted model now and every new version the learner stores."""
        kv = await bus.kv("models")
        async for entry in kv.watch(PROMOTED_KEY):
            if entry.value is not None and entry.revision in (self.version, self.refused_version):
                continue  # what this replica holds or refused already, seen again
            self.load(entry.value, entry.revision)

    def gpu_model(self, decision: DecisionMade) -> str:
        """The model of the first GPU ``decision`` places on ("" when the fleet view lacks it).

        A CPU-only entry (``gpu`` -1) names no GPU and is passed over, as the executor does
        when it tells the model the outcome is learnt under: read as "other" here, the same
        placement was scored on another input than it was trained on."""
        first = next((p for p in decision.placement if p.gpu >= 0), None)
        if self.fleet is None or first is None:
            return ""
        topo = self.fleet.nodes.get(node_key(first.node))
        return next((g.model for g in topo.gpus if g.index == first.gpu), "") if topo else ""

    def apply(self, decision: DecisionMade) -> DecisionMade:
        """``decision`` with the model's confidence (its own kept as ``prior_confidence``), or
        as it is: no model, not a placement, the fallback scheduler's, or a failed prediction."""
        model = self.model
        if (model is None or decision.action not in LEARNED_ACTIONS or decision.fallback
                or decision.prior_confidence is not None):
            return decision
        try:
            p = float(model.predict(model.features.vector(decision, self.gpu_model(decision)))[0])
            if not math.isfinite(p) or not 0.0 <= p <= 1.0:
                raise ValueError(f"predicted {p}, not a probability")
        except Exception as exc:  # a learned part may fail in any way; the decision must not
            self.failures_in_a_row += 1
            self.used.labels("failed").inc()
            log.error("learned confidence: prediction failed for %s (%s); the policy's own confidence stands",
                      decision.decision_id, exc)
            if self.failures_in_a_row >= FAILURES_TO_DISABLE:
                log.error("learned confidence: model version %d set aside after %d failures in a row",
                          self.version, self.failures_in_a_row)
                self.model = None
                self.model_version.set(0)
            return decision
        self.failures_in_a_row = 0
        self.used.labels("used").inc()
        return msgspec.structs.replace(decision, confidence=p, prior_confidence=decision.confidence)
