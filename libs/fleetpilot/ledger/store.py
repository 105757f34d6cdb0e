"""The ledger and the fleet topology as a service sees them: KV buckets kept in memory by
watchers, and compare-and-set writes that retry on conflict. A node's ledger value that does
not decode is rebuilt from what is known of it and written over (``LedgerStore.rebuilt``),
never left to fail every write of the node."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import string
from collections.abc import Callable
from typing import ClassVar, Self

import msgspec

from fleetpilot.contracts import Allocation, NodeLedger, NodeTopology, encode
from fleetpilot.runtime import Bus, CasConflict, KeyValue, KvEntry

log = logging.getLogger("fleetpilot.ledger")

_LEDGER = msgspec.json.Decoder(NodeLedger)
_NODE = msgspec.json.Decoder(NodeTopology)


class _LedgerParts(msgspec.Struct):
    """A ledger value read hold by hold: what is left of one that does not decode whole. The
    node is required: a document without it is not a ledger, whatever else it holds."""

    node: str
    allocations: list[msgspec.Raw] = []


_PARTS = msgspec.json.Decoder(_LedgerParts)
_ALLOCATION = msgspec.json.Decoder(Allocation)
_UNREADABLE = (msgspec.DecodeError, msgspec.ValidationError)
_SHOWN_BYTES = 4096


class BucketMirror:
    """A bucket kept in memory: loaded at open, then followed by a watcher.

    ``nodes`` maps each KV key to its decoded record; ``version`` counts the changes seen
    and ``changed`` is set on each, so a waiting service can wake up. ``changed_at`` maps
    each key (deleted ones too) to the ``version`` of its last change, so that a view derived
    from the mirror can redo only the keys changed since it last looked.
    ``revisions`` maps each key to the bucket revision the view holds of it.
    """

    bucket: ClassVar[str]
    decoder: ClassVar[msgspec.json.Decoder]

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self.nodes: dict = {}
        self.version = 0
        self.changed_at: dict[str, int] = {}
        self.revisions: dict[str, int] = {}
        # The last revision of each key the bucket itself brought (the load, the watch), as
        # opposed to a write of our own shown at once: how far the watch has caught up.
        self._brought: dict[str, int] = {}
        self.changed = asyncio.Event()

    @classmethod
    async def open(cls, bus: Bus) -> Self:
        """Load every key of the bucket."""
        mirror = cls(await bus.kv(cls.bucket))
        for key in await mirror._kv.keys():
            entry = await mirror._kv.get(key)
            mirror._apply(key, entry.value if entry else None, entry.revision if entry else 0)
        return mirror

    def _apply(self, key: str, value: bytes | None, revision: int = 0) -> None:
        # What the watch brings is taken as it comes, older revisions too: a server that lost
        # its store numbers its writes from 1 again. One exception: a revision older than a
        # write of our own the view already shows, while the watch is still moving forward
        # from where it was, is the watch catching up to that write (the reply to it came
        # first); taken, it would show the node without our reservation until the watch
        # brings our write, and the next decision would take the same space again (a CAS
        # keeps it from being taken twice, but each such choice is lost). A watch that goes
        # back (a bucket renumbered from 1, unless its revision lands right between the two,
        # which the key's next write corrects) or a deletion it cannot date (revision 0: a
        # key gone after a reconnect) is taken.
        brought = self._brought.get(key, 0)
        self._brought[key] = revision
        if 0 < revision < self.revisions.get(key, 0) and revision >= brought:
            return
        self.revisions[key] = revision
        if value is None:
            self.nodes.pop(key, None)
        else:
            try:
                self.nodes[key] = self.decoder.decode(value)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                # One unreadable value (a hand edit, a writer of another version) must not
                # stop the view following every other key; the last readable one stays.
                log.error("%s bucket: %s is unreadable (%s); keeping what was read before", self.bucket, key, exc)
                return
        self._changed(key)

    def changed_since(self, version: int) -> list[str]:
        """The keys (deleted ones too) changed after the mirror's ``version`` was ``version``."""
        return [key for key, at in self.changed_at.items() if at > version]

    def _changed(self, key: str) -> None:
        """Count a change of ``key`` and wake whoever waits for one."""
        self.version += 1
        self.changed_at[key] = self.version
        self.changed.set()

    async def follow(self) -> None:
        """Keep the view current (run as a background task)."""
        async for entry in self._kv.watch(">"):
            self._apply(entry.key, entry.value, entry.revision)


class LedgerStore(BucketMirror):
    """A live view of the ``ledger`` bucket plus CAS writes.

    Writers never trust the view: ``mutate`` reads the key's current revision, applies a
    pure change and writes with compare-and-set, retrying on conflict. The view is for
    deciding; the CAS is for committing.
    """

    bucket = "ledger"
    decoder = _LEDGER
    nodes: dict[str, NodeLedger]

    def __init__(self, kv: KeyValue) -> None:
        super().__init__(kv)
        # The unreadable value last reported per key, by revision: said once, not per attempt.
        self._reported: dict[str, int] = {}

    async def read(self, node: str) -> NodeLedger | None:
        """The node's ledger as stored now, not as the view last saw it (rebuilt, when the
        stored value does not decode, as ``mutate`` would: ``rebuilt``)."""
        key = node_key(node)
        return self.decoded(key, await self._kv.get(key))

    def decoded(self, key: str, entry: KvEntry | None) -> NodeLedger | None:
        """The ledger a bucket entry of ``key`` holds (``None`` for none); one that does not
        decode is ``rebuilt``, never raised: every reader of the bucket goes through here."""
        if entry is None or not entry.value:
            return None
        try:
            return _LEDGER.decode(entry.value)
        except _UNREADABLE as exc:
            return self.rebuilt(key, entry, exc)

    def rebuilt(self, key: str, entry: KvEntry, exc: Exception) -> NodeLedger | None:
        """The ledger of ``key`` when its stored value does not decode: taken as lost, and
        rebuilt from what is known of it. ``None`` when nothing is (the node holds nothing
        then, as far as this process can tell).

        Why not refuse, or stop: the value was raising in every write of the node, for ever.
        The executor's confirmations and releases of every task there went to the dead letters
        (capacity held by nobody), a placement that chose the node failed its handler, and a
        retry round that chose it stopped there, every round, holding up the whole queue. An
        operator finds out from the log below, not from a node that silently stopped taking
        work. Why rebuild rather than start the node afresh: a hold forgotten lets a GPU be
        booked twice, and the running task on it dies of OOM; a hold kept too long only costs
        capacity until its task ends or its reservation expires. So what is known is kept, in
        this order: every hold of the value that still decodes on its own (the newest truth:
        a writer of another version may have changed only one), then, when the value lost any
        (a hold that does not decode, a document that is not a ledger), the holds of the view's
        last readable value on GPUs the value no longer accounts for. The value itself goes to
        the log with its key and revision, and stays in the bucket's history (five revisions)
        for a hand repair; the write that replaces it is a compare-and-set on that revision."""
        known = self.nodes.get(key)
        try:
            parts = _PARTS.decode(entry.value)
        except _UNREADABLE:
            parts = None
        kept: list[Allocation] = []
        lost = parts is None
        for raw in parts.allocations if parts is not None else ():
            try:
                kept.append(_ALLOCATION.decode(raw))
            except _UNREADABLE:
                lost = True
        if lost and known is not None:
            accounted = {(a.task_id, a.gpu) for a in kept}
            kept += [a for a in known.allocations if (a.task_id, a.gpu) not in accounted]
        node = parts.node if parts is not None else known.node if known is not None else None
        ledger = NodeLedger(node=node, allocations=kept) if node is not None else None
        if self._reported.get(key) != entry.revision:
            self._reported[key] = entry.revision
            log.error(
                "ledger %s: revision %d does not decode (%s); taken as lost and rebuilt from %s, holding %s. "
                "The value was: %r", key, entry.revision, exc,
                "nothing known (this process never read it)" if ledger is None
                else "its readable holds" + (" and the last value read" if lost and known is not None else ""),
                sorted({(a.task_id, a.gpu) for a in ledger.allocations}) if ledger is not None else "nothing",
                entry.value[:_SHOWN_BYTES])
        return ledger

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
            # A value that does not decode is rebuilt (``rebuilt``), not raised: raised, it
            # failed every later write of the node for ever.
            current = self.decoded(node, entry)
            updated = change(current)
            if updated is None:
                return None
            try:
                if entry is None:
                    written = await self._kv.create(node, encode(updated))
                else:
                    written = await self._kv.update(node, encode(updated), entry.revision)
            except CasConflict:
                await asyncio.sleep(0.001 * (attempt + 1))
                continue
            # The view shows our write at once (the next decision must not take the same
            # space), unless the watch already brought a later one: the reply to a write may
            # come after the watch's next entry, and the older ledger then stayed in the view
            # until the node's next change. It is counted as a change like any other: views
            # built on this one (the policy's kept snapshot) redo only the keys changed since
            # they last looked, and without it they missed our own reservation until the
            # watch brought it back.
            if written > self.revisions.get(node, 0):
                self.nodes[node] = updated
                self.revisions[node] = written
                self._changed(node)
            return updated
        raise CasConflict(f"ledger of {node} kept changing under us")


class FleetView(BucketMirror):
    """A live view of the ``topology`` bucket: every node the fleet has reported."""

    bucket = "topology"
    decoder = _NODE
    nodes: dict[str, NodeTopology]


# Characters a key keeps as they are. ``=`` is a valid key character too, but it is the
# escape: a name's own ``=`` is escaped like any other character, so that no two names share
# a key.
_KEY_CHARACTERS = frozenset(string.ascii_letters + string.digits + "-_/.")

KEY_LIMIT = 1024
"""The longest key ``node_key`` returns. A key goes into the subject of every KV operation
(``$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>`` plus a reply inbox), and the server
closes a connection whose control line passes 4 KiB; a kilobyte leaves room for the rest."""


def node_key(node: str) -> str:
    """KV keys allow ASCII letters, digits and ``-_=/.``, with no empty token between dots;
    node names (and task and decision ids, which clients choose) are mapped onto that set,
    one name to one key. A name that is a valid key without ``=`` is its own key; any other
    character, ``=`` itself and a dot that would make an empty token become ``=`` and the
    two hex digits of each of their UTF-8 bytes (``évaluation-1`` is ``=C3=A9valuation-1``);
    the empty name is ``=``.

    Each character that no key allows became ``_``: ``job:1`` and ``job_1`` (or ``évaluation``
    and ``_valuation``) shared one key, so a second task's pending entry or contract was
    refused as already there, or read as the first task's, and two such nodes shared one
    ledger. ``str.isalnum`` before that let any Unicode letter or digit through (``é``,
    ``²``), which the client refuses as a key; a dot at either end or two in a row make an
    empty subject token, which the server never answers.

    A key longer than ``KEY_LIMIT`` keeps its beginning and ends in ``=_`` and the SHA-256 of
    the name (``=`` is otherwise always followed by two hex digits, so no shorter name's key
    can end so). Left whole, a client's task id of some 1400 characters that each take three
    made a key whose subject the server answered by closing the connection: every service on
    it cut off, and again on each redelivery."""
    if _ITS_OWN_KEY.fullmatch(node) and len(node) <= KEY_LIMIT:
        # The common case, at a dict lookup's cost: an executor covering the openb fleet asks
        # for a node's key twice per GPU sample, 12,000 times a second, and the escaping
        # below took 7.5 µs a name (a fifth of its time on telemetry).
        return node
    return _escaped_key(node)


_ITS_OWN_KEY = re.compile(r"[A-Za-z0-9_/-]+(?:\.[A-Za-z0-9_/-]+)*")
"""A name that is its own key: only characters a key keeps, and no dot at either end or
next to another (``node_key``)."""


def _escaped_key(node: str) -> str:
    """``node_key`` of any name, one character at a time."""
    if not node:
        return "="
    out = []
    for i, c in enumerate(node):
        literal = c in _KEY_CHARACTERS and (c != "." or (
            0 < i < len(node) - 1 and out[-1] != "." and node[i + 1] != "."))
        out.append(c if literal else "".join(f"={b:02X}" for b in c.encode("utf-8", "surrogatepass")))
    key = "".join(out)
    if len(key) <= KEY_LIMIT:
        return key
    digest = hashlib.sha256(node.encode("utf-8", "surrogatepass")).hexdigest()
    # The cut may end in a dot: the ``=`` after it keeps the token between dots non-empty.
    return f"{key[:KEY_LIMIT - len(digest) - 2]}=_{digest}"


__all__ = ["KEY_LIMIT", "FleetView", "LedgerStore", "node_key"]
