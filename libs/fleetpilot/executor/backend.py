"""The executor backend interface: the few verbs a decision needs, nothing more.

A backend runs tasks somewhere (OS processes, a simulated fleet, later Kubernetes pods)
and reports what happened to them as :class:`~fleetpilot.contracts.TaskLifecycle` events
through :meth:`ExecutorBackend.poll`. Adding a backend means implementing this Protocol;
nothing else in the executor changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import msgspec

from fleetpilot.contracts import DecisionMade, Placement, TaskLifecycle

STARTED_OVER = "started over: it cannot resume"
"""What the ``migrated`` event of a task that cannot resume says (``TaskSubmitted.resumable``)."""


def resumes(decision: DecisionMade) -> bool:
    """Whether the task a move decision carries goes on from its checkpoint; a decision that
    carries no task is taken to, as the policy takes a task it does not know."""
    return decision.task is None or decision.task.resumable


class TaskHandle(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend returns for a started task: where it runs and how to find it."""

    task_id: str
    backend: str
    node: str
    gpus: list[int]
    pid: int | None = None
    started_at: float
    latency_ms: float = 0.0


class ProcessSample(msgspec.Struct, frozen=True, kw_only=True):
    """Host-side resource use of one task's process, for the collector."""

    task_id: str
    pid: int
    rss_mb: float
    at: float


class BackendError(RuntimeError):
    """A backend could not carry out a verb; ``retryable`` says whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        """Build the error with its message and retry hint."""
        super().__init__(message)
        self.retryable = retryable


@runtime_checkable
class ExecutorBackend(Protocol):
    """Where tasks run. Every verb is idempotent on ``task_id`` where that makes sense:
    stopping a task that is not running is a no-op, starting one that runs raises."""

    name: str

    async def start(
        self, task_id: str, placement: Sequence[Placement], command: Sequence[str], env: Mapping[str, str]
    ) -> TaskHandle:
        """Start ``command`` for ``task_id`` on ``placement``."""
        ...

    async def stop(self, task_id: str, grace_s: float) -> None:
        """Ask the task to stop, force it after ``grace_s`` seconds (an eviction)."""
        ...

    async def migrate(
        self, task_id: str, target: Sequence[Placement], *, source: Sequence[Placement] = (), grace_s: float = 5.0,
        resumes: bool = True,
    ) -> TaskHandle:
        """Checkpoint, stop and restart the task on ``target``; ``source`` is where it runs
        now (a backend of one node takes a task over from another node there). A task still
        running once its checkpoint window is over is stopped as by ``stop`` with ``grace_s``.
        A task that cannot resume (``resumes`` false: ``TaskSubmitted.resumable``) is asked for
        no checkpoint: it is stopped as by ``stop`` and started over on the target."""
        ...

    async def resize(self, task_id: str, milli: int, memory_mb: int) -> None:
        """Change the task's share of its GPU (compute ``milli`` and ``memory_mb``)."""
        ...

    async def poll(self) -> list[TaskLifecycle]:
        """Lifecycle changes since the last poll, oldest first."""
        ...


def gpus_of(placement: Sequence[Placement]) -> list[int]:
    """The GPU indices of a placement (CPU-only shares, ``gpu = -1``, left out)."""
    return sorted({p.gpu for p in placement if p.gpu >= 0})


def node_of(placement: Sequence[Placement]) -> str:
    """The node of a placement; one task runs on one node in these backends."""
    nodes = {p.node for p in placement}
    if len(nodes) > 1:
        raise BackendError(f"placement spans several nodes: {sorted(nodes)}")
    return next(iter(nodes), "")
