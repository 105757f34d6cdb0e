"""The sla service over a real nats-server: admit, counter-offer and its answers, tokens.

Each test starts its own nats-server (the ``nats_url`` fixture), writes a key ring's JWKS
into ``tmp_path``, puts a two-node fleet into the topology bucket (two A100-40GB at
site-a, two H100 at site-b) and runs the service host in the test's event loop. A watcher
on core NATS records everything published on ``task.>``, ``sla.>`` and ``decision.made``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time

import jwt
import msgspec
import pytest
from fleetpilot.auth import DAY_S, WEEK_S, KeyRing, mint_token, save_jwks
from fleetpilot.contracts import (
    Allocation,
    Contract,
    DecisionMade,
    GpuInfo,
    NodeLedger,
    NodeTopology,
    SlaOffer,
    SlaReply,
    SlaRequest,
    TaskAdmitted,
    TaskLifecycle,
    TaskRejected,
    TaskSubmitted,
    decode,
    encode,
    msg_id_for,
)
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import Reject
from fleetpilot.runtime.nats_bus import NatsBus
from fleetpilot.runtime.testing import eventually
from fleetpilot_services.policy.service import build as build_policy
from fleetpilot_services.policy.settings import PolicySettings
from fleetpilot_services.sla.service import SlaSettings, build
from fleetpilot_services.sla.store import CLAIM_STALE_S, NegotiationClaim, claim_key, contract_key

AUDIENCE, ISSUER = "fleetpilot", "test-issuer"


class Clock:
    """A clock that starts at the wall clock and is moved by hand (key rotation, expiry)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


def node(name: str, site: str, model: str, memory_mb: int) -> NodeTopology:
    return NodeTopology(node=name, site=site, cpu_milli=64_000, memory_mb=512_000,
                        gpus=[GpuInfo(index=i, model=model, memory_mb=memory_mb) for i in range(2)])


FLEET = [node("a100-00", "site-a", "A100-40GB", 40_960), node("h100-00", "site-b", "H100", 81_559)]


class Recorder:
    """Everything published on the watched subjects, decoded, in arrival order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    async def on_msg(self, msg) -> None:
        if msg.subject.startswith("sla.offer."):
            self.seen.append((msg.subject, decode(msg.data, SlaOffer)))
        elif msg.subject == "task.admitted":
            self.seen.append((msg.subject, decode(msg.data, TaskAdmitted)))
        elif msg.subject == "task.rejected":
            self.seen.append((msg.subject, decode(msg.data, TaskRejected)))
        elif msg.subject == "decision.made":
            self.seen.append((msg.subject, decode(msg.data, DecisionMade)))

    def about(self, task_id: str) -> list[tuple[str, object]]:
        return [(s, e) for s, e in self.seen if getattr(e, "task_id", None) == task_id
                or (isinstance(e, TaskAdmitted) and e.task.task_id == task_id)]

    async def wait(self, subject: str, task_id: str, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for s, event in self.about(task_id):
                if s == subject:
                    return event
            await asyncio.sleep(0.02)
        raise AssertionError(f"nothing on {subject} for {task_id}; saw {self.about(task_id)}")


class Rig:
    """A nats-server with the fleet loaded, a key ring, a client bus and the sla service."""

    def __init__(self, nats_url: str, tmp_path, clock: Clock) -> None:
        self.url, self.tmp, self.clock = nats_url, tmp_path, clock
        self.ring = KeyRing(clock=clock)
        self.ring.signing_key()
        self.jwks = tmp_path / "jwks.json"
        self.publish_keys()
        self.recorder = Recorder()
        self.hosts = []
        self.replicas = 0  # negotiators opened by ``negotiator_on``, each its own replica

    def publish_keys(self) -> None:
        save_jwks(self.ring.public_jwks(), self.jwks)

    def token(self, tenant: str = "acme", **kw) -> str:
        return mint_token(self.ring, tenant=tenant, audience=kw.pop("audience", AUDIENCE),
                          issuer=kw.pop("issuer", ISSUER), ttl_s=kw.pop("ttl_s", 3600), **kw)

    async def __aenter__(self) -> Rig:
        self.bus = await NatsBus.connect(self.url, "test-client")
        await self.bus.ensure_topology()
        topology = await self.bus.kv("topology")
        for n in FLEET:
            await topology.put(node_key(n.node), encode(n))
        # Not "sla.>": a listener on sla.negotiate would turn a missing endpoint's "no
        # responders" into a silent timeout, and hide which of the two a failure was.
        for subject in ("task.>", "sla.offer.>", "decision.made"):
            await self.bus._nc.subscribe(subject, cb=self.recorder.on_msg)
        return self

    async def start_sla(self, **settings) -> None:
        defaults = dict(nats_url=self.url, metrics_port=-1, jwks_path=str(self.jwks), issuer=ISSUER,
                        audience=AUDIENCE, state_dir=str(self.tmp), offer_validity_s=30.0, expiry_interval_s=0.2)
        self.sla = build(SlaSettings(**{**defaults, **settings}), clock=self.clock)
        await self.sla.start()
        self.hosts.append(self.sla)

    async def start_policy(self) -> None:
        policy = build_policy(PolicySettings(nats_url=self.url, metrics_port=-1, state_dir=str(self.tmp)))
        await policy.start()
        self.hosts.append(policy)

    async def submit(self, task: TaskSubmitted, token: str | None) -> None:
        headers = {"Nats-Msg-Id": msg_id_for(task)}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        await self.bus.publish_raw("task.submitted", encode(task), headers=headers)

    async def reply(self, reply: SlaReply, token: str) -> None:
        await self.bus.publish(reply, headers={"Authorization": f"Bearer {token}"})

    async def quote(self, task: TaskSubmitted, headers: dict[str, str] | None = None) -> bytes:
        """Ask ``sla.negotiate``; a timeout says what the service's endpoint saw (requests,
        errors), so a failure tells a lost request from a handler that never answered."""
        try:
            return await self.bus.request("sla.negotiate", encode(task), headers=headers, timeout_s=15)
        except TimeoutError as exc:
            micro = self.sla.bus._micro  # type: ignore[union-attr]
            seen = [(e.name, e.num_requests, e.num_errors, e.last_error) for e in micro.stats().endpoints]
            raise AssertionError(f"{exc}; endpoints (name, requests, errors, last error): {seen}") from exc

    def refused(self, reason: str) -> float:
        return self.sla.metrics.registry.get_sample_value("fleetpilot_sla_unauthenticated_total",
                                                          {"reason": reason}) or 0.0

    def answers(self) -> dict[tuple[str, str, str], float]:
        """``fleetpilot_sla_answers_total`` as the service serves it: (answer, tier, code) → count."""
        return {(s.labels["answer"], s.labels["tier"], s.labels["code"]): s.value
                for family in self.sla.metrics.registry.collect() for s in family.samples
                if s.name == "fleetpilot_sla_answers_total"}

    def offers_closed(self) -> dict[str, float]:
        """``fleetpilot_sla_offers_closed_total`` as the service serves it: state → count."""
        return {s.labels["state"]: s.value for family in self.sla.metrics.registry.collect()
                for s in family.samples if s.name == "fleetpilot_sla_offers_closed_total"}

    async def __aexit__(self, *exc) -> None:
        # Each stop waits out a pending pull (about a second): stop the hosts together.
        await asyncio.gather(*(host.stop() for host in self.hosts))
        await self.bus.drain()


@pytest.fixture
async def rig(nats_url, tmp_path):
    async with Rig(nats_url, tmp_path, Clock()) as r:
        yield r


async def hold_gpus(rig: Rig, node: str, task_id: str, gpus: list[int], memory_mb: int, free_in_s: float) -> None:
    """``gpus`` of ``node`` held by the standard task ``task_id``, expected to end in ``free_in_s``."""
    now = rig.clock()
    run = TaskSubmitted(task_id=task_id, tenant="other", gpus=len(gpus), expected_duration_s=free_in_s)
    await (await rig.bus.kv("contracts")).put(contract_key(task_id), encode(TaskAdmitted(
        task=run, contract=Contract(tier="standard"), tenant="other", admitted_at=now)))
    await (await rig.bus.kv("ledger")).put(node_key(node), encode(NodeLedger(node=node, allocations=[
        Allocation(task_id=task_id, decision_id=f"{task_id}.assign", gpu=i, milli=1000, memory_mb=memory_mb, at=now)
        for i in gpus])))


async def fill_h100(rig: Rig, free_in_s: float) -> None:
    """Both H100s held by a standard task that is expected to end in ``free_in_s``."""
    await hold_gpus(rig, "h100-00", "busy", [0, 1], 80_000, free_in_s)


def h100_only(task_id: str) -> TaskSubmitted:
    """Two H100s within 5 s: not possible while ``fill_h100`` holds them."""
    return TaskSubmitted(task_id=task_id, tenant="mallory", kind="train", gpus=2, gpu_memory_mb=30_000,
                         gpu_models=["H100"], sla=SlaRequest(tier="standard", max_queue_s=5))


# (a) ------------------------------------------------------------------------------------

async def test_request_that_can_be_met_is_admitted_with_the_tenant_of_the_token(rig):
    await rig.start_sla()
    task = TaskSubmitted(task_id="t-ok", tenant="mallory", gpus=1, gpu_memory_mb=20_000, gpu_models=["A100"],
                         sla=SlaRequest(tier="standard", max_queue_s=60))
    await rig.submit(task, rig.token("acme"))
    adm: TaskAdmitted = await rig.recorder.wait("task.admitted", "t-ok")
    assert adm.tenant == "acme" and adm.task.tenant == "acme"
    # "A100" is how the user spells it; the fleet says A100-40GB, and the contract pins it.
    assert adm.task.gpu_models == ["A100-40GB"] and adm.contract.gpu_models == ["A100-40GB"]
    assert adm.contract.site == "site-a" and adm.contract.max_queue_s == 60
    stored = await (await rig.bus.kv("contracts")).get(contract_key("t-ok"))
    assert stored is not None and decode(stored.value, TaskAdmitted) == adm
    assert [s for s, _ in rig.recorder.about("t-ok")] == ["task.admitted"]
    assert rig.answers() == {("admitted", "standard", ""): 1}


async def test_negotiate_endpoint_quotes_without_publishing(rig):
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla()
    headers = {"Authorization": f"Bearer {rig.token()}"}
    reply = await rig.quote(h100_only("t-quote"), headers)
    offer = decode(reply, SlaOffer, TaskAdmitted, TaskRejected)
    assert isinstance(offer, SlaOffer) and offer.tenant == "acme"
    assert {o.gpu_model for o in offer.options} == {"A100-40GB", "H100"}
    bad = decode(await rig.quote(h100_only("t-quote")), SlaOffer, TaskAdmitted, TaskRejected)
    assert isinstance(bad, TaskRejected) and bad.code == "unauthenticated"
    await asyncio.sleep(0.5)
    assert rig.recorder.about("t-quote") == []
    assert await (await rig.bus.kv("contracts")).get("offer.t-quote") is None


# (b) ------------------------------------------------------------------------------------

async def test_full_model_gets_counter_offer_and_accepting_it_is_placed_as_agreed(rig):
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla()
    await rig.start_policy()
    await rig.submit(h100_only("t-full"), rig.token("acme"))
    offer: SlaOffer = await rig.recorder.wait("sla.offer.t-full", "t-full")
    assert offer.tenant == "acme" and offer.asked.max_queue_s == 5
    by_model = {o.gpu_model: o for o in offer.options}
    assert set(by_model) == {"A100-40GB", "H100"}
    assert 100 <= by_model["H100"].expected_queue_s <= 120  # when the busy task is expected to end
    assert by_model["A100-40GB"].expected_queue_s == 0
    stored = await (await rig.bus.kv("contracts")).get("offer.t-full")
    assert stored is not None

    a100 = by_model["A100-40GB"]
    await rig.reply(SlaReply(offer_id=offer.offer_id, task_id="t-full", accept=True, option_id=a100.option_id),
                    rig.token("acme"))
    adm: TaskAdmitted = await rig.recorder.wait("task.admitted", "t-full")
    assert adm.tenant == "acme" and adm.contract.offer_id == offer.offer_id
    # The offered model first, then the H100 the task asked for (its terms hold there too).
    assert adm.contract.gpu_models == ["A100-40GB", "H100"] and adm.contract.site == "site-a"
    # The policy only reads task.gpu_models: the agreed models must be written there.
    assert adm.task.gpu_models == ["A100-40GB", "H100"]
    decision: DecisionMade = await rig.recorder.wait("decision.made", "t-full")
    assert decision.action == "assign" and {p.node for p in decision.placement} == {"a100-00"}
    assert decision.contract == adm.contract
    # The submission was answered with an offer, which the acceptance closed.
    assert rig.answers() == {("offer", "standard", ""): 1} and rig.offers_closed() == {"accepted": 1}


async def test_accepting_the_wait_option_sets_not_before(rig):
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla()
    await rig.submit(h100_only("t-wait"), rig.token("acme"))
    offer: SlaOffer = await rig.recorder.wait("sla.offer.t-wait", "t-wait")
    wait = next(o for o in offer.options if o.gpu_model == "H100")
    await rig.reply(SlaReply(offer_id=offer.offer_id, task_id="t-wait", accept=True, option_id=wait.option_id),
                    rig.token("acme"))
    adm: TaskAdmitted = await rig.recorder.wait("task.admitted", "t-wait")
    assert adm.task.gpu_models == ["H100"]
    assert adm.contract.not_before == pytest.approx(wait.not_before)
    assert adm.contract.max_queue_s == pytest.approx(wait.expected_queue_s)


async def test_a_short_task_is_estimated_behind_only_the_waiting_tasks_the_policy_serves_first(rig):
    """A ten-hour run admitted a moment ago waits for the two H100s (free in 120 s). The
    policy's queue serves a ten-minute run first (expected to end sooner): it is admitted to
    start when they free, not offered a wait of ten hours behind the long one."""
    await fill_h100(rig, free_in_s=120)
    long_run = TaskSubmitted(task_id="long", tenant="other", gpus=2, gpu_models=["H100"], expected_duration_s=36_000)
    await (await rig.bus.kv("contracts")).put(contract_key("long"), encode(TaskAdmitted(
        task=long_run, contract=Contract(tier="standard", gpu_models=["H100"], site="site-b"), tenant="other",
        admitted_at=rig.clock() - 1)))
    await rig.start_sla()
    short = msgspec.structs.replace(h100_only("t-short"), expected_duration_s=600.0,
                                    sla=SlaRequest(tier="standard", max_queue_s=300))
    await rig.submit(short, rig.token("acme"))
    adm: TaskAdmitted = await rig.recorder.wait("task.admitted", "t-short")
    assert adm.contract.gpu_models == ["H100"] and adm.contract.not_before == pytest.approx(rig.clock() + 120, abs=5)
    # A run longer than the waiting one is served after it: told the wait behind it.
    await rig.submit(msgspec.structs.replace(short, task_id="t-longer", expected_duration_s=72_000.0),
                     rig.token("acme"))
    offer: SlaOffer = await rig.recorder.wait("sla.offer.t-longer", "t-longer")
    assert next(o for o in offer.options if o.gpu_model == "H100").expected_queue_s > 36_000


async def test_accepting_an_option_whose_gpus_were_taken_since_the_offer_is_refused(rig):
    """Only the first option is held while an offer is open. Accepting the second after its
    H100s went to other work for an hour admitted a contract to start within 120 s that the
    fleet could not keep; it is now refused as infeasible, saying why, and nothing is stored."""
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla()
    await rig.submit(h100_only("t-late"), rig.token("acme"))
    offer: SlaOffer = await rig.recorder.wait("sla.offer.t-late", "t-late")
    wait = next(o for o in offer.options if o.gpu_model == "H100")
    assert wait.option_id != offer.options[0].option_id and wait.expected_queue_s <= 120
    await hold_gpus(rig, "h100-00", "long-run", [0, 1], 80_000, free_in_s=3600)
    headers = {"Authorization": f"Bearer {rig.token()}"}

    async def h100_wait() -> float:
        quote = decode(await rig.quote(h100_only("t-look"), headers), SlaOffer, TaskAdmitted, TaskRejected)
        return next(o.expected_queue_s for o in quote.options if o.gpu_model == "H100")

    deadline = time.monotonic() + 10
    while await h100_wait() < 3000:  # the replica has seen the H100s taken
        assert time.monotonic() < deadline, "the SLA replica never saw the H100s taken"
        await asyncio.sleep(0.05)
    await rig.reply(SlaReply(offer_id=offer.offer_id, task_id="t-late", accept=True, option_id=wait.option_id),
                    rig.token("acme"))
    refused: TaskRejected = await rig.recorder.wait("task.rejected", "t-late")
    assert refused.code == "infeasible" and f"option {wait.option_id} no longer holds" in refused.reason
    assert "H100 at site-b is taken" in refused.reason and "submit it again" in refused.reason
    assert "task.admitted" not in [s for s, _ in rig.recorder.about("t-late")]
    assert await (await rig.bus.kv("contracts")).get(contract_key("t-late")) is None


async def test_declining_rejects_and_a_reply_from_another_tenant_changes_nothing(rig):
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla()
    await rig.submit(h100_only("t-no"), rig.token("acme"))
    offer: SlaOffer = await rig.recorder.wait("sla.offer.t-no", "t-no")
    first = offer.options[0].option_id
    # Sent without the catalogued msg id: with it, JetStream would drop the owner's real
    # answer below as a duplicate of this one (``reply:{offer_id}``) for its window.
    intrusion = SlaReply(offer_id=offer.offer_id, task_id="t-no", accept=True, option_id=first)
    await rig.bus.publish_raw("sla.reply.t-no", encode(intrusion),
                              headers={"Authorization": f"Bearer {rig.token('intruder')}"})
    await asyncio.sleep(0.5)
    assert [s for s, _ in rig.recorder.about("t-no")] == ["sla.offer.t-no"]
    await rig.reply(SlaReply(offer_id=offer.offer_id, task_id="t-no", accept=False), rig.token("acme"))
    rejected: TaskRejected = await rig.recorder.wait("task.rejected", "t-no")
    assert rejected.code == "offer_declined" and rejected.tenant == "acme"
    # The intruder's acceptance came first on the same subject: had it been taken, the task
    # would be admitted by now, however slowly it was handled (half a second proves little).
    assert "task.admitted" not in [s for s, _ in rig.recorder.about("t-no")]
    assert await (await rig.bus.kv("contracts")).get(contract_key("t-no")) is None
    assert rig.offers_closed() == {"declined": 1}


async def stored(rig: Rig, subject: str, task_id: str) -> list:
    """What JetStream kept on ``subject`` for ``task_id`` (the recorder, on core NATS, also
    sees the copies the stream drops as duplicates), decoded."""
    sub = await rig.bus._js.subscribe(subject, ordered_consumer=True)
    kept = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except TimeoutError:
                return [e for e in kept if e.task_id == task_id]
            kept.append(decode(msg.data, TaskRejected))
    finally:
        await sub.unsubscribe()


async def test_a_task_resubmitted_after_its_refusal_is_answered_again(rig):
    """A client declined the offer and asked again at once (a new submission, its own time):
    within JetStream's de-duplication window the new submission, and then its own refusal,
    had the msg ids of the first ones and were dropped; the client waited for an answer
    that never came."""
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla()
    first = msgspec.structs.replace(h100_only("t-again"), submitted_at=rig.clock())

    def offers() -> list[SlaOffer]:
        return [e for s, e in rig.recorder.about("t-again") if s.startswith("sla.offer.")]

    for n, task in enumerate((first, msgspec.structs.replace(first, submitted_at=first.submitted_at + 1)), 1):
        await rig.submit(task, rig.token("acme"))
        await eventually(lambda n=n: len(offers()) == n, timeout_s=10, what=f"offer {n}")
        await rig.reply(SlaReply(offer_id=offers()[-1].offer_id, task_id="t-again", accept=False), rig.token("acme"))
    assert offers()[0].offer_id != offers()[1].offer_id

    async def both_refusals_kept() -> bool:
        return len(await stored(rig, "task.rejected", "t-again")) == 2

    await eventually(both_refusals_kept, timeout_s=10, what="both refusals in the stream")
    assert {r.code for r in await stored(rig, "task.rejected", "t-again")} == {"offer_declined"}

async def test_an_answer_refused_for_its_token_can_be_sent_again_with_a_good_one(rig):
    """The client's token had expired: its acceptance was refused (dead-lettered). Sent again
    at once with a renewed token, the same answer had the same msg id and JetStream dropped
    it for two minutes, while the offer ran out."""
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla()
    await rig.submit(h100_only("t-renew"), rig.token("acme"))
    offer: SlaOffer = await rig.recorder.wait("sla.offer.t-renew", "t-renew")
    accept = SlaReply(offer_id=offer.offer_id, task_id="t-renew", accept=True,
                      option_id=offer.options[0].option_id, replied_at=rig.clock())
    await rig.reply(accept, rig.token("acme", ttl_s=60, clock=lambda: rig.clock() - 3600))  # expired
    await asyncio.sleep(0.5)
    assert "task.admitted" not in [s for s, _ in rig.recorder.about("t-renew")]
    await rig.reply(msgspec.structs.replace(accept, replied_at=accept.replied_at + 1), rig.token("acme"))
    admitted: TaskAdmitted = await rig.recorder.wait("task.admitted", "t-renew")
    assert admitted.contract.offer_id == offer.offer_id

async def test_unanswered_offer_expires_after_its_validity(rig):
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla(offer_validity_s=1.0, reply_grace_s=0.0)
    await rig.submit(h100_only("t-silent"), rig.token("acme"))
    offer: SlaOffer = await rig.recorder.wait("sla.offer.t-silent", "t-silent")
    rejected: TaskRejected = await rig.recorder.wait("task.rejected", "t-silent", timeout_s=5)
    assert rejected.code == "offer_expired"
    assert rejected.rejected_at >= offer.valid_until
    # A late acceptance gets the same answer again (same event, same msg id), never a contract.
    await rig.reply(SlaReply(offer_id=offer.offer_id, task_id="t-silent", accept=True,
                             option_id=offer.options[0].option_id), rig.token("acme"))
    await asyncio.sleep(0.5)
    after = rig.recorder.about("t-silent")
    assert "task.admitted" not in [s for s, _ in after]
    assert all(e == rejected for s, e in after if s == "task.rejected")
    assert await (await rig.bus.kv("contracts")).get(contract_key("t-silent")) is None
    # Closed once, by its expiry: the late acceptance told the same answer, counted nothing.
    assert rig.offers_closed() == {"expired": 1}


async def test_offer_survives_a_restart_of_the_service(rig):
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla()
    await rig.submit(h100_only("t-restart"), rig.token("acme"))
    offer: SlaOffer = await rig.recorder.wait("sla.offer.t-restart", "t-restart")
    await rig.sla.stop()
    rig.hosts.remove(rig.sla)
    await rig.start_sla()  # a fresh replica: the offer is only in the contracts bucket
    option = offer.options[0]
    await rig.reply(SlaReply(offer_id=offer.offer_id, task_id="t-restart", accept=True,
                             option_id=option.option_id), rig.token("acme"))
    adm: TaskAdmitted = await rig.recorder.wait("task.admitted", "t-restart")
    assert adm.contract.offer_id == offer.offer_id and adm.task.gpu_models == option.gpu_models
    assert option.gpu_models[0] == option.gpu_model


async def test_a_reply_stored_in_time_but_handled_after_the_validity_is_admitted(rig):
    """The service falls behind (here: stopped) while the client's acceptance waits in the
    stream; it is handled after the offer's validity. Sent in time, it is admitted: judged by
    when the server stored it, not by when a backlogged handler got to it. The expiry job
    leaves the offer open for it meanwhile (``reply_grace_s``)."""
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla(offer_validity_s=2.0, reply_grace_s=30.0)
    await rig.submit(h100_only("t-backlog"), rig.token("acme"))
    offer: SlaOffer = await rig.recorder.wait("sla.offer.t-backlog", "t-backlog")
    await rig.sla.stop()
    rig.hosts.remove(rig.sla)
    option = offer.options[0]
    await rig.reply(SlaReply(offer_id=offer.offer_id, task_id="t-backlog", accept=True,
                             option_id=option.option_id), rig.token("acme"))
    while rig.clock() <= offer.valid_until + 0.5:
        await asyncio.sleep(0.1)
    await rig.start_sla(offer_validity_s=2.0, reply_grace_s=30.0)
    adm: TaskAdmitted = await rig.recorder.wait("task.admitted", "t-backlog")
    assert adm.contract.offer_id == offer.offer_id and adm.admitted_at > offer.valid_until
    assert "task.rejected" not in [s for s, _ in rig.recorder.about("t-backlog")]


async def test_a_reply_stored_after_the_validity_is_expired_while_the_offer_is_still_open(rig):
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla(offer_validity_s=1.0, reply_grace_s=30.0)
    await rig.submit(h100_only("t-late"), rig.token("acme"))
    offer: SlaOffer = await rig.recorder.wait("sla.offer.t-late", "t-late")
    while rig.clock() <= offer.valid_until + 0.3:
        await asyncio.sleep(0.1)
    await rig.reply(SlaReply(offer_id=offer.offer_id, task_id="t-late", accept=True,
                             option_id=offer.options[0].option_id), rig.token("acme"))
    rejected: TaskRejected = await rig.recorder.wait("task.rejected", "t-late")
    assert rejected.code == "offer_expired" and "answer came" in rejected.reason  # the reply's, not the job's
    assert "task.admitted" not in [s for s, _ in rig.recorder.about("t-late")]


async def hold_one_a100(rig: Rig, free_in_s: float) -> None:
    """The first A100 held by a standard task expected to end in ``free_in_s``: one A100 free."""
    await hold_gpus(rig, "a100-00", "a-run", [0], 30_000, free_in_s)


def one_h100_soon(task_id: str) -> TaskSubmitted:
    """One H100 within 5 s: offered the free A100 now first, then an H100 when ``fill_h100`` ends."""
    return TaskSubmitted(task_id=task_id, kind="train", gpus=1, gpu_memory_mb=20_000, gpu_models=["H100"],
                         sla=SlaRequest(tier="standard", max_queue_s=5))


def first_option(offer: SlaOffer) -> tuple[str | None, float]:
    return offer.options[0].gpu_model, offer.options[0].expected_queue_s


async def test_a_burst_is_not_offered_the_one_free_gpu_twice_while_an_offer_is_open(rig):
    """Two submissions in a burst, one free GPU: both were offered "A100 now", the first to
    accept took it, and the other accepted a start that could no longer be met. The open
    offer now holds its first option's GPU until it is answered or expires."""
    await fill_h100(rig, free_in_s=120)
    await hold_one_a100(rig, free_in_s=300)
    await rig.start_sla()
    for task_id in ("t-burst-1", "t-burst-2"):
        await rig.submit(one_h100_soon(task_id), rig.token("acme"))
    first: SlaOffer = await rig.recorder.wait("sla.offer.t-burst-1", "t-burst-1")
    second: SlaOffer = await rig.recorder.wait("sla.offer.t-burst-2", "t-burst-2")
    assert first_option(first) == ("A100-40GB", 0)
    # Not the same GPU now: the H100 when it frees, or the A100 when its busy one does.
    assert all(o.expected_queue_s > 0 for o in second.options), second.options
    assert 270 <= next(o for o in second.options if o.gpu_model == "A100-40GB").expected_queue_s <= 300

    # Declined: the GPU it held is offered again.
    await rig.reply(SlaReply(offer_id=first.offer_id, task_id="t-burst-1", accept=False), rig.token("acme"))
    assert (await rig.recorder.wait("task.rejected", "t-burst-1")).code == "offer_declined"
    await rig.submit(one_h100_soon("t-burst-3"), rig.token("acme"))
    third: SlaOffer = await rig.recorder.wait("sla.offer.t-burst-3", "t-burst-3")
    assert first_option(third) == ("A100-40GB", 0)

    # Accepted: the admission waits for that GPU and is counted once, as waiting. Counted
    # twice, the busy A100's completion would be taken too and no A100 offered at all.
    await rig.reply(SlaReply(offer_id=third.offer_id, task_id="t-burst-3", accept=True,
                             option_id=third.options[0].option_id), rig.token("acme"))
    await rig.recorder.wait("task.admitted", "t-burst-3")
    await rig.submit(one_h100_soon("t-burst-4"), rig.token("acme"))
    fourth: SlaOffer = await rig.recorder.wait("sla.offer.t-burst-4", "t-burst-4")
    assert all(o.expected_queue_s > 0 for o in fourth.options), fourth.options
    assert 270 <= next(o for o in fourth.options if o.gpu_model == "A100-40GB").expected_queue_s <= 300


async def test_a_submission_left_nothing_but_held_gpus_is_told_when_to_ask_again(rig):
    """The first two of a burst hold every GPU that could run the third (two A100s now, the
    two H100s when they free): it is refused with when the holds lapse, not offered them again
    nor told that no pool will ever free enough GPUs."""
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla()
    for task_id in ("t-held-1", "t-held-2", "t-held-3"):
        await rig.submit(h100_only(task_id), rig.token("acme"))
    first: SlaOffer = await rig.recorder.wait("sla.offer.t-held-1", "t-held-1")
    second: SlaOffer = await rig.recorder.wait("sla.offer.t-held-2", "t-held-2")
    assert first_option(first) == ("A100-40GB", 0) and first_option(second)[0] == "H100"
    refused: TaskRejected = await rig.recorder.wait("task.rejected", "t-held-3")
    assert refused.code == "infeasible" and "held for open counter-offers" in refused.reason
    assert f"until {second.valid_until:.0f}" in refused.reason


# (c) ------------------------------------------------------------------------------------

def _b64(doc: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()


def bad_tokens(rig: Rig) -> dict[str, tuple[str | None, str]]:
    """Task id -> (token, the verifier's reason for refusing it)."""
    kid = rig.ring.signing_key().kid
    now = int(rig.clock())
    claims = {"tenant": "acme", "sub": "acme", "aud": AUDIENCE, "iss": ISSUER, "iat": now, "nbf": now,
              "exp": now + 600}
    impostor = KeyRing()  # a key nobody published, claiming the real key's kid
    forged = jwt.encode(claims, jwt.PyJWK(impostor.signing_key().private_jwk, "EdDSA").key, algorithm="EdDSA",
                        headers={"kid": kid})
    past = Clock()
    past.advance(-7200)
    old_ring = KeyRing(clock=past, keys=list(rig.ring.keys))
    expired = mint_token(old_ring, tenant="acme", audience=AUDIENCE, issuer=ISSUER, ttl_s=600)
    unsigned = f"{_b64({'alg': 'none', 'typ': 'JWT', 'kid': kid})}.{_b64(claims)}."
    return {
        "t-forged": (forged, "forged"),
        "t-expired": (expired, "expired"),
        "t-audience": (rig.token(audience="someone-else"), "wrong_audience"),
        "t-none": (unsigned, "alg_not_allowed"),
        "t-missing": (None, "malformed"),
    }


async def test_bad_tokens_are_rejected_unauthenticated_and_nothing_else_happens(rig):
    await rig.start_sla()
    cases = bad_tokens(rig)
    for task_id, (token, _) in cases.items():
        await rig.submit(TaskSubmitted(task_id=task_id, tenant="acme", gpus=1), token)
    for task_id, (_, reason) in cases.items():
        rejected: TaskRejected = await rig.recorder.wait("task.rejected", task_id)
        assert rejected.code == "unauthenticated" and reason in rejected.reason
        assert rig.refused(reason) >= 1
    await asyncio.sleep(0.5)
    for task_id in cases:
        assert [s for s, _ in rig.recorder.about(task_id)] == ["task.rejected"], task_id
    contracts = await rig.bus.kv("contracts")
    assert await contracts.keys() == []
    assert rig.answers() == {("rejected", "standard", "unauthenticated"): len(cases)}


# (d) ------------------------------------------------------------------------------------

def signed_with(key, claims: dict) -> str:
    return jwt.encode(claims, jwt.PyJWK(key.private_jwk, key.alg).key, algorithm=key.alg, headers={"kid": key.kid})


def claims_at(now: float, ttl_s: float = 3600) -> dict:
    return {"tenant": "acme", "sub": "acme", "aud": AUDIENCE, "iss": ISSUER, "iat": int(now), "nbf": int(now),
            "exp": int(now + ttl_s)}


async def test_rotated_key_works_through_the_overlap_and_not_after(rig):
    await rig.start_sla()
    old = rig.ring.signing_key()
    rig.clock.advance(WEEK_S)
    new = rig.ring.signing_key()  # rotation is due: the old key now has valid_until = now + overlap
    assert new.kid != old.kid
    rig.publish_keys()
    await rig.submit(TaskSubmitted(task_id="t-new", gpus=1), signed_with(new, claims_at(rig.clock())))
    await rig.submit(TaskSubmitted(task_id="t-overlap", gpus=1), signed_with(old, claims_at(rig.clock())))
    assert (await rig.recorder.wait("task.admitted", "t-new")).tenant == "acme"
    assert (await rig.recorder.wait("task.admitted", "t-overlap")).tenant == "acme"

    rig.clock.advance(DAY_S + 120)  # past the overlap (and the verifier's leeway)
    await rig.submit(TaskSubmitted(task_id="t-retired", gpus=1), signed_with(old, claims_at(rig.clock())))
    await rig.submit(TaskSubmitted(task_id="t-current", gpus=1), signed_with(new, claims_at(rig.clock())))
    rejected: TaskRejected = await rig.recorder.wait("task.rejected", "t-retired")
    assert rejected.code == "unauthenticated" and "key_retired" in rejected.reason
    assert (await rig.recorder.wait("task.admitted", "t-current")).tenant == "acme"
    assert rig.refused("key_retired") == 1


async def test_redelivered_or_repeated_submission_gets_the_same_admission(rig):
    await rig.start_sla()
    task = TaskSubmitted(task_id="t-twice", gpus=1)
    await rig.submit(task, rig.token())
    first: TaskAdmitted = await rig.recorder.wait("task.admitted", "t-twice")
    # Past the de-duplication window a resubmission reaches the service again.
    await rig.bus.publish_raw("task.submitted", encode(task), headers={"Authorization": f"Bearer {rig.token()}"})

    def admitted() -> list[TaskAdmitted]:
        return [e for s, e in rig.recorder.about("t-twice") if s == "task.admitted"]

    # Core NATS shows the republished copy (JetStream drops it by its msg id); it must be
    # the stored admission, not a fresh negotiation with a new admitted_at. Waited for, not
    # slept on: a loaded machine answering after a fixed pause failed the test.
    await eventually(lambda: len(admitted()) >= 2, timeout_s=10, what="the second admission")
    assert len(admitted()) == 2 and admitted()[1] == first
    assert rig.answers() == {("admitted", "standard", ""): 1}  # negotiated once


async def test_a_task_given_up_after_admission_loses_its_contract_and_only_for_its_tenant(rig):
    await rig.start_sla()
    for task_id in ("t-kept", "t-gone"):
        await rig.submit(TaskSubmitted(task_id=task_id, gpus=1), rig.token("acme"))
        await rig.recorder.wait("task.admitted", task_id)
    contracts = await rig.bus.kv("contracts")
    # The policy gives t-gone up (the executor refused it again and again); a rejection of
    # t-kept names another tenant, as ours of a stranger's resubmission of its id would.
    for task_id, tenant in (("t-kept", "mallory"), ("t-gone", "acme")):
        await rig.bus.publish(TaskRejected(task_id=task_id, tenant=tenant, code="infeasible",
                                           reason="refused by the executor 3 times", rejected_at=time.time()))

    async def gone() -> bool:
        return await contracts.get(contract_key("t-gone")) is None

    await eventually(gone, what="t-gone's contract forgotten")
    await asyncio.sleep(0.3)
    assert await contracts.get(contract_key("t-kept")) is not None


async def test_a_late_rejection_of_an_earlier_submission_keeps_the_new_contract(rig):
    """An offer expired (``offer_expired`` published), the client resubmitted and was
    admitted; the rejection, read late, forgot the new contract, so the running task's
    tier and duration left every later negotiation. Only a give-up after the admission ends it."""
    await rig.start_sla()
    await rig.submit(TaskSubmitted(task_id="t-back", gpus=1), rig.token("acme"))
    adm: TaskAdmitted = await rig.recorder.wait("task.admitted", "t-back")
    contracts = await rig.bus.kv("contracts")
    for code, at in (("offer_expired", adm.admitted_at - 5), ("offer_expired", adm.admitted_at + 5),
                     ("infeasible", adm.admitted_at - 5)):
        await rig.bus.publish(TaskRejected(task_id="t-back", tenant="acme", code=code, reason="earlier",
                                           rejected_at=at))
    await asyncio.sleep(0.5)
    assert await contracts.get(contract_key("t-back")) is not None
    await rig.bus.publish(TaskRejected(task_id="t-back", tenant="acme", code="infeasible",
                                       reason="refused by the executor 3 times", rejected_at=adm.admitted_at + 5))

    async def gone() -> bool:
        return await contracts.get(contract_key("t-back")) is None

    await eventually(gone, what="t-back's contract forgotten at its give-up")


@pytest.mark.parametrize(("content", "fragment"), [
    (None, "no JWKS at"),
    ("", "cannot read the key set"),
    ("{\"keys\": [", "cannot read the key set"),
])
def test_a_missing_or_unreadable_key_set_stops_the_service_with_one_line(tmp_path, content, fragment):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETPILOT_")}
    env["FLEETPILOT_STATE_DIR"] = str(tmp_path)
    if content is not None:
        (tmp_path / "jwks.json").write_text(content)
    proc = subprocess.run([sys.executable, "-m", "fleetpilot_services.sla"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fleetpilot-sla: ") and fragment in lines[0], proc.stderr


async def negotiator_on(rig: Rig):
    """A negotiator of its own over the rig's buckets, as another replica would open it (under
    a replica name of its own, as every replica has)."""
    from fleetpilot.ledger import FleetView, LedgerStore
    from fleetpilot_services.sla.service import Negotiator
    from fleetpilot_services.sla.store import ContractStore

    rig.replicas += 1
    settings = SlaSettings(nats_url=rig.url, metrics_port=-1, jwks_path=str(rig.jwks), state_dir=str(rig.tmp),
                           replica=f"sla-{rig.replicas}")
    return Negotiator(rig.bus, settings, rig.clock, await FleetView.open(rig.bus), await LedgerStore.open(rig.bus),
                      await ContractStore.open(rig.bus))


async def test_a_redelivered_submission_gets_the_rejection_it_was_given_not_a_new_answer(rig):
    # No GPU holds 120 GB: rejected. Then an H200 node joins, and the submission comes again
    # because the first delivery's acknowledgement was lost (another replica gets it). The
    # client was told "rejected"; it must not now also be told "admitted" for the same ask.
    task = TaskSubmitted(task_id="t-big", tenant="acme", gpus=1, gpu_memory_mb=120_000)
    changed = msgspec.structs.replace(task, task_id="t-big2")
    first = await (await negotiator_on(rig)).submitted(task, redelivered=False)
    assert isinstance(first, TaskRejected)
    assert isinstance(await (await negotiator_on(rig)).submitted(changed, redelivered=False), TaskRejected)
    await (await rig.bus.kv("topology")).put(node_key("h200-00"), encode(node("h200-00", "site-a", "H200", 143_771)))
    replica = await negotiator_on(rig)
    assert await replica.submitted(task, redelivered=True) == first
    # A resubmission (a first delivery), or a redelivery of another ask, is negotiated again.
    assert isinstance(await replica.submitted(task, redelivered=False), TaskAdmitted)
    changed = msgspec.structs.replace(changed, gpu_memory_mb=100_000)
    again = await replica.submitted(changed, redelivered=True)
    assert isinstance(again, TaskAdmitted) and again.task.gpu_memory_mb == 100_000


async def test_a_submission_before_any_node_has_reported_waits_for_the_fleet(rig):
    """A fresh deploy: the first submissions come before the collectors' first reports. They
    used to be retried each second and dead-lettered at the fifth delivery (about 4 s)."""
    topology = await rig.bus.kv("topology")
    for n in FLEET:
        await topology.delete(node_key(n.node))
    dead: list[bytes] = []

    async def on_dead(msg) -> None:
        dead.append(msg.data)

    await rig.bus._nc.subscribe("dlq.>", cb=on_dead)
    await rig.start_sla()
    await rig.submit(TaskSubmitted(task_id="t-early", gpus=1), rig.token())
    await asyncio.sleep(6.0)
    for n in FLEET:
        await topology.put(node_key(n.node), encode(n))
    adm: TaskAdmitted = await rig.recorder.wait("task.admitted", "t-early")
    assert adm.tenant == "acme" and dead == []


def test_the_missing_key_set_message_names_a_command_that_makes_it(tmp_path):
    """The one line said ``fleetpilot token --init``, a flag that does not exist."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETPILOT_")}
    env["FLEETPILOT_STATE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "fleetpilot_services.sla"], env=env, capture_output=True,
                          text=True, timeout=60)
    advice = proc.stderr.split("`")[1].split()
    assert advice[:2] == ["fleetpilot", "token"]
    fleetpilot = os.path.join(os.path.dirname(sys.executable), "fleetpilot")
    made = subprocess.run([fleetpilot, *advice[1:]], env=env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert "keys" in json.loads((tmp_path / "jwks.json").read_text())


async def test_a_dotted_task_id_is_rejected_invalid_not_offered_where_nobody_can_answer(rig):
    """``sla.offer.team.a`` is no subject the SLA stream takes: the offer was stored open in
    the contracts bucket, its publication failed at every delivery, and the client heard
    nothing until the offer it never saw expired."""
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla()
    await rig.submit(h100_only("team.a"), rig.token("acme"))
    rejected: TaskRejected = await rig.recorder.wait("task.rejected", "team.a", timeout_s=5)
    assert rejected.code == "invalid" and "task_id" in rejected.reason and rejected.tenant == "acme"
    assert await (await rig.bus.kv("contracts")).keys() == [contract_key("busy")]


async def test_declined_and_expired_offers_leave_the_bucket_after_their_keep_time(rig):
    """A declined or expired offer's task never runs, so no lifecycle event forgets it: its
    record stayed in the contracts bucket for ever, every replica reading it at each start.
    An accepted offer stays as long as its contract."""
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla(closed_offer_keep_s=3600.0)
    offers = {}
    # One GPU each: three two-GPU asks in a row would find the third refused, every GPU held
    # for the first two's open offers.
    for task_id in ("t-declined", "t-silent", "t-taken"):
        await rig.submit(one_h100_soon(task_id), rig.token("acme"))
        offers[task_id] = await rig.recorder.wait(f"sla.offer.{task_id}", task_id)
    await rig.reply(SlaReply(offer_id=offers["t-declined"].offer_id, task_id="t-declined", accept=False),
                    rig.token("acme"))
    await rig.reply(SlaReply(offer_id=offers["t-taken"].offer_id, task_id="t-taken", accept=True,
                             option_id=offers["t-taken"].options[0].option_id), rig.token("acme"))
    await rig.recorder.wait("task.rejected", "t-declined")
    await rig.recorder.wait("task.admitted", "t-taken")
    rig.clock.advance(60)  # past the offers' validity: t-silent expires
    await rig.recorder.wait("task.rejected", "t-silent")
    contracts = await rig.bus.kv("contracts")
    assert {"offer.t-declined", "offer.t-silent", "offer.t-taken"} <= set(await contracts.keys())

    rig.clock.advance(3600)

    async def dropped() -> bool:
        return not {"offer.t-declined", "offer.t-silent"} & set(await contracts.keys())

    await eventually(dropped, timeout_s=10, what="the closed offers dropped")
    assert {"offer.t-taken", contract_key("t-taken")} <= set(await contracts.keys())


async def test_copies_of_a_submission_at_two_replicas_get_one_answer(rig):
    """A submission redelivered (its acknowledgement lost) reaches a second replica while the
    first still negotiates it. The two replicas' views of the fleet differ for a moment, so
    the second would answer otherwise (here: rejected) while the first admits; the client
    got both. The second now waits for the first's claim and gives the first's answer."""
    first, second = await negotiator_on(rig), await negotiator_on(rig)
    inside, release = asyncio.Event(), asyncio.Event()
    decide = first.decide

    async def slow(task):
        inside.set()
        await release.wait()
        return await decide(task)

    first.decide = slow
    second_decided: list[str] = []

    async def otherwise(task):
        second_decided.append(task.task_id)
        return TaskRejected(task_id=task.task_id, tenant=task.tenant, code="infeasible", reason="a view older",
                            rejected_at=rig.clock())

    second.decide = otherwise
    task = TaskSubmitted(task_id="t-race", tenant="acme", gpus=1, sla=SlaRequest(max_queue_s=60))
    answered_first = asyncio.create_task(first.submitted(task, redelivered=False))
    await asyncio.wait_for(inside.wait(), 10)
    answered_second = asyncio.create_task(second.submitted(task, redelivered=True))
    await asyncio.sleep(0.5)
    assert second_decided == [] and not answered_second.done()
    release.set()
    answers = await asyncio.gather(answered_first, answered_second)
    stored = decode((await (await rig.bus.kv("contracts")).get(contract_key("t-race"))).value, TaskAdmitted)
    assert answers[0] == answers[1] == stored and second_decided == []
    assert claim_key("t-race") not in await (await rig.bus.kv("contracts")).keys()


async def test_a_claim_left_by_a_dead_replica_is_taken_over_and_then_swept(rig):
    """A replica that died while negotiating leaves its claim: the task's next negotiation
    takes it over once it has waited ``CLAIM_STALE_S`` on it, and the expiry job removes one
    nobody comes back for, once it has seen it that long."""
    contracts = await rig.bus.kv("contracts")
    dead = encode(NegotiationClaim(holder="gone", at=rig.clock() - 3600))
    await contracts.put(claim_key("t-orphan"), dead)
    await contracts.put(claim_key("t-again"), dead)
    await rig.start_sla()
    replica = await negotiator_on(rig)
    task = TaskSubmitted(task_id="t-again", tenant="acme", gpus=1)
    waiting = asyncio.create_task(replica.submitted(task, redelivered=False))
    await asyncio.sleep(0.5)  # the waiter, and the expiry job, see the claims
    assert not waiting.done()  # an hour-old stamp is not enough: it waits its own 30 s
    rig.clock.advance(CLAIM_STALE_S + 1)
    fresh = encode(NegotiationClaim(holder="alive", at=rig.clock()))
    await contracts.put(claim_key("t-live"), fresh)
    assert isinstance(await asyncio.wait_for(waiting, 10), TaskAdmitted)

    async def swept() -> bool:
        return claim_key("t-orphan") not in await contracts.keys()

    await eventually(swept, timeout_s=10, what="the orphan claim removed")
    assert claim_key("t-live") in await contracts.keys() and claim_key("t-again") not in await contracts.keys()


async def test_a_replica_whose_clock_runs_ahead_waits_for_a_live_claim(rig):
    """A claim's age was the holder's stamp read on the waiter's clock: a waiter whose clock
    ran a minute ahead took a claim held a moment ago for a dead replica's, and two
    replicas negotiated one submission at once. A waiter now times the claim on its own
    clock, from when it first saw it."""
    from fleetpilot_services.sla.store import ContractStore

    holder, waiter = await ContractStore.open(rig.bus), await ContractStore.open(rig.bus)
    revision = await holder.claim("t-skew", "a", rig.clock)
    ahead = asyncio.create_task(waiter.claim("t-skew", "b", lambda: rig.clock() + 60.0))
    await asyncio.sleep(0.5)
    assert not ahead.done()  # the claim is held: it waits
    await holder.release("t-skew", revision)
    await asyncio.wait_for(ahead, 5)

async def test_a_claim_whose_release_was_lost_is_taken_back_at_once_by_its_own_replica(rig, monkeypatch):
    """The server went away as a negotiation released its claim (``nats: timeout``): the
    handler failed, and the submission's next delivery, to the same replica, waited 30 s
    for a claim nobody held. The lost release is logged, the answer still goes out, and
    the replica takes its own claim back at once; another replica still waits for it."""
    from fleetpilot_services.sla.store import ContractStore

    store, other = await ContractStore.open(rig.bus), await ContractStore.open(rig.bus)
    revision = await store.claim("t-lost", "a", rig.clock)
    delete = store._kv.delete

    async def server_gone(*args, **kwargs):
        raise TimeoutError("nats: timeout")

    monkeypatch.setattr(store._kv, "delete", server_gone)
    await store.release("t-lost", revision)  # told, not raised
    monkeypatch.setattr(store._kv, "delete", delete)
    waiting = asyncio.create_task(other.claim("t-lost", "b", rig.clock))
    again = await asyncio.wait_for(store.claim("t-lost", "a", rig.clock), 2)
    await asyncio.sleep(0.3)
    assert not waiting.done()  # held again, by "a"
    await store.release("t-lost", again)
    await asyncio.wait_for(waiting, 5)

async def test_one_submission_admitted_by_two_replicas_keeps_the_contract_stored_first(rig):
    """Two replicas admitting one task at once (the first so slow that its claim went stale
    and the second took it over): the second write replaced the first, so the contract kept
    was not the one published first. Each replica now answers with the contract that was
    stored (one event, so the bus keeps it once)."""
    first, second = await negotiator_on(rig), await negotiator_on(rig)
    both_decided = asyncio.Barrier(2)
    for replica in (first, second):
        decide = replica.decide

        async def gated(task, decide=decide, replica=replica):
            answer = await decide(task)
            if replica is first:
                rig.clock.advance(CLAIM_STALE_S + 1)  # first's claim is stale: second takes it over
            await both_decided.wait()  # neither records before the other has decided
            return answer

        replica.decide = gated
    second.clock = lambda: rig.clock() + 5.0  # a later decision: a visibly different admission
    task = TaskSubmitted(task_id="t-race", tenant="acme", gpus=1, sla=SlaRequest(max_queue_s=60))
    answers = await asyncio.gather(first.submitted(task, redelivered=False),
                                   second.submitted(task, redelivered=True))
    stored = decode((await (await rig.bus.kv("contracts")).get(contract_key("t-race"))).value, TaskAdmitted)
    assert all(isinstance(a, TaskAdmitted) for a in answers)
    assert answers[0] == answers[1] == stored


def ended_by(how: str, task_id: str, tenant: str, admitted_at: float):
    """The event that ends an admitted task: the executor's lifecycle end, or the policy's
    give-up (a task the executor refused again and again)."""
    if how == "given up":
        return TaskRejected(task_id=task_id, tenant=tenant, code="infeasible",
                            reason="refused by the executor 3 times", rejected_at=admitted_at + 1)
    return TaskLifecycle(task_id=task_id, state=how, node="a100-00", gpus=[0], decision_id=f"{task_id}.assign",
                         at=admitted_at + 1)


@pytest.mark.parametrize("how", ["finished", "failed", "given up"])
async def test_a_task_id_whose_task_ended_is_refused_not_admitted_again(rig, how):
    """A task ran to its end (or was given up) and its contract was forgotten; its id came
    again. It was negotiated afresh and admitted: the policy, finding the executor's journal
    holding that task's ``<task>.assign``, decided nothing, so the client was told "admitted"
    and nothing ever ran, and the new contract (a pinned model, no hold) stayed for ever,
    its GPUs taken off the fleet's free ones in every later negotiation."""
    await rig.start_sla()
    task = TaskSubmitted(task_id="t-ran", gpus=1, gpu_memory_mb=20_000, gpu_models=["A100"],
                         sla=SlaRequest(max_queue_s=60), submitted_at=rig.clock())
    await rig.submit(task, rig.token("acme"))
    first: TaskAdmitted = await rig.recorder.wait("task.admitted", "t-ran")
    contracts = await rig.bus.kv("contracts")
    await rig.bus.publish(ended_by(how, "t-ran", "acme", first.admitted_at))

    async def forgotten() -> bool:
        return await contracts.get(contract_key("t-ran")) is None

    await eventually(forgotten, what="t-ran's contract forgotten at its end")
    await rig.submit(msgspec.structs.replace(task, submitted_at=task.submitted_at + 60), rig.token("acme"))

    def answers() -> list[tuple[str, object]]:  # the give-up this test sent answers nothing
        return [(s, e) for s, e in rig.recorder.about("t-ran") if getattr(e, "code", "") != "infeasible"]

    await eventually(lambda: len(answers()) >= 2, timeout_s=5, what="the resubmission answered")
    assert [s for s, _ in answers()] == ["task.admitted", "task.rejected"]
    refused = answers()[1][1]
    assert refused.code == "invalid" and refused.tenant == "acme"
    assert "new task id" in refused.reason and how in refused.reason
    assert await contracts.get(contract_key("t-ran")) is None
    # Nothing waits on the A100s: both, within 5 s, can be promised at once.
    await rig.submit(TaskSubmitted(task_id="t-both", gpus=2, gpu_memory_mb=20_000, gpu_models=["A100"],
                                   sla=SlaRequest(max_queue_s=5)), rig.token("acme"))
    assert isinstance(await rig.recorder.wait("task.admitted", "t-both"), TaskAdmitted)


async def test_an_oom_kill_keeps_the_contract_until_the_policy_gives_the_task_up(rig):
    """The policy starts a task an OOM killed over (``oom_restarts``): its contract must
    outlive the kill, or the restart finds no admission to place. The policy's give-up
    (``task.rejected`` past its restarts) ends it."""
    await rig.start_sla()
    contracts = await rig.bus.kv("contracts")
    admissions = {}
    for task_id in ("t-oom", "t-done"):
        await rig.submit(TaskSubmitted(task_id=task_id, gpus=1, gpu_memory_mb=20_000, gpu_models=["A100"],
                                       sla=SlaRequest(max_queue_s=60), submitted_at=rig.clock()), rig.token("acme"))
        admissions[task_id] = await rig.recorder.wait("task.admitted", task_id)
    await rig.bus.publish(ended_by("oom_killed", "t-oom", "acme", admissions["t-oom"].admitted_at))
    # Handled in order by the same consumer: once t-done's end is, t-oom's kill was.
    await rig.bus.publish(ended_by("finished", "t-done", "acme", admissions["t-done"].admitted_at))

    async def done_forgotten() -> bool:
        return await contracts.get(contract_key("t-done")) is None

    await eventually(done_forgotten, what="t-done's contract forgotten at its end")
    assert await contracts.get(contract_key("t-oom")) is not None
    await rig.bus.publish(ended_by("given up", "t-oom", "acme", admissions["t-oom"].admitted_at))

    async def oom_forgotten() -> bool:
        return await contracts.get(contract_key("t-oom")) is None

    await eventually(oom_forgotten, what="t-oom's contract forgotten once given up")


async def test_a_submission_of_an_ended_task_delivered_again_is_not_answered_again(rig):
    """The submission's acknowledgement was lost (a server failover) and it came again after
    its task had ended: its answer, the admission, went out before the task could run. A
    redelivery of another submission of the id is refused like any resubmission; another
    tenant's is dead-lettered, as while the task ran."""
    await rig.start_sla()
    task = TaskSubmitted(task_id="t-late", tenant="acme", gpus=1, submitted_at=rig.clock())
    first = await (await negotiator_on(rig)).submitted(task, redelivered=False)
    assert isinstance(first, TaskAdmitted)
    await rig.bus.publish(ended_by("finished", "t-late", "acme", first.admitted_at))
    contracts = await rig.bus.kv("contracts")

    async def forgotten() -> bool:
        return await contracts.get(contract_key("t-late")) is None

    await eventually(forgotten, what="t-late's contract forgotten at its end")
    replica = await negotiator_on(rig)
    assert await replica.submitted(task, redelivered=True) is None
    other = msgspec.structs.replace(task, submitted_at=task.submitted_at + 1)
    refused = await replica.submitted(other, redelivered=True)
    assert isinstance(refused, TaskRejected) and refused.code == "invalid"
    assert isinstance(await replica.submitted(task, redelivered=False), TaskRejected)
    with pytest.raises(Reject, match="another tenant"):
        await replica.submitted(msgspec.structs.replace(task, tenant="mallory"), redelivered=False)
    assert await contracts.get(contract_key("t-late")) is None


async def test_an_ended_task_admitted_through_its_offer_is_refused_even_without_its_contract(rig):
    """An accepted offer is the task's admission whether or not its contract write landed:
    the end of such a task must spend its id too."""
    await fill_h100(rig, free_in_s=120)
    await rig.start_sla()
    task = h100_only("t-offered")
    await rig.submit(task, rig.token("acme"))
    offer: SlaOffer = await rig.recorder.wait("sla.offer.t-offered", "t-offered")
    await rig.reply(SlaReply(offer_id=offer.offer_id, task_id="t-offered", accept=True,
                             option_id=offer.options[0].option_id), rig.token("acme"))
    adm: TaskAdmitted = await rig.recorder.wait("task.admitted", "t-offered")
    contracts = await rig.bus.kv("contracts")
    await contracts.delete(contract_key("t-offered"))  # the reply's contract write, lost
    await rig.bus.publish(ended_by("finished", "t-offered", "acme", adm.admitted_at))

    async def forgotten() -> bool:
        return "offer.t-offered" not in await contracts.keys()

    await eventually(forgotten, what="t-offered's offer forgotten at its end")
    await rig.submit(msgspec.structs.replace(task, submitted_at=task.submitted_at + 60), rig.token("acme"))
    refused: TaskRejected = await rig.recorder.wait("task.rejected", "t-offered", timeout_s=5)
    assert refused.code == "invalid" and "finished" in refused.reason
    assert await contracts.get(contract_key("t-offered")) is None
