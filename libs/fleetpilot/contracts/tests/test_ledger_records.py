"""Ledger records read by every version that shares the ``ledger`` bucket: a hold names the
board it is on (``Allocation.gpu_uuid``), and holds written before that decode unchanged."""

from __future__ import annotations

import msgspec
from fleetpilot.contracts import Allocation, NodeLedger, encode


def test_a_hold_keeps_the_board_it_was_reserved_on() -> None:
    ledger = NodeLedger(node="n1", allocations=[
        Allocation(task_id="t1", decision_id="t1.assign", gpu=2, milli=500, gpu_uuid="GPU-hot")])
    decoded = msgspec.json.decode(encode(ledger), type=NodeLedger)
    assert [(a.gpu, a.gpu_uuid) for a in decoded.allocations] == [(2, "GPU-hot")]


def test_a_hold_written_before_holds_named_their_board_decodes_without_one() -> None:
    written = (b'{"node":"n1","allocations":[{"task_id":"t1","decision_id":"t1.assign","gpu":2,"milli":500,'
               b'"memory_mb":0,"state":"confirmed","at":1.0}]}')
    decoded = msgspec.json.decode(written, type=NodeLedger)
    assert [(a.task_id, a.gpu, a.gpu_uuid) for a in decoded.allocations] == [("t1", 2, "")]
