"""The SLA negotiator service.

Every ``task.submitted`` must carry ``Authorization: Bearer <jwt>``; the tenant comes from
the verified token, never from the payload. A submission without a valid token gets
``task.rejected`` (code ``unauthenticated``) and nothing else happens. A valid one is
negotiated (``fleetpilot.sla.negotiate``) against a snapshot of the live fleet (topology
and ledger buckets, agreed contracts, inter-site bandwidth, the GPU catalogue):

- admitted -> ``task.admitted`` with the agreed contract, stored in the ``contracts`` bucket;
- counter-offer -> ``sla.offer.<task>``, stored with the submission as an open offer so any
  replica can answer the reply (while open, its first option's GPUs are counted as taken
  in every other negotiation); the client answers on ``sla.reply.<task>``: accepting an
  option -> ``task.admitted`` under that option's terms (``task.rejected``, ``infeasible``,
  when the fleet can no longer meet them: only the first option is held), declining ->
  ``task.rejected`` (``offer_declined``), silence past the validity -> ``task.rejected``
  (``offer_expired``);
- rejected -> ``task.rejected`` with the negotiator's code and reason.

The policy places by ``task.gpu_models`` only, so the agreed model is written into the
admitted task (``task.gpu_models = [agreed model]``): that is how the contract reaches the
placement without the policy reading contracts.

``sla.negotiate`` answers the same question interactively (request: a ``task.submitted``
body with the Authorization header; reply: ``sla.offer``, ``task.admitted`` or
``task.rejected``) without publishing or storing anything: a quote.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec
from fleetpilot.auth import AuthError, Claims, TokenVerifier, load_jwks
from fleetpilot.contracts import (
    SLA_NEGOTIATE,
    Event,
    Fingerprint,
    SlaOffer,
    SlaReply,
    TaskAdmitted,
    TaskLifecycle,
    TaskRejected,
    TaskSubmitted,
    TopologyUpdated,
)
from fleetpilot.fingerprint.signature import predict, stored_stats, task_signature
from fleetpilot.ledger import FleetView as TopologyView
from fleetpilot.ledger import LedgerStore
from fleetpilot.policy.backfill import queue_key
from fleetpilot.runtime import Bus, CasConflict, Delivery, Reject, Retry, ServiceHost, ServiceSettings, serve
from fleetpilot.runtime.config import queue_aging_default
from fleetpilot.sla import (
    Admit,
    CounterOffer,
    FleetView,
    NegotiationPolicy,
    OfferBook,
    contract_for,
    negotiate,
    option_lapsed,
    task_problem,
)
from fleetpilot.sla import Reject as SlaReject
from fleetpilot.sla.snapshot import (
    SnapshotCache,
    SnapshotKnobs,
    as_named_by_fleet,
    bandwidth_table,
    fleet_view,
    offers_hold_until,
)
from prometheus_client import CollectorRegistry, Counter
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from .metrics import SlaMetrics
from .store import ContractStore, OfferRecord

log = logging.getLogger("fleetpilot.sla")


Clock = Callable[[], float]


class SlaSettings(ServiceSettings):
    """``FLEETPILOT_SLA_*``."""

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_SLA_", extra="ignore")

    jwks_path: str = ""
    audience: str = "fleetpilot"
    issuer: str = "fleetpilot-local"
    algorithms: list[str] = ["EdDSA", "ES256", "RS256"]
    # Bounded, so that a typo stops the service with one line instead of quietly making
    # offers that never expire (NaN validity), offers without options, or a warm-up divided
    # by a bandwidth of 0 (every submission with data retried, then dead-lettered).
    offer_validity_s: float = Field(default=30.0, gt=0.0, allow_inf_nan=False)
    # How long past its validity an unanswered offer stays open for a reply the stream stored
    # in time that this service has not handled yet (a backlog of replies: the reply is judged
    # by when it was stored, ``reply_received_at``); closed at once, the expiry job answered
    # such a reply ``offer_expired``. A reply stored after the validity is expired whenever it
    # is handled, and the offer stops holding its GPUs at its validity either way; what grows
    # with it is how late the client hears of an unanswered offer's expiry.
    reply_grace_s: float = Field(default=10.0, ge=0.0, allow_inf_nan=False)
    max_options: int = Field(default=4, ge=1)
    expiry_interval_s: float = Field(default=0.5, gt=0.0, allow_inf_nan=False)
    reserve_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    local_bandwidth_gbps: float = Field(default=5.0, gt=0.0, allow_inf_nan=False)
    default_bandwidth_gbps: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    bandwidth_strategy: Literal["min_rtt", "balanced"] = "min_rtt"
    reference_p95_ms: float = Field(default=50.0, gt=0.0, allow_inf_nan=False)
    default_price_per_gpu_hour: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    negotiate_subject: str = SLA_NEGOTIATE.subject  # as documented in proto/
    require_reply_token: bool = True
    # A submission that asks for GPUs before any node has reported (a fresh deploy, the
    # collectors' first reports still to come) waits this long for the fleet, kept alive on
    # the stream, before it is retried as a failure (and dead-lettered at max_deliver).
    fleet_wait_s: float = Field(default=120.0, ge=0.0, allow_inf_nan=False)
    # A declined or expired offer answers redelivered replies and submissions with the outcome
    # it closed with for this long (as long as the ``rejections`` bucket keeps a rejection),
    # then leaves the contracts bucket: nothing else would ever remove it.
    closed_offer_keep_s: float = Field(default=86_400.0, gt=0.0, allow_inf_nan=False)
    # The policy's queue aging (FLEETPILOT_QUEUE_AGING sets both; a prefixed one, this
    # service's alone): a request is estimated behind only the waiting tasks the policy's
    # queue order serves before it.
    queue_aging: float = Field(default_factory=queue_aging_default, validate_default=True, gt=0.0,
                               allow_inf_nan=False)


def bearer_token(headers: dict[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer ...`` header (any header-name case)."""
    for name, value in headers.items():
        if name.lower() == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
    return None


def jwks_path_of(settings: SlaSettings) -> Path:
    """Where the verifier's key set is: ``jwks_path`` or ``<state_dir>/jwks.json``."""
    return Path(settings.jwks_path or Path(settings.state_dir) / "jwks.json")


class UnreadableKeySet(ValueError):
    """The published key set exists but is no key set (empty, cut, not JSON)."""


def load_verifier(settings: SlaSettings, clock: Clock = time.time) -> TokenVerifier:
    """The token verifier over the published key set."""
    path = jwks_path_of(settings)
    if not path.exists():
        raise FileNotFoundError(f"no JWKS at {path}: `fleetpilot token --state-dir {path.parent}` creates a key "
                                f"ring and its JWKS there; or set FLEETPILOT_SLA_JWKS_PATH")
    verifier = TokenVerifier({"keys": []}, audience=settings.audience, issuer=settings.issuer,
                             algorithms=settings.algorithms, clock=clock)
    try:
        # JSON that is no key set (``[]``, ``{"keys": 3}``) is as unreadable as cut JSON.
        verifier.update_jwks(load_jwks(path))
    except ValueError as exc:  # json.JSONDecodeError is one
        raise UnreadableKeySet(f"cannot read the key set {path}: {exc}") from None
    return verifier


class Gate:
    """Authentication at the edge: bearer token -> verified claims, refusals counted.

    The key set is re-read when the JWKS file changes (keys rotate weekly), so a rotation
    needs no restart; a retired key is refused by the verifier even from a stale file.
    """

    def __init__(self, settings: SlaSettings, clock: Clock, refused: Counter) -> None:
        self._path = jwks_path_of(settings)
        # The file's stamp before reading it: a rewrite between the read and the stamp
        # would otherwise be taken as read, and its keys never loaded until the next one.
        self._seen = self._stamp() if self._path.exists() else None
        self._verifier = load_verifier(settings, clock)
        self._refused = refused

    def _stamp(self) -> tuple[int, int, int]:
        stat = self._path.stat()
        # The inode too: save_jwks replaces the file, so a rewrite of the same size within
        # one tick of the file system's clock still shows as a change.
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def _refresh(self) -> None:
        try:
            stamp = self._stamp()
            if stamp != self._seen:
                self._verifier.update_jwks(load_jwks(self._path))
                self._seen = stamp
        except (OSError, ValueError) as exc:
            # A key set being rewritten (or briefly missing) must not stop admissions: keep
            # verifying with the keys we have and pick the new set up on a later request.
            log.warning("JWKS at %s unreadable, keeping the current keys: %s", self._path, exc)

    def claims(self, headers: dict[str, str]) -> Claims:
        """The verified claims of the request's bearer token; ``AuthError`` (counted) otherwise."""
        try:
            token = bearer_token(headers)
            if token is None:
                raise AuthError("malformed", "no bearer token in the Authorization header")
            self._refresh()
            return self._verifier.verify(token)
        except AuthError as exc:
            self._refused.labels(exc.reason).inc()
            raise


def _rejected(task_id: str, tenant: str, code, reason: str, at: float) -> TaskRejected:
    return TaskRejected(task_id=task_id, tenant=tenant, code=code, reason=reason, rejected_at=at)


def _model_bound(task: TaskSubmitted) -> bool:
    """Whether the ask depends on which GPU model runs it (then the agreed model is pinned)."""
    sla = task.sla
    return bool(task.gpu_models) or any(bound is not None for bound in (
        sla.max_queue_s, sla.warmup_ms, sla.p95_latency_ms, sla.deadline, sla.cost_ceiling_per_hour))


def admission(task: TaskSubmitted, admit: Admit, at: float) -> TaskAdmitted:
    """The ``task.admitted`` of an :class:`Admit`, shaped so the policy honours the contract.

    When the ask depends on the GPU model (any bound, or a list of models) the task is held
    to the contract's models (the one it was estimated on first, then every other that keeps
    its terms: ``negotiate.admit_contract``), because the policy places by
    ``task.gpu_models``. An unbounded ask keeps its own (possibly empty) list: any GPU
    satisfies it, and pinning would only stop the policy from packing.
    """
    contract = admit.contract
    if _model_bound(task) and contract.gpu_models:
        task = msgspec.structs.replace(task, gpu_models=list(contract.gpu_models))
    else:
        contract = msgspec.structs.replace(contract, gpu_models=list(task.gpu_models))
    return TaskAdmitted(task=task, contract=contract, tenant=task.tenant, admitted_at=at)


def reply_received_at(stored_at: float | None, handled_at: float) -> float:
    """When a reply reached the bus, to judge its lateness by: when its stream stored it
    (``Delivery.stored_at``), capped at ``handled_at`` (this service's clock, now); ``now``
    alone when the stored time is not known.

    A reply sent in time must not expire because this service handled it late (a backlog).
    The stored time is the server's clock and ``valid_until`` this service's, so a skew
    between them moves the deadline, and the choice is which way it may move:

    - the server's clock ahead: the cap keeps the judgement no stricter than by the handling
      time (what it was before the stored time was read); only a reply handled late and
      stored within the skew of ``valid_until`` is expired while it came in time;
    - the server's clock behind: a reply up to the skew late is taken as in time, but only
      while the offer is open: the expiry job closes it ``reply_grace_s`` after
      ``valid_until`` by this service's clock, so no reply is admitted later than that,
      whatever the skew. NTP keeps the skew to milliseconds, against a validity of seconds.
    """
    return handled_at if stored_at is None else min(stored_at, handled_at)


def settle_reply(record: OfferRecord, reply: SlaReply, at: float, *, lapsed: str | None = None,
                 received_at: float | None = None) -> TaskAdmitted | TaskRejected:
    """The outcome of the client's reply to an open offer (mirrors ``OfferBook.reply``).

    Accepting admits under the option's terms (``contract_for``) with the task held to the
    option's GPU model and the others its terms hold on (``OfferOption.gpu_models``), unless
    the fleet can no longer meet them (``lapsed`` says why): then it is rejected as
    ``infeasible`` with that reason, to be submitted again for a fresh offer. Declining rejects with ``offer_declined``; a reply received after ``valid_until``
    gets ``offer_expired``: received at ``received_at`` (``reply_received_at``; ``at``, the
    time of the outcome, when not given). An option the offer does not list raises
    ``Reject`` (dead letter) and leaves the offer open for a correct answer.
    """
    offer, task = record.offer, record.task
    if (at if received_at is None else received_at) > offer.valid_until:
        return _rejected(task.task_id, task.tenant, "offer_expired", "the offer expired before the answer came", at)
    if not reply.accept:
        return _rejected(task.task_id, task.tenant, "offer_declined", "the client declined every option", at)
    option = next((o for o in offer.options if o.option_id == reply.option_id), None)
    if option is None:
        raise Reject(f"offer {offer.offer_id} has no option {reply.option_id!r}")
    if lapsed is not None:
        return _rejected(task.task_id, task.tenant, "infeasible", f"{lapsed}; submit it again for a fresh offer", at)
    contract = contract_for(task, option, offer.offer_id)
    if option.gpu_model:
        # The option's model, and every other its terms hold on (``OfferOption.gpu_models``).
        task = msgspec.structs.replace(task, gpu_models=list(contract.gpu_models))
    return TaskAdmitted(task=task, contract=contract, tenant=task.tenant, admitted_at=at)


class Negotiator:
    """One replica's live inputs (fleet, ledger, contracts, bandwidth) and the decisions on them."""

    def __init__(self, bus: Bus, settings: SlaSettings, clock: Clock, topology: TopologyView,
                 ledger: LedgerStore, store: ContractStore, metrics: SlaMetrics | None = None) -> None:
        self.bus, self.settings, self.clock = bus, settings, clock
        self.metrics = metrics or SlaMetrics(CollectorRegistry())
        self.topology, self.ledger, self.store = topology, ledger, store
        self.bandwidth: dict[tuple[str, str], float] = {}
        self.knobs = SnapshotKnobs(reserve_fraction=settings.reserve_fraction,
                                   local_bandwidth_gbps=settings.local_bandwidth_gbps,
                                   default_bandwidth_gbps=settings.default_bandwidth_gbps,
                                   reference_p95_ms=settings.reference_p95_ms,
                                   default_price_per_gpu_hour=settings.default_price_per_gpu_hour,
                                   queue_aging=settings.queue_aging)
        self.policy = NegotiationPolicy(offer_ttl_s=settings.offer_validity_s, max_options=settings.max_options)
        # What each decision reads of the whole fleet, redone only for what changed since the
        # last: on the openb fleet a view from scratch costs 12.5 ms of CPU, with nothing held.
        self.snapshots = SnapshotCache()
        self._models: tuple[int, set[str]] = (-1, set())

    def fleet_models(self) -> set[str]:
        """The GPU models in the fleet (recomputed when the topology changes)."""
        if self._models[0] != self.topology.version:
            self._models = (self.topology.version,
                            {g.model for node in self.topology.nodes.values() for g in node.gpus})
        return self._models[1]

    async def fingerprint(self, task: TaskSubmitted) -> Fingerprint | None:
        """What past runs of the same signature predict (memory peak, warm-up), if known."""
        signature = task_signature(task)
        entry = await (await self.bus.kv("fingerprints")).get(signature)
        # Unreadable or in old units is nothing known: negotiate without it rather than refuse,
        # the fingerprint only sharpens estimates (``stored_stats``).
        stats = stored_stats(signature, entry.value if entry is not None else None)
        return predict(stats) if stats is not None else None

    def offers_against(self, task_id: str) -> list[OfferRecord]:
        """The open offers that hold GPUs against ``task_id``: every other submission's. A
        task's own (a quote while it is open, or a view that has not seen it closed) never
        competes with it."""
        return [r for r in self.store.open_offers.values() if r.task.task_id != task_id]

    def view(self, task: TaskSubmitted, now: float, offers: list[OfferRecord] | None = None) -> FleetView:
        """The fleet as ``task``'s negotiation sees it at ``now``: behind the waiting tasks the
        policy's queue serves before it, ``offers`` holding their first option's GPUs."""
        ahead_of = queue_key(task.sla.tier, now, task.expected_duration_s, self.knobs.queue_aging)
        return fleet_view(self.topology.nodes.values(), self.ledger.nodes.values(), self.store.admitted,
                          now=now, bandwidth_gbps=self.bandwidth, knobs=self.knobs, cache=self.snapshots,
                          offers=offers or (), ahead_of=ahead_of)

    async def lapsed(self, record: OfferRecord, reply: SlaReply) -> str | None:
        """Why the option ``reply`` accepts can no longer be met (``option_lapsed``), on the
        fleet as it is now, other open offers holding theirs; ``None`` while it can, and for
        any reply that accepts no listed option."""
        option = next((o for o in record.offer.options if o.option_id == reply.option_id), None)
        if not reply.accept or option is None:
            return None
        now = self.clock()
        view = self.view(record.task, now, self.offers_against(record.task.task_id))
        return option_lapsed(record.task, option, view, now=now, fingerprint=await self.fingerprint(record.task))

    async def decide(self, task: TaskSubmitted) -> Event:
        """Negotiate ``task`` (tenant already verified); the event that answers it, unstored."""
        now = self.clock()
        if task.gpu_models:
            task = msgspec.structs.replace(task, gpu_models=as_named_by_fleet(task.gpu_models, self.fleet_models()))
        offers = self.offers_against(task.task_id)
        view = self.view(task, now, offers)
        fingerprint = await self.fingerprint(task)
        decision = negotiate(task, view, now=now, fingerprint=fingerprint, policy=self.policy)
        if (isinstance(decision, SlaReject) and decision.code == "infeasible"
                and (until := offers_hold_until(offers, self.store.admitted, now)) is not None):
            if not isinstance(negotiate(task, self.view(task, now), now=now, fingerprint=fingerprint, policy=self.policy),
                              SlaReject):
                # Only the open offers' holds leave it nothing: offering their GPUs again would
                # promise them twice; "no pool will free" would be untrue. Say when to ask again.
                decision = SlaReject("infeasible", "every GPU that could run it is held for open counter-offers to "
                                   f"other submissions until {until:.0f} (at most {until - now:.0f} s): "
                                   "submit it again then", task.task_id)
        if isinstance(decision, Admit):
            return admission(task, decision, now)
        if isinstance(decision, CounterOffer):
            offer = OfferBook(clock=self.clock).open(task, decision, tenant=task.tenant)
            # The book numbers offers per instance; a unique id keeps a late reply to an
            # earlier offer for the same task id from landing on a newer one.
            return msgspec.structs.replace(offer, offer_id=f"{task.task_id}/{uuid.uuid4().hex[:12]}")
        return _rejected(task.task_id, task.tenant, decision.code, decision.reason, now)

    async def submitted(self, task: TaskSubmitted, redelivered: bool) -> Event | None:
        """Answer a verified submission: reuse a stored answer for the same task, else negotiate;
        ``None`` when nothing is to be published.

        An admission is reused for any submission of the task id; a closed offer's outcome and
        a rejection only for a redelivery (of the same ask, for a rejection): a client may
        resubmit a refused task, and the fleet may have changed since. Once the admitted task
        has ended, its id is spent: another submission of it is refused (``invalid``), and the
        admitted one delivered again is answered by nothing, its admission having gone out.

        Done under the task's negotiation claim, so that copies of a submission handled by
        two replicas at once get one answer: without it, one replica could admit while the
        other, its view of the fleet a moment older, counter-offered or rejected."""
        revision = await self.store.claim(task.task_id, self.settings.replica, self.clock)
        try:
            return await self._answer(task, redelivered)
        finally:
            await self.store.release(task.task_id, revision)

    async def _answer(self, task: TaskSubmitted, redelivered: bool) -> Event | None:
        stored = await self.store.admission(task.task_id)
        if stored is not None:
            _same_tenant(stored.tenant, task)
            return stored  # a redelivery or a resubmission: same admission, same msg id
        # Before the offer: an ended task's accepted offer is deleted after its contract, and
        # read in between it would store the contract again.
        ended = await self.store.ended(task.task_id)
        if ended is not None:
            # Admitted afresh, the policy would decide nothing (the executor's journal holds
            # the task's assign): "admitted", then silence, and a contract held for ever.
            _same_tenant(ended.rejection.tenant, task)
            if redelivered and task.submitted_at == ended.task.submitted_at:
                return None  # its admission went out before the task could run
            # Stamped now: a second resubmission gets an answer of its own, not one the
            # stream's duplicate window drops.
            spent = msgspec.structs.replace(ended.rejection, rejected_at=self.clock())
            self.metrics.answered(task, spent)
            return spent
        existing = await self.store.offer(task.task_id)
        if existing is not None:
            record, revision = existing
            _same_tenant(record.task.tenant, task)
            if record.state == "open":
                return record.offer
            if isinstance(record.outcome, TaskAdmitted):
                # Accepted: that is the task's admission, whether or not the reply's contract
                # write has landed yet (or ever will); a fresh negotiation would admit it twice.
                return await self.store.admit_once(record.outcome)
            if redelivered and record.outcome is not None:
                return record.outcome
        if redelivered:
            rejected = await self.store.rejection(task)
            if rejected is not None:
                return rejected  # told once; a fresh negotiation now might say otherwise
        answer = await self.decide(task)
        if isinstance(answer, TaskAdmitted):
            answer = await self.store.admit_once(answer)
            _same_tenant(answer.tenant, task)
        elif isinstance(answer, TaskRejected):
            await self.store.record_rejection(task, answer)
        elif isinstance(answer, SlaOffer):
            record = await self.store.open_offer(OfferRecord(offer=answer, task=task),
                                                 replacing=existing[1] if existing is not None else None)
            answer = record.offer if record.state == "open" else record.outcome  # type: ignore[assignment]
        self.metrics.answered(task, answer)
        return answer

    async def replied(self, reply: SlaReply, tenant: str | None, stored_at: float | None = None
                      ) -> TaskAdmitted | TaskRejected:
        """Close the offer ``reply`` answers, once across replicas (CAS on the offer's revision);
        ``stored_at``: when the stream stored the reply (``Delivery.stored_at``), what its
        lateness is judged by (``reply_received_at``)."""
        for _ in range(5):
            found = await self.store.offer(reply.task_id)
            if found is None or found[0].offer.offer_id != reply.offer_id:
                raise Reject(f"no offer {reply.offer_id!r} for task {reply.task_id!r}")
            record, revision = found
            if tenant is not None and tenant != record.task.tenant:
                raise Reject(f"tenant {tenant!r} may not answer an offer made to {record.task.tenant!r}")
            if record.state != "open" and record.outcome is not None:
                outcome = record.outcome  # a redelivered or repeated reply: the same answer again
            else:
                lapsed = await self.lapsed(record, reply)
                now = self.clock()
                outcome = settle_reply(record, reply, now, lapsed=lapsed,
                                       received_at=reply_received_at(stored_at, now))
                state = ("accepted" if isinstance(outcome, TaskAdmitted) else
                         "expired" if outcome.code == "offer_expired" else
                         "lapsed" if lapsed is not None else "declined")
                try:
                    await self.store.close_offer(msgspec.structs.replace(record, state=state, outcome=outcome),
                                                 revision)
                except CasConflict:
                    continue  # another replica closed it (or it expired): read its answer
                self.metrics.offer_closed(state)
            if isinstance(outcome, TaskAdmitted):
                await self.store.record_admission(outcome)
            return outcome
        raise Retry("offer kept changing", 0.2)

    async def expire(self) -> list[TaskRejected]:
        """Close every open offer past its validity and ``reply_grace_s`` with
        ``offer_expired``; the rejections to publish.

        The grace leaves a reply sent in time but not handled yet (a backlog) to close the
        offer, judged by when it was stored (``settle_reply``)."""
        now = self.clock()
        grace = self.settings.reply_grace_s
        out = []
        for task_id, seen in list(self.store.open_offers.items()):
            if now <= seen.offer.valid_until + grace:
                continue
            found = await self.store.offer(task_id)
            if found is None or found[0].state != "open":
                self.store.open_offers.pop(task_id, None)
                continue
            record, revision = found
            if now <= record.offer.valid_until + grace:
                # The view lags: the bucket holds a newer offer (a resubmission answered by
                # another replica), still valid. Closing it would expire a live offer.
                self.store.open_offers[task_id] = record
                continue
            task = record.task
            outcome = _rejected(task.task_id, task.tenant, "offer_expired", "no answer before the offer expired", now)
            try:
                await self.store.close_offer(msgspec.structs.replace(record, state="expired", outcome=outcome),
                                             revision)
            except CasConflict:
                continue  # answered or expired by another replica meanwhile
            self.metrics.offer_closed("expired")
            out.append(outcome)
        return out

    async def drop_closed_offers(self) -> None:
        """Delete declined and expired offers closed longer ago than ``closed_offer_keep_s``."""
        before = self.clock() - self.settings.closed_offer_keep_s
        for task_id, closed_at in list(self.store.closed_offers.items()):
            if closed_at < before:
                await self.store.drop_closed_offer(task_id)


ANSWER_CODES = frozenset({"unauthenticated", "invalid", "offer_declined", "offer_expired"})
"""Rejection codes that only ever answer a submission or an offer, never end an admitted task."""


def ends_admission(adm: TaskAdmitted, rejected: TaskRejected) -> bool:
    """Whether ``rejected`` gives up the task ``adm`` admitted (its contract then goes).

    Only a rejection of the same tenant, stamped at or after the admission, with a code that
    can end a running task (the policy's ``infeasible``). The rejection of an earlier
    submission of the same task id (an offer that expired, then a resubmission admitted)
    may be read late, after the new admission: it must not forget the new contract."""
    return (adm.tenant == rejected.tenant and rejected.code not in ANSWER_CODES
            and rejected.rejected_at >= adm.admitted_at)


def _same_tenant(owner: str, task: TaskSubmitted) -> None:
    # Task ids are global: another tenant re-using one must not see or steer the owner's
    # contract. Dead-lettered rather than rejected, since a task.rejected for that id would
    # tell the owner its own task was refused.
    if owner != task.tenant:
        raise Reject(f"task id {task.task_id!r} belongs to another tenant")


def build(settings: SlaSettings | None = None, *, clock: Clock = time.time) -> ServiceHost:
    """Wire the negotiator. ``clock`` (seconds) drives token checks, estimates and offer
    validity; tests inject one to move through key rotation."""
    settings = settings or SlaSettings.from_environment()
    host = ServiceHost("sla", settings)
    metrics = SlaMetrics(host.metrics.registry)
    gate = Gate(settings, clock, metrics.unauthenticated)
    holder: dict[str, Negotiator] = {}

    async def open_state(bus: Bus) -> None:
        topology = await TopologyView.open(bus)
        ledger = await LedgerStore.open(bus)
        store = await ContractStore.open(bus)
        holder["n"] = Negotiator(bus, settings, clock, topology, ledger, store, metrics)
        host.background(topology.follow, "topology-watch")
        host.background(ledger.follow, "ledger-watch")
        host.background(store.follow, "contracts-watch")

    host.on_startup(open_state)

    def verified(task: TaskSubmitted, delivery: Delivery) -> TaskSubmitted | TaskRejected:
        try:
            claims = gate.claims(delivery.headers)
        except AuthError as exc:
            log.warning("rejected %s: %s", task.task_id, exc)
            return _rejected(task.task_id, "", "unauthenticated", str(exc), clock())
        return msgspec.structs.replace(task, tenant=claims.tenant)

    def fleet_known(task: TaskSubmitted) -> bool:
        # An invalid submission is answered without the fleet: no report can change that
        # answer, and waiting for one left it retried, then dead-lettered, never answered.
        return task.gpus == 0 or task_problem(task) is not None or bool(holder["n"].topology.nodes)

    async def fleet_reported(task: TaskSubmitted) -> bool:
        # Waited for here, not retried: five one-second retries dead-lettered a fresh
        # deploy's first submissions before the collectors' first reports came in.
        deadline = time.monotonic() + settings.fleet_wait_s
        while not fleet_known(task) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return fleet_known(task)

    @host.on(TaskSubmitted, consumer="sla-submitted")
    async def on_submitted(task: TaskSubmitted, delivery: Delivery) -> Event | None:
        checked = verified(task, delivery)
        if isinstance(checked, TaskRejected):
            metrics.answered(task, checked)
            return checked
        if not await fleet_reported(checked):
            raise Retry(f"no node has reported in {settings.fleet_wait_s:g} s", 1.0)
        return await holder["n"].submitted(checked, redelivered=delivery.deliveries > 1)

    @host.on(SlaReply, consumer="sla-replies")
    async def on_reply(reply: SlaReply, delivery: Delivery) -> Event:
        tenant = None
        if settings.require_reply_token:
            try:
                tenant = gate.claims(delivery.headers).tenant
            except AuthError as exc:
                # Dead-lettered, not rejected: a bad reply must not close someone's offer.
                raise Reject(f"reply to {reply.offer_id}: {exc}") from exc
        return await holder["n"].replied(reply, tenant, delivery.stored_at)

    @host.on(TaskLifecycle, consumer="sla-lifecycle")
    async def on_lifecycle(life: TaskLifecycle) -> None:
        # A contract lives as long as its task: the bucket and every negotiation's scan of
        # it would otherwise grow for ever. An OOM kill does not end it: the policy starts the
        # task over (``oom_restarts``), and gives it up with a ``task.rejected`` (below) when
        # it will not.
        if life.state in ("finished", "failed"):
            await holder["n"].store.end(life.task_id, life.state, life.at)

    @host.on(TaskRejected, consumer="sla-rejected")
    async def on_rejected(rejected: TaskRejected) -> None:
        # A task given up after its admission (the policy's rejection of a task the executor
        # refused again and again, or of one killed by an OOM past its restarts) ends here, as
        # one that finished: its contract goes. Only for the tenant that holds it: our own
        # rejection of a bad resubmission of the same task id (another tenant, no token) must
        # not end a running task's contract.
        store = holder["n"].store
        adm = await store.admission(rejected.task_id)
        if adm is not None and ends_admission(adm, rejected):
            await store.end(rejected.task_id, f"given up: {rejected.reason}", rejected.rejected_at)

    @host.every(settings.expiry_interval_s)
    async def expire_offers() -> list[TaskRejected]:
        negotiator = holder.get("n")
        if negotiator is None:
            return []
        expired = await negotiator.expire()
        try:
            await negotiator.drop_closed_offers()
            await negotiator.store.drop_stale_claims(clock())
        except Exception as exc:  # noqa: BLE001 - the offers just closed must still be told
            log.warning("could not drop old closed offers or claims (next tick tries again): %s", exc)
        return expired

    @host.on_core("topology.updated", TopologyUpdated)
    async def on_topology(update: TopologyUpdated) -> None:
        table = bandwidth_table(update.bandwidth, settings.bandwidth_strategy)
        if table and "n" in holder:
            holder["n"].bandwidth = table

    @host.endpoint("negotiate", settings.negotiate_subject, TaskSubmitted)
    async def quote(task: TaskSubmitted, delivery: Delivery) -> Event:
        checked = verified(task, delivery)
        if isinstance(checked, TaskRejected):
            return checked
        if not fleet_known(checked):
            return _rejected(task.task_id, checked.tenant, "infeasible", "no fleet topology known yet", clock())
        return await holder["n"].decide(checked)

    return host


def main() -> None:
    """Console entry point ``fleetpilot-sla``."""
    serve("sla", build, FileNotFoundError, UnreadableKeySet)
