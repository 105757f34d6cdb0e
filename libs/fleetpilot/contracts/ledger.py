"""Ledger records: which share of which GPU each task holds (a KV value per node)."""

from __future__ import annotations

from typing import Literal

import msgspec

from .base import Record


class Allocation(Record, frozen=True, kw_only=True):
    """One task's hold on one GPU (``gpu = -1`` for a CPU-only hold)."""

    task_id: str
    decision_id: str
    gpu: int
    milli: int
    memory_mb: int = 0
    cpu_milli: int = 0
    host_memory_mb: int = 0
    state: Literal["reserved", "confirmed"] = "reserved"
    at: float = 0.0
    # When the run this hold carries began: its first placement's reservation, carried to the
    # target of every move, so the rebalancer knows how far into its run a moved task is (where
    # its program's envelope is read). A run restored from a checkpoint began that long before
    # its restore (``Requeue.progress_s``). 0 when unknown: a run queued again by a stop whose
    # progress nobody recorded.
    run_at: float = 0.0


class NodeLedger(Record, frozen=True, kw_only=True):
    """All holds on one node; written only with compare-and-set on the KV revision."""

    node: str
    allocations: list[Allocation] = msgspec.field(default_factory=list)
