"""SLA family: counter-offers and the client's answers to them."""

from __future__ import annotations

import msgspec

from .base import Event, Record
from .task import SlaRequest


class OfferOption(Record, frozen=True, kw_only=True):
    """One concrete alternative the fleet can meet, and why it differs from the ask."""

    option_id: str
    gpu_model: str | None = None
    site: str | None = None
    warmup_ms: float | None = None
    expected_queue_s: float = 0.0
    p95_latency_ms: float | None = None
    cost_per_hour: float | None = None
    not_before: float | None = None
    why: str = ""
    gpu_models: list[str] = msgspec.field(default_factory=list)
    """The models the option's terms hold on, ``gpu_model`` first: accepted, the task may run on
    any of them (at ``site``, or another of ``sites``). Empty: ``gpu_model`` alone (an offer of an
    earlier version)."""
    sites: list[str] = msgspec.field(default_factory=list)
    """The sites that keep the option's terms that a site decides (its warm-up, a deadline),
    ``site`` first: accepted, the task may run at any of them. Empty where no such term binds
    a site, or an offer of an earlier version (accepted, bound to ``site`` alone)."""


class SlaOffer(Event, frozen=True, kw_only=True, tag="sla.offer.v1"):
    """A counter-offer for a submission that cannot be met as asked."""

    offer_id: str
    task_id: str
    tenant: str
    asked: SlaRequest
    options: list[OfferOption] = msgspec.field(default_factory=list)
    reason: str = ""
    valid_until: float
    at: float


class SlaReply(Event, frozen=True, kw_only=True, tag="sla.reply.v1"):
    """The client's answer to an offer: accept one option or decline."""

    offer_id: str
    task_id: str
    accept: bool
    option_id: str | None = None
    replied_at: float = 0.0
    """When the client sent it (its clock): names this answer in its msg id, so that the same
    answer sent again (its first refused for a token that had expired, say) is not dropped
    as a duplicate, while retries of one publish are."""
