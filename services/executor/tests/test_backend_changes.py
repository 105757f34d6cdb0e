"""What the backend saw happen to its tasks is told once, even when the ledger is away for a
moment: no NATS here, the replica's ledger is a stand-in that fails when told to."""

from __future__ import annotations

from collections.abc import Callable

from fleetpilot.contracts import Allocation, NodeLedger, Placement
from fleetpilot.executor import SimBackend
from fleetpilot.ledger.store import node_key
from fleetpilot_services.executor.replica import ExecutorReplica
from fleetpilot_services.executor.settings import ExecutorSettings


class FlakyLedger:
    """The ledger's ``nodes`` view and ``mutate``, the next ``failures`` writes timing out."""

    def __init__(self, ledgers: list[NodeLedger]) -> None:
        self.nodes = {node_key(ledger.node): ledger for ledger in ledgers}
        self.failures = 0

    async def mutate(self, key: str, change: Callable[[NodeLedger | None], NodeLedger | None]) -> None:
        if self.failures:
            self.failures -= 1
            raise TimeoutError("nats: timeout")
        updated = change(self.nodes.get(key))
        if updated is not None:
            self.nodes[key] = updated


def hold(task_id: str, gpu: int) -> Allocation:
    return Allocation(task_id=task_id, decision_id=f"d-{task_id}", gpu=gpu, milli=1000, memory_mb=1000,
                      state="confirmed", at=0.0)


async def test_ends_whose_holds_could_not_be_given_back_are_told_on_the_next_look() -> None:
    """Two tasks end; the ledger write of the first times out (NATS restarting). Both ends
    were taken from the backend's ``poll`` and lost with the error: neither was told, and
    their holds stayed in the ledger for ever. They are kept and told on the next look,
    once each, their holds given back."""
    backend = SimBackend()
    for task_id, gpu in (("a", 0), ("b", 1)):
        await backend.start(task_id, [Placement(node="n1", gpu=gpu, milli=1000)], ["x"], {})
    replica = ExecutorReplica(ExecutorSettings())
    replica.backend = backend
    ledger = FlakyLedger([NodeLedger(node="n1", allocations=[hold("a", 0), hold("b", 1)])])
    replica.ledger = ledger  # type: ignore[assignment]
    assert await replica.backend_changes() == []  # the starts: their decisions' handlers tell them
    backend.finish("a")
    backend.fail("b")
    ledger.failures = 1
    told = []
    for _ in range(3):
        try:
            told += await replica.backend_changes()
        except TimeoutError:
            pass  # the old way: raised, and the changes polled were gone
    assert [(e.task_id, e.state) for e in told] == [("a", "finished"), ("b", "oom_killed")]
    assert ledger.nodes[node_key("n1")].allocations == []
    # Counted once each, as told: not when the first look failed.
    ends = {s.labels["state"]: s.value for family in replica.metrics.task_ends.collect() for s in family.samples
            if s.name == "fleetpilot_executor_task_ends_total"}
    assert ends == {"finished": 1, "oom_killed": 1}
