"""Executor family: how the executor of one node takes over a task that moves there from
another node.

With one executor per node (the process backend), a move between nodes is carried out by
the target's executor; only the source's executor can checkpoint and stop the running
process, so the target asks it to (request/reply on ``executor.handover.<source node>``)
and restarts the task from that checkpoint with what the answer hands over.
"""

from __future__ import annotations

import msgspec

from .base import Event


class HandOver(Event, frozen=True, kw_only=True, tag="executor.hand_over.v1"):
    """Checkpoint and stop ``task_id``, which runs on ``node`` and moves to another node
    (request on ``executor.handover.<node>``); a repeated request is answered the same.
    ``resumable`` false (``TaskSubmitted.resumable``): the task is stopped without the
    checkpoint signal, to start over at the target."""

    task_id: str
    node: str
    grace_s: float = 10.0
    resumable: bool = True


class HandedOver(Event, frozen=True, kw_only=True, tag="executor.handed_over.v1"):
    """The answer to a :class:`HandOver`: when ``ok``, the task is stopped at the source
    after its checkpoint signal, and ``command`` and ``env`` restart it; else ``error``
    says why nothing was stopped."""

    task_id: str
    ok: bool
    command: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    error: str = ""
