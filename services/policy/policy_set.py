"""The policies a replica decides with, compiled from config, and the atomic swap between them.

Three inputs change at run time: the configuration document (the ``config`` bucket, key
``policies.<hostname>`` falling back to ``policies.default``, else the service settings),
the profiles of the hot-reloaded plugin modules, and the historical success table that the
fallback scheduler is built from. ``ActivePolicies`` keeps the latest good value of each,
compiles a complete, immutable ``PolicySet`` when one of them changes, and only then
replaces ``current``. A handler takes ``current`` once per decision, so a swap always falls
between two decisions, and an input that does not compile leaves the previous set serving.

Circuit breakers outlive the swaps (they are keyed by policy name and breaker config): a
fixed module does not reset a breaker that opened on the broken one, so traffic goes back
to the primary through the breaker's half-open probe after its cooldown, as designed. A swap
that leaves an open breaker guarding nothing (its policy gone, or a new breaker config, which
starts closed) reports it closed (``on_breaker``), so the operators' gauge does not stay open.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fleetpilot.policy import (
    REGISTRY,
    BreakerConfig,
    CircuitBreaker,
    FallbackScheduler,
    GuardedPolicy,
    Policy,
    ProfileConfig,
    Router,
    RouteRule,
    SuccessStat,
    build_policy,
    builtin_profile,
)
from fleetpilot.policy.builtin import BUILTIN_POLICIES
from fleetpilot.policy.fallback import BreakerState, Outcome
from fleetpilot.policy.fragmentation import TaskShape, typical_tasks
from fleetpilot.policy.framework import PolicyDecision
from fleetpilot.policy.state import ClusterState, TaskRequest
from fleetpilot.policy.vetting import DEFAULT_IMPORT_TIMEOUT_S

log = logging.getLogger("fleetpilot.policy.config")

CONFIG_PREFIX = "policies."
DEFAULT_CONFIG_KEY = CONFIG_PREFIX + "default"


def config_key(hostname: str) -> str:
    """The ``config`` bucket key of a host: the issue's ``policies/<hostname>``.

    The path separator becomes a dot so that every host key is a subject token under
    ``policies.`` and one watch on ``policies.>`` sees the host's key and the default;
    characters a KV key cannot hold become ``_`` (a dotted hostname keeps its dots).
    """
    safe = "".join(c if c.isalnum() or c in "-_=." else "_" for c in hostname).strip(".") or "_"
    return CONFIG_PREFIX + safe


class PolicyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One configuration document (JSON in the ``config`` bucket).

    ``profile`` is the default policy: a built-in or plugin profile name, or a profile dict
    (``ProfileConfig`` form). ``shaping`` routes a share of matching tasks to other named
    policies; ``profiles`` defines named profiles those rules may use (``fleetpilot-v2``);
    ``breaker`` sets the circuit breaker of every policy; ``seed`` breaks score ties.
    Unknown fields are refused so that a typo is reported instead of silently ignored.
    """

    profile: str | dict[str, Any] = "fleetpilot"
    shaping: list[RouteRule] = msgspec.field(default_factory=list)
    profiles: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    breaker: BreakerConfig = msgspec.field(default_factory=BreakerConfig)
    seed: int = 0


def parse_config(data: bytes) -> PolicyConfig:
    """Decode and validate a configuration document; ``ValueError`` with the reason."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"invalid policy config: {exc}") from None
    return load_config(raw)


def load_config(raw: Any) -> PolicyConfig:
    """A configuration document from its decoded JSON (the ``config`` bucket's value, or the
    settings'); ``ValueError`` with the reason for a field no struct of it has, at any depth,
    or for a breaker that makes no sense (``check_breaker``).

    The nested structs (a shaping rule, the breaker, a profile and its plugins) are the
    library's, which drop a field they do not know for its default: a rule's misspelt
    ``weight`` sent every matching task to the canary (a weight of 1), and nothing said so."""
    strays = _stray_fields(raw, PolicyConfig, "")
    if strays:
        raise ValueError(f"invalid policy config: unknown field{'s' if len(strays) > 1 else ''} "
                         f"{', '.join(strays)}")
    try:
        config = msgspec.convert(raw, PolicyConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid policy config: {exc}") from None
    check_breaker(config.breaker)
    return config


# The fields typed ``Any`` in the document that hold profiles (``ProfileConfig`` form).
_PROFILE_FIELDS: dict[tuple[type, str], Any] = {
    (PolicyConfig, "profile"): ProfileConfig,
    (PolicyConfig, "profiles"): dict[str, ProfileConfig],
}


def _stray_fields(value: Any, kind: Any, where: str) -> list[str]:
    """The keys of ``value`` (decoded JSON) that no field of the struct ``kind`` stands for,
    at any depth, each with its path (``shaping[0].wieght``)."""
    info = kind if isinstance(kind, msgspec.inspect.Type) else msgspec.inspect.type_info(kind)
    if isinstance(info, msgspec.inspect.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        out = [where + str(k) for k in value if k not in fields]
        for k, t in fields.items():
            if k in value:
                out += _stray_fields(value[k], _PROFILE_FIELDS.get((info.cls, k), t), f"{where}{k}.")
        return out
    if isinstance(info, msgspec.inspect.ListType) and isinstance(value, list):
        return [s for i, v in enumerate(value) for s in _stray_fields(v, info.item_type, f"{where.rstrip('.')}[{i}].")]
    if isinstance(info, msgspec.inspect.DictType) and isinstance(value, dict):
        return [s for k, v in value.items() for s in _stray_fields(v, info.value_type, f"{where}{k}.")]
    if isinstance(info, msgspec.inspect.UnionType):
        return [s for t in info.types for s in _stray_fields(value, t, where)]
    return []


def check_breaker(breaker: BreakerConfig) -> None:
    """``ValueError`` naming every field of a breaker config that makes no sense.

    Before, any number was taken: a time budget of 0 or below, or a confidence floor above 1,
    judged every decision a failure (every task to the fallback), NaN never did; a threshold
    or probe count of 0 opened the breaker at once or closed it without a probe; a negative
    cooldown probed on every call, an infinite one never again."""
    problems = []
    if breaker.failure_threshold < 1:
        problems.append(f"breaker.failure_threshold is {breaker.failure_threshold}: must be at least 1")
    if breaker.probe_successes < 1:
        problems.append(f"breaker.probe_successes is {breaker.probe_successes}: must be at least 1")
    if not (math.isfinite(breaker.cooldown_s) and breaker.cooldown_s >= 0):
        problems.append(f"breaker.cooldown_s is {breaker.cooldown_s}: must be finite and not negative")
    if not (math.isfinite(breaker.time_budget_s) and breaker.time_budget_s > 0):
        problems.append(f"breaker.time_budget_s is {breaker.time_budget_s}: must be finite and above 0")
    if not 0.0 <= breaker.confidence_floor <= 1.0:
        problems.append(f"breaker.confidence_floor is {breaker.confidence_floor}: must be in 0..1")
    if problems:
        raise ValueError(f"invalid policy config: {'; '.join(problems)}")


HANG_LIMIT_MIN_S = 1.0
HANG_LIMIT_BUDGETS = 10.0
"""A primary still deciding after ``HANG_LIMIT_BUDGETS`` times its breaker's time budget (at
least ``HANG_LIMIT_MIN_S``) is given up on (``hang_limit_s``)."""


def hang_limit_s(breaker: BreakerConfig) -> float:
    """How long a decision waits for a primary before the fallback decides it instead."""
    return max(HANG_LIMIT_MIN_S, HANG_LIMIT_BUDGETS * breaker.time_budget_s)


class PolicyHung(TimeoutError):
    """A primary that has not answered within its hang limit, or is still deciding an earlier
    task it did not answer in time (the breaker reads it as a ``timeout``)."""


class PlacementShort(ValueError):
    """A primary's ``assign`` that holds short of the request (``replica.placement_problem``)."""


@dataclass
class _Call:
    """One primary call handed to the worker thread, and what became of it."""

    fn: Callable[[], PolicyDecision]
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    value: PolicyDecision | None = None
    error: BaseException | None = None
    finished: bool = False
    abandoned: Callable[[], None] | None = None


class PrimaryRunner:
    """Runs primary policies on a worker thread and waits for each at most its hang limit.

    Decisions run on the event loop: a primary (a module's plugin) that never returns stopped
    the replica's every decision, message and heartbeat for good, since the breaker judges a
    call only once it has returned. Given up on, the call is left to its thread (a daemon:
    nothing in-process can stop Python code), the next call gets a fresh thread, and the same
    policy is not called again until that call has returned (``PolicyHung`` meanwhile): its
    policy object is never used by two threads at once, and a policy that hangs every time
    holds one thread, not one per probe. Only the policies that use a module's plugins run
    here (``runs_operator_code``); the library's own decide on the caller's thread.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Call] | None = None
        # Keys of the primaries whose call was given up on and has not returned yet.
        self._stuck: set[object] = set()

    @staticmethod
    def _work(jobs: queue.SimpleQueue[_Call]) -> None:
        while True:
            call = jobs.get()
            try:
                value, error = call.fn(), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who judges it
                value, error = None, exc
            with call.lock:
                call.value, call.error, call.finished = value, error, True
                abandoned = call.abandoned
            call.done.set()
            if abandoned is not None:
                abandoned()
                return  # the caller has a fresh thread by now; this one is done

    def call(self, key: object, limit_s: float, fn: Callable[[], PolicyDecision], name: str) -> PolicyDecision:
        """``fn()`` on the worker thread; ``PolicyHung`` when it has not returned within
        ``limit_s``, or the primary ``key`` is still in a call given up on."""
        if key in self._stuck:
            raise PolicyHung(f"policy {name} is still deciding a task it was given up on")
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(self._jobs,), name=f"policy-{name}", daemon=True).start()
        # In the caller's context: the plugins' log lines keep the decision's trace.
        call = _Call(functools.partial(contextvars.copy_context().run, fn))
        self._jobs.put(call)
        if not call.done.wait(limit_s):
            with call.lock:
                if not call.finished:
                    self._stuck.add(key)
                    call.abandoned = functools.partial(self._stuck.discard, key)
                    self._jobs = None
                    log.error("policy %s has not answered in %.1f s; given up on, the fallback scheduler decides "
                              "until it has", name, limit_s)
                    raise PolicyHung(f"policy {name} did not answer in {limit_s:g} s")
        if isinstance(call.error, Exception):
            raise call.error
        if call.error is not None:
            # SystemExit (a plugin that calls sys.exit, or argparse on the service's arguments)
            # went past the breaker, which catches failures, and out of the event loop.
            raise RuntimeError(f"policy {name} raised {type(call.error).__name__}: {call.error}") from call.error
        return call.value  # type: ignore[return-value]


def _plugins_of(profile: ProfileConfig) -> list[Any]:
    """The plugin classes a profile names, as registered now (``None`` for an unknown one)."""
    points = {"filter": profile.filters, "score": profile.scores, "normalise": [profile.normalise],
              "select": [profile.select], "devices": [profile.devices], "confidence": [profile.confidence]}
    return [REGISTRY[point].get(spec.name) for point, specs in points.items() for spec in specs]


def runs_operator_code(profile: ProfileConfig) -> bool:
    """Whether ``profile`` uses a plugin that is not the library's own (one a policy module
    registered): only such a policy may hang, and only it pays the hop to the worker thread
    (~0.15 ms a decision on a busy host, the state's arrays read from another core)."""
    return any(not getattr(cls, "__module__", "").startswith("fleetpilot.") for cls in _plugins_of(profile))


class PolicyBuilds:
    """Builds the policies that use a module's plugins on a thread of their own, waited for at
    most ``limit_s``: a plugin constructor (or its ``Args``) that never returns on the
    arguments a profile gives it stopped the swap, on the event loop, and with it the replica
    for good. Such a build is refused (``PolicyHung``: the swap fails, the previous set
    serves); the same profile with the same plugin classes is refused at once until that
    build has returned, so a stuck build holds one thread, not one per swap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stuck: set[object] = set()

    def build(self, profile: ProfileConfig, limit_s: float) -> Policy:
        """``build_policy(profile)``, on a thread when it runs operator code."""
        if not runs_operator_code(profile):
            return build_policy(profile)
        key = (msgspec.json.encode(profile), tuple(id(cls) for cls in _plugins_of(profile)))
        with self._lock:
            if key in self._stuck:
                raise PolicyHung(f"policy {profile.name}: an earlier build of it has not returned")
        done, box = threading.Event(), {}

        def work() -> None:
            try:
                box["policy"] = build_policy(profile)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
            with self._lock:
                done.set()
                self._stuck.discard(key)

        threading.Thread(target=work, name=f"policy-build-{profile.name}", daemon=True).start()
        if not done.wait(limit_s):
            with self._lock:
                if not done.is_set():
                    self._stuck.add(key)
                    raise PolicyHung(f"policy {profile.name} was not built within {limit_s:g} s "
                                     "(a plugin's constructor did not return)")
        error = box.get("error")
        if isinstance(error, Exception):
            raise error
        if error is not None:  # SystemExit: a failure of this build, not the replica's exit
            raise RuntimeError(f"policy {profile.name}: building it raised {type(error).__name__}: {error}")
        return box["policy"]


def _primary(runner: PrimaryRunner | None, name: str, decide: Callable[[ClusterState, TaskRequest], PolicyDecision],
             key: object, limit_s: float) -> Callable[[ClusterState, TaskRequest], PolicyDecision]:
    """The primary a breaker guards: ``decide`` (run by ``runner`` within ``limit_s``, when
    given), and an ``assign`` that holds short of the request raised as ``PlacementShort``.

    Judged after the guarded call (``replica.checked_decide``), a short placement was recorded
    as a failure right after the breaker had recorded the same call as a success: the ``ok``
    reset the count, so with a threshold above 1 the breaker never opened (every decision went
    to the fallback, the gauge said closed), and a half-open probe closed it before the failure
    was counted."""

    def primary(state: ClusterState, task: TaskRequest) -> PolicyDecision:
        choice = (decide(state, task) if runner is None
                  else runner.call(key, limit_s, functools.partial(decide, state, task), name))
        if choice.action == "assign":
            from .replica import placement_problem  # replica imports this module

            problem = placement_problem(choice, task)
            if problem is not None:
                log.warning("policy %s: %s: %s; the fallback scheduler decides it", name, task.task_id, problem)
                raise PlacementShort(problem)
        return choice

    return primary


@dataclass(frozen=True)
class PluginProfile:
    """A profile exported by a hot-reloaded module, with the module content's version."""

    profile: ProfileConfig
    version: str
    module: str


@dataclass(frozen=True)
class PolicySet:
    """Everything one decision needs, compiled and immutable: never edited, only replaced."""

    default: str
    guarded: Mapping[str, GuardedPolicy]
    policies: Mapping[str, Policy]
    versions: Mapping[str, str]
    router: Router
    source: str
    generation: int

    def route(self, task: Any) -> tuple[str, str]:
        """The policy name and shard id for a task (deterministic by task id)."""
        return self.router.route(task)


@dataclass
class ActivePolicies:
    """The latest good inputs, the compiled ``current`` set and the swap (module docstring).

    ``on_swap(kind, seconds)`` is told how long each successful rebuild took (metrics).
    """

    config: PolicyConfig
    source: str = "settings"
    plugins: Mapping[str, PluginProfile] = field(default_factory=dict)
    stats: Sequence[SuccessStat] = ()
    # The task shapes this replica has seen: FGD's typical tasks and fleetpilot's demand.
    typical: Sequence[TaskShape] = ()
    demand: Sequence[TaskShape] = ()
    on_swap: Callable[[str, float], None] | None = None
    # Told ``(policy, new state, outcome)`` when a policy's breaker opens or closes.
    on_breaker: Callable[[str, BreakerState, Outcome], None] | None = None
    current: PolicySet = field(init=False)
    # The latest configuration refused because it did not compile, with its source: tried
    # again when the plugin modules change (it may name a profile of a module not loaded yet).
    refused: tuple[PolicyConfig, str] | None = None
    _breakers: dict[tuple[str, BreakerConfig], CircuitBreaker] = field(default_factory=dict)
    # A policy that uses a module's plugins not built within this is refused (``PolicyBuilds``).
    build_limit_s: float = DEFAULT_IMPORT_TIMEOUT_S
    _generation: int = 0
    _runner: PrimaryRunner = field(default_factory=PrimaryRunner)
    _builds: PolicyBuilds = field(default_factory=PolicyBuilds)

    def __post_init__(self) -> None:
        self.current = self._compile(self.config, self.source, self.plugins, self.stats)

    def _breaker_changed(self, name: str, state: BreakerState, outcome: Outcome) -> None:
        if self.on_breaker is not None:
            self.on_breaker(name, state, outcome)

    def apply_config(self, config: PolicyConfig, source: str) -> bool:
        """Swap in a new configuration; ``False`` (previous set kept) if it does not compile,
        and it is then tried again with the next plugin modules (``apply_plugins``)."""
        applied = self._swap("config", config, source, self.plugins, self.stats)
        self.refused = None if applied else (config, source)
        return applied

    def apply_plugins(self, plugins: Mapping[str, PluginProfile], started: float | None = None) -> bool:
        """Swap in the plugin directory's current profiles; ``started`` (``perf_counter``)
        is when the reload began, so that the measured time includes the module import.

        A configuration refused since (it named a profile of a module not loaded then) is
        applied with them when it compiles now. Before, it was dropped: the replica kept the
        old policies until the key was written again, while a replica started after the
        module came served the new ones."""
        if self.refused is not None:
            config, source = self.refused
            if self._swap("module", config, source, dict(plugins), self.stats, started):
                self.refused = None
                return True
        return self._swap("module", self.config, self.source, dict(plugins), self.stats, started)

    def apply_stats(self, stats: Sequence[SuccessStat]) -> bool:
        """Rebuild the fallback scheduler from a new success table."""
        return self._swap("stats", self.config, self.source, self.plugins, list(stats))

    def apply_workload(self, tasks: Sequence[TaskRequest]) -> bool:
        """Rebuild the built-in profiles on the task shapes seen: FGD's typical tasks (95%
        coverage) and every class for fleetpilot's demand pressure. ``False`` when the
        shapes did not change (nothing to rebuild) or the rebuild failed."""
        typical, demand = typical_tasks(tasks, coverage=0.95), typical_tasks(tasks, coverage=1.0)
        if list(typical) == list(self.typical) and list(demand) == list(self.demand):
            return False
        previous = (self.typical, self.demand)
        self.typical, self.demand = typical, demand
        if not self._swap("workload", self.config, self.source, self.plugins, self.stats):
            self.typical, self.demand = previous
            return False
        return True

    def _swap(
        self,
        kind: str,
        config: PolicyConfig,
        source: str,
        plugins: Mapping[str, PluginProfile],
        stats: Sequence[SuccessStat],
        started: float | None = None,
    ) -> bool:
        start = time.perf_counter() if started is None else started
        try:
            compiled = self._compile(config, source, plugins, stats)
        except Exception as exc:  # noqa: BLE001 - any bad input keeps the previous set serving
            log.error(
                "policy %s change not applied (%s); still serving generation %d from %s",
                kind,
                exc,
                self.current.generation,
                self.current.source,
            )
            return False
        self.config, self.source, self.plugins, self.stats = config, source, plugins, stats
        previous, self.current = self.current, compiled
        for name, guarded in previous.guarded.items():
            serving = compiled.guarded.get(name)
            if guarded.breaker.state != "closed" and (serving is None or serving.breaker.state == "closed"):
                # The open breaker guards nothing now (a new breaker config, the policy gone):
                # its decisions no longer go to the fallback, and only this says so, for that
                # breaker will never record again.
                self._breaker_changed(name, "closed", "ok")
        # A breaker that guards nothing now is forgotten, as reported: kept, a config switched
        # back to brought it back still open (every decision to the fallback, the gauge at 0),
        # and every breaker config ever applied kept its breakers for good.
        in_service = {id(g.breaker) for g in compiled.guarded.values()}
        for key in [k for k, b in self._breakers.items() if id(b) not in in_service]:
            del self._breakers[key]
        elapsed = time.perf_counter() - start
        if self.on_swap is not None:
            self.on_swap(kind, elapsed)
        log.info(
            "policies swapped after a %s change in %.1f ms: default %s, %d rule(s), generation %d (%s)",
            kind,
            elapsed * 1e3,
            compiled.default,
            len(config.shaping),
            compiled.generation,
            source,
        )
        return True

    def _profile(
        self, name: str, config: PolicyConfig, plugins: Mapping[str, PluginProfile]
    ) -> tuple[ProfileConfig, str]:
        # Config-defined profiles first (the operator's explicit word), then plugin modules,
        # then the built-ins: a module may shadow a built-in name to replace it live.
        if name in config.profiles:
            prof = msgspec.convert({"name": name, **config.profiles[name]}, ProfileConfig)
            return prof, prof.version
        if name in plugins:
            return plugins[name].profile, plugins[name].version
        if name in BUILTIN_POLICIES:
            prof = builtin_profile(name, seed=config.seed, typical=list(self.typical) or None,
                                   demand=list(self.demand) or None)
            return prof, prof.version
        known = sorted({*config.profiles, *plugins, *BUILTIN_POLICIES})
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(known)})")

    def _compile(
        self,
        config: PolicyConfig,
        source: str,
        plugins: Mapping[str, PluginProfile],
        stats: Sequence[SuccessStat],
    ) -> PolicySet:
        profiles: dict[str, tuple[ProfileConfig, str]] = {}
        if isinstance(config.profile, dict):
            try:
                inline = msgspec.convert(config.profile, ProfileConfig)
            except msgspec.ValidationError as exc:
                raise ValueError(f"invalid profile: {exc}") from None
            default = inline.name
            profiles[default] = (inline, inline.version)
        else:
            default = config.profile
        for name in {default, *(rule.policy for rule in config.shaping)}:
            if name not in profiles:
                profiles[name] = self._profile(name, config, plugins)
        check_breaker(config.breaker)  # a document built by hand, not only one read from JSON
        router = Router(config.shaping, default=default)  # validates conditions and weights
        fallback = FallbackScheduler(stats)
        policies = {name: self._builds.build(prof, self.build_limit_s) for name, (prof, _) in profiles.items()}
        guarded = {}
        for name, policy in policies.items():
            breaker = self._breakers.get((name, config.breaker))
            if breaker is None:
                breaker = self._breakers[(name, config.breaker)] = CircuitBreaker(
                    config.breaker, on_change=functools.partial(self._breaker_changed, name))
            # Keyed as its breaker, which outlives swaps: a policy given up on is not called
            # again, rebuilt or not, until its stuck call has returned.
            runner = self._runner if runs_operator_code(profiles[name][0]) else None
            primary = _primary(runner, name, policy.decide, (name, config.breaker), hang_limit_s(config.breaker))
            guarded[name] = GuardedPolicy(primary, fallback, breaker)
        self._generation += 1
        return PolicySet(
            default=default,
            guarded=guarded,
            policies=policies,
            versions={name: version for name, (_, version) in profiles.items()},
            router=router,
            source=source,
            generation=self._generation,
        )


def success_table(groups: Sequence[Any]) -> list[SuccessStat]:
    """Feedback statistics grouped by (task_kind, gpu_model) as the fallback's success table.

    ``groups`` are ``contracts.feedback.StatsGroup`` records; a group without both keys
    (feedback from before the executor recorded them) says nothing about a pair and is skipped.
    """
    out = []
    for g in groups:
        kind, model = g.key.get("task_kind", ""), g.key.get("gpu_model", "")
        if kind and model:
            out.append(
                SuccessStat(
                    task_kind=kind,
                    gpu_model=model,
                    successes=int(g.successes),
                    failures=max(0, int(g.count) - int(g.successes)),
                )
            )
    return out
