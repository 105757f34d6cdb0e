"""``SimBackend``: carries out actions against in-process state, with simulated latencies.

Nothing runs; each verb updates a table of simulated tasks, takes a latency drawn from
``latency_ms`` (optionally really slept, scaled by ``time_scale``) and queues the lifecycle
event a real backend would report. Outcomes that a real task would produce on its own
(finishing, running out of memory) are injected with :meth:`SimBackend.finish` and
:meth:`SimBackend.fail`.

The simulated fleet (``fleetpilot.fleet.simulator``) plugs in through :class:`SimAdapter`:
give the backend an adapter and every verb is forwarded to it, so the fleet's GPUs see the
task arrive, leave, move or change size. This module does not import the simulator.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, Protocol

import msgspec

from fleetpilot.contracts import LifecycleState, Placement, TaskLifecycle

from .backend import STARTED_OVER, BackendError, TaskHandle, gpus_of, node_of
from .locks import Clock

Verb = Literal["start", "stop", "migrate", "resize"]

DEFAULT_LATENCY_MS: Mapping[Verb, float] = {"start": 800.0, "stop": 150.0, "migrate": 4_000.0, "resize": 50.0}
"""Typical container-level latencies, used when no latency model is given."""


class SimAdapter(Protocol):
    """The hook a simulator implements to follow what the executor does to its fleet."""

    def on_start(self, task_id: str, placement: Sequence[Placement], command: Sequence[str]) -> None:
        """A task was placed; may raise :class:`BackendError` to refuse (e.g. no room)."""
        ...

    def on_stop(self, task_id: str) -> None:
        """A task was evicted."""
        ...

    def on_migrate(self, task_id: str, source: Sequence[Placement], target: Sequence[Placement],
                   resumes: bool) -> None:
        """A task moved: going on from its checkpoint (``resumes``), or started over there."""
        ...

    def on_resize(self, task_id: str, milli: int, memory_mb: int) -> None:
        """A task's share changed."""
        ...


class SimTask(msgspec.Struct, kw_only=True):
    """One simulated task's state."""

    task_id: str
    placement: list[Placement]
    command: list[str]
    started_at: float


class ActionRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One verb the backend carried out, for assertions and replay."""

    verb: Verb
    task_id: str
    latency_ms: float
    at: float
    placement: list[Placement] = msgspec.field(default_factory=list)


class SimBackend:
    """An :class:`~fleetpilot.executor.backend.ExecutorBackend` over in-process state."""

    name = "sim"

    def __init__(
        self,
        *,
        latency_ms: Callable[[Verb, str], float] | None = None,
        time_scale: float = 0.0,
        adapter: SimAdapter | None = None,
        clock: Clock = time.time,
    ) -> None:
        """``time_scale = 0`` records latencies without sleeping; ``1`` sleeps them for real."""
        self._latency = latency_ms or (lambda verb, _task: DEFAULT_LATENCY_MS[verb])
        self._time_scale = time_scale
        self._adapter = adapter
        self._clock = clock
        self.tasks: dict[str, SimTask] = {}
        self.actions: list[ActionRecord] = []
        self._events: deque[TaskLifecycle] = deque()

    async def _take(self, verb: Verb, task_id: str, placement: Sequence[Placement] = ()) -> float:
        latency = self._latency(verb, task_id)
        if self._time_scale > 0:
            await asyncio.sleep(latency / 1000.0 * self._time_scale)
        self.actions.append(
            ActionRecord(
                verb=verb, task_id=task_id, latency_ms=latency, at=self._clock(), placement=list(placement)
            )
        )
        return latency

    def _emit(
        self, task: SimTask, state: LifecycleState, detail: str = "", exit_code: int | None = None
    ) -> None:
        self._events.append(
            TaskLifecycle(
                task_id=task.task_id,
                state=state,
                node=node_of(task.placement),
                gpus=gpus_of(task.placement),
                exit_code=exit_code,
                detail=detail,
                at=self._clock(),
            )
        )

    def _running(self, task_id: str) -> SimTask:
        task = self.tasks.get(task_id)
        if task is None:
            raise BackendError(f"task {task_id} is not running here")
        return task

    async def start(
        self, task_id: str, placement: Sequence[Placement], command: Sequence[str], env: Mapping[str, str]
    ) -> TaskHandle:
        """Place the task (forwarded to the adapter) and report ``started``."""
        if task_id in self.tasks:
            raise BackendError(f"task {task_id} is already running")
        if self._adapter is not None:
            self._adapter.on_start(task_id, placement, command)
        latency = await self._take("start", task_id, placement)
        task = SimTask(
            task_id=task_id, placement=list(placement), command=list(command), started_at=self._clock()
        )
        self.tasks[task_id] = task
        self._emit(task, "started")
        return TaskHandle(
            task_id=task_id,
            backend=self.name,
            node=node_of(placement),
            gpus=gpus_of(placement),
            started_at=task.started_at,
            latency_ms=latency,
        )

    async def stop(self, task_id: str, grace_s: float) -> None:
        """Evict the task; no-op if it is not running."""
        task = self.tasks.pop(task_id, None)
        if task is None:
            return
        if self._adapter is not None:
            self._adapter.on_stop(task_id)
        await self._take("stop", task_id)
        self._emit(task, "evicted", detail=f"grace {grace_s:g}s")

    async def migrate(
        self, task_id: str, target: Sequence[Placement], *, source: Sequence[Placement] = (), grace_s: float = 5.0,
        resumes: bool = True,
    ) -> TaskHandle:
        """Move the task to ``target`` and report ``migrated`` (started over, for a task that
        cannot resume)."""
        task = self._running(task_id)
        if self._adapter is not None:
            self._adapter.on_migrate(task_id, task.placement, target, resumes)
        latency = await self._take("migrate", task_id, target)
        task.placement = list(target)
        self._emit(task, "migrated", detail="" if resumes else STARTED_OVER)
        return TaskHandle(
            task_id=task_id,
            backend=self.name,
            node=node_of(target),
            gpus=gpus_of(target),
            started_at=self._clock(),
            latency_ms=latency,
        )

    async def resize(self, task_id: str, milli: int, memory_mb: int) -> None:
        """Change the task's share and report ``resized``."""
        task = self._running(task_id)
        if self._adapter is not None:
            self._adapter.on_resize(task_id, milli, memory_mb)
        await self._take("resize", task_id)
        task.placement = [
            Placement(node=p.node, gpu=p.gpu, milli=milli, memory_mb=memory_mb) if p.gpu >= 0 else p
            for p in task.placement
        ]
        self._emit(task, "resized", detail=f"milli={milli} memory_mb={memory_mb}")

    def finish(self, task_id: str, *, exit_code: int = 0) -> None:
        """Inject the task's end: ``finished`` for exit 0, ``failed`` otherwise."""
        task = self.tasks.pop(task_id)
        self._emit(task, "finished" if exit_code == 0 else "failed", exit_code=exit_code)

    def fail(self, task_id: str, state: LifecycleState = "oom_killed", detail: str = "") -> None:
        """Inject an abnormal end (``oom_killed`` by default)."""
        task = self.tasks.pop(task_id)
        self._emit(task, state, detail=detail, exit_code=137 if state == "oom_killed" else 1)

    async def poll(self) -> list[TaskLifecycle]:
        """Lifecycle changes since the last poll, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events
