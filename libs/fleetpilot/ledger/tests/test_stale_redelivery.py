"""A decision redelivered after a later one for the same task was carried out (its ack was
lost; the journal hands back its recorded result and the executor redoes its ledger write)
must leave the later decision's holds as they are: the ledger arithmetic of an executed
``resize`` or ``migrate`` folds the holds its decision reserved, and once they are folded
there is nothing left to fold."""

from __future__ import annotations

from fleetpilot.contracts import Allocation, DecisionMade, NodeLedger, Placement, PolicyRef
from fleetpilot.ledger.accounting import moved_here, resized


def hold(task: str, decision: str, gpu: int, memory_mb: int, state: str = "confirmed") -> Allocation:
    return Allocation(task_id=task, decision_id=decision, gpu=gpu, milli=500, memory_mb=memory_mb, state=state)


def resize_to(memory_mb: int) -> DecisionMade:
    return DecisionMade(
        decision_id=f"t1.resize.{memory_mb}", task_id="t1", action="resize",
        placement=[Placement(node="n1", gpu=0, milli=500, memory_mb=memory_mb)],
        source=[Placement(node="n1", gpu=0, milli=500, memory_mb=5000)],
        confidence=0.9, policy=PolicyRef(name="resize"), decided_at=0.0,
    )


def test_an_older_resize_redelivered_after_a_larger_one_does_not_shrink_the_hold() -> None:
    # t1 grew to 20000 MB (t1.resize.20000, folded), then to 30000 MB (t1.resize.30000, folded).
    after_both = NodeLedger(node="n1", allocations=[hold("t1", "t1.assign", 0, 30000), hold("nb", "nb.assign", 0, 9000)])
    assert resized(after_both, resize_to(20000)) is None
    # The fold itself still works on the reserved extra.
    reserved = NodeLedger(node="n1", allocations=[
        hold("t1", "t1.assign", 0, 20000), hold("t1", "t1.resize.30000", 0, 10000, "reserved")])
    folded = resized(reserved, resize_to(30000))
    assert folded is not None
    assert [(a.decision_id, a.memory_mb, a.state) for a in folded.allocations] == [("t1.assign", 30000, "confirmed")]


def test_an_older_move_redelivered_after_a_move_within_the_node_keeps_the_task_s_hold() -> None:
    # t1 moved onto n1 GPU 0 (m1, folded), then within n1 to GPU 1 (m2, folded: its GPU 0 hold gone).
    after_both = NodeLedger(node="n1", allocations=[hold("t1", "m2", 1, 8000), hold("nb", "nb.assign", 0, 9000)])
    again = moved_here(after_both, "t1", "m1")
    assert again is None or again.allocations == after_both.allocations
    # A move not yet folded: its reserved target is confirmed, the source hold here goes.
    moving = NodeLedger(node="n1", allocations=[hold("t1", "m1", 0, 8000), hold("t1", "m2", 1, 8000, "reserved")])
    done = moved_here(moving, "t1", "m2")
    assert done is not None
    assert [(a.decision_id, a.gpu, a.state) for a in done.allocations] == [("m2", 1, "confirmed")]


def test_a_folded_move_redelivered_keeps_what_later_decisions_reserved() -> None:
    # t1 moved onto GPU 0 (m1, folded: confirmed); then a resize reserved 5000 MB more on
    # GPU 0 and a move within the node reserved GPU 1. m1 comes again (its ack was lost).
    later = NodeLedger(node="n1", allocations=[
        hold("t1", "m1", 0, 8000), hold("t1", "t1.resize.13000", 0, 5000, "reserved"),
        hold("t1", "m2", 1, 8000, "reserved")])
    again = moved_here(later, "t1", "m1")
    assert again is None or again.allocations == later.allocations
