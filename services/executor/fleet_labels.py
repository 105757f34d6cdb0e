"""GPU condition labels in the ``topology`` bucket: how the executor tells the policy that a
GPU is cordoned, decommissioned or pending maintenance.

The executor does not decide (only the policy publishes ``decision.made``), so it does not
move work itself when a GPU goes bad: it labels the GPU in the node's topology entry
(``NodeTopology.gpus[i].labels``), which every policy replica already reads, and the
policy stops placing work there and migrates running tasks away.

Labels are written with compare-and-set on the entry's revision. The topology service
rewrites a node's entry when its collector reports a *changed* topology, which drops our
labels; :meth:`FleetLabels.follow` watches the bucket and puts back the labels this replica
set. Labels are sticky: an operator removes them when the GPU is back in service.

The labels this replica sets follow the *board* (its NVML uuid) where it is known, as the
topology service carries them over: GPU indices renumber when a GPU falls off the bus or a
board is swapped, and put back by index, a cordon went back onto the healthy board that
took the hot one's number. See :func:`gpu_of` for how a board is found in an entry.

A label write changes the GPUs' ``labels`` and nothing else of the stored value
(:func:`with_gpu_labels`): the entry may hold members this replica's ``NodeTopology`` does
not know, such as the topology service's ``applied_report`` (which report wrote the entry,
so that no late report overwrites a newer one) or a field of a newer contract. Re-encoded
from the decoded ``NodeTopology``, a label write dropped them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
from fleetpilot.contracts import (
    GPU_LABEL_CORDONED,
    GPU_LABEL_DECOMMISSIONED,
    GPU_LABEL_MAINTENANCE_PENDING,
    GPU_LABEL_UNREACHABLE,
    DecisionMade,
    GpuInfo,
    NodeTopology,
    TaskLifecycle,
)
from fleetpilot.executor import ALLOW, HookVerdict
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import CasConflict, KeyValue

log = logging.getLogger("fleetpilot.executor.labels")

CORDONED = GPU_LABEL_CORDONED
DECOMMISSIONED = GPU_LABEL_DECOMMISSIONED
MAINTENANCE_PENDING = GPU_LABEL_MAINTENANCE_PENDING
UNREACHABLE = GPU_LABEL_UNREACHABLE

_NODE = msgspec.json.Decoder(NodeTopology)
_MEMBERS = msgspec.json.Decoder(dict[str, Any])


def with_gpu_labels(value: bytes, labels: Mapping[int, Mapping[str, str]]) -> bytes:
    """The stored entry ``value`` with the GPU at each position of its ``gpus`` list given
    ``labels[position]`` as its labels, every other member kept as it is.

    Only the labels are ours to write: a member this replica does not know (the topology
    service's ``applied_report``, a field a newer contract added, on the node or on a GPU)
    stays, where encoding the decoded ``NodeTopology`` again dropped it.
    """
    members = _MEMBERS.decode(value)
    gpus = members["gpus"]
    for position, gpu_labels in labels.items():
        gpus[position]["labels"] = dict(gpu_labels)
    return msgspec.json.encode(members)


def gpu_of(topo: NodeTopology, gpu: int, uuid: str = "") -> GpuInfo | None:
    """The GPU of ``topo`` that is the board ``uuid`` (read at index ``gpu`` by its latest
    sample): the one the entry names by that uuid, else the one at index ``gpu`` unless the
    entry names another board there (``None``: the board is not in the entry, which is
    behind the samples or ahead of them). Without a uuid, the GPU at index ``gpu``. The same
    rule as the topology service's for carrying labels over."""
    if uuid:
        named = next((g for g in topo.gpus if g.uuid == uuid), None)
        if named is not None:
            return named
    info = next((g for g in topo.gpus if g.index == gpu), None)
    if info is not None and uuid and info.uuid and info.uuid != uuid:
        return None
    return info


class _Wanted(msgspec.Struct, kw_only=True):
    """Labels this replica keeps on one GPU: the board ``uuid`` (``""``: unknown, then the
    GPU at ``index``), read at ``index`` when they were last set."""

    index: int
    uuid: str
    labels: dict[str, str]


class FleetLabels:
    """A view of the ``topology`` bucket plus the GPU labels this replica keeps there."""

    def __init__(self, kv: KeyValue) -> None:
        """Use ``kv`` (the ``topology`` bucket); call :meth:`load`, then run :meth:`follow`."""
        self._kv = kv
        self.nodes: dict[str, NodeTopology] = {}
        # Labels we set, by KV key and board (its uuid, or ``#<index>`` where none is known),
        # to put back after a topology rewrite; in the order they were last set, so that of
        # two that land on one GPU (an entry without uuids) the later wins.
        self._wanted: dict[str, dict[str, _Wanted]] = {}
        # (node, GPU, label, value) of each label of ours that someone else set otherwise
        # since (an operator's "false", another replica's): theirs stands, and the health
        # model reads its GPU's history anew (``GpuHealth.take_overrides``).
        self.overridden: list[tuple[str, int, str, str]] = []
        # The revision of our latest write of each entry: the watch's entries up to it are
        # our own writes or older ones, which override nothing.
        self._written: dict[str, int] = {}
        # Entries whose labels a write failed to put (``set`` raised): written again by
        # ``apply_pending``, on the health round.
        self._unapplied: set[str] = set()
        # Called with a node's name when its key is deleted (the node was forgotten), for
        # what other parts of the replica keep of it to go too.
        self.on_forget: list[Callable[[str], None]] = []

    async def load(self) -> None:
        """Read every node once."""
        for key in await self._kv.keys():
            entry = await self._kv.get(key)
            if entry and entry.value:
                self.nodes[key] = _NODE.decode(entry.value)

    def labels_of(self, node: str, gpu: int, uuid: str = "") -> Mapping[str, str]:
        """The labels of one GPU as last seen (empty for an unknown GPU): of the board
        ``uuid`` when given (:func:`gpu_of`), else of the GPU at index ``gpu``."""
        topo = self.nodes.get(node_key(node))
        info = gpu_of(topo, gpu, uuid) if topo else None
        return info.labels if info else {}

    def model_of(self, node: str, gpu: int) -> str:
        """The GPU's model as the topology knows it, or ``""``."""
        topo = self.nodes.get(node_key(node))
        info = next((g for g in topo.gpus if g.index == gpu), None) if topo else None
        return info.model if info else ""

    async def set(self, node: str, gpu: int, labels: Mapping[str, str], uuid: str = "") -> bool:
        """Add ``labels`` to one GPU: the board ``uuid``, which reads at index ``gpu`` now
        (``""``: not known, the GPU at ``gpu``); ``True`` if the entry was written now. A node
        not in the bucket yet, or whose entry does not hold the board yet, is labelled when it
        does (see :meth:`follow`)."""
        key = node_key(node)
        wanted = self._wanted.setdefault(key, {})
        board = uuid or f"#{gpu}"
        kept = wanted.pop(board, None)
        wanted[board] = _Wanted(index=gpu, uuid=uuid, labels={**(kept.labels if kept else {}), **labels})
        try:
            return await self._apply(key)
        except Exception:
            # Kept to be written again (``apply_pending``): a cordon whose write failed once
            # (the bucket contended, the server away) left the GPU taking work while the
            # hook, which emits each command once, took it as cordoned.
            self._unapplied.add(key)
            raise

    async def apply_pending(self) -> None:
        """Write again the labels whose write failed; a key that fails again is kept."""
        for key in sorted(self._unapplied):
            try:
                await self._apply(key)
            except Exception as error:  # noqa: BLE001 - the next round tries again
                log.warning("labels of %s still not written (%s: %s)", key, type(error).__name__, error)
                continue
            self._unapplied.discard(key)

    async def _apply(self, key: str, attempts: int = 20) -> bool:
        wanted = self._wanted.get(key, {})
        for attempt in range(attempts):
            entry = await self._kv.get(key)
            if entry is None or not entry.value:
                return False
            topo = _NODE.decode(entry.value)
            gpus, relabelled = [], {}
            extras = self._extras(topo, wanted)
            for position, info in enumerate(topo.gpus):
                extra = extras.get(info.index, {})
                if any(info.labels.get(k) != v for k, v in extra.items()):
                    info = msgspec.structs.replace(info, labels={**info.labels, **extra})
                    relabelled[position] = info.labels
                gpus.append(info)
            if not relabelled:
                self.nodes[key] = topo
                return False
            updated = msgspec.structs.replace(topo, gpus=gpus)
            try:
                self._written[key] = await self._kv.update(key, with_gpu_labels(entry.value, relabelled),
                                                           entry.revision)
            except CasConflict:
                await asyncio.sleep(0.005 * (attempt + 1))
                continue
            self.nodes[key] = updated
            log.info("labelled %s: %s", key, extras)
            return True
        raise CasConflict(f"topology entry {key} kept changing under us")

    @staticmethod
    def _extras(topo: NodeTopology, wanted: Mapping[str, _Wanted]) -> dict[int, dict[str, str]]:
        """The labels we want on each GPU of ``topo``, by its index there."""
        extras: dict[int, dict[str, str]] = {}
        for want in wanted.values():
            info = gpu_of(topo, want.index, want.uuid)
            if info is not None and want.labels:
                extras.setdefault(info.index, {}).update(want.labels)
        return extras

    async def follow(self) -> None:
        """Keep the view current and put our labels back when a rewrite dropped them (run
        as a background task)."""
        async for entry in self._kv.watch(">"):
            if entry.value is None:
                self._forget(entry.key)
                continue
            try:
                self.nodes[entry.key] = _NODE.decode(entry.value)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.error("topology bucket: %s is unreadable (%s); keeping what was read before", entry.key, exc)
                continue
            if entry.revision > self._written.get(entry.key, 0):
                self._give_way(entry.key, self.nodes[entry.key])
            if entry.key in self._wanted:
                try:
                    await self._apply(entry.key)
                except CasConflict:
                    log.warning("could not put labels back on %s; the next change retries", entry.key)

    def _forget(self, key: str) -> None:
        """The node's key was deleted: it was forgotten (``fleetpilot fleet forget``, or the
        topology service's ``FORGET_AFTER_S``). What this replica labelled there goes with it,
        and those told (``on_forget``) drop what they made of the node: back under its name,
        it is a new node. Kept, its cordon came back with its first report."""
        topo = self.nodes.pop(key, None)
        self._wanted.pop(key, None)
        self._written.pop(key, None)
        self._unapplied.discard(key)
        node = topo.node if topo is not None else key
        for forget in self.on_forget:
            forget(node)

    def _give_way(self, key: str, topo: NodeTopology) -> None:
        """Stop putting back the labels of ours that ``topo`` holds with another value.

        A rewrite by the topology service drops labels, and those are put back. One that is
        there with another value was set so on purpose: an operator's ``maintenance_pending
        = "false"`` once the GPU was seen to, say. Put back, it came back within a second,
        and no operator could clear a label while the replica that set it ran.
        """
        wanted = self._wanted.get(key)
        if not wanted:
            return
        extras = self._extras(topo, wanted)
        for info in topo.gpus:
            for label, value in extras.get(info.index, {}).items():
                theirs = info.labels.get(label)
                if theirs is not None and theirs != value:
                    for want in wanted.values():
                        if gpu_of(topo, want.index, want.uuid) is info:
                            want.labels.pop(label, None)
                    self.overridden.append((topo.node, info.index, label, theirs))
                    log.warning("%s/%d: %s set to %r by someone else; left so", topo.node, info.index, label, theirs)


class LabelGate:
    """A :class:`fleetpilot.executor.LifecycleHook` that refuses assigns and migrations to
    GPUs labelled ``cordoned`` or ``decommissioned``: the labels outlive any replica, so a
    replica started after the cordon refuses them too (its own hook state starts empty)."""

    def __init__(self, labels: FleetLabels) -> None:
        """Read labels from ``labels``."""
        self._labels = labels

    async def before_assign(self, decision: DecisionMade) -> HookVerdict:
        """Refuse a placement on a labelled GPU."""
        for p in decision.placement:
            if p.gpu < 0:
                continue
            labels = self._labels.labels_of(p.node, p.gpu)
            for label in (DECOMMISSIONED, CORDONED):
                if labels.get(label) == "true":
                    return HookVerdict(allow=False, reason=f"{p.node}/{p.gpu} is labelled {label}")
        return ALLOW

    async def after_finish(self, event: TaskLifecycle) -> None:
        """Nothing to do."""

    async def pre_decommission(self, node: str, gpu: int, running_tasks: Sequence[str]) -> HookVerdict:
        """Not this gate's business."""
        return ALLOW
