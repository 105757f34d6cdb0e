"""The ledger and the fleet topology as a service sees them: KV buckets kept in memory by
watchers, and compare-and-set writes that retry on conflict."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from fleetpilot.contracts import Allocation, NodeLedger, NodeTopology, encode
from fleetpilot.runtime import Bus, CasConflict, KeyValue

_LEDGER = msgspec.json.Decoder(NodeLedger)
_NODE = msgspec.json.Decoder(NodeTopology)


class LedgerStore:
    """A live view of the ``ledger`` bucket plus CAS writes.

    Writers never trust the view: ``mutate`` reads the key's current revision, applies a
    pure change and writes with compare-and-set, retrying on conflict. The view is for
    deciding; the CAS is for committing.
    """

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self.nodes: dict[str, NodeLedger] = {}
        self.changed = asyncio.Event()

    @classmethod
    async def open(cls, bus: Bus) -> LedgerStore:
        """Load every node's ledger."""
        store = cls(await bus.kv("ledger"))
        for key in await store._kv.keys():
            entry = await store._kv.get(key)
            if entry and entry.value:
                store.nodes[key] = _LEDGER.decode(entry.value)
        return store

    async def follow(self) -> None:
        """Keep the view current (run as a background task)."""
        async for entry in self._kv.watch(">"):
            if entry.value is None:
                self.nodes.pop(entry.key, None)
            else:
                self.nodes[entry.key] = _LEDGER.decode(entry.value)
            self.changed.set()

    def holds_of(self, task_id: str) -> tuple[str, list[Allocation]] | None:
        """Where ``task_id`` holds capacity, if anywhere (for idempotent re-decisions)."""
        for node, ledger in self.nodes.items():
            allocs = [a for a in ledger.allocations if a.task_id == task_id]
            if allocs:
                return node, allocs
        return None

    async def mutate(self, node: str, change: Callable[[NodeLedger | None], NodeLedger | None],
                     *, attempts: int = 20) -> NodeLedger | None:
        """Apply ``change`` to the node's current ledger with CAS; ``None`` from ``change``
        aborts. Raises ``CasConflict`` after ``attempts`` lost races."""
        for attempt in range(attempts):
            entry = await self._kv.get(node)
            current = _LEDGER.decode(entry.value) if entry and entry.value else None
            updated = change(current)
            if updated is None:
                return None
            try:
                if entry is None:
                    await self._kv.create(node, encode(updated))
                else:
                    await self._kv.update(node, encode(updated), entry.revision)
            except CasConflict:
                await asyncio.sleep(0.001 * (attempt + 1))
                continue
            self.nodes[node] = updated
            return updated
        raise CasConflict(f"ledger of {node} kept changing under us")


class FleetView:
    """A live view of the ``topology`` bucket: every node the fleet has reported."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self.nodes: dict[str, NodeTopology] = {}
        self.version = 0

    @classmethod
    async def open(cls, bus: Bus) -> FleetView:
        """Load every known node."""
        view = cls(await bus.kv("topology"))
        for key in await view._kv.keys():
            entry = await view._kv.get(key)
            if entry and entry.value:
                view.nodes[key] = _NODE.decode(entry.value)
        view.version += 1
        return view

    async def follow(self) -> None:
        """Keep the view current (run as a background task)."""
        async for entry in self._kv.watch(">"):
            if entry.value is None:
                self.nodes.pop(entry.key, None)
            else:
                self.nodes[entry.key] = _NODE.decode(entry.value)
            self.version += 1


def node_key(node: str) -> str:
    """KV keys allow letters, digits, ``-_=/.``; node names are mapped onto that set."""
    return "".join(c if c.isalnum() or c in "-_=/." else "_" for c in node)


__all__ = ["FleetView", "LedgerStore", "node_key"]
