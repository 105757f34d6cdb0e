"""SimBackend: verbs against in-process state, latencies, the simulator adapter hook."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from fleetpilot.contracts import Placement
from fleetpilot.executor import BackendError, ExecutorBackend, ProcessBackend, SimBackend

A = [Placement(node="n1", gpu=0, milli=500, memory_mb=1000)]
B = [Placement(node="n2", gpu=1, milli=500, memory_mb=1000)]


class RecordingAdapter:
    """A stand-in for the fleet simulator that refuses GPU 7."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_start(self, task_id: str, placement: Sequence[Placement], command: Sequence[str]) -> None:
        if any(p.gpu == 7 for p in placement):
            raise BackendError("no room on gpu 7", retryable=True)
        self.calls.append(("start", task_id, placement[0].node))

    def on_stop(self, task_id: str) -> None:
        self.calls.append(("stop", task_id))

    def on_migrate(self, task_id: str, source: Sequence[Placement], target: Sequence[Placement],
                   resumes: bool) -> None:
        self.calls.append(("migrate", task_id, source[0].node, target[0].node, resumes))

    def on_resize(self, task_id: str, milli: int, memory_mb: int) -> None:
        self.calls.append(("resize", task_id, milli, memory_mb))


def test_backends_satisfy_protocol() -> None:
    assert isinstance(SimBackend(), ExecutorBackend)
    assert isinstance(ProcessBackend(), ExecutorBackend)


async def test_full_lifecycle_with_adapter() -> None:
    adapter = RecordingAdapter()
    backend = SimBackend(
        adapter=adapter, latency_ms=lambda verb, _t: {"start": 10.0}.get(verb, 1.0), clock=lambda: 5.0
    )
    handle = await backend.start("t", A, ["train.py"], {})
    assert handle.latency_ms == 10.0 and handle.node == "n1"
    moved = await backend.migrate("t", B)
    assert moved.node == "n2" and backend.tasks["t"].placement == B
    await backend.migrate("t", A, resumes=False)  # a program that starts over: the simulator is told
    await backend.resize("t", 250, 800)
    assert backend.tasks["t"].placement[0].milli == 250
    await backend.stop("t", grace_s=3)
    await backend.stop("t", grace_s=3)  # idempotent
    states = [e.state for e in await backend.poll()]
    assert states == ["started", "migrated", "migrated", "resized", "evicted"]
    assert await backend.poll() == []
    assert adapter.calls == [
        ("start", "t", "n1"),
        ("migrate", "t", "n1", "n2", True),
        ("migrate", "t", "n2", "n1", False),
        ("resize", "t", 250, 800),
        ("stop", "t"),
    ]
    assert [a.verb for a in backend.actions] == ["start", "migrate", "migrate", "resize", "stop"]


@pytest.mark.parametrize(("exit_code", "state"), [(0, "finished"), (2, "failed")])
async def test_injected_end(exit_code: int, state: str) -> None:
    backend = SimBackend()
    await backend.start("t", A, [], {})
    backend.finish("t", exit_code=exit_code)
    assert [e.state for e in await backend.poll()][-1] == state


async def test_injected_oom_and_refusals() -> None:
    backend = SimBackend(adapter=RecordingAdapter())
    await backend.start("t", A, [], {})
    backend.fail("t")
    assert (await backend.poll())[-1].state == "oom_killed"
    with pytest.raises(BackendError):
        await backend.migrate("t", B)  # no longer running
    with pytest.raises(BackendError) as refused:
        await backend.start("u", [Placement(node="n1", gpu=7, milli=1000)], [], {})
    assert refused.value.retryable and "u" not in backend.tasks
