"""``KvHookLock``: the library's ``HookLock`` on the ``hook_locks`` NATS KV bucket.

The primitive is ``kv.create()``, which fails when the key exists, so of several executor
replicas racing for one GPU's lock exactly one wins. The value names the owner and when the
lock runs out (``expires_at``): the bucket's own time-to-live (35 minutes) removes a lock
whose owner died, and ``expires_at`` lets a caller ask for a *shorter* lock. A lock asked
for longer than the bucket's TTL is still gone after the bucket's TTL — the bucket is the
backstop, not the caller.

``expires_at`` is wall-clock time written by one replica and read by another, so it is
only as good as the replicas' clock agreement (NTP keeps that to milliseconds; the TTLs
here are minutes).
"""

from __future__ import annotations

import time

import msgspec
from fleetpilot.executor import Clock
from fleetpilot.runtime import CasConflict, KeyValue


class LockRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a lock key holds: who has it and until when."""

    owner: str
    expires_at: float


_RECORD = msgspec.json.Decoder(LockRecord)


class KvHookLock:
    """A :class:`fleetpilot.executor.HookLock` shared by every replica through NATS KV."""

    def __init__(self, kv: KeyValue, clock: Clock = time.time) -> None:
        """Use ``kv`` (the ``hook_locks`` bucket); ``clock`` is injectable for tests."""
        self._kv = kv
        self._clock = clock

    def _live(self, value: bytes | None) -> LockRecord | None:
        """The record if it is readable and not past its ``expires_at``."""
        if not value:
            return None
        try:
            record = _RECORD.decode(value)
        except msgspec.DecodeError:
            return None  # not ours: a stray value must not wedge a GPU's procedure forever
        return record if record.expires_at > self._clock() else None

    async def acquire(self, key: str, owner: str, ttl_s: float) -> bool:
        """Create ``key`` for ``owner``; ``True`` too when ``owner`` holds it already (TTL
        unchanged, as the Protocol says). An expired lock is taken over with
        compare-and-set on its revision, so two replicas cannot both take it over."""
        body = msgspec.json.encode(LockRecord(owner=owner, expires_at=self._clock() + ttl_s))
        try:
            await self._kv.create(key, body)
            return True
        except CasConflict:
            pass
        entry = await self._kv.get(key)
        if entry is None:
            # Deleted between our create and our get (a release): one more create decides.
            try:
                await self._kv.create(key, body)
                return True
            except CasConflict:
                return False
        live = self._live(entry.value)
        if live is not None:
            return live.owner == owner
        try:
            await self._kv.update(key, body, entry.revision)
            return True
        except CasConflict:
            return False

    async def release(self, key: str, owner: str) -> bool:
        """Delete ``key`` if ``owner`` holds it; ``False``, with no change, for a lock
        someone else holds or that has run out. The delete is at the revision read, so a
        lock taken over between the read and the delete (it ran out meanwhile) stays with
        its new owner."""
        entry = await self._kv.get(key)
        live = self._live(entry.value) if entry else None
        if entry is None or live is None or live.owner != owner:
            return False
        try:
            await self._kv.delete(key, revision=entry.revision)
        except CasConflict:
            return False
        return True

    async def holder(self, key: str) -> str | None:
        """The live owner of ``key``, if any."""
        entry = await self._kv.get(key)
        live = self._live(entry.value) if entry else None
        return live.owner if live else None
