"""The executor's ledger handling of a ``resize`` over a real nats-server: the policy reserved
the extra memory as a second hold under the resize's decision id; once carried out it is
folded into the task's hold (new size, confirmed), and when the resize fails it is given
back. Redelivered, nothing changes twice."""

from __future__ import annotations

from pathlib import Path

from fleetpilot.contracts import (
    ActionExecuted,
    ActionFailed,
    Allocation,
    DecisionMade,
    NodeLedger,
    Placement,
    PolicyRef,
    encode,
    now,
)
from fleetpilot.runtime.testing import eventually
from fleetpilot_services.executor.service import ExecutorSettings, build


def settings(nats_url: str, tmp_path: Path, **overrides) -> ExecutorSettings:
    return ExecutorSettings(
        nats_url=nats_url, metrics_port=-1, replica="a", state_dir=str(tmp_path), **overrides
    )


def reserved_resize() -> bytes:
    """t1 runs with 5000 MB on GPU 0; the policy reserved 16012 MB more for ``t1.resize.21012``;
    a neighbour shares the GPU."""
    return encode(
        NodeLedger(
            node="n1",
            allocations=[
                Allocation(
                    task_id="t1", decision_id="t1.assign", gpu=0, milli=300, memory_mb=5000, state="confirmed"
                ),
                Allocation(
                    task_id="nb", decision_id="nb.assign", gpu=0, milli=500, memory_mb=9000, state="confirmed"
                ),
                Allocation(task_id="t1", decision_id="t1.resize.21012", gpu=0, milli=0, memory_mb=16012),
            ],
        )
    )


def resize() -> DecisionMade:
    return DecisionMade(
        decision_id="t1.resize.21012",
        task_id="t1",
        action="resize",
        placement=[Placement(node="n1", gpu=0, milli=300, memory_mb=21012)],
        source=[Placement(node="n1", gpu=0, milli=300, memory_mb=5000)],
        confidence=0.99,
        policy=PolicyRef(name="resize"),
        decided_at=now(),
    )


def holds(ledger: NodeLedger) -> list[tuple[str, str, int, str]]:
    return [(a.task_id, a.decision_id, a.memory_mb, a.state) for a in ledger.allocations]


async def test_an_executed_resize_gives_the_task_s_hold_its_new_memory(
    observer, sim_fleet, nats_url, tmp_path
):
    await observer.kv_put("ledger", "n1", reserved_resize())
    host = build(settings(nats_url, tmp_path))
    await host.start()
    try:
        for msg_id in ("first", "redelivered"):  # the second copy gets the recorded result
            await observer.js.publish("decision.made", encode(resize()), headers={"Nats-Msg-Id": msg_id})
        executed = await observer.wait_stored("action.executed", ActionExecuted, 1)
        ledger = await eventually(
            lambda: _ledger_without_resize_hold(observer), what="the extra folded into the hold"
        )
    finally:
        await host.stop()
    assert [(e.action, e.action_id) for e in executed] == [("resize", "act-t1.resize.21012")]
    assert await observer.stored("action.failed", ActionFailed) == []
    assert holds(ledger) == [
        ("t1", "t1.assign", 21012, "confirmed"),
        ("nb", "nb.assign", 9000, "confirmed"),
    ]


async def _ledger_without_resize_hold(observer) -> NodeLedger | None:
    ledger = await observer.ledger("n1")
    return ledger if ledger and all(".resize." not in a.decision_id for a in ledger.allocations) else None


async def test_a_failed_resize_gives_the_reserved_extra_back(observer, nats_url, tmp_path):
    # The process backend runs nothing called t1: the resize fails.
    await observer.kv_put("ledger", "n1", reserved_resize())
    host = build(settings(nats_url, tmp_path, backend="process"))
    await host.start()
    try:
        await observer.js.publish("decision.made", encode(resize()))
        failed = await observer.wait_stored("action.failed", ActionFailed, 1)
        ledger = await eventually(lambda: _ledger_without_resize_hold(observer), what="the extra given back")
    finally:
        await host.stop()
    assert [f.action for f in failed] == ["resize"]
    assert holds(ledger) == [
        ("t1", "t1.assign", 5000, "confirmed"),
        ("nb", "nb.assign", 9000, "confirmed"),
    ]
