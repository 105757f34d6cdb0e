"""The policy's view of the fleet: a vectorised, serialisable snapshot and the task request.

``ClusterState`` holds one row per node and one ``node × max_gpus`` padded matrix per GPU
attribute, so that every plugin scores the whole fleet with a few numpy operations. A GPU
slot that does not exist has ``gpu_exists = False`` and zero free capacity, which lets most
arithmetic ignore the mask. ``allocate`` / ``release`` update the arrays in place and bump a
per-node version counter, which derived-feature caches use to recompute only dirty nodes.

Snapshots round-trip through ``to_record`` / ``from_record`` (a msgspec struct of plain
lists, JSON-able) and ``to_npz_bytes`` / ``from_npz_bytes`` (compact binary), so a recorded
``(state, task)`` pair can be replayed against another policy later.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from fleetpilot.contracts.fingerprint import Fingerprint
from fleetpilot.contracts.task import TaskSubmitted
from fleetpilot.contracts.topology import TASK_LABEL_DRIVER, GpuRules, Link, NodeTopology, gpu_rules

MILLI = 1000
"""Milli-GPU of one whole GPU."""

# Link classes between two GPUs of a node, closest first; the value is a relative cost used
# by the NUMA/NVLink transformers (0 = same device).
LINK_COST: dict[str, int] = {"X": 0, "NV": 1, "PIX": 2, "PXB": 3, "PHB": 4, "NODE": 5, "SYS": 6, "PSB": 6}
UNKNOWN_LINK_COST = 4
MAX_GPUS_PER_NODE = 64
"""GPU indices a node may report (0 .. this - 1): every node's slots are padded to the widest,
so one absurd index would size every per-GPU array of the fleet by it."""


def _gpu_number(device: str) -> int | None:
    """The index of a ``GPU<n>`` link end, ``None`` for another device or a malformed name."""
    digits = device[3:]
    return int(digits) if device.startswith("GPU") and digits.isdigit() else None


def _index_in(table: list, item: Any) -> int:
    """The index of ``item`` in ``table``, appended when it is not there yet."""
    try:
        return table.index(item)
    except ValueError:
        table.append(item)
        return len(table) - 1


def _link_costs(links: Iterable[tuple[str, str, str]], slots: int) -> np.ndarray:
    """A node's ``slots`` x ``slots`` link costs from its links' ``(a, b, kind)``: 0 to itself,
    ``UNKNOWN_LINK_COST`` between GPUs no link names, a later link of a pair over an earlier
    one; a link to another device, or to a GPU past the slots, counts for nothing."""
    costs = np.full((slots, slots), UNKNOWN_LINK_COST, dtype=np.int8)
    np.fill_diagonal(costs, 0)
    for a_end, b_end, kind in links:
        a, b = _gpu_number(a_end), _gpu_number(b_end)
        if a is not None and b is not None and a < slots and b < slots:
            costs[a, b] = costs[b, a] = LINK_COST.get(kind, UNKNOWN_LINK_COST)
    return costs


PEAK_INTERVAL_SIGMAS = 4.0
"""How many standard deviations of a run's peak a fingerprint's interval ``[peak_low_mb,
peak_high_mb]`` spans, at least: a signature's is the mean of its runs' peaks ± 2 sd (or
their range, when wider), a fitted one the fit's peak ± 2.6 standard errors ± 2 sd of its
residuals. Width / 4 errs wide, never narrow. (It was width / 3.29, as if the interval held
90%: a spread 1.2 to 1.6 times too wide.)"""


def peak_sigma_mb(fingerprint: Fingerprint) -> float:
    """The spread of a run's peak its fingerprint's interval says (``PEAK_INTERVAL_SIGMAS``)."""
    return max(0.0, float(fingerprint.peak_high_mb - fingerprint.peak_low_mb) / PEAK_INTERVAL_SIGMAS)


class TaskRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What one task asks of the fleet, in the units the policies score with.

    ``gpus`` GPUs of ``gpu_milli`` each; a task with ``gpus == 1`` and ``gpu_milli < 1000``
    shares a GPU. ``gpu_models`` empty means any model. ``predicted_peak_mb`` and
    ``peak_sigma_mb`` come from the task's fingerprint (0 = unknown) and feed the OOM risk.
    """

    task_id: str
    kind: str = "batch"
    gpus: int = 1
    gpu_milli: int = MILLI
    gpu_memory_mb: int = 0
    cpu_milli: int = 0
    memory_mb: int = 0
    gpu_models: tuple[str, ...] = ()
    tier: str = "standard"
    role: str = ""
    predicted_peak_mb: float = 0.0
    peak_sigma_mb: float = 0.0
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    # The site the task's contract binds it to (an accepted counter-offer's); empty: any.
    site: str = ""

    @property
    def shares_gpu(self) -> bool:
        """True for a fractional request on one GPU (never split across GPUs)."""
        return self.gpus == 1 and 0 < self.gpu_milli < MILLI

    @property
    def total_milli(self) -> int:
        """Requested milli-GPU over all GPUs."""
        return self.gpus * self.gpu_milli if self.gpus > 0 else 0

    @classmethod
    def from_submitted(cls, task: TaskSubmitted, fingerprint: Fingerprint | None = None) -> TaskRequest:
        """Build a request from the wire event, with the fingerprint's predicted peak if known.

        The peak is taken as a normal of spread ``peak_sigma_mb`` (its interval's width / 4).
        """
        peak = sigma = 0.0
        if fingerprint is not None:
            peak = float(fingerprint.predicted_peak_mb)
            sigma = peak_sigma_mb(fingerprint)
        return cls(
            task_id=task.task_id,
            kind=task.kind,
            gpus=task.gpus,
            gpu_milli=task.gpu_milli if task.gpus > 0 else 0,
            gpu_memory_mb=task.gpu_memory_mb,
            cpu_milli=task.cpu_milli,
            memory_mb=task.memory_mb,
            gpu_models=tuple(task.gpu_models),
            tier=task.sla.tier,
            role=task.labels.get("business_role") or task.labels.get("role", ""),
            predicted_peak_mb=peak,
            peak_sigma_mb=sigma,
            labels=dict(task.labels),
        )


def request_problem(task: TaskRequest) -> str | None:
    """Why no GPU or node can hold ``task`` as it asks, in a few words; ``None`` when nothing
    is wrong with its shape. A negative count or size, or more than one GPU's milli on each
    GPU (``gpu_milli`` is per GPU: a task asking for more asks for more GPUs)."""
    for name in ("gpus", "cpu_milli", "memory_mb", "gpu_memory_mb"):
        if getattr(task, name) < 0:
            return f"{name} {getattr(task, name)} is negative"
    if task.gpus > 0 and not 0 <= task.gpu_milli <= MILLI:
        return f"gpu_milli {task.gpu_milli} is not a share of one GPU (0..{MILLI})"
    return None


class ClusterStateRecord(msgspec.Struct, kw_only=True):
    """The JSON-able form of a ``ClusterState``: names plus nested lists."""

    node_names: list[str]
    models: list[str]
    sites: list[str]
    roles: list[str]
    arrays: dict[str, Any]
    rule_sets: list[GpuRules] = msgspec.field(default_factory=lambda: [GpuRules()])


# Per-node and per-GPU arrays, with their dtypes; the order is the serialisation order.
_NODE_ARRAYS: dict[str, Any] = {
    "cpu_total": np.int64,
    "cpu_free": np.int64,
    "mem_total": np.int64,
    "mem_free": np.int64,
    "node_model": np.int32,
    "node_site": np.int32,
    "version": np.int64,
    "node_ready": np.bool_,
}
# Arrays a record made before they existed may lack; ``ClusterState`` fills their default.
_OPTIONAL_ARRAYS = frozenset({"gpu_rule", "node_ready"})
_GPU_ARRAYS: dict[str, Any] = {
    "gpu_exists": np.bool_,
    "gpu_free": np.int32,
    "gpu_mem_total": np.int32,
    "gpu_mem_free": np.int32,
    "gpu_healthy": np.bool_,
    "gpu_maintenance": np.bool_,
    "gpu_temp_c": np.float32,
    "gpu_role": np.int32,
    "gpu_numa": np.int32,
    "gpu_nvlink_util": np.float32,
    "gpu_rule": np.int32,
}


@dataclass
class ClusterState:
    """A vectorised snapshot of the fleet (see the module docstring for the layout).

    ``gpu_link`` is ``(N, G, G)`` link costs between GPUs of a node (``LINK_COST``).
    ``gpu_role`` indexes ``roles`` (0 = no role); ``gpu_rule`` indexes ``rule_sets``, the
    distinct business rules of the GPUs' labels (0 = none: any task), which ``allowed``
    turns into the GPUs a task may use. ``node_ready`` is false for a node out of service as a
    whole (its collector silent, its executor down: ``not_ready`` / ``unreachable``), which
    takes no task at all, one that asks no GPU included. Mutated only through ``allocate`` /
    ``release``; everything else treats it as read-only.
    """

    node_names: list[str]
    models: list[str]
    sites: list[str]
    roles: list[str]
    cpu_total: np.ndarray
    cpu_free: np.ndarray
    mem_total: np.ndarray
    mem_free: np.ndarray
    node_model: np.ndarray
    node_site: np.ndarray
    version: np.ndarray
    gpu_exists: np.ndarray
    gpu_free: np.ndarray
    gpu_mem_total: np.ndarray
    gpu_mem_free: np.ndarray
    gpu_healthy: np.ndarray
    gpu_maintenance: np.ndarray
    gpu_temp_c: np.ndarray
    gpu_role: np.ndarray
    gpu_numa: np.ndarray
    gpu_nvlink_util: np.ndarray
    gpu_link: np.ndarray
    gpu_rule: np.ndarray | None = None
    node_ready: np.ndarray | None = None  # type: ignore[assignment]
    rule_sets: list[GpuRules] = field(default_factory=lambda: [GpuRules()])
    _index: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._index = {name: i for i, name in enumerate(self.node_names)}
        if len(self._index) != len(self.node_names):
            # Decisions and the ledger name the node: of two rows with one name, the holds go to
            # one and the other shows its capacity free to be booked twice.
            twice = next(name for i, name in enumerate(self.node_names) if self._index[name] != i)
            raise ValueError(f"node {twice!r} appears twice in the fleet")
        if self.gpu_rule is None:  # no business rules known: every GPU has the default set
            self.gpu_rule = np.zeros(self.gpu_free.shape, dtype=np.int32)
        if self.node_ready is None:  # no node known to be out of service
            self.node_ready = np.ones(len(self.node_names), dtype=bool)

    # ---- shape -----------------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        """Number of nodes (rows)."""
        return len(self.node_names)

    @property
    def max_gpus(self) -> int:
        """Padded GPU slots per node (columns)."""
        return int(self.gpu_free.shape[1])

    def node_index(self, name: str) -> int:
        """Row of a node by name; raises ``KeyError`` for an unknown node."""
        return self._index[name]

    def model_index(self, model: str) -> int:
        """Index of a GPU model in ``models``, or -1 when the fleet has none of it."""
        try:
            return self.models.index(model)
        except ValueError:
            return -1

    def usable_free(self) -> np.ndarray:
        """Free milli per GPU slot that a new task may use: healthy, not in maintenance."""
        return np.where(self.gpu_healthy & ~self.gpu_maintenance, self.gpu_free, 0)

    def allowed(self, task: TaskRequest) -> np.ndarray:
        """``(N, G)``: the GPUs whose business rules let ``task`` start (a reserved GPU, a
        driver other than the task's ``driver`` label, a kind the GPU does not take: no),
        on the site its contract names, if it names one."""
        driver = task.labels.get(TASK_LABEL_DRIVER)
        ok = np.array([r.refusal(task.kind, driver) is None for r in self.rule_sets])[self.gpu_rule]
        if task.site:
            ok = ok & self.on_site(task)[:, None]
        return ok

    def on_site(self, task: TaskRequest) -> np.ndarray:
        """``(N,)``: the nodes on the site ``task``'s contract binds it to (every node when it
        names none; none when the fleet has no such site)."""
        if not task.site:
            return np.ones(self.n_nodes, dtype=bool)
        return self.node_site == (self.sites.index(task.site) if task.site in self.sites else -1)

    def gpu_count(self) -> np.ndarray:
        """GPUs per node."""
        return self.gpu_exists.sum(axis=1)

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def build(
        cls,
        *,
        names: Sequence[str],
        cpu_milli: Sequence[int],
        memory_mb: Sequence[int],
        gpus: Sequence[int],
        models: Sequence[str],
        sites: Sequence[str] | None = None,
        gpu_memory_mb: Sequence[int] | None = None,
        max_gpus: int | None = None,
    ) -> ClusterState:
        """An empty (nothing allocated) cluster from per-node columns.

        GPU links default to NVLink inside a node, NUMA to one domain per half of the GPUs.
        """
        n = len(names)
        g = max(max_gpus or 0, max(gpus) if n else 0, 1)
        model_names = sorted({m for m in models if m})
        site_list = list(sites) if sites is not None else ["default"] * n
        site_names = sorted(set(site_list)) or ["default"]
        exists = np.arange(g)[None, :] < np.asarray(gpus, dtype=np.int64)[:, None]
        mem_each = np.asarray(gpu_memory_mb if gpu_memory_mb is not None else [0] * n, dtype=np.int32)
        per_node = np.asarray(gpus, dtype=np.int64)
        numa = np.where(exists, (np.arange(g)[None, :] * 2) // np.maximum(per_node, 1)[:, None], 0)
        link = np.full((n, g, g), LINK_COST["NV"], dtype=np.int8)
        link[:, np.arange(g), np.arange(g)] = 0
        cpu = np.asarray(cpu_milli, dtype=np.int64)
        mem = np.asarray(memory_mb, dtype=np.int64)
        return cls(
            node_names=list(names),
            models=model_names,
            sites=site_names,
            roles=[""],
            cpu_total=cpu.copy(),
            cpu_free=cpu.copy(),
            mem_total=mem.copy(),
            mem_free=mem.copy(),
            node_model=np.asarray([model_names.index(m) if m else -1 for m in models], dtype=np.int32),
            node_site=np.asarray([site_names.index(s) for s in site_list], dtype=np.int32),
            version=np.zeros(n, dtype=np.int64),
            gpu_exists=exists,
            gpu_free=np.where(exists, MILLI, 0).astype(np.int32),
            gpu_mem_total=np.where(exists, mem_each[:, None], 0).astype(np.int32),
            gpu_mem_free=np.where(exists, mem_each[:, None], 0).astype(np.int32),
            gpu_healthy=exists.copy(),
            gpu_maintenance=np.zeros((n, g), dtype=bool),
            gpu_temp_c=np.full((n, g), 40.0, dtype=np.float32),
            gpu_role=np.zeros((n, g), dtype=np.int32),
            gpu_numa=numa.astype(np.int32),
            gpu_nvlink_util=np.zeros((n, g), dtype=np.float32),
            gpu_link=link,
        )

    @classmethod
    def from_topology(
        cls,
        nodes: Iterable[NodeTopology],
        allocations: Mapping[str, Iterable[Any]] | None = None,
        *,
        temperatures: Mapping[tuple[str, int], float] | None = None,
        unhealthy: Iterable[tuple[str, int]] = (),
        maintenance: Iterable[str] = (),
        not_ready: Iterable[str] = (),
        max_gpus: int | None = None,
    ) -> ClusterState:
        """Build the state from ``contracts.topology.NodeTopology`` records and the ledger.

        ``allocations`` maps a node name to its holds (``contracts.ledger.Allocation``-like:
        ``gpu``, ``milli``, ``memory_mb``, ``cpu_milli``, ``host_memory_mb``). GPU labels
        ``role`` set the business role; ``temperatures`` and ``unhealthy`` come from telemetry;
        nodes listed in ``maintenance`` take no new GPU work; nodes listed in ``not_ready`` take
        no task at all (``node_ready``).
        """
        topo = list(nodes)
        # A node's GPU slots are the indices it reports, which placements name to its executor:
        # a GPU missing from the report leaves its slot empty rather than shifting the next
        # GPUs into it. An index that is negative or not below ``MAX_GPUS_PER_NODE`` names no
        # slot; the first of a repeated index counts.
        slots = [sorted({g.index for g in t.gpus if 0 <= g.index < MAX_GPUS_PER_NODE}) for t in topo]
        state = cls.build(
            names=[t.node for t in topo],
            cpu_milli=[t.cpu_milli for t in topo],
            memory_mb=[t.memory_mb for t in topo],
            gpus=[s[-1] + 1 if s else 0 for s in slots],
            models=[next((g.model for g in t.gpus if g.model), "") for t in topo],
            sites=[t.site for t in topo],
            max_gpus=max_gpus,
        )
        # Mixed-model nodes are rare; the node's model is its first GPU's, per-GPU models
        # would need a per-slot model array that no policy uses yet. A GPU with no model (one
        # fallen off the bus, as the collector reports it) does not name it.
        roles: list[str] = [""]
        rule_index: dict[GpuRules, int] = {GpuRules(): 0}
        # Nodes of one make share their labels and links: each distinct set is worked out
        # once (on the openb fleet, 24,330 links of 1,213 nodes parsed one by one took two
        # thirds of a build, and the policy builds at each topology change).
        rule_of_labels: dict[tuple[tuple[str, str], ...], int] = {}
        link_costs: dict[tuple[Link, ...], np.ndarray] = {}
        # Gathered GPU by GPU, then written into the arrays at once: a NumPy write per GPU and
        # field cost more than the rest of the loop.
        rows: list[int] = []
        cols: list[int] = []
        rules: list[int] = []
        memory: list[int] = []
        numa: list[tuple[int, int, int]] = []
        role_at: list[tuple[int, int, int]] = []
        for i, t in enumerate(topo):
            seen: set[int] = set()
            for gpu in t.gpus:
                j = gpu.index
                if not 0 <= j < MAX_GPUS_PER_NODE or j in seen:
                    continue
                seen.add(j)
                labels = tuple(gpu.labels.items())
                rule = rule_of_labels.get(labels)
                if rule is None:
                    rule = rule_of_labels[labels] = rule_index.setdefault(gpu_rules(gpu.labels), len(rule_index))
                rows.append(i)
                cols.append(j)
                rules.append(rule)
                memory.append(gpu.memory_mb)
                if gpu.numa_node is not None:
                    numa.append((i, j, gpu.numa_node))
                # The fleet labels GPUs with ``business_role``; ``role`` is the short form.
                role = gpu.labels.get("business_role") or gpu.labels.get("role", "")
                if role:
                    if role not in roles:
                        roles.append(role)
                    role_at.append((i, j, roles.index(role)))
            if t.links:
                links = tuple(t.links)
                costs = link_costs.get(links)
                if costs is None:
                    costs = link_costs[links] = _link_costs(((x.a, x.b, x.kind) for x in links), state.max_gpus)
                state.gpu_link[i] = costs
        reported = np.zeros_like(state.gpu_exists)
        reported[rows, cols] = True
        gap = state.gpu_exists & ~reported
        state.gpu_exists[gap] = state.gpu_healthy[gap] = False
        state.gpu_free[gap] = 0
        state.gpu_rule[rows, cols] = rules  # type: ignore[index]
        state.gpu_mem_total[rows, cols] = state.gpu_mem_free[rows, cols] = memory
        for at, column in ((numa, state.gpu_numa), (role_at, state.gpu_role)):
            if at:
                i_s, j_s, values = zip(*at, strict=True)
                column[list(i_s), list(j_s)] = values
        state.roles = roles
        state.rule_sets = list(rule_index)
        # A reading or condition for a slot the fleet lacks (telemetry of a GPU gone from the
        # report) concerns no GPU here; indexed, it crashed the whole snapshot.
        for (node, j), temp in (temperatures or {}).items():
            if node in state._index and 0 <= j < state.max_gpus:
                state.gpu_temp_c[state._index[node], j] = temp
        for node, j in unhealthy:
            if node in state._index and 0 <= j < state.max_gpus:
                state.gpu_healthy[state._index[node], j] = False
        for node in maintenance:
            if node in state._index:
                state.gpu_maintenance[state._index[node], :] = True
        for node in not_ready:
            if node in state._index:
                state.node_ready[state._index[node]] = False  # type: ignore[index]
        for node, holds in (allocations or {}).items():
            if node in state._index:
                state.set_holds(state._index[node], holds)
        return state

    def set_topology(self, node: int, topology: NodeTopology) -> bool:
        """Make row ``node`` what ``from_topology`` builds of ``topology``, nothing held and
        no condition set (the caller applies the node's holds and conditions again), and bump
        the node's version. ``False``, the row unchanged, where it cannot take it in place: the
        row is another node's, or the node has more GPU slots than the fleet's rows, or a GPU
        model or site the fleet has no index for (the tables stay sorted, as a build makes
        them); a build from the records is then needed."""
        one = ClusterState.from_topology([topology], max_gpus=self.max_gpus)
        model = one.models[one.node_model[0]] if one.node_model[0] >= 0 else ""
        site = one.sites[one.node_site[0]]
        if (topology.node != self.node_names[node] or one.max_gpus != self.max_gpus
                or (model and model not in self.models) or site not in self.sites):
            return False
        for name in (*_NODE_ARRAYS, *_GPU_ARRAYS, "gpu_link"):
            if name not in ("version", "node_model", "node_site", "gpu_role", "gpu_rule"):
                getattr(self, name)[node] = getattr(one, name)[0]
        self.node_model[node] = self.models.index(model) if model else -1
        self.node_site[node] = self.sites.index(site)
        self.gpu_role[node] = [_index_in(self.roles, one.roles[r]) for r in one.gpu_role[0]]
        self.gpu_rule[node] = [_index_in(self.rule_sets, one.rule_sets[r]) for r in one.gpu_rule[0]]  # type: ignore[index]
        self.version[node] += 1
        return True

    def set_holds(self, node: int, holds: Iterable[Any]) -> None:
        """Make row ``node``'s free capacity its totals minus ``holds`` (the node's whole
        ledger, ``Allocation``-like as in ``from_topology``), whatever it held before; bumps
        the node's version. A live view applies a changed ledger key with it, row by row."""
        self.cpu_free[node] = self.cpu_total[node]
        self.mem_free[node] = self.mem_total[node]
        self.gpu_free[node] = np.where(self.gpu_exists[node], MILLI, 0)
        self.gpu_mem_free[node] = self.gpu_mem_total[node]
        for hold in holds:
            self.cpu_free[node] -= int(getattr(hold, "cpu_milli", 0))
            self.mem_free[node] -= int(getattr(hold, "host_memory_mb", 0))
            gpu = int(getattr(hold, "gpu", -1))
            # A hold on a slot the fleet lacks (a stale or corrupt ledger row) holds no GPU
            # here, only its CPU and memory; indexed, it failed the whole snapshot.
            if 0 <= gpu < self.max_gpus:
                self.gpu_free[node, gpu] -= int(getattr(hold, "milli", 0))
                self.gpu_mem_free[node, gpu] -= int(getattr(hold, "memory_mb", 0))
        self.version[node] += 1

    def copy(self) -> ClusterState:
        """A deep copy (arrays copied)."""
        kwargs = {name: getattr(self, name).copy() for name in (*_NODE_ARRAYS, *_GPU_ARRAYS, "gpu_link")}
        return ClusterState(
            node_names=list(self.node_names), models=list(self.models), sites=list(self.sites),
            roles=list(self.roles), rule_sets=list(self.rule_sets), **kwargs,
        )

    # ---- incremental updates ---------------------------------------------------------
    def allocate(self, node: int, gpus: Sequence[int], milli: int, *, cpu_milli: int = 0,
                 memory_mb: int = 0, gpu_memory_mb: int = 0) -> None:
        """Hold ``milli`` on each GPU in ``gpus`` (and CPU / memory) of row ``node``.

        Raises ``ValueError`` if the hold does not fit; the state is unchanged then.
        """
        idx = np.asarray(list(gpus), dtype=np.int64)
        if self.cpu_free[node] < cpu_milli or self.mem_free[node] < memory_mb:
            raise ValueError(f"node {self.node_names[node]}: not enough CPU or memory")
        if idx.size and (np.any(~self.gpu_exists[node, idx]) or np.any(self.gpu_free[node, idx] < milli)):
            raise ValueError(f"node {self.node_names[node]}: GPUs {idx.tolist()} cannot hold {milli} milli")
        self.cpu_free[node] -= cpu_milli
        self.mem_free[node] -= memory_mb
        if idx.size:
            self.gpu_free[node, idx] -= milli
            self.gpu_mem_free[node, idx] -= gpu_memory_mb
        self.version[node] += 1

    def set_condition(self, node: int, gpus: Sequence[int], *, healthy: bool | np.ndarray | None = None,
                      maintenance: bool | np.ndarray | None = None) -> None:
        """Set the health and maintenance flags of GPUs ``gpus`` of row ``node`` (a flag left
        ``None`` is unchanged; an array gives one value per GPU) and bump the node's version,
        so that derived-feature caches notice."""
        idx = np.asarray(list(gpus), dtype=np.int64)
        if healthy is not None:
            self.gpu_healthy[node, idx] = healthy
        if maintenance is not None:
            self.gpu_maintenance[node, idx] = maintenance
        self.version[node] += 1

    def release(self, node: int, gpus: Sequence[int], milli: int, *, cpu_milli: int = 0,
                memory_mb: int = 0, gpu_memory_mb: int = 0) -> None:
        """Undo an ``allocate`` with the same arguments (capped at capacity)."""
        idx = np.asarray(list(gpus), dtype=np.int64)
        self.cpu_free[node] = min(self.cpu_total[node], self.cpu_free[node] + cpu_milli)
        self.mem_free[node] = min(self.mem_total[node], self.mem_free[node] + memory_mb)
        if idx.size:
            self.gpu_free[node, idx] = np.minimum(MILLI, self.gpu_free[node, idx] + milli)
            self.gpu_mem_free[node, idx] = np.minimum(self.gpu_mem_total[node, idx],
                                                      self.gpu_mem_free[node, idx] + gpu_memory_mb)
        self.version[node] += 1

    # ---- serialisation ---------------------------------------------------------------
    def to_record(self) -> ClusterStateRecord:
        """The JSON-able record (``msgspec.json.encode`` it)."""
        arrays = {name: getattr(self, name).tolist() for name in (*_NODE_ARRAYS, *_GPU_ARRAYS, "gpu_link")}
        return ClusterStateRecord(node_names=list(self.node_names), models=list(self.models),
                                  sites=list(self.sites), roles=list(self.roles), arrays=arrays,
                                  rule_sets=list(self.rule_sets))

    @classmethod
    def from_record(cls, record: ClusterStateRecord) -> ClusterState:
        """Rebuild a state from ``to_record`` output (one recorded before business rules
        existed reads as a fleet without any)."""
        dtypes = {**_NODE_ARRAYS, **_GPU_ARRAYS, "gpu_link": np.int8}
        kwargs = {name: np.asarray(record.arrays[name], dtype=dt) for name, dt in dtypes.items()
                  if name in record.arrays}
        if not record.node_names:
            # JSON keeps no shape for an empty list: a fleet without nodes has the one padded
            # GPU slot ``build`` gives it, else ``max_gpus`` and every policy fail on it.
            ndim = {name: 1 if name in _NODE_ARRAYS else 2 if name in _GPU_ARRAYS else 3 for name in kwargs}
            kwargs = {name: a.reshape((0,) + (1,) * (ndim[name] - 1)) if a.size == 0 else a
                      for name, a in kwargs.items()}
        _check_arrays(kwargs, len(record.node_names), record.models, record.sites, record.roles,
                      record.rule_sets)
        return cls(node_names=list(record.node_names), models=list(record.models),
                   sites=list(record.sites), roles=list(record.roles), rule_sets=list(record.rule_sets), **kwargs)

    def to_npz_bytes(self) -> bytes:
        """Compact binary snapshot (numpy ``.npz`` in memory; names stored as JSON)."""
        buf = io.BytesIO()
        names = msgspec.json.encode({"node_names": self.node_names, "models": self.models,
                                     "sites": self.sites, "roles": self.roles, "rule_sets": self.rule_sets})
        arrays = {name: getattr(self, name) for name in (*_NODE_ARRAYS, *_GPU_ARRAYS, "gpu_link")}
        np.savez_compressed(buf, _names=np.frombuffer(names, dtype=np.uint8), **arrays)
        return buf.getvalue()

    @classmethod
    def from_npz_bytes(cls, data: bytes) -> ClusterState:
        """Rebuild a state from ``to_npz_bytes`` output."""
        with np.load(io.BytesIO(data)) as z:
            names = msgspec.json.decode(z["_names"].tobytes())
            kwargs = {name: z[name].copy() for name in (*_NODE_ARRAYS, *_GPU_ARRAYS, "gpu_link") if name in z}
        rules = msgspec.convert(names.get("rule_sets", [{}]), list[GpuRules])
        _check_arrays(kwargs, len(names["node_names"]), names["models"], names["sites"], names["roles"],
                      rules)
        return cls(node_names=names["node_names"], models=names["models"], sites=names["sites"],
                   roles=names["roles"], rule_sets=rules, **kwargs)


# What each index array of a snapshot points into (``-1``: no model / no site).
_INDEXES = {"node_model": "models", "node_site": "sites", "gpu_role": "roles", "gpu_rule": "rule_sets"}


def _check_arrays(arrays: Mapping[str, np.ndarray], n: int, models: Sequence[str], sites: Sequence[str],
                  roles: Sequence[str], rule_sets: Sequence[GpuRules]) -> None:
    """Raise ``ValueError`` naming the first array of a read snapshot that is missing, not
    shaped as ``n`` nodes of as many GPU slots as ``gpu_exists`` has, or that indexes past
    the names it refers to: left to the policies, a short array was broadcast or read past."""
    missing = [name for name in (*_NODE_ARRAYS, *_GPU_ARRAYS, "gpu_link")
               if name not in arrays and name not in _OPTIONAL_ARRAYS]
    if missing:
        raise ValueError(f"state record lacks the array {missing[0]!r}")
    exists = arrays["gpu_exists"]
    if exists.ndim != 2:
        raise ValueError(f"state record: array 'gpu_exists' has shape {exists.shape}, "
                         "expected (nodes, GPU slots)")
    g = exists.shape[1]
    for name, a in arrays.items():
        want = (n,) if name in _NODE_ARRAYS else (n, g) if name in _GPU_ARRAYS else (n, g, g)
        if a.shape != want:
            raise ValueError(f"state record: array {name!r} has shape {a.shape}, expected {want}")
    sizes = {"models": len(models), "sites": len(sites), "roles": len(roles), "rule_sets": len(rule_sets)}
    for name, of in _INDEXES.items():
        a = arrays.get(name)
        lowest = -1 if name.startswith("node") else 0  # a node may have no model or site, a GPU no rule
        if a is not None and a.size and (a.max() >= sizes[of] or a.min() < lowest):
            raise ValueError(f"state record: array {name!r} points past its {sizes[of]} {of}")
