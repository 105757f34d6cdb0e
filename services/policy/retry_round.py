"""The queue's retry round: every ``pending_retry_s`` a replica walks the ``pending`` bucket
and places, in the queue's order, what fits now.

A round reads every entry (``collect``) from the replica's ``PendingQueue``, the bucket kept
in memory by a watcher: a backlog of thousands is read without a bus round trip per entry
(about 0.2 ms each, so 0.4 s a round for 1,000 waiting tasks, and a round longer than its
period past 3,000). An entry another replica claimed is left to it unless its claim is older
than ``claim_timeout_s`` (that replica died, or lost the bus, while placing it); a task
evicted whose holds are not released yet waits, and tells which vips are still freeing room.
Then it places what waits (``place``): each entry is claimed with compare-and-set, so one
replica takes it, placed or put back, and a vip that fits nowhere may preempt
``best_effort`` work. What the round decided goes out even when the bus fails half-way, for
its holds are reserved and its entries gone.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

import msgspec
from fleetpilot.contracts import DecisionMade, TaskAdmitted, now
from fleetpilot.policy.backfill import Demand, delays_any, queue_key
from fleetpilot.policy.preempt import (
    NoRoom,
    Requeue,
    claim_of,
    claim_pending,
    decode_pending,
    no_room_of,
    run_left_s,
    waiting_since,
    with_no_room,
)
from fleetpilot.policy.state import MILLI
from fleetpilot.runtime import Bus, CasConflict, KeyValue, KvEntry, Retry

from .evictions import Evictions
from .replica import decision_id_for
from .settings import PolicySettings

log = logging.getLogger("fleetpilot.policy")


def queue_position(adm: TaskAdmitted, progress_s: float = 0.0, aging: float = 1.0) -> tuple[int, float, float]:
    """Where a waiting task stands: ``backfill.queue_key`` (vip first; within a tier, the
    earliest expected completion had it started on admission, its admission weighed by
    ``aging``, so short work does not queue behind long work that came about the same time
    and nothing starves), then admission. A task restored from a checkpoint counts the run
    it has left (``run_left_s``)."""
    return (*queue_key(adm.contract.tier, adm.admitted_at, run_left_s(adm, progress_s), aging), adm.admitted_at)


class PendingQueue:
    """The ``pending`` bucket kept in memory: loaded at open, then followed by a watcher.

    A round decides on it and commits with compare-and-set on the revision it read: an
    entry that changed since (claimed, placed or written again elsewhere) fails its claim
    and waits for the next round, so a view a moment behind costs a round, never a task.
    """

    def __init__(self, kv: KeyValue) -> None:
        """Mirror ``kv`` (the ``pending`` bucket); call :meth:`follow` to keep it current."""
        self.kv = kv
        self.entries: dict[str, KvEntry] = {}
        # Unreadable entries already reported, at the revision reported: every round found
        # them again, and logged each once a round (``pending_retry_s``) for as long as it stayed.
        self.reported: dict[str, int] = {}

    @classmethod
    async def open(cls, bus: Bus) -> Self:
        """Load every entry of the bucket."""
        queue = cls(await bus.kv("pending"))
        for key in await queue.kv.keys():
            entry = await queue.kv.get(key)
            if entry is not None and entry.value:
                queue.entries[key] = entry
        return queue

    async def follow(self) -> None:
        """Keep the view current (run as a background task)."""
        async for entry in self.kv.watch(">"):
            if entry.value is None:
                self.entries.pop(entry.key, None)
                self.reported.pop(entry.key, None)
            else:
                self.entries[entry.key] = entry


@dataclass
class Waiting:
    """A pending entry this round may place: the admission, its re-placement (an evicted or
    failed task) and the entry as read, for the claim's compare-and-set."""

    adm: TaskAdmitted
    requeue: Requeue | None
    entry: KvEntry
    value: bytes


@dataclass
class RetryRound:
    """One replica's pass over the ``pending`` bucket: what it found and what it decided.

    ``decided`` wraps each decision as it is made (the service counts it in its metrics).
    """

    ps: Evictions
    queue: PendingQueue
    settings: PolicySettings
    decided: Callable[[DecisionMade], DecisionMade]
    waiting: list[Waiting] = field(default_factory=list)
    # Vip tasks whose preemption is still being carried out.
    evicting: set[str] = field(default_factory=set)
    # Tasks evicted whose holds are not released yet: no vip may pick them again.
    leaving: set[str] = field(default_factory=set)
    # The decisions, in the order they were made.
    out: list[DecisionMade] = field(default_factory=list)
    # What found no node this round (whether the reservation was hidden from it, and whose
    # request it was): a task that needs no less is not tried again until the next round. A
    # backlog of hundreds then costs a few decisions a round, not hundreds of claims and
    # decisions.
    failed: list[tuple[Demand, bool, str]] = field(default_factory=list)
    # The tasks that found no place this round, skipped ones included: the reservation's
    # owner is chosen among them once the round is over.
    blocked: list[TaskAdmitted] = field(default_factory=list)
    # How far the waiting tasks restored from a checkpoint had got (``Requeue.progress_s``).
    progress: dict[str, float] = field(default_factory=dict)
    # Every task the bucket holds, this round's or not (claimed by a replica placing it, leaving
    # a node): how many per tier, and since when the longest has waited (what an operator
    # watches, ``PolicyMetrics.waiting``; the tasks ``fleetpilot queue`` lists).
    tiers: Counter[str] = field(default_factory=Counter)
    waiting_since: float | None = None

    async def collect(self) -> None:
        """Read every entry; keep those this round may place, in the queue's order."""
        ps, settings = self.ps, self.settings
        for key, entry in list(self.queue.entries.items()):
            value = entry.value
            if not value:
                continue
            claim = claim_of(value)
            if claim is not None:
                at, value = claim
                if not value or now() - at < settings.claim_timeout_s:
                    self._count(value)
                    continue  # a replica is placing it (or a claim of old left nothing to place)
                # Its replica died, or lost the bus, while placing it: the entry is ours.
                log.warning("%s: claimed %.0f s ago and never decided; taken over", key, now() - at)
            try:
                adm, requeue = decode_pending(value)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                # One unreadable entry must not stop every other task from being placed.
                if self.queue.reported.get(key) != entry.revision:
                    self.queue.reported[key] = entry.revision
                    log.error("pending %s is unreadable (%s); skipped until it is written again", key, exc)
                continue
            held = ps.ledger.holds_of(adm.task.task_id)
            if claim is not None and held is None and await ps.journaled(
                    requeue.decision_id if requeue else decision_id_for(adm.task.task_id, "assign")):
                # The dead replica's decision went out and the executor took it (and the task
                # ended, or its failure placed it again): nothing is left to decide.
                await self._forget(entry)
                continue
            # Holds under the note's own id are its re-placement, reserved by a replica that
            # died before clearing the entry: ``place`` issues them again. Any other holds
            # are the placement it was evicted from.
            if requeue is not None and held is not None and not any(
                a.decision_id == requeue.decision_id for a in held[1]
            ):
                if now() - requeue.at > settings.evict_timeout_s:
                    # The eviction failed or never went out: the task still runs. Forget the
                    # entry (the vip may preempt again) rather than hold the queue up.
                    log.warning(
                        "eviction %s not carried out in time; %s keeps running",
                        requeue.evict_id or "by the executor",
                        adm.task.task_id,
                    )
                    await self._forget(entry)
                    continue
                # Evicted, but the executor has not released its holds yet (or our view has
                # not seen the release): placing it now would book it twice (and the release
                # would take the new holds too). Only a preemption holds the queue for its vip.
                if requeue.for_task:
                    self.evicting.add(requeue.for_task)
                self.leaving.add(adm.task.task_id)
                self._counted(adm, requeue)
                continue
            self._counted(adm, requeue)
            self.waiting.append(Waiting(adm, requeue, entry, value))
            if requeue is not None and requeue.progress_s > 0:
                self.progress[adm.task.task_id] = requeue.progress_s
        self.waiting.sort(key=lambda w: self.position(w.adm))

    def _count(self, value: bytes) -> None:
        """Count a task a replica is placing now, if its entry reads (``tiers``)."""
        try:
            self._counted(*decode_pending(value))
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass  # nothing to place, or unreadable: its replica says so

    def _counted(self, adm: TaskAdmitted, requeue: Requeue | None) -> None:
        """Count a waiting task in ``tiers`` and ``waiting_since`` (since its requeue, if any)."""
        since = waiting_since(adm, requeue)
        self.tiers[adm.contract.tier] += 1
        self.waiting_since = since if self.waiting_since is None else min(self.waiting_since, since)

    def position(self, adm: TaskAdmitted) -> tuple[int, float, float]:
        """Where a waiting task stands (``queue_position``), by the run it has left."""
        return queue_position(adm, self.progress.get(adm.task.task_id, 0.0), self.settings.queue_aging)

    async def _forget(self, entry: KvEntry) -> None:
        # Only the entry as read: one written since (claimed by a replica taking it over,
        # queued again) is no longer what this round judged. The revision goes with the
        # delete itself: a read first, then a plain delete, left a window for such a write.
        try:
            await self.queue.kv.delete(entry.key, revision=entry.revision)
        except CasConflict:
            log.info("%s: written again since this round read it; left as it is", entry.key)

    async def place(self) -> None:
        """Place what waits, in the queue's order: each entry claimed, placed or put back
        (a vip may preempt); decisions go to ``out`` as they are made."""
        ps, pending = self.ps, self.queue.kv
        for w in self.waiting:
            adm = w.adm
            if self.evicting and adm.contract.tier != "vip":
                # Space is being freed for a vip: nothing else may take it half-freed (an
                # evicted task would otherwise come straight back where it was).
                continue
            left = run_left_s(adm, self.progress.get(adm.task.task_id, 0.0))
            hide = delays_any((ps.reservation, *ps.reservations_apart), adm.task.task_id, left, now())
            # A smooth grower is skipped only when its bridge (its ask) cannot fit either.
            demands = [Demand.of(r) for r in ps.requests(adm.task, w.requeue)]
            like = [next((by for f, masked, by in self.failed if (hide or not masked) and d.cannot_fit_after(f)), None)
                    for d in demands]
            if adm.contract.tier != "vip" and None not in like:
                self.blocked.append(adm)
                await self._tell_skipped(w, next((by for by in like if by), ""))
                continue  # a vip still gets its turn: it may preempt
            try:
                claimed = await pending.update(w.entry.key, claim_pending(w.value, now()), w.entry.revision)
            except CasConflict:
                continue  # one replica takes it
            refused = False  # by the policy, this try (not a lost race nor an unready view)
            try:
                decision, _, _ = await ps.place(adm, w.requeue)
                if decision is None:
                    refused = True
                    self.failed.extend((d, hide, adm.task.task_id) for d in demands)
                    self.blocked.append(adm)
            except Retry:
                decision = None
            if decision is None:
                try:
                    # Put back only under our own claim: a replica that stalled past
                    # ``claim_timeout_s`` may find its entry taken over, the task placed and
                    # the entry cleared; writing it back would queue a placed task again.
                    # With what kept it off every node this time, if the policy said.
                    refusal = ps.refusals.get(adm.task.task_id, "") if refused else ""
                    await pending.update(w.entry.key, with_no_room(w.value, NoRoom(shortfall=refusal, at=now())),
                                         claimed)
                except CasConflict:
                    log.warning("%s: claim taken over while placing it; left to its new owner", w.entry.key)
                    continue
                # A vip that fits nowhere may preempt best_effort work (``preempt``), once
                # per round and not while its last preemption is still under way.
                if adm.contract.tier == "vip" and adm.task.task_id not in self.evicting:
                    evictions = await ps.preempt(adm, pending, frozenset(self.leaving))
                    if evictions:
                        self.evicting.add(adm.task.task_id)
                        self.leaving.update(d.task_id for d in evictions)
                        self.out.extend(self.decided(d) for d in evictions)
                continue
            try:
                # Cleared only under our own claim, as the put-back above: a replica that stalled
                # past ``claim_timeout_s`` may find the entry taken over and written again since
                # (the task placed by its new owner, then queued again when that assign
                # failed); deleting it blindly would lose the re-queued task.
                await pending.delete(w.entry.key, revision=claimed)
            except CasConflict:
                log.warning("%s: claim taken over while placing it; the entry is left to its new owner", w.entry.key)
            # Its holds are reserved: the decision goes out either way (under the same id as
            # the new owner's, if that owner placed it too, so the stream keeps one).
            self.out.append(self.decided(decision))

    async def _tell_skipped(self, w: Waiting, like: str) -> None:
        """Tell a waiting task the round skipped what kept ``like`` off every node (its plain
        request needs no less): without it, its entry kept the reason of its own latest try,
        which may be its admission, long ago. At most every ``no_room_refresh_s``, and only
        on an entry no replica holds; one written since it was read is left as it is."""
        refusal = self.ps.refusals.get(like, "")
        if not refusal or claim_of(w.entry.value) is not None:
            return
        told = no_room_of(w.value)
        if told is not None and now() - told.at < self.settings.no_room_refresh_s:
            return
        try:
            await self.queue.kv.update(w.entry.key, with_no_room(w.value, NoRoom(shortfall=refusal, at=now(), like=like)),
                                       w.entry.revision)
        except CasConflict:
            pass  # claimed, placed or told since: its owner's word is newer

    def reservation_owner(self) -> TaskAdmitted | None:
        """The task the reservation goes to: the whole-GPU task first in the queue's order
        among those that found no place (expected completion bounds how long anything is
        overtaken, wide tasks included)."""
        return next(iter(self.reservation_owners()), None)

    def reservation_owners(self) -> list[TaskAdmitted]:
        """The whole-GPU tasks that found no place, in the queue's order: the first owns the
        reservation, the others may get one apart (``Moves.reservations_for``)."""
        return sorted((a for a in self.blocked if a.task.gpus >= 1 and a.task.gpu_milli >= MILLI), key=self.position)
