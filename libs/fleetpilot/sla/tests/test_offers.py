"""The offer book: accept makes a contract, decline and silence reject, replies are idempotent."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from fleetpilot.contracts import SlaReply, SlaRequest, TaskSubmitted
from fleetpilot.sla import Admit, CounterOffer, FleetView, GpuPool, OfferBook, Reject, negotiate

T0 = 50_000.0
FLEET = FleetView(pools=(
    GpuPool(site="eu-1", gpu_model="A100", memory_mb_per_gpu=81_920, price_per_gpu_hour=2.0, free_gpus=1),
    GpuPool(site="us-1", gpu_model="H100", memory_mb_per_gpu=81_920, price_per_gpu_hour=4.0,
            completions=((240.0, 1),), relative_compute=2.0),
), bandwidth_gbps={("us-1", "eu-1"): 0.2}, local_bandwidth_gbps=10.0)
TASK = TaskSubmitted(task_id="t9", tenant="acme", kind="infer", size_gb=2.0, labels={"data_site": "us-1"},
                     sla=SlaRequest(tier="standard", warmup_ms=250, max_queue_s=30))


class Clock:
    """A hand-moved clock."""

    def __init__(self) -> None:
        self.at = T0

    def __call__(self) -> float:
        return self.at


def _open():
    clock = Clock()
    book = OfferBook(clock=clock)
    counter = negotiate(TASK, FLEET, now=clock())
    assert isinstance(counter, CounterOffer)
    offer = book.open(TASK, counter)
    return clock, book, offer


def test_open_publishes_offer():
    _, book, offer = _open()
    assert offer.task_id == "t9" and offer.tenant == "acme" and offer.asked == TASK.sla
    assert offer.valid_until == T0 + 300 and len(offer.options) == 2
    assert book.pending == [offer] and book.task_of(offer.offer_id) == TASK


def test_accept_makes_contract_with_relaxed_terms():
    _, book, offer = _open()
    h100 = next(o for o in offer.options if o.gpu_model == "H100")
    out = book.reply(SlaReply(offer_id=offer.offer_id, task_id="t9", accept=True, option_id=h100.option_id))
    assert isinstance(out, Admit)
    c = out.contract
    # The option's model first, then the others its terms hold on (the A100 the task asked too).
    assert (c.gpu_models, c.site, c.offer_id) == (h100.gpu_models, "us-1", offer.offer_id)
    assert c.gpu_models[0] == "H100" and "A100" in c.gpu_models
    assert c.max_queue_s == 240 and c.warmup_ms == 250 and c.not_before == T0 + 240
    assert book.pending == []


# (reply accept?, option, clock advance, expected code)
REPLIES = [
    (False, None, 10.0, "offer_declined"),
    (True, "o1", 301.0, "offer_expired"),
    (False, None, 301.0, "offer_expired"),
]


@pytest.mark.parametrize("accept,option,advance,code", REPLIES)
def test_rejecting_replies(accept, option, advance, code):
    clock, book, offer = _open()
    clock.at += advance
    out = book.reply(SlaReply(offer_id=offer.offer_id, task_id="t9", accept=accept, option_id=option))
    assert isinstance(out, Reject) and out.code == code and out.task_id == "t9"
    again = book.reply(SlaReply(offer_id=offer.offer_id, task_id="t9", accept=True, option_id="o1"))
    assert again == out  # a redelivered or late reply gets the same answer


def test_expire_sweeps_only_due_offers():
    clock, book, first = _open()
    clock.at += 200
    second = book.open(TASK, negotiate(TASK, FLEET, now=clock()))
    assert book.expire() == []
    clock.at = T0 + 301
    rejects = book.expire()
    assert [r.code for r in rejects] == ["offer_expired"] and book.pending == [second]
    assert book.reply(SlaReply(offer_id=first.offer_id, task_id="t9", accept=True, option_id="o1")).code \
        == "offer_expired"


@pytest.mark.parametrize("offer_id,task_id", [("nope", "t9"), (None, "other-task")])
def test_unknown_offer_is_invalid(offer_id, task_id):
    _, book, offer = _open()
    out = book.reply(SlaReply(offer_id=offer_id or offer.offer_id, task_id=task_id, accept=True, option_id="o1"))
    assert isinstance(out, Reject) and out.code == "invalid"
    assert book.pending == [offer]


def test_unknown_option_keeps_offer_open():
    _, book, offer = _open()
    with pytest.raises(ValueError, match="no option"):
        book.reply(SlaReply(offer_id=offer.offer_id, task_id="t9", accept=True, option_id="o99"))
    assert book.pending == [offer]
    assert isinstance(book.reply(SlaReply(offer_id=offer.offer_id, task_id="t9", accept=True, option_id="o1")), Admit)


def test_offer_and_admission_survive_the_wire():
    from fleetpilot.contracts import SlaOffer, TaskAdmitted, decode, encode

    _, book, offer = _open()
    assert decode(encode(offer), SlaOffer) == offer
    out = book.reply(SlaReply(offer_id=offer.offer_id, task_id="t9", accept=True, option_id="o2"))
    admitted = TaskAdmitted(task=TASK, contract=out.contract, tenant="acme", admitted_at=T0)
    assert decode(encode(admitted), TaskAdmitted) == admitted


def test_a_reply_naming_another_task_gets_nothing_of_a_closed_offer():
    """A closed offer answered a reply that named another task with its own outcome: the
    accepted offer's contract came back as that other task's admission."""
    _, book, offer = _open()
    accepted = book.reply(SlaReply(offer_id=offer.offer_id, task_id="t9", accept=True, option_id="o1"))
    assert isinstance(accepted, Admit)
    out = book.reply(SlaReply(offer_id=offer.offer_id, task_id="other-task", accept=False))
    assert isinstance(out, Reject) and out.code == "invalid" and out.task_id == "other-task"
    assert book.reply(SlaReply(offer_id=offer.offer_id, task_id="t9", accept=False)) == accepted


def _pools(h100: GpuPool | None) -> FleetView:
    return FleetView(pools=tuple(p for p in (FLEET.pools[0], h100) if p is not None),
                     bandwidth_gbps=FLEET.bandwidth_gbps, local_bandwidth_gbps=FLEET.local_bandwidth_gbps)


def test_an_option_holds_while_its_pool_still_frees_in_the_wait_offered():
    from fleetpilot.sla import option_lapsed

    _, _, offer = _open()
    h100 = next(o for o in offer.options if o.gpu_model == "H100")  # the H100 frees in 240 s
    assert option_lapsed(TASK, h100, FLEET, now=T0) is None
    # A minute later it frees in 180 s: sooner than offered is no reason to refuse.
    later = _pools(dataclasses.replace(FLEET.pools[1], completions=((180.0, 1),)))
    assert option_lapsed(TASK, h100, later, now=T0 + 60) is None


def test_an_option_whose_pool_was_taken_or_left_the_fleet_lapses():
    from fleetpilot.sla import option_lapsed

    _, _, offer = _open()
    h100 = next(o for o in offer.options if o.gpu_model == "H100")
    # Another task took the H100 that was to free: the next frees in an hour.
    taken = _pools(dataclasses.replace(FLEET.pools[1], completions=((3600.0, 1),)))
    why = option_lapsed(TASK, h100, taken, now=T0 + 5)
    assert why is not None and "H100 at us-1 is taken" in why and "3600 s, not within the 240 s offered" in why
    never = _pools(dataclasses.replace(FLEET.pools[1], completions=()))
    assert "can no longer free enough GPUs" in option_lapsed(TASK, h100, never, now=T0 + 5)
    assert "no H100 at us-1 now" in option_lapsed(TASK, h100, _pools(None), now=T0 + 5)


def test_an_unbounded_wait_never_lapses_for_a_longer_queue_but_a_deadline_does():
    from fleetpilot.sla import option_lapsed

    unbounded = msgspec.structs.replace(TASK, sla=msgspec.structs.replace(TASK.sla, max_queue_s=None))
    _, _, offer = _open()
    h100 = next(o for o in offer.options if o.gpu_model == "H100")
    taken = _pools(dataclasses.replace(FLEET.pools[1], completions=((3600.0, 1),)))
    assert option_lapsed(unbounded, h100, taken, now=T0 + 5) is None  # its contract bounds no wait
    due = msgspec.structs.replace(unbounded, expected_duration_s=600.0,
                                  sla=msgspec.structs.replace(unbounded.sla, deadline=T0 + 1800))
    assert "before its deadline" in option_lapsed(due, h100, taken, now=T0 + 5)


@pytest.mark.parametrize(("terms", "bound"), [
    ({}, False),  # a wait, a price, a p95: the models' or the clock's, not the site's
    ({"max_queue_s": 60.0, "cost_ceiling_per_hour": 3.0, "p95_latency_ms": 20.0}, False),
    ({"warmup_ms": 500.0}, True),  # the data's trip to the site
    ({"deadline": T0 + 3600}, True),  # the warm-up counts towards it
])
def test_an_accepted_offer_s_site_binds_only_where_a_term_depends_on_it(terms, bound):
    from fleetpilot.contracts import Contract  # noqa: PLC0415
    from fleetpilot.sla import site_bound  # noqa: PLC0415

    assert site_bound(Contract(site="us-1", offer_id="o", **terms)) is bound


def test_an_option_of_an_earlier_version_binds_its_site_alone():
    """An offer made before options listed sites, accepted now: its contract lists none, and
    its warm-up bound holds it to the option's site, as it did then."""
    from fleetpilot.sla import bound_sites, contract_for  # noqa: PLC0415

    _, _, offer = _open()
    h100 = next(o for o in offer.options if o.gpu_model == "H100")
    old = msgspec.structs.replace(h100, sites=[])
    contract = contract_for(TASK, old, offer.offer_id)
    assert contract.sites == [] and bound_sites(contract) == ["us-1"]
    # Made now, the option lists its sites, and its contract takes them.
    assert contract_for(TASK, h100, offer.offer_id).sites == h100.sites == ["us-1"]


def test_an_old_contract_without_sites_decodes_and_binds_as_it_did():
    """Stored admissions and decisions from before contracts listed sites: they decode, list
    none, and bind an accepted offer with a warm-up bound to its site, an admission to none."""
    from fleetpilot.contracts import TaskAdmitted, decode  # noqa: PLC0415
    from fleetpilot.sla import bound_sites  # noqa: PLC0415

    def stored(contract: str) -> bytes:
        return (b'{"type":"task.admitted.v1","task":{"type":"task.submitted.v1","task_id":"t"},'
                b'"tenant":"acme","admitted_at":1.0,"contract":' + contract.encode() + b"}")

    offered = decode(stored('{"warmup_ms":500.0,"site":"us-1","offer_id":"o"}'), TaskAdmitted)
    asked = decode(stored('{"warmup_ms":500.0,"site":"us-1"}'), TaskAdmitted)
    assert offered.contract.sites == [] and asked.contract.sites == []
    assert bound_sites(offered.contract) == ["us-1"] and bound_sites(asked.contract) == []
