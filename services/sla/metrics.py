"""The SLA negotiator's own Prometheus series: how submissions are answered.

A submission is counted once, when it is negotiated (a redelivery answered from what the
contracts bucket keeps counts nothing); an offer once, when a reply or its expiry closes it,
by the replica whose compare-and-set closed it. So the sums over the replicas are the
negotiations the fleet ran.
"""

from __future__ import annotations

from fleetpilot.contracts import Event, SlaOffer, TaskAdmitted, TaskRejected, TaskSubmitted
from prometheus_client import Counter


class SlaMetrics:
    """The service's own series, in the host's registry next to the handler metrics."""

    def __init__(self, registry) -> None:
        """Register the series in ``registry``."""
        self.unauthenticated = Counter(
            "fleetpilot_sla_unauthenticated_total", "Submissions and replies rejected for their token",
            ["reason"], registry=registry,
        )
        self.answers = Counter(
            "fleetpilot_sla_answers_total",
            "Submissions answered, by the answer (admitted, offer, rejected), the tier asked for and, for a "
            "rejection, its code",
            ["answer", "tier", "code"], registry=registry,
        )
        self.offers_closed = Counter(
            "fleetpilot_sla_offers_closed_total",
            "Counter-offers closed, by how: accepted, declined, lapsed (accepted after the fleet could no "
            "longer keep it) or expired (no answer in time)",
            ["state"], registry=registry,
        )

    def answered(self, task: TaskSubmitted, answer: Event | None) -> None:
        """Count ``answer`` to ``task``'s submission (nothing when none is published)."""
        if isinstance(answer, TaskAdmitted):
            self.answers.labels("admitted", task.sla.tier, "").inc()
        elif isinstance(answer, SlaOffer):
            self.answers.labels("offer", task.sla.tier, "").inc()
        elif isinstance(answer, TaskRejected):
            self.answers.labels("rejected", task.sla.tier, answer.code).inc()

    def offer_closed(self, state: str) -> None:
        """Count an offer this replica closed as ``state``."""
        self.offers_closed.labels(state).inc()
