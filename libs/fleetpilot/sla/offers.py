"""Open counter-offers: opened from a :class:`CounterOffer`, closed by a reply or by expiry.

The book is pure state with an injectable clock; the sla service persists nothing but the
events it publishes. Closing is idempotent: a redelivered reply to a closed offer gets the
same answer again, never a second contract.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from fleetpilot.contracts import Contract, Fingerprint, OfferOption, SlaOffer, SlaReply, TaskSubmitted

from .fleet import FleetView
from .negotiate import Admit, CounterOffer, Reject, estimate

QUEUE_SLACK_S = 1.0
"""How much longer than its offered wait an accepted option may now wait and still hold:
the offered figure is rounded, and a completion estimate moves a little between two views."""


@dataclass(frozen=True)
class _Open:
    offer: SlaOffer
    task: TaskSubmitted


def contract_for(task: TaskSubmitted, option: OfferOption, offer_id: str) -> Contract:
    """The contract an accepted option makes: the asked terms, relaxed to what the option states.

    Its ``sites`` are the option's (its site first, then every other that keeps the terms a
    site decides), only where such a term binds (``site_bound``); an option of an earlier
    version lists none, and its contract binds ``site`` alone (``bound_sites``)."""
    sla = task.sla

    def relaxed(asked: float | None, offered: float | None) -> float | None:
        if asked is None or offered is None:
            return asked
        return max(asked, offered)

    contract = Contract(
        tier=sla.tier,
        max_queue_s=relaxed(sla.max_queue_s, option.expected_queue_s),
        warmup_ms=relaxed(sla.warmup_ms, option.warmup_ms),
        p95_latency_ms=relaxed(sla.p95_latency_ms, option.p95_latency_ms),
        deadline=sla.deadline,
        cost_ceiling_per_hour=relaxed(sla.cost_ceiling_per_hour, option.cost_per_hour),
        gpu_models=(list(option.gpu_models) or [option.gpu_model]) if option.gpu_model else list(task.gpu_models),
        site=option.site,
        not_before=option.not_before,
        offer_id=offer_id,
        notes=f"accepted option {option.option_id}: {option.why}",
    )
    if option.sites and site_bound(contract):
        contract = msgspec.structs.replace(contract, sites=list(option.sites))
    return contract


def site_bound(contract: Contract) -> bool:
    """Whether a term of ``contract`` depends on the site it runs at: a warm-up bound (the
    data's trip there), or a deadline (the warm-up counts towards it). A contract's sites
    bind its task only then (``bound_sites``); its other terms are its models'."""
    return contract.warmup_ms is not None or contract.deadline is not None


def bound_sites(contract: Contract) -> list[str]:
    """The sites ``contract`` binds its task to, the one it was estimated at first; empty:
    any site keeps it.

    Only where a term depends on the site (``site_bound``): then its ``sites``, every site
    that keeps those terms (an admission's as an accepted offer's). A contract written before
    contracts listed sites binds an accepted offer to its ``site`` and an admission to none,
    as it did then."""
    if not site_bound(contract):
        return []
    if contract.sites:
        return list(contract.sites)
    return [contract.site] if contract.offer_id and contract.site else []


def option_lapsed(task: TaskSubmitted, option: OfferOption, fleet: FleetView, *, now: float,
                  fingerprint: Fingerprint | None = None) -> str | None:
    """Why ``option``, offered for ``task`` and being accepted at ``now``, can no longer be
    met on ``fleet``; ``None`` while it can.

    An open offer holds only its first option's GPUs: another option's pool may have been
    taken in the meantime, a node may have gone. Accepted regardless, the contract would
    promise a wait the fleet cannot give. What is checked is capacity, which is what moves:
    the pool is still there, its GPUs still free in time for the deadline, and within the
    wait the contract would agree (the offered one, ``contract_for``, with
    :data:`QUEUE_SLACK_S`). Warm-up, latency and price are the option's own terms."""
    if option.gpu_model is None or option.site is None:
        return None  # not bound to a pool: nothing of the fleet's was promised
    where = f"{option.gpu_model} at {option.site}"
    pool = next((p for p in fleet.pools if p.gpu_model == option.gpu_model and p.site == option.site), None)
    if pool is None:
        return f"option {option.option_id} no longer holds: the fleet has no {where} now"
    now_there = estimate(task, pool, fleet, fingerprint, now, preempt=False)
    if now_there is None:
        return (f"option {option.option_id} no longer holds: {where} can no longer free enough GPUs "
                f"{'before its deadline' if task.sla.deadline is not None else 'for it'}")
    agreed = contract_for(task, option, "").max_queue_s
    if agreed is not None and now_there.queue_s > agreed + QUEUE_SLACK_S:
        return (f"option {option.option_id} no longer holds: {where} is taken; it would start in "
                f"{now_there.queue_s:.0f} s, not within the {agreed:.0f} s offered")
    return None


class OfferBook:
    """Tracks open offers; turns replies into contracts or rejections and expires the silent."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        """``clock`` gives the current time in seconds (injectable for tests and replay)."""
        self._clock = clock
        self._open: dict[str, _Open] = {}
        self._closed: dict[str, tuple[str, Admit | Reject]] = {}  # offer id -> (its task, outcome)
        self._count = 0

    def open(self, task: TaskSubmitted, counter: CounterOffer, tenant: str = "") -> SlaOffer:
        """Record ``counter`` for ``task`` and return the ``sla.offer`` event to publish."""
        self._count += 1
        offer_id = f"{task.task_id}/offer-{self._count}"
        offer = SlaOffer(offer_id=offer_id, task_id=task.task_id, tenant=tenant or task.tenant, asked=task.sla,
                         options=list(counter.options), reason=counter.reason,
                         valid_until=counter.valid_until, at=self._clock())
        self._open[offer_id] = _Open(offer=offer, task=task)
        return offer

    @property
    def pending(self) -> list[SlaOffer]:
        """Offers still waiting for an answer, oldest first."""
        return [o.offer for o in self._open.values()]

    def task_of(self, offer_id: str) -> TaskSubmitted | None:
        """The submission an open offer is about (to build ``task.admitted``)."""
        entry = self._open.get(offer_id)
        return entry.task if entry is not None else None

    def reply(self, reply: SlaReply) -> Admit | Reject:
        """Apply the client's answer.

        Accepting a listed option gives :class:`Admit`; declining gives ``offer_declined``;
        answering after ``valid_until`` gives ``offer_expired``; an unknown offer, or one
        about another task, gives ``invalid``. Accepting an option the offer does not list
        raises ``ValueError`` and leaves the offer open for a correct answer.
        """
        closed = self._closed.get(reply.offer_id)
        if closed is not None and closed[0] == reply.task_id:
            return closed[1]
        entry = self._open.get(reply.offer_id)
        if entry is None or entry.offer.task_id != reply.task_id:
            return Reject("invalid", f"no open offer {reply.offer_id!r} for task {reply.task_id!r}", reply.task_id)
        offer = entry.offer
        if self._clock() > offer.valid_until:
            return self._close(offer, Reject("offer_expired", "the offer expired before the answer came",
                                             offer.task_id))
        if not reply.accept:
            return self._close(offer, Reject("offer_declined", "the client declined every option",
                                             offer.task_id))
        option = next((o for o in offer.options if o.option_id == reply.option_id), None)
        if option is None:
            raise ValueError(f"offer {offer.offer_id} has no option {reply.option_id!r}")
        return self._close(offer, Admit(contract_for(entry.task, option, offer.offer_id)))

    def expire(self) -> list[Reject]:
        """Close every offer past its ``valid_until`` with ``offer_expired``; the rejections to publish."""
        now = self._clock()
        due = [entry.offer for entry in self._open.values() if now > entry.offer.valid_until]
        rejects = [Reject("offer_expired", "no answer before the offer expired", o.task_id) for o in due]
        for offer, reject in zip(due, rejects, strict=True):
            self._close(offer, reject)
        return rejects

    def _close(self, offer: SlaOffer, outcome: Admit | Reject) -> Admit | Reject:
        self._open.pop(offer.offer_id, None)
        # Kept with its task: a reply naming another task must not be given this outcome.
        self._closed[offer.offer_id] = (offer.task_id, outcome)
        return outcome
