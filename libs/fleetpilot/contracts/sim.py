"""Simulated-hardware family: how an executor drives the simulated fleet hosted by the
collector, and what that "hardware" reports back.

On real nodes the executor starts processes and the collector reads NVML; in simulation
both touch the same simulated fleet, which lives in the collector process. These events
are that hardware boundary and nothing else uses them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .base import Event
from .fingerprint import GrowthPattern

SimVerb = Literal["place", "remove", "move"]
# ``task_failed``: a fatal XID (see ``fleet.reader.FATAL_XIDS``) killed the task.
SimEventKind = Literal["finished", "oom_killed", "task_failed", "xid", "ecc", "overheat"]


class SimCommand(Event, frozen=True, kw_only=True, tag="sim.command.v1"):
    """Start, stop or move a task on the simulated fleet (request/reply on ``sim.control``).
    A task that is not ``resumable`` (``TaskSubmitted.resumable``) starts its run over when it
    is moved or placed again; any other goes on from where it was stopped."""

    verb: SimVerb
    task_id: str
    node: str = ""
    gpus: list[int] = msgspec.field(default_factory=list)
    peak_memory_mb: float = 0.0
    pattern: GrowthPattern = "flat"
    duration_s: float = 600.0
    utilization_pct: float = 80.0
    resumable: bool = True


class SimAck(Event, frozen=True, kw_only=True, tag="sim.ack.v1"):
    """The simulated fleet's answer to a command."""

    ok: bool
    detail: str = ""


class SimEvent(Event, frozen=True, kw_only=True, tag="sim.event.v1"):
    """Something the simulated hardware did on its own: a task ended, was OOM-killed, a fault."""

    kind: SimEventKind
    node: str
    gpu: int = -1
    task_id: str | None = None
    detail: str = ""
    at: float
