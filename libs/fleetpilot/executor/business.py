"""Business context the executor must respect, and hooks around lifecycle events.

A :class:`BusinessContextProvider` says, per GPU, what it is for (its *role*), which driver
it is pinned to and which task kinds it may take; it also lists the
:class:`LifecycleHook` s to call at ``before_assign``, ``after_finish`` and
``pre_decommission``. The executor asks before carrying out an ``assign`` or ``migrate``
and refuses (``action.failed``, not retryable) when a rule or hook says no; the policy sees
the same context so it rarely proposes such a placement in the first place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import msgspec

from fleetpilot.contracts import (
    ROLE_RESERVED,
    TASK_LABEL_DRIVER,
    DecisionMade,
    GpuRules,
    Record,
    TaskLifecycle,
)


class GpuContext(Record, frozen=True, kw_only=True):
    """What the business says about one GPU.

    ``role``: ``general`` takes anything, ``reserved`` takes nothing new (kept for a team or
    an incident), any other value (``training``, ``inference``...) is informative.
    ``driver_pin``: tasks labelled ``driver=<version>`` must match it (the version or a
    prefix of it). ``task_kinds``: the kinds allowed here (empty: all). The same rules as
    ``contracts.GpuRules``, which the policies apply from the topology labels.
    """

    node: str
    gpu: int
    role: str = "general"
    driver_pin: str | None = None
    model: str = ""
    task_kinds: list[str] = msgspec.field(default_factory=list)

    @property
    def rules(self) -> GpuRules:
        """The rules this context states, as the policies apply them."""
        return GpuRules(role=self.role, driver=self.driver_pin or "", task_kinds=tuple(self.task_kinds))


class HookVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """A hook's answer: go ahead, or not and why."""

    allow: bool = True
    reason: str = ""


ALLOW = HookVerdict()


@runtime_checkable
class LifecycleHook(Protocol):
    """Code the business runs around lifecycle events; every method must be idempotent."""

    async def before_assign(self, decision: DecisionMade) -> HookVerdict:
        """Whether an ``assign``/``migrate`` may go ahead."""
        ...

    async def after_finish(self, event: TaskLifecycle) -> None:
        """A task ended (finished, failed, evicted, OOM-killed)."""
        ...

    async def pre_decommission(self, node: str, gpu: int, running_tasks: Sequence[str]) -> HookVerdict:
        """Whether a GPU may be pulled from service now."""
        ...


@runtime_checkable
class BusinessContextProvider(Protocol):
    """Per-GPU business rules and the lifecycle hooks to run."""

    def gpu_context(self, node: str, gpu: int) -> GpuContext:
        """The context of one GPU (a ``general`` default when nothing is known)."""
        ...

    def hooks(self) -> Sequence[LifecycleHook]:
        """The hooks to call, in order."""
        ...


class StaticBusinessContext:
    """A :class:`BusinessContextProvider` from fixed data (config files, tests)."""

    def __init__(self, gpus: Sequence[GpuContext] = (), hooks: Sequence[LifecycleHook] = ()) -> None:
        """Index ``gpus`` by (node, gpu) and keep ``hooks`` in order."""
        self._gpus: Mapping[tuple[str, int], GpuContext] = {(g.node, g.gpu): g for g in gpus}
        self._hooks = list(hooks)

    def gpu_context(self, node: str, gpu: int) -> GpuContext:
        """The configured context, or a ``general`` one."""
        return self._gpus.get((node, gpu)) or GpuContext(node=node, gpu=gpu)

    def hooks(self) -> Sequence[LifecycleHook]:
        """The configured hooks."""
        return self._hooks


def rule_verdict(context: GpuContext, decision: DecisionMade) -> HookVerdict:
    """Whether a GPU's role, driver pin and allowed kinds admit the decision's task (pure;
    ``GpuRules.refusal`` decides, as in the policies)."""
    rules = context.rules
    task = decision.task
    if task is None:
        # Nothing known of the task: only the role can say no.
        refusal = rules.refusal("", None) if rules.role == ROLE_RESERVED else None
    else:
        refusal = rules.refusal(task.kind, task.labels.get(TASK_LABEL_DRIVER))
    if refusal is None:
        return ALLOW
    return HookVerdict(allow=False, reason=f"{context.node}/{context.gpu}: {refusal}")


async def check_before_assign(provider: BusinessContextProvider, decision: DecisionMade) -> HookVerdict:
    """Rules of every target GPU, then every hook's ``before_assign``; the first "no" wins."""
    for p in decision.placement:
        if p.gpu < 0:
            continue
        verdict = rule_verdict(provider.gpu_context(p.node, p.gpu), decision)
        if not verdict.allow:
            return verdict
    for hook in provider.hooks():
        verdict = await hook.before_assign(decision)
        if not verdict.allow:
            return verdict
    return ALLOW


async def notify_after_finish(provider: BusinessContextProvider, event: TaskLifecycle) -> None:
    """Call every hook's ``after_finish``."""
    for hook in provider.hooks():
        await hook.after_finish(event)


async def check_pre_decommission(
    provider: BusinessContextProvider, node: str, gpu: int, running_tasks: Sequence[str]
) -> HookVerdict:
    """Every hook's ``pre_decommission``; the first "not yet" wins."""
    for hook in provider.hooks():
        verdict = await hook.pre_decommission(node, gpu, running_tasks)
        if not verdict.allow:
            return verdict
    return ALLOW
