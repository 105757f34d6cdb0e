"""The allocation ledger: which share of which GPU each task holds.

``accounting`` is pure (free capacity, adding and removing holds); ``store`` keeps the
ledger in the ``ledger`` KV bucket, one key per node, written only with compare-and-set.
"""

from .accounting import FreeCapacity, free_capacity, with_allocations, without_task
from .store import FleetView, LedgerStore

__all__ = ["FleetView", "FreeCapacity", "LedgerStore", "free_capacity", "with_allocations", "without_task"]
