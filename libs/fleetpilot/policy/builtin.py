"""The built-in policy profiles: k8s-default, bestfit, packing, fgd and fleetpilot.

Each is a ``ProfileConfig`` (plain data): the service can store it in the config bucket,
edit plugin weights and arguments, and ``build_policy`` compiles it. The baselines reproduce
the FGD paper's (USENIX ATC'23) reference simulator; ``fleetpilot`` is ours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from . import plugins as _plugins  # noqa: F401  (registers the built-in plugins)
from .fragmentation import TaskShape
from .framework import PluginSpec, Policy, ProfileConfig

BUILTIN_POLICIES: tuple[str, ...] = ("k8s-default", "bestfit", "packing", "fgd", "fleetpilot")
"""Names accepted by ``builtin_profile``."""

_FEASIBLE = [PluginSpec(name="node-resources"), PluginSpec(name="gpu-model")]

FLEETPILOT_CPU_WEIGHT = 2.0
"""Weight of fleetpilot's CPU-stranding term (``fleetpilot-frag``'s ``cpu_weight``). Chosen
on the openb tuning seeds (0-9, variant seed 3): at 1 a CPU-heavy multi-GPU task would
rather leave a node's last GPUs without the cores to use them, lost for good, than break an
idle node the demand pressure keeps for the 8-GPU classes; 3 gains nothing more."""


def _typical_args(typical: Sequence[TaskShape] | None) -> list[dict[str, Any]]:
    return [msgspec.to_builtins(s) for s in (typical or [])]


def builtin_profile(name: str, *, seed: int = 0, typical: Sequence[TaskShape] | None = None,
                    no_fit_action: str = "queue", pressure_weight: float = 1.0,
                    demand: Sequence[TaskShape] | None = None) -> ProfileConfig:
    """The profile of a built-in policy.

    ``seed`` draws the node priority that breaks score ties; ``typical`` is the typical-task
    distribution for fgd / fleetpilot (derive it from the tasks seen, e.g.
    ``fragmentation.typical_tasks``); ``demand`` is the full shape distribution fleetpilot's
    demand pressure prices capacity with (e.g. ``typical_tasks(seen, coverage=1.0)``: rare
    multi-GPU classes matter for the capacity they need even when they are few; default:
    ``typical``).
    """
    select = PluginSpec(name="priority", args={"seed": seed})
    common: dict[str, Any] = {"select": select, "no_fit_action": no_fit_action}
    if name == "k8s-default":
        whole = {"whole_gpus_only": True}
        return ProfileConfig(
            name=name,
            filters=[PluginSpec(name="node-resources", args=whole), PluginSpec(name="gpu-model")],
            scores=[PluginSpec(name="least-allocated")],
            devices=PluginSpec(name="first-free", args=whole),
            **common,
        )
    if name == "bestfit":
        return ProfileConfig(name=name, filters=list(_FEASIBLE), scores=[PluginSpec(name="bestfit")],
                             normalise=PluginSpec(name="min-max"), devices=PluginSpec(name="tightest"), **common)
    if name == "packing":
        return ProfileConfig(name=name, filters=list(_FEASIBLE), scores=[PluginSpec(name="packing")],
                             devices=PluginSpec(name="tightest"), **common)
    if name == "fgd":
        return ProfileConfig(name=name, filters=list(_FEASIBLE),
                             scores=[PluginSpec(name="fgd", args={"typical": _typical_args(typical)})],
                             devices=PluginSpec(name="scored"), **common)
    if name == "fleetpilot":
        frag: dict[str, Any] = {"typical": _typical_args(typical), "pressure_weight": pressure_weight,
                                "cpu_weight": FLEETPILOT_CPU_WEIGHT}
        if demand is not None:
            frag["demand"] = _typical_args(demand)
        return ProfileConfig(
            name=name,
            filters=list(_FEASIBLE),
            scores=[
                PluginSpec(name="fleetpilot-frag", args=frag),
                # Smooth side terms: zero or constant across nodes when the fleet reports no
                # memory predictions, temperatures, roles or NVLink load (as in openb).
                PluginSpec(name="oom-risk", weight=0.2),
                PluginSpec(name="thermal", weight=0.02),
                PluginSpec(name="role-affinity", weight=0.05),
                PluginSpec(name="topology", weight=0.1),
            ],
            devices=PluginSpec(name="scored"),
            confidence=PluginSpec(name="fleetpilot"),
            **common,
        )
    raise ValueError(f"unknown built-in policy {name!r} (known: {', '.join(BUILTIN_POLICIES)})")


def build_policy(profile: ProfileConfig | Mapping[str, Any] | str, *, explain: bool = True, **kwargs: Any) -> Policy:
    """Compile a profile into a ``Policy``.

    ``profile`` is a ``ProfileConfig``, its dict form (from YAML/JSON config, validated), or
    the name of a built-in (``kwargs`` then go to ``builtin_profile``). ``explain``: whether a
    refusal says what keeps the task off the nodes (``Policy``).
    """
    if isinstance(profile, str):
        return Policy(builtin_profile(profile, **kwargs), explain=explain)
    if isinstance(profile, Mapping):
        try:
            profile = msgspec.convert(dict(profile), ProfileConfig)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid policy profile: {exc}") from None
    return Policy(profile, explain=explain)
