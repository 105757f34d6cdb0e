"""Holds follow the board they name (``Allocation.gpu_uuid``) through a renumbering of its
GPU's index; holds of earlier versions, which name none, are followed by their index."""

from __future__ import annotations

import msgspec
from fleetpilot.contracts import Allocation, DecisionMade, NodeLedger, Placement, PolicyRef
from fleetpilot.ledger.accounting import confirmed, moved_here, on_board, resized


def hold(task: str, gpu: int, uuid: str = "", decision: str = "") -> Allocation:
    return Allocation(task_id=task, decision_id=decision or f"{task}.assign", gpu=gpu, milli=500, memory_mb=1000,
                      gpu_uuid=uuid)


def test_a_hold_naming_its_board_is_on_that_board_wherever_it_reads() -> None:
    # The hot board held at 2 reads at 1 after a renumbering; the new board reads at 2.
    busy = hold("busy", 2, "GPU-hot")
    assert on_board(busy, 1, "GPU-hot")
    assert not on_board(busy, 2, "GPU-new")
    # A board whose uuid is not known is taken to be the one at the hold's index.
    assert on_board(busy, 2) and not on_board(busy, 1)


def test_a_hold_of_an_earlier_version_is_on_whatever_board_reads_at_its_index() -> None:
    old = msgspec.json.decode(b'{"task_id":"t","decision_id":"t.assign","gpu":2,"milli":500}', type=Allocation)
    assert on_board(old, 2, "GPU-new") and not on_board(old, 1, "GPU-hot")


def test_confirming_moving_and_resizing_keep_the_board_a_hold_names() -> None:
    ledger = NodeLedger(node="n1", allocations=[hold("t", 0, "GPU-a"), hold("t", 0, "GPU-a", "t.resize.9")])
    grown = resized(ledger, DecisionMade(
        decision_id="t.resize.9", task_id="t", action="resize", confidence=0.5, policy=PolicyRef(name="p"),
        decided_at=0.0, placement=[Placement(node="n1", gpu=0, milli=500, memory_mb=9000)]))
    assert grown is not None and [(a.memory_mb, a.gpu_uuid) for a in grown.allocations] == [(9000, "GPU-a")]
    moving = NodeLedger(node="n1", allocations=[*grown.allocations, hold("t", 1, "GPU-b", "t.migrate.0")])
    moved = moved_here(moving, "t", "t.migrate.0")
    assert moved is not None and [(a.gpu, a.gpu_uuid) for a in moved.allocations] == [(1, "GPU-b")]
    assert [a.gpu_uuid for a in confirmed(moving, "t", "t.migrate.0").allocations] == ["GPU-a", "GPU-b"]
