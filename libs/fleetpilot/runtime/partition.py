"""A keyed share of a service's work, owned by one replica.

A service whose state is per key (the fingerprinter's model of each task's memory series)
cannot share its messages among replicas in a queue group: each replica would hold part of
every key's state. Partitioned instead, each replica takes every message and keeps those of
the keys it owns, ``crc32(key) % count == index``: a key's messages all reach the same
replica, whatever subject or stream they come on, and no server-side mapping is needed.

The hash is CRC-32, not Python's ``hash``, which is salted per process: every replica, and
every restart of one, must agree on who owns a key.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass


def partition_of(key: str, count: int) -> int:
    """The partition, of ``count``, that owns ``key``."""
    return zlib.crc32(key.encode()) % count


@dataclass(frozen=True)
class Partition:
    """Partition ``index`` of ``count`` (``0`` of ``1``: the whole)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"partition {self.index} of {self.count}: wants 0 <= partition < partitions")

    @property
    def whole(self) -> bool:
        """Whether this replica owns every key (the service is not partitioned)."""
        return self.count == 1

    @property
    def name(self) -> str:
        """A name for this partition's own consumers and queue group, ``p<index>of<count>``:
        with another count the keys are shared out anew, so its consumers are new too."""
        return f"p{self.index}of{self.count}"

    def owns(self, key: str) -> bool:
        """Whether ``key``'s messages are this replica's to handle."""
        return self.whole or partition_of(key, self.count) == self.index
