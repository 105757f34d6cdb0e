"""The one reading interface the collector sees: ``GpuReader``.

Both the NVML backend (``nvml_reader.NvmlReader``) and the simulated fleet
(``simulator.SimulatedFleet``) implement it, so a collector is written once and cannot
tell them apart. The interface is deliberately small: list nodes, sample GPUs, sample
tasks, describe topology, drain events.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import msgspec

from fleetpilot.contracts.task import TaskLifecycle
from fleetpilot.contracts.telemetry import GpuSample, TaskTelemetry
from fleetpilot.contracts.topology import NodeTopology

FleetEventKind = Literal["oom", "xid", "ecc", "overheat", "finished", "task_failed"]

# XIDs after which the GPU's work is lost (double-bit ECC, NVLink fatal, fell off the bus,
# contained/uncontained ECC): the simulator kills the GPU's tasks on these.
FATAL_XIDS: frozenset[int] = frozenset({48, 74, 79, 94, 95})


class FleetEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Something that happened to a GPU or a task between two reads (OOM, XID, ECC ...)."""

    kind: FleetEventKind
    node: str
    gpu: int
    at: float
    task_id: str | None = None
    value: float = 0.0
    detail: str = ""


_LIFECYCLE_STATE = {"oom": "oom_killed", "finished": "finished", "task_failed": "failed"}


def lifecycle_for(event: FleetEvent, gpus: list[int] | None = None) -> TaskLifecycle | None:
    """The ``task.lifecycle`` event an executor would publish for ``event``, if it ends a task."""
    state = _LIFECYCLE_STATE.get(event.kind)
    if state is None or event.task_id is None:
        return None
    return TaskLifecycle(task_id=event.task_id, state=state, node=event.node,  # type: ignore[arg-type]
                         gpus=list(gpus if gpus is not None else [event.gpu]), detail=event.detail, at=event.at)


@runtime_checkable
class GpuReader(Protocol):
    """Reads GPUs of one or more nodes: implemented by NVML and by the simulated fleet."""

    @property
    def source(self) -> Literal["nvml", "sim"]:
        """Where readings come from (the ``source`` of ``NodeTelemetry``)."""
        ...

    def node_names(self) -> list[str]:
        """The nodes this reader can sample."""
        ...

    def sample(self, node: str) -> list[GpuSample]:
        """One reading of every GPU of ``node`` (every schema field filled)."""
        ...

    def task_samples(self, node: str) -> list[TaskTelemetry]:
        """Memory and utilisation of each task (or untracked process) running on ``node``."""
        ...

    def topology(self, node: str) -> NodeTopology:
        """The node's devices and links."""
        ...

    def events(self) -> list[FleetEvent]:
        """Events since the last call (OOM kills, XIDs, ECC, overheating); drains the queue."""
        ...
