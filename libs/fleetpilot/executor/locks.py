"""Locks with a time-to-live that guard lifecycle hooks across executor replicas.

The primitive is "create the key unless it exists" — exactly what a NATS KV bucket with a
TTL offers (``kv.create`` fails when the key exists). The in-memory implementation here has
an injectable clock so tests can fast-forward past a TTL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

Clock = Callable[[], float]
"""Seconds, monotonic enough for TTLs; ``time.time`` in production, a fake in tests."""


@runtime_checkable
class HookLock(Protocol):
    """A named lock, owned by one executor, that expires by itself after ``ttl_s``."""

    async def acquire(self, key: str, owner: str, ttl_s: float) -> bool:
        """Take the lock; ``True`` if taken now or already held by ``owner`` (TTL unchanged)."""
        ...

    async def release(self, key: str, owner: str) -> bool:
        """Give the lock back; ``False`` (and no change) unless ``owner`` holds it."""
        ...

    async def holder(self, key: str) -> str | None:
        """Who holds the lock now, or ``None``."""
        ...


class InMemoryHookLock:
    """A :class:`HookLock` in one process (tests, single-executor setups)."""

    def __init__(self, clock: Clock = time.time) -> None:
        """Create an empty lock table reading time from ``clock``."""
        self._clock = clock
        self._held: dict[str, tuple[str, float]] = {}
        self._mutex = asyncio.Lock()

    def _live(self, key: str) -> tuple[str, float] | None:
        entry = self._held.get(key)
        if entry and entry[1] <= self._clock():
            del self._held[key]
            return None
        return entry

    async def acquire(self, key: str, owner: str, ttl_s: float) -> bool:
        """Create ``key`` for ``owner`` unless someone else holds it."""
        async with self._mutex:
            entry = self._live(key)
            if entry is None:
                self._held[key] = (owner, self._clock() + ttl_s)
                return True
            return entry[0] == owner

    async def release(self, key: str, owner: str) -> bool:
        """Delete ``key`` if ``owner`` holds it."""
        async with self._mutex:
            entry = self._live(key)
            if entry is None or entry[0] != owner:
                return False
            del self._held[key]
            return True

    async def holder(self, key: str) -> str | None:
        """The live owner of ``key``, if any."""
        async with self._mutex:
            entry = self._live(key)
            return entry[0] if entry else None
