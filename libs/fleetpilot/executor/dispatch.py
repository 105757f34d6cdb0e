"""Carrying out one decision on a backend, exactly once.

:func:`execute_decision` is what the executor service calls for each ``decision.made``: it
looks the decision up in the :class:`~fleetpilot.executor.journal.ExecutionJournal` (a
redelivery returns the recorded result and does nothing), asks the business context,
claims it, runs the verb on the backend and records the resulting ``action.executed`` or
``action.failed``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping

from fleetpilot.contracts import ActionExecuted, ActionFailed, DecisionMade

from .backend import BackendError, ExecutorBackend, resumes
from .business import BusinessContextProvider, check_before_assign
from .journal import ActionResult, ExecutionJournal
from .locks import Clock


def action_id_for(decision_id: str) -> str:
    """The action id of a decision: derived, so every replica and retry agrees on it."""
    return f"act-{decision_id}"


def carried_out_on(decision: DecisionMade, node: str) -> bool:
    """Whether the executor of ``node`` carries ``decision`` out: an assign, a resize or a
    move whose placement is on ``node`` (a move between nodes belongs to its target, where
    the task is to run), an eviction from it. A decision that names no node (``queue``,
    ``reject``) is for every node's executor: the first to claim it in the journal
    acknowledges it, as among the replicas of one executor."""
    if decision.action == "evict":
        return any(p.node == node for p in decision.source)
    if decision.action in ("assign", "migrate", "resize"):
        return any(p.node == node for p in decision.placement)
    return not decision.placement and not decision.source


def _gpu_model(decision: DecisionMade, business: BusinessContextProvider | None) -> str:
    if business is None:
        return ""
    for p in decision.placement or decision.source:
        if p.gpu >= 0:
            return business.gpu_context(p.node, p.gpu).model
    return ""


async def _run(
    decision: DecisionMade, backend: ExecutorBackend, grace_s: float, env: Mapping[str, str]
) -> float:
    """Run the verb; returns the backend latency in ms."""
    began = time.perf_counter()
    if decision.action == "assign":
        command = (decision.task.command if decision.task else None) or []
        full_env = {**env, "FLEETPILOT_DECISION_ID": decision.decision_id}
        handle = await backend.start(decision.task_id, decision.placement, command, full_env)
        return handle.latency_ms or (time.perf_counter() - began) * 1000.0
    if decision.action == "migrate":
        handle = await backend.migrate(decision.task_id, decision.placement, source=decision.source, grace_s=grace_s,
                                       resumes=resumes(decision))
        return handle.latency_ms or (time.perf_counter() - began) * 1000.0
    if decision.action == "evict":
        await backend.stop(decision.task_id, grace_s)
    elif decision.action == "resize":
        share = next((p for p in decision.placement if p.gpu >= 0), None)
        if share is None:
            raise BackendError("resize decision without a GPU share")
        await backend.resize(decision.task_id, share.milli, share.memory_mb)
    # queue and reject change nothing on the backend: executing them is acknowledging them.
    return (time.perf_counter() - began) * 1000.0


async def execute_decision(
    decision: DecisionMade,
    backend: ExecutorBackend,
    journal: ExecutionJournal,
    *,
    owner: str,
    business: BusinessContextProvider | None = None,
    grace_s: float = 30.0,
    env: Mapping[str, str] | None = None,
    clock: Clock = time.time,
    still_reserved: Callable[[DecisionMade], Awaitable[bool]] | None = None,
) -> ActionResult | None:
    """Execute ``decision`` once; ``None`` when another replica has claimed it and is running it.

    A decision already executed returns its recorded result unchanged (to be republished
    with the same ``Nats-Msg-Id``, which the stream deduplicates). With ``still_reserved``,
    an assign or a move whose reservation is no longer in the ledger is void and fails
    without retry: its capacity was given back since it was decided (the node went silent
    and its tasks were placed again), and carrying it out late would run the task twice.
    """
    recorded = await journal.result(decision.decision_id)
    if recorded is not None:
        return recorded
    checked = time.perf_counter()  # a refusal's latency is its checks': it took them to fail
    # The checks come before the claim: they read the ledger and run the business's hooks,
    # either of which may raise (a KV read timing out, a hook's bug). Raised after the
    # claim, that left the decision claimed with no result, and every redelivery was told
    # "another replica runs it" until the runtime dead-lettered it, never carried out. Raised
    # here, the redelivery checks again, and a lasting failure is dead-lettered with its cause.
    refusal = ""
    if still_reserved is not None and decision.action in ("assign", "migrate") and not await still_reserved(decision):
        refusal = "void: its reservation is no longer in the ledger (given back since it was decided)"
    elif business is not None and decision.action in ("assign", "migrate"):
        verdict = await check_before_assign(business, decision)
        if not verdict.allow:
            refusal = f"business rule: {verdict.reason}"
    if not await journal.claim(decision.decision_id, owner):
        return None
    common = dict(
        action_id=action_id_for(decision.decision_id),
        decision_id=decision.decision_id,
        task_id=decision.task_id,
        action=decision.action,
        backend=backend.name,
        policy=decision.policy,
        shard_id=decision.shard_id,
        confidence=decision.confidence,
        task_kind=decision.task.kind if decision.task else "",
        gpu_model=_gpu_model(decision, business),
    )
    result: ActionResult
    if refusal:
        result = ActionFailed(**common, placement=decision.placement, error=refusal, retryable=False,
                              latency_ms=(time.perf_counter() - checked) * 1000.0, failed_at=clock())
        await journal.record(decision.decision_id, result)
        return result
    began = time.perf_counter()
    try:
        latency = await _run(decision, backend, grace_s, env or {})
        result = ActionExecuted(
            **common, placement=decision.placement, latency_ms=latency, executed_at=clock()
        )
    except BackendError as error:
        result = ActionFailed(
            **common,
            placement=decision.placement,
            error=str(error),
            retryable=error.retryable,
            latency_ms=(time.perf_counter() - began) * 1000.0,
            failed_at=clock(),
        )
    except Exception as error:  # noqa: BLE001 - a bug in a backend must not leave the claim dangling
        # Recorded as a retryable failure: the policy re-decides under a new decision_id,
        # and this decision_id is never half-executed twice.
        result = ActionFailed(
            **common,
            placement=decision.placement,
            error=f"{type(error).__name__}: {error}",
            retryable=True,
            latency_ms=(time.perf_counter() - began) * 1000.0,
            failed_at=clock(),
        )
    await journal.record(decision.decision_id, result)
    return result
