"""SLA negotiation: admit as asked, counter-offer what the fleet can meet, or reject.

:func:`negotiate` decides one submission against a :class:`FleetView`; an
:class:`OfferBook` tracks the counter-offers it makes until they are accepted, declined or
expire.
"""

from .fleet import FleetView, GpuPool
from .negotiate import (
    DATA_SITE_LABEL,
    P95_REFERENCE_LABEL,
    Admit,
    CounterOffer,
    Decision,
    Estimate,
    NegotiationPolicy,
    Reject,
    admit_contract,
    estimate,
    negotiate,
    task_problem,
)
from .offers import QUEUE_SLACK_S, OfferBook, bound_sites, contract_for, option_lapsed, site_bound

__all__ = [
    "DATA_SITE_LABEL",
    "QUEUE_SLACK_S",
    "P95_REFERENCE_LABEL",
    "Admit",
    "CounterOffer",
    "Decision",
    "Estimate",
    "FleetView",
    "GpuPool",
    "NegotiationPolicy",
    "OfferBook",
    "Reject",
    "admit_contract",
    "bound_sites",
    "contract_for",
    "estimate",
    "negotiate",
    "option_lapsed",
    "site_bound",
    "task_problem",
]
