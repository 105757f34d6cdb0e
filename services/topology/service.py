"""The topology service: one truth about what the fleet is made of.

It consumes ``topology.report.<node>`` from collectors, keeps each node in the
``topology`` bucket (the source every other service reads) and publishes
``topology.updated`` with the changed nodes and the inter-site bandwidth estimates.

It also tells when a node has gone silent, in two steps, as Kubernetes does with a node
that stops posting its status: a node whose collector sent no report for ``not_ready_after_s``
has every GPU labelled ``not_ready`` (no new work goes there; its tasks are still taken as
running), and one silent for ``silent_after_s`` is labelled ``unreachable`` instead (the
executor gives its tasks up). The label goes when the node reports again. A node given up
``forget_after_s`` ago (off by default) is forgotten: its key leaves the bucket.

The estimates come from the configured fleet's site links (``SiteNetwork`` in
``fleetpilot.fleet.bandwidth``), computed once at start: links are configuration, not
telemetry, so they do not change while the service runs.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import NamedTuple

import msgspec
from fleetpilot.contracts import (
    GPU_LABEL_NOT_READY,
    GPU_LABEL_UNREACHABLE,
    NODE_LABEL_UNREACHABLE_SINCE,
    OPERATIONAL_GPU_LABELS,
    Allocation,
    BandwidthEstimate,
    ExecutorPresence,
    GpuInfo,
    NodeLedger,
    NodeTopology,
    TopologyReport,
    TopologyUpdated,
    encode,
    marked_condition,
    now,
    subject_for,
    unreachable_since,
)
from fleetpilot.fleet.bandwidth import SiteNetwork
from fleetpilot.fleet.inventory import Fleet, load_fleet_spec, load_openb_fleet, read_fleet_json
from fleetpilot.fleet.topology import topology_problem
from fleetpilot.ledger.store import node_key
from fleetpilot.runtime import (
    Bus,
    CasConflict,
    Delivery,
    KeyValue,
    Reject,
    ServiceHost,
    ServiceSettings,
    serve,
)
from prometheus_client import Gauge
from pydantic import model_validator
from pydantic_settings import SettingsConfigDict

log = logging.getLogger("fleetpilot.topology")
_PRESENCE = msgspec.json.Decoder(ExecutorPresence)

# ``fleet_spec`` value that means "no inter-site links known" (a single-site deployment).
NO_SPEC = "none"


class TopologySettings(ServiceSettings):
    """``FLEETPILOT_TOPOLOGY_*``.

    ``fleet_spec`` is a YAML spec or a ``topology.json``; empty means the shipped three-site
    spec (the simulated fleet's default, so ``fleetpilot up`` needs no setting) and ``none``
    means no site links. ``openb_nodes`` (the openb CSV) takes precedence: one site, no links.
    """

    model_config = SettingsConfigDict(env_prefix="FLEETPILOT_TOPOLOGY_", extra="ignore")

    fleet_spec: str = ""
    openb_nodes: str = ""
    # A node whose collector sent no report for this long (it re-reports every 30 s) takes no
    # new work (three reports missed), and then is given up; judged every ``liveness_check_s``.
    not_ready_after_s: float = 90.0
    silent_after_s: float = 300.0
    liveness_check_s: float = 30.0
    # A node whose executor's key in the ``executors`` bucket has not changed for this long
    # (its executor rewrites it every 15 s) takes no new work either: its collector reports,
    # but nobody is there to carry decisions out. Nodes whose executor never wrote one (the
    # simulated fleet's single executor) are not judged by it.
    executor_silent_after_s: float = 60.0
    # A node unreachable for this long (counted from ``unreachable_since``) is forgotten: its
    # key, labels and all, leaves the bucket, and its executor's key the ``executors`` one.
    # 0: never (``fleetpilot fleet forget`` does it by hand). Off by default: a node repaired
    # after that comes back without its cordons and pins.
    forget_after_s: float = 0.0

    @model_validator(mode="after")
    def _not_ready_before_lost(self) -> TopologySettings:
        if not 0 < self.not_ready_after_s <= self.silent_after_s:
            raise ValueError(f"not_ready_after_s ({self.not_ready_after_s:g}) must be above 0 and at most "
                             f"silent_after_s ({self.silent_after_s:g})")
        # 0 (meant as "off") had the check run back to back, each asking the server about
        # every node: a busy loop against NATS, not a check turned off.
        if not (0 < self.liveness_check_s and math.isfinite(self.liveness_check_s)):
            raise ValueError(f"liveness_check_s ({self.liveness_check_s:g}) must be a number of seconds above 0")
        if not (0 < self.executor_silent_after_s and math.isfinite(self.executor_silent_after_s)):
            raise ValueError(f"executor_silent_after_s ({self.executor_silent_after_s:g}) must be a number of "
                             "seconds above 0")
        if not (0 <= self.forget_after_s and math.isfinite(self.forget_after_s)):
            raise ValueError(f"forget_after_s ({self.forget_after_s:g}) must be a number of seconds, or 0 (never "
                             "forget a node)")
        return self


class BadFleetConfig(ValueError):
    """The configured fleet spec cannot be read."""


def configured_fleet(settings: TopologySettings) -> Fleet:
    """The fleet whose site links the estimates are computed from."""
    try:
        if settings.openb_nodes:
            return load_openb_fleet(settings.openb_nodes)
        if settings.fleet_spec.lower() == NO_SPEC:
            return Fleet()
        if settings.fleet_spec.endswith(".json"):
            return read_fleet_json(settings.fleet_spec)
        return load_fleet_spec(Path(settings.fleet_spec)) if settings.fleet_spec else load_fleet_spec()
    except (OSError, ValueError, KeyError, LookupError, msgspec.DecodeError) as exc:
        raise BadFleetConfig(f"cannot load the fleet spec: {exc}") from None


def bandwidth_estimates(settings: TopologySettings) -> list[BandwidthEstimate]:
    """Inter-site bandwidth for every site pair and multipath strategy from the fleet's links."""
    return SiteNetwork(configured_fleet(settings).links).estimates()


MAX_GPUS_PER_NODE = 128
"""More GPUs than this in one report is no node: every policy replica sizes its fleet arrays
by the largest node (a GPU-by-GPU link matrix per node), so one report of thousands would
take its memory."""

MAX_GPU_MEMORY_MB = 4 * 1024 * 1024
"""4 TiB, over ten times the largest GPU made: more is a unit mistake (bytes or KiB reported
as MB), and above 2**31 it overflowed the policy's per-GPU memory, stopping every decision."""

MAX_NODE_AMOUNT = 2**63 - 1
"""A node's CPU milli and host memory are kept as 64-bit integers by the policy."""


def report_problem(report: TopologyReport, subject: str) -> str | None:
    """What makes a report unfit for the bucket beyond ``topology_problem``, or ``None``.

    - It came on a subject that does not name its node: silence is judged on
      ``topology.report.<node>``, so a node whose collector publishes under another name
      (``ip-10-0-3-7_ec2_internal`` for ``ip-10-0-3-7.ec2.internal``) was heard on a subject
      nobody watched, taken for silent while it reported on, and its tasks given up.
    - Its GPU indices are not 0 to n-1: the ledger and the policies address a GPU by its
      index as a position, so a gap charged one GPU's holds to another.
    - A size no consumer can hold (see ``MAX_GPUS_PER_NODE``, ``MAX_GPU_MEMORY_MB``).
    """
    node = report.node
    expected = subject_for(report)
    if subject and subject != expected:
        return f"came on {subject}, but the node it describes reports on {expected}"
    if len(node.gpus) > MAX_GPUS_PER_NODE:
        return f"{len(node.gpus)} GPUs, more than the {MAX_GPUS_PER_NODE} a node may list"
    missing = sorted(set(range(len(node.gpus))) - {g.index for g in node.gpus})
    if missing:
        return f"GPU indices must run from 0 to {len(node.gpus) - 1}; missing {missing}"
    for gpu in node.gpus:
        if gpu.memory_mb > MAX_GPU_MEMORY_MB:
            return f"GPU {gpu.index} has {gpu.memory_mb} MB, more than {MAX_GPU_MEMORY_MB} (memory not in MB?)"
        if gpu.numa_node is not None and not -(2**31) <= gpu.numa_node < 2**31:
            return f"GPU {gpu.index} has NUMA node {gpu.numa_node}"
    for name in ("cpu_milli", "memory_mb"):
        amount = getattr(node, name)
        if not 0 <= amount <= MAX_NODE_AMOUNT:
            return f"{name} {amount} is not between 0 and {MAX_NODE_AMOUNT}"
    return None


def in_index_order(node: NodeTopology) -> NodeTopology:
    """``node`` with its GPUs listed by index, which every consumer takes as their order."""
    if all(g.index == i for i, g in enumerate(node.gpus)):
        return node
    return msgspec.structs.replace(node, gpus=sorted(node.gpus, key=lambda g: g.index))


def with_operational_labels(reported: NodeTopology, stored: NodeTopology | None) -> NodeTopology:
    """``reported`` carrying over the operational labels (cordoned, maintenance...) of ``stored``.

    The node conditions (``not_ready``, ``unreachable``) come from ``stored`` alone, never
    from a report: this service sets them from the node's silence. A collector that sends
    back what the bucket held (a read-modify-write of its own) re-sent ``unreachable`` after
    the node came back; stored again, it had the executor give up the tasks of a node
    reporting on, and the next check lifted it again, at every report.

    Labels follow the GPU, by its UUID where both reports name one, by index otherwise: a
    node that lost a GPU (off the bus, pulled) is numbered 0 to n-1 again, and by index alone
    the cordon of the GPU that was 3 went to the one that was 2 and its own was lost, while a
    GPU gone left its driver pin and role on its neighbour."""
    gpus_then = stored.gpus if stored is not None else []
    by_uuid = {g.uuid: g for g in gpus_then if g.uuid}
    by_index = {g.index: g for g in gpus_then}

    def kept(gpu: GpuInfo) -> dict[str, str]:
        then = by_uuid.get(gpu.uuid) if gpu.uuid else None
        if then is None:
            then = by_index.get(gpu.index)
            if then is not None and gpu.uuid and then.uuid:
                return {}  # another GPU than the one this index named before
        return {k: v for k, v in then.labels.items() if k in OPERATIONAL_GPU_LABELS} if then is not None else {}

    # The node's condition goes on every GPU, one new in this report included: carried GPU
    # by GPU, a replaced or added GPU of a node `not_ready` or `unreachable` came in without
    # it, and took new work (placed by the GPU's labels) until the next check.
    condition = marked_condition(stored) if stored is not None else ""
    gpus = [msgspec.structs.replace(g, labels={
        **{k: v for k, v in g.labels.items() if k not in NODE_CONDITION_LABELS},
        **{k: v for k, v in kept(g).items() if k not in NODE_CONDITION_LABELS},
        **({condition: "true"} if condition else {})})
            for g in reported.gpus]
    # The node's own labels carry its condition too (a node without GPUs has nowhere else),
    # from ``stored`` alone as on the GPUs.
    labels = {**{k: v for k, v in reported.labels.items() if k not in NODE_CONDITION_LABELS},
              **({k: v for k, v in stored.labels.items() if k in NODE_CONDITION_LABELS} if stored is not None else {})}
    if gpus == reported.gpus and labels == reported.labels:
        return reported
    return msgspec.structs.replace(reported, gpus=gpus, labels=labels)


class ReportPlace(msgspec.Struct, frozen=True, kw_only=True):
    """Where the topology stream keeps a report and when it stored it (the server's clock):
    which of two reports of one node is the newer. Either may be unknown (``None``)."""

    sequence: int | None = None
    stored_at: float | None = None

    @classmethod
    def of(cls, delivery: Delivery) -> ReportPlace | None:
        """The place of the report ``delivery`` hands over; ``None`` when nothing is known."""
        if delivery.stream_seq is None and delivery.stored_at is None:
            return None
        return cls(sequence=delivery.stream_seq, stored_at=delivery.stored_at)


class KeptNode(NodeTopology, frozen=True, kw_only=True):
    """A node as this service writes it to the bucket: the node, and the place of the report
    it was written from in a member of its own (``applied_report``).

    Every reader decodes the value as a ``NodeTopology``, which ignores that member: what
    they read is unchanged, and a value written before it reads as a node whose report's
    place is unknown. The executor's label writes keep it (they change the GPUs' labels and
    nothing else of the stored value).
    """

    applied_report: ReportPlace | None = None


class _AppliedReport(msgspec.Struct):
    """The one member of a stored value that says which report wrote it."""

    applied_report: ReportPlace | None = None


def applied_report(value: bytes | None) -> ReportPlace | None:
    """The place of the report a stored value was written from (``None``: not known, or a
    value that does not decode)."""
    if not value:
        return None
    try:
        return msgspec.json.decode(value, type=_AppliedReport).applied_report
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def kept_value(node: NodeTopology, place: ReportPlace | None) -> bytes:
    """The bucket value of ``node`` written from the report at ``place``."""
    if place is None:
        return encode(node)
    return encode(KeptNode(**msgspec.structs.asdict(node), applied_report=place))


def superseded(report: ReportPlace, applied: ReportPlace) -> bool:
    """Whether the report at ``report`` is older than the one at ``applied`` (of one node).

    The stream's sequence decides: it grows with every message stored. A lower one stored
    later by the server's clock is no older report, but a stream made again (a server that
    lost its store numbers from 1 again): taken as older, the node would take no report until
    the new numbers passed the old. Only where a sequence is unknown does the stored time
    decide alone. Nothing known on either side: not older (as before the places were kept).
    """
    if report.sequence is not None and applied.sequence is not None:
        if report.sequence >= applied.sequence:
            return False  # the same report again (its write is a no-op) or a newer one
        return not (report.stored_at is not None and applied.stored_at is not None
                    and report.stored_at > applied.stored_at)
    if report.stored_at is not None and applied.stored_at is not None:
        return report.stored_at < applied.stored_at
    return False


class StoredNode(NamedTuple):
    """Where a report left its node in the ``topology`` bucket."""

    revision: int
    """The bucket revision that holds the node as reported."""
    written: bool
    """Whether this report wrote it (``False``: the bucket held it already)."""
    superseded: bool = False
    """Whether the bucket holds the node as a newer report left it, which this one, older,
    did not replace (then ``written`` is ``False``)."""


async def write_keeping_operational_labels(kv: KeyValue, node: NodeTopology, attempts: int = 10,
                                           place: ReportPlace | None = None) -> StoredNode:
    """Write a reported node with compare-and-set so that a label the executor sets at the
    same moment is neither lost nor overwritten; ``written`` is ``False`` when the bucket
    already holds what the node reports.

    The bucket, not what this replica last saw, says what is unchanged: replicas share the
    reports, and a report that undoes another replica's write looks unchanged to this one.

    ``place`` is where the stream keeps this report: the value keeps the place of the report
    it was written from, and a report older than that one (a late or redelivered one) leaves
    the value as it is (``superseded``), whichever replica wrote the newer. The compare-and-
    set makes the check and the write one step: a newer report written between them by
    another replica is read on the next attempt.
    """
    key = node_key(node.node)
    for _ in range(attempts):
        entry = await kv.get(key)
        stored = None
        if entry is not None and entry.value is not None:
            try:
                stored = msgspec.json.decode(entry.value, type=NodeTopology)
            except (msgspec.DecodeError, msgspec.ValidationError):
                stored = None
        applied = applied_report(entry.value) if entry is not None and stored is not None else None
        if entry is not None and place is not None and applied is not None and superseded(place, applied):
            return StoredNode(entry.revision, written=False, superseded=True)
        updated = with_operational_labels(node, stored)
        if updated == stored and entry is not None:
            # Not written again for the place alone: a write every 30 s per node would move
            # every bucket watcher. A newer report that changed nothing is told from the
            # stream instead (``on_report``).
            return StoredNode(entry.revision, written=False)
        # A report whose place is unknown keeps the place of the one before: still no older
        # report than that one replaces it.
        body = kept_value(updated, place if place is not None else applied)
        try:
            if entry is None:
                revision = await kv.create(key, body)
            else:
                revision = await kv.update(key, body, entry.revision)
            return StoredNode(revision, written=True)
        except CasConflict:
            continue
    raise CasConflict(f"topology of {node.node} kept changing")


async def stored_nodes(kv: KeyValue) -> list[NodeTopology]:
    """Every node in the ``topology`` bucket (an unreadable entry is logged and skipped:
    the node's next report rewrites it)."""
    out = []
    for key in await kv.keys():
        entry = await kv.get(key)
        if entry is None or entry.value is None:
            continue
        try:
            out.append(msgspec.json.decode(entry.value, type=NodeTopology))
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("topology bucket key %s does not hold a node topology; it will be rewritten", key)
    return out


READY = "ready"
"""A node condition: it reported within ``not_ready_after_s``."""
NOT_READY = GPU_LABEL_NOT_READY
UNREACHABLE = GPU_LABEL_UNREACHABLE
UNREACHABLE_SINCE = NODE_LABEL_UNREACHABLE_SINCE
NODE_CONDITION_LABELS = (NOT_READY, UNREACHABLE, UNREACHABLE_SINCE)


def node_condition(heard: float | None, kept_since: float | None, now: float, not_ready_after_s: float,
                   silent_after_s: float) -> str | None:
    """``READY``, ``NOT_READY`` or ``UNREACHABLE``, from when the stream stored the node's last
    report (``heard``) and how far back the stream keeps anything (``kept_since``); ``None``
    when that cannot be told.

    With no report kept, the node has been silent at least as long as the stream goes back.
    That is no proof of readiness: a large fleet's reports fill the stream's byte limit, and
    a node's last report may have been pushed out by the others' while the node reports on.
    """
    if heard is not None:
        silent_for = now - heard
    elif kept_since is not None and now - kept_since > not_ready_after_s:
        silent_for = now - kept_since
    else:
        return None
    if silent_for > silent_after_s:
        return UNREACHABLE
    return NOT_READY if silent_for > not_ready_after_s else READY


class Sightings:
    """When this replica first saw each server timestamp it reads (a node's last report, how
    far back the stream keeps anything), on its own clock.

    The stream stamps a report with the server's clock, and silence is that stamp's age on
    this replica's clock: a replica whose clock ran two minutes ahead of the server's saw
    every node silent for two minutes more, marked the whole fleet not ready, and at five
    gave every node's tasks up. :meth:`no_earlier_than_seen` moves a stamp up to when it
    was first seen here, so a silence is the lesser of the two readings: a clock ahead costs
    at most one check's delay in telling a silence; a clock behind delays it, as before.
    """

    def __init__(self) -> None:
        """No stamp seen yet."""
        self._seen: dict[str, tuple[float, float]] = {}

    def no_earlier_than_seen(self, key: str, stamp: float | None, now: float) -> float | None:
        """``stamp`` (server time) or, if later, when this replica first saw it as ``key``'s
        (``now`` on its clock, when it is new); ``None`` for no stamp."""
        if stamp is None:
            self._seen.pop(key, None)
            return None
        kept = self._seen.get(key)
        if kept is None or kept[0] != stamp:
            kept = self._seen[key] = (stamp, now)
        return max(stamp, kept[1])

    def keep_only(self, keys: set[str]) -> None:
        """Forget the stamps of keys no longer read (nodes gone from the bucket)."""
        for gone in self._seen.keys() - keys:
            del self._seen[gone]


class ExecutorSightings:
    """When this replica last saw each node's key in the ``executors`` bucket change, on its
    own clock: the executor's silence is how long the key has kept one revision here, so no
    clock but this replica's is read (an executor's clock may be anywhere), and a replica
    vouches only for a silence it listened through, as for the collectors' reports."""

    def __init__(self) -> None:
        """No key seen yet."""
        self._seen: dict[str, tuple[int, float]] = {}
        self._changed: set[str] = set()  # keys seen to change since this replica first read them

    def silent_for(self, node: str, revision: int | None, now: float) -> float | None:
        """How long ``node``'s key has held ``revision`` as this replica saw it; ``None`` when
        the node has no key (no executor of its own ever said it was there)."""
        if revision is None:
            self._seen.pop(node, None)
            self._changed.discard(node)
            return None
        kept = self._seen.get(node)
        if kept is None or kept[0] != revision:
            if kept is not None:
                self._changed.add(node)
            kept = self._seen[node] = (revision, now)
        return now - kept[1]

    def heard_change(self, node: str) -> bool:
        """Whether ``node``'s key has changed since this replica first read it: its executor
        is known to be there, whatever this replica has listened through."""
        return node in self._changed

    def keep_only(self, nodes: set[str]) -> None:
        """Forget the nodes no longer in the fleet."""
        for gone in self._seen.keys() - nodes:
            del self._seen[gone]
        self._changed &= nodes


def labelled_condition(node: NodeTopology) -> str:
    """The condition a node's labels say it is in (``READY`` without either label)."""
    return marked_condition(node) or READY


def with_condition(node: NodeTopology, condition: str, at: float | None = None) -> NodeTopology:
    """``node`` with its condition's label on the node and every GPU (none when ``READY``);
    given up, the node also says since when (``UNREACHABLE_SINCE``: ``at``, by default now,
    or the time it already holds when it was given up before).

    ``NOT_READY`` never lifts ``unreachable``: the executor has given that node's tasks up,
    and only a report of its own brings it back. A verdict of ``NOT_READY`` on a node already
    given up comes from a replica that has not listened long enough to tell more.
    """
    if condition == NOT_READY and labelled_condition(node) == UNREACHABLE:
        return node
    gpus = []
    for gpu in node.gpus:
        labels = {k: v for k, v in gpu.labels.items() if k not in NODE_CONDITION_LABELS}
        if condition != READY:
            labels[condition] = "true"
        gpus.append(msgspec.structs.replace(gpu, labels=labels))
    own = {k: v for k, v in node.labels.items() if k not in NODE_CONDITION_LABELS}
    if condition != READY:
        own[condition] = "true"
    if condition == UNREACHABLE:
        since = unreachable_since(node) if labelled_condition(node) == UNREACHABLE else None
        own[UNREACHABLE_SINCE] = f"{(now() if at is None else at) if since is None else since:.0f}"
    return msgspec.structs.replace(node, gpus=gpus, labels=own)


async def stored_node(kv: KeyValue, key: str) -> tuple[NodeTopology, int] | None:
    """The node the ``topology`` bucket holds at ``key`` and its revision (``None``: no such
    key, or a value that does not decode, which nothing here writes over)."""
    found = await _stored_entry(kv, key)
    return None if found is None else (found[0], found[1])


async def _stored_entry(kv: KeyValue, key: str) -> tuple[NodeTopology, int, ReportPlace | None] | None:
    """``stored_node`` with the place of the report the value was written from."""
    entry = await kv.get(key)
    if entry is None or entry.value is None:
        return None
    try:
        node = msgspec.json.decode(entry.value, type=NodeTopology)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return node, entry.revision, applied_report(entry.value)


async def mark_condition(kv: KeyValue, key: str, condition: str, attempts: int = 10) -> int | None:
    """Label (or unlabel) one node's GPUs with compare-and-set; the bucket revision written
    when it changed."""
    for _ in range(attempts):
        found = await _stored_entry(kv, key)
        if found is None:
            return None
        stored, revision, place = found
        updated = with_condition(stored, condition)
        if updated == stored:
            return None
        try:
            # The place of the report it holds stays: a mark is no report.
            return await kv.update(key, kept_value(updated, place), revision)
        except CasConflict:
            continue
    raise CasConflict(f"topology of {key} kept changing")


UNREADABLE_HOLD = "(a hold that does not decode)"
"""Stands in ``held_tasks`` for what the ledger holds on a node but cannot be read."""


class _LedgerHolds(msgspec.Struct):
    """A ledger value read hold by hold (``LedgerStore.rebuilt`` reads it so too)."""

    allocations: list[msgspec.Raw] = []


_UNDECODABLE = (msgspec.DecodeError, msgspec.ValidationError)


async def held_tasks(ledger: KeyValue, node: str) -> list[str]:
    """The tasks the ``ledger`` still holds on ``node``; what it holds there but cannot be
    read counts as ``UNREADABLE_HOLD``.

    A value that did not decode whole (one hold written by another version, a hand edit)
    read as holding nothing: the node was forgotten while its holds stayed, and the executor,
    which gives a node's tasks up only while the node is in the bucket, never released them.
    The executor's next write of the ledger rebuilds the value (``LedgerStore.rebuilt``)."""
    entry = await ledger.get(node_key(node))
    if entry is None or not entry.value:
        return []
    try:
        return sorted({a.task_id for a in msgspec.json.decode(entry.value, type=NodeLedger).allocations})
    except _UNDECODABLE:
        pass
    try:
        holds = msgspec.json.decode(entry.value, type=_LedgerHolds).allocations
    except _UNDECODABLE:
        return [UNREADABLE_HOLD]
    held: set[str] = set()
    for raw in holds:
        try:
            held.add(msgspec.json.decode(raw, type=Allocation).task_id)
        except _UNDECODABLE:
            held.add(UNREADABLE_HOLD)
    return sorted(held)


async def forget_given_up(kv: KeyValue, executors: KeyValue, node: str, since: float,
                          executor_revision: int | None) -> bool:
    """Delete a given-up node's key in the ``topology`` bucket, if it is still given up since
    ``since``, with compare-and-set (a node written meanwhile, by a report or a label, is
    left); and first its executor's key, if still at ``executor_revision``: left behind, its
    unchanged revision would judge the node, back under its name, silent from the start.
    Whether the node is forgotten now. Followers of the bucket see the delete."""
    key = node_key(node)
    found = await stored_node(kv, key)
    if found is None:
        return False
    stored, revision = found
    if labelled_condition(stored) != UNREACHABLE or unreachable_since(stored) != since:
        return False
    if executor_revision is not None:
        try:
            await executors.delete(key, revision=executor_revision)
        except CasConflict:
            pass  # it writes on: an executor is there, and its key keeps changing
    try:
        await kv.delete(key, revision=revision)
    except CasConflict:
        return False
    return True


def executor_trouble(value: bytes | None) -> str:
    """What a node's executor says is wrong with it in its ``executors`` key (empty for none,
    no key, or a value this service cannot read: silence alone judges that one)."""
    if not value:
        return ""
    try:
        return _PRESENCE.decode(value).trouble
    except msgspec.DecodeError:
        return ""


async def newer_report_stored(bus: Bus, delivery: Delivery) -> bool:
    """Whether the stream keeps a report on ``delivery``'s subject (one node's) stored after
    the one it hands over, both by the server's clock; ``False`` when that cannot be told.

    What the bucket's value says of the report that wrote it (``superseded``) misses a newer
    report that changed nothing, which writes nothing: a late report with a change of its own
    undid the node as that one left it. The stream keeps every report's time."""
    if delivery.stored_at is None or not delivery.subject:
        return False
    last = await bus.last_stored_at(delivery.subject)
    return last is not None and last > delivery.stored_at


def build(settings: TopologySettings | None = None) -> ServiceHost:
    """Wire the topology service; raises ``BadFleetConfig`` for an unreadable spec."""
    settings = settings or TopologySettings.from_environment()
    estimates = bandwidth_estimates(settings)
    host = ServiceHost("topology", settings)
    nodes_by_condition = Gauge("fleetpilot_topology_nodes", "Nodes by condition, as the last liveness check left them",
                               ["condition"], registry=host.metrics.registry)
    # An update's revision is the bucket revision of the write it announces (the latest, for
    # several): increasing, and unique across replicas, as its message id must be. A clock
    # and a per-process counter gave two replicas (or a replica and its restart) the same
    # one within a millisecond, and the stream dropped the second update as a duplicate.

    @host.on(TopologyReport, consumer="topology-reports")
    async def on_report(report: TopologyReport, delivery: Delivery) -> TopologyUpdated | None:
        node: NodeTopology = report.node
        problem = topology_problem(node) or report_problem(report, delivery.subject)
        if problem is not None:
            # To the dead letters with its reason, not into the bucket every policy reads.
            raise Reject(f"topology report of {node.node or 'a node'} from {report.source or 'a collector'}: {problem}")
        bus = host.bus
        assert bus is not None
        kv = await bus.kv("topology")
        place = ReportPlace.of(delivery)
        if await newer_report_stored(bus, delivery):
            # A late or redelivered report: a newer one of the node is in the stream, applied
            # already or to be. Written now, this one would undo it until the next report
            # (30 s), and the newer one, if it changed nothing, would not put it back.
            stored = StoredNode(0, written=False, superseded=True)
        else:
            stored = await write_keeping_operational_labels(kv, in_index_order(node), place=place)
        if stored.superseded:
            log.info("topology report of %s (stream sequence %s) not applied: a newer one of the node is stored",
                     node.node, delivery.stream_seq)
            if delivery.deliveries <= 1:
                return None
            # An earlier delivery of it may have written the node and failed to announce it;
            # the newer report, finding nothing changed, announced nothing: announce what the
            # bucket holds now (the stream drops it as a duplicate when it went out).
            entry = await kv.get(node_key(node.node))
            if entry is None:
                return None
            return TopologyUpdated(revision=entry.revision, nodes=[node.node], bandwidth=estimates, at=now())
        if not stored.written and delivery.deliveries <= 1:
            return None  # unchanged: collectors re-send periodically for late joiners
        # Written now, or by an earlier delivery of this report whose update may not have
        # gone out (its publish failed): announced under the same revision, which the
        # stream drops as a duplicate when it did.
        return TopologyUpdated(revision=stored.revision, nodes=[node.node], bandwidth=estimates, at=now())

    started = {"at": now()}
    sightings = Sightings()
    executor_sightings = ExecutorSightings()

    told_held: set[str] = set()  # nodes whose held tasks have kept them from being forgotten, said once

    async def forget(node: NodeTopology, stamp: float | None, since: float, executor_revision: int | None) -> bool:
        """Forget a node given up ``forget_after_s`` ago; whether it is gone now."""
        bus = host.bus
        assert bus is not None
        if await bus.last_stored_at(f"topology.report.{node.node}") != stamp:
            return False  # it reported since its stamp was read: the next check lifts the mark
        held = await held_tasks(await bus.kv("ledger"), node.node)
        if held:
            # The executor gives an unreachable node's tasks up only while the node is in the
            # bucket: forgotten now, they would be held for ever, never placed again.
            if node.node not in told_held:
                told_held.add(node.node)
                log.warning("%s unreachable for %.0f s, but not forgotten: the ledger still holds %d task(s) there "
                            "(%s); is an executor running?", node.node, now() - since, len(held), ", ".join(held[:5]))
            return False
        told_held.discard(node.node)
        if not await forget_given_up(await bus.kv("topology"), await bus.kv("executors"), node.node, since,
                                     executor_revision):
            return False
        log.warning("%s forgotten: unreachable for %.0f s (FORGET_AFTER_S %.0f); its topology, labels included, "
                    "and its executor's key are removed; a report of it is a new node", node.node, now() - since,
                    settings.forget_after_s)
        return True

    async def listening_since(bus: Bus) -> None:
        # Every known node's last report is read now, before listening is counted: first
        # read by the first check (one ``liveness_check_s`` later), a report older than this
        # replica counted as heard then, and once listened through ``not_ready_after_s`` a
        # node silent all along read as heard within it: ``ready``, its `unreachable` (set by
        # the replica before) or another replica's `not_ready` lifted with no report.
        for node in await stored_nodes(await bus.kv("topology")):
            subject = f"topology.report.{node.node}"
            sightings.no_earlier_than_seen(subject, await bus.last_stored_at(subject), now())
        started["at"] = now()

    host.on_startup(listening_since)

    @host.every(settings.liveness_check_s)
    async def judge_liveness() -> TopologyUpdated | None:
        # A collector re-reports its node every 30 s; the stream keeps the last report per
        # node, stamped by the server's clock, read no earlier than this replica saw it
        # (``Sightings``: a replica's clock ahead of the server's silenced every node). A replica vouches only
        # for a silence it listened through itself: after an outage of the whole fleet (or of
        # the NATS cluster) every last report is old, and nobody is silent yet. So it judges
        # nothing before ``not_ready_after_s``, and gives no node up before ``silent_after_s``.
        bus = host.bus
        if bus is None:
            return None
        listened = now() - started["at"]
        kv = await bus.kv("topology")
        executors = await bus.kv("executors")
        nodes = await stored_nodes(kv)
        # Read from the start, judged only once listened long enough: the stamps' sightings
        # (``Sightings``) then date from this replica's start, not from its first judgement.
        stamps = []
        for node in nodes:
            subject = f"topology.report.{node.node}"
            stamp = await bus.last_stored_at(subject)
            heard = sightings.no_earlier_than_seen(subject, stamp, now())
            # How far back the stream goes stays the server's reading: it moves on as the stream
            # rolls, and each new first message seen anew would read as no time kept at all.
            kept_since = await bus.first_stored_at(subject) if heard is None else None
            presence = await executors.get(node_key(node.node))
            executor_silent = executor_sightings.silent_for(
                node.node, presence.revision if presence is not None and presence.value else None, now())
            trouble = executor_trouble(presence.value if presence is not None else None)
            stamps.append((node, stamp, heard, kept_since, executor_silent, trouble,
                           presence.revision if presence is not None and presence.value else None))
        sightings.keep_only({f"topology.report.{n.node}" for n in nodes})
        executor_sightings.keep_only({n.node for n in nodes})
        told_held.intersection_update(n.node for n in nodes if labelled_condition(n) == UNREACHABLE)
        # The collectors' silences are judged once listened through ``not_ready_after_s``; an
        # executor's, once its key has kept one revision longer than its own limit here. A
        # node back in service is told only once both can be judged: before, this replica
        # cannot tell whose silence its label was.
        judge_reports = listened >= settings.not_ready_after_s
        changed: list[str] = []
        written: list[int] = []
        counts = dict.fromkeys((READY, NOT_READY, UNREACHABLE), 0)
        for node, stamp, heard, kept_since, executor_silent, trouble, executor_revision in stamps:
            condition = (node_condition(heard, kept_since, now(), settings.not_ready_after_s, settings.silent_after_s)
                         if judge_reports else None)
            if (condition in (NOT_READY, UNREACHABLE) and labelled_condition(node) != condition
                    and await bus.last_stored_at(f"topology.report.{node.node}") != stamp):
                # It reported since its stamp was read (in a large fleet, seconds ago): its
                # silence is over, and a mark written now would outlive the report that ended
                # it until the next check (``unreachable``: its tasks given up meanwhile).
                condition = READY
            # Reporting, but its executor has stopped saying it is there, or says it cannot
            # start anything there: no new work (its tasks run on; the next executor of the
            # node gives back what it cannot follow).
            executor_gone = executor_silent is not None and executor_silent > settings.executor_silent_after_s
            if (executor_gone or trouble) and condition in (READY, None):
                condition = NOT_READY
            if (condition == READY and executor_silent is not None and not executor_sightings.heard_change(node.node)
                    and labelled_condition(node) != READY):
                # Whether its executor is there cannot be told yet: its key has not changed
                # since this replica first read it, and not for longer than its limit. A label
                # set for its silence (by another replica, or a run before this one) stays
                # until the key changes or the silence is told; lifted, it was set again a
                # moment later.
                condition = None
            if condition is None:
                counts[labelled_condition(node)] += 1
                continue  # the stream does not go back far enough to tell
            if condition == UNREACHABLE and listened < settings.silent_after_s:
                condition = NOT_READY
            since = unreachable_since(node) if labelled_condition(node) == UNREACHABLE else None
            if (condition == UNREACHABLE and since is not None and 0 < settings.forget_after_s < now() - since
                    and await forget(node, stamp, since, executor_revision)):
                continue
            counts[labelled_condition(with_condition(node, condition))] += 1
            revision = await mark_condition(kv, node_key(node.node), condition)
            if revision is not None:
                changed.append(node.node)
                written.append(revision)
                silence = f"{now() - heard:.0f} s" if heard is not None else "as long as the stream keeps"
                if condition == READY:
                    log.warning("%s reports again: back in service", node.node)
                elif condition == NOT_READY and trouble and (heard is None or now() - heard
                                                             <= settings.not_ready_after_s):
                    log.warning("%s not ready: its executor cannot start tasks there (%s); no new work goes there",
                                node.node, trouble)
                elif condition == NOT_READY and executor_gone and (heard is None or now() - heard
                                                                   <= settings.not_ready_after_s):
                    log.warning("%s not ready: its executor has not said it is there for %.0f s (is it running?); "
                                "no new work goes there", node.node, executor_silent)
                elif condition == NOT_READY:
                    log.warning("%s not ready: no report from its collector for %s; no new work goes there",
                                node.node, silence)
                else:
                    log.warning("%s unreachable: no report from its collector for %s; its tasks are given up",
                                node.node, silence)
        for condition, count in counts.items():
            nodes_by_condition.labels(condition).set(count)
        if not changed:
            return None
        return TopologyUpdated(revision=max(written), nodes=changed, bandwidth=estimates, at=now())

    return host


def main() -> None:
    """Console entry point ``fleetpilot-topology``; a bad spec is a one-line error, exit 2."""
    serve("topology", build, BadFleetConfig)
