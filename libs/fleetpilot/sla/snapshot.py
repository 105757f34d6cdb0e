"""The negotiator's picture of the live fleet, assembled from what the buckets say.

:func:`fleet_view` turns the topology bucket (nodes: GPU model, site, memory), the ledger
bucket (who holds which GPU share since when) and the agreed contracts (each holder's tier
and expected duration) into the :class:`fleetpilot.sla.FleetView` that ``negotiate()``
reads. It is pure, so a test can hand it plain records and check every number.

Per pool (one GPU model at one site); a GPU out of service (labelled cordoned,
decommissioned, pending maintenance or unreachable) is in the pool but is never free and
never frees, as the policy will place nothing there:

- ``free_gpus``: GPUs nobody holds any share of; ``free_milli``: the largest spare share on
  a GPU that is already shared (what a fractional request can still get without a free GPU).
- ``preemptible_gpus``: busy GPUs whose every holder runs under a ``best_effort`` contract;
  ``most_clearable_on_a_node``, the most one node has free or preemptible (what a vip's
  preemption can clear for it: its GPUs are all on one node).
  A holder without a known contract counts as guaranteed: never offer to preempt work we
  cannot prove is preemptible.
- ``reserved_gpus``: a headroom of ``reserve_fraction`` of the pool's GPUs (rounded up, at
  most the free ones) kept for guaranteed tiers; ``best_effort`` requests never see it.
- waiting: a task admitted on a pinned model and site that holds nothing in the ledger is
  either on its way to the policy or queued there; it is ahead of a new request if the
  policy's queue serves it first (``ahead_of``: a higher tier, or expected to end before
  the request would; a short task is not estimated behind a long one it will overtake).
  In the policy's order, each takes the pool's GPUs that free first (free ones,
  then the earliest completions), or sooner the idle ones a wide task ahead of it leaves
  until it starts, if its run ends by then (the policy backfills there), and, when its
  expected duration is known, gives them back
  once it has run (:func:`play_queue`), so a burst of submissions is not all promised the
  same GPUs, a queue shows as a wait, and a backlog deeper than the running tasks is a
  longer wait, not "no pool will free". (A contract is forgotten when its task ends, so
  nothing finished counts.)
- open offers: a counter-offer not yet answered and not past its ``valid_until`` holds the
  capacity of its *first* option (``held_option``) the same way, after the waiting
  admissions: while its client thinks it over, a burst of submissions is not all offered
  the GPU that option promises. The first option is the one most likely taken: the options
  are ranked by the negotiator's own preference (fewest relaxed terms, then the shortest
  wait, the lowest cost), ``fleetpilot submit --accept-offer`` and ``fleetpilot up`` accept
  it, and the benchmark models every submitter doing so. Holding every option would take
  up to ``max_options`` pools' GPUs for one task that will run on one of them, and push
  every later request to waits and refusals for capacity that is free. An offer holds
  nothing once declined, expired (by the clock, before the expiry job closes it) or
  accepted: accepted, its task is an admission on that option's model and site, counted
  as waiting above, and an offer whose task is already admitted is not counted again.
  Accepting another option than the first takes capacity nothing held for it: the sla
  service checks it against the fleet then (``option_lapsed``) and refuses it if taken.
- ``most_gpus_on_a_node``: the most GPUs of the pool one node has, in service or not (a
  task's GPUs are all on one node, and a GPU out of service now may be back); and
  ``node_shapes``, each node's GPUs of the pool with its CPU and host memory (a task's
  CPU and memory are on that node too), those no other node outdoes.
- ``completions``: when busy GPUs free up, from each holder's reservation time plus the
  ``expected_duration_s`` of its admitted task. A GPU frees when its *last* holder ends; a
  GPU with any holder of unknown duration never appears (no promise we cannot back). A run
  past its expected end frees in as long again as it has overrun, and no sooner than a
  tenth of its expected duration (``frees_in``), not "now".
- price and relative compute come from the GPU catalogue (relative to an A100-40GB, the
  device of ``reference_p95_ms``); an uncatalogued model gets ``default_price_per_gpu_hour``
  and relative compute 1.0.

Bandwidths: ``topology.updated`` carries inter-site estimates in Gbit/s per multipath
strategy; the negotiator wants GB/s per (data site, site) pair, in both directions.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from fleetpilot.contracts import (
    BandwidthEstimate,
    NodeLedger,
    NodeTopology,
    OfferOption,
    SlaOffer,
    TaskAdmitted,
    TaskSubmitted,
    in_service,
)
from fleetpilot.fleet.catalogue import UnknownGpuModel, gpu_model
from fleetpilot.policy.backfill import queue_key

from .fleet import FleetView, GpuPool, earliest_in_windows, node_frontier


@dataclass(frozen=True)
class SnapshotKnobs:
    """Settings of :func:`fleet_view` (the service fills them from ``FLEETPILOT_SLA_*``)."""

    reserve_fraction: float = 0.1
    local_bandwidth_gbps: float = 5.0
    default_bandwidth_gbps: float = 1.0
    reference_p95_ms: float = 50.0
    default_price_per_gpu_hour: float = 1.0
    # The policy's FLEETPILOT_POLICY_QUEUE_AGING: which waiting tasks the policy serves
    # before a new request (``fleet_view``'s ``ahead_of``) depends on it.
    queue_aging: float = 1.0


def _catalogue_terms(model: str, knobs: SnapshotKnobs) -> tuple[float, float, int]:
    """Price per GPU-hour, compute relative to an A100-40GB, and catalogue memory of ``model``."""
    try:
        entry = gpu_model(model)
    except UnknownGpuModel:
        return knobs.default_price_per_gpu_hour, 1.0, 0
    return entry.price_usd_per_hour, entry.compute_ratio, entry.memory_mb


# What an overrunning run is expected to need at least, as a share of its expected duration.
OVERRUN_FLOOR = 0.1


@dataclass
class _PoolTally:
    memory_mb: int = 0
    total: int = 0
    free: int = 0
    free_milli: int = 0
    preemptible: int = 0
    # (expected end, expected duration) of the holder that ends last, per busy GPU.
    frees_at: list[tuple[float, float]] = field(default_factory=list)
    most_on_a_node: int = 0
    # (GPUs of the pool, CPU milli, host memory MB) of each node.
    shapes: set[tuple[int, int, int]] = field(default_factory=set)
    # The most GPUs of the pool one node has free or running only best_effort work.
    most_clearable: int = 0

    def add(self, other: _PoolTally) -> None:
        """Fold another node's tally of the same pool into this one."""
        # A pool promises what its smallest GPU holds.
        self.memory_mb = other.memory_mb if self.total == 0 else min(self.memory_mb, other.memory_mb)
        self.total += other.total
        self.free += other.free
        self.free_milli = max(self.free_milli, other.free_milli)
        self.preemptible += other.preemptible
        self.frees_at.extend(other.frees_at)
        self.most_on_a_node = max(self.most_on_a_node, other.most_on_a_node)
        self.shapes |= other.shapes
        self.most_clearable = max(self.most_clearable, other.most_clearable)


NodeTallies = dict[tuple[str, str], _PoolTally]


def _node_tallies(node: NodeTopology, allocations: Iterable, admitted: Mapping[str, TaskAdmitted],
                  memory_of: dict[str, int], knobs: SnapshotKnobs) -> NodeTallies:
    """What one node adds to each of its pools (independent of the time: see ``frees_at``)."""
    per_gpu: dict[int, list] = defaultdict(list)
    for alloc in allocations:
        if alloc.gpu >= 0:
            per_gpu[alloc.gpu].append(alloc)
    tallies: NodeTallies = defaultdict(_PoolTally)
    for gpu in node.gpus:
        if gpu.model not in memory_of:
            memory_of[gpu.model] = _catalogue_terms(gpu.model, knobs)[2]
        tally = tallies[(node.site, gpu.model)]
        tally.add(_PoolTally(memory_mb=gpu.memory_mb or memory_of[gpu.model], total=1))
        if not in_service(gpu.labels):
            continue  # it exists, but is neither free nor ever freeing: nothing to promise
        holders = per_gpu.get(gpu.index, [])
        if not holders:
            tally.free += 1
            continue
        spare = 1000 - sum(a.milli for a in holders)
        if spare > 0:
            tally.free_milli = max(tally.free_milli, spare)
        contracts = [admitted.get(a.task_id) for a in holders]
        if all(c is not None and c.contract.tier == "best_effort" for c in contracts):
            tally.preemptible += 1
        # A moved run ends by when it began (``run_at``), not by when its hold here was taken.
        ends = [((a.run_at or a.at) + c.task.expected_duration_s, c.task.expected_duration_s)
                for a, c in zip(holders, contracts, strict=True)
                if c is not None and c.task.expected_duration_s is not None and a.at > 0]
        if len(ends) == len(holders):
            tally.frees_at.append(max(ends))
    for tally in tallies.values():
        # Every GPU it has, in service or not: a GPU out of service for now may be back.
        tally.most_on_a_node = tally.total
        tally.shapes = {(tally.total, node.cpu_milli, node.memory_mb)}
        tally.most_clearable = tally.free + tally.preemptible
    return tallies


def _fold_into(pools: NodeTallies, parts: NodeTallies) -> None:
    """Add each pool's tally of ``parts`` to ``pools``' (a ``defaultdict``)."""
    for pool, part in parts.items():
        pools[pool].add(part)


BLOCK_NODES = 32
"""How many consecutive nodes :class:`SnapshotCache` folds into one block's pools."""


@dataclass
class SnapshotCache:
    """Per-node tallies of the last :func:`fleet_view`, reused while a node's topology
    record, its ledger allocations and its holders' admissions are the very objects they
    were built from (the services' mirrors replace a record when it changes, never edit it);
    and, per block of ``BLOCK_NODES`` consecutive nodes, their tallies folded into pools,
    reused while every node's tallies in it were.

    On the openb fleet (1,213 nodes, 6,212 GPUs) a view built from scratch is a Python loop
    over every GPU for every submission; with the cache only the nodes that changed are
    counted again, and only their blocks folded again (folding every node's tallies took
    as long as checking them: a fifth of the sla service's time per submission there)."""

    _by_node: dict[str, tuple[NodeTopology, object, tuple, NodeTallies]] = field(default_factory=dict)
    _blocks: list[tuple[list[NodeTallies], NodeTallies]] = field(default_factory=list)

    def tallies(self, node: NodeTopology, allocations: Iterable, admitted: Mapping[str, TaskAdmitted],
                memory_of: dict[str, int], knobs: SnapshotKnobs) -> NodeTallies:
        """The node's tallies, from the cache when nothing they depend on was replaced."""
        holders = tuple(admitted.get(a.task_id) for a in allocations)
        kept = self._by_node.get(node.node)
        if (kept is not None and kept[0] is node and kept[1] is allocations and len(kept[2]) == len(holders)
                and all(x is y for x, y in zip(kept[2], holders, strict=True))):
            return kept[3]
        tallies = _node_tallies(node, allocations, admitted, memory_of, knobs)
        self._by_node[node.node] = (node, allocations, holders, tallies)
        return tallies

    def folded(self, index: int, parts: list[NodeTallies]) -> NodeTallies:
        """The ``index``-th block's node tallies ``parts`` (in the view's node order) folded
        into one tally per pool, from the cache when each part is the one folded last time.
        The tallies returned are read, never changed."""
        if index < len(self._blocks):
            kept, folded = self._blocks[index]
            if len(kept) == len(parts) and all(a is b for a, b in zip(kept, parts, strict=True)):
                return folded
        folded: NodeTallies = defaultdict(_PoolTally)
        for node_parts in parts:
            _fold_into(folded, node_parts)
        if index < len(self._blocks):
            self._blocks[index] = (parts, folded)
        else:
            self._blocks.append((parts, folded))
        return folded

    def keep_only(self, nodes: set[str], blocks: int) -> None:
        """Forget the nodes no longer in the fleet, and the blocks past the last."""
        for gone in set(self._by_node) - nodes:
            del self._by_node[gone]
        del self._blocks[blocks:]


def frees_in(end: float, duration: float, now: float) -> float:
    """Seconds from ``now`` until a run expected to end at ``end`` (after ``duration``) ends.

    A run past its expected end is still running, and was promised as freeing "now" to
    every request until it ended: it is expected to need as long again as it has overrun,
    and at least ``OVERRUN_FLOOR`` of its expected duration more."""
    if end > now:
        return end - now
    return max(now - end, OVERRUN_FLOOR * duration)


class OpenOffer(Protocol):
    """A counter-offer as :func:`fleet_view` reads it: the offer, the submission it answers
    (for its GPU count) and its state (``"open"`` until answered or expired). The sla
    service's stored ``OfferRecord`` is one; a test may pass any plain record."""

    @property
    def offer(self) -> SlaOffer:
        """The offer made: its options and ``valid_until``."""
        ...

    @property
    def task(self) -> TaskSubmitted:
        """The submission the offer answers."""
        ...

    @property
    def state(self) -> str:
        """``open``, ``accepted``, ``declined`` or ``expired``."""
        ...


def held_option(offer: SlaOffer) -> OfferOption | None:
    """The option whose capacity an open offer holds for its client: the first (see the
    module docstring), when it names a model and a site; ``None`` when it names no pool."""
    if not offer.options:
        return None
    first = offer.options[0]
    return first if first.gpu_model and first.site else None


def _holding(record: OpenOffer, admitted: Mapping[str, TaskAdmitted], now: float) -> OfferOption | None:
    """The option whose GPUs ``record`` holds at ``now`` (its first), ``None`` if it holds none."""
    # Past valid_until a reply gets ``offer_expired`` whether or not the expiry job has
    # closed it yet; an admitted task is counted as waiting (or in the ledger) already.
    if record.state != "open" or now > record.offer.valid_until or record.task.task_id in admitted:
        return None
    return held_option(record.offer)


def _held_by_offers(offers: Iterable[OpenOffer], admitted: Mapping[str, TaskAdmitted],
                    now: float) -> list[tuple[OpenOffer, OfferOption]]:
    """The open offers that hold GPUs at ``now``, each with the option it holds (its first)."""
    return [(record, option) for record in offers if (option := _holding(record, admitted, now)) is not None]


@dataclass
class _SharedGpu:
    """A GPU the waiting tasks asking shares of one are played onto, while their shares fit."""

    start: float
    milli: int
    frees_at: float | None  # None: a task on it has no expected duration, it never frees


def queued(task: TaskSubmitted) -> tuple[int, int, float | None]:
    """How :func:`play_queue` seats ``task``: its GPUs (at least one: a CPU-only admission
    pinned to a pool is counted as one), its share of each, its expected duration."""
    return max(task.gpus, 1), task.gpu_milli, task.expected_duration_s


class PlayedQueue(NamedTuple):
    """What :func:`play_queue` leaves a new request: GPUs ``free`` now, when each other GPU
    frees for good (``frees``, seconds from now, sorted) and the ``gaps`` before then: each
    ``(from_s, until_s)`` a GPU stands idle, held for a waiting task that starts later."""

    free: int
    frees: list[float]
    gaps: list[tuple[float, float]]


MAX_GAPS = 128
"""The most idle windows :func:`play_queue` keeps (the longest): a deep queue of wide tasks
leaves one per GPU each, and every later task scans them."""


def _backfilled(gaps: list[tuple[float, float]], taken: list[float], at: float, chosen: list[int],
                duration: float, gpus: list[float]) -> list[tuple[float, float]]:
    """The gaps once a task of ``duration`` runs from ``at`` on the ``chosen`` windows of
    ``earliest_in_windows`` over ``gaps`` and then ``taken`` (GPUs free for good from those
    times): a gap it runs in leaves what is idle before and after the run; a GPU free for
    good is idle until the run and, pushed back on the ``gpus`` heap, free after it; the
    ``taken`` GPUs it leaves go back on the heap as they were."""
    kept = [w for i, w in enumerate(gaps) if i not in chosen]
    for i in chosen:
        if i < len(gaps):
            since, until = gaps[i]
            kept += [w for w in ((since, at), (at + duration, until)) if w[1] > w[0]]
        else:
            t = taken[i - len(gaps)]
            if at > t:
                kept.append((t, at))
            heapq.heappush(gpus, at + duration)
    for i, t in enumerate(taken):
        if i + len(gaps) not in chosen:
            heapq.heappush(gpus, t)
    return kept


def play_queue(free: int, frees_in_s: Iterable[float],
               waiting: Iterable[tuple[int, int, float | None]]) -> PlayedQueue:
    """What a pool offers a new request once the tasks ahead of it have had their turn.

    ``free`` GPUs are free now and busy ones free in ``frees_in_s`` seconds; ``waiting`` is
    ``(GPUs, share of each in milli, expected duration or None)`` per task ahead, in the
    order they are served. Each whole-GPU task is given the earliest start that delays none
    before it (conservative backfilling, Mu'alem and Feitelson 2001): on the GPUs that free
    first, starting when the last of them frees, unless as many GPUs stand idle for its whole
    run sooner, in the gaps those before it leave while they wait for their last GPU; it
    gives them back when its expected duration has run. One of unknown duration keeps its
    GPUs and fits no gap (no promise we cannot back), as does one the pool cannot seat.
    Tasks asking a share of one GPU (``milli < 1000``) that come one after another share a
    GPU while their shares fit in it, as the policy packs them: counted a whole GPU each,
    they delayed every task behind them by runs they need no GPU of their own for.

    Before, a waiting task took a GPU and never gave it back: a queue deeper than the
    running tasks' completions made every pool "never free enough GPUs", and a fleet with a
    backlog refused new work as infeasible. Then, a wide task waiting for its last GPU held
    the others idle from the negotiator's view, while the policy backfills them with work
    that ends before it starts (``policy.backfill``): short tasks behind a wide one were
    refused deadlines the fleet met.
    """
    gpus = [0.0] * free + list(frees_in_s)
    heapq.heapify(gpus)
    gaps: list[tuple[float, float]] = []
    shared: _SharedGpu | None = None

    def give_back(gpu: _SharedGpu | None) -> None:
        if gpu is not None and gpu.frees_at is not None:
            heapq.heappush(gpus, gpu.frees_at)

    for need, milli, duration in waiting:
        if need == 1 and milli < 1000:
            if shared is not None and shared.milli + milli <= 1000:
                shared.milli += milli
                if shared.frees_at is not None:
                    shared.frees_at = None if duration is None else max(shared.frees_at, shared.start + duration)
                continue
            give_back(shared)
            shared = None
            if gpus:
                start = heapq.heappop(gpus)
                shared = _SharedGpu(start, milli, None if duration is None else start + duration)
            continue
        give_back(shared)
        shared = None
        taken = [heapq.heappop(gpus) for _ in range(min(need, len(gpus)))]
        if len(taken) < need:
            continue  # it waits for ever on what there is
        start = max(taken)
        early = (earliest_in_windows([*gaps, *((t, math.inf) for t in taken)], need, duration, start)
                 if duration is not None and gaps else None)
        if early is not None and duration is not None:
            gaps = _backfilled(gaps, taken, *early, duration, gpus)
        else:
            for t in taken:
                if start > t:
                    gaps.append((t, start))
                if duration is not None:
                    heapq.heappush(gpus, start + duration)
        if len(gaps) > MAX_GAPS:
            gaps = sorted(gaps, key=lambda w: w[0] - w[1])[:MAX_GAPS]
    give_back(shared)
    at_once = sum(1 for t in gpus if t <= 0.0)
    return PlayedQueue(at_once, sorted(t for t in gpus if t > 0.0), sorted(gaps))


def offers_hold_until(offers: Iterable[OpenOffer], admitted: Mapping[str, TaskAdmitted], now: float) -> float | None:
    """When the last of the open offers that hold GPUs at ``now`` lapses unless accepted (its
    ``valid_until``); ``None`` when none holds any.

    The sla service names it when the holds alone leave a submission nothing: every GPU
    that could run it is promised to another client for now, which is no lasting
    infeasibility, so the refusal says when to ask again instead of "no pool will free"."""
    holding = [record.offer.valid_until for record in offers if _holding(record, admitted, now) is not None]
    return max(holding) if holding else None


def fleet_view(nodes: Iterable[NodeTopology], ledgers: Iterable[NodeLedger],
               admitted: Mapping[str, TaskAdmitted], *, now: float,
               bandwidth_gbps: Mapping[tuple[str, str], float] | None = None,
               knobs: SnapshotKnobs | None = None, cache: SnapshotCache | None = None,
               offers: Iterable[OpenOffer] = (), ahead_of: tuple[int, float] | None = None) -> FleetView:
    """The fleet as the negotiator sees it at ``now`` (see the module docstring).

    ``admitted`` maps task ids to their agreed admission (tier and expected duration of
    the holders); ``bandwidth_gbps`` is in GB/s, e.g. from :func:`bandwidth_table`. With a
    ``cache`` (kept between calls), nodes unchanged since the last call are not counted again.
    ``offers`` are the counter-offers made to other submissions: each still open holds its
    first option's GPUs (:func:`held_option`), as an admission waiting for them would.
    ``ahead_of`` is the request's own place in the policy's queue
    (:func:`fleetpilot.policy.backfill.queue_key` of its tier, ``now`` and its expected
    duration): only the waiting admissions the policy serves before it count, in the
    policy's order. Without it, every waiting admission counts, in the order admitted.
    """
    knobs = knobs or SnapshotKnobs()
    holds = {ledger.node: ledger.allocations for ledger in ledgers}
    tallies: dict[tuple[str, str], _PoolTally] = defaultdict(_PoolTally)
    memory_of: dict[str, int] = {}  # catalogue memory per model, looked up once per call
    seen: set[str] = set()
    block: list[NodeTallies] = []
    blocks = 0
    for node in nodes:
        allocations = holds.get(node.node, ())
        seen.add(node.node)
        if cache is None:
            _fold_into(tallies, _node_tallies(node, allocations, admitted, memory_of, knobs))
            continue
        # Folded block by block, in the nodes' order: the pools come out as folded node by node.
        block.append(cache.tallies(node, allocations, admitted, memory_of, knobs))
        if len(block) == BLOCK_NODES:
            _fold_into(tallies, cache.folded(blocks, block))
            block, blocks = [], blocks + 1
    if cache is not None:
        if block:
            _fold_into(tallies, cache.folded(blocks, block))
            blocks += 1
        cache.keep_only(seen, blocks)
    holding = {a.task_id for allocations in holds.values() for a in allocations}
    # (its place in the queue, the task) of each task ahead of a new request, per pool.
    waiting: dict[tuple[str, str], list[tuple[tuple[float, ...], TaskSubmitted]]] = defaultdict(list)
    for adm in admitted.values():
        contract = adm.contract
        # Counted where it was estimated: the contract's site (the first of its ``sites``, where
        # it lists them) and first model (it may start on another of its models, or at another
        # of its sites, if one frees first; then it waits less than counted here).
        if adm.task.task_id in holding or contract.site is None or not contract.gpu_models:
            continue
        place = (*queue_key(contract.tier, adm.admitted_at, adm.task.expected_duration_s, knobs.queue_aging),
                 adm.admitted_at)
        if ahead_of is not None and place[:2] >= ahead_of:
            continue  # the policy serves the request first: a shorter run, or a higher tier
        waiting[(contract.site, contract.gpu_models[0])].append(
            (place if ahead_of is not None else (adm.admitted_at,), adm.task))
    for record, option in _held_by_offers(offers, admitted, now):
        # After every admission: an offer's client has not said yes yet, and will be served
        # in its turn only once it has.
        waiting[(option.site, option.gpu_model)].append(((math.inf,), record.task))
    pools = []
    for (site, model), tally in sorted(tallies.items()):
        price, compute, _ = _catalogue_terms(model, knobs)
        reserved = min(tally.free, math.ceil(tally.total * knobs.reserve_fraction)) if knobs.reserve_fraction > 0 else 0
        ahead = sorted(waiting.get((site, model), ()), key=lambda w: w[0])
        free, frees, gaps = play_queue(tally.free, [frees_in(end, duration, now) for end, duration in tally.frees_at],
                                       [queued(task) for _, task in ahead])
        completions: dict[float, int] = defaultdict(int)
        for in_s in frees:
            completions[round(in_s, 3)] += 1
        pools.append(GpuPool(site=site, gpu_model=model, memory_mb_per_gpu=tally.memory_mb,
                             price_per_gpu_hour=price, free_gpus=free, free_milli=tally.free_milli,
                             reserved_gpus=reserved, preemptible_gpus=tally.preemptible,
                             most_clearable_on_a_node=tally.most_clearable,
                             completions=tuple(sorted(completions.items())), relative_compute=compute,
                             most_gpus_on_a_node=tally.most_on_a_node, node_shapes=node_frontier(tally.shapes),
                             gaps=tuple(gaps)))
    return FleetView(pools=tuple(pools), bandwidth_gbps=dict(bandwidth_gbps or {}),
                     local_bandwidth_gbps=knobs.local_bandwidth_gbps,
                     default_bandwidth_gbps=knobs.default_bandwidth_gbps,
                     reference_p95_ms=knobs.reference_p95_ms)


def bandwidth_table(estimates: Iterable[BandwidthEstimate], strategy: str = "min_rtt") -> dict[tuple[str, str], float]:
    """GB/s per (from site, to site), both directions, from ``topology.updated`` estimates.

    Only the estimates of ``strategy`` are used: ``min_rtt`` is what most multipath stacks
    actually achieve, so promises made on it hold. A zero estimate (no path between the
    sites) is left out: the negotiator divides by the bandwidth, and the configured default
    is the honest fallback for a pair nobody measured.
    """
    table: dict[tuple[str, str], float] = {}
    for est in estimates:
        if est.strategy != strategy or est.effective_gbps <= 0:
            continue
        gbytes = est.effective_gbps / 8.0  # the estimates are in Gbit/s
        table[(est.a_site, est.b_site)] = gbytes
        table[(est.b_site, est.a_site)] = gbytes
    return table


def _catalogue_name(model: str) -> str | None:
    try:
        return gpu_model(model).name
    except UnknownGpuModel:
        return None


def as_named_by_fleet(asked: Iterable[str], fleet_models: Iterable[str]) -> list[str]:
    """The asked GPU models plus the fleet's own spellings of the same catalogue models.

    Users write ``A100`` where nodes report ``A100-40GB``; the negotiator and the policy
    compare names exactly, so the asked list is widened to every fleet spelling of the same
    catalogue entry (the asked names stay first, an uncatalogued name matches only itself).
    """
    out = list(asked)
    wanted = {name for name in (_catalogue_name(m) for m in out) if name is not None}
    for model in sorted(set(fleet_models)):
        if model not in out and _catalogue_name(model) in wanted:
            out.append(model)
    return out
