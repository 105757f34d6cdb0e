"""The policy framework: plugins at extension points, a registry, profiles, ``Policy``.

Shaped like the kube-scheduler framework. A decision runs, in order:

1. **filter** — every filter plugin returns a boolean mask over nodes; the feasible rows are
   those every filter keeps;
2. **score** — every score plugin scores the feasible rows; a score plugin may also propose
   the GPU it would use on each row (``Cycle.gpu_choice``);
3. **normalise** — the profile's normaliser maps each plugin's scores (e.g. min-max to
   0..100) before they are weighted and summed;
4. **select** — the selector picks one row from the summed scores (ties by node priority);
5. **devices** — the device picker chooses the GPU indices on the selected node;
6. **confidence** — the confidence plugin estimates the probability the action meets its goal.

Plugins are registered by name per extension point and enabled per profile in config with
typed arguments: each plugin class declares an ``Args`` msgspec struct and receives a
validated instance (``msgspec.convert`` turns a YAML/JSON dict into it, rejecting unknown or
mistyped fields with a clear message).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgspec
import numpy as np

from fleetpilot.contracts.decision import Placement

from .state import ClusterState, TaskRequest, request_problem

ExtensionPoint = Literal["filter", "score", "normalise", "select", "devices", "confidence"]
EXTENSION_POINTS: tuple[str, ...] = ("filter", "score", "normalise", "select", "devices", "confidence")


class NoArgs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Arguments of a plugin that takes none."""


@dataclass
class Cycle:
    """Per-decision scratch space shared by the plugins of one decision (like CycleState).

    ``free`` is the usable free milli per GPU; ``rows`` the feasible node rows once filtered;
    ``gpu_choice`` a per-row GPU proposed by a score plugin for a sharing task (-1 = none);
    ``notes`` short reason fragments for the decision's ``reason``.
    """

    state: ClusterState
    task: TaskRequest
    free: np.ndarray
    rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    gpu_choice: np.ndarray | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class Plugin:
    """Base class of every plugin: a ``name``, an ``Args`` struct and the validated ``args``."""

    name: ClassVar[str] = ""
    point: ClassVar[str] = ""
    Args: ClassVar[type[msgspec.Struct]] = NoArgs

    def __init__(self, args: msgspec.Struct | None = None) -> None:
        self.args = args if args is not None else self.Args()


class FilterPlugin(Plugin):
    """Returns a boolean mask over all nodes: True = the node can take the task."""

    point = "filter"

    def filter(self, cycle: Cycle) -> np.ndarray:  # pragma: no cover - interface
        """The feasibility mask ``(N,)``."""
        raise NotImplementedError

    def shortfalls(self, cycle: Cycle) -> list[tuple[str, np.ndarray]]:
        """Why nodes fail this filter, for the reason of a decision that finds no node: pairs
        of what a node lacks and the mask ``(N,)`` of the nodes that lack it (a node may lack
        several things). By default one pair: the plugin's name and the nodes it filters out;
        a filter that checks several things names each."""
        return [(self.name, ~self.filter(cycle))]


class ScorePlugin(Plugin):
    """Scores the feasible rows (``cycle.rows``); higher is better."""

    point = "score"

    def score(self, cycle: Cycle) -> np.ndarray:  # pragma: no cover - interface
        """Scores ``(len(cycle.rows),)``."""
        raise NotImplementedError


class NormalisePlugin(Plugin):
    """Maps one plugin's raw scores to the range the weights assume."""

    point = "normalise"

    def normalise(self, scores: np.ndarray) -> np.ndarray:  # pragma: no cover - interface
        """Normalised scores, same shape."""
        raise NotImplementedError


class SelectPlugin(Plugin):
    """Picks one position in ``cycle.rows`` from the summed scores."""

    point = "select"

    def select(self, cycle: Cycle, total: np.ndarray) -> int:  # pragma: no cover - interface
        """The position (index into ``cycle.rows``) of the chosen node."""
        raise NotImplementedError


class DevicePlugin(Plugin):
    """Chooses GPU indices on the chosen node; returns ``(gpus, milli_per_gpu)``."""

    point = "devices"

    def devices(self, cycle: Cycle, pos: int) -> tuple[list[int], int]:  # pragma: no cover
        """GPU indices and the milli held on each."""
        raise NotImplementedError


class ConfidencePlugin(Plugin):
    """Estimates the probability that placing on (node, gpus) meets the task's goal."""

    point = "confidence"

    def confidence(self, cycle: Cycle, pos: int, gpus: list[int], total: np.ndarray) -> float:  # pragma: no cover
        """A probability in 0..1."""
        raise NotImplementedError


REGISTRY: dict[str, dict[str, type[Plugin]]] = {p: {} for p in EXTENSION_POINTS}
"""Plugin classes by extension point and name."""


def register(cls: type[Plugin]) -> type[Plugin]:
    """Class decorator: register a plugin under its ``point`` and ``name``."""
    if cls.point not in REGISTRY or not cls.name:
        raise ValueError(f"plugin {cls.__name__} needs a known point and a name")
    REGISTRY[cls.point][cls.name] = cls
    return cls


class PluginSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One enabled plugin in a profile: its name, weight (score plugins) and arguments."""

    name: str
    weight: float = 1.0
    args: dict[str, Any] = msgspec.field(default_factory=dict)


class ProfileConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A policy profile: the plugins enabled at each extension point, with their arguments.

    ``no_fit_action`` is the action when no node passes the filters (``queue`` for a live
    fleet where capacity frees up, ``reject`` for a one-shot experiment).
    """

    name: str
    version: str = "1"
    filters: list[PluginSpec] = msgspec.field(default_factory=list)
    scores: list[PluginSpec] = msgspec.field(default_factory=list)
    normalise: PluginSpec = msgspec.field(default_factory=lambda: PluginSpec(name="none"))
    select: PluginSpec = msgspec.field(default_factory=lambda: PluginSpec(name="priority"))
    devices: PluginSpec = msgspec.field(default_factory=lambda: PluginSpec(name="tightest"))
    confidence: PluginSpec = msgspec.field(default_factory=lambda: PluginSpec(name="prior"))
    no_fit_action: Literal["queue", "reject"] = "queue"


class GpuShare(msgspec.Struct, frozen=True, kw_only=True):
    """A share of one GPU on one node (``gpu = -1``: CPU only)."""

    node: str
    gpu: int
    milli: int


class PolicyDecision(msgspec.Struct, frozen=True, kw_only=True):
    """What a policy decided for one task.

    ``confidence`` is the estimated probability the action meets its goal (see each
    profile's confidence plugin); ``node_row`` is the chosen row in the state (-1 if none).
    """

    action: Literal["assign", "queue", "reject"]
    placement: list[GpuShare] = msgspec.field(default_factory=list)
    confidence: float = 0.0
    reason: str = ""
    policy: str = ""
    node_row: int = -1
    fallback: bool = False
    # When no node passes the filters: what keeps the task off them (``Policy.shortfall_summary``).
    shortfall: str = ""

    def placements(self, memory_mb: int = 0) -> list[Placement]:
        """The placement as wire ``contracts.decision.Placement`` records."""
        return [Placement(node=p.node, gpu=p.gpu, milli=p.milli, memory_mb=memory_mb) for p in self.placement]


class PluginConfigError(ValueError):
    """A profile names an unknown plugin or gives it invalid arguments."""


def instantiate(point: str, spec: PluginSpec) -> Plugin:
    """Build one plugin from its spec, validating its arguments."""
    cls = REGISTRY.get(point, {}).get(spec.name)
    if cls is None:
        known = ", ".join(sorted(REGISTRY.get(point, {})))
        raise PluginConfigError(f"unknown {point} plugin {spec.name!r} (known: {known})")
    try:
        args = msgspec.convert(spec.args, cls.Args)
    except msgspec.ValidationError as exc:
        raise PluginConfigError(f"{point} plugin {spec.name!r}: {exc}") from None
    return cls(args)


class Policy:
    """A compiled profile: call ``decide(state, task)`` (pure: the state is not modified).

    ``explain``: a decision that finds no node says what keeps the task off them
    (``shortfall_summary``). It costs about as much again as the refusal itself; a caller that
    never reads it (the fleet benchmark, refused tens of thousands of times a run) leaves it off.
    """

    def __init__(self, config: ProfileConfig, *, explain: bool = True) -> None:
        self.config = config
        self.explain = explain
        self.name = config.name
        self.filters = [instantiate("filter", s) for s in config.filters]
        self.scores = [(instantiate("score", s), float(s.weight)) for s in config.scores]
        self.normaliser = instantiate("normalise", config.normalise)
        self.selector = instantiate("select", config.select)
        self.device_picker = instantiate("devices", config.devices)
        self.confidence_model = instantiate("confidence", config.confidence)

    def __call__(self, state: ClusterState, task: TaskRequest) -> PolicyDecision:
        """Same as ``decide``: a policy is a function of (state, task)."""
        return self.decide(state, task)

    def decide(self, state: ClusterState, task: TaskRequest) -> PolicyDecision:
        """Place one task on the state; never mutates ``state``. A request whose shape no GPU
        can hold (``state.request_problem``) is rejected, saying why."""
        problem = request_problem(task)
        if problem is not None:
            # Left to the plugins, a share over one GPU was proposed as is and a negative size
            # gave capacity back on allocate: no placement is right for it, now or later.
            return PolicyDecision(action="reject", confidence=1.0, policy=self.name,
                                  reason=f"{self.name}: malformed request: {problem}")
        # Business rules are hard: a GPU the task may not use is, for this task, not there.
        cycle = Cycle(state=state, task=task, free=np.where(state.allowed(task), state.usable_free(), 0))
        # The contract's site binds the node, not only its GPUs: a CPU-only task too; and a
        # node out of service as a whole takes no task, one that asks no GPU included.
        mask = state.on_site(task) & state.node_ready
        for f in self.filters:
            mask &= f.filter(cycle)
        cycle.rows = np.flatnonzero(mask)
        if cycle.rows.size == 0:
            shortfall = self.shortfall_summary(cycle) if self.explain else ""
            return PolicyDecision(action=self.config.no_fit_action, confidence=0.95, policy=self.name,
                                  reason="no node passes the filters" + (f" ({shortfall})" if shortfall else ""),
                                  shortfall=shortfall)
        total = np.zeros(cycle.rows.size, dtype=np.float64)
        for plugin, weight in self.scores:
            raw = plugin.score(cycle)
            if np.isnan(raw).any():
                # NaN (a NaN reading in the state, a broken plugin) is no worse and no better
                # than anything: no node would be chosen for a reason, so none is.
                bad = state.node_names[int(cycle.rows[int(np.flatnonzero(np.isnan(raw))[0])])]
                raise ValueError(f"{self.name}: score plugin {plugin.name!r} scored NaN on node {bad}")
            total += weight * self.normaliser.normalise(raw)
        pos = self.selector.select(cycle, total)
        gpus, milli = self.device_picker.devices(cycle, pos)
        row = int(cycle.rows[pos])
        node = state.node_names[row]
        placement = [GpuShare(node=node, gpu=g, milli=milli) for g in gpus] or [GpuShare(node=node, gpu=-1, milli=0)]
        raw_conf = float(self.confidence_model.confidence(cycle, pos, gpus, total))
        if np.isnan(raw_conf):  # clipping keeps NaN: it would be published as a probability
            raise ValueError(f"{self.name}: confidence plugin {self.confidence_model.name!r} gave NaN on node {node}")
        conf = float(np.clip(raw_conf, 0.0, 1.0))
        reason = f"{self.name}: node {node} score {total[pos]:.3g} of {cycle.rows.size} feasible"
        if cycle.notes:
            reason += "; " + "; ".join(cycle.notes)
        return PolicyDecision(action="assign", placement=placement, confidence=conf, reason=reason,
                              policy=self.name, node_row=row)

    def shortfall_summary(self, cycle: Cycle) -> str:
        """What keeps the task off the nodes, as kube-scheduler's ``0/N nodes are available``
        says it: ``0 of N nodes: a lack X, b lack Y``, most common first, a node counted under
        everything it lacks (out of service, off the contract's site, then each filter's
        ``shortfalls``). Worked out only when no node passes, so it costs a placement nothing;
        an operator reading a queued task's reason sees which resource to add or free."""
        state, task = cycle.state, cycle.task
        counts: dict[str, int] = {}
        found = [("out of service", ~state.node_ready), ("off its site", ~state.on_site(task))]
        for f in self.filters:
            found.extend(f.shortfalls(cycle))
        for what, lacking in found:
            n = int(np.count_nonzero(lacking))
            if n:
                counts[what] = counts.get(what, 0) + n
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return f"0 of {state.n_nodes} nodes: " + (", ".join(f"{n} {what}" for what, n in ranked) or "none to place on")


PolicyFn = Callable[[ClusterState, TaskRequest], PolicyDecision]
"""The shape every policy has: a pure function of (state, task)."""
