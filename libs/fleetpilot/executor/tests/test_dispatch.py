"""execute_decision: exactly-once execution, business rules, backend failures."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from fleetpilot.contracts import (
    ActionExecuted,
    ActionFailed,
    DecisionMade,
    Placement,
    PolicyRef,
    TaskSubmitted,
)
from fleetpilot.executor import (
    ALLOW,
    GpuContext,
    HookVerdict,
    InMemoryExecutionJournal,
    SimBackend,
    StaticBusinessContext,
    action_id_for,
    carried_out_on,
    execute_decision,
)

P = [Placement(node="n1", gpu=0, milli=1000, memory_mb=8000)]


def decision(
    action: str = "assign",
    decision_id: str = "d1",
    kind: str = "train",
    labels: dict | None = None,
    placement: list[Placement] | None = None,
) -> DecisionMade:
    task = TaskSubmitted(task_id="t1", kind=kind, labels=labels or {}, command=["run"])  # type: ignore[arg-type]
    return DecisionMade(
        decision_id=decision_id,
        task_id="t1",
        action=action,
        placement=P if placement is None else placement,  # type: ignore[arg-type]
        confidence=0.8,
        policy=PolicyRef(name="fgd"),
        decided_at=0.0,
        task=task,
    )


async def test_redelivered_decision_runs_once() -> None:
    backend, journal = SimBackend(), InMemoryExecutionJournal()
    first = await execute_decision(decision(), backend, journal, owner="e1")
    again = await execute_decision(decision(), backend, journal, owner="e1")
    assert isinstance(first, ActionExecuted) and again == first
    assert first.action_id == action_id_for("d1") and first.confidence == 0.8 and first.task_kind == "train"
    assert [a.verb for a in backend.actions] == ["start"]


async def test_two_replicas_racing_execute_once() -> None:
    backend, journal = SimBackend(time_scale=0.001), InMemoryExecutionJournal()
    results = await asyncio.gather(
        execute_decision(decision(), backend, journal, owner="e1"),
        execute_decision(decision(), backend, journal, owner="e2"),
    )
    assert sorted(r is None for r in results) == [False, True]
    assert len(backend.actions) == 1


@pytest.mark.parametrize(
    ("context", "kind", "labels", "allowed"),
    [
        (GpuContext(node="n1", gpu=0), "train", {}, True),
        (GpuContext(node="n1", gpu=0, role="reserved"), "train", {}, False),
        (GpuContext(node="n1", gpu=0, driver_pin="535"), "train", {"driver": "550"}, False),
        (GpuContext(node="n1", gpu=0, driver_pin="535"), "train", {"driver": "535"}, True),
        (GpuContext(node="n1", gpu=0, driver_pin="535.104.05"), "train", {"driver": "535"}, True),
        (GpuContext(node="n1", gpu=0, driver_pin="5350.1"), "train", {"driver": "535"}, False),
        (GpuContext(node="n1", gpu=0, task_kinds=["infer"]), "train", {}, False),
        (GpuContext(node="n1", gpu=0, task_kinds=["infer"]), "infer", {}, True),
    ],
)
async def test_business_rules(context: GpuContext, kind: str, labels: dict, allowed: bool) -> None:
    backend = SimBackend()
    business = StaticBusinessContext([context])
    result = await execute_decision(
        decision(kind=kind, labels=labels), backend, InMemoryExecutionJournal(), owner="e1", business=business
    )
    assert isinstance(result, ActionExecuted) is allowed
    assert bool(backend.actions) is allowed
    if not allowed:
        assert isinstance(result, ActionFailed) and not result.retryable and "business rule" in result.error
        assert result.latency_ms > 0.0  # the checks it took to refuse, timed: not a measured 0 ms


async def test_backend_failure_becomes_action_failed() -> None:
    journal = InMemoryExecutionJournal()
    result = await execute_decision(
        decision("migrate"), SimBackend(), journal, owner="e1"
    )  # nothing to migrate
    assert isinstance(result, ActionFailed) and "not running" in result.error
    assert await journal.result("d1") == result


@pytest.mark.parametrize("action", ["evict", "resize", "queue", "reject"])
async def test_other_verbs(action: str) -> None:
    backend, journal = SimBackend(), InMemoryExecutionJournal()
    await execute_decision(decision("assign", "d0"), backend, journal, owner="e1")
    result = await execute_decision(decision(action, "d1"), backend, journal, owner="e1")
    assert isinstance(result, ActionExecuted) and result.action == action
    expected = {"evict": ["start", "stop"], "resize": ["start", "resize"]}.get(action, ["start"])
    assert [a.verb for a in backend.actions] == expected


@pytest.mark.parametrize("resumable", [True, False])
async def test_a_move_tells_the_backend_whether_its_task_resumes(resumable: bool) -> None:
    backend, journal = SimBackend(), InMemoryExecutionJournal()
    await execute_decision(decision("assign", "d0"), backend, journal, owner="e1")
    await backend.poll()
    move = decision("migrate", "d1", placement=[Placement(node="n1", gpu=1, milli=1000, memory_mb=8000)])
    move = msgspec.structs.replace(move, task=msgspec.structs.replace(move.task, resumable=resumable))
    result = await execute_decision(move, backend, journal, owner="e1")
    assert isinstance(result, ActionExecuted)
    [moved] = await backend.poll()
    assert moved.state == "migrated" and ("started over" in moved.detail) is not resumable


async def test_backend_bug_is_recorded_not_left_claimed() -> None:
    class Broken(SimBackend):
        async def start(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise KeyError("bug")

    journal = InMemoryExecutionJournal()
    result = await execute_decision(decision(), Broken(), journal, owner="e1")
    assert isinstance(result, ActionFailed) and result.retryable and "KeyError" in result.error
    assert await execute_decision(decision(), Broken(), journal, owner="e2") == result


def on(node: str, gpu: int = 0) -> Placement:
    return Placement(node=node, gpu=gpu, milli=1000, memory_mb=8000)


@pytest.mark.parametrize(
    ("action", "placement", "source", "nodes"),
    [
        ("assign", [on("n1"), on("n1", 1)], [], {"n1"}),
        ("resize", [on("n2")], [], {"n2"}),
        ("evict", [], [on("n2")], {"n2"}),
        # A move belongs to the node it goes to, not to the one it leaves.
        ("migrate", [on("n1", 3)], [on("n2")], {"n1"}),
        ("migrate", [on("n2", 1)], [on("n2")], {"n2"}),
        # Naming no node: for every node's executor (the journal lets one acknowledge it).
        ("queue", [], [], {"n1", "n2", "n3"}),
        ("reject", [], [], {"n1", "n2", "n3"}),
    ],
)
def test_a_decision_is_carried_out_by_the_executor_of_its_node(action, placement, source, nodes) -> None:
    d = msgspec.structs.replace(decision(action, placement=placement), source=source)
    assert {n for n in ("n1", "n2", "n3") if carried_out_on(d, n)} == nodes


@pytest.mark.parametrize("failing", ["still_reserved", "before_assign"])
async def test_a_check_that_raises_leaves_no_claim_behind(failing: str) -> None:
    """A check before the verb that raises (the ledger read timing out, a hook's bug) must not
    leave the decision claimed: its redelivery would find the claim, be told "another replica
    runs it" until the runtime dead-letters it, and the decision would never be carried out."""
    calls = 0

    async def flaky(_decision: DecisionMade) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise TimeoutError("ledger read timed out")
        return True

    class FlakyHook:
        async def before_assign(self, d: DecisionMade) -> HookVerdict:
            await flaky(d)
            return ALLOW

        async def after_finish(self, event) -> None:  # type: ignore[no-untyped-def]
            return None

        async def pre_decommission(self, node, gpu, running_tasks) -> HookVerdict:  # type: ignore[no-untyped-def]
            return ALLOW

    backend, journal = SimBackend(), InMemoryExecutionJournal()
    kwargs: dict = {"still_reserved": flaky} if failing == "still_reserved" else {
        "business": StaticBusinessContext(hooks=[FlakyHook()])
    }
    with pytest.raises(TimeoutError):
        await execute_decision(decision(), backend, journal, owner="e1", **kwargs)
    # The redelivery carries it out.
    result = await execute_decision(decision(), backend, journal, owner="e1", **kwargs)
    assert isinstance(result, ActionExecuted)
    assert [a.verb for a in backend.actions] == ["start"]
