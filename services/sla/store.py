"""The ``contracts`` bucket: agreed contracts and open offers, shared by every sla replica.

Three kinds of keys, one each per task (``node_key(task_id)`` makes any task id a legal key):

- ``contract.<task>``: the ``TaskAdmitted`` that was published, contract included. Other
  services may read it; the negotiator reads it back for the tier and expected duration of
  the work holding GPUs, and to answer a redelivered submission with the same admission.
- ``offer.<task>``: an :class:`OfferRecord`, the counter-offer with the submission it is
  about, and once closed the outcome that was published. Any replica (or this one after a
  restart) can therefore answer the client's reply or expire the offer; the close is a
  compare-and-set on the key's revision, so exactly one of them decides.

The store also keeps an in-memory view of both (watched), which the negotiator reads to
build its fleet snapshot and the expiry job to find offers past their validity.

- ``claim.<task>``: a :class:`NegotiationClaim`, held while one replica reads what the task
  was answered and negotiates it. Two copies of a submission (a redelivery after a lost
  acknowledgement, a client's retry) reaching two replicas at once are thus answered one
  after the other: the second reads the first's answer instead of giving its own, which
  could differ (an admission and a counter-offer for one submission). Created, then
  deleted at its revision; one left by a replica that died mid-negotiation is taken over
  once a waiter has seen it unchanged for ``CLAIM_STALE_S``, and removed by the expiry job
  (after as long, seen by it) if nobody needs it. Both time it on their own clocks.

A negotiated rejection is kept apart, in the ``rejections`` bucket (a day's time-to-live):
a :class:`RejectionRecord` per task, so a redelivered submission (its acknowledgement lost,
its replica gone) gets the rejection it was given, not a second answer that may differ. So
is the end of an admitted task (``end``): its contract goes, and a record marked ``ended``
takes its place there for a day, so that its id, which names that one run, is not admitted
again (the policy would decide nothing for it: the executor's journal holds its assign).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Literal

import msgspec
from fleetpilot.contracts import SlaOffer, TaskAdmitted, TaskRejected, TaskSubmitted, encode
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import Bus, CasConflict, KeyValue

log = logging.getLogger("fleetpilot.sla.store")

OfferState = Literal["open", "accepted", "declined", "expired", "lapsed"]

CONTRACT_PREFIX = "contract."
OFFER_PREFIX = "offer."
CLAIM_PREFIX = "claim."

CLAIM_STALE_S = 30.0
"""How long a negotiation claim seen unchanged means its holder died. A negotiation reads
a few keys and writes one (milliseconds); a live holder slower than this loses only the
serialisation, not correctness: the admission and offer writes are compare-and-set too."""

CLAIM_POLL_S = 0.05
"""How often a replica waiting for another's claim looks again."""


class OfferRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One counter-offer as stored: what was offered, for which submission, and how it ended.

    ``task`` carries the tenant taken from the submitter's token. ``outcome`` is set when the
    offer closes and is what a redelivered reply gets again.
    """

    offer: SlaOffer
    task: TaskSubmitted
    state: OfferState = "open"
    outcome: TaskAdmitted | TaskRejected | None = None


class RejectionRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A negotiated rejection with the submission (tenant from its token) it answered.

    ``ended`` marks the record of an admitted task that has ended (ran to its end, or was
    given up): ``task`` is then the submission that was admitted, and ``rejection`` what any
    other submission of its id is told."""

    task: TaskSubmitted
    rejection: TaskRejected
    ended: bool = False


class NegotiationClaim(msgspec.Struct, frozen=True, kw_only=True):
    """Who is negotiating a task, since when (the holder's clock, seconds)."""

    holder: str
    at: float


_ADMITTED = msgspec.json.Decoder(TaskAdmitted)
_CLAIM = msgspec.json.Decoder(NegotiationClaim)
_OFFER = msgspec.json.Decoder(OfferRecord)
_REJECTION = msgspec.json.Decoder(RejectionRecord)


def contract_key(task_id: str) -> str:
    """The key of a task's agreed contract."""
    return CONTRACT_PREFIX + node_key(task_id)


def offer_key(task_id: str) -> str:
    """The key of a task's counter-offer."""
    return OFFER_PREFIX + node_key(task_id)


def _holder_of(value: bytes) -> str | None:
    """The holder a stored claim names; ``None`` for one that does not decode."""
    try:
        return _CLAIM.decode(value).holder
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def claim_key(task_id: str) -> str:
    """The key of a task's negotiation claim."""
    return CLAIM_PREFIX + node_key(task_id)


class ContractStore:
    """Reads and CAS writes on the ``contracts`` bucket, plus a watched in-memory view."""

    def __init__(self, kv: KeyValue, rejections: KeyValue) -> None:
        self._kv = kv
        self._rejections = rejections
        self.admitted: dict[str, TaskAdmitted] = {}
        self.open_offers: dict[str, OfferRecord] = {}
        # Declined and expired offers by task, with when they closed: their task never runs,
        # so no lifecycle event ever forgets them; the expiry job drops them after a while.
        self.closed_offers: dict[str, float] = {}
        # Negotiation claims by key, as the watch last gave them: one whose holder died would
        # otherwise stay until its task id came again, which it may never do.
        self.claims: dict[str, bytes] = {}
        # When the expiry job first saw each claim as it is now, on its clock (``drop_stale_claims``).
        self._claims_seen: dict[str, tuple[bytes, float]] = {}
        # The tasks this replica is negotiating now: a claim in its name for any other task
        # was left by one of its own negotiations whose release was lost (``claim``).
        self._holding: set[str] = set()

    @classmethod
    async def open(cls, bus: Bus) -> ContractStore:
        """Load every stored contract and open offer."""
        store = cls(await bus.kv("contracts"), await bus.kv("rejections"))
        for key in await store._kv.keys():
            entry = await store._kv.get(key)
            if entry is not None:
                store._apply(key, entry.value)
        return store

    async def follow(self) -> None:
        """Keep the view current with what every replica writes (run as a background task)."""
        async for entry in self._kv.watch(">"):
            self._apply(entry.key, entry.value)

    def _apply(self, key: str, value: bytes | None) -> None:
        try:
            if key.startswith(CLAIM_PREFIX):
                if value is None:
                    self.claims.pop(key, None)
                else:
                    self.claims[key] = value
            elif key.startswith(CONTRACT_PREFIX):
                if value is None:
                    self._drop_contract(key)
                else:
                    adm = _ADMITTED.decode(value)
                    self.admitted[adm.task.task_id] = adm
            elif key.startswith(OFFER_PREFIX):
                if value is None:
                    self._drop_offer(key)
                    return
                record = _OFFER.decode(value)
                if record.state == "open":
                    self.open_offers[record.task.task_id] = record
                    self.closed_offers.pop(record.task.task_id, None)
                else:
                    self.open_offers.pop(record.task.task_id, None)
                    self._note_closed(record)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # One bad record must not blind the negotiator to the rest of the bucket.
            log.warning("contracts bucket: ignoring unreadable %s: %s", key, exc)

    def _drop_contract(self, key: str) -> None:
        for task_id in [t for t in self.admitted if contract_key(t) == key]:
            del self.admitted[task_id]

    def _drop_offer(self, key: str) -> None:
        for task_id in [t for t in self.open_offers if offer_key(t) == key]:
            del self.open_offers[task_id]
        for task_id in [t for t in self.closed_offers if offer_key(t) == key]:
            del self.closed_offers[task_id]

    def _note_closed(self, record: OfferRecord) -> None:
        # An accepted offer stays with its contract (both go when the task ends).
        if isinstance(record.outcome, TaskRejected):
            self.closed_offers[record.task.task_id] = record.outcome.rejected_at
        else:
            self.closed_offers.pop(record.task.task_id, None)

    async def admission(self, task_id: str) -> TaskAdmitted | None:
        """The stored admission of ``task_id`` (read from the bucket, not the view)."""
        entry = await self._kv.get(contract_key(task_id))
        if entry is None or entry.value is None:
            return None
        adm = _ADMITTED.decode(entry.value)
        return adm if adm.task.task_id == task_id else None

    async def claim(self, task_id: str, holder: str, clock: Callable[[], float],
                    stale_s: float = CLAIM_STALE_S) -> int:
        """Hold the task's negotiation claim, waiting while another replica holds it; its revision.

        A claim this waiter has seen unchanged for ``stale_s`` by ``clock`` (its holder died
        holding it) is taken over. Timed from when this waiter first saw it, on its own
        clock: the holder's stamp read on another clock made a waiter whose clock ran ahead
        take a live claim over, and two replicas negotiated one submission at once. A claim in
        ``holder``'s own name that none of its negotiations holds now (its release was lost
        with the server) is taken back at once: the submission's next delivery waited 30 s."""
        key = claim_key(task_id)
        seen: tuple[int, float] | None = None  # the claim's revision, and when first seen
        while True:
            mine = encode(NegotiationClaim(holder=holder, at=clock()))
            try:
                revision = await self._kv.create(key, mine)
                break
            except CasConflict:
                pass
            entry = await self._kv.get(key)
            if entry is None or entry.value is None:
                continue  # released between the two calls
            if seen is None or seen[0] != entry.revision:
                seen = (entry.revision, clock())
            if clock() - seen[1] > stale_s or (task_id not in self._holding and _holder_of(entry.value) == holder):
                try:
                    revision = await self._kv.update(key, mine, entry.revision)
                    break
                except CasConflict:
                    continue  # another waiter took it over first
            await asyncio.sleep(CLAIM_POLL_S)
        self._holding.add(task_id)
        return revision

    async def release(self, task_id: str, revision: int) -> None:
        """Give the claim taken at ``revision`` back (not one taken over since). A release the
        server does not answer is told, not raised: the answer negotiated under the claim
        still goes out, and the claim left is taken back by this replica at once, by another
        once stale, and swept by the expiry job."""
        self._holding.discard(task_id)
        try:
            await self._kv.delete(claim_key(task_id), revision=revision)
        except CasConflict:
            log.warning("negotiation claim of %s was taken over while held: its holder was slower than %g s",
                        task_id, CLAIM_STALE_S)
        except Exception as exc:  # noqa: BLE001 - the server gone: the claim stays, handled as above
            log.warning("negotiation claim of %s not released (%s); left to be taken back or swept", task_id, exc)

    async def drop_stale_claims(self, now: float, stale_s: float = CLAIM_STALE_S) -> None:
        """Delete the claims their holders left behind: seen unchanged for more than
        ``stale_s`` by ``now``, the expiry job's clock, from when it first saw each (never the
        holder's stamp, which another clock wrote)."""
        self._claims_seen = {key: seen for key, seen in self._claims_seen.items() if key in self.claims}
        for key, value in list(self.claims.items()):
            seen = self._claims_seen.get(key)
            if seen is None or seen[0] != value:
                self._claims_seen[key] = (value, now)
                continue
            if now - seen[1] <= stale_s:
                continue
            entry = await self._kv.get(key)
            if entry is not None and entry.value is not None:
                if entry.value != value:
                    continue  # taken over since the watch last said: the watch brings it
                try:
                    await self._kv.delete(key, revision=entry.revision)
                except CasConflict:
                    continue  # taken over meanwhile
            self.claims.pop(key, None)
            self._claims_seen.pop(key, None)

    async def end(self, task_id: str, how: str, at: float) -> None:
        """Forget an admitted task that has ended (``how``: its lifecycle end, or its give-up),
        keeping for a day what any later submission of its id is told: a task id names one run.

        Kept before the contract goes: a submission read between the two must never find
        neither, and be admitted afresh. A task this service never admitted is only forgotten."""
        adm = await self.admission(task_id)
        if adm is None:
            found = await self.offer(task_id)
            if found is not None and isinstance(found[0].outcome, TaskAdmitted):
                adm = found[0].outcome  # accepted, its contract write lost
        if adm is not None:
            refusal = TaskRejected(
                task_id=task_id, tenant=adm.tenant, code="invalid", rejected_at=at,
                reason=f"task {task_id!r} was admitted and has ended ({how}); a task id names one run: "
                       "submit a new run under a new task id")
            await self._rejections.put(node_key(task_id),
                                       encode(RejectionRecord(task=adm.task, rejection=refusal, ended=True)))
        await self.forget(task_id)

    async def ended(self, task_id: str) -> RejectionRecord | None:
        """The record of the admitted task of this id that has ended (``end``), if kept."""
        record = await self._record(task_id)
        return record if record is not None and record.ended else None

    async def forget(self, task_id: str) -> None:
        """Drop the contract and any offer of a task that has ended."""
        await self._kv.delete(contract_key(task_id))
        await self._kv.delete(offer_key(task_id))
        self.admitted.pop(task_id, None)
        self.open_offers.pop(task_id, None)
        self.closed_offers.pop(task_id, None)

    async def drop_closed_offer(self, task_id: str) -> None:
        """Delete the task's offer record if it is still closed (not reopened by a resubmission)."""
        found = await self.offer(task_id)
        if found is not None and found[0].state != "open":
            try:
                await self._kv.delete(offer_key(task_id), revision=found[1])
            except CasConflict:
                return  # reopened meanwhile: the watch brings the open record
        self.closed_offers.pop(task_id, None)

    async def record_admission(self, adm: TaskAdmitted) -> None:
        """Store the agreed contract (idempotent: the same admission may be written twice)."""
        await self._kv.put(contract_key(adm.task.task_id), encode(adm))
        self.admitted[adm.task.task_id] = adm

    async def admit_once(self, adm: TaskAdmitted) -> TaskAdmitted:
        """Store a freshly negotiated admission unless the task has one already; the one stored.

        Created, not put: two replicas negotiating the same submission at once must not both
        admit, the second replacing the contract the first published."""
        try:
            await self._kv.create(contract_key(adm.task.task_id), encode(adm))
        except CasConflict:
            stored = await self.admission(adm.task.task_id)
            if stored is None:
                raise  # gone again, or another task id on the same key: try the delivery again
            return stored
        self.admitted[adm.task.task_id] = adm
        return adm

    async def record_rejection(self, task: TaskSubmitted, rejection: TaskRejected) -> None:
        """Keep the rejection ``task`` was given, for its redeliveries."""
        await self._rejections.put(node_key(task.task_id), encode(RejectionRecord(task=task, rejection=rejection)))

    async def rejection(self, task: TaskSubmitted) -> TaskRejected | None:
        """The rejection stored for exactly this submission (same task, same ask, same tenant)."""
        record = await self._record(task.task_id)
        return record.rejection if record is not None and not record.ended and record.task == task else None

    async def _record(self, task_id: str) -> RejectionRecord | None:
        entry = await self._rejections.get(node_key(task_id))
        if entry is None or entry.value is None:
            return None
        try:
            return _REJECTION.decode(entry.value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("rejections bucket: ignoring unreadable %s: %s", task_id, exc)
            return None

    async def offer(self, task_id: str) -> tuple[OfferRecord, int] | None:
        """The task's offer record and its revision, read from the bucket."""
        entry = await self._kv.get(offer_key(task_id))
        if entry is None or entry.value is None:
            return None
        record = _OFFER.decode(entry.value)
        if record.task.task_id != task_id:
            return None  # another task id that maps onto the same key
        return record, entry.revision

    async def open_offer(self, record: OfferRecord, replacing: int | None = None) -> OfferRecord:
        """Store a new open offer; the stored one wins when another writer got there first.

        ``replacing`` is the revision of a closed offer for the same task (a resubmission
        after a decline or expiry); without it the key must not exist.
        """
        key = offer_key(record.task.task_id)
        try:
            if replacing is None:
                await self._kv.create(key, encode(record))
            else:
                await self._kv.update(key, encode(record), replacing)
        except CasConflict:
            current = await self.offer(record.task.task_id)
            if current is None:
                raise
            return current[0]
        self.open_offers[record.task.task_id] = record
        return record

    async def close_offer(self, record: OfferRecord, revision: int) -> None:
        """Write the closed ``record`` if the offer is still at ``revision``; else ``CasConflict``."""
        await self._kv.update(offer_key(record.task.task_id), encode(record), revision)
        self.open_offers.pop(record.task.task_id, None)
        self._note_closed(record)
