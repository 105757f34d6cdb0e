"""The queue in front of a policy: skipping what cannot fit, and backfill with a reservation.

A scan of the waiting tasks stops deciding a task that needs no less than one that already
found no node in the same round (``Demand``): it cannot fit either until something frees.

A queue that lets any task start as soon as it fits ("backfill") keeps a fleet busy but
starves wide tasks: a 4-GPU task needs four GPUs of one node free at the same time, and while
it waits, every narrower task that arrives takes whichever GPU frees first. EASY backfilling
(Lifka, 1995; what Slurm's backfill scheduler does) gives the first blocked task in queue
order a *reservation*: the node and GPUs where it can start earliest, judged by the expected
end of what runs there, and the time it can start (the shadow time). Other tasks still start
anywhere, except on the reserved GPUs unless they are expected to end before the shadow
time. So backfill never delays the reserved task, and the reservation never idles a GPU
that a task short enough could use meanwhile.

Expected ends come from the durations users declare (``expected_duration_s``): estimates,
so a reservation is not kept but recomputed every scheduling cycle from what runs then.
Only whole-GPU requests are given one: a share fits into a partly used GPU, which "entirely
free at" does not describe. The reservation holds GPUs, not the node's CPU or memory; if
backfilled work drains those, the next cycle reserves elsewhere.

Usage (one scheduling cycle)::

    free_at = gpu_free_at(state, running_ends, now)
    reservation, failed = None, []
    for task in queue:                      # priority order
        hide = reservation is not None and reservation.delayed_by(task_id, task_duration, now)
        demand = Demand.of(request)
        if any(demand.cannot_fit_after(f) for f, masked in failed if hide or not masked):
            continue
        with hidden(state, reservation if hide else None):
            decision = policy.decide(state, request)
        if decision.action != "assign":
            failed.append((demand, hide))
            if reservation is None:
                reservation = reserve(state, request, free_at)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np

from fleetpilot.contracts.topology import TASK_LABEL_DRIVER

from .framework import PolicyDecision
from .state import MILLI, ClusterState, TaskRequest


@dataclass(frozen=True)
class Demand:
    """What a waiting request needs, for the monotone test a queue scan skips with: once a
    request found no node in a round, one that needs at least as much of everything, under
    the same business rules and without accepting any model it did not, cannot fit either
    until something frees (as kube-scheduler parks unschedulable pods). A request bound to a
    site (its contract's) bounds only those bound to the same site; one free to go anywhere
    bounds them all."""

    gpus: int
    milli: int
    gpu_memory_mb: int
    cpu_milli: int
    memory_mb: int
    models: frozenset[str]
    kind: str
    driver: str
    site: str = ""

    @classmethod
    def of(cls, request: TaskRequest, *, whole_gpus: bool = False) -> Demand:
        """The demand of ``request``; ``whole_gpus`` counts a share as a whole GPU (the
        device plugin's view)."""
        # GPUs of no milli are no GPU to the policies (they place it on CPU only), so none here:
        # counted as whole GPUs, it was skipped behind every whole-GPU request that waited.
        gpus = request.gpus if request.gpus > 0 and request.gpu_milli > 0 else 0
        milli = 0 if not gpus else MILLI if (whole_gpus or not request.shares_gpu) else request.gpu_milli
        models = frozenset(request.gpu_models) if gpus else frozenset()
        return cls(gpus=gpus, milli=milli, gpu_memory_mb=request.gpu_memory_mb if gpus else 0,
                   cpu_milli=request.cpu_milli, memory_mb=request.memory_mb, models=models, kind=request.kind,
                   driver=request.labels.get(TASK_LABEL_DRIVER, ""), site=request.site)

    def cannot_fit_after(self, failed: Demand) -> bool:
        """True when ``failed`` found no node and this needs at least as much (see above)."""
        if (self.kind, self.driver) != (failed.kind, failed.driver):
            return False  # business rules may open GPUs to one and not the other
        if failed.models and (not self.models or not self.models <= failed.models):
            return False
        if failed.site and self.site != failed.site:
            return False  # the failure saw one site's nodes; this may run on others
        return (self.gpus >= failed.gpus and self.milli >= failed.milli and self.gpu_memory_mb >= failed.gpu_memory_mb
                and self.cpu_milli >= failed.cpu_milli and self.memory_mb >= failed.memory_mb)


@dataclass(frozen=True)
class Reservation:
    """GPUs ``gpus`` of ``node`` kept for ``task_id``, expected free at ``start_s``. The node
    is named, not indexed, so a reservation stays valid on a later snapshot of the fleet."""

    task_id: str
    node: str
    gpus: tuple[int, ...]
    start_s: float

    def delayed_by(self, task_id: str, expected_duration_s: float | None, now: float) -> bool:
        """True when a task starting ``now`` may not use the reserved GPUs: it is not the
        task the reservation is for and is expected to outlast the start (a task that
        declares no duration is assumed to)."""
        if task_id == self.task_id:
            return False
        return expected_duration_s is None or now + expected_duration_s > self.start_s


def completion_order(arrival_s: float, remaining_s: float | None, aging: float = 1.0) -> float:
    """Queue key within a tier: when the task would end had it started on arrival (arrival
    plus the run still to do, as declared; a task that declares nothing is taken as long as
    a day, ``UNDECLARED_S``), with the arrival weighed by ``aging``.

    Ordering by it puts short work before long work that arrived about the same time (what
    shortest-job-first does for the mean wait) without starving anything: a later arrival
    overtakes a waiting task only if its run is shorter by more than ``aging`` times the
    time between their arrivals, so a run of length r is overtaken only by arrivals within
    r / ``aging`` of its own, a wide task included. ``aging`` 1 (the default) is "expected to
    end before that task would have"; below 1 short work goes first more often (the mean
    wait falls a little where a pool is asked several times what it gives, the longest
    waits rise; the benchmark's log has the figures). It must be above 0: at 0 the order is
    shortest first with no bound on how long a long run waits.
    """
    if not aging > 0.0:
        raise ValueError(f"queue aging must be above 0, got {aging!r}")
    return aging * arrival_s + (UNDECLARED_S if remaining_s is None else max(remaining_s, 0.0))


UNDECLARED_S = 24 * 3600.0
"""The run time ``completion_order`` assumes for a task that declares none."""

TIER_RANK = {"vip": 0, "standard": 1, "best_effort": 2}
"""Queue order of the SLA tiers; a tier not named here ranks as ``standard``."""


def queue_key(tier: str, arrival_s: float, remaining_s: float | None, aging: float = 1.0) -> tuple[int, float]:
    """Where a waiting task stands in the queue: its tier (``TIER_RANK``, vip first), then
    ``completion_order`` (with its ``aging``). The first blocked whole-GPU task in this order
    owns the reservation (``reserve``); making way (``makes_way``) compares the same keys."""
    return TIER_RANK.get(tier, 1), completion_order(arrival_s, remaining_s, aging)


MAKE_WAY_FACTOR = 3.0
"""A running task is checkpointed to make way for a blocked one (``makes_way``) only with at
least this many times the waiter's run and its own checkpoint pause still to run: the waiter's
wait falls by what the tenant has left, the tenant's grows by the waiter's run and the pause,
and a factor well above 1 keeps the trade clearly won when declared durations are loose."""

MAKE_WAY_PER_ROUND = 10
"""At most this many tasks are checkpointed to make way in one scheduling round."""


def makes_way(waiter: tuple[int, float], waiter_left_s: float | None, tenant: tuple[int, float],
              tenant_left_s: float | None, pause_s: float) -> bool:
    """Whether a running task (``tenant``: its ``queue_key`` as if it waited, with the run it
    has left) should be checkpointed so that a blocked task of one GPU, whole or a share
    (``waiter``), starts on its GPU now: shortest remaining work first, made preemptive.

    Only when the queue's own order puts the waiter first (its key before the tenant's: a
    higher tier, or expected to end before the tenant would) and the tenant has at least
    ``MAKE_WAY_FACTOR`` times the waiter's run plus its own pause left. The mean wait falls by
    the tenant's remainder less the waiter's run; nothing starves, since a task is overtaken
    only by what is expected to end before it, as in the queue. A run that declares no
    duration is neither preempted nor preempts: nothing says the trade is won."""
    if waiter_left_s is None or tenant_left_s is None or waiter >= tenant:
        return False
    return tenant_left_s >= MAKE_WAY_FACTOR * (waiter_left_s + pause_s)


@dataclass(frozen=True, slots=True)
class Room:
    """Capacity on one GPU and its node: what is free there, or what a tenant holds there."""

    milli: int
    gpu_memory_mb: int
    cpu_milli: int
    memory_mb: int


def leaves_room(free: Room, tenant: Room, share: TaskRequest) -> bool:
    """Whether a tenant's going would leave room on its GPU and node for ``share`` (a task of
    part of one GPU): what is ``free`` there now plus what the ``tenant`` holds there covers
    the share's SM, GPU memory, CPU and host memory. Making room (``makes_way`` for a share)
    stops a tenant only where this holds: on a GPU that other shares keep busy, stopping one
    tenant may free too little, and its run would be lost for no start."""
    return (free.milli + tenant.milli >= share.gpu_milli
            and free.gpu_memory_mb + tenant.gpu_memory_mb >= share.gpu_memory_mb
            and free.cpu_milli + tenant.cpu_milli >= share.cpu_milli
            and free.memory_mb + tenant.memory_mb >= share.memory_mb)


def gpu_free_at(state: ClusterState, ends: Iterable[tuple[int, Sequence[int], float]], now: float) -> np.ndarray:
    """``(nodes, max_gpus)`` time at which each GPU slot is expected to be entirely free.

    ``ends`` lists what runs: ``(node_row, gpus, expected_end_s)`` per task. An idle GPU is
    free ``now``; a busy one when its last tenant is expected to end (never before ``now``:
    a task past its declared duration ends "any moment"); a missing, unhealthy or
    maintenance slot never (``inf``).
    """
    free_at = np.full(state.gpu_free.shape, float(now))
    for row, gpus, end in ends:
        for g in gpus:
            free_at[row, g] = max(free_at[row, g], float(end))
    usable = state.gpu_exists & state.gpu_healthy & ~state.gpu_maintenance
    return np.where(usable, free_at, np.inf)


def wide_hosts(state: ClusterState, request: TaskRequest) -> np.ndarray:
    """Per node, whether a whole-GPU ``request`` could run there once the node is empty: an
    accepted model on its contract's site if it names one, enough CPU and memory in total,
    and ``gpus`` GPUs that exist, hold its GPU memory and whose business rules let it start
    (``ClusterState.allowed``). All false for a share or a task wider than any node
    (``reserve`` and ``clearing`` only serve whole-GPU requests)."""
    n = request.gpus
    if n < 1 or request.gpu_milli < MILLI or n > state.max_gpus:
        return np.zeros(state.n_nodes, dtype=bool)
    ok = (state.cpu_total >= request.cpu_milli) & (state.mem_total >= request.memory_mb)
    if request.gpu_models:
        wanted = [state.model_index(m) for m in request.gpu_models]
        ok &= np.isin(state.node_model, [w for w in wanted if w >= 0])
    if request.site:  # bound to a site by its contract
        ok &= state.node_site == (state.sites.index(request.site) if request.site in state.sites else -1)
    return ok & (_roomy(state, request).sum(axis=1) >= n)


def _roomy(state: ClusterState, request: TaskRequest) -> np.ndarray:
    """``(N, G)``: the GPUs that exist, hold ``request``'s GPU memory and may take it by their
    business rules. A GPU the rules keep it off is never free for it: reserving or emptying
    one would hold GPUs back, or checkpoint their tenants, for a node it is never placed on."""
    return state.gpu_exists & (state.gpu_mem_total >= request.gpu_memory_mb) & state.allowed(request)


def reserve(state: ClusterState, request: TaskRequest, free_at: np.ndarray) -> Reservation | None:
    """Where and when a blocked whole-GPU request can start earliest, or ``None``.

    Candidate nodes are those it could run on once empty (``wide_hosts``): an accepted
    model, enough GPUs that its business rules let it use, GPU memory, CPU and memory in
    total. On each, the start is the ``gpus``-th earliest GPU release; the earliest node
    wins (the lowest row on a tie, so the choice is reproducible), and the reservation is
    for its ``gpus`` earliest-free GPUs.
    """
    ok = wide_hosts(state, request)
    if not ok.any():
        return None
    n = request.gpus
    times = np.where(_roomy(state, request), free_at, np.inf)
    nth = np.where(ok, np.sort(times, axis=1)[:, n - 1], np.inf)
    row = int(np.argmin(nth))
    if not np.isfinite(nth[row]):
        return None
    gpus = np.argsort(times[row], kind="stable")[:n]
    return Reservation(task_id=request.task_id, node=state.node_names[row],
                       gpus=tuple(sorted(int(g) for g in gpus)), start_s=float(nth[row]))


def reserve_earliest(state: ClusterState, requests: Sequence[TaskRequest],
                     free_at: np.ndarray) -> tuple[Reservation, TaskRequest] | None:
    """``reserve`` for the earliest of one task's requests: its plain request at each site
    its contract binds it to. The earliest start wins (on a tie, the first in the contract's
    order), with the request it was made for, whose site a clearing for it looks at. Reserved
    at the contract's first site only, a task that fits no node there (an 8-GPU run whose
    predicted peak needs the H100s of the second site) got no reservation ever, and every
    GPU that freed at the other was backfilled before it: standard 8-GPU runs waited 2 to 3
    hours past their 30-minute bound (three-site 123)."""
    best: tuple[Reservation, TaskRequest] | None = None
    for request in requests:
        made = reserve(state, request, free_at)
        if made is not None and (best is None or made.start_s < best[0].start_s):
            best = (made, request)
    return best


MORE_RESERVATIONS = 3
"""How many blocked tasks after the first may get a reservation of their own, each only on
nodes that no earlier reserved task could use (``reserve_apart``)."""


def reserve_apart(state: ClusterState, first: Sequence[TaskRequest],
                  waiters: Sequence[Sequence[TaskRequest]], free_at: np.ndarray,
                  limit: int = MORE_RESERVATIONS) -> list[Reservation]:
    """Reservations for the blocked tasks after the first (``first``: its requests; it holds
    the reservation), in the queue's order (``waiters``: each task's requests at each of its
    sites), for each whose nodes (``wide_hosts`` at any of its
    sites) no earlier reserved task could use, at most ``limit``: one backfill reservation per
    pool of nodes, as a cluster of partitions keeps one per partition. A task that shares
    nodes with the first would wait on the GPUs the first waits on: reserving those too
    kept more GPUs idle ahead of starts the declared durations place too early or too late
    (four reservations on shared nodes, measured in the fleet benchmark, lost on both
    fleets). Apart, a reservation delays no earlier one, and a task that only another site's
    or model's nodes can take no longer waits without one behind the first."""
    used = np.zeros(state.n_nodes, dtype=bool)
    for request in first:
        used |= wide_hosts(state, request)
    out: list[Reservation] = []
    for requests in waiters:
        if len(out) >= limit:
            break
        hosts = np.zeros(state.n_nodes, dtype=bool)
        for request in requests:
            hosts |= wide_hosts(state, request)
        if (hosts & used).any() or not hosts.any():
            continue
        used |= hosts
        made = reserve_earliest(state, requests, free_at)  # apart: no earlier one holds these GPUs
        if made is not None:
            out.append(made[0])
    return out


def delays_any(reservations: Iterable[Reservation | None], task_id: str, run_s: float | None, now: float) -> bool:
    """Whether a task ``task_id`` starting ``now`` and running ``run_s`` would delay any of
    ``reservations`` (``Reservation.delayed_by``): it is decided with them hidden."""
    return any(r is not None and r.delayed_by(task_id, run_s, now) for r in reservations)


@contextmanager
def hidden_from(state: ClusterState, reservations: Iterable[Reservation | None], task_id: str,
                run_s: float | None, now: float) -> Iterator[ClusterState]:
    """``hidden`` for every one of ``reservations`` that a task ``task_id`` starting ``now``
    and running ``run_s`` would delay (``Reservation.delayed_by``)."""
    with ExitStack() as stack:
        for reservation in reservations:
            if reservation is not None and reservation.delayed_by(task_id, run_s, now):
                stack.enter_context(hidden(state, reservation))
        yield state


@contextmanager
def hidden(state: ClusterState, reservation: Reservation | None) -> Iterator[ClusterState]:
    """Within the block, the reserved GPUs look out of service to any policy deciding on
    ``state`` (marked as in maintenance); the flags are restored on exit. The node's version
    is bumped both ways so derived-feature caches never serve the masked view afterwards.
    A reservation on a node the snapshot does not have hides nothing."""
    row = _row_of(state, reservation.node) if reservation is not None else None
    # Slots the snapshot lacks (read on a later snapshot, the fleet's widest node gone) hold
    # nothing to hide; indexed, they failed the round.
    gpus = [g for g in reservation.gpus if 0 <= g < state.max_gpus] if reservation is not None else []
    if row is None or not gpus:
        yield state
        return
    before = state.gpu_maintenance[row, gpus].copy()
    state.set_condition(row, gpus, maintenance=True)
    try:
        yield state
    finally:
        state.set_condition(row, gpus, maintenance=before)


def node_hidden(state: ClusterState, node: str) -> AbstractContextManager[ClusterState]:
    """``hidden`` for every GPU of ``node`` (none for ``""`` or a node the snapshot lacks)."""
    row = _row_of(state, node) if node else None
    gpus = tuple(int(g) for g in np.flatnonzero(state.gpu_exists[row])) if row is not None else ()
    return hidden(state, Reservation(task_id="", node=node, gpus=gpus, start_s=0.0) if gpus else None)


def _row_of(state: ClusterState, node: str) -> int | None:
    try:
        return state.node_index(node)
    except KeyError:
        return None


@dataclass(frozen=True)
class Tenant:
    """A running task that a clearing may move: where it holds what, the request it would be
    placed with now, and how long its checkpoint and restore would pause it."""

    request: TaskRequest
    row: int
    gpus: tuple[int, ...]
    milli: int
    gpu_memory_mb: int
    pause_s: float

    @property
    def cost(self) -> float:
        """GPU-seconds a move loses: the pause times the GPUs it holds, as a share."""
        return self.pause_s * len(self.gpus) * self.milli / MILLI

    def _hold(self) -> dict[str, int]:
        return {"cpu_milli": self.request.cpu_milli, "memory_mb": self.request.memory_mb,
                "gpu_memory_mb": self.gpu_memory_mb}


@dataclass(frozen=True)
class Move:
    """One tenant's new place in a clearing."""

    task_id: str
    row: int
    gpus: tuple[int, ...]
    milli: int
    # The policy's confidence in that placement: that the tenant runs on there (``decide``).
    confidence: float = 1.0


@dataclass(frozen=True)
class Clearing:
    """Moves that empty ``gpus`` of node ``row`` for a blocked whole-GPU request, and their
    total cost (GPU-seconds)."""

    row: int
    gpus: tuple[int, ...]
    moves: tuple[Move, ...]
    cost: float


Decide = Callable[[ClusterState, TaskRequest], PolicyDecision]


def clearing(state: ClusterState, request: TaskRequest, tenants: Sequence[Tenant], decide: Decide, *,
             wait_s: float, tries: int = 3) -> Clearing | None:
    """The cheapest set of migrations that lets a blocked whole-GPU ``request`` start as soon
    as the moved tenants are checkpointed, if they lose less than it gains: the tenants' cost
    (GPU-seconds) against the wait it is spared (``wait_s``, until its reservation starts,
    less the longest of their pauses, which it still waits) times the GPUs it needs.

    EASY backfill only waits for GPUs to free; when the tasks that hold every node a wide
    task can use will run for hours, that wait is hours of the wide task (and of the GPUs
    kept idle for it), while most of those tenants could run elsewhere at the price of a
    checkpoint. For every node the request could use once empty, the ``gpus`` GPUs cheapest
    to empty are picked (then more tenants of the node, cheapest first, if its CPU or memory
    is still short); the ``tries`` cheapest plans that pay off are tried in order: their
    tenants are placed by ``decide`` (the active policy) elsewhere, the node's GPUs hidden,
    largest tenant first. The first plan whose tenants all find a place wins. A one-GPU
    request gains nothing from where its GPU is, so every GPU that can be emptied is a plan
    of its own, and every plan that pays off is tried (one or two decisions each): the
    cheapest GPU of a node often holds a task that fits nowhere else. ``state`` is left as
    it was; the caller carries out the moves and places the request. Only tenants on
    ``wide_hosts`` nodes can be moved: a caller may pass just those.
    """
    n = request.gpus
    usable = _roomy(state, request) & state.gpu_healthy & ~state.gpu_maintenance
    on_row: dict[int, list[Tenant]] = {}
    for t in tenants:
        on_row.setdefault(t.row, []).append(t)
    plans: list[tuple[float, int, tuple[int, ...], list[Tenant]]] = []
    for row in np.flatnonzero(wide_hosts(state, request) & (usable.sum(axis=1) >= n)):
        row = int(row)
        here = on_row.get(row, [])
        # A GPU held by something that is not a tenant (not movable) cannot be emptied.
        gpu_cost = np.zeros(state.max_gpus)
        held = np.zeros(state.max_gpus, dtype=np.int64)
        for t in here:
            gpu_cost[list(t.gpus)] += t.cost
            held[list(t.gpus)] += t.milli
        emptyable = usable[row] & (state.gpu_free[row] + held >= MILLI)
        k = int(emptyable.sum())
        if k < n:
            continue
        ranked = [int(g) for g in np.argsort(np.where(emptyable, gpu_cost, np.inf), kind="stable")[:k]]
        for gpus in ([ranked[:n]] if n > 1 else [[g] for g in ranked]):
            plan = _plan(state, request, row, gpus, here, wait_s)
            if plan is not None:
                plans.append(plan)
    plans.sort(key=lambda p: (p[0], p[1]))
    for cost, row, gpus, moving in plans[:tries] if n > 1 else plans:
        moves = _evacuate(state, request, row, gpus, moving, decide)
        if moves is not None:
            return Clearing(row=row, gpus=gpus, moves=tuple(moves), cost=cost)
    return None


def _plan(state: ClusterState, request: TaskRequest, row: int, gpus: list[int], here: list[Tenant],
          wait_s: float) -> tuple[float, int, tuple[int, ...], list[Tenant]] | None:
    """``(cost, row, gpus, tenants to move)`` for emptying ``gpus`` of ``row`` (and, while
    its CPU or memory is short for the request, more of its tenants, cheapest first), or
    ``None`` when that is not enough or costs more than the request's wait saves."""
    moving = [t for t in here if set(t.gpus) & set(gpus)]
    rest = sorted((t for t in here if t not in moving), key=lambda t: t.cost)
    cpu = state.cpu_free[row] + sum(t.request.cpu_milli for t in moving)
    mem = state.mem_free[row] + sum(t.request.memory_mb for t in moving)
    while (cpu < request.cpu_milli or mem < request.memory_mb) and rest:
        t = rest.pop(0)
        moving.append(t)
        cpu += t.request.cpu_milli
        mem += t.request.memory_mb
    if cpu < request.cpu_milli or mem < request.memory_mb or not moving:
        return None
    cost = sum(t.cost for t in moving)
    if cost >= (wait_s - max(t.pause_s for t in moving)) * request.gpus:
        return None
    return cost, row, tuple(sorted(gpus)), moving


def _evacuate(state: ClusterState, request: TaskRequest, row: int, gpus: tuple[int, ...], moving: list[Tenant],
              decide: Decide) -> list[Move] | None:
    """Place ``moving`` elsewhere with ``row``'s ``gpus`` hidden; the moves, or ``None`` if
    one finds no place or the request's CPU and memory are still short on ``row`` after them
    (a tenant moved for its CPU may land on another GPU of the same node). ``state`` is
    restored either way."""
    for t in moving:
        state.release(t.row, t.gpus, t.milli, **t._hold())
    before = state.gpu_maintenance[row, list(gpus)].copy()
    state.set_condition(row, gpus, maintenance=True)
    placed: list[tuple[Tenant, Move]] = []
    try:
        for t in sorted(moving, key=lambda t: (-t.request.gpus * t.milli, t.request.task_id)):
            d = decide(state, t.request)
            if d.action != "assign" or not d.placement:
                return None
            move = Move(task_id=t.request.task_id, row=d.node_row,
                        gpus=tuple(p.gpu for p in d.placement if p.gpu >= 0), milli=d.placement[0].milli,
                        confidence=d.confidence)
            state.allocate(move.row, move.gpus, move.milli, **t._hold())
            placed.append((t, move))
        if state.cpu_free[row] < request.cpu_milli or state.mem_free[row] < request.memory_mb:
            return None
        return [m for _, m in placed]
    finally:
        for t, m in placed:
            state.release(m.row, m.gpus, m.milli, **t._hold())
        state.set_condition(row, gpus, maintenance=before)
        for t in moving:
            state.allocate(t.row, t.gpus, t.milli, **t._hold())
