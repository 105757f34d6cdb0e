"""Ledger records: which share of which GPU each task holds (a KV value per node)."""

from __future__ import annotations

from typing import Literal

import msgspec

from .base import Record
from .decision import PolicyRef


class DecidedBy(Record, frozen=True, kw_only=True):
    """Who decided the placement a hold carries, and as what: the fields of the ``assign`` the
    policy published once the hold was reserved. A replica that finds the hold reserved and the
    decision not published (the replica that reserved it died first) publishes it again from
    these, as it was decided."""

    policy: PolicyRef
    shard_id: str = "primary"
    fallback: bool = False
    # The policy's own (calibrated) confidence: a learned model's is worked out again on the
    # way out, as it was the first time.
    confidence: float = 0.0
    reason: str = ""


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
    # The decision this hold was reserved for, on the first hold of a placement only (the
    # others of the same decision carry ``None``, as they carry no CPU): an assign's, so that it
    # can be published again as decided. ``None`` in holds written before it was recorded,
    # and in the holds of moves and resizes, which are never published again.
    decided: DecidedBy | None = None
    # The board (NVML uuid) the hold is on, as the policy's topology named the GPU at ``gpu``
    # when it reserved. Indices renumber under running tasks (a GPU falls off the bus and the
    # driver numbers the rest again); by index alone, a hot board's drain counted and evicted
    # the tasks of the board that took its number. "" when unknown: holds written before it was
    # recorded, a topology without uuids, a CPU-only hold; those are followed by ``gpu``.
    gpu_uuid: str = ""


class NodeLedger(Record, frozen=True, kw_only=True):
    """All holds on one node; written only with compare-and-set on the KV revision."""

    node: str
    allocations: list[Allocation] = msgspec.field(default_factory=list)
