"""The agreed contracts as the policy sees them: ``contract.<task>`` entries of the ``contracts``
bucket (written by the sla service: the published ``TaskAdmitted``, contract included),
watched into memory. The policy only reads them: to know which running tasks are
``best_effort`` (and may be preempted for a vip) and to queue an evicted task again with its
own admission (one the policy preempted, or one the executor evicted from a decommissioned GPU).

The key layout (``contract.`` + the task id made KV-safe like ``node_key``) is the sla
service's; services do not import each other, so it is restated here.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import msgspec
from fleetpilot.contracts import TaskAdmitted
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import Bus, KeyValue

log = logging.getLogger("fleetpilot.policy.admissions")

CONTRACT_PREFIX = "contract."
_ADMITTED = msgspec.json.Decoder(TaskAdmitted)


class Admissions:
    """``contract.<task>`` entries by task id, plus the admissions this replica placed itself
    (bounded) for tasks whose contract the sla service did not store."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self.stored: dict[str, TaskAdmitted] = {}
        self._by_key: dict[str, str] = {}
        self.seen: OrderedDict[str, TaskAdmitted] = OrderedDict()

    @classmethod
    async def open(cls, bus: Bus) -> Admissions:
        """Load every stored contract."""
        view = cls(await bus.kv("contracts"))
        for key in await view._kv.keys():
            if key.startswith(CONTRACT_PREFIX):
                entry = await view._kv.get(key)
                view._apply(key, entry.value if entry else None)
        return view

    async def follow(self) -> None:
        """Keep the view current (run as a background task)."""
        async for entry in self._kv.watch(CONTRACT_PREFIX + ">"):
            self._apply(entry.key, entry.value)

    def _apply(self, key: str, value: bytes | None) -> None:
        if value is None:
            task_id = self._by_key.pop(key, None)
            if task_id is not None:
                self.stored.pop(task_id, None)
            return
        try:
            adm = _ADMITTED.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("contracts bucket: ignoring unreadable %s: %s", key, exc)
            return
        self._by_key[key] = adm.task.task_id
        self.stored[adm.task.task_id] = adm

    def placed(self, adm: TaskAdmitted, limit: int = 100_000) -> None:
        """Remember an admission this replica decided on."""
        self.seen[adm.task.task_id] = adm
        self.seen.move_to_end(adm.task.task_id)
        while len(self.seen) > limit:
            self.seen.popitem(last=False)

    def of(self, task_id: str) -> TaskAdmitted | None:
        """The task's admission: the stored contract first, else the one this replica saw."""
        return self.stored.get(task_id) or self.seen.get(task_id)

    async def fetch(self, task_id: str) -> TaskAdmitted | None:
        """``of``, else a fresh read of ``contract.<task>`` (the watch may not have delivered it
        yet); ``None`` when neither the bucket nor this replica knows the task."""
        known = self.of(task_id)
        if known is not None:
            return known
        key = CONTRACT_PREFIX + node_key(task_id)
        entry = await self._kv.get(key)
        if entry is None or not entry.value:
            return None
        self._apply(key, entry.value)
        return self.stored.get(task_id)

    def tier(self, task_id: str) -> str | None:
        """The task's contract tier, ``None`` when unknown (then it is never preempted)."""
        adm = self.of(task_id)
        return adm.contract.tier if adm is not None else None
