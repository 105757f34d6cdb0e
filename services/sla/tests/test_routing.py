"""What the negotiator publishes for each answer, on the in-memory bus and as pure functions.

The JetStream behaviour (durable consumers, de-duplication, a restart) is tested against a
real nats-server in ``test_sla_service.py``; here only the routing: which event, which
subject, which contract, and how the admitted task is shaped for the policy.
"""

from __future__ import annotations

import time

import msgspec
import pytest
from fleetpilot.auth import KeyRing, mint_token, save_jwks
from fleetpilot.contracts import (
    BandwidthEstimate,
    Contract,
    GpuInfo,
    NodeTopology,
    OfferOption,
    SlaOffer,
    SlaReply,
    SlaRequest,
    TaskAdmitted,
    TaskRejected,
    TaskSubmitted,
    TopologyUpdated,
    decode,
    encode,
)
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import InMemoryBus, Reject
from fleetpilot.sla import Admit
from fleetpilot_services.sla.service import SlaSettings, admission, build, reply_received_at, settle_reply
from fleetpilot_services.sla.store import OfferRecord, offer_key


def decode_record(entry) -> OfferRecord:
    return msgspec.json.decode(entry.value, type=OfferRecord)

T0 = 1_000.0
TASK = TaskSubmitted(task_id="t1", tenant="acme", gpus=1, gpu_models=["H100"],
                     sla=SlaRequest(max_queue_s=5, warmup_ms=100))
OFFER = SlaOffer(offer_id="t1/x", task_id="t1", tenant="acme", asked=TASK.sla, valid_until=T0 + 30, at=T0,
                 options=[OfferOption(option_id="o1", gpu_model="A100-40GB", site="a", warmup_ms=50,
                                      expected_queue_s=0, why="other model"),
                          OfferOption(option_id="o2", gpu_model="H100", site="b", warmup_ms=50,
                                      expected_queue_s=120, not_before=T0 + 120, why="wait")])
RECORD = OfferRecord(offer=OFFER, task=TASK)


def reply(accept: bool, option: str | None = None) -> SlaReply:
    return SlaReply(offer_id="t1/x", task_id="t1", accept=accept, option_id=option)


def test_accepting_another_model_pins_the_task_to_it():
    out = settle_reply(RECORD, reply(True, "o1"), T0 + 1)
    assert isinstance(out, TaskAdmitted)
    assert out.task.gpu_models == ["A100-40GB"] and out.contract.gpu_models == ["A100-40GB"]
    assert out.contract.offer_id == "t1/x" and out.contract.site == "a" and out.tenant == "acme"


def test_accepting_the_wait_keeps_the_model_and_sets_not_before():
    out = settle_reply(RECORD, reply(True, "o2"), T0 + 1)
    assert isinstance(out, TaskAdmitted)
    assert out.task.gpu_models == ["H100"]
    assert out.contract.not_before == T0 + 120 and out.contract.max_queue_s == 120


@pytest.mark.parametrize(("answer", "at", "code"), [
    (reply(False), T0 + 1, "offer_declined"),
    (reply(True, "o1"), T0 + 31, "offer_expired"),
    (reply(False), T0 + 31, "offer_expired"),
])
def test_declined_or_late_answers_reject(answer, at, code):
    out = settle_reply(RECORD, answer, at)
    assert isinstance(out, TaskRejected) and out.code == code and out.task_id == "t1"


@pytest.mark.parametrize(("received_at", "code"), [
    (T0 + 29, None),  # stored in time, handled late (at T0 + 31): admitted
    (T0 + 30, None),  # at the last moment of its validity
    (T0 + 30.5, "offer_expired"),  # stored late: expired, however soon it is handled
])
def test_a_reply_is_late_by_when_it_was_received_not_when_it_is_handled(received_at, code):
    out = settle_reply(RECORD, reply(True, "o1"), T0 + 31, received_at=received_at)
    assert (out.code if isinstance(out, TaskRejected) else None) == code
    assert (out.rejected_at if isinstance(out, TaskRejected) else out.admitted_at) == T0 + 31


@pytest.mark.parametrize(("stored_at", "handled_at", "received"), [
    (T0 + 29, T0 + 31, T0 + 29),  # a backlog: the server's stored time
    (T0 + 33, T0 + 31, T0 + 31),  # a server clock ahead: never later than handled
    (None, T0 + 31, T0 + 31),  # not known (a core message): when handled
])
def test_when_a_reply_was_received(stored_at, handled_at, received):
    assert reply_received_at(stored_at, handled_at) == received


class MovedClock:
    """Wall-clock time moved by hand, shared by the bus (its stored times) and the service."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


async def test_on_the_in_memory_bus_a_reply_waiting_past_the_validity_is_admitted_one_sent_late_expired(tmp_path):
    clock = MovedClock()
    ring = KeyRing()
    ring.signing_key()
    save_jwks(ring.public_jwks(), tmp_path / "jwks.json")
    bus = InMemoryBus(clock=clock)
    await bus.ensure_topology()
    await (await bus.kv("topology")).put(node_key("n1"), encode(NodeTopology(node="n1", site="a", gpus=[
        GpuInfo(index=i, model="A100-40GB", memory_mb=40_960) for i in range(2)])))  # one per open offer
    host = build(SlaSettings(nats_url="unused", metrics_port=-1, jwks_path=str(tmp_path / "jwks.json"),
                             issuer="iss", offer_validity_s=30, reply_grace_s=10), clock=clock)
    await host.start(bus)
    auth = {"Authorization": f"Bearer {mint_token(ring, tenant='acme', audience='fleetpilot', issuer='iss', ttl_s=3600)}"}
    try:
        for task_id in ("waited", "late"):
            await bus.publish(TaskSubmitted(task_id=task_id, gpus=1, sla=SlaRequest(max_queue_s=0, warmup_ms=1),
                                            size_gb=1.0), headers=auth)
        await bus.settle()
        offers = {e.task_id: e for s, e in published(bus, "SLA") if isinstance(e, SlaOffer)}
        assert set(offers) == {"waited", "late"}

        def accept(task_id: str) -> SlaReply:
            return SlaReply(offer_id=offers[task_id].offer_id, task_id=task_id, accept=True,
                            option_id=offers[task_id].options[0].option_id)

        await bus.publish(accept("waited"), headers=auth)  # stored now, in time...
        clock.offset += 35  # ...and handled 35 s later, past the validity (not the grace)
        await bus.settle()
        clock.offset += 1
        await bus.publish(accept("late"), headers=auth)  # stored past the validity
        await bus.settle()
        answers = {(e.task.task_id if isinstance(e, TaskAdmitted) else e.task_id): e
                   for s, e in published(bus, "TASKS") if s in ("task.admitted", "task.rejected")}
        assert isinstance(answers["waited"], TaskAdmitted)
        assert answers["waited"].contract.offer_id == offers["waited"].offer_id
        assert isinstance(answers["late"], TaskRejected) and answers["late"].code == "offer_expired"
    finally:
        await host.stop()


def test_an_option_the_offer_does_not_list_is_dead_lettered():
    with pytest.raises(Reject):
        settle_reply(RECORD, reply(True, "o9"), T0 + 1)


@pytest.mark.parametrize(("task", "pinned"), [
    (TASK, ["H100-SXM"]),                                            # bounded: pinned to the estimate
    (TaskSubmitted(task_id="t2", gpus=1, gpu_models=["H100"]), ["H100-SXM"]),  # a model list: pinned
    (TaskSubmitted(task_id="t3", gpus=1), []),                       # anything goes: the policy may pack
])
def test_admission_pins_the_model_only_when_the_ask_depends_on_it(task, pinned):
    adm = admission(task, Admit(Contract(gpu_models=["H100-SXM"], site="b")), T0)
    assert adm.task.gpu_models == pinned and adm.contract.gpu_models == pinned
    assert adm.contract.site == "b"


# -- the service on the in-memory bus --------------------------------------------------

@pytest.fixture
async def service(tmp_path):
    ring = KeyRing()
    ring.signing_key()  # the ring creates its first key lazily: publish it
    save_jwks(ring.public_jwks(), tmp_path / "jwks.json")
    bus = InMemoryBus()
    await bus.ensure_topology()
    topology = await bus.kv("topology")
    await topology.put(node_key("n1"), encode(NodeTopology(node="n1", site="a", gpus=[
        GpuInfo(index=0, model="A100-40GB", memory_mb=40_960)])))
    host = build(SlaSettings(nats_url="unused", metrics_port=-1, jwks_path=str(tmp_path / "jwks.json"),
                             issuer="iss", offer_validity_s=30))
    await host.start(bus)
    token = mint_token(ring, tenant="acme", audience="fleetpilot", issuer="iss", ttl_s=600)
    yield bus, {"Authorization": f"Bearer {token}"}
    await host.stop()


def published(bus: InMemoryBus, stream: str) -> list:
    return [(subject, decode(data, TaskAdmitted, TaskRejected, SlaOffer, SlaReply, TaskSubmitted))
            for subject, data in bus.stored(stream)]


async def test_routes_admit_offer_accept_and_unauthenticated(service):
    bus, auth = service
    fits = TaskSubmitted(task_id="fits", gpus=1)
    too_big = TaskSubmitted(task_id="two", gpus=1, sla=SlaRequest(max_queue_s=0, warmup_ms=1), size_gb=1.0)
    await bus.publish(fits, headers=auth)
    await bus.publish(too_big, headers=auth)
    await bus.publish(TaskSubmitted(task_id="anon", gpus=1))
    await bus.settle()
    tasks = {(s, getattr(e, "task_id", None) or e.task.task_id): e for s, e in published(bus, "TASKS")
             if s != "task.submitted"}
    assert set(tasks) == {("task.admitted", "fits"), ("task.rejected", "anon")}, tasks
    assert tasks[("task.rejected", "anon")].code == "unauthenticated"
    ((subject, offer),) = published(bus, "SLA")
    assert subject == "sla.offer.two" and isinstance(offer, SlaOffer) and offer.tenant == "acme"

    await bus.publish(SlaReply(offer_id=offer.offer_id, task_id="two", accept=True,
                               option_id=offer.options[0].option_id), headers=auth)
    await bus.settle()
    adm = [e for s, e in published(bus, "TASKS") if s == "task.admitted" and e.task.task_id == "two"]
    assert len(adm) == 1 and adm[0].contract.offer_id == offer.offer_id
    assert adm[0].contract.warmup_ms == pytest.approx(offer.options[0].warmup_ms)


async def test_quotes_use_the_bandwidth_of_the_latest_topology_update(service):
    bus, auth = service
    far = TaskSubmitted(task_id="far", gpus=1, size_gb=2.0, labels={"data_site": "b"},
                        sla=SlaRequest(warmup_ms=1))

    async def quoted_warmup() -> float:
        answer = decode(await bus.request("sla.negotiate", encode(far), headers=auth), SlaOffer, TaskAdmitted,
                        TaskRejected)
        assert isinstance(answer, SlaOffer)
        return answer.options[0].warmup_ms

    assert await quoted_warmup() == pytest.approx(2000.0)  # the default 1 GB/s across sites
    await bus.publish(TopologyUpdated(revision=1, nodes=[], at=T0, bandwidth=[
        BandwidthEstimate(a_site="a", b_site="b", strategy="min_rtt", effective_gbps=16.0),
        BandwidthEstimate(a_site="a", b_site="b", strategy="balanced", effective_gbps=64.0)]))
    await bus.settle()
    assert await quoted_warmup() == pytest.approx(1000.0)  # 16 Gbit/s = 2 GB/s, min_rtt
    assert bus.stored("SLA") == []  # a quote is never published


async def test_a_finished_task_s_contract_is_forgotten():
    from fleetpilot.contracts import Contract, TaskAdmitted, TaskSubmitted
    from fleetpilot.runtime import InMemoryBus
    from fleetpilot_services.sla.store import ContractStore, contract_key

    bus = InMemoryBus()
    await bus.ensure_topology()
    store = await ContractStore.open(bus)
    task = TaskSubmitted(task_id="done-1", submitted_at=1.0)
    await store.record_admission(TaskAdmitted(task=task, contract=Contract(), tenant="t", admitted_at=1.0))
    kv = await bus.kv("contracts")
    assert await kv.get(contract_key("done-1")) is not None
    await store.forget("done-1")
    assert await kv.get(contract_key("done-1")) is None
    assert "done-1" not in store.admitted


async def test_a_p95_reference_label_in_words_is_rejected_invalid_not_retried(service):
    # It raised out of the negotiator: five deliveries, then a dead letter, and no answer to
    # the submitter; a quote got no reply at all.
    bus, auth = service
    wordy = TaskSubmitted(task_id="wordy", gpus=1, kind="infer", labels={"p95_ref_ms": "fast"})
    quoted = decode(await bus.request("sla.negotiate", encode(wordy), headers=auth), SlaOffer, TaskAdmitted,
                    TaskRejected)
    assert isinstance(quoted, TaskRejected) and quoted.code == "invalid" and "p95_ref_ms" in quoted.reason
    await bus.publish(wordy, headers=auth)
    await bus.settle()
    answers = [e for s, e in published(bus, "TASKS") if s == "task.rejected"]
    assert [(e.task_id, e.code) for e in answers] == [("wordy", "invalid")]


async def test_a_task_whose_warm_up_overflows_is_answered_infeasible_not_dead_lettered(service):
    # 1e308 GB over any link is an infinite warm-up: the offer holding it could not be
    # encoded, so the submission was dead-lettered ("unencodable") and never answered.
    bus, auth = service
    await bus.publish(TaskSubmitted(task_id="huge", gpus=1, size_gb=1e308, sla=SlaRequest(warmup_ms=250)),
                      headers=auth)
    await bus.settle()
    assert bus.stored("DLQ") == []
    answers = [e for s, e in published(bus, "TASKS") if s == "task.rejected"]
    assert [(e.task_id, e.code) for e in answers] == [("huge", "infeasible")]


async def test_an_invalid_submission_is_rejected_invalid_before_any_node_has_reported(tmp_path):
    # It waited for the fleet (FLEET_WAIT_S) although no fleet could change its answer, then
    # was retried and dead-lettered "max_deliver": the submitter never heard why; a quote
    # said "infeasible: no fleet topology known yet".
    ring = KeyRing()
    ring.signing_key()
    save_jwks(ring.public_jwks(), tmp_path / "jwks.json")
    bus = InMemoryBus()
    await bus.ensure_topology()
    host = build(SlaSettings(nats_url="unused", metrics_port=-1, jwks_path=str(tmp_path / "jwks.json"),
                             issuer="iss", fleet_wait_s=0))
    await host.start(bus)
    try:
        token = mint_token(ring, tenant="acme", audience="fleetpilot", issuer="iss", ttl_s=600)
        auth = {"Authorization": f"Bearer {token}"}
        bad = TaskSubmitted(task_id="bad", gpus=1, gpu_milli=0)
        quoted = decode(await bus.request("sla.negotiate", encode(bad), headers=auth), SlaOffer, TaskAdmitted,
                        TaskRejected)
        assert isinstance(quoted, TaskRejected) and quoted.code == "invalid" and "gpu_milli" in quoted.reason
        await bus.publish(bad, headers=auth)
        await bus.settle()
        answers = [e for s, e in published(bus, "TASKS") if s == "task.rejected"]
        assert [(e.task_id, e.code) for e in answers] == [("bad", "invalid")]
        assert bus.stored("DLQ") == []
    finally:
        await host.stop()


async def test_a_submission_of_a_task_whose_offer_was_accepted_gets_that_admission(service):
    # The reply path closes the offer (accepted), then writes the contract. A client's retry
    # of the submission read between the two (or after a lost contract write) found no
    # contract and negotiated afresh: a second admission under other terms, or a new open
    # offer written over the accepted one, to expire into offer_expired for an admitted task.
    bus, auth = service
    asked = TaskSubmitted(task_id="acc", tenant="acme", gpus=1, sla=SlaRequest(max_queue_s=5))
    option = OfferOption(option_id="o1", gpu_model="A100-40GB", site="a", expected_queue_s=60,
                         not_before=T0 + 60, why="wait")
    offer = SlaOffer(offer_id="acc/x", task_id="acc", tenant="acme", asked=asked.sla, options=[option],
                     valid_until=T0 + 30, at=T0)
    accepted = settle_reply(OfferRecord(offer=offer, task=asked),
                            SlaReply(offer_id="acc/x", task_id="acc", accept=True, option_id="o1"), T0 + 1)
    kv = await bus.kv("contracts")
    closed = OfferRecord(offer=offer, task=asked, state="accepted", outcome=accepted)
    await kv.put(offer_key("acc"), encode(closed))
    await bus.publish(asked, headers=auth)
    await bus.settle()
    answers = [e for s, e in published(bus, "TASKS") if s in ("task.admitted", "task.rejected")]
    assert answers == [accepted]
    record = decode_record(await kv.get(offer_key("acc")))
    assert record.state == "accepted" and record.outcome == accepted


async def test_the_expiry_job_leaves_a_newer_offer_open_when_its_view_still_holds_the_old_one():
    # The expiry job finds offers past their validity in the watched view, then closes what
    # the bucket holds. A view lagging behind another replica (which expired the old offer and
    # opened one for a resubmission) made it close the new offer at once, before its validity:
    # the client's acceptance a moment later was answered offer_expired.
    from fleetpilot.ledger import FleetView as TopologyView
    from fleetpilot.ledger import LedgerStore
    from fleetpilot.runtime import InMemoryBus
    from fleetpilot_services.sla.service import Negotiator
    from fleetpilot_services.sla.store import ContractStore

    bus = InMemoryBus()
    await bus.ensure_topology()
    store = ContractStore(await bus.kv("contracts"), await bus.kv("rejections"))  # not watching: a lagging view
    negotiator = Negotiator(bus, SlaSettings(nats_url="unused", metrics_port=-1, reply_grace_s=0.0), lambda: T0 + 31,
                            await TopologyView.open(bus), await LedgerStore.open(bus), store)
    newer = OfferRecord(offer=msgspec.structs.replace(OFFER, offer_id="t1/y", at=T0 + 20, valid_until=T0 + 50),
                        task=TASK)
    await (await bus.kv("contracts")).put(offer_key("t1"), encode(newer))
    store.open_offers["t1"] = RECORD  # the old offer, past its validity at T0 + 31
    assert await negotiator.expire() == []
    stored = decode_record(await (await bus.kv("contracts")).get(offer_key("t1")))
    assert stored.state == "open" and stored.offer.offer_id == "t1/y"
