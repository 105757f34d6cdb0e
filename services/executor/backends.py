"""Backends the executor service adds to the library's: the simulated fleet over the bus,
the take-over of a task from another node's executor, and the KV-backed execution journal."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence

import msgspec
from fleetpilot.contracts import (
    ActionExecuted,
    ActionFailed,
    HandedOver,
    HandOver,
    Placement,
    SimAck,
    SimCommand,
    TaskLifecycle,
    TaskSubmitted,
    decode,
    encode,
    subject_for,
)
from fleetpilot.executor import BackendError, TaskHandle, recorded_result
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import Bus, CasConflict, KeyValue
from fleetpilot.workload import SIM_PEAK_LABEL

log = logging.getLogger("fleetpilot.executor")

HAND_OVER_ATTEMPTS = 3
"""How many times a target asks the source for a task (an answer lost on the way)."""


def hand_over_wait_s(checkpoint_s: float, grace_s: float, attempts: int = HAND_OVER_ATTEMPTS) -> float:
    """How long a target may wait for a task's hand-over in all: each try gives the source
    the checkpoint window, the stop's grace and 10 s for the round trip."""
    return attempts * (checkpoint_s + grace_s + 10.0)


class BusTakeOver:
    """``take_over`` for a node's process backend: asks the executor of the node a task runs
    on (``executor.handover.<node>``) to checkpoint and stop it, for it to restart here.

    An answer lost on the way is asked for again (the source answers a repeat the same);
    no answer at all (no executor there, or it is stuck) is a retryable failure, and the
    task stays at its source."""

    def __init__(self, bus: Bus, checkpoint_s: float = 1.0, attempts: int = HAND_OVER_ATTEMPTS) -> None:
        """Ask over ``bus``, allowing the source ``checkpoint_s`` to save, ``attempts`` times."""
        self._bus = bus
        self._checkpoint_s = checkpoint_s
        self._attempts = attempts

    async def __call__(self, node: str, task_id: str, grace_s: float,
                       resumes: bool = True) -> tuple[list[str], dict[str, str]]:
        """The command and environment of ``task_id``, once stopped on ``node`` (after its
        checkpoint signal when it ``resumes``)."""
        request = HandOver(task_id=task_id, node=node, grace_s=grace_s, resumable=resumes)
        # The source signals, waits for the checkpoint, then stops with grace; a task that
        # cannot resume it only stops.
        timeout_s = hand_over_wait_s(self._checkpoint_s if resumes else 0.0, grace_s, attempts=1)
        last = ""
        for _ in range(self._attempts):
            try:
                raw = await self._bus.request(subject_for(request), encode(request), timeout_s=timeout_s)
            except TimeoutError as exc:
                last = str(exc)
                continue
            answer = decode(raw, HandedOver)
            if not answer.ok:
                raise BackendError(f"{node} did not hand {task_id} over: {answer.error}")
            return answer.command, answer.env
        raise BackendError(f"{node} did not hand {task_id} over: {last}", retryable=True)


def simulated_peak_mb(task: TaskSubmitted) -> float:
    """The per-GPU peak the simulated fleet plays ``task``'s program to: its ``SIM_PEAK_LABEL``
    where it carries a positive number, else what it asks (1000 MB when it asks nothing)."""
    asked = float(task.gpu_memory_mb or 1000)
    label = task.labels.get(SIM_PEAK_LABEL)
    try:
        peak = float(label) if label is not None else asked
    except ValueError:
        log.warning("%s: label %s=%r is no number; its program peaks at what it asks", task.task_id,
                    SIM_PEAK_LABEL, label)
        return asked
    return peak if math.isfinite(peak) and peak > 0 else asked


class BusSimBackend:
    """Runs tasks on the simulated fleet hosted by the collector (``sim.control``)."""

    name = "sim"

    def __init__(self, bus: Bus, default_duration_s: float = 120.0) -> None:
        self._bus = bus
        self._default_duration_s = default_duration_s
        self.task_meta: dict[str, tuple[float, str, float, bool]] = {}

    def describe(self, task_id: str, peak_mb: float, pattern: str, duration_s: float | None,
                 resumable: bool = True) -> None:
        """Tell the backend how the task will behave (from its submission and fingerprint)."""
        self.task_meta[task_id] = (peak_mb, pattern, duration_s or self._default_duration_s, resumable)

    async def _send(self, cmd: SimCommand) -> float:
        began = time.perf_counter()
        try:
            ack = decode(await self._bus.request("sim.control", encode(cmd), timeout_s=5.0), SimAck)
        except TimeoutError as exc:
            raise BackendError("simulated fleet did not answer", retryable=True) from exc
        if not ack.ok:
            raise BackendError(ack.detail)
        return (time.perf_counter() - began) * 1000.0

    async def start(
        self, task_id: str, placement: Sequence[Placement], command: Sequence[str], env: Mapping[str, str]
    ) -> TaskHandle:
        """Place the task on its GPUs; CPU-only tasks run without touching the GPUs."""
        return await self._put("place", task_id, placement)

    async def stop(self, task_id: str, grace_s: float) -> None:
        """Remove the task from the simulated fleet."""
        await self._send(SimCommand(verb="remove", task_id=task_id))

    async def migrate(
        self, task_id: str, target: Sequence[Placement], *, source: Sequence[Placement] = (), grace_s: float = 5.0,
        resumes: bool = True,
    ) -> TaskHandle:
        """Move the task: restored on the target from its checkpoint, or started over there
        when it cannot resume (``SimulatedHardware``), as the move or the task described says."""
        return await self._put("move", task_id, target, resumes=resumes)

    async def _put(self, verb: str, task_id: str, placement: Sequence[Placement], *, resumes: bool = True) -> TaskHandle:
        peak, pattern, duration, resumable = self.task_meta.get(task_id, (1000.0, "flat", self._default_duration_s, True))
        resumable = resumable and resumes
        gpus = [p.gpu for p in placement if p.gpu >= 0]
        latency = 0.0
        if gpus:
            latency = await self._send(SimCommand(verb=verb, task_id=task_id, node=placement[0].node, gpus=gpus,
                                                  peak_memory_mb=peak, pattern=pattern, duration_s=duration,
                                                  resumable=resumable))
        return TaskHandle(task_id=task_id, backend=self.name, node=placement[0].node if placement else "",
                          gpus=gpus, started_at=time.time(), latency_ms=latency)

    async def resize(self, task_id: str, milli: int, memory_mb: int) -> None:
        """A resize changes only the ledger's view of the share in simulation."""

    async def poll(self) -> list[TaskLifecycle]:
        """Lifecycle changes arrive as ``sim.event`` messages instead."""
        return []


class KvExecutionJournal:
    """The execution journal in the ``executions`` bucket.

    A claim is a create-only key; a claim older than ``stale_after_s`` without a result
    belongs to a replica that died mid-action and may be taken over with compare-and-set.
    """

    def __init__(self, kv: KeyValue, stale_after_s: float = 30.0) -> None:
        self._kv = kv
        self._stale_after_s = stale_after_s

    async def claim(self, decision_id: str, owner: str) -> bool:
        """Reserve ``decision_id`` for ``owner``."""
        key = node_key(decision_id)
        body = msgspec.json.encode({"claim": owner, "at": time.time()})
        try:
            await self._kv.create(key, body)
            return True
        except CasConflict:
            entry = await self._kv.get(key)
            if entry is None or entry.value is None:
                return False
            doc = msgspec.json.decode(entry.value)
            if "claim" in doc and time.time() - doc["at"] > self._stale_after_s:
                try:
                    await self._kv.update(key, body, entry.revision)
                    return True
                except CasConflict:
                    return False
            return False

    async def result(self, decision_id: str) -> ActionExecuted | ActionFailed | None:
        """The recorded result, if the decision was executed."""
        entry = await self._kv.get(node_key(decision_id))
        return recorded_result(entry.value) if entry is not None else None

    async def record(self, decision_id: str, result: ActionExecuted | ActionFailed) -> None:
        """Store the result (replaces the claim)."""
        await self._kv.put(node_key(decision_id), encode(result))
